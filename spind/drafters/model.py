"""A drafter that runs a causal LM: a separate small model or a self-draft derived from the target.

Per request it holds KV for `synced`: a prefix of the committed sequence followed by its own last drafts.
Each propose rolls the KV back to the longest common prefix with the committed sequence it is handed and
feeds the rest, so accepted drafts cost nothing and a request that switches here from another drafter
(or comes back after a while) catches up by feeding only what it missed. Only the tokens since the last
call are compared: the committed sequence never changes, it only grows.
"""

from __future__ import annotations

import msgspec
import torch

from spind.drafters.base import Draft, DraftInput, Drafter
from spind.models.llama import LlamaModel
from spind.models.runner import ForwardItem, ModelRunner
from spind.worker.device import DeviceClock
from spind.worker.sampling import argmax_rows, biased, make_generator, sample, to_probs


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `start` items are known equal."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(Drafter):
    def __init__(self, name: str, kind: str, model: LlamaModel, num_blocks: int, block_size: int,
                 attention: str = "packed", max_model_len: int | None = None, max_batch: int = 16,
                 cuda_graphs: bool = False) -> None:
        super().__init__(name, DeviceClock(model.device))
        self.kind = kind
        # draft steps feed one token per request: replayed from CUDA graphs (catch-up and prefill run eagerly)
        self.runner = ModelRunner(model, num_blocks, block_size, attention, max_model_len, max_batch,
                                  cuda_graphs=cuda_graphs, graph_query_lens=(1,))
        self.synced: dict[str, list[int]] = {}  # tokens whose KV this drafter holds, per request
        self.committed: dict[str, int] = {}  # length of the committed sequence at the last call
        self.generators: dict[str, torch.Generator] = {}

    def add_request(self, req_id, params) -> None:
        vocab = self.runner.model.args.vocab_size  # the bias only steers drafts: ids this model cannot score go
        if any(t >= vocab for t, _ in params.logit_bias):
            params = msgspec.structs.replace(params, logit_bias=tuple(p for p in params.logit_bias if p[0] < vocab))
        super().add_request(req_id, params)
        self.runner.add_request(req_id)
        self.synced[req_id] = []
        self.committed[req_id] = 0
        self.generators[req_id] = make_generator(params.seed, salt=1)

    def free_request(self, req_id: str) -> None:
        super().free_request(req_id)
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)
        for d in (self.synced, self.committed, self.generators):
            d.pop(req_id, None)

    def reset_request(self, req_id: str) -> None:
        """Forget a request's KV (after a failed forward left it unknown); the next call re-feeds it."""
        self.runner.truncate(req_id, 0)
        self.synced[req_id] = []
        self.committed[req_id] = 0

    def _catch_up(self, req_id: str, tokens: list[int], keep_last: bool) -> list[int]:
        """Roll KV back to the common prefix with `tokens`; return the tokens still to feed.
        keep_last: always leave at least the last token to feed (its logits are needed)."""
        synced = self.synced[req_id]
        c = common_prefix(synced, tokens, self.committed[req_id])
        if keep_last:
            c = min(c, len(tokens) - 1)
        self.runner.truncate(req_id, c)
        del synced[c:]
        self.committed[req_id] = len(tokens)
        return tokens[c:]

    def precompute(self, req_id: str, tokens: list[int], max_tokens: int | None = None) -> int:
        todo = self._catch_up(req_id, tokens, keep_last=False)
        feed = todo if max_tokens is None else todo[:max_tokens]
        if feed:
            self.runner.forward([ForwardItem(req_id, feed, 0)])
            self.synced[req_id].extend(feed)
        return len(todo) - len(feed)

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        try:
            return self._draft(inputs)
        except Exception:
            for x in inputs:  # a forward failed midway: what each request's KV holds is unknown now
                if x.req_id in self.synced:
                    self.reset_request(x.req_id)
            raise

    def _draft(self, inputs: list[DraftInput]) -> list[Draft]:
        limit = self.runner.max_model_len
        ks = {x.req_id: max(0, min(x.k, limit - len(x.tokens))) for x in inputs}
        active = [x for x in inputs if ks[x.req_id] > 0]
        out: dict[str, list[int]] = {x.req_id: [] for x in inputs}
        probs: dict[str, list[torch.Tensor]] = {x.req_id: [] for x in inputs}
        items = [ForwardItem(x.req_id, self._catch_up(x.req_id, x.tokens, keep_last=True)) for x in active]
        caught_up = {it.req_id: len(it.tokens) - 1 for it in items}  # beyond the one every step feeds
        switch_s = dict.fromkeys(out, 0.0)
        first = True
        while items:
            catching_up = first and sum(caught_up.values()) > 0  # the first step feeds what the request missed
            start = self.clock.now() if catching_up else 0.0
            logits = self.runner.forward(items)
            if catching_up:
                spent, total = self.clock.now() - start, sum(caught_up.values())
                switch_s.update((r, spent * n / total) for r, n in caught_up.items())
            first = False
            next_items = []
            # every greedy request's next token in one device->host copy (not a sync per request)
            # (a biased row in the logits' own dtype: the unbiased ones are not copied)
            picks = argmax_rows(torch.stack([biased(row[-1], self.params[it.req_id]).to(row.dtype)
                                             for it, row in zip(items, logits)])) \
                if any(self.params[it.req_id].is_greedy for it in items) else []
            for i, (item, row) in enumerate(zip(items, logits)):
                rid = item.req_id
                self.synced[rid].extend(item.tokens)
                params = self.params[rid]
                if params.is_greedy:
                    tok = picks[i]
                else:
                    p = to_probs(row[-1:], params)[0]
                    tok = sample(p, self.generators[rid])
                    probs[rid].append(p)
                out[rid].append(tok)
                if len(out[rid]) < ks[rid]:
                    next_items.append(ForwardItem(rid, [tok]))
            items = next_items
        return [Draft(out[r], torch.stack(probs[r]) if probs[r] else None, switch_s[r]) for r in out]
