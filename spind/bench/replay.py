"""`spind bench replay`: the systems' selection replayed over recorded greedy outputs (`spind.sim.replay`), side by
side per workload and batch size: tokens per second by the cost model, ratios to plain decoding and to the best
fixed system, the share of request-slots decoded plainly, the share of slots `spin`'s regime trial ran plainly, the
drafters' shares, and what selection ended with (the free drafters it left out, whether it idled). Deterministic: a
selector change is judged on the same slots, without the machine's noise, where `spind bench e2e` cannot resolve a few
per cent; `--noise` adds a modelled host's (`sim.replay.HostNoise`, drawn by --seed) to judge what decisions made
from measured seconds, the regime trial's, lose to it.

The outputs are recorded once with the real target (plain decoding, greedy: what every lossless system commits),
and cached under the cache folder by model, prompts and max_tokens; the verify costs come from the machine's start-up
profile (measured, or the cached one), and each free drafter's call cost is timed on the recording."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from spind.bench.datasets import DEFAULT_DATASETS_DIR, encode_prompt, sample_workload
from spind.bench.report import Progress, fmt, format_table
from spind.config import SpindConfig
from spind.coordinator.profile import SystemProfile
from spind.policy import Policy
from spind.sim.replay import FREE_DRAFTERS, HostNoise, Recorded, ReplayCosts, measure_call_costs, replay


@dataclass(frozen=True)
class ReplaySettings:
    workloads: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    systems: tuple[str, ...]  # none | fixed:NAME[@K] | spin; NAME one of the free drafters
    num_requests: int = 32
    max_tokens: int = 96
    seed: int = 0
    datasets_dir: Path = DEFAULT_DATASETS_DIR
    profile: Path | None = None  # a profile JSON; None: the machine's, for the config's target
    recordings_dir: Path | None = None  # where recorded outputs are cached; None: the cache folder's replay/
    noise: tuple[float, float] = (0.0, 0.0)  # the host's (slot_sd, drift_sd), drawn by seed (`HostNoise`)
    select_ms: float | None = None  # a fully selected slot's selecting, ms; None: ReplayCosts' model
    hidden_ms: float = 0.0  # what a selected slot costs unseen by the selector, ms (`ReplayCosts.hidden_s`)

    def check(self) -> None:
        if min(self.num_requests, self.max_tokens, *self.batch_sizes) < 1:
            raise ValueError("--num-requests, --max-tokens and --batch-size must be >= 1")
        if min(self.noise) < 0 or (self.select_ms is not None and self.select_ms < 0) or self.hidden_ms < 0:
            raise ValueError("--noise, --select-ms and --hidden-ms must be >= 0")
        for name in self.systems:
            if name == "spin":
                continue
            p = Policy.parse(name)
            if not (p.is_plain or p.is_fixed and p.drafter in FREE_DRAFTERS):
                raise ValueError(f"system {name!r}: replay runs none, spin and fixed:NAME[@K] of the free drafters "
                                 f"({', '.join(FREE_DRAFTERS)})")
        from spind.bench.datasets import WORKLOADS

        for name in self.workloads:
            if name not in WORKLOADS and name != "mix" and not ("/" in name or name.endswith((".json", ".jsonl"))):
                raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}, mix, or a prompt file")
        if not self.workloads:
            raise ValueError("need at least one workload")
        if "none" not in self.systems:
            raise ValueError("--systems needs none: the ratios are to plain decoding")


def _cache_file(cfg: SpindConfig, s: ReplaySettings, prompts: list[list[int]]) -> Path:
    key = json.dumps([cfg.model.target, cfg.model.dtype, s.max_tokens, prompts])
    folder = s.recordings_dir if s.recordings_dir is not None else cfg.cache_path / "replay"
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def record(cfg: SpindConfig, workload: str, s: ReplaySettings, progress: Progress) -> tuple[list[Recorded], Path]:
    """The workload's requests with their plain greedy outputs from the real target, cached (and where cached)."""
    from spind.bench.e2e import _drive, _load, parse_system
    from spind.bench.e2e_records import E2ESettings
    from spind.models.loader import resolve_model_dir
    from spind.tokenizer import Tokenizer

    texts = sample_workload(workload, s.num_requests, s.seed, s.datasets_dir)
    tokenizer = Tokenizer(resolve_model_dir(cfg.model.target, cfg.cache_path))
    prompts = [encode_prompt(tokenizer, p) for p in texts]
    labels = [p.category or p.dataset for p in texts]
    path = _cache_file(cfg, s, prompts)
    if path.is_file():
        raw = json.loads(path.read_text())
        progress.note(f"{workload}: the recorded outputs in {path}")
        return [Recorded(p, o, lab) for p, o, lab in raw["requests"]], path
    progress.note(f"{workload}: recording plain decoding's outputs ({len(prompts)} requests)")
    e2e = E2ESettings(workload=workload, num_requests=len(prompts), batch_size=8, max_tokens=s.max_tokens,
                      systems=("none",))
    engine = _load(cfg, parse_system("none", cfg), prompts, e2e)
    try:
        with open(os.devnull, "w") as quiet:  # the bench's own progress counts the replays
            records, _, _ = engine.loop.run_until_complete(
                _drive(engine.coordinator, prompts, labels, e2e, "none", Progress(len(prompts), quiet), "record"))
    finally:
        engine.close()
    out = [Recorded(prompts[r.index], list(r.token_ids), labels[r.index])
           for r in sorted(records, key=lambda r: r.index)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": cfg.model.target, "max_tokens": s.max_tokens,
                                "requests": [[r.prompt, r.output, r.label] for r in out]}))
    return out, path


