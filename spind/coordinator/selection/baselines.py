"""Selection baselines behind the same Selector protocol, and `build_selector`: a selector for a policy
(spind.policy.Policy, or its text).

- `fixed:NAME[@K]`: vanilla speculative decoding with one drafter (the paper's "Vanilla"); `none`: plain
  decoding for every AUTO request. Both are `StaticSelector`s.
- `greedy-length` (§VII "Greedy"): shorter prompts -> smaller drafters. "Smaller" is lower cost per draft
  token (a drafter -> cost map given at construction). A request's prompt length is ranked among the prompt
  lengths seen so far, and the quantile picks the drafter: the shortest 1/D of prompts get the cheapest of
  the D drafters, and so on. The choice is made once per request, so it never switches.
- `epsilon-greedy` (§VII, as the paper words it): each slot, with probability epsilon *all* AUTO requests
  use the arm with the best population goodput observed so far, and with probability 1 - epsilon each picks
  an arm at random. (The textbook rule is the other way round, exploring with probability epsilon; the
  paper's wording, with epsilon = 0.2 "for better exploration", explores 80% of the time.)
- `random`: every AUTO request a random arm every slot (B_j kept by random drop, as in Algorithm 2).
- `oracle` (evaluation only): told each request's true goodput per arm, it runs the best feasible arms
  (per request, or the maximum-weight matching when capacities bind). Its regret is zero by definition.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from spind.config import SelectionConfig
from spind.coordinator.selection.arms import ArmSet, free_capacity, random_drop, split_bypass, with_requested_k
from spind.coordinator.selection.lbss import UNKNOWN_WEIGHT, LBSSSelector
from spind.coordinator.selection.matching import max_weight_assignment
from spind.coordinator.selection.protocol import (PLAIN, Arm, Capacity, RequestInfo, Selector, SlotFeedback,
                                        StaticSelector, fit_capacity)
from spind.policy import Policy

GoodputTable = Callable[[str], Mapping[Arm, float]]  # req_id -> true goodput per arm (the oracle's knowledge)


class FixedSelector(StaticSelector):
    """Every AUTO request on one arm: `fixed:NAME[@K]`, or plain decoding (`none`, drafter None)."""

    def __init__(self, drafter: str | None, k: int) -> None:
        super().__init__(PLAIN if drafter is None else drafter, k)
        self.policy = PLAIN if drafter is None else f"fixed:{Arm(drafter, k).name}"


class _Baseline(StaticSelector):
    """Bypass handling and capacity for the baselines; subclasses implement `_choose(auto, free) -> {req_id:
    Arm}`. Like StaticSelector they neither learn (unless they override observe) nor hint."""

    def __init__(self, default_k: int, drafters: Sequence[str]) -> None:
        super().__init__(PLAIN, default_k)
        self.drafters = tuple(drafters)

    def select(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        bypass = split_bypass(reqs, self.default_k)
        free = free_capacity(capacity, self.drafters, [a for a in bypass if a is not None])
        choice = self._choose([r for r, b in zip(reqs, bypass) if b is None], free)
        arms = [b if b is not None else with_requested_k(choice[r.req_id], r) for r, b in zip(reqs, bypass)]
        arms = fit_capacity(arms, capacity)
        self._current.update((r.req_id, a) for r, a in zip(reqs, arms))
        return arms

    def _choose(self, auto: list[RequestInfo], free: dict[str | None, int | None]) -> dict[str, Arm]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"policy": self.policy, "assignment": dict(Counter(a.name for a in self._current.values()))}


class GreedyLengthSelector(_Baseline):
    policy = "greedy-length"

    def __init__(self, costs: Mapping[str, float], k: int, window: int = 4096) -> None:
        super().__init__(k, tuple(costs))
        self.by_cost = sorted(costs, key=lambda d: costs[d])  # cheapest per draft token first
        self._seen: deque[int] = deque(maxlen=window)  # prompt lengths, arrival order
        self._sorted: list[int] = []  # the same, sorted
        self._drafter_of: dict[str, str] = {}

    def _choose(self, auto: list[RequestInfo], free: dict[str | None, int | None]) -> dict[str, Arm]:
        new = [r for r in auto if r.req_id not in self._drafter_of]
        for r in new:  # the whole batch of newcomers is ranked among each other too
            self._add_length(r.num_prompt_tokens)
        for r in new:
            self._drafter_of[r.req_id] = self.by_cost[self._rank(r.num_prompt_tokens)]
        return {r.req_id: Arm(self._drafter_of[r.req_id], self.default_k) for r in auto}

    def _add_length(self, length: int) -> None:
        if len(self._seen) == self._seen.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._seen[0])]
        self._seen.append(length)
        bisect.insort(self._sorted, length)

    def _rank(self, length: int) -> int:
        """Index of the drafter for a prompt of this length: its quantile among the lengths seen."""
        below = bisect.bisect_left(self._sorted, length)
        equal = bisect.bisect_right(self._sorted, length) - below
        quantile = (below + 0.5 * equal) / len(self._sorted)
        return min(int(quantile * len(self.by_cost)), len(self.by_cost) - 1)

    def remove(self, req_id: str) -> None:
        super().remove(req_id)
        self._drafter_of.pop(req_id, None)


class EpsilonGreedySelector(_Baseline):
    """With probability epsilon all AUTO requests run the best observed arm, else each a random one."""

    policy = "epsilon-greedy"

    def __init__(self, arm_set: ArmSet, epsilon: float, seed: int, default_k: int) -> None:
        super().__init__(default_k, arm_set.drafters)
        self.arm_set, self.epsilon = arm_set, epsilon
        self.rng = np.random.default_rng(seed)
        self.sums = np.zeros(len(arm_set))  # [A] population's summed rewards
        self.counts = np.zeros(len(arm_set))  # [A]
        self.is_exploiting = False

    def _choose(self, auto: list[RequestInfo], free: dict[str | None, int | None]) -> dict[str, Arm]:
        available = self.arm_set.available(free)
        self.is_exploiting = bool(self.counts.any()) and self.rng.random() < self.epsilon
        if self.is_exploiting:
            with np.errstate(invalid="ignore", divide="ignore"):
                means = np.where(self.counts > 0, self.sums / self.counts, -np.inf)
            best = max((a for g in available for a in g), key=lambda a: means[a])
            choice = {r.req_id: best for r in auto}
        else:
            choice = {r.req_id: self.arm_set.draw(available, self.rng) for r in auto}
        choice = random_drop(choice, self.arm_set, free, self.rng)
        return {req_id: self.arm_set.arms[a] for req_id, a in choice.items()}

    def observe(self, feedback: Sequence[SlotFeedback]) -> None:
        for fb in feedback:
            a = self.arm_set.index.get(fb.arm)
            seconds = fb.draft_s + fb.verify_s
            if a is not None and seconds > 0:
                self.sums[a] += fb.num_committed / seconds
                self.counts[a] += 1

    def describe(self) -> dict:
        with np.errstate(invalid="ignore", divide="ignore"):
            means = self.sums / self.counts
        return super().describe() | {
            "epsilon": self.epsilon, "is_exploiting": self.is_exploiting,
            "population": {n: None if np.isnan(m) else round(float(m), 3) for n, m in zip(self.arm_set.names, means)}}


class RandomSelector(EpsilonGreedySelector):
    """A random arm per AUTO request per slot: epsilon-greedy that never exploits."""

    policy = "random"

    def __init__(self, arm_set: ArmSet, seed: int, default_k: int) -> None:
        super().__init__(arm_set, 0.0, seed, default_k)


class OracleSelector(_Baseline):
    """Knows every request's true goodput per arm (evaluation only: the simulator has it)."""

    policy = "oracle"

    def __init__(self, arm_set: ArmSet, goodput_of: GoodputTable, default_k: int) -> None:
        super().__init__(default_k, arm_set.drafters)
        self.arm_set, self.goodput_of = arm_set, goodput_of
        self._weights: dict[str, np.ndarray] = {}  # req_id -> [A]

    def _choose(self, auto: list[RequestInfo], free: dict[str | None, int | None]) -> dict[str, Arm]:
        if not auto:
            return {}
        weights = np.stack([self._row(r.req_id) for r in auto])  # [n, A]
        best = weights.argmax(axis=1)
        used = np.bincount(self.arm_set.drafter_of[best] + 1, minlength=len(self.drafters) + 1)[1:]  # [D]
        fits = all(free.get(d) is None or used[j] <= free[d] for j, d in enumerate(self.drafters))
        arms = best if fits else max_weight_assignment(weights, self.arm_set, free)
        return {r.req_id: self.arm_set.arms[a] for r, a in zip(auto, arms)}

    def _row(self, req_id: str) -> np.ndarray:
        if req_id not in self._weights:
            table = self.goodput_of(req_id)
            self._weights[req_id] = np.array([table.get(arm, UNKNOWN_WEIGHT) for arm in self.arm_set.arms])
        return self._weights[req_id]

    def remove(self, req_id: str) -> None:
        super().remove(req_id)
        self._weights.pop(req_id, None)


