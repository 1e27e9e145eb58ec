"""Triton verification backends: `triton-packed` and `triton-decomposed` (kernels in kernels/triton_kernels.py).

Both read the runner's metadata tensors directly and launch grids sized by (num_seqs, max_query_len) alone,
so `__call__` can be captured in a CUDA graph: `plan` runs outside the graph and only writes buffers whose
storage never moves. On CPU they run in Triton's interpreter (TRITON_INTERPRET=1 before Triton is
imported): a correctness check of the kernels, not a way to run a model.
"""

from __future__ import annotations

import torch
import triton

from spind.kernels.base import Backend
from spind.kernels.decompose import DEFAULT_ROWS_PER_SEQ, max_rows_for
from spind.kernels.decomposed import decomposition_for, row_tables
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.triton_kernels import merge_rows_kernel, packed_attention_kernel, split_kv_kernel

DEFAULT_MAX_NUM_SEQS = 256  # row tables are preallocated for batches up to this many sequences


class TritonBackend(Backend):
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.block_d = triton.next_power_of_2(max(head_dim, 16))
        # GPU tiles: untuned (this was written without a GPU); small ones keep the CPU interpreter quick
        self.block_n = (64 if head_dim <= 64 else 32) if self.device.type == "cuda" else 16

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.max_q = max(meta.max_query_len, 1)
        # keys the kernels visit (tiles past a sequence's end are masked loads)
        self.num_kv_slots = sum(n for q, n in zip(meta.query_lens_cpu, meta.seq_lens_cpu) if q)
        rows = self.max_q * self.group  # folded query rows per sequence
        self.block_m = 16 if rows <= 16 or self.device.type != "cuda" else 32

    def _tile_args(self, q: torch.Tensor) -> dict:
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 models get fp32 dot products
        return dict(GROUP=self.group, HEAD_DIM=self.head_dim, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    BLOCK_D=self.block_d, PRECISION=precision)

    def _grid_m(self) -> int:
        return triton.cdiv(self.max_q * self.group, self.block_m)


class TritonPackedAttention(TritonBackend):
    """One program per (sequence, query block, KV head) over exactly the sequence's own pages."""

    name = "triton-packed"

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        meta, out = self.meta, torch.empty_like(q)
        grid = (meta.num_seqs, self._grid_m(), self.num_kv_heads)
        packed_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, meta.block_size,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), meta.block_tables.stride(0), **self._tile_args(q))
        return out


class TritonDecomposedAttention(TritonBackend):
    """Split-KV over the decomposition's rows (each row a program per query block and KV head), then a
    log-sum-exp merge per query token and head. The row grid is max_rows_for(num_seqs): the paper's fixed
    width B, so a captured graph covers every plan of its batch size; rows past the plan are empty."""

    name = "triton-decomposed"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str, *,
                 rows_per_seq: float = DEFAULT_ROWS_PER_SEQ, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.rows_per_seq, self.max_num_seqs = rows_per_seq, max_num_seqs
        # [3, max rows]: row_seq, row_start, row_len; [max_num_seqs + 1]: first row of each sequence
        self._row_tables = torch.zeros(3, max_rows_for(max_num_seqs, rows_per_seq), dtype=torch.int32,
                                       device=self.device)
        self._seq_row_start = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=self.device)

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        self.decomposition = plan = decomposition_for(meta, self.rows_per_seq)
        self.num_rows = max_rows_for(meta.num_seqs, self.rows_per_seq)
        tables = torch.zeros(3, self.num_rows, dtype=torch.int32)
        if plan.num_rows:
            tables[:, :plan.num_rows] = torch.stack(row_tables(plan, torch.device("cpu")))
        counts = torch.zeros(meta.num_seqs + 1, dtype=torch.int32)
        counts[1:].index_add_(0, tables[0, :plan.num_rows].long(), torch.ones(plan.num_rows, dtype=torch.int32))
        if meta.num_seqs <= self.max_num_seqs:  # persistent buffers: what a captured graph reads
            self.row_tables = self._row_tables[:, :self.num_rows]
            self.seq_row_start = self._seq_row_start[:meta.num_seqs + 1]
            self.row_tables.copy_(tables, non_blocking=True)
            self.seq_row_start.copy_(torch.cumsum(counts, 0, dtype=torch.int32), non_blocking=True)
        else:  # a batch past the preallocated size (eager only)
            self.row_tables = tables.to(self.device)
            self.seq_row_start = torch.cumsum(counts, 0, dtype=torch.int32).to(self.device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        meta, out, args = self.meta, torch.empty_like(q), self._tile_args(q)
        part_o = torch.empty(self.num_rows, self.max_q, self.num_heads, self.head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(self.num_rows, self.max_q, self.num_heads, dtype=torch.float32, device=q.device)
        row_seq, row_start, row_len = self.row_tables
        split_kv_kernel[(self.num_rows, self._grid_m(), self.num_kv_heads)](
            q, k_cache, v_cache, part_o, part_lse, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            row_seq, row_start, row_len, scale, meta.block_size, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), meta.block_tables.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1), **args)
        merge_rows_kernel[(meta.num_seqs, self.max_q, self.num_heads)](
            part_o, part_lse, out, meta.query_start_loc, self.seq_row_start,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), HEAD_DIM=self.head_dim, BLOCK_D=self.block_d)
        return out
