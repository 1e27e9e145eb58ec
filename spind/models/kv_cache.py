"""Paged KV cache: fixed-size blocks in one preallocated pool per model.

Layout: `k[layer]`, `v[layer]` are `[num_blocks * block_size, num_kv_heads, head_dim]` (flat slots), so a
token's KV lives at slot `block_table[pos // block_size] * block_size + pos % block_size`. Blocks make the
memory budget exact (admission asks `can_allocate`), rollback cheap (truncate frees whole trailing blocks),
and give the verification modes their unit: `packed` gathers each request's slots, `padded` pads them to
the batch's longest, and a decomposed plan (paper §VI-A) splits a long request at block boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCacheFullError(RuntimeError):
    """Not enough free blocks; the scheduler should have asked `can_allocate` first."""


@dataclass
class SeqKV:
    block_table: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages are only committed as blocks get used. Slot 0 is what padded attention
        # reads for padding (masked out), so it must at least hold finite numbers.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k + self.v:
            t[:block_size].zero_()
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.seqs: dict[str, SeqKV] = {}

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def length(self, req_id: str) -> int:
        seq = self.seqs.get(req_id)
        return seq.length if seq else 0

    def has(self, req_id: str) -> bool:
        return req_id in self.seqs

    # ---- lifecycle --------------------------------------------------------------------------
    def allocate(self, req_id: str) -> None:
        if req_id in self.seqs:
            raise KeyError(f"request {req_id!r} already has KV")
        self.seqs[req_id] = SeqKV()

    def reserve(self, req_id: str, new_length: int) -> None:
        """Grow the block table so that positions < new_length have slots."""
        seq = self.seqs[req_id]
        need = self.blocks_for(new_length) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise KVCacheFullError(f"KV cache full: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            seq.block_table.append(self._free_blocks.pop())

    def truncate(self, req_id: str, length: int) -> None:
        """Forget KV at positions >= length (rolled-back drafts); frees whole trailing blocks."""
        seq = self.seqs[req_id]
        if length > seq.length:
            raise ValueError(f"truncate to {length} > length {seq.length}")
        seq.length = length
        keep = self.blocks_for(length)
        while len(seq.block_table) > keep:
            self._free_blocks.append(seq.block_table.pop())

    def free(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self._free_blocks.extend(reversed(seq.block_table))

    # ---- slots ------------------------------------------------------------------------------
    def slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) of a request. # [end - start]"""
        table = torch.tensor(self.seqs[req_id].block_table, dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
