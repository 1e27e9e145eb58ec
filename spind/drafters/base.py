"""The drafter (SSM) interface: every kind of drafter proposes tokens the same way.

A drafter mirrors each request's committed token sequence and proposes up to k next tokens. It never
decides what is committed: the target's verification does, and the next `propose` call carries the
sequence as it now stands (a drafter with a KV cache rolls back to the common prefix itself).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spind.draft_cut import CutRule
from spind.params import SamplingParams
from spind.worker.device import DeviceClock


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] proposal distributions; None = point mass
    switch_s: float = 0.0  # time spent catching this request's KV up beyond the last slot's tokens
    # per token t, the drafter's own estimate that its first t tokens are all accepted (non-increasing); None: it
    # has none. Calibrated online against shadow drafts, it lets the worker cut a draft where it stops paying
    # (`CutRule`, VerifyItem.cut_values and cut_prices)
    confidence: list[float] | None = None


def cut_at(draft: Draft, rule: CutRule | None) -> Draft:
    """The draft cut to its prefix its rule keeps (`CutRule`); as it is with no rule, or no confidence."""
    if draft.confidence is None or rule is None:
        return draft
    n = rule.kept(draft.confidence, len(draft.tokens))
    if n == len(draft.tokens):
        return draft
    probs = None if draft.probs is None else draft.probs[:n]
    return Draft(draft.tokens[:n], probs, draft.switch_s, draft.confidence[:n])


@dataclass
class DraftInput:
    req_id: str
    tokens: list[int]  # the committed sequence (prompt + generated so far); read, never modified
    k: int


class Drafter(ABC):
    kind: str = ""

    def __init__(self, name: str, clock: DeviceClock | None = None) -> None:
        self.name = name
        self.clock = clock or DeviceClock("cpu")  # times its drafting (a model drafter: on its model's device)
        self.params: dict[str, SamplingParams] = {}
        self._ms_per_token: float | None = None  # EMA of measured propose time per drafted token

    # ---- request lifecycle ----------------------------------------------------------------------
    def add_request(self, req_id: str, params: SamplingParams) -> None:
        self.params[req_id] = params

    def free_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)

    def precompute(self, req_id: str, tokens: list[int], max_tokens: int | None = None) -> int:
        """Bring this drafter's state for `tokens` up to date ahead of use (the KV-precompute queue),
        feeding at most max_tokens of them; returns how many are still to feed (0: up to date)."""
        return 0

    def observe_finished(self, req_id: str, output: list[int]) -> None:
        """A request this drafter's worker served finished with this output (the tokens generated, not the prompt),
        whichever drafter served it: a drafter that learns across requests (suffix decoding) keeps it. Nothing for
        most."""

    def forget_finished(self) -> None:
        """Drop what observe_finished kept (a bench that runs several drafters on one prompt: none may draft
        from another run's answer to it)."""

    @property
    def has_background_work(self) -> bool:
        """Work this drafter does between ops, off every request's path (see background_work)."""
        return False

    def background_work(self, max_tokens: int, stop: Callable[[], bool] | None = None) -> None:
        """A chunk (about max_tokens tokens' worth) of that work; the worker runs it only while no op waits. stop:
        whether an op now waits (the worker's socket polled), asked between small parts of the chunk: the work
        yields to it there."""

    def prepare_probe(self, req_id: str, tokens: list[int]) -> None:
        """Before an offline probe drafts for `req_id` over prefixes of `tokens` (the start-up profile, `spind
        bench drafters`): whatever the drafter reads besides the token ids, which serving would have given it (a
        feature-level head: the target's features of those tokens). Nothing for most drafters."""

    # ---- drafting ----------------------------------------------------------------------------------
    def propose(self, inputs: list[DraftInput]) -> list[Draft]:
        start = self.clock.now()
        drafts = self._propose(inputs)
        num = sum(len(d.tokens) for d in drafts)
        if num:
            ms = (self.clock.now() - start) * 1e3 / num
            self._ms_per_token = ms if self._ms_per_token is None else 0.9 * self._ms_per_token + 0.1 * ms
        return drafts

    @abstractmethod
    def _propose(self, inputs: list[DraftInput]) -> list[Draft]: ...

    @property
    def ms_per_token(self) -> float | None:
        return self._ms_per_token

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "ms_per_token": self._ms_per_token}