def build_selector(policy: Policy | str, cfg: SelectionConfig, drafters: Sequence[str], default_k: int, *,
                   costs: Mapping[str, float] | None = None, oracle: GoodputTable | None = None,
                   verify_points: Sequence[tuple[int, int, float]] = (),
                   kv_drafters: Sequence[str] | None = None) -> Selector:
    """A selector for a policy: lbss | fixed:NAME[@K] | greedy-length | epsilon-greedy | random | none | oracle
    (text is parsed with Policy.parse: ValueError when malformed). `costs` (seconds per draft token per
    drafter) is needed by greedy-length and starts lbss's draft costs, `oracle` by oracle; `verify_points`
    (measured (requests, tokens, seconds) verify forwards) start lbss's verify-cost model; `kv_drafters` (those
    with KV to precompute; None: all) are what lbss's precompute hints are for."""
    p = policy if isinstance(policy, Policy) else Policy.parse(policy.strip())
    if p.name == "lbss":
        return LBSSSelector(cfg, drafters, default_k, verify_points=verify_points, draft_s_per_token=dict(costs or {}),
                            kv_drafters=kv_drafters)
    if p.is_plain:
        return FixedSelector(None, default_k)
    if p.is_fixed:
        if p.drafter not in drafters:
            raise ValueError(f"policy {str(p)!r}: unknown drafter {p.drafter!r}; known: {', '.join(drafters)}")
        return FixedSelector(p.drafter, default_k if p.k is None else p.k)
    if p.name == "greedy-length":
        if costs is None or set(costs) != set(drafters):
            raise ValueError("greedy-length needs each drafter's cost per draft token (costs={drafter: seconds})")
        return GreedyLengthSelector(costs, default_k)
    arm_set = ArmSet(drafters, cfg.k_set)
    if p.name == "epsilon-greedy":
        return EpsilonGreedySelector(arm_set, cfg.epsilon, cfg.seed, default_k)
    if p.name == "random":
        return RandomSelector(arm_set, cfg.seed, default_k)
    if p.name == "oracle":
        if oracle is None:
            raise ValueError("oracle is evaluation only: it needs the true goodput table (oracle=req_id -> {arm: g})")
        return OracleSelector(arm_set, oracle, default_k)
    raise ValueError(f"policy {str(p)!r} has no selector")  # a name added to spind.policy.NAMES but not here
