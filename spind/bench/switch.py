"""`spind bench switch`: what switching a request's SSM costs, with and without the KV-precompute queue.

A request that has been drafting with one drafter (`--from`) switches to another (`--to`) that has not seen
it. Without precompute, the switch slot's Propose first catches the new drafter's KV up to the request's
context, then drafts k tokens: the slot waits for both. With precompute (what the coordinator does for a
request's likely drafters, in the worker's idle time), the catch-up has run before the slot and the Propose
only drafts. Measured on a real drafter worker (`Worker.answer`, the ops the daemon sends), per context
length, median over reps; the precompute's own time is reported too (hidden in idle time when there is any).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass

from spind import protocol as P
from spind.bench.report import Progress, fmt, format_table
from spind.config import SpindConfig
from spind.params import SamplingParams


@dataclass(frozen=True)
class SwitchBenchSettings:
    from_drafter: str
    to_drafter: str
    lengths: tuple[int, ...] = (64, 256, 1024)
    k: int = 4
    reps: int = 4  # the first of each cell warms up and is dropped


def run_switch_bench(cfg: SpindConfig, s: SwitchBenchSettings) -> dict:
    import torch

    from spind.coordinator.placement import threads_for
    from spind.worker.profile import probe_prompt
    from spind.worker.worker import Worker

    worker_name = cfg.drafter(s.to_drafter).worker
    if cfg.drafter(s.from_drafter).worker != worker_name:
        raise ValueError(f"--from {s.from_drafter} and --to {s.to_drafter} run on different workers; a switch "
                         f"within one worker is what this measures")
    torch.set_num_threads(threads_for(cfg, worker_name))  # the threads that worker gets in the daemon
    worker = Worker(worker_name, cfg)
    vocab = next(d.runner.model.args.vocab_size for d in worker.drafters.values() if hasattr(d, "runner"))
    seq = itertools.count(1)

    def op(msg):
        reply = worker.answer(msg)
        if isinstance(reply, P.ErrorReply):
            raise RuntimeError(reply.error)
        return reply

    def propose(rid: str, drafter: str, length: int) -> float:
        start = time.perf_counter()
        op(P.Propose(next(seq), 0, [P.ProposeItem(rid, drafter, length, [], s.k)]))
        return (time.perf_counter() - start) * 1e3

    rows = []
    progress = Progress(len(s.lengths) * 2 * s.reps)
    for length in s.lengths:
        prompt = probe_prompt(length, vocab)
        cell: dict[str, list[float]] = {"cold": [], "precomputed": [], "precompute": [], "steady": []}
        for mode in ("cold", "precomputed"):
            for rep in range(s.reps):
                rid = f"switch-{length}-{mode}-{rep}"
                op(P.AddRequest(next(seq), rid, prompt, SamplingParams(), False))
                propose(rid, s.from_drafter, length)  # it has been drafting with --from: that KV is current
                if mode == "precomputed":
                    start = time.perf_counter()
                    op(P.Precompute(next(seq), [P.PrecomputeItem(rid, s.to_drafter, length, [])]))
                    while worker.precompute_queue:  # what the worker's loop runs while no op waits
                        worker.run_precompute()
                    pre_ms = (time.perf_counter() - start) * 1e3
                switch_ms = propose(rid, s.to_drafter, length)
                steady_ms = propose(rid, s.to_drafter, length)  # the next slot on --to: no catch-up left
                op(P.FreeRequests(next(seq), [rid]))
                if rep:
                    cell[mode].append(switch_ms)
                    cell["steady"].append(steady_ms)
                    if mode == "precomputed":
                        cell["precompute"].append(pre_ms)
                progress.step(f"context {length} {mode}: switch slot {switch_ms:.1f} ms")
        med = {key: statistics.median(v) for key, v in cell.items()}
        rows.append({"context": length, "switch_cold_ms": med["cold"], "switch_precomputed_ms": med["precomputed"],
                     "steady_ms": med["steady"], "precompute_ms": med["precompute"],
                     "speedup": med["cold"] / med["precomputed"]})
    return {"settings": asdict(s), "model": cfg.model.target, "dtype": cfg.model.dtype, "worker": worker_name,
            "rows": rows}


def render_table(results: dict) -> str:
    s = results["settings"]
    header = ["context", "switch slot, cold ms", "switch slot, precomputed ms", "x faster", "steady slot ms",
              "precompute ms (idle time)"]
    rows = [[str(r["context"]), fmt(r["switch_cold_ms"], 1), fmt(r["switch_precomputed_ms"], 1), fmt(r["speedup"]),
             fmt(r["steady_ms"], 1), fmt(r["precompute_ms"], 1)] for r in results["rows"]]
    return format_table(f"spind bench switch: {s['from_drafter']} -> {s['to_drafter']} on worker "
                        f"{results['worker']}, k={s['k']}, median of {s['reps'] - 1} reps", header, rows)
