"""`spind bench verify`: what batched verification costs in each attention mode (the paper's §VI-A).

On the real target with its KV prefilled from Alpaca prompts (chat template), per batch size (with
`--generated N`, each request is also some way into its answer: N_i ~ uniform 0..N generated tokens, drawn
with a fixed seed, as in continuous batching where requests joined at different times):
- attention alone: every layer's call on the real caches plus the mode's plan, with k + 1 new tokens per
  request (a verify step) and random queries — the attention share of one verify forward;
- the whole verify forward (embedding, 30 layers, norm, lm_head over every token), per mode;
- peak memory of one attention step (plan + one layer, on a freshly built backend so that the workspace it
  keeps for the layers is counted): on CPU the high-water mark of live torch tensor bytes, from
  torch.profiler's allocation events at op granularity (scratch an op frees before it returns is not
  seen); on CUDA torch.cuda.max_memory_allocated above the step's start;
- KV slots each mode scores (padding included) against the exact sum of context lengths;
and at batch 1, verify(k + 1 tokens) / decode(1 token) per mode. Modes are timed round-robin within each
batch (so load on the shared machine hits them alike); figures are medians over repeats, then over batches.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from spind.bench.datasets import encode_prompt, load_prompts
from spind.bench.report import Progress, fmt, format_table, timed
from spind.bench.verify_setup import PagedKV, allocate, batch_inputs, prefill, verify_forward
from spind.config import SpindConfig, with_resolved_dtype
from spind.kernels.attention import get_backend
from spind.kernels.metadata import AttentionBackend
from spind.models.llama import load_llama
from spind.models.loader import resolve_model_dir
from spind.tokenizer import Tokenizer


@dataclass(frozen=True)
class VerifyBenchSettings:
    batch_sizes: tuple[int, ...]
    modes: tuple[str, ...]
    query_len: int  # k + 1 tokens per request in the mode comparison
    ks: tuple[int, ...]  # drafts per step for verify(k + 1) / decode(1)
    num_batches: int  # Alpaca batches per batch size
    generated: int  # requests are uniform 0..generated tokens into their answers (0: prompts only)
    repeats: int
    rows_per_seq: float  # decomposed modes: B = ceil(rows_per_seq * batch)
    with_forward: bool
    datasets_dir: Path
    device: str


def run_verify_bench(cfg: SpindConfig, settings: VerifyBenchSettings) -> dict:
    model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
    cfg = with_resolved_dtype(cfg, model_dir, settings.device)
    model = load_llama(model_dir, cfg.model.dtype, settings.device)
    tokenizer = Tokenizer(model_dir)
    num_prompts = settings.num_batches * max(settings.batch_sizes)
    prompts = [encode_prompt(tokenizer, p) for p in load_prompts("alpaca", num_prompts, settings.datasets_dir)]
    prompts = with_generated(prompts, settings.generated)
    block_size = cfg.runtime.kv_block_size
    requests, num_blocks = allocate(prompts, block_size, max(settings.query_len, max(settings.ks) + 1))
    kv = PagedKV(model, num_blocks, block_size)
    a = model.args
    backends = {m: _backend(m, a.num_heads, a.num_kv_heads, a.head_dim, model.device, settings.rows_per_seq)
                for m in settings.modes}
    steps = len(requests) + len(settings.batch_sizes) * settings.num_batches + settings.num_batches
    progress = Progress(steps)
    for i, request in enumerate(requests):
        prefill(model, kv, request, backends[settings.modes[0]])
        progress.step(f"prefill {i + 1}/{len(requests)}: {len(request.prompt)} tokens")
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    scale = a.head_dim ** -0.5

    batches = []
    for b in settings.batch_sizes:
        for j in range(settings.num_batches):
            chunk = requests[j * b:(j + 1) * b]
            tokens, positions, meta = batch_inputs(chunk, settings.query_len, block_size, model.device)
            q = torch.randn(meta.num_tokens, a.num_heads, a.head_dim, dtype=model.dtype, device=model.device)
            row = {"batch_size": b, "batch": j, "context_lens": list(meta.seq_lens_cpu), "kv_slots": {},
                   "peak_mib": {}}
            for m, be in backends.items():
                be.plan(meta)
                row["kv_slots"][m] = be.num_kv_slots
                fresh = _backend(m, a.num_heads, a.num_kv_heads, a.head_dim, model.device, settings.rows_per_seq)
                row["peak_mib"][m] = peak_bytes(lambda: (fresh.plan(meta), fresh(q, kv.k[0], kv.v[0], scale)),
                                                model.device) / 2 ** 20
            row["attention_ms"] = interleaved(
                {m: _attention_step(be, meta, q, kv, scale) for m, be in backends.items()}, settings.repeats, sync)
            if settings.with_forward:
                row["forward_ms"] = interleaved(
                    {m: _forward_step(model, kv, be, tokens, positions, meta) for m, be in backends.items()},
                    settings.repeats, sync)
            batches.append(row)
            progress.step(f"batch {b} #{j}: attention " + ", ".join(f"{m} {ms:.2f}" for m, ms in
                                                                    row["attention_ms"].items()) + " ms")
    ratios = []
    for j in range(settings.num_batches):
        ratios.append(_decode_verify_ratios(model, kv, backends, requests[j], settings, block_size, sync))
        progress.step(f"verify/decode, request {j}: " + ", ".join(
            f"{m} k={k} {r:.2f}" for m, rs in ratios[-1].items() for k, r in rs["ratio"].items()))
    return {"settings": {**asdict(settings), "datasets_dir": str(settings.datasets_dir)},
            "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                            "cpu_count": os.cpu_count(), "device": str(model.device), "model": cfg.model.target,
                            "dtype": cfg.model.dtype, "num_layers": a.num_layers, "block_size": block_size},
            "batches": batches, "summary": summarize(batches, settings), "ratios": summarize_ratios(ratios)}


def with_generated(prompts: list[list[int]], generated: int, seed: int = 0) -> list[list[int]]:
    """Each context extended by 0..generated tokens standing for an answer in progress (the prompt's own
    tokens cycled: what they are does not change the cost)."""
    rng = random.Random(seed)
    return [ids + (ids * (generated // len(ids) + 1))[:rng.randint(0, generated)] for ids in prompts]


def _backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
             rows_per_seq: float) -> AttentionBackend:
    options = {"rows_per_seq": rows_per_seq} if "decomposed" in name else {}
    return get_backend(name)(num_heads, num_kv_heads, head_dim, device, **options)


def _attention_step(be: AttentionBackend, meta, q: torch.Tensor, kv: PagedKV, scale: float) -> Callable[[], None]:
    @torch.inference_mode()
    def step() -> None:
        be.plan(meta)
        for k_cache, v_cache in zip(kv.k, kv.v):
            be(q, k_cache, v_cache, scale)
    return step


def _forward_step(model, kv: PagedKV, be: AttentionBackend, tokens, positions, meta) -> Callable[[], None]:
    def step() -> None:
        be.plan(meta)
        verify_forward(model, kv, tokens, positions, meta, be)
    return step


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median ms of each fn over `repeats` rounds, the fns taking turns (order rotated each round) after
    one untimed warm-up round."""
    names = list(fns)
    for name in names:
        fns[name]()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(timed(lambda: (fns[name](), sync())))
    return {name: statistics.median(s) for name, s in samples.items()}


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak of live tensor bytes fn allocates above what was allocated when it started (see module doc)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                                          profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (the profiler's C++ side logs every start and stop there, between our progress lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _decode_verify_ratios(model, kv: PagedKV, backends: dict[str, AttentionBackend], request,
                          settings: VerifyBenchSettings, block_size: int, sync) -> dict[str, dict]:
    """One request (batch 1): whole-forward ms with 1 and with k + 1 new tokens, per mode."""
    fns = {}
    for q_len in (1, *[k + 1 for k in settings.ks]):
        tokens, positions, meta = batch_inputs([request], q_len, block_size, model.device)
        for m, be in backends.items():
            fns[f"{m}:{q_len}"] = _forward_step(model, kv, be, tokens, positions, meta)
    ms = interleaved(fns, settings.repeats, sync)
    return {m: {"decode_ms": ms[f"{m}:1"], "verify_ms": {k: ms[f"{m}:{k + 1}"] for k in settings.ks},
                "ratio": {k: ms[f"{m}:{k + 1}"] / ms[f"{m}:1"] for k in settings.ks}} for m in backends}


