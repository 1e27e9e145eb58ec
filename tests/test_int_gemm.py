"""The integer GEMM paths (8- and 15-bit activations: `gguf-q8`, `gguf-q16`) of every build this CPU runs.

- exact integer sums: with unit scales (fp16 d = 1, integer activations whose block maximum makes the activation
  scale exactly 1) every output is the exact integer x . codes, checked against an int64 reference, for Q4_0, Q4_1
  and Q8_0, with the codes' extremes (0 and 15, -128 and 127) and the activations' (+-127, +-32512);
- with random scales, the result is the digits' exact dot product scaled, within fp32 rounding of a float64
  reference built from the kernel's own digits (`quantize_rows`);
- batch invariance, bit for bit: every row of an M-row call (M = 1..16, a 130-row call crossing row tiles, mixed
  magnitudes) equals the row alone, at 1 and 2 threads;
- the AVX2 and AVX-512 VNNI builds give bit-identical outputs (where this CPU runs both);
- the AMX builds (`avx512amx` on the CPU's tiles, `avx512amxemu` on emulated ones, wherever AVX-512 VNNI runs) are
  tested with every call on the tiles (threshold 1 row), and give every row bit-identical to the VNNI build's, for
  1 to 64 rows, 130 rows, at 1 and 2 threads, for every block format and activation precision;
- the whole decoder stack in one call equals the module-by-module forward bit for bit, and the packed weights
  copied onto huge pages are unchanged.
Each path skips with the reason where this CPU lacks its ISA.
"""

from __future__ import annotations

import pytest
import torch

from spind.kernels import cpu_ext
from spind.models.gguf_linear import block_fields, pack
from spind.models.loader import BLOCK_BYTES, GGUFBlocks

AMX = ("avx512amx", cpu_ext.EMULATED_AMX)
ISAS = ("avx512vnni", "avx2", *AMX)
SUPPORTED = cpu_ext.supported_isas()
LOADABLE = cpu_ext.loadable_isas()
MODES = {"q8": 1, "q16": 2}  # op suffix -> activation digits
LIMIT = {1: 127, 2: 127 * 255 + 127}  # |activation / scale| bound of each mode
LIMITS = {**LIMIT, 3: (1 << 22) - 1}  # and of the fp32-precision activations' three digits


def ops_for(isa: str):
    """A build's ops; an AMX build's with every call on its tiles (threshold 1 row, restored after the test)."""
    if isa not in LOADABLE:
        pytest.skip(f"this CPU does not run the {isa} build (it runs: {', '.join(LOADABLE) or 'none'})")
    reason = cpu_ext.load(isa)
    assert reason is None, reason  # a machine that runs the ISA must build it
    ops = cpu_ext.ops(isa)
    if isa in AMX:
        info = cpu_ext.amx_info(isa)
        if info["reason"]:
            pytest.skip(f"the {isa} build cannot use its tiles here: {info['reason']}")
        _tiles_from_one_row(ops)
    return ops


_restore: list = []


def _tiles_from_one_row(ops) -> None:
    _restore.append((ops, ops.set_amx_min_rows(1)))  # the op itself: cpu_ext's wrapper takes a build's name


_restore_layout: list = []


@pytest.fixture(autouse=True)
def _restore_amx_threshold():
    yield
    while _restore:
        ops, rows = _restore.pop()
        ops.set_amx_min_rows(rows)
    while _restore_layout:
        ops, blocks = _restore_layout.pop()
        ops.set_amx_pair_above(blocks)


def linear(ops, qtype: str, mode: str):
    return getattr(ops, ("q8_0_linear" if qtype == "Q8_0" else "q4_1_linear") + f"_{mode}")


