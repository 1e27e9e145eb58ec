"""`decomposed`: Spin's fast batch verification (§VI-A). The KV is laid out as `[num_rows, L]` rows from
`plan_decomposition` (kernels/decompose.py): long sequences are split into several rows so that short
ones need little padding. Each row carries a copy of its sequence's (folded) queries; one SDPA over all
rows returns outputs and log-sum-exps, and a sequence's rows are merged into its exact softmax.

When the plan splits nothing (L = the longest sequence), this is `padded` and skips the merge. Splitting
has a price of its own, the replicated queries and the merge (about 15% of the attention step at batch 16
on this CPU), so a plan that saves less than `min_saving` of the KV slots is not taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spind.kernels.base import Backend
from spind.kernels.decompose import DEFAULT_ROWS_PER_SEQ, DecompositionPlan, max_rows_for, plan_decomposition
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.ops import (KV_ALIGN, QueryLayout, attend_mask, attention_with_lse, fold_queries, gather_queries,
                               merge_rows, paged_slots, scatter_outputs, unfold_queries)

DEFAULT_MIN_SAVING = 0.15


def decomposition_for(meta: AttentionMetadata, rows_per_seq: float, min_saving: float = 0.0) -> DecompositionPlan:
    """The plan of one forward: B = ceil(rows_per_seq * num_seqs) rows at most, L a multiple of KV_ALIGN and
    >= the longest query block (so each sequence's new tokens share its last row); one row per sequence
    unless that saves at least `min_saving` of the KV slots. Sequences without new tokens take no row."""
    lens = [n if q else 0 for q, n in zip(meta.query_lens_cpu, meta.seq_lens_cpu)]
    plan = plan_decomposition(lens, max_rows_for(meta.num_seqs, rows_per_seq), meta.max_query_len, KV_ALIGN)
    unsplit = plan_decomposition(lens, sum(n > 0 for n in lens), meta.max_query_len, KV_ALIGN)
    if plan.num_rows * plan.row_len > (1.0 - min_saving) * unsplit.num_rows * unsplit.row_len:
        return unsplit
    return plan


def row_tables(plan: DecompositionPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_seq, kv_start, kv_len: [num_rows] int32 each."""
    table = torch.tensor([(r.seq, r.kv_start, r.kv_len) for r in plan.rows], dtype=torch.int32).view(-1, 3)
    return tuple(table.t().contiguous().to(device))


class DecomposedAttention(Backend):
    name = "decomposed"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str, *,
                 rows_per_seq: float = DEFAULT_ROWS_PER_SEQ, min_saving: float = DEFAULT_MIN_SAVING) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.rows_per_seq, self.min_saving = rows_per_seq, min_saving

    def plan(self, meta: AttentionMetadata) -> None:
        self.decomposition = plan = decomposition_for(meta, self.rows_per_seq, self.min_saving)
        b, max_q, rows, row_len = meta.num_seqs, max(meta.max_query_len, 1), plan.num_rows, max(plan.row_len, 1)
        device = meta.seq_lens.device
        self.shape, self.num_kv_slots = (b, max_q, rows, row_len), rows * row_len
        self.layout = QueryLayout.of(meta)
        self.query_rows = self.layout.padded_rows(max_q)
        row_seq, kv_start, kv_len = (t.long() for t in row_tables(plan, device))
        self.row_seq = row_seq
        self.is_one_row_per_seq = rows == b and bool((row_seq == torch.arange(b, device=device)).all())
        j = torch.arange(row_len, device=device).expand(rows, row_len)  # [R, L]
        k_pos, k_valid = kv_start[:, None] + j, j < kv_len[:, None]
        self.slots = paged_slots(meta.block_tables[row_seq], k_pos, k_valid, meta.block_size).view(-1)  # [R * L]
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()[row_seq, None]
        q_idx = torch.arange(max_q, device=device).expand(rows, max_q)  # [R, max_q]
        q_pos = meta.seq_lens.long()[row_seq, None] - q_lens + q_idx
        self.plan_masks([attend_mask(q_pos, q_idx < q_lens, k_pos, k_valid, self.group, torch.float32)])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        (b, max_q, rows, row_len), h, hkv, d = self.shape, self.num_heads, self.num_kv_heads, self.head_dim
        qp = gather_queries(q, self.layout, self.query_rows, b * max_q).view(b, max_q, h, d)
        qr = fold_queries(qp, hkv, self.workspace.get("q", (b, hkv, self.group * max_q, d), q))  # [B, Hkv, g*max_q, D]
        if not self.is_one_row_per_seq:  # [R, Hkv, g*max_q, D]: queries replicated per row
            qr = torch.index_select(qr, 0, self.row_seq, out=self.workspace.get("q_rows", (rows, *qr.shape[1:]), q))
        # [R, Hkv, L, D] views of the gathered keys and values
        kr = self.workspace.gather("k", k_cache, self.slots).to(q.dtype).view(rows, row_len, hkv, d).transpose(1, 2)
        vr = self.workspace.gather("v", v_cache, self.slots).to(q.dtype).view(rows, row_len, hkv, d).transpose(1, 2)
        mask = self.masks_for(q.dtype)[0]
        if self.is_one_row_per_seq:
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
        else:
            o, lse = attention_with_lse(qr, kr, vr, mask, scale)
            o = merge_rows(o, lse, self.row_seq, b)  # [B, Hkv, g*max_q, D]
        o = unfold_queries(o, max_q).reshape(b * max_q, h, d)
        return scatter_outputs(o, self.layout, self.query_rows, q.shape[0])
