"""SSM selection (paper §V): which drafter, and how many draft tokens, each running request uses next slot.

The coordinator drives a selector through three calls:

    arms = selector.select(requests, capacity)   # before speculation, one Arm per request, in order
    ...  speculate, verify  ...
    selector.observe(feedback)                  # after verification: one SlotFeedback per request that ran
    selector.remove(req_id)                     # the request finished or was aborted

and asks `precompute_hint(req_id)` for the drafter whose KV to keep warm for that request (fast SSM
switching, §V-C: the worker hosting it precomputes the request's KV in its idle time).

A selector is a pure policy: numbers in, decisions out. It does no I/O and reads no clock; the times it
learns from arrive in the feedback. Plain target decoding is an arm like any other (`drafter=None`),
without a capacity limit. A request that names a drafter (or "none") bypasses selection, but its feedback
is still observed, so the population's estimates learn from it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from spind.draft_cut import CutRule

AUTO = "auto"
PLAIN = "none"  # the API's name for plain decoding; an Arm spells it drafter=None


@dataclass(frozen=True, order=True)
class Arm:
    """A drafter and a draft length: what a request runs with for one slot."""

    drafter: str | None  # None = plain target decoding
    k: int = 0  # tokens drafted per slot; 0 when drafter is None

    @property
    def name(self) -> str:
        return PLAIN if self.drafter is None else f"{self.drafter}@{self.k}"


PLAIN_ARM = Arm(None, 0)


@dataclass(frozen=True, kw_only=True)
class RequestInfo:
    """What a selector may know about a running request when it chooses."""

    req_id: str
    requested: str  # AUTO (selection decides) | a drafter name | PLAIN (both bypass selection)
    requested_k: int | None  # k asked for by the API; None = the selector's (or config's) choice
    current: Arm | None  # arm of the previous slot; None for a request that has not run yet
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_repetition: float = 0.0  # share of the prompt's 3-grams seen earlier in the prompt, in [0, 1]


@dataclass(frozen=True)
class Capacity:
    """B_j of the paper: how many requests each drafter may draft for in one slot. Drafters absent from
    the map are unavailable this slot; plain decoding is never limited."""

    per_drafter: Mapping[str, int] = field(default_factory=dict)

    def of(self, drafter: str | None) -> int | None:
        """None = unlimited (plain decoding)."""
        return None if drafter is None else self.per_drafter.get(drafter, 0)


@dataclass(frozen=True, kw_only=True)
class SlotFeedback:
    """What one request did in one slot, with the seconds it cost (reward r_ij(t) of the paper is
    num_committed / (draft_s + verify_s); the switching cost c_ij(t) is switch_s)."""

    req_id: str
    arm: Arm
    num_drafted: int  # drafts proposed (fewer than arm.k near max_tokens, or when n-gram finds no match)
    num_accepted: int  # drafts the target accepted
    num_committed: int  # tokens committed this slot: accepted drafts + the recovered/bonus one, after stop rules
    draft_s: float  # wall time of the propose call that drafted for it (its drafter's whole batch); 0 if none
    verify_s: float  # wall time of the verify forward it took part in (the whole batch)
    switch_s: float = 0.0  # KV catch-up its drafter ran before drafting, beyond the last slot's tokens
    batch_size: int = 1  # requests in that verify forward
    batch_tokens: int = 0  # tokens that verify forward carried (every request's drafts + 1); 0 = not one shared
    #                        forward (the simulator's per-request slots): no verify cost is learned from it
    # counterfactual drafts of free drafters it did not run, decided by what greedy decoding committed:
    # (drafter, drafted, accepted) each; acceptance evidence only, no timing (spind.coordinator.selection.shadow)
    shadow: tuple[tuple[str, int, int], ...] = ()
    shadowed: bool = False  # its own draft's drafter drafted a shadow draft for it this slot too (all of SHADOW_K
    #                         positions, where a draft cut short has only its own): acceptance is counted from that
    # of those shadow drafts, the ones whose drafter gave a confidence per token: (drafter, the decided tokens'
    # confidences, accepted) each, what selection calibrates the drafter's confidence on
    shadow_confidence: tuple[tuple[str, tuple[float, ...], int], ...] = ()
    # per shadow draft (in `shadow`'s order): what the slot it was drafted at did, (tokens it committed, the drafter
    # it ran or "" where it drafted nothing), which weighs the draft in the ledger (`LBSSSelector._ledger`)
    shadow_slot: tuple[tuple[int, str], ...] = ()
    # its share of what selecting cost the slot: the coordinator's selector calls (split over the requests it selected
    # for) and the target worker's shadow drafts (split over the verify's requests); summed over a slot's feedback
    select_s: float = 0.0


class Selector(Protocol):
    policy: str

    def select(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        """One arm per request, in order. Must respect capacity: at most capacity.of(j) requests on drafter j."""

    def observe(self, feedback: Sequence[SlotFeedback]) -> None:
        """Learn from the slot that just ran."""

    def remove(self, req_id: str) -> None:
        """Forget a finished or aborted request."""

    def precompute_hint(self, req_id: str) -> str | None:
        """The drafter this request most likely switches to next (other than its current one), whose KV is
        worth precomputing now; None for no precompute."""

    def cut_rule(self, req_id: str) -> CutRule | None:
        """After select: where its drafter's draft stops paying this slot, by its tokens' confidences
        (`Draft.confidence`): its worker cuts the draft to the prefix the rule keeps. None: no cut."""

    def wants_shadow(self, req_id: str) -> bool:
        """After select, at the request's turn for shadow drafts (the free drafters' counterfactual drafts, which
        SlotFeedback.shadow brings back): whether to draft them this time. A selector that does not learn from them
        says False."""

    def describe(self) -> dict:
        """JSON-able state for /v1/spind/state and the dashboard."""


def bypass_arm(req: RequestInfo, default_k: int) -> Arm | None:
    """The arm of a request that named its drafter (or "none"); None when selection decides (AUTO)."""
    if req.requested == AUTO:
        return None
    if req.requested == PLAIN:
        return PLAIN_ARM
    return Arm(req.requested, default_k if req.requested_k is None else req.requested_k)


def fit_capacity(arms: Sequence[Arm], capacity: Capacity) -> list[Arm]:
    """Enforce B_j in request order: requests past a drafter's capacity decode plainly this slot."""
    used: dict[str, int] = {}
    out = []
    for arm in arms:
        if arm.drafter is not None:
            used[arm.drafter] = used.get(arm.drafter, 0) + 1
            if used[arm.drafter] > capacity.of(arm.drafter):
                arm = PLAIN_ARM
        out.append(arm)
    return out


