"""Torch building blocks shared by the reference backends: query layout, GQA folding, masks, attention
that also returns its log-sum-exp, and the merge of split-KV partial results.

GQA is folded into query rows: the g query heads that share a KV head become g blocks of query rows, so
SDPA runs as plain multi-head attention over unexpanded KV (2.6x cheaper than `enable_gqa` on CPU).
Folded rows are head-major: row `j * q_len + i` is query head `kv_head * g + j` of token i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spind.kernels.metadata import AttentionMetadata

# KV rows are padded to a multiple of 16 keys: the CPU flash kernel vectorises keys in 16s and a ragged tail
# costs it more than the padding (measured, [16, 3, 15, L] fp32: 336 us at L = 75, 278 us at L = 80).
KV_ALIGN = 16


@dataclass(frozen=True)
class QueryLayout:
    """Where each sequence's new tokens sit, on the metadata's device (computed once per forward)."""

    num_owned: int  # sum of query lengths; tokens past it (CUDA-graph bucket padding) belong to no sequence
    is_uniform: bool  # every token is owned and every sequence brings as many: no query padding needed
    seq_of_token: torch.Tensor  # [num_owned] int64
    index_in_seq: torch.Tensor  # [num_owned] int64, 0 .. query_len - 1

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "QueryLayout":
        device = meta.query_start_loc.device
        q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
        num_owned = int(q_lens.sum())
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs), q_lens).to(device)
        starts = meta.query_start_loc[:-1].long()
        index = torch.arange(num_owned, device=device) - starts[seq]
        is_uniform = num_owned == meta.num_tokens and len(set(meta.query_lens_cpu)) <= 1
        return cls(num_owned, is_uniform, seq, index)

    def padded_rows(self, max_query_len: int) -> torch.Tensor:
        """[num_owned] row of each owned token in a [num_seqs * max_query_len] block of padded queries."""
        return self.seq_of_token * max_query_len + self.index_in_seq


def fold_queries(q: torch.Tensor, num_kv_heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, q_len, H, D] -> [N, Hkv, g * q_len, D] (written into `out` when given)."""
    n, q_len, h, d = q.shape
    g = h // num_kv_heads
    folded = q.view(n, q_len, num_kv_heads, g, d).permute(0, 2, 3, 1, 4)
    if out is None:
        return folded.reshape(n, num_kv_heads, g * q_len, d)
    out.view(n, num_kv_heads, g, q_len, d).copy_(folded)
    return out


def unfold_queries(o: torch.Tensor, q_len: int) -> torch.Tensor:
    """Inverse of fold_queries: [N, Hkv, g * q_len, D] -> [N, q_len, H, D]."""
    n, hkv, rows, d = o.shape
    g = rows // q_len
    return o.view(n, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(n, q_len, hkv * g, d)


def gather_queries(q: torch.Tensor, layout: QueryLayout, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Owned tokens of q [T, H, D] scattered to `rows` [num_owned] of a zero [num_rows, H, D] block."""
    if layout.is_uniform and num_rows == q.shape[0]:
        return q
    return q.new_zeros(num_rows, *q.shape[1:]).index_copy_(0, rows, q[:layout.num_owned])


def scatter_outputs(o: torch.Tensor, layout: QueryLayout, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Rows `rows` of o [N, H, D] back to packed tokens [T, H, D]; unowned tokens get zeros."""
    if layout.is_uniform and o.shape[0] == num_tokens:
        return o
    picked = o.index_select(0, rows)
    if layout.num_owned == num_tokens:
        return picked
    return o.new_zeros(num_tokens, *o.shape[1:]).index_copy_(0, torch.arange(layout.num_owned, device=o.device),
                                                              picked)


def attend_mask(q_pos: torch.Tensor, q_valid: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
                group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask [N, 1, group * q_len, L] (0 = may attend, -inf = not) for folded query rows.

    q_pos, q_valid: [N, q_len]; k_pos, k_valid: [N, L]. A query sees the valid keys at positions <= its own.
    Invalid query rows (padding) see key 0 so that no softmax row is empty; their outputs are discarded.
    None when every query sees every key.
    """
    visible = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [N, q_len, L]
    visible[:, :, 0] |= ~q_valid
    if bool(visible.all()):
        return None
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return mask.repeat(1, group, 1).unsqueeze(1)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v and its log-sum-exp: [..., M, D], [..., M] (fp32 lse).

    On CPU this is the fused flash kernel SDPA itself dispatches to (it computes the lse anyway);
    elsewhere the plain math. Every query row must see at least one key: the fused kernel reports lse 0,
    not -inf, for a row with every key masked (the masks built here never leave one empty).
    """
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                            scale=scale)
        return o, lse.float()
    return attention_with_lse_math(q, k, v, mask, scale)


def attention_with_lse_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)  # -inf for an all-masked row
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.matmul(p, v.float()).to(q.dtype), lse


def merge_rows(o: torch.Tensor, lse: torch.Tensor, row_seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Exact softmax over a sequence's rows from per-row results: o [R, ..., D], lse [R, ...] -> [num_seqs, ..., D].

    out = sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m), m = max_r lse_r: the split-KV log-sum-exp merge.
    """
    index = row_seq.view(-1, *([1] * (lse.dim() - 1))).expand_as(lse)
    m = lse.new_full((num_seqs, *lse.shape[1:]), float("-inf")).scatter_reduce_(0, index, lse, "amax")
    w = torch.exp(lse - m.masked_fill(m == float("-inf"), 0.0).gather(0, index))  # [R, ...]
    num = o.new_zeros((num_seqs, *o.shape[1:])).index_add_(0, row_seq, o * w[..., None].to(o.dtype))
    den = lse.new_zeros((num_seqs, *lse.shape[1:])).index_add_(0, row_seq, w)
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None].to(o.dtype)


def paged_slots(block_tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Flat cache slots of `positions` [N, L] through each row's block table [N, W]; invalid -> slot 0.

    Padding must read a slot that holds finite numbers even though it is masked (0 * NaN is NaN): slot 0,
    which the KV cache zeroes when it is created. Unwritten slots may hold anything.
    """
    width = block_tables.shape[1]
    blocks = block_tables.long().gather(1, (positions // block_size).clamp(0, width - 1))
    return (blocks * block_size + positions % block_size).masked_fill_(~valid, 0)


class Workspace:
    """Grow-only scratch buffers, reused by every layer of every forward (a mode's gathered K/V have the same
    shape in each layer). On CPU a fresh multi-MiB tensor per layer is not free: glibc hands large freed
    blocks back to the OS, so each new one page-faults in again (measured: the padded attention step at
    batch 16, 30 layers, 154 ms with fresh tensors, 49 ms reusing them)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous [shape] tensor with like's dtype and device; its contents are undefined."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            with torch.inference_mode(False):  # a normal tensor: writable inside inference mode and out of it
                buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def gather(self, name: str, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """cache[slots] into the buffer `name`: [len(slots), *cache.shape[1:]]."""
        out = self.get(name, (slots.shape[0], *cache.shape[1:]), cache)
        return torch.index_select(cache, 0, slots, out=out)
