"""Selection replayed over recorded greedy outputs: the real selector and the real free drafters, time from a cost
model, so a selector change is judged without the machine's noise.

Under greedy decoding every system's output is the plain decoding one (lossless), so what a system does with a
request is fully determined by its prompt and that recorded output: each slot, the selector chooses the arms
(`select`), the free drafters (n-gram lookup, suffix decoding: lookups, run here for real) draft and are cut by the
selector's rules (`CutRule`), the draft is accepted up to its first token that differs from the recording, and the
selector learns from the feedback, shadow drafts included, exactly as the coordinator feeds it (`SlotPhases`). Only
the seconds are modelled: a verify forward of B requests and T tokens from the machine's start-up profile (per batch
size, its profiled forwards joined by straight lines: one token each, one request with k more, every request with k
more), and each drafter call as a fixed part and a part per token
the drafter took in since its last call (suffix decoding inserts them into the request's trie), measured on this
machine before the replay (`measure_call_costs`); a fully selected slot's selecting, as a fixed cost (`select_s`: the
daemon's coordinator, measured there). The selector learns only modelled seconds, so two replays of one recording
decide alike, slot for slot. `spin` runs the lockstep's regime trial (`selection/regime.py`) as the daemon does, its
windows measured by the modelled seconds; `HostNoise` scales each slot's seconds as a shared host does, so that
what the selector and the trial learn from measured time can be judged against a known truth.

What it leaves out: model drafters (their drafts need the models; selection leaves them out on CPUs where they cannot
pay, `SystemProfile.dominated_drafters`), the pipeline's overlap of drafting and verification, and the coordinator's
per-request costs beyond `base_s` a slot. `spind bench replay` records the outputs with the real target and replays
the systems side by side.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import isotonic_regression

from spind.config import SelectionConfig
from spind.coordinator.profile import SystemProfile
from spind.coordinator.selection.baselines import build_selector
from spind.coordinator.selection.lbss import NUM_BUCKETS, bucket_of
from spind.coordinator.selection.protocol import AUTO, PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.coordinator.selection.regime import MIN_BATCH, PLAIN, RegimeTrial
from spind.coordinator.selection.shadow import SHADOW_K, ShadowDrafts, is_shadow_turn
from spind.drafters.base import Draft, DraftInput, Drafter, cut_at
from spind.drafters.ngram import NgramDrafter
from spind.drafters.suffix import SuffixDrafter
from spind.params import SamplingParams
from spind.policy import Policy

FREE_DRAFTERS = ("ngram", "suffix")


@dataclass(frozen=True)
class Recorded:
    prompt: list[int]
    output: list[int]  # plain greedy decoding's tokens (what every lossless system commits)
    label: str = ""


@dataclass(frozen=True)
class ReplayCosts:
    curves: dict[int, tuple[tuple[int, float], ...]]  # batch size -> (tokens past one each, seconds) of its
    #                                                   profiled forwards, the fewest first
    points: list[tuple[int, int, float]]  # the profile's measured forwards (SystemProfile.verify_points): the
    #                                       selector's verify-cost prior, as the daemon gives it
    calls: dict[str, tuple[float, float]]  # drafter -> (seconds a propose call, per token it takes in)
    base_s: float = 0.15e-3  # the coordinator's own seconds a slot, every system alike
    select_s: float = 0.25e-3  # the coordinator's seconds choosing a fully selected slot's arms (LBSS, not idle)
    settled_s: float = 0.12e-3  # ... a slot settled on one drafter's (`LBSSSelector._settle`: its cut alone);
    #   through `bench e2e` (mtbench, batch 1) a settled `spin` coordinator took 0.06 ms a slot more than
    #   fixed:suffix's, a fully selecting one 0.13 ms: select_s scaled by that

    hidden_s: float = 0.0  # what a selected slot costs that no feedback shows the selector: on a CPU whose cores the
    #                        target uses, the coordinator's selecting slows its forward (what the regime trial is for)

    @classmethod
    def from_profile(cls, profile: SystemProfile, calls: dict[str, tuple[float, float]],
                     base_s: float = 0.15e-3, select_s: float = 0.25e-3, settled_s: float = 0.12e-3) -> ReplayCosts:
        by_batch: dict[int, dict[int, list[float]]] = {}
        for b, t, seconds in profile.verify_points():
            by_batch.setdefault(b, {}).setdefault(t - b, []).append(seconds)
        curves = {b: _non_decreasing(c) for b, c in sorted(by_batch.items()) if 0 in c and len(c) > 1}
        if not curves:
            raise ValueError("the profile has no batch sizes with both a 1-token and a verify forward")
        return cls(curves, profile.verify_points(), dict(calls), base_s, select_s, settled_s)

    def verify_s(self, batch: int, tokens: int) -> float:
        """A forward of `batch` requests and `tokens` tokens: each profiled batch size's forwards joined by straight
        lines in the tokens past one each (past its last, the last line's slope), interpolated between batch
        sizes."""
        sizes = sorted(self.curves)
        lo = max([b for b in sizes if b <= batch] or [sizes[0]])
        hi = min([b for b in sizes if b >= batch] or [sizes[-1]])
        w = 0.0 if hi == lo else (batch - lo) / (hi - lo)
        extra = max(0, tokens - batch)
        one = (1 - w) * self.curves[lo][0][1] + w * self.curves[hi][0][1]
        more = (1 - w) * _along(self.curves[lo], extra) + w * _along(self.curves[hi], extra)
        if batch > sizes[-1]:  # past the largest profiled batch: its one-token forward, scaled
            one *= batch / sizes[-1]
        return one + more

    def call_s(self, drafter: str, taken_in: int) -> float:
        fixed, per_token = self.calls.get(drafter, (0.0, 0.0))
        return fixed + per_token * taken_in


def _non_decreasing(timed: dict[int, list[float]]) -> tuple[tuple[int, float], ...]:
    """One batch size's profiled forwards (tokens past one each -> the seconds of each timing) as the closest curve
    that never falls as tokens are added (least squares, each point weighed by its timings: isotonic regression). A
    profile timed on a busy host can read a 5-token forward faster than the 4-token one (one of a 2-core Xeon's, at
    batch 4: 16.2 against 18.7 ms); joined as they lie, one request's first draft token was a free lunch in every
    replayed slot."""
    extras = sorted(timed)
    fit = isotonic_regression([float(np.mean(timed[x])) for x in extras], weights=[len(timed[x]) for x in extras])
    return tuple(zip(extras, (float(y) for y in fit.x)))


def _along(curve: tuple[tuple[int, float], ...], extra: int) -> float:
    """Seconds the curve's forwards add over its first (extra = 0) for `extra` tokens: linear between its points."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if extra <= x1 or (x1, y1) == curve[-1]:
            return y0 - curve[0][1] + (y1 - y0) * (extra - x0) / (x1 - x0)
    return 0.0


@dataclass(frozen=True)
class HostNoise:
    """A shared host's hand in each slot's seconds: every second of slot i (the forward, the drafting, the selecting)
    takes exp(drift_i + jitter_i) times its modelled length, jitter ~ N(0, slot_sd) slot by slot, drift a slow
    random walk pulled back to 0 (AR(1): stationary spread drift_sd, correlation over ~drift_slots slots: another
    tenant's load coming and going). The selector and the regime trial then learn from noisy seconds, as in the
    daemon: what the noise costs a decision made from measured time is measured without the host's own. The factors
    depend on the slot's index and the seed alone, so every system of a replay meets the same host."""
    slot_sd: float = 0.0
    drift_sd: float = 0.0
    drift_slots: float = 50.0
    seed: int = 0

    def factors(self) -> Iterator[float]:
        rng = np.random.default_rng(self.seed)
        rho = math.exp(-1.0 / max(1.0, self.drift_slots))
        drift = rng.normal(0.0, self.drift_sd)
        while True:
            yield math.exp(drift + rng.normal(0.0, self.slot_sd))
            drift = rho * drift + rng.normal(0.0, self.drift_sd * math.sqrt(1.0 - rho * rho))


@dataclass
class ReplayResult:
    system: str
    batch_size: int
    tokens: int = 0
    seconds: float = 0.0
    slots: int = 0
    request_slots: int = 0
    drafted_slots: dict[str, int] = field(default_factory=dict)  # drafter -> request slots it drafted tokens in
    select_s: float = 0.0  # the selector's calls before the verify, timed (and charged)
    shadow_s: float = 0.0  # modelled shadow drafting
    selection: dict | None = None  # the selector's describe() at the end (learning selectors)
    plain_regime_slots: int = 0  # slots the regime trial ran plainly (`selection/regime.py`)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def plain_share(self) -> float:
        return 1.0 - sum(self.drafted_slots.values()) / max(1, self.request_slots)


def make_drafter(name: str) -> Drafter:
    if name == "ngram":
        return NgramDrafter(name)
    if name == "suffix":
        return SuffixDrafter(name)
    raise ValueError(f"replay runs the free drafters only ({', '.join(FREE_DRAFTERS)}), not {name!r}")


class _Calls:
    """Each drafter's modelled seconds per call: what it takes in since its last call on the request."""

    def __init__(self, costs: ReplayCosts) -> None:
        self.costs = costs
        self.seen: dict[tuple[str, str], int] = {}

    def __call__(self, drafter: str, req_id: str, num_tokens: int) -> float:
        taken_in = num_tokens - self.seen.get((drafter, req_id), num_tokens - 1)
        self.seen[(drafter, req_id)] = num_tokens
        return self.costs.call_s(drafter, taken_in)


def replay(recording: Sequence[Recorded], system: str, batch_size: int, costs: ReplayCosts,
           selection: SelectionConfig | None = None, drafters: Sequence[str] = FREE_DRAFTERS,
           k: int = 4, noise: HostNoise | None = None) -> ReplayResult:
    """Closed loop of `batch_size` streams over the recording, in order. system: none | fixed:NAME[@K] | spin (LBSS
    over `drafters`, with the lockstep's regime trial where `selection.regime_trial`: a slot the trial runs plainly
    is not selected, shadowed or learned from, as `SlotPhases.select(plain=True)`). Every request commits exactly
    its recorded output. noise: the host's hand in each slot's seconds (None: none)."""
    cfg = selection or SelectionConfig()
    policy = Policy.parse("lbss" if system == "spin" else system)
    selector = build_selector(policy, cfg, list(drafters), k,
                              costs={d: costs.call_s(d, 1) for d in drafters},
                              verify_points=costs.points, kv_drafters=())  # free drafters: no KV
    learns = policy.name == "lbss"
    trial = RegimeTrial(NUM_BUCKETS, selector.plain_seconds, seed=cfg.seed) if learns and cfg.regime_trial else None
    host = (noise or HostNoise()).factors()
    pool = {d: make_drafter(d) for d in drafters}
    calls = _Calls(costs)
    shadows = ShadowDrafts()
    out = ReplayResult(system, batch_size)
    waiting = list(range(len(recording)))
    running: dict[str, tuple[Recorded, list[int]]] = {}  # req_id -> (record, [tokens committed])
    current: dict[str, Arm] = {}
    turn_count = 0
    while waiting or running:
        while waiting and len(running) < batch_size:
            i = waiting.pop(0)
            req_id = f"r{i}"
            running[req_id] = (recording[i], [0])
            for d in pool.values():
                d.add_request(req_id, SamplingParams())
        ids = list(running)
        infos = [RequestInfo(req_id=r, requested=AUTO, requested_k=None, current=current.get(r),
                             num_prompt_tokens=len(running[r][0].prompt), num_output_tokens=running[r][1][0])
                 for r in ids]
        regime = trial.regime(bucket_of(len(ids)), len(ids)) if trial is not None and len(ids) >= MIN_BATCH else None
        selected = regime != PLAIN
        t0 = time.perf_counter()
        turn_count += 1  # as `SlotPhases.select`'s shadow turn, which a plain window's select counts too
        if selected:
            arms = selector.select(infos, Capacity(dict.fromkeys(drafters, 16)))
        else:
            arms = [PLAIN_ARM] * len(ids)
            out.plain_regime_slots += 1
        cuts = {r: selector.cut_rule(r) if a.drafter else None for r, a in zip(ids, arms)}
        wanted = {r: learns and selected and is_shadow_turn(turn_count, i, len(ids)) and selector.wants_shadow(r)
                  for i, r in enumerate(ids)}
        timed = time.perf_counter() - t0
        # a fully selected slot costs what the daemon's coordinator takes, and one settled on a drafter its part of
        # that (modelled: the selector learns it, and its decisions must not follow this process's clock); a slot
        # selected on the plain fast path, or not selected, what it took here
        modelled = learns and selected and not selector.nothing_pays  # selected in full or settled: not clocked
        select_s = ((costs.settled_s if selector.settled_on is not None else costs.select_s) if modelled else timed)
        tokens_in_forward, draft_s, shadow_s, results, shadowed = 0, {}, 0.0, {}, {}
        for r, arm in zip(ids, arms):
            rec, (pos,) = running[r]
            seq = rec.prompt + rec.output[:pos]
            left = len(rec.output) - pos
            draft: Draft | None = None
            k_now = max(0, min(arm.k, left - 1)) if arm.drafter else 0
            if k_now:
                draft = cut_at(pool[arm.drafter].propose([DraftInput(r, seq, k_now)])[0], cuts[r])
                draft_s[r] = calls(arm.drafter, r, len(seq))
            if wanted[r]:
                proposed, rated = {}, {}
                for name in shadows.due(r, list(pool), every_slot=len(ids) == 1):  # as `SlotPhases.select`
                    shadow = pool[name].propose([DraftInput(r, seq, SHADOW_K)])[0]
                    proposed[name] = list(shadow.tokens)
                    if shadow.confidence is not None:
                        rated[name] = list(shadow.confidence)
                    shadow_s += calls(name, r, len(seq))
            tokens = draft.tokens if draft is not None else []
            accepted = 0
            while accepted < len(tokens) and tokens[accepted] == rec.output[pos + accepted]:
                accepted += 1
            if wanted[r]:
                shadows.add(r, len(seq), proposed, rated, (min(accepted + 1, left), arm.drafter if tokens else ""),
                            every_slot=len(ids) == 1)
                shadowed[r] = arm.drafter in proposed
            results[r] = (len(tokens), accepted, min(accepted + 1, left))
            tokens_in_forward += len(tokens) + 1
        f = next(host)
        verify_s, shadow_s, select_s = f * costs.verify_s(len(ids), tokens_in_forward), f * shadow_s, f * select_s
        draft_s = {r: f * s for r, s in draft_s.items()}
        hidden_s = f * costs.hidden_s if modelled else 0.0
        slot_s = verify_s + sum(draft_s.values()) + shadow_s + f * costs.base_s + select_s + hidden_s
        out.seconds += slot_s
        out.select_s += select_s
        out.shadow_s += shadow_s
        out.slots += 1
        if trial is not None:  # modelled seconds only (a clocked selection's are left out: microseconds, and the
            #                    trial's decisions must not follow this process's clock either)
            trial.record(bucket_of(len(ids)), regime, sum(c for _, _, c in results.values()), len(ids),
                         slot_s if modelled else slot_s - select_s)
        feedback = []
        for r, arm in zip(ids, arms):
            rec, state = running[r]
            drafted, accepted, committed = results[r]
            state[0] += committed
            out.tokens += committed
            out.request_slots += 1
            if drafted:
                out.drafted_slots[arm.drafter] = out.drafted_slots.get(arm.drafter, 0) + 1
            if not selected:
                continue
            decided = shadows.resolve(r, rec.prompt + rec.output[:state[0]], state[0] >= len(rec.output))
            feedback.append(SlotFeedback(
                req_id=r, arm=arm, num_drafted=drafted, num_accepted=accepted, num_committed=committed,
                draft_s=draft_s.get(r, 0.0), verify_s=verify_s, batch_size=len(ids), batch_tokens=tokens_in_forward,
                shadow=tuple(d[:3] for d in decided), shadowed=shadowed.get(r, False),
                shadow_slot=tuple(d.slot for d in decided),
                shadow_confidence=tuple((d.drafter, d.confidence, d.accepted) for d in decided if d.confidence),
                select_s=(select_s + shadow_s) / len(ids)))
            current[r] = arm
        if feedback:
            selector.observe(feedback)  # not charged: the daemon runs it while the target computes
        for r in ids:
            rec, (pos,) = running[r]
            if pos >= len(rec.output):
                selector.remove(r)
                shadows.remove(r)
                current.pop(r, None)
                for d in pool.values():
                    d.observe_finished(r, rec.output)
                    d.free_request(r)
                del running[r]
        for d in pool.values():
            while d.has_background_work:
                d.background_work(1 << 20)
    if learns:
        out.selection = selector.describe()
        if trial is not None:
            out.selection["regime"] = trial.describe()
    return out


def measure_call_costs(recording: Sequence[Recorded], drafters: Sequence[str] = FREE_DRAFTERS,
                       max_requests: int = 8) -> dict[str, tuple[float, float]]:
    """Each drafter's (seconds a propose call, seconds per token it takes in), timed on this machine over the
    recording's first requests: a call after one new token, and a second call on the same tokens (nothing new)."""
    out = {}
    for name in drafters:
        d = make_drafter(name)
        first = again = 0.0
        n = 0
        for i, rec in enumerate(recording[:max_requests]):
            req_id = f"m{i}"
            d.add_request(req_id, SamplingParams())
            d.propose([DraftInput(req_id, rec.prompt, SHADOW_K)])
            for pos in range(1, len(rec.output)):
                seq = rec.prompt + rec.output[:pos]
                t0 = time.perf_counter()
                d.propose([DraftInput(req_id, seq, SHADOW_K)])
                t1 = time.perf_counter()
                d.propose([DraftInput(req_id, seq, SHADOW_K)])
                t2 = time.perf_counter()
                first, again, n = first + t1 - t0, again + t2 - t1, n + 1
            d.observe_finished(req_id, rec.output)
            d.free_request(req_id)
            while d.has_background_work:
                d.background_work(1 << 20)
        fixed = again / max(1, n)
        out[name] = (fixed, max(0.0, first / max(1, n) - fixed))
    return out
