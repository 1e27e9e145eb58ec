"""`spind bench pipeline`: what the speculative decoding pipeline buys, side by side in one run, one engine.

For each batch size, on the same requests through the same coordinator (its pipeline switched per run):
- `none`: plain decoding (the target takes every core: nothing drafts beside it);
- `lockstep`: the drafter, speculation and verification in turn (no pipeline);
- `pipe:b=N`: the pipeline with N micro-batches per SSM, N = 1 .. max (draft ahead on);
- `pipe:heuristic`: the pipeline with the paper's heuristic choosing N from the target's profile;
- at batch 1, `pipe:no-ahead` too: one micro-batch and no draft ahead, to show what drafting ahead adds.
Goodput is committed tokens per second of wall time (closed loop, `batch` clients); occupancy is each worker's
busy time by kind over the run's wall time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from spind.bench.datasets import Prompt, encode_prompt
from spind.bench.report import Progress, fmt, format_table
from spind.config import SpindConfig
from spind.coordinator.interface import EngineRequest
from spind.coordinator.microbatch import choose_micro_batches
from spind.coordinator.lockstep import Lockstep
from spind.coordinator.pipeline import Pipeline
from spind.params import SamplingParams


@dataclass(frozen=True)
class PipelineBenchSettings:
    batch_sizes: tuple[int, ...]
    drafter: str
    max_tokens: int
    max_micro_batches: int
    requests_per_client: int = 2
    k: int = 4


def modes(batch: int, max_b: int) -> list[tuple[str, int | None, bool]]:
    """(label, micro_batches (None: lockstep, 0: heuristic), draft ahead) of every run at one batch size."""
    out: list[tuple[str, int | None, bool]] = [("none", None, False), ("lockstep", None, False)]
    if batch == 1:
        out.append(("pipe:no-ahead", 1, False))
    out += [(f"pipe:b={b}", b, True) for b in range(1, min(max_b, batch) + 1)]
    return out + [("pipe:heuristic", 0, True)]


async def _closed_loop(coordinator, prompts: list[list[int]], clients: int, drafter: str, s: PipelineBenchSettings,
                       label: str) -> tuple[int, float]:
    todo = iter(range(len(prompts)))
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        for i in todo:
            req = EngineRequest(f"pipe-{label}-{i}", prompts[i], SamplingParams(max_tokens=s.max_tokens,
                                                                                  ignore_eos=True), drafter, s.k)
            async for d in coordinator.generate(req):
                tokens += len(d.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return tokens, time.perf_counter() - start


def _busy_totals(c) -> dict[str, float]:
    """worker:kind -> seconds busy since the coordinator started."""
    return {f"{w}:{k}": v for w, kinds in c.phases.history.busy_s.items() for k, v in kinds.items()}


def run_pipeline_bench(cfg: SpindConfig, s: PipelineBenchSettings, texts: list[Prompt]) -> dict:
    from spind.coordinator.transport.local import LocalEngine

    engine = LocalEngine.load(cfg, drafters=[s.drafter])  # pipeline on at start: the profile gets measured
    c = engine.coordinator
    prompts = [encode_prompt(engine.tokenizer, p) for p in texts]
    runs = [(b, m) for b in s.batch_sizes for m in modes(b, s.max_micro_batches)]
    progress = Progress(len(runs))
    rows = []
    try:
        for batch, (label, micro, ahead) in runs:
            engine.loop.run_until_complete(
                c.replace_loop(Lockstep(c.phases) if micro is None else Pipeline(c.phases, micro, ahead)))
            busy_before = _busy_totals(c)
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch * s.requests_per_client)]
            drafter = "none" if label == "none" else s.drafter
            tokens, wall = engine.loop.run_until_complete(_closed_loop(c, batch_prompts, batch, drafter, s, label))
            busy = {key: (v - busy_before.get(key, 0.0)) / wall for key, v in _busy_totals(c).items()
                    if v > busy_before.get(key, 0.0)}
            chosen = (c.loop.chosen_micro_batches.get(cfg.drafter(s.drafter).worker) if isinstance(c.loop, Pipeline)
                      else None)
            rows.append({"batch": batch, "mode": label, "micro_batches": micro if micro else chosen,
                         "tokens": tokens, "wall_s": wall, "goodput": tokens / wall, "occupancy": busy})
            progress.step(f"batch {batch} {label}: {tokens / wall:.1f} tokens/s")
    finally:
        engine.close()
    profile = c.phases.profile.to_json() if c.phases.profile else None
    return {"settings": asdict(s), "profile": profile, "rows": add_ratios(rows),
            "heuristic": {b: choose_micro_batches(c.phases.profile.verify_ms, b) if c.phases.profile else None
                          for b in s.batch_sizes}}


def add_ratios(rows: list[dict]) -> list[dict]:
    """x lockstep and x none of every row, within its batch size; and each batch size's best count."""
    for r in rows:
        same = {x["mode"]: x["goodput"] for x in rows if x["batch"] == r["batch"]}
        r["x_lockstep"] = r["goodput"] / same["lockstep"] if same.get("lockstep") else None
        r["x_none"] = r["goodput"] / same["none"] if same.get("none") else None
    return rows


