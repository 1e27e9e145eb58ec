"""Where a draft whose drafter rates its own tokens stops paying (`CutRule`): what the selector sends with a request's
verify (`VerifyItem.cut_values`, `cut_prices`) and the target's worker cuts the draft by (`spind.drafters.base.cut_at`).
Imports nothing of spind, so the selector, the protocol's users and the worker can all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CutRule:
    """Where a draft whose drafter rates its tokens (`Draft.confidence`) stops paying: values[b] is the chance that a
    token whose confidence falls in bin b (of len(values) equal bins of [0, 1]) survives with its prefix (the
    drafter's calibration), prices[t] what the draft's token at position t costs the batch, in tokens (past the end,
    the last holds). A draft is worth, cut after its first n tokens, the sum over them of value - price, and is cut
    to its prefix of greatest worth (the shortest of equals; nothing where no prefix is worth more than 0).

    Not a floor per position: where the first position costs more than the others (a CPU forward's second row leaves the
    one-row kernels: the default model's first draft token added 0.5 ms to a 2.6-2.7 ms step at batch 1, each later one
    0.1-0.6, AMD EPYC, 2 threads), a first token that does not pay alone may open a run that pays for it. Cut at the
    first token below its own position's floor, `spin` at batch 1 drafted 41 tokens of a request where `fixed:suffix`
    drafted 93, and kept 12 accepted tokens of its 28 (mtbench)."""

    values: tuple[float, ...]
    prices: tuple[float, ...]

    def kept(self, confidence: Sequence[float], limit: int | None = None) -> int:
        """The tokens of a draft with these confidences (at most `limit`) that its cut keeps."""
        values, prices = self.values, self.prices
        bins, last = len(values), len(prices) - 1
        top = bins - 1
        gain = best = 0.0
        n = 0
        for t, c in enumerate(confidence if limit is None else confidence[:limit]):
            gain += values[min(top, max(0, int(c * bins)))] - prices[min(t, last)]
            if gain > best:
                best, n = gain, t + 1
        return n

    def pays(self, k: int) -> bool:
        """Whether any draft of up to k tokens could pay: one rated surest at every position."""
        return self.kept((1.0,) * k) > 0
