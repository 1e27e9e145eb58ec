"""The `eagle` drafter: a feature-level draft head (spind/models/eagle.py) beside the target on its worker.

The target's forwards (prefill and verify) record the features of every token they commit in a `FeatureStore`;
the head reads them at no extra target forward. Per request the head's KV holds `fed` entries built from the
target's features (entry p, at KV index p - 1: token p over the features after token p - 1), then its own draft
entries, which the next call drops: so accepted drafts are re-fed with the target's true features, exactly the
inputs the head was trained on. A request that comes to the head late (a switch) catches up from its features
in one forward. Draft probabilities (sampled requests) are the head's distribution over its draft vocabulary,
placed in the target's vocabulary (zero elsewhere), so speculative sampling stays exact.
"""

from __future__ import annotations

import msgspec
import torch

from spind.drafters.base import Draft, DraftInput, Drafter
from spind.kernels import cpu_ext
from spind.models.eagle import EagleHead, HeadKV
from spind.worker.device import DeviceClock
from spind.worker.sampling import biased, make_generator, sample, to_probs


class FeatureStore:
    """Per request, fp16 features [length, width] of its committed tokens, row p after token p (target side)."""

    def __init__(self, layers: tuple[int, ...], width: int) -> None:
        self.layers, self.width = layers, width
        self.rows: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}

    def add(self, req_id: str) -> None:
        self.rows[req_id] = torch.empty(0, self.width, dtype=torch.float16)
        self.lengths[req_id] = 0

    def free(self, req_id: str) -> None:
        self.rows.pop(req_id, None)
        self.lengths.pop(req_id, None)

    def fork(self, src: str, dst: str) -> None:
        self.rows[dst] = self.rows[src].clone()
        self.lengths[dst] = self.lengths[src]

    def length(self, req_id: str) -> int:
        return self.lengths.get(req_id, 0)

    def append(self, req_id: str, features: torch.Tensor) -> None:
        if req_id not in self.rows:
            return
        n, end = features.shape[0], self.lengths[req_id] + features.shape[0]
        rows = self.rows[req_id]
        if end > rows.shape[0]:
            grown = torch.empty(max(end, 2 * rows.shape[0], 64), self.width, dtype=torch.float16)
            grown[: self.lengths[req_id]] = rows[: self.lengths[req_id]]
            self.rows[req_id] = rows = grown
        rows[end - n:end] = features.to(device="cpu", dtype=torch.float16)
        self.lengths[req_id] = end

    def get(self, req_id: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows [start, stop), or None where the store does not hold them all."""
        if req_id not in self.rows or stop > self.lengths[req_id] or start < 0:
            return None
        return self.rows[req_id][start:stop]


def prime_features(store: FeatureStore, runner, req_id: str, tokens: list[int]) -> None:
    """Give `req_id` the target's features of `tokens` (a throw-away probe the start-up profile times the head on,
    which the target never verified): one forward on the target's runner under a reserved id, then rolled back."""
    from spind.models.runner import ForwardItem

    probe = f"{req_id}\x00features"
    runner.add_request(probe)
    try:
        _, rows = runner.forward_features([ForwardItem(probe, list(tokens), 0)], store.layers)
    finally:
        runner.free_request(probe)
    store.free(req_id)
    store.add(req_id)
    store.append(req_id, rows[0])


def make_eagle_drafters(configs: list, target, resolve_path, embedding=None) -> dict[str, "EagleDrafter"]:
    """The eagle drafters of `configs` beside `target` (a TargetVerifier), which from now on records the
    features they read; `resolve_path(path)` is a head's directory. `embedding()`: the target's whole token embedding
    where the target's own is split over tensor-parallel ranks (whose lookup is a collective of every rank)."""
    from spind.models.eagle import load_eagle_head

    model = target.runner.model
    split = model.shard is not None
    heads = {}
    for dc in configs:
        try:
            heads[dc.name] = load_eagle_head(resolve_path(dc.path), model.args)
        except ValueError as e:
            raise ValueError(f"drafter {dc.name!r}: {e}") from None
    layers = tuple(sorted({i for h in heads.values() for i in h.cfg.feature_layers}))
    store = FeatureStore(layers, len(layers) * model.args.hidden_size)
    target.features = store
    out = {}
    for name, head in heads.items():
        head.to(model.device)
        if model.quantized is not None and model.device.type == "cpu" and cpu_ext.available():
            # a quantized CPU target: the head's weights as Q8_0 blocks too (4.4 -> 0.9 ms a draft step for the
            # default model's head at 1 thread), at the target's activation precision where it has one
            head.quantize_linears({"gguf": "fp32", "gguf-q8": "q8"}.get(model.quantized, "q16"))
        if split and not head.eagle3:
            raise ValueError(f"drafter {name!r}: an EAGLE-1 head scores with the target's lm_head, which a "
                             f"tensor-parallel target splits over its ranks; serve it with tensor_parallel = 1")
        if split and embedding is None:
            raise ValueError(f"drafter {name!r}: a tensor-parallel target's head needs its whole embedding")
        head.bind_target(embedding() if split else model.embed_tokens, None if split else model.lm_head,
                         target.max_model_len + 1)
        out[name] = EagleDrafter(name, head, store, target.max_model_len, DeviceClock(model.device), target.runner)
    return out