def machine_profile(cfg: SpindConfig) -> SystemProfile:
    """The start-up profile of the config's target on this machine (the cached one, else measured now)."""
    from spind.coordinator.profile import load_or_measure
    from spind.coordinator.transport.local import LocalEngine

    engine = LocalEngine.load(cfg, drafters=[])
    try:
        return engine.loop.run_until_complete(load_or_measure(engine.pool, engine.cfg, 600.0))
    finally:
        engine.close()


def run_replay_bench(cfg: SpindConfig, s: ReplaySettings) -> dict:
    s.check()
    progress = Progress(len(s.workloads) * len(s.batch_sizes) * len(s.systems))
    if s.profile is not None:
        profile = SystemProfile.from_json(json.loads(s.profile.read_text()))
    else:
        progress.note("the machine's start-up profile (verify costs)")
        profile = machine_profile(cfg)
    rows, recordings, calls = [], {}, {}
    for workload in s.workloads:
        recorded, path = record(cfg, workload, s, progress)
        recordings[workload] = str(path)
        calls[workload] = measure_call_costs(recorded)
        costs = ReplayCosts.from_profile(profile, calls[workload])
        costs = replace(costs, hidden_s=s.hidden_ms * 1e-3)
        if s.select_ms is not None:
            costs = replace(costs, select_s=s.select_ms * 1e-3)
        noise = HostNoise(*s.noise, seed=s.seed)
        for b in s.batch_sizes:
            results = {}
            for name in s.systems:
                results[name] = replay(recorded, name, b, costs, cfg.selection, k=cfg.speculation.k, noise=noise)
                progress.step(f"{workload} batch {b} {name}: {results[name].tokens_per_s:.1f} tok/s")
            none = results["none"].tokens_per_s
            fixed = [r.tokens_per_s for n, r in results.items() if n.startswith("fixed:")]
            best = max([none, *fixed])
            for name, r in results.items():
                sel = r.selection or {}
                rows.append({"workload": workload, "batch_size": b, "system": name, "tokens_per_s": r.tokens_per_s,
                             "vs_none": r.tokens_per_s / none, "vs_best": r.tokens_per_s / best,
                             "plain_share": r.plain_share, "slots": r.slots, "tokens": r.tokens,
                             "drafted_slots": r.drafted_slots, "select_ms_per_slot": r.select_s / r.slots * 1e3,
                             "shadow_ms_per_slot": r.shadow_s / r.slots * 1e3,
                             "plain_regime_share": r.plain_regime_slots / r.slots,
                             "regime": sel.get("regime"),
                             "dominated": sel.get("dominated"), "idle": sel.get("idle"), "ledger": sel.get("ledger")})
    paths = {k: None if v is None else str(v) for k, v in asdict(s).items() if isinstance(v, Path) or v is None}
    return {"settings": {**asdict(s), **paths},
            "profile": profile.to_json(), "call_costs": calls, "recordings": recordings, "rows": rows}


def render_table(results: dict) -> str:
    header = ["workload", "batch", "system", "tok/s", "x none", "x best", "plain slots", "trial plain",
              "drafter shares", "select ms/slot", "left out", "idle"]
    out = []
    for r in results["rows"]:
        drafted = sum(r["drafted_slots"].values())
        shares = " ".join(f"{d}:{n / max(1, drafted):.0%}" for d, n in sorted(r["drafted_slots"].items())) or "-"
        out.append([r["workload"], str(r["batch_size"]), r["system"], fmt(r["tokens_per_s"], 1), fmt(r["vs_none"], 3),
                    fmt(r["vs_best"], 3), f"{r['plain_share']:.0%}",
                    "-" if r["regime"] is None else f"{r['plain_regime_share']:.0%}", shares,
                    fmt(r["select_ms_per_slot"], 3),
                    ",".join(r["dominated"]) if r["dominated"] else "-", "-" if r["idle"] is None else str(r["idle"])])
    s = results["settings"]
    title = (f"spind bench replay: selection replayed over plain decoding's recorded outputs, {s['num_requests']} "
             f"requests x {s['max_tokens']} tokens, seconds from the start-up profile (x best: to the best of none "
             f"and the fixed systems; trial plain: the slots spin's regime trial ran plainly)")
    if any(s["noise"]):
        title += f"; host noise (slot sd, drift sd) {tuple(s['noise'])}, drawn by seed {s['seed']}"
    if s["hidden_ms"]:
        title += f"; {s['hidden_ms']} ms a selected slot unseen by the selector"
    return format_table(title, header, out)
