"""Attention over a paged KV cache for a batch of requests with different query and context lengths.

Each backend is the torch reference of one verification mode of the paper (§VI-A):
- `packed`:  no padding at all; each request attends over exactly its own slots (varlen).
- `padded`:  the baseline; every request's KV is padded to the batch's longest and one batched call runs.
Both give the same numbers (tests check it); a decomposed mode and GPU kernels register here as well.

A backend is built once per forward (`prepare`, shared by all layers) and then called per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Per-forward layout, shared by every layer.

    Tokens of all requests are packed: request i owns rows [cu_q[i], cu_q[i+1]) of the token dimension.
    Its new tokens sit at positions ctx_lens[i] - q_lens[i] ... ctx_lens[i] - 1.
    """

    q_lens: list[int]
    ctx_lens: list[int]
    write_slots: torch.Tensor  # [T] cache slot of each new token
    read_slots: list[torch.Tensor]  # per request: [ctx_len] slots of positions 0..ctx_len-1

    @property
    def cu_q(self) -> list[int]:
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor | None:
    """[q_len, ctx_len] bool, True = may attend. None when every query sees every key."""
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [Hkv, g*n, D]: the g query heads sharing a KV head become extra query rows, so attention
    runs as plain multi-head attention over the unexpanded KV (no repeat of K/V, the fused kernel applies)."""
    n, h, d = q.shape
    g = h // num_kv_heads
    return q.view(n, num_kv_heads, g, d).permute(1, 2, 0, 3).reshape(num_kv_heads, g * n, d)


def unfold_gqa(o: torch.Tensor, n: int, num_heads: int) -> torch.Tensor:
    """Inverse of fold_gqa: [Hkv, g*n, D] -> [n, H, D]."""
    hkv, _, d = o.shape
    return o.view(hkv, num_heads // hkv, n, d).permute(2, 0, 1, 3).reshape(n, num_heads, d)


class PackedAttention:
    name = "packed"

    def __init__(self, batch: AttentionBatch, device) -> None:
        self.batch = batch
        self.masks = [_causal_mask(q, c, device) for q, c in zip(batch.q_lens, batch.ctx_lens)]
        self.cu_q = batch.cu_q

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> out [T, H, D]
        t, h, d = q.shape
        hkv = k_cache.shape[1]
        g = h // hkv
        out = torch.empty_like(q)
        for i, slots in enumerate(self.batch.read_slots):
            lo, hi = self.cu_q[i], self.cu_q[i + 1]
            n = hi - lo
            qi = fold_gqa(q[lo:hi], hkv)  # [Hkv, g*n, D]
            ki = k_cache.index_select(0, slots).transpose(0, 1)  # [Hkv, ctx, D]
            vi = v_cache.index_select(0, slots).transpose(0, 1)
            mask = None if self.masks[i] is None else self.masks[i].repeat(g, 1)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[lo:hi] = unfold_gqa(oi, n, h)
        return out


class PaddedAttention:
    name = "padded"

    def __init__(self, batch: AttentionBatch, device) -> None:
        b = len(batch.q_lens)
        self.max_q, self.max_ctx = max(batch.q_lens), max(batch.ctx_lens)
        slots = torch.zeros(b, self.max_ctx, dtype=torch.long, device=device)  # pads read slot 0
        mask = torch.zeros(b, 1, self.max_q, self.max_ctx, dtype=torch.bool, device=device)
        # packed token row -> (request, row in the padded query block)
        q_index = []
        for i, (ql, cl) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
            slots[i, :cl] = batch.read_slots[i]
            m = _causal_mask(ql, cl, device)
            mask[i, 0, :ql, :cl] = True if m is None else m
            mask[i, 0, ql:, 0] = True  # padded query rows: attend to something, output discarded
            q_index.extend(i * self.max_q + j for j in range(ql))
        self.slots, self.mask = slots.view(-1), mask
        self.q_index = torch.tensor(q_index, dtype=torch.long, device=device)
        self.b = b

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        t, h, d = q.shape
        qp = q.new_zeros(self.b * self.max_q, h, d).index_copy_(0, self.q_index, q)
        hkv = k_cache.shape[1]
        g = h // hkv
        # [B, maxq, Hkv, g, D] -> [B, Hkv, g*maxq, D] (GQA folded into query rows, as in fold_gqa)
        qp = qp.view(self.b, self.max_q, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(self.b, hkv, g * self.max_q, d)
        kp = k_cache.index_select(0, self.slots).view(self.b, self.max_ctx, hkv, d).transpose(1, 2)
        vp = v_cache.index_select(0, self.slots).view(self.b, self.max_ctx, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.mask.repeat(1, 1, g, 1), scale=scale)
        o = o.view(self.b, hkv, g, self.max_q, d).permute(0, 3, 1, 2, 4)  # [B, maxq, Hkv, g, D]
        return o.reshape(self.b * self.max_q, h, d).index_select(0, self.q_index)


BACKENDS = {"packed": PackedAttention, "padded": PaddedAttention}


def get_backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None
