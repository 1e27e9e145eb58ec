"""spind's CPU kernels (kernels/csrc): compiled on first use for this machine, or a logged reason why not.

The C++ sources are built with torch's extension builder (a C++ compiler and ninja; about a minute, once per
machine, torch version and source change, cached under torch's extensions directory) in one of three builds:
- `avx512amx`: `avx512vnni` whose many-row integer GEMMs (from `SPIND_AMX_MIN_ROWS` rows, default 4: a verify,
  a batch, a prefill) compute their exact block dots by AMX int8 tiles (Intel Sapphire Rapids and later), then run
  the VNNI path's epilogue: bit-identical to `avx512vnni`. It asks Linux for the tile state once per process and,
  refused, runs its VNNI code (`amx_info()` says why);
- `avx512vnni`: AVX-512 with VNNI (Intel Ice Lake and later, AMD Zen 4 and later): integer dot products by
  vpdpbusd (fp32-precision activations as three int8 digits per block, 15- or 8-bit ones as two or one);
- `avx2`: AVX2 + FMA + F16C (x86-64 since ~2013): fp32 FMAs for fp32-precision activations, vpmaddwd /
  vpmaddubsw integer dots for 15- / 8-bit ones (the same integer sums and fp32 epilogue as avx512vnni:
  bit-identical).
A fourth build, `avx512amxemu`, runs the AMX path on emulated tiles (csrc/amx.h): never chosen to serve, it lets
the tests check the tile path's layouts and epilogue on every AVX-512 VNNI machine, not only where AMX exists.
`SPIND_CPU_ISA=avx2` forces a build (to run or time the AVX2 path on an AVX-512 machine; `avx512vnni` the VNNI path
on an AMX machine). Where the AMX build fails (a compiler without `-mamx-int8`), the VNNI build serves. The build's
name carries its ISA, so a cache shared between machines never hands one to a CPU without it, and each registers its
ops under its own namespace (`torch.ops.spind_cpu_<isa>`), so builds can be loaded side by side (tests compare them).
Callers use `ops()`, or fall back to torch when `available()` is False. `build_other(csrc)` compiles another tree's
sources (an older checkout's) under a namespace of their own, and a model loaded inside `ops_from(that)` runs them:
a kernel change is timed against its parent in one process (`spind bench batch --against`). Every op runs on the
kernels' own thread pool (csrc/pool.h) at torch's thread count.

Built at install time: `pip install .` / `pip install -e .` (setup.py) compile this CPU's serving build into
`prebuilt/` beside this file, with a manifest of what it was built from (sources, headers, flags, torch version), so
an import loads it in milliseconds. A C++ extension is tied to the torch release it was compiled against: where the
manifest does not match (another torch, edited sources, another CPU's build, a forced ISA), the build is compiled here
on first use instead, as before, and said on stderr once it takes more than two seconds (what, why, how long,
where it is cached). A torch build lock left behind by a killed compile is removed once it is older than any build.

Ops (all batch-invariant: a row's result does not depend on the other rows of the call):
- `q4_1_linear(x, blocks)`, `q8_0_linear(x, blocks)` (fp32-precision activations), `*_q16` and `*_q8` (15- and
  8-bit activations): y = x W^T from packed GGUF blocks (csrc/quant_gemm.cpp);
  `quantize_rows(x, digits)`: the activation digits those compute with (tests);
- `amx_info()` -> (kind, reason the tiles go unused or "", min rows, pair above), `set_amx_min_rows(rows)`,
  `set_amx_pair_above(blocks)`: the AMX path's state, threshold and layout (every build has them; kind "none" where
  there are no tiles); `tune_amx_layout()` times the two layouts and keeps the faster;
- `row_attention(q, k_cache, v_cache, slots, slot_start, cu_q, ctx_lens, scale)` (csrc/row_attention.cpp), for
  head dims `row_attention_supports`;
- `rms_norm(x, w, eps)`, `silu_mul(gate_up)`, `rope_kv(...)`: fused row-wise ops of the quantized forward
  (csrc/fused_ops.cpp);
- `decoder_layers(...)`: a whole LLaMA decoder stack through the ops above in one call, `stack_profile(enable)`:
  where its calls' time went (GEMMs, attention, row-wise ops; `spind bench batch`), and
  `huge_page_copy(t)`: a tensor copy on transparent-huge-page memory (csrc/stack.cpp).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
PREBUILT = Path(__file__).resolve().parent / "prebuilt"  # setup.py writes this CPU's build here at install time
SOURCES = ("quant_gemm.cpp", "row_attention.cpp", "fused_ops.cpp", "stack.cpp")
HEADERS = ("simd.h", "pool.h", "ops.h", "amx.h")
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "avx512amx": [*_AVX512, "-mamx-tile", "-mamx-int8"],
    "avx512vnni": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512amxemu": [*_AVX512, "-DSPIND_AMX_EMULATE"],  # tests only
}
EMULATED_AMX = "avx512amxemu"
CFLAGS = ["-O3", "-ffp-contract=off"]
BUILD_S = 30  # what one build takes on 2 cores (25 s seen on a Zen 4 for avx512vnni): said before a compile
STALE_LOCK_S = 600  # a torch build lock older than this belongs to a compile that was killed

_lock = threading.Lock()
_builds: dict[str, str | None] = {}  # isa -> None when loaded, else why it is not
_logged: set[str] = set()


ISA_ENV = "SPIND_CPU_ISA"  # force a build (e.g. avx2 on an AVX-512 machine, to run or time that path)
AMX_PAIR_ENV = "SPIND_AMX_PAIR_ABOVE"  # fix the AMX layout (row blocks of a tile above which they pair), untimed
PAIR_ABOVE = 4  # the kernels' default (csrc/quant_gemm.cpp)
NEVER_PAIR = 1 << 30  # row blocks no tile has: every tile runs its row blocks one at a time
_tuned: dict[str, dict | None] = {}  # isa -> tune_amx_layout's result
_tune_lock = threading.Lock()


def best_isa() -> str | None:
    """The build spind runs: `SPIND_CPU_ISA` when set (and this CPU runs it), else the fastest this CPU runs; None
    when there is none (not x86, older than AVX2, or a forced build this CPU lacks)."""
    isas = supported_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        return forced if forced in loadable_isas() else None
    if isas and isas[0] == "avx512amx" and load("avx512amx") is not None:
        return isas[1]  # a compiler without AMX support: the VNNI build serves (unavailable_reason logged why)
    return isas[0] if isas else None


@functools.cache
def supported_isas() -> list[str]:
    """The builds this CPU can serve with, fastest first."""
    try:
        vnni = torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()
        avx2 = torch.cpu._is_avx2_supported()
    except AttributeError:  # an older torch without the private probes
        vnni, avx2 = False, torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    amx = vnni and _has_amx_int8()
    return [isa for isa, ok in (("avx512amx", amx), ("avx512vnni", vnni), ("avx2", avx2)) if ok]


def loadable_isas() -> list[str]:
    """The builds this CPU can load: those it serves with, and the emulated-AMX test build where AVX-512 VNNI runs."""
    isas = supported_isas()
    return [*isas, EMULATED_AMX] if "avx512vnni" in isas else isas


def _has_amx_int8() -> bool:
    """AMX tiles with int8 dot products, as the OS reports the CPU (torch probes AMX-TILE only)."""
    try:
        if not torch.cpu._is_amx_tile_supported():
            return False
    except AttributeError:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    except OSError:
        return False


def amx_info(isa: str | None = None) -> dict:
    """The AMX path of a loaded build: {"kind": "hardware" | "emulated" | "none", "reason": why its tiles go unused
    ("" when they are used), "min_rows": calls of at least this many rows take them, "pair_above": a tile of more
    row blocks than this runs them in pairs (NEVER_PAIR: one at a time)}."""
    kind, reason, min_rows, pair_above = ops(isa).amx_info()
    return {"kind": kind, "reason": reason, "min_rows": min_rows, "pair_above": pair_above}


def set_amx_pair_above(blocks: int, isa: str | None = None) -> int:
    """A tile of more than `blocks` row blocks runs them in pairs from now on, in this process (NEVER_PAIR: never);
    returns the previous value. For tune_amx_layout, benches and tests: every value gives the same outputs."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= NEVER_PAIR:
        raise ValueError(f"AMX pair-above must be an integer in [1, {NEVER_PAIR}], got {blocks!r}")
    return ops(isa).set_amx_pair_above(blocks)


