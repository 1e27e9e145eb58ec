"""Counterfactual drafts of the free drafters: what n-gram lookup *would* have proposed for a request, checked
against the tokens greedy decoding then committed.

Under greedy decoding a deterministic draft is accepted exactly up to its first token that differs from the
committed sequence, so its acceptance is known without verifying it, at the cost of a lookup (O(n) with
`NgramIndex`). The coordinator drafts one shadow draft per request and slot, resolves it once enough tokens
are committed to decide it (a mismatch, or all k matched), and reports it in the selector feedback: the
selector learns each request's n-gram acceptance on every slot without spending slots exploring it.
(Sampled requests get no shadows: their acceptance depends on the target's probabilities.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spind.ngram_index import NgramIndex

SHADOW_K = 8  # tokens per shadow draft: acceptance is per token, so one length serves every k


@dataclass
class _Pending:
    position: int  # sequence length when it was drafted
    draft: list[int]


@dataclass
class _Shadowed:
    indexes: dict[str, NgramIndex]
    pending: dict[str, list[_Pending]] = field(default_factory=dict)


class ShadowDrafts:
    def __init__(self, drafters: dict[str, tuple[int, int]], k: int = SHADOW_K) -> None:
        """drafters: name -> (ngram_max, ngram_min) of each n-gram drafter."""
        self.drafters, self.k = drafters, k
        self._reqs: dict[str, _Shadowed] = {}

    def draft(self, req_id: str, tokens: list[int], exclude: str | None = None) -> None:
        """Before a slot: what each free drafter (but `exclude`, the one the request runs this slot: it gets
        real feedback) would propose after `tokens`, the committed sequence."""
        if not self.drafters or set(self.drafters) == {exclude}:
            return
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _Shadowed({n: NgramIndex(*p) for n, p in self.drafters.items()})
        for name, index in st.indexes.items():
            index.extend(tokens[len(index):])
            if name != exclude:
                st.pending.setdefault(name, []).append(_Pending(len(tokens), index.lookup(self.k)))

    def resolve(self, req_id: str, tokens: list[int], is_final: bool = False) -> list[tuple[str, int, int]]:
        """(drafter, drafted, accepted) of every shadow draft the committed `tokens` now decide; is_final:
        the request ended, decide what is left on the tokens there are."""
        st = self._reqs.get(req_id)
        if st is None:
            return []
        out = []
        for name, pending in st.pending.items():
            keep = []
            for p in pending:
                committed = tokens[p.position:p.position + len(p.draft)]
                n = 0
                while n < len(committed) and committed[n] == p.draft[n]:
                    n += 1
                if n < len(committed) or len(committed) == len(p.draft):  # a mismatch, or all of it matched
                    out.append((name, len(p.draft), n))
                elif is_final and committed:
                    out.append((name, len(committed), n))
                elif not is_final:
                    keep.append(p)
            st.pending[name] = keep
        return out

    def remove(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
