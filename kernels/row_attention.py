"""`invariant` attention backend: spind's CPU kernel that computes each query row on its own.

Same numbers as `packed` up to fp32 rounding, but a row's output is bit-identical whatever else shares the
forward (one decode row, a (k+1)-row verify, a prefill, other requests): with the quantized target's
batch-invariant GEMMs this makes greedy speculative output equal plain decoding exactly. It reads K/V in
place from the paged cache through each sequence's block table instead of gathering its context. fp32 CPU
queries over an fp32 or fp16 cache; anything else, or a machine without the kernels (kernels/cpu_ext.py), runs
`packed` instead.
"""

from __future__ import annotations

import logging

import torch

from spind.kernels import cpu_ext
from spind.kernels.base import Backend
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.ops import paged_slots
from spind.kernels.packed import PackedAttention

log = logging.getLogger(__name__)


def context_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cache slots of positions 0 .. seq_len - 1, packed ([sum of seq_lens] int64), and where
    each sequence's run starts ([B] int64): the kernel's view of the block tables. The reference of the kernels'
    `context_slots` op, which the backend plans with."""
    seq_lens = meta.seq_lens.long().cpu()
    width = max(meta.max_seq_len, 1)
    pos = torch.arange(width).expand(meta.num_seqs, width)
    valid = pos < seq_lens[:, None]
    slots = paged_slots(meta.block_tables.cpu(), pos, valid, meta.block_size)[valid].contiguous()
    start = torch.zeros(meta.num_seqs, dtype=torch.long)
    if meta.num_seqs > 1:
        torch.cumsum(seq_lens[:-1], 0, out=start[1:])
    return slots, start


class RowInvariantAttention(Backend):
    name = "invariant"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.ops = cpu_ext.ops() if self.device.type == "cpu" and cpu_ext.available() else None
        if self.ops is not None and not cpu_ext.row_attention_supports(head_dim):
            log.warning("invariant attention: the %s kernel takes no head dim %d; this model attends with `packed` "
                        "(not batch-invariant: speculative output may differ from plain decoding)",
                        cpu_ext.best_isa(), head_dim)
            self.ops = None
        self.fallback = PackedAttention(num_heads, num_kv_heads, head_dim, device)
        self._meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta, self._fallback_planned = meta, False
        self.num_owned = sum(meta.query_lens_cpu)  # trailing tokens of no sequence (CUDA-graph padding) get zeros
        if self.ops is not None:
            self.slots, self.slot_start = self.ops.context_slots(meta.block_tables.contiguous(),
                                                                 meta.seq_lens.contiguous(), meta.block_size)
            self.cu_q = meta.query_start_loc.long().contiguous()
            self.ctx_lens = meta.seq_lens.long().contiguous()

    def kernel_plan(self) -> tuple[torch.Tensor, ...] | None:
        """This forward's arguments of the kernel (slots, slot_start, cu_q, ctx_lens) for callers that run it from
        C++ (spind/models/fused.py `FusedStack`); None when a forward of fp32 CPU tensors would not use it."""
        if self.ops is None or self._meta is None or self.num_owned != self._meta.num_tokens:
            return None
        return self.slots, self.slot_start, self.cu_q, self.ctx_lens

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D]
        if (self.ops is not None and q.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.float16)
                and q.device.type == "cpu"):
            owned = q[:self.num_owned].contiguous()
            out = self.ops.row_attention(owned, k_cache, v_cache, self.slots, self.slot_start, self.cu_q,
                                         self.ctx_lens, scale)
            return out if self.num_owned == q.shape[0] else torch.cat([out, q.new_zeros(q.shape[0] - self.num_owned,
                                                                                          *q.shape[1:])])
        if not self._fallback_planned:
            self.fallback.plan(self._meta)
            self._fallback_planned = True
        return self.fallback(q, k_cache, v_cache, scale)