def tune_amx_layout(isa: str | None = None) -> dict | None:
    """Which layout a many-row AMX call takes, chosen by timing both on this machine (csrc/quant_gemm.cpp: its row
    blocks one at a time, accumulators in registers, or in pairs sharing B tiles, accumulators in memory; one CPU
    ran 64 rows 0.87x the time in pairs, another 1.26x). Once per process and build, on the first quantized model
    loaded (~0.1 s): a 64-row call of 15-bit activations against a 1536 x 576 Q4_1 weight (the default target's
    gate/up shape) at torch's thread count, the layouts alternated over 9 rounds, the faster by the median of the
    rounds' ratios is kept. Both give bit-identical rows, so the choice moves time only. Returns {"pair_above",
    "paired_ms", "single_ms", "ratio"} (None where the build has no hardware tiles in use, or `SPIND_AMX_PAIR_ABOVE`
    fixes the layout)."""
    isa = isa or best_isa()
    if isa is None or os.environ.get(AMX_PAIR_ENV) or load(isa) is not None:
        return None
    with _tune_lock:
        if isa not in _tuned:
            _tuned[isa] = _tune(ops(isa))
            if _tuned[isa] is not None:
                log.info("AMX layout: %s", _tuned[isa])
        return _tuned[isa]


def tune_other_layout(namespace: str) -> dict | None:
    """tune_amx_layout for another tree's build (`build_other`'s namespace), so that an A/B times each build in its
    faster layout; None where its sources have no layout choice (older trees) or this machine no tiles in use."""
    other = getattr(torch.ops, namespace)
    if os.environ.get(AMX_PAIR_ENV) or not hasattr(other, "set_amx_pair_above"):
        return None
    return _tune(other)