def random_blocks(qtype: str, rows: int, cols: int, seed: int, unit_scales: bool = False) -> GGUFBlocks:
    """GGUF blocks with random codes; scales random (or d = 1, m = 0 with `unit_scales`)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols // 32, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    if unit_scales:
        d = torch.ones(rows, cols // 32, dtype=torch.float16)
        m = torch.zeros(rows, cols // 32, dtype=torch.float16)
    else:
        d = (torch.rand(rows, cols // 32, generator=g) * 0.02 + 1e-3).half()
        m = (-torch.rand(rows, cols // 32, generator=g) * 0.1).half()
    raw[..., 0:2] = d.view(torch.uint8).view(rows, cols // 32, 2)
    if qtype == "Q4_1":
        raw[..., 2:4] = m.view(torch.uint8).view(rows, cols // 32, 2)
    if qtype == "Q8_0":  # the extremes of the signed codes in every block
        raw[:, :, 2], raw[:, :, 3] = 128, 127  # -128, 127
    else:
        raw[:, :, -1] = 0xF0  # codes 0 and 15
    return GGUFBlocks(qtype, raw.reshape(rows, -1))


def signed_codes(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes int64 [N, G, 32] as the kernel multiplies them, d fp32 [N, G], m fp32 [N, G] or None): Q4_x codes are
    0..15 with the offset in m (Q4_0: m = -8 d), Q8_0 codes signed."""
    d, q, m = block_fields(b)
    if b.qtype == "Q8_0":
        return q.view(torch.int8).long(), d.float(), None
    codes = torch.cat([q & 15, q >> 4], dim=-1).long()
    return codes, d.float(), (d.float() * -8 if b.qtype == "Q4_0" else m.float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_integer_sums_are_exact(isa: str, mode: str, qtype: str) -> None:
    ops = ops_for(isa)
    digits = MODES[mode]
    # 15-bit activations: one block, and small entries beside its extremes, keep every total below 2^24
    n, k, bound = (64, 256, LIMIT[1]) if digits == 1 else (64, 32, 300)
    b = random_blocks(qtype, n, k, seed=1, unit_scales=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-bound, bound + 1, (20, k), generator=g)
    x.view(20, k // 32, 32)[:, :, 0] = LIMIT[digits]  # every block's maximum: activation scale exactly 1
    x[0, 1::32], x[1, 2::32] = -LIMIT[digits], -LIMIT[digits]
    codes, _, m = signed_codes(b)
    exact = torch.einsum("mgk,ngk->mn", x.view(20, k // 32, 32), codes)  # int64
    if m is not None:  # Q4_0: + m sum(x) with m = -8 (exact too); Q4_1: m = 0
        exact = exact + torch.einsum("mg,ng->mn", x.view(20, k // 32, 32).sum(-1), m.long())
    assert exact.abs().max() < 2**24  # so that the fp32 outputs can be exact
    # 20 rows, 9 and 5 (on AVX-512 VNNI at 15 bits, calls of up to 16 rows take the loop over both columns at once)
    for rows in (20, 9, 5):
        y = linear(ops, qtype, mode)(x[:rows].float().contiguous(), pack(b))
        assert torch.equal(y.double(), exact[:rows].double()), rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_scaled_sums_match_the_digits_reference(isa: str, mode: str, qtype: str) -> None:
    ops = ops_for(isa)
    n, k, digits = 96, 320, MODES[mode]
    b = random_blocks(qtype, n, k, seed=3)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 7)[:, None]
    dig, scale, sums = ops.quantize_rows(x, digits)
    assert dig.shape == (7, k // 32, digits, 32) and dig[:, :, 0].abs().max() <= 127  # the leading digit: |q| bound
    q = dig[:, :, 0].double()
    for e in range(1, digits):  # balanced base-256 digits, each in [-128, 127]
        q = q * 256 + dig[:, :, e].double()
    assert q.abs().max() <= LIMIT[digits]
    assert ((q * scale.double()[..., None] - x.double().view(7, k // 32, 32)).abs()
            <= scale.double()[..., None] * 0.51).all()  # half a step, and x / scale rounded in fp32
    codes, d, m = signed_codes(b)
    ref = torch.einsum("mgk,ngk->mng", q, codes.double()) * (d.double()[None] * scale.double()[:, None, :])
    ref = ref.sum(-1)
    if m is not None:
        ref = ref + torch.einsum("mg,ng->mn", sums.double(), m.double())
    y = linear(ops, qtype, mode)(x, pack(b))[:, :n].double()
    assert ((y - ref).abs() <= 2e-6 * ref.abs().amax(dim=1, keepdim=True)).all()


def reference_digits(x: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantizer's definition in fp32 torch ops: per block of 32, scale = amax / limit, q = x * (limit / amax)
    rounded to nearest even and clamped, balanced base-256 digits (most significant first), and the block's sum
    in fp32 with k increasing."""
    limit = LIMITS[digits]
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(float(limit)) / amax, torch.zeros(()))
    q = torch.round(blocks * inv[..., None]).clamp(-limit, limit).to(torch.int64)
    out = []
    for _ in range(digits):  # least significant first
        d = ((q + 128) & 255) - 128
        out.append(d)
        q = (q - d) >> 8
    total = torch.zeros(blocks.shape[:2])
    for k in range(32):
        total = total + blocks[..., k]
    return torch.stack(out[::-1], dim=2).to(torch.int8), amax / limit, total


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_every_build_quantizes_activations_as_defined(isa: str, digits: int) -> None:
    """Digits, scales and sums bit for bit against the definition, for row counts whose blocks run through each of
    a build's loops (AVX-512: 16 blocks at a time, then 8, then 1), with zero blocks, rounding ties and magnitudes
    from 1e-30 to 1e30."""
    ops = ops_for(isa)
    g = torch.Generator().manual_seed(13)
    for m, k in ((1, 32), (1, 576), (3, 160), (7, 1536), (64, 576)):
        n = m * k // 32  # blocks, each at its own magnitude, in random order
        magnitude = torch.logspace(-30, 30, n)[torch.randperm(n, generator=g)]
        x = torch.randn(m, k, generator=g) * magnitude.repeat_interleave(32).view(m, k)
        x.view(-1, 32)[::5] = 0.0  # every fifth block all zeros
        x.view(-1)[7::97] = 0.5  # lone entries in zero blocks (their scale from them alone)
        # the last block: its maximum the limit (scale exactly 1), the others halves, each a rounding tie
        x.view(-1, 32)[-1] = torch.cat([torch.tensor([float(LIMITS[digits])]), torch.arange(-15, 16) + 0.5])
        got = ops.quantize_rows(x, digits)
        want = reference_digits(x, digits)
        for a, b, what in zip(got, want, ("digits", "scale", "sum")):
            assert torch.equal(a.view(b.shape), b), (m, k, what)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_rows_are_batch_invariant_at_every_width_and_thread_count(isa: str, mode: str, qtype: str) -> None:
    ops = ops_for(isa)
    b = pack(random_blocks(qtype, 160, 192, seed=5))
    f = linear(ops, qtype, mode)
    x = torch.randn(130, 192, generator=torch.Generator().manual_seed(6)) * torch.logspace(-2, 2, 130)[:, None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [f(x[i:i + 1].contiguous(), b) for i in range(len(x))]
        # 5 threads on a 2-core machine: helpers preempted mid-region, chunks claimed by whoever runs
        for t in (1, 2, 5):
            torch.set_num_threads(t)
            for m in (*range(1, 65), 130):  # 130 rows cross the 64-row tiles of a prefill
                assert torch.equal(f(x[:m].contiguous(), b), torch.cat(alone[:m])), (t, m)
            mixed = torch.stack([x[129], x[0], x[64], x[3]])  # rows of very different magnitudes, reordered
            assert torch.equal(f(mixed, b), torch.cat([alone[129], alone[0], alone[64], alone[3]]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not {"avx512vnni", "avx2"} <= set(SUPPORTED), reason="this CPU runs one of the AVX builds only")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_builds_are_bit_identical(mode: str, qtype: str) -> None:
    b = pack(random_blocks(qtype, 128, 576, seed=7))
    x = torch.randn(23, 576, generator=torch.Generator().manual_seed(8)) * 3
    for rows in (2, 5, 8, 12, 16, 23):  # VNNI: both columns at once up to 16 rows (15-bit), a column at a time above
        outs = [linear(ops_for(isa), qtype, mode)(x[:rows].contiguous(), b) for isa in ("avx512vnni", "avx2")]
        assert torch.equal(*outs), rows


@pytest.mark.parametrize("isa", AMX)
@pytest.mark.parametrize("mode", ["", *MODES])  # "": `gguf`, fp32-precision activations (three digits)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("pair_above", [1, cpu_ext.PAIR_ABOVE, cpu_ext.NEVER_PAIR])
def test_amx_rows_equal_the_vnni_rows(isa: str, mode: str, qtype: str, pair_above: int) -> None:
    """Every row of a call on the tiles, at every height (partial tiles, several tiles, two 64-row tiles), thread
    count and layout (row blocks in pairs from 2, 5 or never), bit-identical to the VNNI build's row, computed
    alone: a forward may switch path by row count, and tune_amx_layout picks the layout by time."""
    amx, vnni = ops_for(isa), ops_for("avx512vnni")
    _restore_layout.append((amx, amx.set_amx_pair_above(pair_above)))
    name = ("q8_0_linear" if qtype == "Q8_0" else "q4_1_linear") + (f"_{mode}" if mode else "")
    b = pack(random_blocks(qtype, 96, 320, seed=9))
    x = torch.randn(130, 320, generator=torch.Generator().manual_seed(10)) * torch.logspace(-3, 3, 130)[:, None]
    x[7] = 0.0  # a zero row: activation scale 0
    alone = torch.cat([getattr(vnni, name)(x[i:i + 1].contiguous(), b) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 33, 48, 64, 65, 130):
                assert torch.equal(getattr(amx, name)(x[:m].contiguous(), b), alone[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", AMX)
def test_calls_below_the_amx_threshold_take_the_vnni_code(isa: str) -> None:
    """The threshold is the op's: rows below it run the VNNI loop (so a hardware build whose tiles Linux refused
    still serves), and both sides of it give the same rows."""
    ops = ops_for(isa)
    assert cpu_ext.set_amx_min_rows(5, isa) == 1
    b = pack(random_blocks("Q4_1", 64, 128, seed=11))
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(12))
    below, at = ops.q4_1_linear(x[:4].contiguous(), b), ops.q4_1_linear(x[:5].contiguous(), b)
    assert torch.equal(below, at[:4])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="AMX min rows"):
            cpu_ext.set_amx_min_rows(bad, isa)
    assert cpu_ext.amx_info(isa)["min_rows"] == 5


@pytest.mark.parametrize("isa", AMX)
def test_the_amx_layout_is_set_and_checked(isa: str) -> None:
    ops = ops_for(isa)
    previous = cpu_ext.set_amx_pair_above(2, isa)
    _restore_layout.append((ops, previous))
    assert cpu_ext.amx_info(isa)["pair_above"] == 2
    assert cpu_ext.set_amx_pair_above(cpu_ext.NEVER_PAIR, isa) == 2
    for bad in (0, -1, cpu_ext.NEVER_PAIR + 1, 2.0, True):
        with pytest.raises(ValueError, match="AMX pair-above"):
            cpu_ext.set_amx_pair_above(bad, isa)
    assert cpu_ext.amx_info(isa)["pair_above"] == cpu_ext.NEVER_PAIR
    assert "row blocks one at a time" in cpu_ext.describe() or cpu_ext.best_isa() != isa


def test_the_faster_layout_is_chosen_by_the_median_round() -> None:
    """Each round timed both layouts: the median of the rounds' ratios decides, so one slow spell (a noisy machine's)
    in either layout's times does not; a tie keeps the row blocks one at a time (registers, no shared codes)."""
    chosen: list[int] = []
    paired, single = [1.0, 1.0, 9.0, 1.0, 1.0], [1.2, 1.2, 1.2, 0.1, 1.2]  # paired faster in 4 rounds of 5
    got = cpu_ext.layout_choice(paired, single, 4, chosen.append)
    assert got["pair_above"] == 4 and chosen == [4] and got["ratio"] == pytest.approx(1 / 1.2, abs=1e-3)
    assert got["paired_ms"] == 1000.0 and got["single_ms"] == 1200.0  # medians, in ms
    got = cpu_ext.layout_choice([1.3, 1.3, 1.3], [1.0, 2.0, 1.0], 3, chosen.append)
    assert got["pair_above"] == cpu_ext.NEVER_PAIR and chosen[-1] == cpu_ext.NEVER_PAIR and got["ratio"] == 1.3
    assert cpu_ext.layout_choice([1.0], [1.0], 4)["pair_above"] == cpu_ext.NEVER_PAIR
    with pytest.raises(ValueError):
        cpu_ext.layout_choice([1.0, 1.0], [1.0], 4)  # rounds must pair up


@pytest.mark.skipif(not cpu_ext._has_amx_int8(), reason="this CPU has no AMX-INT8: no tiles to time")
def test_tune_amx_layout_times_both_and_keeps_the_faster(monkeypatch) -> None:
    ops = ops_for("avx512amx")
    _restore_layout.append((ops, ops.set_amx_pair_above(cpu_ext.PAIR_ABOVE)))
    monkeypatch.setattr(cpu_ext, "_tuned", {})
    got = cpu_ext.tune_amx_layout("avx512amx")
    assert got["pair_above"] == (cpu_ext.PAIR_ABOVE if got["ratio"] < 1 else cpu_ext.NEVER_PAIR)
    assert got["paired_ms"] > 0 and got["single_ms"] > 0
    assert cpu_ext.amx_info("avx512amx")["pair_above"] == got["pair_above"]
    assert cpu_ext.tune_amx_layout("avx512amx") is got  # once per process
    monkeypatch.setattr(cpu_ext, "_tuned", {})
    monkeypatch.setenv(cpu_ext.AMX_PAIR_ENV, "3")  # the user's layout: not timed, not changed
    ops.set_amx_pair_above(3)
    assert cpu_ext.tune_amx_layout("avx512amx") is None and cpu_ext.amx_info("avx512amx")["pair_above"] == 3
    assert cpu_ext.tune_other_layout("spind_cpu_avx512amx") is None
    monkeypatch.delenv(cpu_ext.AMX_PAIR_ENV)
    assert cpu_ext.tune_amx_layout(cpu_ext.EMULATED_AMX) is None  # emulated tiles: nothing worth timing
    assert cpu_ext.tune_other_layout(f"spind_cpu_{cpu_ext.EMULATED_AMX}") is None
    # another build's namespace (`bench batch --against`), here this build's own: timed and set the same way
    got = cpu_ext.tune_other_layout("spind_cpu_avx512amx")
    assert cpu_ext.amx_info("avx512amx")["pair_above"] == got["pair_above"] in (3, cpu_ext.NEVER_PAIR)


def test_amx_info_names_each_build() -> None:
    if "avx512vnni" not in SUPPORTED:
        pytest.skip("this CPU runs no AVX-512 VNNI build")
    assert cpu_ext.amx_info("avx512vnni")["kind"] == "none"
    emulated = cpu_ext.amx_info(cpu_ext.EMULATED_AMX)
    assert emulated["kind"] == "emulated" and emulated["reason"] == "" and emulated["min_rows"] >= 1
    assert ("avx512amx" in SUPPORTED) == cpu_ext._has_amx_int8()
    if "avx512amx" in SUPPORTED:
        assert cpu_ext.amx_info("avx512amx")["kind"] == "hardware"


def test_huge_page_copy_is_a_copy() -> None:
    if not SUPPORTED:
        pytest.skip("spind's CPU kernels need AVX2 or AVX-512 VNNI")
    t = torch.randint(0, 256, (3, 5, 640), dtype=torch.uint8)
    c = cpu_ext.ops().huge_page_copy(t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr() and c.data_ptr() % (2 << 20) == 0
    t.zero_()
    assert c.sum() > 0  # its own memory


@pytest.mark.parametrize("dtype", ["gguf", "gguf-q16", "gguf-q8"])
def test_decoder_stack_equals_the_module_forward(model_dir, dtype: str) -> None:
    if not cpu_ext.available():
        pytest.skip("spind's CPU kernels need AVX2 or AVX-512 VNNI")
    from spind.models.llama import load_llama
    from spind.models.runner import ForwardItem, ModelRunner

    model = load_llama(model_dir, dtype)
    assert model.fused_stack is not None
    outs = []
    for stack in (model.fused_stack, None):
        model.fused_stack = stack
        runner = ModelRunner(model, 32, 16, "invariant")
        runner.add_request("a")
        runner.add_request("b")
        prompt = list(range(200, 270))
        first = runner.forward([ForwardItem("a", prompt, 3)])[0]  # a prefill
        # a verify and a prefill in one forward
        mixed = runner.forward([ForwardItem("a", [5, 6, 7, 8, 9], 5), ForwardItem("b", prompt[:40], 2)])
        outs.append(torch.cat([first, *mixed]))
    assert torch.equal(outs[0], outs[1])


def test_each_amx_build_keeps_its_own_tile_state() -> None:
    """Both AMX builds loaded in one process, the emulated one first: the hardware build still asks the CPU and Linux
    for its tiles. (Its permission check once lived in an inline function's static, a process-wide unique symbol:
    the hardware build read the emulated build's "usable", ran tiles without Linux's permission, and crashed.)"""
    if "avx512vnni" not in SUPPORTED:
        pytest.skip("this CPU runs no AVX-512 VNNI build")
    assert cpu_ext.amx_info(cpu_ext.EMULATED_AMX)["reason"] == ""
    assert cpu_ext.load("avx512amx") is None  # builds on any x86 compiler with AMX support, runs its tiles only on AMX
    hardware = cpu_ext.amx_info("avx512amx")
    assert hardware["kind"] == "hardware"
    if not cpu_ext._has_amx_int8():
        assert "lacks AMX" in hardware["reason"]


def test_a_failed_amx_build_gives_way_to_the_vnni_build(monkeypatch, caplog) -> None:
    """An AMX CPU whose compiler cannot build the tiles (no -mamx-int8) serves with the VNNI build, and says why."""
    if "avx512vnni" not in SUPPORTED:
        pytest.skip("this CPU runs no AVX-512 VNNI build")
    monkeypatch.delenv(cpu_ext.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_ext, "supported_isas", lambda: ["avx512amx", "avx512vnni", "avx2"])
    monkeypatch.setitem(cpu_ext._builds, "avx512amx", "building quant_gemm.cpp failed (no -mamx-int8)")
    monkeypatch.setattr(cpu_ext, "_logged", set())
    assert cpu_ext.best_isa() == "avx512vnni"
    with caplog.at_level("WARNING", logger=cpu_ext.__name__):
        assert cpu_ext.unavailable_reason() is None
    assert "the AMX build failed, the AVX-512 VNNI build serves: building quant_gemm.cpp failed" in caplog.text
