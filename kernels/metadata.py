"""The attention layout of one forward, as tensors: what every backend (torch reference, Triton, CUDA graph)
reads, built once per forward by the model runner and shared by every layer.

Tokens of all sequences are packed along one dimension: sequence b owns rows
`[query_start_loc[b], query_start_loc[b + 1])` of q, and its i-th new token sits at position
`seq_lens[b] - query_len[b] + i`. It attends (causally) to the keys at positions `0 .. that position`,
which live in the paged KV cache: position p of sequence b is flat slot
`block_tables[b, p // block_size] * block_size + p % block_size` of the per-layer caches
`k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim]`. The new tokens' K/V are written at
`slot_mapping` before attention runs, so a sequence's context includes them.

The tensors are views into buffers the runner preallocates at fixed capacity (max batch, max tokens,
max blocks per sequence), so their storage never moves: what CUDA-graph capture needs. The `*_cpu` tuples
are host copies for planners that size their work on the host (padding, decomposition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    num_seqs: int  # B
    num_tokens: int  # T = sum of query lengths
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence including this forward's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32; entries past a sequence's blocks are 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new token's K/V is written to
    block_size: int
    query_lens_cpu: tuple[int, ...]  # [B]
    seq_lens_cpu: tuple[int, ...]  # [B]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one new token (plain decoding)."""
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """One verification-attention mode. Built once per model runner with the model's shapes
    (`cls(num_heads, num_kv_heads, head_dim, device)`), `plan`ned once per forward, called once per layer."""

    name: str

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare whatever this mode needs for the forward described by `meta` (index maps, padding,
        a decomposition plan), shared by all layers."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; caches: [slots, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""


def build_metadata(query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                   block_size: int, device: torch.device | str = "cpu",
                   max_blocks_per_seq: int | None = None) -> AttentionMetadata:
    """Fresh metadata tensors from per-sequence lists (tests, benches; the runner stages its own buffers).

    Sequence b's new tokens are its last `query_lens[b]` positions; its blocks are `block_tables[b]`.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
    for q, n, table in zip(query_lens, seq_lens, block_tables):
        if not 0 <= q <= n or len(table) * block_size < n:
            raise ValueError(f"sequence with {q} new tokens of {n} needs {-(-n // block_size)} blocks, "
                             f"has {len(table)}")
    width = max_blocks_per_seq or max((len(t) for t in block_tables), default=0) or 1
    tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for b, table in enumerate(block_tables):
        tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [table[p // block_size] * block_size + p % block_size
             for q, n, table in zip(query_lens, seq_lens, block_tables) for p in range(n - q, n)]
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=cu[1:])
    return AttentionMetadata(
        num_seqs=len(query_lens), num_tokens=int(cu[-1]), query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
        query_lens_cpu=tuple(int(q) for q in query_lens), seq_lens_cpu=tuple(int(n) for n in seq_lens))