class EagleDrafter(Drafter):
    kind = "eagle"

    def __init__(self, name: str, head: EagleHead, store: FeatureStore, max_model_len: int,
                 clock: DeviceClock | None = None, target_runner=None) -> None:
        super().__init__(name, clock)
        self.head, self.store, self.max_model_len = head, store, max_model_len
        self.target_runner = target_runner  # for offline probes only (prepare_probe); serving never runs it
        self.probes: set[str] = set()
        index = {layer: i for i, layer in enumerate(store.layers)}
        h = head.cfg.args.hidden_size
        self.columns = torch.cat([torch.arange(index[layer] * h, (index[layer] + 1) * h)
                                  for layer in head.cfg.feature_layers])
        self.all_columns = self.columns.numel() == store.width
        self.device = head.rope_cos.device
        self.kv = HeadKV(head.num_kv_heads, head.head_dim, device=self.device)
        self.fed: dict[str, int] = {}  # entries built from the target's features: 1..fed
        self.generators: dict[str, torch.Generator] = {}

    def add_request(self, req_id, params) -> None:
        vocab = self.head.target_vocab
        if any(t >= vocab for t, _ in params.logit_bias):
            params = msgspec.structs.replace(params, logit_bias=tuple(p for p in params.logit_bias if p[0] < vocab))
        super().add_request(req_id, params)
        self.kv.add(req_id)
        self.fed[req_id] = 0
        self.generators[req_id] = make_generator(params.seed, salt=1)

    def prepare_probe(self, req_id: str, tokens: list[int]) -> None:
        if self.target_runner is None:
            raise RuntimeError(f"drafter {self.name!r} has no target to compute a probe's features with")
        prime_features(self.store, self.target_runner, req_id, tokens)
        self.probes.add(req_id)

    def free_request(self, req_id: str) -> None:
        super().free_request(req_id)
        self.kv.free(req_id)
        if req_id in self.probes:  # a real request's features are the target's to free
            self.probes.discard(req_id)
            self.store.free(req_id)
        self.fed.pop(req_id, None)
        self.generators.pop(req_id, None)

    def precompute(self, req_id: str, tokens: list[int], max_tokens: int | None = None) -> int:
        """Feed the entries whose features the target holds (all but the last token's: drafting feeds that)."""
        known = min(self.store.length(req_id), len(tokens) - 1)
        start = self.fed[req_id]
        stop = known if max_tokens is None else min(known, start + max_tokens)
        if stop > start:
            self.kv.truncate(req_id, start)
            feats = self._features(req_id, start, stop)
            if feats is not None:
                self.head.draft_step(self.kv, [(req_id, torch.tensor(tokens[start + 1:stop + 1], device=self.device),
                                                self.head.hidden_in(feats))])
                self.fed[req_id] = stop
        return known - stop

    def _features(self, req_id: str, start: int, stop: int) -> torch.Tensor | None:
        rows = self.store.get(req_id, start, stop)
        if rows is None:
            return None
        rows = rows if self.all_columns else rows.index_select(1, self.columns)
        return rows.to(self.device, torch.float32)

    def _propose(self, inputs: list[DraftInput]) -> list[Draft]:
        try:
            with torch.inference_mode():
                return self._draft(inputs)
        except Exception:
            for x in inputs:  # a step failed midway: rebuild this request's entries next time
                if x.req_id in self.fed:
                    self.kv.truncate(x.req_id, 0)
                    self.fed[x.req_id] = 0
            raise

    def _draft(self, inputs: list[DraftInput]) -> list[Draft]:
        out: dict[str, list[int]] = {x.req_id: [] for x in inputs}
        probs: dict[str, list[torch.Tensor]] = {x.req_id: [] for x in inputs}
        ks = {x.req_id: max(0, min(x.k, self.max_model_len - len(x.tokens))) for x in inputs}
        seqs, switch_s = [], dict.fromkeys(out, 0.0)
        for x in inputs:
            n = len(x.tokens) - 1  # the newest committed token's position: its entry drafts the next
            if ks[x.req_id] == 0 or n < 1 or self.store.length(x.req_id) < n:
                continue  # no features for it yet (tokens the target has not read: a draft-ahead): no draft
            start = min(self.fed[x.req_id], n - 1)
            feats = self._features(x.req_id, start, n)
            if feats is None:
                continue
            self.kv.truncate(x.req_id, start)  # drop the last call's own draft entries
            self.fed[x.req_id] = n
            seqs.append((x.req_id, torch.tensor(x.tokens[start + 1:n + 1], device=self.device), self.head.hidden_in(feats)))
            switch_s[x.req_id] = float(n - start - 1)  # entries beyond the one each slot feeds: the catch-up
        first = True
        while seqs:
            catching_up = first and sum(switch_s.values()) > 0
            t0 = self.clock.now() if catching_up else 0.0
            hidden, logits = self.head.draft_step(self.kv, seqs)
            if catching_up:
                spent, total = self.clock.now() - t0, sum(switch_s.values())
                switch_s = {r: spent * n / total for r, n in switch_s.items()}
            elif first:
                switch_s = dict.fromkeys(switch_s, 0.0)
            first = False
            plain = self.head.to_target_ids(logits.argmax(-1)).tolist()  # greedy requests without logit_bias
            full = None  # the target-vocabulary rows [n, V], built only for the others
            nxt = []
            for i, (rid, _, _) in enumerate(seqs):
                params = self.params[rid]
                if params.is_greedy and not params.logit_bias:
                    tok = plain[i]
                else:
                    if full is None:
                        full = logits.new_full((len(seqs), self.head.target_vocab), float("-inf"))
                        full[:, self.head.d2t] = logits
                    if params.is_greedy:
                        tok = int(biased(full[i], params).argmax())
                    else:
                        p = to_probs(full[i:i + 1], params)[0]
                        tok = sample(p, self.generators[rid])
                        probs[rid].append(p)
                out[rid].append(tok)
                if len(out[rid]) < ks[rid]:
                    nxt.append((rid, torch.tensor([tok], device=self.device), hidden[i:i + 1]))
            seqs = nxt
        return [Draft(out[r], torch.stack(probs[r]) if probs[r] else None, switch_s.get(r, 0.0)) for r in out]
