"""`spind drafters`: every configured drafter, whether `auto` selection uses it on this machine and why not, with the
costs that decided it (ms per draft token against the target's decode step), read from the machine's start-up
profile (spind/coordinator/profile.py). Without --measure nothing loads: no torch, milliseconds."""

from __future__ import annotations

import time
from pathlib import Path

from spind.bench.report import fmt, format_table
from spind.config import SpindConfig
from spind.coordinator.profile import SystemProfile, find_cached


def describe_drafters(cfg: SpindConfig, measure: bool = False) -> dict:
    """Every configured drafter, whether `auto` selection uses it on this machine and why not, from the machine's
    start-up profile: the cached one of this config (no model loaded), or with `measure` the one a start reads or
    measures (the models are loaded, as `spind start` loads them). {"profile": its numbers and path, or None when no
    start has profiled this config here; "drafters": one row each}."""
    if measure:
        from spind.coordinator.transport.local import LocalEngine

        engine = LocalEngine.load(cfg)  # reads the cached profile, or measures and caches it
        engine.close()
    cached = find_cached(cfg)
    path, profile = cached if cached is not None else (None, None)
    return {"profile": None if profile is None else profile_summary(cfg, profile, path),
            "drafters": drafter_rows(cfg, profile)}


def profile_summary(cfg: SpindConfig, profile: SystemProfile, path: Path | None) -> dict:
    min_k = min(cfg.selection.k_set)
    return {"path": None if path is None else str(path), "measured_at": profile.measured_at, "k": profile.k,
            "decode_ms": profile.decode_ms, "verify_ms": profile.verify_ms.get(1),
            "min_k": min_k, "max_cost_ratio": (min_k + 1) / min_k}


def drafter_rows(cfg: SpindConfig, profile: SystemProfile | None) -> list[dict]:
    """One row per configured drafter: its measured ms per draft token, that cost over the target's decode step,
    and whether `auto` selection uses it, with the reason when not. The rule is the engine's own: the selection
    policy's choice of drafters, less, under LBSS, what `SystemProfile.dominated_drafters` leaves out."""
    policy = cfg.selection.parsed_policy
    min_k = min(cfg.selection.k_set)
    dominated = set(profile.dominated_drafters(min_k)) if profile is not None and policy.name == "lbss" else set()
    rows = []
    for d in cfg.drafters:
        ms = profile.draft_ms_per_token.get(d.name) if profile is not None else None
        ratio = ms / profile.decode_ms if ms is not None and profile.decode_ms else None
        if policy.name == "none":
            used, why = False, "the selection policy is none: auto decodes plainly"
        elif policy.drafter:
            used = d.name == policy.drafter
            why = "" if used else f"the selection policy is fixed on {policy.drafter}"
        elif d.name in dominated:
            used, why = False, f"a draft token costs {ratio:.2f} target steps >= {(min_k + 1) / min_k:.2f} (the rule)"
        elif profile is None and policy.name == "lbss":
            used, why = None, "not profiled on this machine yet"
        else:
            used, why = True, ""
        rows.append({"name": d.name, "kind": d.kind, "variant": d.variant, "worker": d.worker, "ms_per_token": ms,
                     "cost_ratio": ratio, "used_by_auto": used, "why_not": why})
    return rows


def render_drafters(table: dict) -> str:
    rows = table["drafters"]
    out = [format_table("configured drafters", ["name", "kind", "variant", "worker", "ms/draft-token",
                                                "x target step", "auto uses it", "why not"],
                        [[r["name"], r["kind"], r["variant"] or "-", r["worker"], fmt(r["ms_per_token"], 3),
                          fmt(r["cost_ratio"], 2), {True: "yes", False: "no", None: "?"}[r["used_by_auto"]],
                          r["why_not"] or "-"] for r in rows])]
    prof = table["profile"]
    if prof is None:
        out.append("No start-up profile of this config on this machine yet: `spind drafters --measure` loads the "
                   "models and profiles them, as the first `spind start` or `spind generate` does (~10 s).")
    else:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(prof["measured_at"]))
        out.append(f"target: {fmt(prof['decode_ms'])} ms a decode step, {fmt(prof['verify_ms'])} ms a verify of "
                   f"k + 1 = {prof['k'] + 1} tokens, at batch 1 (profile of {when}: {prof['path']})")
        out.append(f"rule: auto leaves out a drafter whose draft token costs at least {prof['max_cost_ratio']:.2f} "
                   f"target decode steps ((k + 1) / k at the smallest k, {prof['min_k']}): even with every draft "
                   f"accepted and drafting hidden behind verification, it makes tokens slower than plain decoding. "
                   f"Requests may still name it.")
    return "\n".join(out)
