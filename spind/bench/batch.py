"""`spind bench batch`: where a batched target step's time goes as load grows (B = 1, 4, 8, 16 requests).

The target's own code path in one process (the worker's `TargetVerifier.verify` over the configured target: the
runner's metadata, the model's forward, acceptance), for B requests that each hold `--context` tokens of KV (windows
of AlpacaEval's reference outputs) and send a decode row (`--k 0`) or a (k+1)-row verify. Rounds are interleaved
over B and rolled back after each, so every round sees the same contexts. Per B, medians over rounds:
- ms per step and the tokens per second it gives (B (k+1) rows; a decode row is a token);
- where the step went: the decoder stack's GEMMs, its attention and its row-wise ops (RMSNorm, RoPE and the cache
  writes, SiLU x up, residual adds), timed inside the stack's one C++ call (`stack_profile`); the lm_head with the
  final norm (the same B rows, timed alone); the rest of the forward (the runner's metadata, the attention plan,
  the embedding: Python and torch dispatch); acceptance and sampling after the forward;
- the step at B over the step at 1, and throughput at B over throughput at 1.
Without the fused stack (no kernels, or a target that does not qualify) the stack's share is one `forward` column.
What this does not see is the daemon around it (IPC, the coordinator's slot): `spind bench serve` measures that.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from spind.bench.datasets import DEFAULT_DATASETS_DIR
from spind.bench.decode import _cpu_name
from spind.bench.quality import quality_windows
from spind.bench.report import Progress, fmt, format_table
from spind.config import SpindConfig, configured_kv_blocks
from spind.coordinator.transport.local import LocalEngine
from spind.kernels import cpu_ext
from spind.params import SamplingParams
from spind.worker.target import TargetVerifier, VerifyItem

PHASES = ("gemm", "attention", "row_ops", "lm_head", "forward_rest", "accept")


@dataclass(frozen=True)
class BatchBenchSettings:
    batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 256  # KV tokens each request holds
    k: int = 0  # draft tokens per request: 0 = decode rows
    rounds: int = 16
    threads: tuple[int, ...] = (1,)
    datasets_dir: Path = DEFAULT_DATASETS_DIR


def _stack_ops(verifier: TargetVerifier):
    """The kernels' ops when the target runs the fused stack (their `stack_profile` times it), else None."""
    model = verifier.runner.model
    return cpu_ext.ops() if model.fused_stack is not None and cpu_ext.available() else None


