"""Counterfactual drafts of the free drafters: what n-gram lookup or suffix decoding *would* have proposed for a
request that ran something else, checked against the tokens greedy decoding then committed.

Under greedy decoding a deterministic draft is accepted exactly up to its first token that differs from the
committed sequence, so its acceptance is known without verifying it. The worker that hosts a model-free drafter
(beside the target) drafts one shadow draft per request and slot for the coordinator when it verifies the
request (`VerifyItem.shadow`: a lookup, microseconds), from the same committed tokens as the real draft, and
returns it with the result (`VerifyResult.shadow`). This resolver keeps each until enough tokens are committed
to decide it (a mismatch, or all of it matched) and reports it in the selector feedback: the selector learns
each request's acceptance on every free drafter on every slot without spending slots exploring them. (Sampled
requests get no shadows: their acceptance depends on the target's probabilities.)
"""

from __future__ import annotations

from dataclasses import dataclass

SHADOW_K = 8  # tokens per shadow draft: acceptance is per position, so one length serves every k up to it
FREE_KINDS = ("ngram", "suffix")  # drafters with no KV: a shadow draft costs a lookup


@dataclass
class _Pending:
    drafter: str
    position: int  # sequence length when it was drafted
    draft: list[int]


class ShadowDrafts:
    def __init__(self) -> None:
        self._pending: dict[str, list[_Pending]] = {}

    def add(self, req_id: str, position: int, drafts: dict[str, list[int]]) -> None:
        """Shadow drafts a worker returned for the request, drafted after its first `position` tokens."""
        if drafts:
            self._pending.setdefault(req_id, []).extend(_Pending(n, position, list(d)) for n, d in drafts.items())

    def resolve(self, req_id: str, tokens: list[int], is_final: bool = False) -> list[tuple[str, int, int]]:
        """(drafter, drafted, accepted) of every shadow draft the committed `tokens` now decide (an empty draft at
        once: the drafter had nothing to propose); is_final: the request ended, decide what is left on the tokens
        there are."""
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
                out.append((p.drafter, len(p.draft), n))
            elif is_final and committed:
                out.append((p.drafter, len(committed), n))
            elif not is_final:
                keep.append(p)
        self._pending[req_id] = keep
        return out

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
