"""What the simulator replays: requests, and for every request and arm the distribution of one slot's outcome.

A `Workload` holds, per request i and arm a, a small categorical distribution over outcomes o (tables
`[R, A, O]`, zero-padded): the probability, tokens drafted / accepted / committed, and the draft and verify
seconds at batch 1. The same tables come from a parametric model (`parametric_outcomes`: per-token
acceptance, drafter and target costs) or from a profile measured on real runs (`load_profile`).

Seconds scale with the slot's batch size b as (1 + batch_slope * (b - 1)), the same factor for every arm,
so a request's best arm does not depend on the batch it runs in (each request has one x_i^* as in the
paper's regret), and with a per-slot time jitter J ~ lognormal(0, time_jitter) shared by the slot.

Profile JSON (`save_profile` / `load_profile` / `ProfileRecorder`):

    {"format": "spind-sim-profile", "version": 1,
     "drafters": ["ngram", "int8"], "k_set": [2, 4, 8],       # arms: none + every drafter at every k
     "batch_slope": 0.07, "time_jitter": 0.05,
     "prefill_s_per_token": {"ngram": 0.0, "int8": 0.0015},    # KV catch-up cost of a switch, per token
     "capacity": {"ngram": 16, "int8": 16}, "max_batch_size": 16,
     "requests": [{"req_id": "r0", "arrival_slot": 0, "num_tokens": 128, "num_prompt_tokens": 50,
                   "prompt_repetition": 0.1, "requested": "auto", "label": "chat",
                   "samples": {"none": [[weight, drafted, accepted, committed, draft_s, verify_s, batch_size],
                                        ...], "int8@2": [...], ...}}]}

Every request needs samples for every arm. A recorded sample has weight 1 and the seconds and batch size of
the slot it came from; the loader divides its seconds by the batch factor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spind.coordinator.selection.arms import ArmSet
from spind.coordinator.selection.protocol import AUTO, Arm, RequestInfo, SlotFeedback

PROFILE_FORMAT = "spind-sim-profile"
FIELDS = ("drafted", "accepted", "committed", "draft_s", "verify_s")


@dataclass
class Outcomes:
    """One slot's outcome distribution per request and arm; every array is [R, A, O]."""

    prob: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    committed: np.ndarray
    draft_s: np.ndarray  # seconds at batch 1
    verify_s: np.ndarray


@dataclass(kw_only=True)
class Workload:
    name: str
    arm_set: ArmSet
    req_ids: list[str]
    arrival_slot: np.ndarray  # [R] int
    num_tokens: np.ndarray  # [R] tokens to generate
    num_prompt_tokens: np.ndarray  # [R]
    prompt_repetition: np.ndarray  # [R]
    requested: list[str]  # [R] AUTO, a drafter name, or "none"
    labels: list[str]  # [R] request class, for reports
    outcomes: Outcomes
    prefill_s_per_token: np.ndarray  # [D] KV catch-up seconds per token on each drafter
    capacity: dict[str, int]
    max_batch_size: int
    batch_slope: float = 0.0
    time_jitter: float = 0.0

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    def goodput(self) -> np.ndarray:
        """[R, A] g_ij: expected reward E[committed / seconds] of one slot, at batch 1."""
        o = self.outcomes
        with np.errstate(invalid="ignore", divide="ignore"):
            per_outcome = np.where(o.prob > 0, o.committed / (o.draft_s + o.verify_s), 0.0)
        return (o.prob * per_outcome).sum(axis=2) * float(np.exp(self.time_jitter ** 2 / 2))

    def goodput_table(self) -> Callable[[str], dict[Arm, float]]:
        """req_id -> {Arm: g}: what the oracle selector is told."""
        g, index = self.goodput(), {r: i for i, r in enumerate(self.req_ids)}
        return lambda req_id: dict(zip(self.arm_set.arms, g[index[req_id]].tolist()))


