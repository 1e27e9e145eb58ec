"""What the free drafters' shadow drafts would have been worth, per batch size: which free drafter another one
dominates, and whether selecting pays for its own cost.

Every free drafter (n-gram lookup, suffix decoding) drafts a shadow draft on the same slots (`shadow.py`), so their
worth can be compared on the same text. The selector values each decided shadow draft as its slot would have run it
(cut at its drafter's confidence floor of the moment): the tokens it would have added less the price of the tokens it
would have drafted, in tokens (an empty proposal: 0). The ledger keeps, per drafter and per batch-size bucket (1, 2,
3-4, 5-8, 9-16, 17+: the price of a draft token, and so a draft's worth, is set by the batch size), a decayed mean of
those values over the latest ~`window` drafts. Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_BUCKETS = 6


def bucket_of(batch_size: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, 17 and more -> 5."""
    return min(NUM_BUCKETS - 1, (max(1, batch_size) - 1).bit_length())


class ShadowLedger:
    """Plain Python over a handful of drafters: read on the selection's critical path (`best`, `dominated`: cached
    per bucket until a draft is added there)."""

    def __init__(self, drafters: Sequence[str], window: int = 512, evidence: int = 64, margin: float = 0.15) -> None:
        """window: drafts a mean weighs (exponential decay); evidence: drafts a drafter needs in a bucket before its
        mean counts there; margin: a drafter worth less than (1 - margin) x the best one's is dominated."""
        if window < 1 or evidence < 1 or not 0.0 <= margin < 1.0:
            raise ValueError("need window >= 1, evidence >= 1, 0 <= margin < 1")
        self.drafters = list(drafters)
        self.decay = 1.0 - 1.0 / window
        self.evidence, self.margin = evidence, margin
        d = len(self.drafters)
        self._worth = [[0.0] * d for _ in range(NUM_BUCKETS)]  # decayed sums of the drafts' worth, in tokens
        self._weight = [[0.0] * d for _ in range(NUM_BUCKETS)]  # decayed counts
        self._seen = [[0] * d for _ in range(NUM_BUCKETS)]
        self._answers: list[tuple[float | None, frozenset[str]] | None] = [None] * NUM_BUCKETS  # (best, dominated)

    def add(self, batch_size: int, j: int, tokens: float) -> None:
        """One of drafter j's shadow drafts, decided, was worth `tokens` (net) in a slot of batch_size requests."""
        b = bucket_of(batch_size)
        self._worth[b][j] = self.decay * self._worth[b][j] + tokens
        self._weight[b][j] = self.decay * self._weight[b][j] + 1.0
        self._seen[b][j] += 1
        self._answers[b] = None

    def rates(self, batch_size: int) -> list[float | None]:
        """Each drafter's mean worth of a shadow draft (tokens) at this batch size; None below `evidence` drafts."""
        b = bucket_of(batch_size)
        return [w / n if seen >= self.evidence else None
                for w, n, seen in zip(self._worth[b], self._weight[b], self._seen[b])]

    def _answer(self, batch_size: int) -> tuple[float | None, frozenset[str]]:
        b = bucket_of(batch_size)
        if self._answers[b] is None:
            r = self.rates(batch_size)
            known = [x for x in r if x is not None]
            best = max(known) if known else None
            dominated = frozenset()
            if len(known) >= 2 and best > 0.0:
                bar = (1.0 - self.margin) * best
                dominated = frozenset(d for d, x in zip(self.drafters, r) if x is not None and x < bar)
            self._answers[b] = (best if r and len(known) == len(r) else None, dominated)
        return self._answers[b]

    def best(self, batch_size: int) -> float | None:
        """The best known drafter's mean worth of a draft at this batch size; None until every drafter is known (one
        still unknown might pay)."""
        return self._answer(batch_size)[0]

    def dominated(self, batch_size: int) -> frozenset[str]:
        """The drafters worth less than (1 - margin) x the best known one's worth a draft at this batch size, where that
        one pays (worth > 0). None while fewer than two are known."""
        return self._answer(batch_size)[1]

    def describe(self) -> dict:
        """{bucket's largest batch size ("17+" for the last): {drafter: mean worth of a draft, tokens; null below
        evidence}} for the buckets with any draft."""
        out = {}
        for b in range(NUM_BUCKETS):
            if any(self._seen[b]):
                name = "17+" if b == NUM_BUCKETS - 1 else str(2 ** b)
                out[name] = {d: None if x is None else round(x, 4) for d, x in zip(self.drafters, self.rates(2 ** b))}
        return out
