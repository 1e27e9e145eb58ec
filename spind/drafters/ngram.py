"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix.

Free to run and model-free; strong when the output repeats the context (summaries, code edits, quotes),
useless on open chat. Deterministic, so its proposal is a point mass.
"""

from __future__ import annotations

import numpy as np

from spind.drafters.base import Draft, DraftInput, Drafter


def lookup(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The up to k tokens after the most recent earlier match of the longest matching suffix n-gram."""
    seq = np.asarray(tokens, dtype=np.int64)
    n_tok = len(seq)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # all n-grams that have a successor
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, name: str, ngram_max: int = 3, ngram_min: int = 1) -> None:
        super().__init__(name)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        return [Draft(lookup(x.tokens, x.k, self.ngram_max, self.ngram_min) if x.k > 0 else []) for x in inputs]
