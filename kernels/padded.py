"""`padded`: the baseline. Every sequence's KV is padded to the batch's longest (rounded up to KV_ALIGN),
its queries to the longest query block, and one batched SDPA runs over
`[num_seqs, Hkv, g * max_query_len, max_seq_len]`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spind.kernels.base import Backend
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.decompose import round_up
from spind.kernels.ops import (KV_ALIGN, QueryLayout, attend_mask, fold_queries, gather_queries, paged_slots,
                               scatter_outputs, unfold_queries)


class PaddedAttention(Backend):
    name = "padded"

    def plan(self, meta: AttentionMetadata) -> None:
        b, max_q, max_len = meta.num_seqs, max(meta.max_query_len, 1), round_up(max(meta.max_seq_len, 1), KV_ALIGN)
        device = meta.seq_lens.device
        self.meta, self.shape, self.layout = meta, (b, max_q, max_len), QueryLayout.of(meta)
        self.num_kv_slots = b * max_len
        self.query_rows = self.layout.padded_rows(max_q)
        seq_lens = meta.seq_lens.long()[:, None]
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()[:, None]
        k_pos = torch.arange(max_len, device=device).expand(b, max_len)  # [B, L]
        q_idx = torch.arange(max_q, device=device).expand(b, max_q)  # [B, max_q]
        self.slots = paged_slots(meta.block_tables, k_pos, k_pos < seq_lens, meta.block_size).view(-1)  # [B * L]
        self.plan_masks([attend_mask(seq_lens - q_lens + q_idx, q_idx < q_lens, k_pos, k_pos < seq_lens,
                                     self.group, torch.float32)])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        (b, max_q, max_len), hkv, d = self.shape, self.num_kv_heads, self.head_dim
        qp = gather_queries(q, self.layout, self.query_rows, b * max_q).view(b, max_q, self.num_heads, d)
        # [B, Hkv, L, D] views of the gathered keys and values
        kp = self.workspace.gather("k", k_cache, self.slots).to(q.dtype).view(b, max_len, hkv, d).transpose(1, 2)
        vp = self.workspace.gather("v", v_cache, self.slots).to(q.dtype).view(b, max_len, hkv, d).transpose(1, 2)
        qf = fold_queries(qp, hkv, self.workspace.get("q", (b, hkv, self.group * max_q, d), q))
        o = F.scaled_dot_product_attention(qf, kp, vp, attn_mask=self.masks_for(q.dtype)[0], scale=scale)
        o = unfold_queries(o, max_q).reshape(b * max_q, self.num_heads, d)
        return scatter_outputs(o, self.layout, self.query_rows, q.shape[0])
