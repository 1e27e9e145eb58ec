"""`spind drafters`: every configured drafter, whether `auto` selection uses it on this machine and why not, with the
costs that decided it (ms per draft token against the target's decode step), read from the machine's start-up
profile (spind/coordinator/profile.py). Without --measure nothing loads: no torch, milliseconds."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from spind.bench.report import fmt, format_table
from spind.config import SpindConfig
from spind.coordinator.profile import SystemProfile, find_cached

MEASURE_HINT = ("`spind drafters --measure` loads the models and profiles them, as the first `spind start` or "
                "`spind generate` does (~10 s), and caches the profile")


def describe_drafters(cfg: SpindConfig, measure: bool = False) -> dict:
    """Every configured drafter, whether `auto` selection uses it on this machine and why not, from the machine's
    start-up profile: the cached one of this config (no model loaded), or with `measure` the one a start reads or
    measures (the models are loaded, as `spind start` loads them). {"policy", "rule": the bound and whether it
    applies, "profile": its numbers and path, or None when no start has profiled this config here, "note": what
    to do about a missing or unusable profile, or None, "drafters": one row each}."""
    if measure:
        measure_profile(cfg)
    cached = find_cached(cfg)
    path, profile = cached if cached is not None else (None, None)
    policy = cfg.selection.parsed_policy
    min_k = min(cfg.selection.k_set)
    rule_applies = policy.name == "lbss" and cfg.runtime.profile != "off"
    note = None
    if profile is None:
        note = f"No start-up profile of this config on this machine yet: {MEASURE_HINT}."
    elif rule_applies and profile.implausible() is not None:
        note = (f"The cached profile is implausible ({profile.implausible()}): the next start measures again, "
                f"so what auto leaves out is not known until then; {MEASURE_HINT}.")
    if not rule_applies:
        why = ("[runtime].profile is off: the daemon loads no profile, so auto leaves no drafter out"
               if policy.name == "lbss" else f"the selection policy is {cfg.selection.policy}, not lbss")
        note = f"The rule does not apply: {why}." + (f" {note}" if note else "")
    return {"policy": cfg.selection.policy,
            "rule": {"applies": rule_applies, "min_k": min_k, "max_cost_ratio": (min_k + 1) / min_k},
            "profile": None if profile is None else profile_summary(profile, path), "note": note,
            "drafters": drafter_rows(cfg, profile)}


def measure_profile(cfg: SpindConfig) -> None:
    """Load the models and read or measure this config's start-up profile, caching it, as `spind start` does. The
    engine profiles only for a policy that uses the costs, so the load runs under LBSS whatever the config's
    policy (the profile's cache key holds no policy): `--measure` measures for every config."""
    from spind.coordinator.transport.local import LocalEngine

    runtime = cfg.runtime if cfg.runtime.profile == "measure" else dataclasses.replace(cfg.runtime, profile="auto")
    engine = LocalEngine.load(dataclasses.replace(cfg, runtime=runtime,
                                                  selection=dataclasses.replace(cfg.selection, policy="lbss")))
    engine.close()


def profile_summary(profile: SystemProfile, path: Path | None) -> dict:
    """The target's side of the profile: ms of a plain decode step and of a verify of k + 1 tokens, at batch 1."""
    return {"path": None if path is None else str(path), "measured_at": profile.measured_at, "k": profile.k,
            "decode_ms": profile.decode_ms, "verify_ms": profile.verify_ms.get(1),
            "implausible": profile.implausible()}


def drafter_rows(cfg: SpindConfig, profile: SystemProfile | None) -> list[dict]:
    """One row per configured drafter: its measured ms per draft token, that cost over the target's decode step
    (`cost_ratio`, against the rule's bound (min_k + 1) / min_k), and whether `auto` selection uses it, with the
    reason when not (`used_by_auto` None: not known before a profile). The rule is the engine's own
    (Coordinator._build_selector): the selection policy's choice of drafters, less, under LBSS with a profile,
    what `SystemProfile.dominated_drafters` leaves out."""
    policy = cfg.selection.parsed_policy
    min_k = min(cfg.selection.k_set)
    bound = (min_k + 1) / min_k
    rule_applies = policy.name == "lbss" and cfg.runtime.profile != "off"
    usable = profile is not None and profile.implausible() is None
    dominated = set(profile.dominated_drafters(min_k)) if rule_applies and usable else set()
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
            used, why = False, f"a draft token costs {ratio:.2f} target steps >= {bound:.2f} (the rule)"
        elif rule_applies and profile is None:
            used, why = None, "not profiled on this machine yet"
        elif rule_applies and not usable:
            used, why = None, "the cached profile is implausible: the next start measures again"
        else:
            used, why = True, ""
        rows.append({"name": d.name, "kind": d.kind, "variant": d.variant, "worker": d.worker, "ms_per_token": ms,
                     "cost_ratio": ratio, "used_by_auto": used, "why_not": why})
    return rows


def render_drafters(table: dict) -> str:
    """The table of `describe_drafters` as text: the drafters, then the target's costs and the rule, or the note."""
    rows = table["drafters"]
    out = [format_table("configured drafters", ["name", "kind", "variant", "worker", "ms/draft-token",
                                                "x target step", "auto uses it", "why not"],
                        [[r["name"], r["kind"], r["variant"] or "-", r["worker"], fmt(r["ms_per_token"], 3),
                          fmt(r["cost_ratio"], 2), {True: "yes", False: "no", None: "?"}[r["used_by_auto"]],
                          r["why_not"] or "-"] for r in rows])]
    prof, rule = table["profile"], table["rule"]
    if prof is not None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(prof["measured_at"]))
        out.append(f"target: {fmt(prof['decode_ms'])} ms a plain decode step, {fmt(prof['verify_ms'])} ms a verify "
                   f"of k + 1 = {prof['k'] + 1} tokens, at batch 1 (profile of {when}: {prof['path']})")
    out.append(f"rule: auto leaves out a drafter whose draft token costs at least {rule['max_cost_ratio']:.2f} "
               f"target decode steps ((k + 1) / k at the smallest k of [selection].k_set, {rule['min_k']}): even "
               f"with every draft accepted and drafting hidden behind verification, it makes tokens slower than "
               f"plain decoding. Requests may still name it.")
    if table["note"]:
        out.append(table["note"])
    return "\n".join(out)