def _round(verifier: TargetVerifier, req_ids: list[str], drafts: dict[str, list[int]], ops) -> dict[str, float]:
    """One timed step of every request in `req_ids`, rolled back after: ms per phase and in all."""
    runner = verifier.runner
    lengths = {r: runner.length(r) for r in req_ids}
    pending = {r: list(verifier.pending[r]) for r in req_ids}
    items = [VerifyItem(r, drafts[r]) for r in req_ids]
    forward = runner.forward
    forward_s = 0.0

    def timed_forward(batch):
        nonlocal forward_s
        t0 = time.perf_counter()
        try:
            return forward(batch)
        finally:
            forward_s += time.perf_counter() - t0

    if ops is not None:
        ops.stack_profile(True)
    runner.forward = timed_forward  # an instance attribute over the method, for this one call
    try:
        start = time.perf_counter()
        verifier.verify(items)
        step_s = time.perf_counter() - start
    finally:
        del runner.forward
        stack = ops.stack_profile(False).tolist() if ops is not None else None
    for r in req_ids:  # back to the same contexts for the next round
        runner.truncate(r, lengths[r])
        verifier.pending[r] = pending[r]
    # the lm_head and its norm alone, on as many rows as the step computed logits for
    model = runner.model
    rows = sum(len(drafts[r]) + 1 for r in req_ids)
    h = torch.randn(rows, model.args.hidden_size, generator=torch.Generator().manual_seed(rows)).to(model.dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.lm_head(model.norm(h)).float()
        head_s = time.perf_counter() - t0
    out = {"step": step_s, "accept": step_s - forward_s, "lm_head": head_s}
    if stack is not None:
        gemm, attention, row_ops, _calls = stack
        out.update(gemm=gemm, attention=attention, row_ops=row_ops,
                   forward_rest=forward_s - gemm - attention - row_ops - head_s)
    else:
        out.update(forward_rest=forward_s - head_s)
    return {k: v * 1e3 for k, v in out.items()}


def _measure(cfg: SpindConfig, settings: BatchBenchSettings, progress: Progress) -> dict:
    engine = LocalEngine.load(cfg, drafters=[])
    try:
        verifier = engine.target
        need = max(settings.batches)
        windows = quality_windows(engine.tokenizer, settings.datasets_dir, need * settings.context, settings.context)
        req_ids = [f"b{i}" for i in range(need)]
        for r, window in zip(req_ids, windows):
            verifier.add_request(r, window, SamplingParams(temperature=0.0, max_tokens=1))
            verifier.prefill([(r, len(window) - 1)])
        drafts = {r: windows[i][:settings.k] for i, r in enumerate(req_ids)}  # any tokens: the cost is the rows
        ops = _stack_ops(verifier)
        for b in settings.batches:  # warm-up: per-shape state
            _round(verifier, req_ids[:b], drafts, ops)
        times: dict[int, dict[str, list[float]]] = {b: defaultdict(list) for b in settings.batches}
        for i in range(settings.rounds):
            for b in settings.batches:
                for phase, ms in _round(verifier, req_ids[:b], drafts, ops).items():
                    times[b][phase].append(ms)
            progress.step(f"{torch.get_num_threads()} threads: round {i + 1}/{settings.rounds} over B = "
                          f"{', '.join(map(str, settings.batches))}")
        rows = []
        for b in settings.batches:
            med = {phase: statistics.median(v) for phase, v in times[b].items()}
            tokens = b * (settings.k + 1)
            rows.append({"batch": b, "rows": tokens, "step_ms": med.pop("step"),
                         "tokens_per_s": tokens / statistics.median(times[b]["step"]) * 1e3, "phases_ms": med})
        base = rows[0]
        for r in rows:
            r["step_over_first"] = r["step_ms"] / base["step_ms"]
            r["throughput_over_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        return {"threads": torch.get_num_threads(), "stack_profiled": ops is not None, "rows": rows}
    finally:
        engine.close()


def run_batch_bench(cfg: SpindConfig, settings: BatchBenchSettings) -> dict:
    progress = Progress(total=settings.rounds * len(settings.threads))
    runs = []
    for threads in settings.threads:
        torch.set_num_threads(threads)
        cfg_t = dataclasses.replace(cfg, runtime=dataclasses.replace(
            cfg.runtime, threads=threads, adaptive_threads=False,
            max_batch_size=max(cfg.runtime.max_batch_size, max(settings.batches)),
            kv_num_blocks=max(configured_kv_blocks(cfg), max(settings.batches) * (
                -(-(settings.context + settings.k + 2) // cfg.runtime.kv_block_size)))))
        runs.append(_measure(cfg_t, settings, progress))
    print(f"done: {len(runs)} thread counts", file=sys.stderr)
    return {"settings": {**dataclasses.asdict(settings), "datasets_dir": str(settings.datasets_dir)},
            "environment": {"torch": torch.__version__, "cpu": _cpu_name(), "model": cfg.model.target,
                            "dtype": cfg.model.dtype, "attention": cfg.runtime.attention,
                            "kv_cache_dtype": cfg.runtime.kv_cache_dtype,
                            "kernels": cpu_ext.describe()},
            "runs": runs}


def render_tables(results: dict) -> str:
    s, env = results["settings"], results["environment"]
    what = "decode rows" if s["k"] == 0 else f"verifies of {s['k'] + 1} rows"
    parts = []
    for run in results["runs"]:
        phases = [p for p in PHASES if p in run["rows"][0]["phases_ms"]]
        parts.append(format_table(
            f"Where a batched step goes: {env['dtype']} target, B requests of {s['context']} KV tokens each, {what}, "
            f"{run['threads']} threads ({env['cpu'] or 'CPU'}, kernels {env['kernels'] or 'none'}, KV "
            f"{env['kv_cache_dtype']}); medians of {s['rounds']} interleaved rounds, ms",
            ["B", "rows", "step ms", "tok/s", *phases, "step / B=1", "tok/s / B=1"],
            [[str(r["batch"]), str(r["rows"]), fmt(r["step_ms"], 2), fmt(r["tokens_per_s"], 1),
              *(fmt(r["phases_ms"][p], 2) for p in phases), fmt(r["step_over_first"], 2),
              fmt(r["throughput_over_first"], 2)] for r in run["rows"]]))
    return "\n\n".join(parts)
