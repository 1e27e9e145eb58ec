"""For tests and benches: random paged batches, and the plainest per-sequence reference of attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spind.kernels.metadata import AttentionMetadata, build_metadata


@dataclass(frozen=True)
class PagedCase:
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor


def make_paged_case(query_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", unwritten: float = float("nan")) -> PagedCase:
    """Random q and caches; each sequence's blocks are scattered over the pool in shuffled order. Slots no
    sequence owns hold `unwritten` (NaN by default: a backend that reads them without masking fails),
    except block 0, which the KV cache zeroes and keeps out of every table here."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays unowned
    tables, offset = [], 0
    for nb in blocks:
        tables.append(perm[offset:offset + nb])
        offset += nb
    meta = build_metadata(query_lens, seq_lens, tables, block_size, device)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k = torch.full(shape, unwritten, dtype=dtype)
    v = torch.full(shape, unwritten, dtype=dtype)
    k[:block_size], v[:block_size] = 0.0, 0.0
    for table, n in zip(tables, seq_lens):
        pos = torch.arange(n)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        k[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(meta, q.to(device), k.to(device), v.to(device))


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Per sequence, per query head, in fp64: softmax over the keys at positions <= the query's. [T, H, D]"""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    tables, bs = meta.block_tables.long().cpu(), meta.block_size
    for b, (q_len, n) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start = int(meta.query_start_loc[b])
        pos = torch.arange(n)
        slots = (tables[b, pos // bs] * bs + pos % bs).to(q.device)
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        for i in range(q_len):
            visible = n - q_len + i + 1
            s = torch.einsum("hd,nhd->hn", q[start + i].double(), k[:visible]) * scale
            out[start + i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v[:visible])
    return out.to(q.dtype)
