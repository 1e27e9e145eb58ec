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

from dataclasses import dataclass
from typing import NamedTuple

SHADOW_K = 8  # tokens per shadow draft: acceptance is per position, so one length serves every k up to it
FREE_KINDS = ("ngram", "suffix")  # drafters with no KV: a shadow draft costs a lookup
SHADOWED_PER_SLOT = 1  # requests a slot drafts shadow drafts for, in turn (`SlotPhases.select`)
MIN_SHADOW_TURN = 2  # ... and a request's turn comes at most every this many slots


def is_shadow_turn(count: int, i: int, batch_size: int) -> bool:
    """Whether the i-th of a slot's batch_size requests takes its turn for shadow drafts at the count-th select:
    SHADOWED_PER_SLOT of them a slot, in turn, each request every MIN_SHADOW_TURN-th slot at most (at batch 1 every
    2nd slot, at batch B each request every B-th). At batch 1 a shadow draft cost ~70 us (the worker's lookups,
    resolving them, learning from them: ~1% of a default-model slot on a 2-core CPU), and selection replayed with
    one every 2nd slot chose as well or better (the calibration and the ledger are everyone's, over thousands of
    tokens; a request's own recent drafts are read at a stage's start)."""
    return (count + i) % max(MIN_SHADOW_TURN, -(-batch_size // SHADOWED_PER_SLOT)) == 0


@dataclass
class _Pending:
    drafter: str
    position: int  # sequence length when it was drafted
    draft: list[int]
    confidence: tuple[float, ...]  # the drafter's per token (Draft.confidence); () where it has none
    slot: tuple[int, str]  # what the slot it was drafted at did: the tokens it committed, the drafter it ran ("")


class Decided(NamedTuple):
    drafter: str
    drafted: int  # its tokens that were decided (all of them, but at a request's end)
    accepted: int
    confidence: tuple[float, ...] = ()  # of the decided tokens, where the drafter gives one
    slot: tuple[int, str] = (0, "")  # the tokens the slot it was drafted at committed, the drafter that slot ran;
                                     # (0, "") not known (the ledger counts the draft as one own slot)


class ShadowDrafts:
    def __init__(self) -> None:
        self._pending: dict[str, list[_Pending]] = {}

    def add(self, req_id: str, position: int, drafts: dict[str, list[int]],
            confidence: dict[str, list[float]] | None = None, slot: tuple[int, str] = (0, "")) -> None:
        """Shadow drafts a worker returned for the request, drafted after its first `position` tokens, with their
        confidences where the drafter has them; slot: what that slot did (the tokens it committed, the drafter it
        ran, "" for none; (0, "") where not known)."""
        if drafts:
            conf = confidence or {}
            self._pending.setdefault(req_id, []).extend(_Pending(n, position, list(d), tuple(conf.get(n, ())), slot)
                                                        for n, d in drafts.items())

    def resolve(self, req_id: str, tokens: list[int], is_final: bool = False) -> list[Decided]:
        """Every shadow draft the committed `tokens` now decide (an empty draft at once: the drafter had nothing
        to propose); is_final: the request ended, decide what is left on the tokens there are."""
        pending = self._pending.get(req_id)
        if not pending:
            return []
        out, keep = [], []
        for p in pending:
            committed = tokens[p.position:p.position + len(p.draft)]
            n = 0
            while n < len(committed) and committed[n] == p.draft[n]:
                n += 1
            if n < len(committed) or len(committed) == len(p.draft):  # a mismatch, or all of it matched
                out.append(Decided(p.drafter, len(p.draft), n, p.confidence, p.slot))
            elif is_final and committed:
                out.append(Decided(p.drafter, len(committed), n, p.confidence[:len(committed)], p.slot))
            elif not is_final:
                keep.append(p)
        self._pending[req_id] = keep
        return out

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
