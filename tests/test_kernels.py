"""The torch verification backends (padded, decomposed, packed) against a per-sequence fp64 reference.

Unwritten cache slots hold NaN (kernels/testing.py): a backend that reads past a sequence's keys without
masking them, or masks by multiplying, fails these tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spind.config import ATTENTION_BACKENDS
from spind.kernels.attention import BACKENDS, TORCH_BACKENDS, get_backend
from spind.kernels.decomposed import DecomposedAttention
from spind.kernels.metadata import build_metadata
from spind.kernels.ops import attention_with_lse, attention_with_lse_math, merge_rows
from spind.kernels.testing import make_paged_case, reference_attention

FP32_ATOL = 2e-5  # observed <= 1e-6 against the fp64 reference
# every mode that runs on a CPU without Triton (`invariant` runs spind's C++ kernel, or `packed` where it cannot build)
CPU_BACKENDS = (*TORCH_BACKENDS, "invariant")

# (query lengths, KV lengths): new tokens are each sequence's last query_len positions
BATCHES = {
    "mixed": ([1, 5, 1, 9, 64], [1, 40, 700, 9, 300]),  # decode, verify, prefill rows; a length-1 request
    "verify-ragged": ([5] * 7, [5, 47, 33, 130, 61, 9, 52]),
    "very-long": ([5, 5, 5], [2000, 12, 40]),
    "decode-only": ([1] * 6, [1, 16, 17, 33, 260, 48]),
    "decode-equal": ([1] * 3, [32, 32, 32]),
    "single": ([3], [3]),
}
HEADS = {"gqa-9:3": (9, 3, 64), "gqa-8:2": (8, 2, 32), "mha-4:4": (4, 4, 16)}


def run_backend(name: str, case, scale: float, **options) -> torch.Tensor:
    h, hkv, d = case.q.shape[1], case.k_cache.shape[1], case.q.shape[2]
    backend = get_backend(name)(h, hkv, d, "cpu", **options)
    backend.plan(case.meta)
    return backend(case.q, case.k_cache, case.v_cache, scale)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("heads", HEADS)
def test_backend_matches_the_per_sequence_reference(name: str, batch: str, heads: str) -> None:
    (q_lens, seq_lens), (h, hkv, d) = BATCHES[batch], HEADS[heads]
    case = make_paged_case(q_lens, seq_lens, h, hkv, d, block_size=16, seed=len(batch))
    out = run_backend(name, case, d ** -0.5)
    torch.testing.assert_close(out, reference_attention(case.q, case.k_cache, case.v_cache, case.meta, d ** -0.5),
                               atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_backends_follow_the_block_table_at_any_block_size(name: str, block_size: int) -> None:
    q_lens, seq_lens = BATCHES["mixed"]
    case = make_paged_case(q_lens, seq_lens, 9, 3, 64, block_size=block_size, seed=block_size)
    torch.testing.assert_close(run_backend(name, case, 0.125),
                               reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125),
                               atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rows_per_seq", [1.5, 2.0, 4.0])
def test_decomposed_is_exact_whenever_it_splits(batch: str, rows_per_seq: float) -> None:
    """min_saving 0: every plan that saves any padding is taken, so the merge runs on most batches."""
    case = make_paged_case(*BATCHES[batch], 9, 3, 64, seed=3)
    out = run_backend("decomposed", case, 0.125, rows_per_seq=rows_per_seq, min_saving=0.0)
    torch.testing.assert_close(out, reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125),
                               atol=FP32_ATOL, rtol=0)


def test_decomposed_splits_only_when_it_saves_enough() -> None:
    case = make_paged_case([5, 5, 5], [60, 60, 90], 9, 3, 64)
    eager_split, cautious = DecomposedAttention(9, 3, 64, "cpu", min_saving=0.0), DecomposedAttention(9, 3, 64, "cpu")
    eager_split.plan(case.meta)
    cautious.plan(case.meta)
    assert (eager_split.decomposition.num_rows, eager_split.num_kv_slots) == (4, 4 * 64)  # 11% fewer slots ...
    assert (cautious.decomposition.num_rows, cautious.num_kv_slots) == (3, 3 * 96)  # ... not worth a merge
    torch.testing.assert_close(cautious(case.q, case.k_cache, case.v_cache, 0.125),
                               eager_split(case.q, case.k_cache, case.v_cache, 0.125), atol=FP32_ATOL, rtol=0)


def test_decomposed_splits_the_long_request_of_a_ragged_batch() -> None:
    """The plan actually decomposes here (so the parity tests exercise the merge): a 2000-key request next
    to short ones becomes several rows, and the KV tensor is a fraction of the padded one."""
    case = make_paged_case(*BATCHES["very-long"], 9, 3, 64)
    backend = DecomposedAttention(9, 3, 64, "cpu")
    backend.plan(case.meta)
    plan = backend.decomposition
    assert (plan.num_rows, plan.row_len) == (6, 512) and sum(r.seq == 0 for r in plan.rows) == 4
    assert plan.num_rows * plan.row_len == 3072  # keys computed; padding to the longest computes 3 x 2000


def test_bfloat16_backends_agree_with_the_reference() -> None:
    q_lens, seq_lens = BATCHES["mixed"]
    case = make_paged_case(q_lens, seq_lens, 9, 3, 64, dtype=torch.bfloat16, seed=7)
    ref = reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125).float()
    for name in CPU_BACKENDS:
        torch.testing.assert_close(run_backend(name, case, 0.125).float(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("q_lens", [(5, 1), (3, 3)])
def test_tokens_owned_by_no_sequence_and_empty_sequences_are_ignored(q_lens: tuple[int, int]) -> None:
    """A CUDA-graph bucket pads a batch with empty sequences and with tokens no sequence owns."""
    real = make_paged_case(list(q_lens), [30, 70], 9, 3, 64, seed=2)
    ref = reference_attention(real.q, real.k_cache, real.v_cache, real.meta, 0.125)
    m = real.meta
    tables = m.block_tables.tolist() + [[0] * m.block_tables.shape[1]] * 2
    padded = build_metadata((*q_lens, 0, 0), (30, 70, 0, 0), tables, m.block_size)
    padded = dataclasses.replace(padded, num_tokens=m.num_tokens + 4)  # four trailing tokens of no sequence
    q = torch.cat([real.q, torch.randn(4, 9, 64)])
    for name in CPU_BACKENDS:
        backend = get_backend(name)(9, 3, 64, "cpu")
        backend.plan(padded)
        out = backend(q, real.k_cache, real.v_cache, 0.125)
        assert out.shape == q.shape
        torch.testing.assert_close(out[:m.num_tokens], ref, atol=FP32_ATOL, rtol=0)


def test_attention_with_lse_fused_equals_math_and_merge_is_exact() -> None:
    """Splitting keys into two halves and merging by log-sum-exp gives attention over all keys."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 15, 64, generator=gen), torch.randn(2, 3, 80, 64, generator=gen),
               torch.randn(2, 3, 80, 64, generator=gen))
    mask = torch.zeros(2, 1, 15, 80)
    mask[:, :, 5:, 70:] = float("-inf")
    fused, fused_lse = attention_with_lse(q, k, v, mask, 0.125)
    math, math_lse = attention_with_lse_math(q, k, v, mask, 0.125)
    torch.testing.assert_close(fused, math, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused_lse, math_lse, atol=1e-5, rtol=0)
    halves = [attention_with_lse(q, k[..., s, :], v[..., s, :], mask[..., s], 0.125)
              for s in (slice(0, 37), slice(37, 80))]
    merged = merge_rows(torch.cat([o for o, _ in halves]), torch.cat([lse for _, lse in halves]),
                        torch.tensor([0, 1, 0, 1]), 2)
    torch.testing.assert_close(merged, fused, atol=1e-5, rtol=0)


def test_registry_knows_every_configurable_mode_and_names_them_on_error() -> None:
    assert set(BACKENDS) == set(ATTENTION_BACKENDS)
    for name in CPU_BACKENDS:
        assert get_backend(name).name == name
    with pytest.raises(ValueError, match="packed.*triton-decomposed"):
        get_backend("flash")


def test_build_metadata_lays_out_tokens_and_slots() -> None:
    meta = build_metadata([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.num_tokens == 3
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]  # positions 3, 4 of seq 0; 2 of seq 1
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]] and not meta.is_decode_only
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_metadata([1], [5], [[1]], block_size=4)
