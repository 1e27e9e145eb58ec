"""`spind bench select`: every selection policy side by side in the simulator, per workload.

One row per policy, each over the same requests and seed: goodput (mean expected tokens/s per request-slot,
at batch 1) and the oracle's on the same request-slots, the share of the oracle's goodput reached, regret
(summed g* - E[r] over request-slots, switch delays included), drafter switches per 100 request-slots,
requests finished, and the simulator's wall time with that selector. A last run times the simulator itself
on a large case: LBSS, 10^4 requests arriving faster than they finish, 10^4 slots of full batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from spind.bench.report import Progress, fmt, format_table
from spind.coordinator.selection.baselines import build_selector
from spind.coordinator.selection.lbss import SelectionConfig
from spind.coordinator.selection.protocol import Selector
from spind.policy import Policy
from spind.sim.simulator import simulate
from spind.sim.workload import Workload, load_profile
from spind.sim.workloads import ARRIVAL_RATE, build_workload

BASELINES = ("lbss", "epsilon-greedy", "greedy-length", "random", "none")


@dataclass(frozen=True)
class SelectBenchSettings:
    workloads: tuple[str, ...]
    policies: tuple[str, ...]  # empty: BASELINES, fixed:NAME for every drafter, and oracle
    num_requests: int
    max_slots: int
    seed: int
    profiles: tuple[Path, ...] = ()
    default_k: int = 4  # k of fixed:NAME, greedy-length and requests that name a drafter
    speed_requests: int = 10_000
    speed_slots: int = 10_000


def policies_for(w: Workload, asked: tuple[str, ...]) -> list[str]:
    return list(asked) or [*BASELINES, *(str(Policy("fixed", d)) for d in w.arm_set.drafters), "oracle"]


def draft_costs(w: Workload) -> dict[str, float]:
    """Seconds per drafted token per drafter, from the outcome tables (what greedy-length ranks by)."""
    o, out = w.outcomes, {}
    for j, d in enumerate(w.arm_set.drafters):
        arms = w.arm_set.drafter_of == j
        drafted = (o.prob[:, arms] * o.drafted[:, arms]).sum()
        out[d] = float((o.prob[:, arms] * o.draft_s[:, arms]).sum() / drafted) if drafted else 0.0
    return out


def make_selector(w: Workload, policy: str, s: SelectBenchSettings, cfg: SelectionConfig) -> Selector:
    return build_selector(policy, cfg, w.arm_set.drafters, s.default_k, costs=draft_costs(w), oracle=w.goodput_table())


def run_select_bench(s: SelectBenchSettings, cfg: SelectionConfig) -> dict:
    """Every policy on every workload, then the timed run; progress on stderr. Bad names fail before any run."""
    workloads = [build_workload(name, s.num_requests, k_set=cfg.k_set, arrival_rate=ARRIVAL_RATE[name], seed=s.seed)
                 for name in s.workloads]
    workloads += [load_profile(p, name=p.stem) for p in s.profiles]
    plans = [(w, policies_for(w, s.policies)) for w in workloads]
    for w, policies in plans:
        for policy in policies:
            make_selector(w, policy, s, cfg)
    is_timed = bool(s.speed_requests and s.speed_slots)
    progress = Progress(sum(len(policies) for _, policies in plans) + is_timed)
    out: dict = {"settings": {k: (list(map(str, v)) if isinstance(v, tuple) else v)
                              for k, v in dataclasses.asdict(s).items()},
                 "selection": dataclasses.asdict(cfg), "workloads": {}}
    for w, policies in plans:
        rows = out["workloads"][w.name] = []
        for policy in policies:
            rows.append(simulate(w, make_selector(w, policy, s, cfg), s.max_slots, seed=s.seed).summary())
            progress.step(f"{w.name} {policy}: {rows[-1]['goodput']:.2f} tok/s, regret {rows[-1]['regret_pct']:.1f}%")
    if is_timed:
        w = build_workload("mixed", s.speed_requests, k_set=cfg.k_set, arrival_rate=1.0, seed=s.seed)
        result = simulate(w, make_selector(w, "lbss", s, cfg), s.speed_slots, seed=s.seed)
        out["speed"] = {"workload": "mixed", "policy": "lbss", "num_requests": s.speed_requests,
                        "num_slots": result.num_slots, "request_slots": len(result.slot),
                        "num_finished": result.num_finished, "wall_s": result.wall_s}
        progress.step(f"simulator: {s.speed_requests} requests x {result.num_slots} slots in {result.wall_s:.1f}s")
    return out


def render_tables(results: dict) -> str:
    header = ["policy", "goodput", "oracle", "% of oracle", "regret", "switch/100", "finished", "sim s"]
    tables = []
    for name, rows in results["workloads"].items():
        body = [[r["policy"], fmt(r["goodput"]), fmt(r["oracle_goodput"]), fmt(100 - r["regret_pct"], 1),
                 f"{r['regret']:.3g}", fmt(r["switches_per_100"], 1), str(r["num_finished"]), fmt(r["wall_s"])]
                for r in rows]
        tables.append(format_table(f"{name}: goodput in tokens/s at batch 1, regret vs the oracle", header, body))
    speed = results.get("speed")
    if speed:
        tables.append(f"simulator wall time: {speed['num_requests']} requests x {speed['num_slots']} slots "
                      f"({speed['request_slots']} request-slots, {speed['policy']}): {speed['wall_s']:.2f}s")
    return "\n\n".join(tables)
