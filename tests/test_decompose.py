"""The decomposition planner (kernels/decompose.py): the L search against brute force, and the layout."""

from __future__ import annotations

import random

import pytest

from spind.kernels.decompose import (DecompositionPlan, Segment, max_rows_for, num_padding, num_rows,
                                     plan_decomposition, round_up)


def brute_force(seq_lens: list[int], max_rows: int, min_row_len: int, align: int) -> tuple[int, int, int]:
    """(padding, rows, L) minimised lexicographically over every L, multiple of align, that fits max_rows."""
    live = [n for n in seq_lens if n > 0]
    lo, hi = round_up(min_row_len, align), max(round_up(max(live), align), round_up(min_row_len, align))
    return min((num_padding(live, L), num_rows(live, L), L) for L in range(lo, hi + 1, align)
               if num_rows(live, L) <= max_rows)


def check_layout(plan: DecompositionPlan, seq_lens: list[int], min_row_len: int) -> None:
    """Every sequence's keys covered once, in order, by rows of <= L keys; its last row ends at its length."""
    for seq, n in enumerate(seq_lens):
        rows = [r for r in plan.rows if r.seq == seq]
        if n == 0:
            assert rows == []
            continue
        assert rows[0].kv_start == 0 and rows[-1].kv_start + rows[-1].kv_len == n
        assert all(a.kv_start + a.kv_len == b.kv_start for a, b in zip(rows, rows[1:]))
        assert all(0 < r.kv_len <= plan.row_len for r in rows)
        assert all(r.kv_len == plan.row_len for r in rows[1:])  # only the first row is partial
        assert rows[-1].kv_len >= min(n, min_row_len)  # the newest min_row_len keys (the queries) share a row
    assert [r.seq for r in plan.rows] == sorted(r.seq for r in plan.rows)
    assert plan.num_pad == plan.num_rows * plan.row_len - sum(seq_lens)


@pytest.mark.parametrize("align", [1, 16])
def test_search_matches_brute_force_on_random_batches(align: int) -> None:
    rng = random.Random(align)
    for _ in range(300):
        batch = rng.randint(1, 12)
        lens = [rng.choice([1, rng.randint(1, 40), rng.randint(30, 90), rng.randint(200, 900)]) for _ in range(batch)]
        max_rows = rng.randint(batch, 3 * batch)
        min_row_len = rng.choice([1, 5, 9])
        plan = plan_decomposition(lens, max_rows, min_row_len, align)
        padding, rows, row_len = brute_force(lens, max_rows, min_row_len, align)
        assert (plan.num_pad, plan.num_rows, plan.row_len) == (padding, rows, row_len), (lens, max_rows)
        assert plan.num_rows <= max_rows and plan.row_len % align == 0
        check_layout(plan, lens, min_row_len)


def test_a_long_request_is_split_so_short_ones_need_no_padding() -> None:
    """The paper's picture: one request as long as three others together is split into rows like theirs."""
    plan = plan_decomposition([12, 4, 4, 4], max_rows=6)
    assert (plan.row_len, plan.num_rows, plan.num_pad) == (4, 6, 0)
    assert plan.rows[:3] == (Segment(0, 0, 4), Segment(0, 4, 4), Segment(0, 8, 4))
    assert num_padding([12, 4, 4, 4], 12) == 24  # what padding to the longest costs


def test_padding_is_not_monotone_in_row_length() -> None:
    """Why L is searched over candidates: here L = 10 pads nothing, L = 11 and L = 9 both pad."""
    lens = [20, 10, 30]
    assert num_padding(lens, 10) == 0 and num_padding(lens, 11) > 0 and num_padding(lens, 9) > 0
    assert plan_decomposition(lens, max_rows=6).row_len == 10


def test_ties_go_to_fewer_rows_and_a_single_sequence_is_never_split() -> None:
    assert plan_decomposition([48], max_rows=2).rows == (Segment(0, 0, 48),)
    assert plan_decomposition([16, 32], max_rows=4, align=16).row_len == 16  # 3 rows, no padding
    assert plan_decomposition([16, 32], max_rows=2, align=16).row_len == 32  # 2 rows allowed: pad 16


def test_row_budget_and_min_row_len_bound_the_split() -> None:
    lens = [1000, 40, 40, 40]
    assert plan_decomposition(lens, max_rows=4).row_len == 1000  # no spare row: the padded layout
    assert plan_decomposition(lens, max_rows=8).num_rows <= 8
    assert plan_decomposition(lens, max_rows=100).row_len == 40
    assert plan_decomposition(lens, max_rows=100, min_row_len=64).row_len >= 64


def test_empty_sequences_take_no_row_and_too_few_rows_is_an_error() -> None:
    plan = plan_decomposition([0, 30, 0, 7], max_rows=4)
    assert {r.seq for r in plan.rows} == {1, 3}
    assert plan_decomposition([0, 0], max_rows=2) == DecompositionPlan(0, (), 0)
    with pytest.raises(ValueError, match="at least 3 rows"):
        plan_decomposition([5, 6, 7], max_rows=2)


def test_max_rows_is_a_fixed_factor_of_the_batch() -> None:
    assert [max_rows_for(b) for b in (1, 2, 16)] == [2, 4, 32]
    assert max_rows_for(5, 1.5) == 8 and max_rows_for(3, 1.0) == 3
    with pytest.raises(ValueError):
        max_rows_for(4, 0.5)