def summarize(batches: list[dict], settings: VerifyBenchSettings) -> list[dict]:
    """Per batch size and mode: medians over the batches."""
    rows = []
    for b in settings.batch_sizes:
        mine = [r for r in batches if r["batch_size"] == b]
        exact = statistics.median(sum(r["context_lens"]) for r in mine)
        for m in settings.modes:
            rows.append({"batch_size": b, "mode": m,
                         "attention_ms": statistics.median(r["attention_ms"][m] for r in mine),
                         "forward_ms": statistics.median(r["forward_ms"][m] for r in mine)
                         if settings.with_forward else None,
                         "peak_mib": statistics.median(r["peak_mib"][m] for r in mine),
                         "kv_slots": statistics.median(r["kv_slots"][m] for r in mine), "exact_kv": exact})
    return rows


def summarize_ratios(per_request: list[dict[str, dict]]) -> list[dict]:
    rows = []
    for m in per_request[0]:
        for k in per_request[0][m]["ratio"]:
            rows.append({"batch_size": 1, "mode": m, "k": k,
                         "decode_ms": statistics.median(r[m]["decode_ms"] for r in per_request),
                         "verify_ms": statistics.median(r[m]["verify_ms"][k] for r in per_request),
                         "ratio": statistics.median(r[m]["ratio"][k] for r in per_request)})
    return rows