def best_count(rows: list[dict], batch: int) -> tuple[int, float]:
    """The micro-batch count with the highest goodput at this batch size (from the b=N sweep)."""
    sweep = [(r["micro_batches"], r["goodput"]) for r in rows if r["batch"] == batch and r["mode"].startswith("pipe:b=")]
    return max(sweep, key=lambda x: x[1])


def render_tables(results: dict) -> str:
    s = results["settings"]
    header = ["batch", "mode", "micro-batches", "goodput tok/s", "x lockstep", "x none", "occupancy (busy/wall)"]
    rows = [[str(r["batch"]), r["mode"], fmt(r["micro_batches"], 0) if r["micro_batches"] else "-",
             fmt(r["goodput"], 1), fmt(r["x_lockstep"]), fmt(r["x_none"]),
             " ".join(f"{k}={v:.0%}" for k, v in sorted(r["occupancy"].items()))] for r in results["rows"]]
    title = (f"spind bench pipeline: drafter {s['drafter']}, k={s['k']}, {s['max_tokens']} tokens a request, "
             f"{s['requests_per_client']} requests per client")
    lines = [format_table(title, header, rows)]
    picks = []
    for batch in s["batch_sizes"]:
        best_b, best_g = best_count(results["rows"], batch)
        heur = next(r for r in results["rows"] if r["batch"] == batch and r["mode"] == "pipe:heuristic")
        picks.append([str(batch), str(heur["micro_batches"]), str(best_b), fmt(heur["goodput"] / best_g)])
    lines.append(format_table("The heuristic's pick against the best count of the sweep",
                              ["batch", "heuristic", "best", "goodput heuristic / best"], picks))
    return "\n\n".join(lines)


def write_plot(results: dict, path) -> object:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for batch in results["settings"]["batch_sizes"]:
        sweep = [(r["micro_batches"], r["goodput"]) for r in rows if r["batch"] == batch and r["mode"].startswith("pipe:b=")]
        line, = ax.plot(*zip(*sweep), marker="o", label=f"batch {batch}: pipeline")
        for mode, style in (("lockstep", "--"), ("none", ":")):
            g = next(r["goodput"] for r in rows if r["batch"] == batch and r["mode"] == mode)
            ax.axhline(g, linestyle=style, color=line.get_color(), alpha=0.6, label=f"batch {batch}: {mode}")
        heur = next(r for r in rows if r["batch"] == batch and r["mode"] == "pipe:heuristic")
        ax.plot([heur["micro_batches"]], [heur["goodput"]], "o", color="red", markersize=9)
    ax.set_xlabel("micro-batches per SSM (red: the heuristic's pick)")
    ax.set_ylabel("goodput (tokens/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