def _tune(kernel_ops) -> dict | None:
    """Time a build's layouts and keep the faster, where its tiles are hardware ones in use; else None."""
    kind, reason, _, pair_above = kernel_ops.amx_info()
    if kind != "hardware" or reason:
        return None
    return _time_layouts(kernel_ops, pair_above if pair_above < NEVER_PAIR else PAIR_ABOVE)


def _time_layouts(kernel_ops, pair_above: int, rounds: int = 9) -> dict:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (1536 // 32, 576 // 32, 640), dtype=torch.uint8, generator=g)
    blocks[..., :128] = torch.full((64,), 0.01, dtype=torch.float16).view(torch.uint8)  # d and m: normal fp16
    x = torch.randn(64, 576, generator=g)
    times: dict[int, list[float]] = {pair_above: [], NEVER_PAIR: []}
    previous = kernel_ops.set_amx_pair_above(pair_above)
    try:
        for r in range(rounds + 1):
            for layout in (times if r % 2 else reversed(times)):
                kernel_ops.set_amx_pair_above(layout)
                t = time.perf_counter()
                for _ in range(3):
                    kernel_ops.q4_1_linear_q16(x, blocks)
                if r:  # round 0 warms both up
                    times[layout].append(time.perf_counter() - t)
    finally:
        kernel_ops.set_amx_pair_above(previous)
    return layout_choice(times[pair_above], times[NEVER_PAIR], pair_above, kernel_ops.set_amx_pair_above)


def layout_choice(paired: list[float], single: list[float], pair_above: int, apply=None) -> dict:
    """The faster layout by the median of per-round ratios of paired to single times (each round timed both, so a
    noisy machine's slow spells cancel); `apply(pair_above)` sets it."""
    ratio = statistics.median(p / s for p, s in zip(paired, single, strict=True))
    chosen = pair_above if ratio < 1.0 else NEVER_PAIR
    if apply is not None:
        apply(chosen)
    return {"pair_above": chosen, "paired_ms": round(statistics.median(paired) * 1e3, 3),
            "single_ms": round(statistics.median(single) * 1e3, 3), "ratio": round(ratio, 3)}


def load(isa: str) -> str | None:
    """Build or load one ISA's kernels; None on success, else the reason."""
    with _lock:
        if isa not in _builds:
            if not _builds and (other := foreign_checkout(Path(sys.modules["spind"].__file__).parent)) is not None:
                log.warning("spind's Python comes from %s but its CPU kernels from %s (an editable install's): "
                            "%s/csrc is not what runs here", other.parent, CSRC.parent.parent, other)
            _builds[isa] = _build(isa)
        return _builds[isa]


def foreign_checkout(spind_dir: Path, kernels_dir: Path = CSRC.parent) -> Path | None:
    """The kernels folder of the checkout whose `spind` package is `spind_dir`, where these kernels are not that
    folder; else None. The case: another checkout run by PYTHONPATH beside an editable install. Its Python is its
    own, but `spind.kernels` is a mapped package (pyproject's package-dir) that only the install's finder resolves,
    so its kernels are the install's; a daemon A/B of two kernel versions run that way compares one with itself."""
    own = spind_dir.resolve().parent / "kernels"
    return own if (own / "csrc").is_dir() and own.resolve() != kernels_dir.resolve() else None


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
        amx_build = load("avx512amx") if not forced and supported_isas()[0] == "avx512amx" else None
        if amx_build is not None and amx_build not in _logged:
            _logged.add(amx_build)
            log.warning("the AMX build failed, the AVX-512 VNNI build serves: %s", amx_build)
        reason = load(isa)
        if reason is None and isa == "avx512amx":
            tiles = amx_info(isa)["reason"]
            if tiles and tiles not in _logged:
                _logged.add(tiles)
                log.warning("AMX tiles unavailable, the avx512amx build runs its AVX-512 VNNI code: %s", tiles)
    if reason is not None and reason not in _logged:
        _logged.add(reason)
        log.warning("spind CPU kernels unavailable, falling back to torch: %s", reason)
    return reason


def set_amx_min_rows(rows: int, isa: str | None = None) -> int:
    """Calls of at least `rows` rows take the AMX tiles from now on, in this process (default: `SPIND_AMX_MIN_ROWS`,
    else 4); returns the previous threshold. For benches and tests: every threshold gives the same outputs."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"AMX min rows must be an integer >= 1, got {rows!r}")
    return ops(isa).set_amx_min_rows(rows)


def describe() -> str | None:
    """The build in use as the benches show it: its name, and for AMX whether and from how many rows a GEMM takes
    the tiles and in which layout (e.g. "avx512amx (AMX tiles from 4 rows, row blocks one at a time)"); None when the
    kernels are unavailable."""
    if not available():
        return None
    isa = best_isa()
    info = amx_info(isa)
    if info["kind"] == "none":
        return isa
    if info["reason"]:
        return f"{isa} (AMX tiles unused: {info['reason']})"
    layout = ("row blocks one at a time" if info["pair_above"] >= NEVER_PAIR
              else f"row blocks in pairs above {info['pair_above']} a tile")
    return (f"{isa} ({'emulated ' if info['kind'] == 'emulated' else ''}AMX tiles from {info['min_rows']} rows, "
            f"{layout})")


def row_attention_supports(head_dim: int) -> bool:
    """Whether the row-attention kernel of the build in use takes this head dim: whole vectors of 16 (AVX-512) or 8
    (AVX2) lanes, at most 16 of them (csrc/row_attention.cpp)."""
    lanes = 16 if (best_isa() or "").startswith("avx512") else 8
    return head_dim % lanes == 0 and head_dim // lanes <= 16


def available() -> bool:
    return unavailable_reason() is None


_ops_from: str | None = None  # while set (`ops_from`), the namespace `ops()` returns


def ops(isa: str | None = None):
    """The op namespace of a loaded build (the best one by default; inside `ops_from(name)`, that one)."""
    if isa is None and _ops_from is not None:
        return getattr(torch.ops, _ops_from)
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


def _flags(isa: str) -> list[str]:
    # torch's builder hashes the sources, not the headers: a define carrying their digest rebuilds on a change
    headers = hashlib.sha1(b"".join((CSRC / h).read_bytes() for h in HEADERS)).hexdigest()[:12]
    return [*CFLAGS, f"-DSPIND_OPS=spind_cpu_{isa}", f"-DSPIND_HEADERS={headers}", *ISA_FLAGS[isa]]


def fingerprint(isa: str) -> str:
    """What a build of `isa` is made from: its sources and headers, its flags, and the torch release whose C++ ABI
    it links against. A prebuilt library serves only where this matches."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + (CSRC / name).read_bytes())
    h.update(" ".join(_flags(isa)).encode() + torch.__version__.encode())
    return h.hexdigest()[:16]


def install_isas() -> list[str]:
    """The builds an install compiles ahead: the one this CPU serves with, and where that is AMX the VNNI build too
    (it serves where the AMX build turns out to fail). Other builds (a forced AVX2, the tests' emulated AMX) are
    compiled on first use."""
    isas = supported_isas()
    return isas[:2] if isas[:1] == ["avx512amx"] else isas[:1]


def prebuild(isa: str, out_dir: Path) -> Path:
    """Compile one build into `out_dir` (the library and its manifest) for the install; returns the library.
    Raises where it cannot be built (no compiler, no ninja): the install then goes on without it."""
    import json
    import tempfile

    lib, _ = _prebuilt(isa, out_dir)
    if lib is not None:
        return lib  # a reinstall of the same sources and torch (e.g. `pip install -e '.[test]'` after `-e .`)
    lib = out_dir / f"spind_cpu_{isa}.so"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"spind_cpu_{isa}.") as tmp:
        _compile(f"spind_cpu_{isa}", [CSRC / s for s in SOURCES], CSRC, _flags(isa), build_directory=tmp)
        staged = lib.with_name(f".{lib.name}.{os.getpid()}")
        shutil.copyfile(Path(tmp) / lib.name, staged)
        os.replace(staged, lib)  # a new file, never rewritten in place: a process running the old one keeps it
    (out_dir / f"spind_cpu_{isa}.json").write_text(json.dumps(
        {"isa": isa, "fingerprint": fingerprint(isa), "torch": torch.__version__}, indent=1) + "\n")
    return lib


