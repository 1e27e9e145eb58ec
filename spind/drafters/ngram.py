"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix.

Free to run and model-free; strong when the output repeats the context (summaries, code edits, quotes),
useless on open chat. Deterministic, so its proposal is a point mass; each token carries a confidence from the
matched n-gram's length and its place (`confidence`). Each request keeps an incremental
index (`spind.ngram_index`), so a lookup costs O(n), not O(context).
"""

from __future__ import annotations

from spind.drafters.base import Draft, DraftInput, Drafter
from spind.ngram_index import NgramIndex


def lookup(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The up to k tokens after the most recent earlier match of the longest matching suffix n-gram."""
    index = NgramIndex(ngram_max, ngram_min)
    index.extend(tokens)
    return index.lookup(k)


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, name: str, ngram_max: int = 3, ngram_min: int = 1) -> None:
        super().__init__(name)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.indexes: dict[str, NgramIndex] = {}

    def free_request(self, req_id: str) -> None:
        super().free_request(req_id)
        self.indexes.pop(req_id, None)

    def _index(self, x: DraftInput) -> NgramIndex:
        index = self.indexes.get(x.req_id)
        if index is None or len(index) > len(x.tokens) or index.tokens[-1:] != x.tokens[len(index) - 1:len(index)]:
            index = self.indexes[x.req_id] = NgramIndex(self.ngram_max, self.ngram_min)  # new, or not a prefix
        index.extend(x.tokens[len(index):])
        return index

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        out = []
        for x in inputs:
            tokens, n = self._index(x).lookup_matched(x.k) if x.k > 0 else ([], 0)
            out.append(Draft(tokens, confidence=confidence(n, len(tokens))))
        return out


def confidence(matched: int, num_tokens: int) -> list[float]:
    """Per copied token t = 1.., (n / (n + 1))^t for a matched n-gram of n tokens: a longer match copies more
    surely, each token further on less so. An ordering, not a probability: selection calibrates it against what
    greedy decoding accepted (`Calibration`)."""
    q = matched / (matched + 1.0)
    return [q ** (t + 1) for t in range(num_tokens)]