def render_tables(results: dict) -> str:
    s, summary = results["settings"], results["summary"]
    modes, sizes = s["modes"], s["batch_sizes"]
    cell = {(r["batch_size"], r["mode"]): r for r in summary}
    pairs = [(a, b) for a, b in (("decomposed", "padded"), ("packed", "decomposed"),
                                 ("triton-decomposed", "padded"), ("triton-packed", "triton-decomposed"))
             if a in modes and b in modes]
    contexts = "Alpaca prompts" + (f" + 0..{s['generated']} generated" if s["generated"] else "")
    where = (f"k+1 = {s['query_len']} tokens/request, {contexts}, median of {s['repeats']} runs x "
             f"{s['num_batches']} batches, {results['environment']['threads']} threads")

    def latency(key: str, title: str, share: bool = False) -> str:
        rows = [[str(b), *[fmt(cell[b, m][key]) for m in modes],
                 *[fmt(cell[b, x][key] / cell[b, y][key]) for x, y in pairs],
                 *([f"{cell[b, m]['attention_ms'] / cell[b, m][key]:.0%}" for m in modes] if share else [])]
                for b in sizes]
        header = ["batch", *[f"{m} ms" for m in modes], *[f"{x}/{y}" for x, y in pairs],
                  *([f"{m} attn" for m in modes] if share else [])]
        return format_table(title, header, rows)

    tables = [latency("attention_ms", f"Verification attention per forward (plan + every layer; {where})")]
    if s["with_forward"]:
        tables.append(latency("forward_ms", f"Whole verify forward, with attention's share ({where})", share=True))
    tables.append(format_table(
        "Attention step (plan + one layer): peak MiB, and KV slots scored (padding included) / exact",
        ["batch", *[f"{m} MiB" for m in modes], *[f"{m} slots" for m in modes], "exact slots"],
        [[str(b), *[fmt(cell[b, m]["peak_mib"]) for m in modes], *[f"{cell[b, m]['kv_slots']:.0f}" for m in modes],
          f"{cell[b, modes[0]]['exact_kv']:.0f}"] for b in sizes]))
    ks = sorted({r["k"] for r in results["ratios"]})
    ratio = {(r["mode"], r["k"]): r for r in results["ratios"]}
    tables.append(format_table(
        "verify(k+1) / decode(1), whole forward, batch 1 (decode ms in brackets)",
        ["mode", *[f"k={k}" for k in ks]],
        [[f"{m} ({fmt(ratio[m, ks[0]]['decode_ms'], 1)} ms)", *[fmt(ratio[m, k]["ratio"]) for k in ks]]
         for m in modes]))
    return "\n\n".join(tables)


def write_plot(results: dict, path: Path) -> Path | None:
    """Latency per batch size for each mode (attention; whole forward) and verify/decode per k; None
    without matplotlib (pip install 'spind[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = results["settings"]
    panels = [("attention_ms", "attention per forward (ms)")] + ([("forward_ms", "verify forward (ms)")]
                                                               if s["with_forward"] else [])
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4))
    for ax, (key, label) in zip(axes, panels):
        for m in s["modes"]:
            rows = [r for r in results["summary"] if r["mode"] == m]
            ax.plot([r["batch_size"] for r in rows], [r[key] for r in rows], marker="o", label=m)
        ax.set(xscale="log", xlabel="batch size", ylabel=label, title=f"{label}, k+1 = {s['query_len']}")
        ax.set_xticks(s["batch_sizes"], [str(b) for b in s["batch_sizes"]])
        ax.legend()
    ax = axes[-1]
    for m in s["modes"]:
        rows = [r for r in results["ratios"] if r["mode"] == m]
        ax.plot([r["k"] for r in rows], [r["ratio"] for r in rows], marker="o", label=m)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(xlabel="k (drafts)", ylabel="verify(k+1) / decode(1)", title="batch 1")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
