"""spind's CPU kernels (kernels/csrc) against torch references, for every build this CPU runs.

- GEMMs on GGUF blocks: the real default model's Q4_1 / Q8_0 tensors (and a Q4_0 one from gguf's own
  quantizer) match x W^T with W dequantized exactly, within 2e-6 of the output's largest entry (fp32 rounding:
  the fp32 matmul itself is ~4e-7 off the float64 product);
- batch invariance, bit for bit: a row's output is the same alone, in any slice of a batch, in any order;
- row attention matches the per-sequence float64 reference within 5e-6 (as fp32 SDPA does), and is invariant
  to the other rows and requests;
- the fused ops match the modules they replace.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spind.kernels import cpu_ext
from spind.kernels.metadata import build_metadata
from spind.kernels.row_attention import context_slots
from spind.kernels.testing import make_paged_case, reference_attention
from spind.models.gguf_linear import dequantize, pack
from spind.models.layers import RMSNorm, apply_rope
from spind.models.loader import GGUFBlocks, load_gguf_blocks

ISAS = cpu_ext.supported_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="spind's CPU kernels need AVX2 or AVX-512 VNNI")

GEMM_RTOL = 2e-6  # of max |x W^T|
ATTENTION_ATOL = 5e-6  # fp32 SDPA itself is 2-3e-6 off float64 on these inputs


@pytest.fixture(scope="module", params=ISAS)
def ops(request: pytest.FixtureRequest):
    reason = cpu_ext.load(request.param)
    assert reason is None, reason  # a machine that runs the ISA must build it
    return cpu_ext.ops(request.param)


@pytest.fixture(scope="module")
def blocks(model_dir: Path) -> dict[str, GGUFBlocks]:
    return load_gguf_blocks(model_dir)


def q4_0_blocks(rows: int, cols: int) -> GGUFBlocks:
    """A Q4_0 tensor made by gguf's quantizer; `rows` not a multiple of 32 exercises the packing's padding."""
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0).reshape(rows, -1)
    return GGUFBlocks("Q4_0", torch.from_numpy(np.ascontiguousarray(data)))


def gemm(ops, b: GGUFBlocks):
    packed = pack(b)
    fn = ops.q8_0_linear if b.qtype == "Q8_0" else ops.q4_1_linear
    return lambda x: fn(x.contiguous(), packed)[:, :b.shape[0]]


def test_blocks_dequantize_to_the_fp32_cache(blocks: dict[str, GGUFBlocks], model_dir: Path) -> None:
    """Raw blocks (RoPE row permutation undone on whole rows) dequantize to exactly the converted fp32 weights."""
    from safetensors import safe_open

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in names:
            assert torch.equal(dequantize(blocks[name]), f.get_tensor(name)), name
    q40 = q4_0_blocks(48, 64)
    expected = gguf.quants.dequantize(q40.data.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(48, 64)
    assert torch.equal(dequantize(q40), torch.from_numpy(expected))


@pytest.mark.parametrize("name", ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                                  "model.embed_tokens.weight", "q4_0"])
def test_gemm_matches_the_dequantized_weights(ops, blocks: dict[str, GGUFBlocks], name: str) -> None:
    b = q4_0_blocks(48, 96) if name == "q4_0" else blocks[name]
    x = torch.randn(37, b.shape[1], generator=torch.Generator().manual_seed(1)) * 4
    ref = x.double() @ dequantize(b).double().T
    err = (gemm(ops, b)(x).double() - ref).abs().max() / ref.abs().max()
    assert err < GEMM_RTOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["model.layers.3.mlp.gate_proj.weight", "model.embed_tokens.weight"])
def test_gemm_is_batch_invariant(ops, blocks: dict[str, GGUFBlocks], name: str) -> None:
    f = gemm(ops, blocks[name])
    x = torch.randn(64, blocks[name].shape[1], generator=torch.Generator().manual_seed(2))
    x[7] *= 1e3  # a row of another scale must not change its neighbours
    full = f(x)
    for lo, hi in [(0, 1), (5, 6), (0, 5), (3, 8), (7, 13), (20, 46), (63, 64)]:
        assert torch.equal(f(x[lo:hi]), full[lo:hi]), f"rows {lo}:{hi}"
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(f(x[perm]), full[perm])
    threads = torch.get_num_threads()
    try:  # threads split output columns, never the reduction: the thread count cannot change a bit
        torch.set_num_threads(2)
        assert torch.equal(f(x), full)
    finally:
        torch.set_num_threads(threads)


def row_attention(ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
    slots, slot_start = context_slots(meta)
    return ops.row_attention(q.contiguous(), k, v, slots, slot_start, meta.query_start_loc.long(),
                             meta.seq_lens.long(), 0.125)


def test_context_slots_op_matches_the_torch_reference(ops) -> None:
    g = torch.Generator().manual_seed(3)
    for seq_lens, block_size in (([40, 100, 17, 200], 16), ([1], 16), ([0, 5], 4), ([33, 64, 1, 9, 31], 8)):
        blocks = [torch.randperm(64, generator=g)[:-(-n // block_size) + 1].tolist() for n in seq_lens]
        meta = build_metadata([min(n, 1) for n in seq_lens], seq_lens, blocks, block_size, max_blocks_per_seq=40)
        slots, start = ops.context_slots(meta.block_tables, meta.seq_lens, block_size)
        want_slots, want_start = context_slots(meta)
        assert torch.equal(slots, want_slots) and torch.equal(start, want_start)
    with pytest.raises(RuntimeError, match="positions, its table holds"):
        ops.context_slots(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([33], dtype=torch.int32), 16)


def test_row_attention_matches_the_reference_and_is_invariant(ops) -> None:
    case = make_paged_case([1, 5, 17, 3], [40, 100, 17, 200], 9, 3, 64, block_size=16, seed=5)
    q, k, v, meta = case.q * 3, case.k_cache, case.v_cache, case.meta
    out = row_attention(ops, q, k, v, meta)
    ref = reference_attention(q.double(), k.double(), v.double(), meta, 0.125)  # float64, per sequence
    assert (out - ref).abs().max() < ATTENTION_ATOL
    tables = [meta.block_tables[b].tolist() for b in range(meta.num_seqs)]
    cu = meta.query_start_loc.tolist()
    # every row alone, as a decode step of its own request at its own position: bit-identical
    for b, (ql, n) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        for j in range(ql):
            row = cu[b] + j
            alone = build_metadata([1], [n - ql + j + 1], [tables[b]], meta.block_size)
            assert torch.equal(row_attention(ops, q[row:row + 1], k, v, alone), out[row:row + 1]), (b, j)
    # the same requests in another order and another company
    sub = build_metadata([meta.query_lens_cpu[2], meta.query_lens_cpu[1]], [meta.seq_lens_cpu[2], meta.seq_lens_cpu[1]],
                         [tables[2], tables[1]], meta.block_size)
    out_sub = row_attention(ops, torch.cat([q[cu[2]:cu[3]], q[cu[1]:cu[2]]]), k, v, sub)
    assert torch.equal(out_sub, torch.cat([out[cu[2]:cu[3]], out[cu[1]:cu[2]]]))
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):  # the items cut at other places (by their work: row_attention_parts)
            torch.set_num_threads(n)
            assert torch.equal(row_attention(ops, q, k, v, meta), out), n
    finally:
        torch.set_num_threads(threads)


def test_row_attention_cuts_its_items_by_work(ops) -> None:
    """Threads get contiguous runs of items of about equal work (each part within one item of its share), not of
    equal count: a prefill's later chunks see more positions, so its first half by work holds most of its items."""
    def parts(query_lens: list[int], ctx_lens: list[int], threads: int) -> tuple[list[int], list[int]]:
        cu = torch.tensor([0, *query_lens]).cumsum(0)
        bounds, work = ops.row_attention_parts(cu, torch.tensor(ctx_lens), 3, 3, threads)
        return bounds.tolist(), work.tolist()

    bounds, work = parts([229], [229], 2)  # 29 chunks x 3 KV heads
    assert len(work) == 87 and bounds[0] == 0 and bounds[-1] == 87 and len(bounds) == 3
    assert bounds[1] > 87 * 0.6  # by count it would be 43
    for query_lens, ctx_lens in (([229], [229]), ([64, 1, 1, 1, 5], [256, 100, 600, 30, 41]), ([1] * 16, [256] * 16),
                                 ([1, 5], [7, 500])):
        for threads in (1, 2, 3, 4, 64):
            bounds, work = parts(query_lens, ctx_lens, threads)
            items = len(work)
            assert bounds[0] == 0 and bounds[-1] == items and bounds == sorted(bounds)
            assert len(bounds) == min(threads, items) + 1
            share = sum(work) / (len(bounds) - 1)
            for lo, hi in zip(bounds, bounds[1:]):
                assert sum(work[lo:hi]) <= share + max(work), (query_lens, threads, bounds)
    # a later chunk of a prompt is worth more than an earlier one, a decode row of long context more than a short one
    _, work = parts([16, 1, 1], [16, 10, 900], 1)
    assert work[0] < work[3] and work[6] < work[9]


