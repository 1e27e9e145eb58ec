"""Prompt lookup over a growing token sequence in O(n) per token: an index from each n-gram to the latest
position where it occurs with a successor. Shared (torch-free) by the n-gram drafter on the target worker and
by the coordinator, which checks what the drafter would have proposed against what greedy decoding committed.
"""

from __future__ import annotations


class NgramIndex:
    """`lookup(k)` = the up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (ngram_max down to ngram_min) of the sequence so far; `extend` appends tokens."""

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_max + 1)]  # n -> gram -> start

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        seq = self.tokens
        for tok in new:
            end = len(seq)  # the n-grams ending just before `tok` now have a successor
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self._last[n][tuple(seq[end - n:end])] = end - n
            seq.append(tok)

    def lookup(self, k: int) -> list[int]:
        return self.lookup_matched(k)[0]

    def lookup_matched(self, k: int) -> tuple[list[int], int]:
        """lookup(k), and the length of the n-gram it matched (0: none)."""
        seq = self.tokens
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            start = self._last[n].get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return seq[start + n:start + n + k], n
        return [], 0
