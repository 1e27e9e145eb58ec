"""`packed`: variable length, no padding to other sequences. Each sequence reads exactly its own KV blocks.

A varlen kernel (flash-attn varlen, FlashInfer) runs one program per sequence over its own pages. In torch
the same work is batched without a per-sequence loop: sequences whose KV rounds up to the same number of
KV_ALIGN-key tiles (16: one block at the default block size) and that bring the same number of new tokens
have identical shapes, so each such group is one dense SDPA call; the only masked keys are the tail of a
sequence's last tile, which a paged kernel loads as well. A plan has one group per distinct
(tiles, query length): a verify batch over Alpaca lengths has 3-8, not B.

Per layer: one gather each of all K and V slots, one SDPA per group over views of them, and the queries
folded (GQA) and put in group order once; when every sequence brings as many new tokens (a verify or a
decode batch) that is one fold for the whole batch, else one per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from spind.kernels.base import Backend
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.decompose import round_up
from spind.kernels.ops import KV_ALIGN, QueryLayout, attend_mask, fold_queries, paged_slots, unfold_queries


@dataclass(frozen=True)
class Group:
    num_seqs: int  # G
    query_len: int  # q
    kv_len: int  # L, a multiple of KV_ALIGN


def group_sequences(query_lens: tuple[int, ...], seq_lens: tuple[int, ...]) -> dict[tuple[int, int], list[int]]:
    """(KV length rounded up to KV_ALIGN, query length) -> the sequences of that shape, in batch order.
    Sequences without new tokens (CUDA-graph padding) are left out."""
    groups: dict[tuple[int, int], list[int]] = {}
    for seq, (q, n) in enumerate(zip(query_lens, seq_lens)):
        if q > 0:
            groups.setdefault((round_up(n, KV_ALIGN), q), []).append(seq)
    return dict(sorted(groups.items()))


class PackedAttention(Backend):
    name = "packed"

    def plan(self, meta: AttentionMetadata) -> None:
        device, bs = meta.seq_lens.device, meta.block_size
        self.layout = QueryLayout.of(meta)
        self.num_tokens = meta.num_tokens
        self.groups: list[Group] = []
        token_order, slots, masks = [], [], []
        starts = meta.query_start_loc.long()
        groups = group_sequences(meta.query_lens_cpu, meta.seq_lens_cpu)
        for (kv_len, q_len), seqs in groups.items():
            self.groups.append(Group(len(seqs), q_len, kv_len))
            seq = torch.tensor(seqs, device=device)
            q_idx = torch.arange(q_len, device=device).expand(len(seqs), q_len)  # [G, q]
            token_order.append((starts[seq, None] + q_idx).view(-1))
            seq_lens = meta.seq_lens.long()[seq, None]
            k_pos = torch.arange(kv_len, device=device).expand(len(seqs), kv_len)  # [G, L]
            slots.append(paged_slots(meta.block_tables[seq], k_pos, k_pos < seq_lens, bs).view(-1))
            masks.append(attend_mask(seq_lens - q_len + q_idx, q_idx >= 0, k_pos, k_pos < seq_lens, self.group,
                                     torch.float32))
        self.token_order = torch.cat(token_order)  # [owned] packed token of each grouped query row
        self.is_in_order = self.layout.num_owned == self.num_tokens and bool(
            (self.token_order == torch.arange(self.num_tokens, device=device)).all())
        self.slots = torch.cat(slots)  # [sum over groups of G * L]
        self.num_kv_slots = self.slots.numel()
        self.plan_masks(masks)
        self._plan_uniform(meta, [s for seqs in groups.values() for s in seqs])

    def _plan_uniform(self, meta: AttentionMetadata, grouped: list[int]) -> None:
        """When all sequences with new tokens bring the same number, their folded queries are one tensor:
        seq_order puts its rows (sequences, in batch order) in group order, seq_inverse back."""
        q_lens = {q for q in meta.query_lens_cpu if q}
        self.query_len = q_lens.pop() if len(q_lens) == 1 else None
        live = {seq: i for i, seq in enumerate(s for s, q in enumerate(meta.query_lens_cpu) if q)}
        order = [live[s] for s in grouped]
        self.is_sorted = order == sorted(order)
        self.seq_order = torch.tensor(order, device=meta.seq_lens.device)
        self.seq_inverse = torch.argsort(self.seq_order)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        if not self.groups:
            return torch.zeros_like(q)
        ks = self.workspace.gather("k", k_cache, self.slots).to(q.dtype)  # [sum G*L, Hkv, D] (an fp16 cache widened)
        vs = self.workspace.gather("v", v_cache, self.slots).to(q.dtype)
        if self.query_len is not None:
            return self._call_uniform(q, ks, vs, scale)
        return self._call_mixed(q, ks, vs, scale)

    def _group_views(self, ks: torch.Tensor, vs: torch.Tensor) -> Iterator[tuple[Group, torch.Tensor, torch.Tensor]]:
        """Per group: its keys and values as [G, Hkv, L, D] views."""
        s0, hkv, d = 0, self.num_kv_heads, self.head_dim
        for grp in self.groups:
            s1 = s0 + grp.num_seqs * grp.kv_len
            yield (grp, ks[s0:s1].view(grp.num_seqs, grp.kv_len, hkv, d).transpose(1, 2),
                   vs[s0:s1].view(grp.num_seqs, grp.kv_len, hkv, d).transpose(1, 2))
            s0 = s1

    def _call_uniform(self, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float) -> torch.Tensor:
        n, q_len, h, hkv, d = self.seq_order.shape[0], self.query_len, self.num_heads, self.num_kv_heads, self.head_dim
        qf = fold_queries(q[:n * q_len].view(n, q_len, h, d), hkv,
                          self.workspace.get("q", (n, hkv, self.group * q_len, d), q))  # [n, Hkv, g*q, D]
        if not self.is_sorted:
            qf = qf.index_select(0, self.seq_order)
        outs, r0 = [], 0
        for (grp, kg, vg), mask in zip(self._group_views(ks, vs), self.masks_for(q.dtype)):
            outs.append(F.scaled_dot_product_attention(qf[r0:r0 + grp.num_seqs], kg, vg, attn_mask=mask, scale=scale))
            r0 += grp.num_seqs
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        if not self.is_sorted:
            o = o.index_select(0, self.seq_inverse)
        o = unfold_queries(o, q_len).reshape(n * q_len, h, d)
        return o if n * q_len == q.shape[0] else torch.cat([o, o.new_zeros(q.shape[0] - n * q_len, h, d)])

    def _call_mixed(self, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float) -> torch.Tensor:
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qs = q if self.is_in_order else q.index_select(0, self.token_order)  # [owned, H, D], grouped
        outs, t0 = [], 0
        for (grp, kg, vg), mask in zip(self._group_views(ks, vs), self.masks_for(q.dtype)):
            t1 = t0 + grp.num_seqs * grp.query_len
            qg = fold_queries(qs[t0:t1].view(grp.num_seqs, grp.query_len, h, d), hkv)  # [G, Hkv, g*q, D]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            outs.append(unfold_queries(o, grp.query_len).reshape(-1, h, d))
            t0 = t1
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        if self.is_in_order:
            return o
        return q.new_zeros(q.shape).index_copy_(0, self.token_order, o)
