"""spind's CPU kernels (kernels/csrc): compiled on first use for this machine, or a logged reason why not.

The C++ sources are built with torch's extension builder (a C++ compiler and ninja; about a minute, once per
machine, torch version and source change, cached under torch's extensions directory) in one of two builds:
- `avx512vnni`: AVX-512 with VNNI (Intel Ice Lake and later, AMD Zen 4 and later): integer dot products by
  vpdpbusd (fp32-precision activations as three int8 digits per block, 15- or 8-bit ones as two or one);
- `avx2`: AVX2 + FMA + F16C (x86-64 since ~2013): fp32 FMAs for fp32-precision activations, vpmaddwd /
  vpmaddubsw integer dots for 15- / 8-bit ones (the same integer sums and fp32 epilogue as avx512vnni:
  bit-identical).
`SPIND_CPU_ISA=avx2` forces a build (to run or time the AVX2 path on an AVX-512 machine). The build's name carries
its ISA, so a cache shared between machines never hands one to a CPU without it, and each registers its ops under
its own namespace (`torch.ops.spind_cpu_<isa>`), so both can be loaded side by side (tests compare them). Callers
use `ops()`, or fall back to torch when `available()` is False. Every op runs on the kernels' own thread pool
(csrc/pool.h) at torch's thread count.

Ops (all batch-invariant: a row's result does not depend on the other rows of the call):
- `q4_1_linear(x, blocks)`, `q8_0_linear(x, blocks)` (fp32-precision activations), `*_q16` and `*_q8` (15- and
  8-bit activations): y = x W^T from packed GGUF blocks (csrc/quant_gemm.cpp);
  `quantize_rows(x, digits)`: the activation digits those compute with (tests);
- `row_attention(q, k_cache, v_cache, slots, slot_start, cu_q, ctx_lens, scale)` (csrc/row_attention.cpp), for
  head dims `row_attention_supports`;
- `rms_norm(x, w, eps)`, `silu_mul(gate_up)`, `rope_kv(...)`: fused row-wise ops of the quantized forward
  (csrc/fused_ops.cpp);
- `decoder_layers(...)`: a whole LLaMA decoder stack through the ops above in one call, `stack_profile(enable)`:
  where its calls' time went (GEMMs, attention, row-wise ops; `spind bench batch`), and
  `huge_page_copy(t)`: a tensor copy on transparent-huge-page memory (csrc/stack.cpp).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("quant_gemm.cpp", "row_attention.cpp", "fused_ops.cpp", "stack.cpp")
HEADERS = ("simd.h", "pool.h", "ops.h")
ISA_FLAGS = {
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
_builds: dict[str, str | None] = {}  # isa -> None when loaded, else why it is not
_logged: set[str] = set()


ISA_ENV = "SPIND_CPU_ISA"  # force a build (e.g. avx2 on an AVX-512 machine, to run or time that path)


def best_isa() -> str | None:
    """The build spind runs: `SPIND_CPU_ISA` when set (and this CPU runs it), else the fastest this CPU runs; None
    when there is none (not x86, older than AVX2, or a forced build this CPU lacks)."""
    isas = supported_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        return forced if forced in isas else None
    return isas[0] if isas else None


@functools.cache
def supported_isas() -> list[str]:
    """The builds this CPU can run, fastest first."""
    try:
        vnni = torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()
        avx2 = torch.cpu._is_avx2_supported()
    except AttributeError:  # an older torch without the private probes
        vnni, avx2 = False, torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return [isa for isa, ok in (("avx512vnni", vnni), ("avx2", avx2)) if ok]


def load(isa: str) -> str | None:
    """Build or load one ISA's kernels; None on success, else the reason."""
    with _lock:
        if isa not in _builds:
            _builds[isa] = _build(isa)
        return _builds[isa]


def unavailable_reason() -> str | None:
    """None when the best build for this CPU is loaded (building it on first call), else why not (logged once)."""
    isa = best_isa()
    forced = os.environ.get(ISA_ENV)
    if isa is None and forced:
        reason = (f"{ISA_ENV}={forced}: not a build this CPU runs (it runs: {', '.join(supported_isas()) or 'none'}; "
                  f"builds: {', '.join(ISA_FLAGS)})")
    elif isa is None:
        reason = f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither AVX-512 VNNI nor AVX2"
    else:
        reason = load(isa)
    if reason is not None and reason not in _logged:
        _logged.add(reason)
        log.warning("spind CPU kernels unavailable, falling back to torch: %s", reason)
    return reason


def row_attention_supports(head_dim: int) -> bool:
    """Whether the row-attention kernel of the build in use takes this head dim: whole vectors of 16 (AVX-512) or 8
    (AVX2) lanes, at most 16 of them (csrc/row_attention.cpp)."""
    lanes = 16 if best_isa() == "avx512vnni" else 8
    return head_dim % lanes == 0 and head_dim // lanes <= 16


def available() -> bool:
    return unavailable_reason() is None


def ops(isa: str | None = None):
    """The op namespace of a loaded build (the best one by default)."""
    reason = unavailable_reason() if isa is None else load(isa)
    if reason is not None:
        raise RuntimeError(f"spind CPU kernels unavailable: {reason}")
    return getattr(torch.ops, f"spind_cpu_{isa or best_isa()}")


def _ninja_on_path() -> str | None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel (a spind dependency) puts it in the environment's
    bin folder, which is not on PATH when python is run without activating the environment. Returns the PATH to
    build with (None: leave it)."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        return None
    return os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _build(isa: str) -> str | None:
    path = _ninja_on_path()
    old_path = os.environ.get("PATH")
    try:
        from torch.utils import cpp_extension

        if path is not None:
            os.environ["PATH"] = path
        # torch's builder hashes the sources, not the headers: a define carrying their digest rebuilds on a change
        headers = hashlib.sha1(b"".join((CSRC / h).read_bytes() for h in HEADERS)).hexdigest()[:12]
        cpp_extension.load(name=f"spind_cpu_{isa}", sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=["-O3", "-ffp-contract=off", f"-DSPIND_OPS=spind_cpu_{isa}",
                                         f"-DSPIND_HEADERS={headers}", *ISA_FLAGS[isa]],
                           extra_include_paths=[str(CSRC)], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: all mean "use torch instead"
        lines = str(e).strip().splitlines()
        return f"building {', '.join(SOURCES)} failed ({type(e).__name__}: {lines[-1] if lines else e})"
    finally:
        if path is not None and old_path is not None:
            os.environ["PATH"] = old_path
    return None
