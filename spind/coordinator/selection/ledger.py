"""What the free drafters' shadow drafts would have been worth at a batch size: which free drafter another one
dominates, and whether selecting pays for its own cost.

Every free drafter (n-gram lookup, suffix decoding) drafts a shadow draft on the same slots (`shadow.py`), so their
worth can be compared on the same text. The ledger keeps each drafter's latest `window` decided shadow drafts as they
were drafted: each token's own rating (where the drafter rates its tokens) and how many tokens survived. It values
them at the prices of the batch size it is asked about (`Pricing`, the selector's at that size): each draft cut where
its slot would have cut it (by the drafter's `CutRule`; all of it where the drafter is not calibrated), the tokens it
would have added less what those it would have drafted cost, in tokens (an empty proposal: 0), averaged over the drafts
with the latest weighing most (exponential decay), each weighed by the drafter's own slots it stands for (`add`: a copy
run seen at several slots of another drafter is one or two of its own; `LBSSSelector._ledger` says how many), and no
further than the default k (`LBSSSelector._pricing_at`).

What survives does not depend on the batch size; what a token costs does. So every draft, whatever batch it was
drafted in, values the drafters at every batch size, and a server whose load changes knows at once whether drafting
pays at the new one. Kept per batch size (as before), a 16-client level of `spind bench serve` was one wave of
arrivals that ended before its ledger knew anything: one request is shadow-drafted a slot, so the 64 drafts of
evidence took 64 slots of ~100, each selecting in full and exploring drafts that lost at that size.

Pure: numbers in, numbers out (numpy over the kept drafts: ~30 us a drafter, read once per price reading).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spind.draft_cut import CutRule

# drafter index -> (how its drafts are cut by their ratings, or None where they are not; what a token at each draft
# position costs the batch, in tokens). Past the costs' end their last entry holds.
Pricing = Callable[[int], tuple[CutRule | None, tuple[float, ...]]]


@dataclass(frozen=True)
class Verdict:
    """The ledger read at one batch size's prices."""
    rates: tuple[float | None, ...]  # each drafter's mean worth of a shadow draft, tokens; None below the evidence
    best: float | None  # the best one's; None until every drafter is known (one still unknown might pay)
    dominated: frozenset[str]  # worth less than (1 - margin) x the best one's, where that one pays (> 0)


UNKNOWN = Verdict((), None, frozenset())


