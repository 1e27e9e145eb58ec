"""Request decomposition for batched verification (the paper's §VI-A), as a pure policy: lengths in, plan out.

Padded attention runs a `[num_seqs, longest]` KV tensor: every shorter sequence is padded to the longest.
Decomposition instead lays the KV out as rows of one length `L`: a sequence of `n` keys takes
`ceil(n / L)` rows, and the tensor is `[num_rows, L]`. A sequence split over several rows has its
queries replicated into each of them, and its softmax is merged across them afterwards (split-KV with a
log-sum-exp merge), so the result is exact.

What the cost model trades:
- KV work (and memory) is `num_rows * L` slots; the padding `num_rows * L - sum(n)` is what L minimises.
- Each row costs a copy of its sequence's query rows (memory, and the merge's work per row). The paper
  bounds that by fixing the tensor's width B first: `max_rows = ceil(rows_per_seq * num_seqs)`, so at most
  `rows_per_seq` times the batch's query rows are materialised, whatever the lengths.
- Then L is searched for the least padding among the L whose rows fit in B; ties go to fewer rows.
  Padding is not monotone in L (each sequence's last row is partial), so the search is over candidates.
- L is a multiple of `align`: kernels tile keys (the CPU flash kernel vectorises them in 16s, and a
  ragged tail costs it more than padding to the next 16 does; GPU kernels load BLOCK_N keys at a time).

Which L can win: for any feasible L, with `r_i = ceil(n_i / L)` rows per sequence,
`L' = max_i up(ceil(n_i / r_i))` (up: to a multiple of align) is <= L and needs no more rows, so it pads no
more. The optimum is therefore some `up(ceil(n_i / r))`, with `r <= max_rows - num_seqs + 1` (every other
sequence takes at least one row), clamped to `up(min_row_len)`.

Rows are aligned to each sequence's end: the last row holds the newest `L` keys, so when
`L >= max query length` every new token (query) sits in its sequence's last row and every row holds at
least one key each of its queries may attend to (no row is fully masked; only the last needs a causal mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_ROWS_PER_SEQ = 2.0


@dataclass(frozen=True)
class Segment:
    """One row of the decomposed KV tensor: keys [kv_start, kv_start + kv_len) of sequence `seq`."""

    seq: int
    kv_start: int
    kv_len: int


@dataclass(frozen=True)
class DecompositionPlan:
    row_len: int  # L; 0 when no sequence has keys
    rows: tuple[Segment, ...]  # grouped by sequence, in sequence order, each sequence's rows by position
    num_pad: int  # num_rows * L - sum of lengths

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def max_rows_for(num_seqs: int, rows_per_seq: float = DEFAULT_ROWS_PER_SEQ) -> int:
    """The tensor width B for a batch: a fixed budget of rows, at least one per sequence."""
    if rows_per_seq < 1.0:
        raise ValueError(f"rows_per_seq must be >= 1, got {rows_per_seq}")
    return max(num_seqs, math.ceil(rows_per_seq * num_seqs))


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def num_rows(seq_lens: Sequence[int], row_len: int) -> int:
    return sum(-(-n // row_len) for n in seq_lens)


def num_padding(seq_lens: Sequence[int], row_len: int) -> int:
    return num_rows(seq_lens, row_len) * row_len - sum(seq_lens)


def plan_decomposition(seq_lens: Sequence[int], max_rows: int, min_row_len: int = 1,
                       align: int = 1) -> DecompositionPlan:
    """The row length L (a multiple of align, >= min_row_len) with the least padding among those needing
    <= max_rows rows.

    Sequences of length 0 (padding of a CUDA-graph bucket) take no row.
    """
    lens = np.asarray([n for n in seq_lens if n > 0], dtype=np.int64)
    if lens.size == 0:
        return DecompositionPlan(0, (), 0)
    if max_rows < lens.size:
        raise ValueError(f"{lens.size} sequences need at least {lens.size} rows, max_rows is {max_rows}")
    longest = round_up(int(lens.max()), align)
    max_split = max_rows - lens.size + 1
    candidates = -(-lens[:, None] // np.arange(1, max_split + 1)[None, :])  # ceil(n_i / r)
    candidates = -(-candidates // align) * align
    candidates = np.unique(np.maximum(np.minimum(candidates, longest), round_up(min_row_len, align)))
    rows = (-(-lens[None, :] // candidates[:, None])).sum(axis=1)  # [num_candidates]
    padding = rows * candidates - int(lens.sum())
    feasible = rows <= max_rows  # the longest candidate (one row each) always is
    best = np.lexsort((rows[feasible], padding[feasible]))[0]
    return _layout(seq_lens, int(candidates[feasible][best]))


def _layout(seq_lens: Sequence[int], row_len: int) -> DecompositionPlan:
    rows: list[Segment] = []
    for seq, n in enumerate(seq_lens):
        if n <= 0:
            continue
        first = n - (-(-n // row_len) - 1) * row_len  # the partial row comes first; the last row ends at n
        rows.append(Segment(seq, 0, first))
        rows.extend(Segment(seq, start, row_len) for start in range(first, n, row_len))
    return DecompositionPlan(row_len, tuple(rows), len(rows) * row_len - sum(n for n in seq_lens if n > 0))