def parametric_outcomes(arm_set: ArmSet, acceptance: np.ndarray, hit: np.ndarray, draft_s_per_token: np.ndarray,
                        miss_s: np.ndarray, step_s: float, verify_slope: float) -> Outcomes:
    """Outcome tables from the standard model of speculative decoding.

    acceptance, hit: [R, D] per-token acceptance while drafting, and the chance the drafter proposes at all
    (below 1 for prompt lookup, which drafts nothing when no n-gram matches). draft_s_per_token, miss_s: [D]
    seconds per drafted token, and of a propose that finds nothing. A verify of k drafts costs
    step_s * (1 + verify_slope * k). Outcome o <= k: o drafts accepted (leading run, probability
    p^o (1 - p), p^k for o = k), o + 1 committed; outcome k + 1: no proposal, a plain step.
    """
    num_requests = acceptance.shape[0]
    num_outcomes = max(arm_set.k_set) + 2
    shape = (num_requests, len(arm_set), num_outcomes)
    t = {f: np.zeros(shape) for f in ("prob", *FIELDS)}
    t["prob"][:, 0, 0], t["committed"][:, 0, 0], t["verify_s"][:, 0, 0] = 1.0, 1.0, step_s  # plain decoding
    p = np.clip(acceptance, 0.0, 0.999)
    for a, arm in enumerate(arm_set.arms[1:], start=1):
        j, k = arm_set.drafter_of[a], arm.k
        runs = np.arange(k + 1)  # [k + 1] accepted drafts
        leading = p[:, j, None] ** runs * np.where(runs < k, 1 - p[:, j, None], 1.0)  # [R, k + 1]
        t["prob"][:, a, :k + 1] = hit[:, j, None] * leading
        t["prob"][:, a, k + 1] = 1 - hit[:, j]
        t["accepted"][:, a, :k + 1] = runs
        t["committed"][:, a, :k + 2] = np.append(runs + 1, 1)
        t["drafted"][:, a, :k + 1] = k
        t["draft_s"][:, a, :k + 1] = k * draft_s_per_token[j]
        t["draft_s"][:, a, k + 1] = miss_s[j]
        t["verify_s"][:, a, :k + 1] = step_s * (1 + verify_slope * k)
        t["verify_s"][:, a, k + 1] = step_s
    return Outcomes(**t)


# -- profiles ---------------------------------------------------------------------------------------------------


def save_profile(w: Workload) -> dict:
    """The workload as a profile (each outcome a weighted sample at batch 1)."""
    o, arms = w.outcomes, w.arm_set
    requests = []
    for i, req_id in enumerate(w.req_ids):
        samples = {}
        for a, name in enumerate(arms.names):
            keep = np.flatnonzero(o.prob[i, a] > 0)
            samples[name] = [[float(o.prob[i, a, x]), *(float(getattr(o, f)[i, a, x]) for f in FIELDS), 1]
                             for x in keep]
        requests.append({"req_id": req_id, "arrival_slot": int(w.arrival_slot[i]), "num_tokens": int(w.num_tokens[i]),
                         "num_prompt_tokens": int(w.num_prompt_tokens[i]),
                         "prompt_repetition": float(w.prompt_repetition[i]), "requested": w.requested[i],
                         "label": w.labels[i], "samples": samples})
    return _header(w.arm_set, w.batch_slope, w.time_jitter, dict(zip(arms.drafters, w.prefill_s_per_token.tolist())),
                   w.capacity, w.max_batch_size) | {"requests": requests}


def _header(arm_set: ArmSet, batch_slope: float, time_jitter: float, prefill_s_per_token: Mapping[str, float],
            capacity: Mapping[str, int], max_batch_size: int) -> dict:
    return {"format": PROFILE_FORMAT, "version": 1, "drafters": list(arm_set.drafters), "k_set": list(arm_set.k_set),
            "batch_slope": batch_slope, "time_jitter": time_jitter, "prefill_s_per_token": dict(prefill_s_per_token),
            "capacity": dict(capacity), "max_batch_size": max_batch_size}