def test_fused_ops_match_the_modules_they_replace(ops) -> None:
    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(7, 576, generator=g) * 5
    assert torch.allclose(ops.rms_norm(x, norm.weight.data, 1e-5), norm(x), rtol=1e-5, atol=1e-6)
    # the residual add folded into the norm: x += r in place, then the very norm of the sum (bit for bit)
    for width in (576, 100):  # and a row with a tail
        w = torch.randn(width, generator=g)
        x, r = torch.randn(7, width, generator=g) * 5, torch.randn(7, width, generator=g)
        summed = x + r
        y = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(x, summed) and torch.equal(y, ops.rms_norm(summed, w, 1e-5))
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 1e-5)
    for inter in (1536, 100):  # a multiple of the vector width, and one with a tail
        gu = torch.randn(5, 2 * inter, generator=g) * 6
        gate, up = gu.split(inter, dim=-1)
        assert torch.allclose(ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    # RoPE and the cache writes: the same roundings as the torch reference, so bit-identical
    heads, kv_heads, dim, t = 9, 3, 64, 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(t, 1, dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([9, 3, 40, 41, 0, 17])
    k_cache, v_cache = torch.zeros(64, kv_heads, dim), torch.zeros(64, kv_heads, dim)
    q = ops.rope_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.equal(q, apply_rope(q_ref.view(t, heads, dim), cos, sin))
    assert torch.equal(k_cache[slots], apply_rope(k_ref.view(t, kv_heads, dim), cos, sin))
    assert torch.equal(v_cache[slots], v_ref.view(t, kv_heads, dim))


def test_an_fp16_cache_is_read_as_its_exact_fp32_widening(ops) -> None:
    """The kernel widens each fp16 K/V element exactly and then runs the fp32 sequence: its output on an fp16 cache is
    bit-identical to its output on an fp32 cache holding the same (rounded) values, and stays batch-invariant."""
    case = make_paged_case([1, 5, 17, 3], [40, 100, 17, 200], 9, 3, 64, block_size=16, seed=7)
    q, meta = case.q * 3, case.meta
    k16, v16 = case.k_cache.half(), case.v_cache.half()
    out = row_attention(ops, q, k16, v16, meta)
    assert torch.equal(out, row_attention(ops, q, k16.float(), v16.float(), meta))
    cu, tables = meta.query_start_loc.tolist(), [meta.block_tables[b].tolist() for b in range(meta.num_seqs)]
    b, ql, n = 1, meta.query_lens_cpu[1], meta.seq_lens_cpu[1]
    for j in range(ql):  # a verify's rows as decode rows
        alone = build_metadata([1], [n - ql + j + 1], [tables[b]], meta.block_size)
        row = slice(cu[b] + j, cu[b] + j + 1)
        assert torch.equal(row_attention(ops, q[row], k16, v16, alone), out[row])
    with pytest.raises(RuntimeError, match="both the same"):
        row_attention(ops, q, k16, v16.float(), meta)


@pytest.mark.parametrize("dim", [64, 40])  # whole vectors, and a head dim with a scalar tail
def test_rope_kv_writes_an_fp16_cache_rounded_to_nearest(ops, dim: int) -> None:
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, t = 9, 3, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g) * 50
    angles = torch.rand(t, 1, dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([9, 3, 40, 41, 0])
    k32, v32 = torch.zeros(64, kv_heads, dim), torch.zeros(64, kv_heads, dim)
    k16, v16 = torch.zeros(64, kv_heads, dim, dtype=torch.half), torch.zeros(64, kv_heads, dim, dtype=torch.half)
    q32 = ops.rope_kv(qkv, cos, sin, k32, v32, slots, heads, kv_heads)
    q16 = ops.rope_kv(qkv, cos, sin, k16, v16, slots, heads, kv_heads)
    assert torch.equal(q16, q32)  # queries stay fp32
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())  # torch's rounding: to nearest even
