"""Triton kernels for verification attention over the paged KV cache (launched by kernels/triton_backends.py).

Layouts (strides passed explicitly, last dim contiguous):
- q, out:        [T, H, D]; sequence b owns rows [query_start_loc[b], query_start_loc[b + 1])
- k/v cache:     [slots, Hkv, D]; position p of sequence b is slot block_table[b, p // bs] * bs + p % bs
- part_o, lse:   [R, max_q, H, D], [R, max_q, H] (decomposed: one partial result per row)

A program owns BLOCK_M folded query rows of one sequence (or row) and one KV head: row m is token
m // GROUP of the block and query head kv_head * GROUP + m % GROUP, so the GROUP query heads that share a
KV head share its key and value loads (GQA without expanding KV). Keys are visited BLOCK_N at a time with
an online softmax; a query at position p sees keys at positions <= p (causal inside the query block).
Loads past a sequence's end are masked (other=0): unwritten cache slots may hold NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _query_block(query_start_loc, seq):
    """-> (first token row, number of new tokens) of sequence seq."""
    q_start = tl.load(query_start_loc + seq)
    return q_start, tl.load(query_start_loc + seq + 1) - q_start


@triton.jit
def _load_queries(q_ptr, seq_lens, seq, q_start, q_len, kv_head, m_block, stride_qt, stride_qh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """-> q [BLOCK_M, BLOCK_D], token index in the sequence [BLOCK_M], head [BLOCK_M], row valid, query
    position [BLOCK_M], the sequence's KV length."""
    seq_len = tl.load(seq_lens + seq)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    ptrs = q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(ptrs, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    return q, tok, head, row_ok, seq_len - q_len + tok, seq_len


@triton.jit
def _attend_keys(q, q_pos, k_cache, v_cache, block_table, kv_lo, kv_hi, kv_head, block_size, scale,
                 stride_ks, stride_kh, stride_vs, stride_vh,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Online softmax of q over the keys at positions [kv_lo, kv_hi) -> acc [BLOCK_M, BLOCK_D], max, sum."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < HEAD_DIM
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < kv_hi
        block = tl.load(block_table + pos // block_size, mask=ok, other=0)
        slot = (block.to(tl.int64) * block_size + pos % block_size)[:, None]
        k = tl.load(k_cache + slot * stride_ks + kv_head * stride_kh + d[None, :], mask=ok[:, None] & d_ok, other=0.0)
        v = tl.load(v_cache + slot * stride_vs + kv_head * stride_vh + d[None, :], mask=ok[:, None] & d_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def packed_attention_kernel(q_ptr, k_cache, v_cache, out_ptr, query_start_loc, seq_lens, block_tables,
                            scale, block_size, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """grid (num_seqs, cdiv(max_query_len * GROUP, BLOCK_M), Hkv): one sequence's query block over its own KV."""
    seq, m_block, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len = _query_block(query_start_loc, seq)
    if m_block * BLOCK_M >= q_len * GROUP:
        return
    q, tok, head, row_ok, q_pos, seq_len = _load_queries(q_ptr, seq_lens, seq, q_start, q_len, kv_head, m_block,
                                                         stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D)
    last_tok = tl.minimum(q_len, (m_block * BLOCK_M + BLOCK_M - 1) // GROUP + 1)  # keys past it are masked
    acc, m_i, l_i = _attend_keys(q, q_pos, k_cache, v_cache, block_tables + seq.to(tl.int64) * stride_bt, 0,
                                 seq_len - q_len + last_tok, kv_head, block_size, scale, stride_ks, stride_kh,
                                 stride_vs, stride_vh, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    d = tl.arange(0, BLOCK_D)
    ptrs = out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def split_kv_kernel(q_ptr, k_cache, v_cache, part_o, part_lse, query_start_loc, seq_lens, block_tables,
                    row_seq, row_start, row_len, scale, block_size, stride_qt, stride_qh,
                    stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                    stride_pr, stride_pt, stride_ph, stride_lr, stride_lt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """grid (max_rows, cdiv(max_query_len * GROUP, BLOCK_M), Hkv): a row's keys
    [row_start, row_start + row_len) of sequence row_seq -> its partial output and log-sum-exp."""
    row, m_block, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(row_len + row)
    if kv_len == 0:  # rows past the plan's (the grid is sized by the batch, not the plan)
        return
    seq, kv_lo = tl.load(row_seq + row), tl.load(row_start + row)
    q_start, q_len = _query_block(query_start_loc, seq)
    if m_block * BLOCK_M >= q_len * GROUP:
        return
    q, tok, head, row_ok, q_pos, _ = _load_queries(q_ptr, seq_lens, seq, q_start, q_len, kv_head, m_block,
                                                   stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D)
    acc, m_i, l_i = _attend_keys(q, q_pos, k_cache, v_cache, block_tables + seq.to(tl.int64) * stride_bt, kv_lo,
                                 kv_lo + kv_len, kv_head, block_size, scale, stride_ks, stride_kh, stride_vs,
                                 stride_vh, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION)
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    d = tl.arange(0, BLOCK_D)
    base = row.to(tl.int64) * stride_pr + tok * stride_pt + head * stride_ph
    tl.store(part_o + base[:, None] + d[None, :], o, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))
    tl.store(part_lse + row.to(tl.int64) * stride_lr + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit
def merge_rows_kernel(part_o, part_lse, out_ptr, query_start_loc, seq_row_start,
                      stride_pr, stride_pt, stride_ph, stride_lr, stride_lt, stride_ot, stride_oh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (num_seqs, max_query_len, H): out = sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m) over the rows
    of the sequence (the split-KV log-sum-exp merge), for one query token and head."""
    seq, tok, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len = _query_block(query_start_loc, seq)
    if tok >= q_len:
        return
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    row_lo = tl.load(seq_row_start + seq).to(tl.int64)
    row_hi = tl.load(seq_row_start + seq + 1).to(tl.int64)
    for row in range(row_lo, row_hi):
        lse = tl.load(part_lse + row * stride_lr + tok * stride_lt + head)
        o = tl.load(part_o + row * stride_pr + tok * stride_pt + head * stride_ph + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha + w * o
        l_i = l_i * alpha + w
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)
    ptrs = out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=d_ok)