def load_profile(source: dict | str | Path, name: str = "profile") -> Workload:
    """A Workload from a profile dict or JSON file; raises ValueError naming what is missing."""
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if data.get("format") != PROFILE_FORMAT or data.get("version") != 1:
        raise ValueError(f"not a {PROFILE_FORMAT} version 1 document")
    arm_set = ArmSet(data["drafters"], data["k_set"])
    slope = float(data.get("batch_slope", 0.0))
    requests = data["requests"]
    num_outcomes = max(len(s) for r in requests for s in r["samples"].values())
    t = {f: np.zeros((len(requests), len(arm_set), num_outcomes)) for f in ("prob", *FIELDS)}
    for i, r in enumerate(requests):
        for a, arm_name in enumerate(arm_set.names):
            rows = np.array(r["samples"].get(arm_name, []), dtype=float).reshape(-1, 2 + len(FIELDS))
            if len(rows) == 0:
                raise ValueError(f"profile request {r['req_id']!r} has no samples for arm {arm_name!r}")
            n = len(rows)
            t["prob"][i, a, :n] = rows[:, 0] / rows[:, 0].sum()
            factor = 1 + slope * (rows[:, -1] - 1)  # seconds at batch b -> at batch 1
            for f, column in zip(FIELDS, rows[:, 1:-1].T):
                t[f][i, a, :n] = column / factor if f.endswith("_s") else column
    def column(key: str, default: object = None) -> list:
        return [r.get(key, default) for r in requests]

    prefill = data.get("prefill_s_per_token", {})
    return Workload(name=name, arm_set=arm_set, req_ids=column("req_id"),
                    arrival_slot=np.array(column("arrival_slot", 0)), num_tokens=np.array(column("num_tokens")),
                    num_prompt_tokens=np.array(column("num_prompt_tokens")),
                    prompt_repetition=np.array(column("prompt_repetition", 0.0), dtype=float),
                    requested=column("requested", AUTO), labels=column("label", ""), outcomes=Outcomes(**t),
                    prefill_s_per_token=np.array([prefill.get(d, 0.0) for d in arm_set.drafters], dtype=float),
                    capacity=dict(data["capacity"]), max_batch_size=int(data["max_batch_size"]), batch_slope=slope,
                    time_jitter=float(data.get("time_jitter", 0.0)))


class ProfileRecorder:
    """Collects a real run's feedback into a profile: feed it every request (`add_request`) and every
    SlotFeedback (`add`). Replayable once each request has run on every arm (a bench that runs each prompt
    on each arm in turn)."""

    def __init__(self, drafters: Sequence[str], k_set: Sequence[int], prefill_s_per_token: Mapping[str, float],
                 capacity: Mapping[str, int], max_batch_size: int, batch_slope: float = 0.0) -> None:
        self.header = _header(ArmSet(drafters, k_set), batch_slope, 0.0, prefill_s_per_token, capacity, max_batch_size)
        self.requests: dict[str, dict] = {}

    def add_request(self, info: RequestInfo, num_tokens: int, arrival_slot: int = 0, label: str = "") -> None:
        self.requests[info.req_id] = {
            "req_id": info.req_id, "arrival_slot": arrival_slot, "num_tokens": num_tokens,
            "num_prompt_tokens": info.num_prompt_tokens, "prompt_repetition": info.prompt_repetition,
            "requested": AUTO, "label": label, "samples": {}}

    def add(self, fb: SlotFeedback) -> None:
        samples = self.requests[fb.req_id]["samples"].setdefault(fb.arm.name, [])
        samples.append([1, fb.num_drafted, fb.num_accepted, fb.num_committed, fb.draft_s, fb.verify_s, fb.batch_size])

    def to_json(self) -> dict:
        return self.header | {"requests": list(self.requests.values())}