class StaticSelector:
    """No learning: a named drafter as asked, "auto" -> one configured default, "none" -> plain decoding."""

    policy = "static"

    def __init__(self, default_drafter: str | None, default_k: int) -> None:
        self.default_drafter = None if default_drafter == PLAIN else default_drafter
        self.default_k = default_k
        self._current: dict[str, Arm] = {}

    def select(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        arms = []
        for r in reqs:
            arm = bypass_arm(r, self.default_k)
            if arm is None:
                k = self.default_k if r.requested_k is None else r.requested_k
                arm = PLAIN_ARM if self.default_drafter is None or k == 0 else Arm(self.default_drafter, k)
            arms.append(arm)
        arms = fit_capacity(arms, capacity)
        self._current.update((r.req_id, a) for r, a in zip(reqs, arms))
        return arms

    def observe(self, feedback: Sequence[SlotFeedback]) -> None:
        pass

    def remove(self, req_id: str) -> None:
        self._current.pop(req_id, None)

    def precompute_hint(self, req_id: str) -> str | None:
        """The default drafter: every AUTO request drafts with it."""
        return self.default_drafter

    def cut_rule(self, req_id: str) -> CutRule | None:
        return None

    def wants_shadow(self, req_id: str) -> bool:
        return False

    def describe(self) -> dict:
        counts: dict[str, int] = {}
        for arm in self._current.values():
            counts[arm.name] = counts.get(arm.name, 0) + 1
        return {"policy": self.policy, "default_drafter": self.default_drafter or PLAIN,
                "default_k": self.default_k, "assignment": counts}
