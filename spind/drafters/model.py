"""A drafter that runs a causal LM: a separate small model or a self-draft derived from the target."""

from __future__ import annotations

import torch

from spind.drafters.base import Draft, DraftInput, Drafter
from spind.models.llama import LlamaModel
from spind.models.runner import ForwardItem, ModelRunner
from spind.sampling import make_generator, sample, to_probs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(Drafter):
    def __init__(self, name: str, kind: str, model: LlamaModel, num_blocks: int, block_size: int,
                 attention: str = "packed", max_model_len: int | None = None) -> None:
        super().__init__(name)
        self.kind = kind
        self.runner = ModelRunner(model, num_blocks, block_size, attention, max_model_len)
        self.synced: dict[str, list[int]] = {}  # tokens whose KV this drafter holds, per request
        self.generators: dict[str, torch.Generator] = {}

    def add_request(self, req_id, params) -> None:
        super().add_request(req_id, params)
        self.runner.add_request(req_id)
        self.synced[req_id] = []
        self.generators[req_id] = make_generator(params.seed, salt=1)

    def free_request(self, req_id: str) -> None:
        super().free_request(req_id)
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)
        self.synced.pop(req_id, None)
        self.generators.pop(req_id, None)

    def _catch_up(self, req_id: str, tokens: list[int], keep_last: bool) -> list[int]:
        """Roll KV back to the common prefix with `tokens`; return the tokens still to feed.
        keep_last: always leave at least the last token to feed (its logits are needed)."""
        c = common_prefix(self.synced[req_id], tokens)
        if keep_last:
            c = min(c, len(tokens) - 1)
        self.runner.truncate(req_id, c)
        self.synced[req_id] = tokens[:c]
        return tokens[c:]

    def precompute(self, req_id: str, tokens: list[int]) -> None:
        todo = self._catch_up(req_id, tokens, keep_last=False)
        if todo:
            self.runner.forward([ForwardItem(req_id, todo)])
            self.synced[req_id] = list(tokens)

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        limit = self.runner.max_model_len
        ks = {x.req_id: max(0, min(x.k, limit - len(x.tokens))) for x in inputs}
        active = [x for x in inputs if ks[x.req_id] > 0]
        out: dict[str, list[int]] = {x.req_id: [] for x in inputs}
        probs: dict[str, list[torch.Tensor]] = {x.req_id: [] for x in inputs}
        items = [ForwardItem(x.req_id, self._catch_up(x.req_id, x.tokens, keep_last=True)) for x in active]
        for x in active:
            self.synced[x.req_id] = list(x.tokens)
        while items:
            logits = self.runner.forward(items)
            next_items = []
            for item, row in zip(items, logits):
                rid = item.req_id
                params = self.params[rid]
                if params.is_greedy:
                    tok = int(row[-1].argmax())
                else:
                    p = to_probs(row[-1:], params)[0]
                    tok = sample(p, self.generators[rid])
                    probs[rid].append(p)
                out[rid].append(tok)
                if len(out[rid]) < ks[rid]:
                    self.synced[rid].append(tok)
                    next_items.append(ForwardItem(rid, [tok]))
            items = next_items
        return [Draft(out[x.req_id], torch.stack(probs[x.req_id]) if probs[x.req_id] else None) for x in inputs]
