"""The target side of a time slot: append each request's pending tokens and its draft, verify, roll back.

Invariant per request: the target's KV holds every committed token but the newest ones (`pending`);
a verification forward appends `pending + draft`, reads the last `len(draft) + 1` logits rows, keeps the
KV of the accepted drafts and rolls back the rest. A new request's first forward is its prefill: its
pending tokens are the whole prompt, and a draft may ride along with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spind.models.runner import ForwardItem, ModelRunner
from spind.sampling import SamplingParams, make_generator, to_probs, verify_greedy, verify_stochastic


@dataclass
class VerifyItem:
    req_id: str
    draft: list[int]
    draft_probs: torch.Tensor | None = None  # [len(draft), V]; None = point mass


@dataclass
class VerifyOutput:
    req_id: str
    num_drafted: int
    num_accepted: int
    tokens: list[int]  # newly committed: accepted drafts + one recovered/bonus token


class TargetVerifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pending: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator] = {}

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add_request(self, req_id: str, tokens: list[int], params: SamplingParams) -> None:
        """Register a request whose committed sequence is `tokens` (a prompt, or a re-prefill)."""
        if not tokens:
            raise ValueError("empty prompt")
        self.runner.add_request(req_id)
        self.pending[req_id] = list(tokens)
        self.params[req_id] = params
        self.generators[req_id] = make_generator(params.seed)

    def free_request(self, req_id: str) -> None:
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)
        for d in (self.pending, self.params, self.generators):
            d.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.pending

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        fwd = [ForwardItem(it.req_id, self.pending[it.req_id] + it.draft, len(it.draft) + 1) for it in items]
        logits = self.runner.forward(fwd)
        outs = []
        for it, rows in zip(items, logits):
            params = self.params[it.req_id]
            if params.is_greedy:
                res = verify_greedy(rows, it.draft)
            else:
                res = verify_stochastic(to_probs(rows, params), it.draft, it.draft_probs,
                                        self.generators[it.req_id])
            rejected = len(it.draft) - res.num_accepted
            self.runner.truncate(it.req_id, self.runner.length(it.req_id) - rejected)
            self.pending[it.req_id] = res.tokens[-1:]
            outs.append(VerifyOutput(it.req_id, len(it.draft), res.num_accepted, res.tokens))
        return outs
