"""`spind bench batch`: where a batched target step's time goes as load grows (B = 1, 4, 8, 16 requests).

The target's own code path in one process (the worker's `TargetVerifier.verify` over the configured target: the
runner's metadata, the model's forward, acceptance), for B requests that each hold `--context` tokens of KV (windows
of AlpacaEval's reference outputs) and send a decode row (`--k 0`) or a (k+1)-row verify. Rounds are interleaved
over B and rolled back after each, so every round sees the same contexts. Per B, medians over rounds:
- ms per step and the tokens per second it gives (B (k+1) rows; a decode row is a token);
- where the step went: the decoder stack's GEMMs, its attention and its row-wise ops (RMSNorm, RoPE and the cache
  writes, SiLU x up, residual adds), timed inside the stack's one C++ call (`stack_profile`); the final norm and
  the lm_head, timed around their calls in the same forward (`_HeadTimer`); the rest of the forward (the runner's
  metadata, the attention plan, the embedding: Python and torch dispatch); acceptance and sampling after the
  forward. Every phase is a disjoint part of the step, so none reads below zero;
- the step at B over the step at 1, and throughput at B over throughput at 1.
Without the fused stack (no kernels, or a target that does not qualify) the stack's share is one `forward` column.
What this does not see is the daemon around it (IPC, the coordinator's slot): `spind bench serve` measures that.

`--against DIR` (another checkout, or its kernels/csrc) times a kernel change against its parent in one process:
the other sources are built under their own op namespace (`cpu_ext.build_other`), a second target is loaded on them,
and every round steps both, in alternating order, on the same contexts; per B, the median and quartiles of the
per-round ratios of this build's time to the other's, for the step, its GEMMs and its attention. Two daemons or two
runs minutes apart on a shared 2-core VM drift by more than a kernel change gains (18-40 % seen within an hour);
round-by-round pairs do not.

`--after-decodes N` steps the same requests N times as decode rows (untimed, rolled back) before each timed step:
the step as a server runs it after plain slots. Speculation at batch 1 alternates 1-row decode steps with
(k+1)-row verifies, and on AMD EPYC (Zen 5, 32 MB L3) the many-row GEMMs ran ~30% slower after a few 1-row GEMMs
had streamed the weights (the hardware prefetchers' state, `kernels/csrc/quant_gemm.cpp`): a verify timed after a
verify sees none of that.
"""

from __future__ import annotations

import contextlib
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
RATIO_PHASES = ("step", "gemm", "attention")  # what --against pairs round by round (the kernels' own phases)


@dataclass(frozen=True)
class BatchBenchSettings:
    batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 256  # KV tokens each request holds
    k: int = 0  # draft tokens per request: 0 = decode rows
    rounds: int = 16
    threads: tuple[int, ...] = (1,)
    datasets_dir: Path = DEFAULT_DATASETS_DIR
    against: Path | None = None  # another tree's kernel sources (kernels/csrc), timed beside this one's
    after_decodes: int = 0  # untimed decode steps (1 row a request) of the same requests before each timed round:
    #                        the step as it runs after plain slots (a CPU's many-row GEMMs can run slower after
    #                        the 1-row GEMMs streamed the weights: kernels/csrc/quant_gemm.cpp)


def _stack_ops(verifier: TargetVerifier):
    """The ops of the build the target runs when it runs the fused stack (their `stack_profile` times it), else
    None."""
    stack = verifier.runner.model.fused_stack
    return None if stack is None else stack.ops