def _prebuilt(isa: str, folder: Path | None = None) -> tuple[Path | None, str]:
    """The library for `isa` in `folder` (default: the install's) when its manifest matches this checkout and
    torch, else (None, why not)."""
    import json

    folder = PREBUILT if folder is None else folder
    lib, manifest = folder / f"spind_cpu_{isa}.so", folder / f"spind_cpu_{isa}.json"
    if not lib.is_file() or not manifest.is_file():
        return None, f"the install built no {isa} library" if folder.is_dir() else "the install built none"
    try:
        built = json.loads(manifest.read_text())
    except ValueError:
        return None, f"an unreadable manifest {manifest}"
    if built.get("fingerprint") != fingerprint(isa):
        if built.get("torch") != torch.__version__:
            return None, f"the install built it against torch {built.get('torch')}, this is torch {torch.__version__}"
        return None, "its sources changed since the install"
    return lib, ""


@contextlib.contextmanager
def _said_if_slow(message: str, after_s: float = 2.0):
    """Print `message` on stderr if the block is still running after `after_s`, and then how long it took: a
    compile that finds its cache up to date takes a second and says nothing."""
    done, said = threading.Event(), []
    start = time.perf_counter()

    def say() -> None:
        if not done.wait(after_s):
            said.append(True)
            print(f"spind: {message}", file=sys.stderr, flush=True)

    t = threading.Thread(target=say, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        if said:
            print(f"spind: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _ninja_on_path_env():
    path, old_path = _ninja_on_path(), os.environ.get("PATH")
    if path is not None:
        os.environ["PATH"] = path
    try:
        yield
    finally:
        if path is not None and old_path is not None:
            os.environ["PATH"] = old_path


def _remove_stale_lock(name: str) -> None:
    """torch's builder waits forever on a lock file a killed compile left behind (seen: a CI run killed mid-build
    hung every later import). A lock older than any build is removed."""
    from torch.utils import cpp_extension

    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        if lock.is_file() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing a stale build lock %s (%.0f s old: its compile was killed)", lock,
                        time.time() - lock.stat().st_mtime)
            lock.unlink()
    except (OSError, AttributeError, RuntimeError):  # a private torch helper moved: the lock stays, as before
        pass


def _compile(name: str, sources: list[Path], include: Path, flags: list[str], build_directory: str | None = None,
             slow: str | None = None) -> None:
    """Compile and load `sources` as the op library `name` with torch's builder (ninja found on PATH; `slow` said
    on stderr if it takes a while). Raises where it cannot be built."""
    from torch.utils import cpp_extension

    said = _said_if_slow(slow) if slow else contextlib.nullcontext()
    with _ninja_on_path_env(), said:
        cpp_extension.load(name=name, sources=[str(f) for f in sources], extra_cflags=flags,
                           extra_include_paths=[str(include)], build_directory=build_directory,
                           is_python_module=False, verbose=False)


def build_other(csrc: Path, isa: str | None = None) -> str:
    """Build another tree's kernel sources (e.g. an older checkout's kernels/csrc) beside this one's, for an A/B in
    one process (`spind bench batch --against`): every *.cpp in `csrc` with this build's flags, under an op namespace
    of its own named by the sources' digest; returns that namespace. Raises where it cannot be built."""
    isa = isa or best_isa()
    if isa is None or isa not in loadable_isas():
        raise RuntimeError(f"no kernel build runs on this CPU for {isa!r}")
    sources = sorted(csrc.glob("*.cpp"))
    if not sources:
        raise ValueError(f"{csrc} holds no kernel sources (*.cpp)")
    digest = hashlib.sha1(b"".join(f.name.encode() + f.read_bytes() for f in sorted(csrc.glob("*.[ch]*"))))
    name = f"spind_cpu_{isa}_ab{digest.hexdigest()[:10]}"
    # cached by torch's builder: a second call loads the same library
    _compile(name, sources, csrc, [*CFLAGS, f"-DSPIND_OPS={name}", *ISA_FLAGS[isa]],
             slow=f"compiling {csrc}'s {isa} kernels as {name} (~{BUILD_S} s)")
    return name


@contextlib.contextmanager
def ops_from(namespace: str):
    """`ops()` returns `namespace` inside the block, in every thread of the process (a process-wide override, not a
    thread-local one: load nothing else meanwhile): a model loaded in it keeps those ops (its layers take them at
    load), so two builds' models can run side by side in one process."""
    global _ops_from
    with _lock:
        previous, _ops_from = _ops_from, namespace
    try:
        yield
    finally:
        with _lock:
            _ops_from = previous


def _build(isa: str) -> str | None:
    lib, why = _prebuilt(isa)
    if lib is not None:
        try:
            torch.ops.load_library(str(lib))
            return None
        except (OSError, RuntimeError) as e:  # e.g. a library whose symbols this torch lacks: compile instead
            why = f"loading {lib} failed ({e})"
    name = f"spind_cpu_{isa}"
    try:
        from torch.utils import cpp_extension

        _remove_stale_lock(name)
        where = cpp_extension._get_build_directory(name, verbose=False)
        ahead = ("`pip install -e .` builds it ahead" if isa in install_isas()
                 else f"an install builds only {', '.join(install_isas())}")
        _compile(name, [CSRC / s for s in SOURCES], CSRC, _flags(isa),
                 slow=f"compiling the {isa} CPU kernels ({why}; {ahead}): ~{BUILD_S} s, once per machine, torch and "
                      f"source change, cached in {where}")
    except Exception as e:  # no compiler, no ninja, a failed build: all mean "use torch instead"
        lines = str(e).strip().splitlines()
        return f"building {', '.join(SOURCES)} failed ({type(e).__name__}: {lines[-1] if lines else e})"
    return None
