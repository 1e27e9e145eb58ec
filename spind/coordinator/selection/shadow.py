"""Counterfactual drafts of the free drafters: what n-gram lookup or suffix decoding *would* have proposed for a
request that ran something else, checked against the tokens greedy decoding then committed.

Under greedy decoding a deterministic draft is accepted exactly up to its first token that differs from the
committed sequence, so its acceptance is known without verifying it. The worker that hosts a model-free drafter
(beside the target) drafts one shadow draft per request and slot for the coordinator when it verifies the
request (`VerifyItem.shadow`: a lookup, microseconds), from the same committed tokens as the real draft, and
returns it with the result (`VerifyResult.shadow`, and the drafter's confidence per token where it has one:
`VerifyResult.shadow_confidence`). This resolver keeps each until enough tokens are committed
to decide it (a mismatch, or all of it matched) and reports it in the selector feedback: the selector learns
each request's acceptance on every free drafter on every slot without spending slots exploring them. (Sampled
requests get no shadows: their acceptance depends on the target's probabilities.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

SHADOW_K = 8  # tokens per shadow draft: acceptance is per position, so one length serves every k up to it
FREE_KINDS = ("ngram", "suffix")  # drafters with no KV: a shadow draft costs a lookup
SHADOWED_PER_SLOT = 1  # requests a slot drafts shadow drafts for, in turn (`SlotPhases.select`)


def is_shadow_turn(count: int, i: int, batch_size: int) -> bool:
    """Whether the i-th of a slot's batch_size requests takes its turn for shadow drafts at the count-th select:
    SHADOWED_PER_SLOT of them a slot, in turn (at batch 1 every slot, at batch B each request every B-th), so their
    cost (~70 us a request: the worker's lookups, resolving them, learning from them; ~1% of a default-model slot
    at batch 1 on a 2-core CPU) stays one request's a slot. At batch 1, where every slot is the request's turn, only
    the drafters whose last shadow draft of the request is decided draft again (`ShadowDrafts.due`), so each drafter's
    shadow drafts follow its own slots through the text (`ShadowDrafts.add`); past it every free drafter drafts at
    each turn."""
    return (count + i) % max(1, -(-batch_size // SHADOWED_PER_SLOT)) == 0


@dataclass
class _Pending:
    drafter: str
    position: int  # sequence length when it was drafted
    draft: list[int]
    confidence: tuple[float, ...]  # the drafter's per token (Draft.confidence); () where it has none
    slot: tuple[int, str]  # the slot it stands at: the tokens the slot it was drafted at committed, and the drafter
    #                       whose slot that is: the one the slot ran ("" for none), or its own where it was paced


class Decided(NamedTuple):
    drafter: str
    drafted: int  # its tokens that were decided (all of them, but at a request's end)
    accepted: int
    confidence: tuple[float, ...] = ()  # of the decided tokens, where the drafter gives one
    slot: tuple[int, str] = (0, "")  # the tokens the slot it was drafted at committed, and the drafter whose slot
                                     # it stands at (`_Pending.slot`); (0, "") not known (the ledger counts the draft
                                     # as one own slot)


class ShadowDrafts:
    """Each request's undecided shadow drafts, decided as its tokens commit.

    Pacing (batch 1, where every slot is a request's shadow turn). Where a drafter's shadow draft is drafted at the
    first slot after its last one was decided, it starts where that one's own slot would have ended (its accepted
    tokens and the bonus token: the mismatch that decided it is the bonus), give or take what the slot that ran
    overshot: the drafter's shadow drafts then follow its own slots through the text, and each stands for one of
    them (`add` marks it so, `LBSSSelector._ledger` weighs it as one). Drafted anywhere else (another drafter's
    slot, after a pause) a draft sees the text at that drafter's pace. Replayed at batch 1 (the default model's
    greedy outputs, 32 requests of mtbench, humaneval, gsm8k, alpaca, cp, passage; k = 4, a CPU's verify at
    1.06-1.25x a decode step for 1-4 draft tokens), with a shadow draft of both drafters every 2nd slot the ledger
    read suffix decoding 1-15% lower against n-gram lookup while n-gram lookup ran than while it ran itself, and
    selection (over the six and their mix, three draws of the prompts each) kept whichever drafter it had settled on
    first (0.90-0.98x `fixed:suffix`, mean 0.961); paced and at every slot (`is_shadow_turn`), it read suffix
    decoding ahead wherever its own slots are (by 1-4% less while n-gram lookup ran on four of the six, 9-10% on
    alpaca and passage) and kept it (0.958-0.981x, mean 0.976: the rest is what selecting costs). Unpaced at every
    slot: mean 0.971, worst 0.949."""

    def __init__(self) -> None:
        self._pending: dict[str, list[_Pending]] = {}
        self._decided_at: dict[str, dict[str, int]] = {}  # req_id -> drafter -> tokens when its last draft decided

    def due(self, req_id: str, drafters: Sequence[str], every_slot: bool = False, ahead: bool = False) -> list[str]:
        """The drafters that draft a shadow draft of the request at its turn: where it may be shadowed at every slot
        (batch 1), those of `drafters` with no undecided shadow draft of it (paced); past batch 1 all of them.
        ahead: the turn is chosen before the slot in flight commits (the lockstep's follow-on, whose verify is sent
        while the last one runs): every drafter, as that slot may decide a drafter's last draft, and where it does
        not, `add` drops the drafter's draft. Paced on what was decided before the slot in flight, each drafter's
        draft came a slot after its own slot's start; a follow-on at nearly every batch-1 slot left the shadow drafts
        unpaced: on gsm8k (`bench e2e`, batch 1, 2-core EPYC) the ledger read n-gram lookup ahead of suffix decoding
        (0.483 / 0.452 and 0.490 / 0.476, two runs; without the follow-on 0.364 / 0.456), which `fixed:` runs find 8%
        fewer tokens a slot, and selection settled on it (31% of the slots). Asked ahead: 0.423 / 0.484 and 0.390 /
        0.471, n-gram lookup on 9% and 2% of the slots."""
        if not every_slot or ahead:
            return list(drafters)
        busy = self._busy(req_id)
        return [d for d in drafters if d not in busy]

    def _busy(self, req_id: str) -> set[str]:
        """The drafters with an undecided shadow draft of the request."""
        return {p.drafter for p in self._pending.get(req_id, ())}

    def add(self, req_id: str, position: int, drafts: dict[str, list[int]],
            confidence: dict[str, list[float]] | None = None, slot: tuple[int, str] = (0, ""),
            every_slot: bool = False) -> frozenset[str]:
        """Shadow drafts a worker returned for the request, drafted after its first `position` tokens, with their
        confidences where the drafter has them; slot: what that slot did (the tokens it committed, the drafter it
        ran, "" for none; (0, "") where not known); every_slot: the request may be shadowed at every slot (batch 1).
        There, a draft drafted at the tokens its drafter's last one was decided at is paced: its slot is its
        drafter's own. Past batch 1 nothing is: a request's turn comes every B-th slot, and a plain request's draft
        of SHADOW_K tokens that all match is decided exactly B = SHADOW_K slots later, where its next turn drafts
        again, one copy run after another, none of them where the drafter's own slot would start. At batch 1 a draft of
        a drafter whose last draft of the request is still undecided is dropped: asked for ahead of the slot that was
        to decide that one (`due`), it stands nowhere its drafter's own slot would. Returns the drafters whose drafts
        were kept."""
        if every_slot and drafts:
            busy = self._busy(req_id)
            drafts = {n: d for n, d in drafts.items() if n not in busy}
        if drafts:
            conf = confidence or {}
            decided = self._decided_at.get(req_id, {}) if every_slot else {}
            self._pending.setdefault(req_id, []).extend(
                _Pending(n, position, list(d), tuple(conf.get(n, ())),
                         (slot[0], n) if decided.get(n) == position else slot)
                for n, d in drafts.items())
        return frozenset(drafts)

    def resolve(self, req_id: str, tokens: list[int], is_final: bool = False) -> list[Decided]:
        """Every shadow draft the committed `tokens` now decide (an empty draft at once: the drafter had nothing
        to propose); is_final: the request ended, decide what is left on the tokens there are."""
        pending = self._pending.get(req_id)
        if not pending:
            return []
        out, keep = [], []
        decided_at = self._decided_at.setdefault(req_id, {})
        for p in pending:
            committed = tokens[p.position:p.position + len(p.draft)]
            n = 0
            while n < len(committed) and committed[n] == p.draft[n]:
                n += 1
            if n < len(committed) or len(committed) == len(p.draft):  # a mismatch, or all of it matched
                out.append(Decided(p.drafter, len(p.draft), n, p.confidence, p.slot))
                decided_at[p.drafter] = len(tokens)
            elif is_final and committed:
                out.append(Decided(p.drafter, len(committed), n, p.confidence[:len(committed)], p.slot))
            elif not is_final:
                keep.append(p)
        self._pending[req_id] = keep
        return out

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._decided_at.pop(req_id, None)