class ShadowLedger:
    """Each free drafter's latest shadow drafts, valued at the prices asked (`verdict`)."""

    def __init__(self, drafters: Sequence[str], window: int = 512, evidence: int = 64, margin: float = 0.15,
                 max_len: int = 8) -> None:
        """window: drafts kept per drafter (the mean's weights decay by 1 - 1/window a draft); evidence: drafts a
        drafter needs before its mean counts; margin: a drafter worth less than (1 - margin) x the best one's is
        dominated; max_len: draft positions kept (a shadow draft's length)."""
        if window < 1 or evidence < 1 or max_len < 1 or not 0.0 <= margin < 1.0:
            raise ValueError("need window >= 1, evidence >= 1, max_len >= 1, 0 <= margin < 1")
        self.drafters = list(drafters)
        self.window, self.evidence, self.margin, self.max_len = window, evidence, margin, max_len
        d = len(self.drafters)
        # per drafter and kept draft, each position's rating: 1 where the drafter gave none (a rule reads it surest),
        # nan past the draft (where it ends)
        self._rating = np.full((d, window, max_len), np.nan)
        self._drafted = np.zeros((d, window), dtype=np.int64)
        self._accepted = np.zeros((d, window), dtype=np.int64)
        self._slots = np.ones((d, window))  # the drafter's own slots each draft stands for (`add`)
        self._seen = [0] * d  # drafts added per drafter (the latest is at (seen - 1) % window)
        self._pending: list[tuple] = []  # drafts added since the arrays were last written (`_absorb`)
        self._weights = (1.0 - 1.0 / window) ** np.arange(window)  # by age, the latest first

    def add(self, j: int, drafted: int, accepted: int, rating: Sequence[float] | None = None,
            slots: float = 1.0) -> None:
        """One of drafter j's shadow drafts, decided: `drafted` tokens (0: it proposed none), the first `accepted`
        of them survived; rating: its own confidence per token (None where it rates none); slots: how many of the
        drafter's own slots it stands for (its weight in the mean). Kept as given until the ledger is next read
        (`_absorb`): drafts come one or two a slot and reads every few dozen slots, and a draft written into the
        arrays alone took ~15 us on the coordinator between two forwards (wall timers, batch 1: numpy's per-call
        overhead, run cold; ~2 us in a tight loop)."""
        self._pending.append((j, drafted, accepted, rating, slots))
        self._seen[j] += 1
        if len(self._pending) >= self.window:  # never read (no prices yet): bounded all the same
            self._absorb()

    def _absorb(self) -> None:
        """The drafts added since the last read, into the arrays: per drafter, its rows built in Python and written
        in one assignment (older pending drafts than a window holds are overwritten as they would have been)."""
        pending, self._pending = self._pending, []
        nan, width = float("nan"), self.max_len
        for j in range(len(self.drafters)):
            mine = [x for x in pending if x[0] == j]
            if not mine:
                continue
            mine = mine[-self.window:]
            first = self._seen[j] - len(mine)  # the count of drafter j's drafts before the first of these
            rows, drafted, accepted, slots = [], [], [], []
            for _, d, a, rating, w in mine:
                n = min(max(0, d), width)
                r = [1.0] * n if rating is None else [float(c) for c in list(rating)[:n]]
                rows.append(r + [nan] * (width - len(r)))
                drafted.append(n)
                accepted.append(min(max(0, a), n))
                slots.append(max(0.0, w))
            at = (first + np.arange(len(mine))) % self.window
            self._rating[j, at] = rows
            self._drafted[j, at] = drafted
            self._accepted[j, at] = accepted
            self._slots[j, at] = slots

    def seen(self, j: int) -> int:
        return self._seen[j]

    def worth(self, j: int, rule: CutRule | None, costs: tuple[float, ...], limit: int | None = None) -> float | None:
        """Drafter j's mean worth of a draft (tokens) cut by `rule` (`CutRule.kept`, vectorized: its prefix of
        greatest worth, the shortest of equals) and at `limit` tokens, with each position costing `costs` (see
        Pricing); None below the evidence."""
        seen = self._seen[j]
        if seen < self.evidence:
            return None
        if self._pending:
            self._absorb()
        n = min(seen, self.window)
        width = self.max_len if limit is None else max(0, min(limit, self.max_len))
        drafted, accepted = self._drafted[j, :n], self._accepted[j, :n]
        if rule is None:
            kept = np.minimum(drafted, width)
        else:
            rating = self._rating[j, :n, :width]
            values, bins = np.asarray(rule.values), len(rule.values)
            prices = np.array([rule.prices[min(t, len(rule.prices) - 1)] for t in range(width)])
            inside = ~np.isnan(rating)
            b = np.clip((np.where(inside, rating, 0.0) * bins).astype(np.int64), 0, bins - 1)
            gains = np.where(inside, values[b] - prices, -np.inf)  # past the draft: no prefix reaches there
            worth = np.concatenate((np.zeros((n, 1)), np.cumsum(gains, axis=1)), axis=1)
            kept = np.argmax(worth, axis=1)  # the shortest prefix of greatest worth (0: none pays)
        per_position = np.array([costs[min(t, len(costs) - 1)] for t in range(self.max_len)])
        cost = np.concatenate(([0.0], np.cumsum(per_position)))[kept]
        value = np.minimum(accepted, kept) - cost
        age = ((seen - 1) % self.window - np.arange(n)) % self.window
        w = self._weights[age] * self._slots[j, :n]
        total = w.sum()
        return float(np.dot(w, value) / total) if total > 0 else 0.0

    def verdict(self, pricing: Pricing, limit: int | None = None) -> Verdict:
        """The ledger read at one batch size's prices, each draft at most `limit` tokens."""
        rates = tuple(self.worth(j, *pricing(j), limit) for j in range(len(self.drafters)))
        known = [x for x in rates if x is not None]
        best = max(known) if known else None
        dominated: frozenset[str] = frozenset()
        if len(known) >= 2 and best > 0.0:
            bar = (1.0 - self.margin) * best
            dominated = frozenset(d for d, x in zip(self.drafters, rates) if x is not None and x < bar)
        return Verdict(rates, best if rates and len(known) == len(rates) else None, dominated)