class _HeadTimer:
    """Seconds spent in the model's final norm and lm_head calls while installed (forward hooks on both modules):
    the head's share of the very forward being timed. (It was a separate call on random rows after the step: cold,
    on a busy VM it read more than the forward spent there, and the forward's rest came out below zero.)"""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self._start = 0.0
        self._handles = []
        for module in (model.norm, model.lm_head):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, module, args) -> None:
        self._start = time.perf_counter()

    def _exit(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


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
    head = _HeadTimer(runner.model)
    try:
        start = time.perf_counter()
        verifier.verify(items)
        step_s = time.perf_counter() - start
    finally:
        del runner.forward
        head.remove()
        stack = ops.stack_profile(False).tolist() if ops is not None else None
    for r in req_ids:  # back to the same contexts for the next round
        runner.truncate(r, lengths[r])
        verifier.pending[r] = pending[r]
    head_s = head.seconds
    out = {"step": step_s, "accept": step_s - forward_s, "lm_head": head_s}
    if stack is not None:
        gemm, attention, row_ops, _calls = stack
        out.update(gemm=gemm, attention=attention, row_ops=row_ops,
                   forward_rest=forward_s - gemm - attention - row_ops - head_s)
    else:
        out.update(forward_rest=forward_s - head_s)
    return {k: v * 1e3 for k, v in out.items()}


@dataclass
class _Target:
    engine: LocalEngine
    req_ids: list[str]
    drafts: dict[str, list[int]]
    ops: object  # the stack's ops (None: no fused stack)

    @classmethod
    def load(cls, cfg: SpindConfig, settings: BatchBenchSettings, namespace: str | None = None) -> "_Target":
        """The target (on the kernels of op namespace `namespace`, default this build's), its requests prefilled
        with `--context` tokens each."""
        with cpu_ext.ops_from(namespace) if namespace else contextlib.nullcontext():
            engine = LocalEngine.load(cfg, drafters=[])
        try:
            verifier = engine.target
            need = max(settings.batches)
            windows = quality_windows(engine.tokenizer, settings.datasets_dir, need * settings.context,
                                      settings.context)
            req_ids = [f"b{i}" for i in range(need)]
            for r, window in zip(req_ids, windows):
                verifier.add_request(r, window, SamplingParams(temperature=0.0, max_tokens=1))
                verifier.prefill([(r, len(window) - 1)])
            drafts = {r: windows[i][:settings.k] for i, r in enumerate(req_ids)}  # any tokens: the cost is the rows
            return cls(engine, req_ids, drafts, _stack_ops(verifier))
        except BaseException:
            engine.close()
            raise

    def round(self, b: int, after_decodes: int = 0) -> dict[str, float]:
        """One timed step of the first b requests, after `after_decodes` untimed decode steps of them (each rolled
        back like the timed one)."""
        plain = dict.fromkeys(self.req_ids[:b], [])
        for _ in range(after_decodes):
            _round(self.engine.target, self.req_ids[:b], plain, None)
        return _round(self.engine.target, self.req_ids[:b], self.drafts, self.ops)


def _rows(settings: BatchBenchSettings, times: dict[int, dict[str, list[float]]]) -> list[dict]:
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
    return rows


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def _measure(cfg: SpindConfig, settings: BatchBenchSettings, progress: Progress, against: str | None) -> dict:
    targets = [_Target.load(cfg, settings)]
    try:
        if against is not None:
            targets.append(_Target.load(cfg, settings, against))
        for t in targets:
            for b in settings.batches:  # warm-up: per-shape state
                t.round(b, settings.after_decodes)
        times: list[dict[int, dict[str, list[float]]]] = [{b: defaultdict(list) for b in settings.batches}
                                                          for _ in targets]
        for i in range(settings.rounds):
            for b in settings.batches:
                # alternate which build steps first: the one after inherits the other's spinning pool helpers
                for j in (range(len(targets)) if i % 2 == 0 else reversed(range(len(targets)))):
                    for phase, ms in targets[j].round(b, settings.after_decodes).items():
                        times[j][b][phase].append(ms)
            progress.step(f"{torch.get_num_threads()} threads: round {i + 1}/{settings.rounds} over B = "
                          f"{', '.join(map(str, settings.batches))}")
        run = {"threads": torch.get_num_threads(), "stack_profiled": targets[0].ops is not None,
               "rows": _rows(settings, times[0])}
        if against is not None:
            ratios = []
            for b in settings.batches:
                ratio = {}
                for phase in RATIO_PHASES:
                    if phase in times[0][b] and phase in times[1][b]:
                        pairs = [x / y for x, y in zip(times[0][b][phase], times[1][b][phase]) if y > 0]
                        ratio[phase] = _quartiles(pairs)  # [q1, median, q3]
                ratios.append({"batch": b, "over_against": ratio})
            run["against"] = {"namespace": against, "rows": _rows(settings, times[1]), "ratios": ratios}
        return run
    finally:
        for t in targets:
            t.engine.close()


def run_batch_bench(cfg: SpindConfig, settings: BatchBenchSettings) -> dict:
    progress = Progress(total=settings.rounds * len(settings.threads))
    against = None
    if settings.against is not None:
        if not cpu_ext.available():
            raise RuntimeError(f"--against needs spind's CPU kernels: {cpu_ext.unavailable_reason()}")
        against = cpu_ext.build_other(settings.against)
        cpu_ext.tune_other_layout(against)  # each build in its faster AMX layout (this one's: at its model's load)
    runs = []
    for threads in settings.threads:
        torch.set_num_threads(threads)
        cfg_t = dataclasses.replace(cfg, runtime=dataclasses.replace(
            cfg.runtime, threads=threads, adaptive_threads=False,
            max_batch_size=max(cfg.runtime.max_batch_size, max(settings.batches)),
            kv_num_blocks=max(configured_kv_blocks(cfg), max(settings.batches) * (
                -(-(settings.context + settings.k + 2) // cfg.runtime.kv_block_size)))))
        runs.append(_measure(cfg_t, settings, progress, against))
    print(f"done: {len(runs)} thread counts", file=sys.stderr)
    return {"settings": {**dataclasses.asdict(settings), "datasets_dir": str(settings.datasets_dir),
                         "against": None if settings.against is None else str(settings.against)},
            "environment": {"torch": torch.__version__, "cpu": _cpu_name(), "model": cfg.model.target,
                            "dtype": cfg.model.dtype, "attention": cfg.runtime.attention,
                            "kv_cache_dtype": cfg.runtime.kv_cache_dtype,
                            "kernels": cpu_ext.describe()},
            "runs": runs}


def render_tables(results: dict) -> str:
    s, env = results["settings"], results["environment"]
    what = "decode rows" if s["k"] == 0 else f"verifies of {s['k'] + 1} rows"
    if s.get("after_decodes"):
        what += f", each after {s['after_decodes']} untimed decode steps"
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
        if "against" in run:
            other = run["against"]

            def ratio(q: list[float] | None) -> str:
                return "-" if q is None else f"{q[1]:.3f} ({q[0]:.2f}-{q[2]:.2f})"

            parts.append(format_table(
                f"This build / {s['against']} ({other['namespace']}), {run['threads']} threads: time per step, each "
                f"round's pair in turn; median (quartiles) of {s['rounds']} per-round ratios",
                ["B", "rows", "step ms", "against ms", *(f"{p} ratio" for p in RATIO_PHASES)],
                [[str(r["batch"]), str(r["rows"]), fmt(r["step_ms"], 2), fmt(o["step_ms"], 2),
                  *(ratio(q["over_against"].get(p)) for p in RATIO_PHASES)]
                 for r, o, q in zip(run["rows"], other["rows"], other["ratios"])]))
    return "\n\n".join(parts)
