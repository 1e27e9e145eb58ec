"""The target side of a time slot: prefill prompts in chunks; append each request's pending token and its
draft, verify, roll back.

Invariant per request: the target's KV holds every committed token but the newest ones (`pending`).
`prefill` feeds a chunk of pending tokens into the KV without computing logits; a verify forward appends
`pending + draft`, reads the last `len(draft) + 1` logits rows, keeps the KV of the accepted drafts and
rolls back the rest, leaving exactly one pending token (the recovered or bonus one).

A request with a grammar (structured output, spind/grammar.py) has its draft cut where the grammar refuses it
(and lengthened by the tokens it forces) before the forward, and its logits masked to what the grammar allows
before acceptance; logprobs read the raw logits. `fork` starts one of a prompt's n completions on another's
prefilled KV.

Prefix caching (the runner's KV cache, spind/models/kv_cache.py): at its first prefill chunk a request takes the
cached KV of the longest prompt prefix published by then (not at admission: requests admitted together reuse what
the first of them prefilled in an earlier slot); each prefill publishes the full blocks it completed, and a request
that ends publishes the rest of its committed sequence (its answer: the next turn of a chat begins with it). The
coordinator still plans chunks over the whole prompt; a chunk's tokens that were reused are skipped, not computed
(`prefill` says how many). Off beside a feature-level draft head, which reads every prompt token's features.

`verify` is transactional: if one request's verification fails (its data, not the model), every request's
KV is rolled back to where it was and `RequestFailed` names the culprits, so the caller can fail them alone
and rerun the others: one bad request never costs another its slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from spind.drafters.eagle import FeatureStore
from spind.grammar import Grammars
from spind.models.runner import ForwardItem, ModelRunner
from spind.params import SamplingParams
from spind.worker.device import is_fatal_device_error
from spind.worker.sampling import (accept_greedy, argmax_rows, biased, make_generator, to_probs, token_logprobs,
                                   verify_stochastic)


class RequestFailed(RuntimeError):
    """An op failed because of the named requests' data; nothing was changed for any request."""

    def __init__(self, req_ids: list[str], why: str) -> None:
        super().__init__(f"request(s) {', '.join(req_ids)} failed: {why}")
        self.req_ids = req_ids


@dataclass
class VerifyItem:
    req_id: str
    draft: list[int]
    draft_probs: torch.Tensor | None = None  # [len(draft), V]; None = point mass
    max_draft: int = 0  # a request with a grammar: the tokens it forces may lengthen the draft up to this


@dataclass
class VerifyOutput:
    req_id: str
    num_drafted: int
    num_accepted: int
    tokens: list[int]  # newly committed: accepted drafts + one recovered/bonus token
    # per token, when the request asks for them: (log-probability, top ids, top log-probabilities); see token_logprobs
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


class TargetVerifier:
    def __init__(self, runner: ModelRunner, grammars: Grammars | None = None) -> None:
        self.runner = runner
        self.grammars = grammars  # structured output: requests with a grammar (None: this target cannot)
        self.grammar_s = 0.0  # seconds the last verify spent on grammars
        self.pending: dict[str, list[int]] = {}
        self.reused: dict[str, int] = {}  # leading pending tokens whose KV came from the prefix cache (looked up
        # at a request's first prefill chunk: absent until then)
        self.sequences: dict[str, list[int]] = {}  # with prefix caching, each request's committed tokens
        # the features of committed tokens, where a feature-level draft head (spind/drafters/eagle.py) reads them
        self.features: FeatureStore | None = None
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator] = {}

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add_request(self, req_id: str, tokens: list[int], params: SamplingParams, num_output: int = 0) -> None:
        """Register a request whose committed sequence is `tokens` (a prompt, or a re-prefill: then its last
        `num_output` tokens are output, which its grammar has already passed)."""
        if not tokens:
            raise ValueError("empty prompt")
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this target cannot enforce a grammar")
            self.grammars.add(req_id, params.grammar, tokens[len(tokens) - num_output:] if num_output else [])
        self.runner.add_request(req_id)
        if self.features is not None:
            self.features.add(req_id)
        elif self.runner.kv.prefix_caching:
            self.sequences[req_id] = list(tokens)
        self.pending[req_id] = list(tokens)
        self.params[req_id] = params
        self.generators[req_id] = make_generator(params.seed)

    def fork(self, src: str, dst: str, params: SamplingParams) -> None:
        """Register `dst` as a copy of `src` (same committed tokens) sharing its KV blocks, copied on write: one of
        the n completions of a prompt that `src` prefilled. Its own sampling parameters and random stream."""
        if src not in self.pending:
            raise ValueError(f"{dst}: cannot share the KV of {src}, which this worker does not hold")
        self.runner.fork(src, dst)
        if self.features is not None:
            self.features.fork(src, dst)
        if self.grammars is not None:
            self.grammars.fork(src, dst)
        self.pending[dst] = list(self.pending[src])
        if src in self.sequences:
            self.sequences[dst] = list(self.sequences[src])
        self.params[dst] = params
        self.generators[dst] = make_generator(params.seed)

    def free_request(self, req_id: str) -> None:
        sequence = self.sequences.pop(req_id, None)
        if self.runner.has_request(req_id):
            if sequence is not None:  # what its KV holds (all but the newest token), for a later prompt to reuse
                self.runner.publish(req_id, sequence[:self.runner.length(req_id)])
            self.runner.free_request(req_id)
        if self.grammars is not None:
            self.grammars.free(req_id)
        if self.features is not None:
            self.features.free(req_id)
        for d in (self.pending, self.params, self.generators, self.reused):
            d.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.pending

    def num_pending(self, req_id: str) -> int:
        return len(self.pending[req_id])

    def prefill(self, chunks: list[tuple[str, int]]) -> list[int]:
        """Write KV for the next `n` pending tokens of each (req_id, n); at least one token stays pending. Returns
        per chunk how many of its tokens the prefix cache held already (skipped, not computed)."""
        reused = [self._chunk(req_id, n) for req_id, n in chunks]
        items = [ForwardItem(req_id, self.pending[req_id][r:n], 0) for (req_id, n), r in zip(chunks, reused) if r < n]
        if self.features is None:
            self.runner.forward(items)
        else:
            for it, rows in zip(items, self.runner.forward_features(items, self.features.layers)[1]):
                self.features.append(it.req_id, rows)
        for (req_id, n), r in zip(chunks, reused):
            upto = self._published_upto(req_id, n)
            del self.pending[req_id][:n]
            self._chunk_written(req_id, r, upto)
        return reused

    def _chunk(self, req_id: str, n: int) -> int:
        """A chunk of `n` of the request's pending tokens, checked; at its first chunk the request takes the prefix
        cache's KV of its sequence. Returns the chunk's leading tokens that KV holds (not computed)."""
        pending = self.pending[req_id]
        if not 0 < n < len(pending):
            raise ValueError(f"{req_id}: prefill of {n} tokens with {len(pending)} pending")
        if req_id in self.sequences and req_id not in self.reused:  # its first chunk: what is cached by now
            self.reused[req_id] = self.runner.reuse_prefix(req_id, self.sequences[req_id])
        return min(self.reused.get(req_id, 0), n)

    def _published_upto(self, req_id: str, n: int) -> int:
        """The request's committed tokens whose KV is final once a chunk of `n` of its pending tokens is written."""
        sequence = self.sequences.get(req_id)
        return 0 if sequence is None else len(sequence) - len(self.pending[req_id]) + n

    def _chunk_written(self, req_id: str, reused: int, upto: int) -> None:
        """A chunk's KV is in: its cached tokens are used up, the full blocks it completed published for others."""
        if req_id in self.sequences:
            self.reused[req_id] -= reused
            self.runner.publish(req_id, self.sequences[req_id][:upto])

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (requests keep the KV they hold)."""
        self.runner.reset_prefix_cache()

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        return self.prefill_and_verify([], items)[1]

    def prefill_and_verify(self, chunks: list[tuple[str, int]], items: list[VerifyItem]
                           ) -> tuple[list[int], list[VerifyOutput]]:
        """`prefill(chunks)`, then `verify(items)`, as one forward: the weights are read once for both (a slot that
        admits prompts costs one pass over them, not two). A request in both completes its prompt and verifies
        its first token in one run of rows (its chunk must leave exactly one pending token). The rows of every
        request are what the two ops would compute (the CPU kernels are batch-invariant). Returns per chunk the
        tokens the prefix cache held, and the verify's outputs. If the verify fails, the chunks are not written
        either: nothing changed."""
        verified = {it.req_id for it in items}
        for req_id, n in chunks:
            if req_id in verified and n != len(self.pending[req_id]) - 1:
                raise ValueError(f"{req_id}: a chunk of {n} of its {len(self.pending[req_id])} pending tokens does "
                                 "not complete its prompt before its verify")
        proposed = {it.req_id: len(it.draft) for it in items}
        t0 = time.perf_counter()
        cut_q, allowed = self._apply_grammars(items)
        self.grammar_s = time.perf_counter() - t0  # this verify's grammar work (cuts, masks, commits): its cost
        before = {r: self.runner.length(r) for r in [*verified, *(r for r, _ in chunks)]}
        looked_up = [r for r, _ in chunks if r in self.sequences and r not in self.reused]  # reuse_prefix in this op
        rng = {it.req_id: self.generators[it.req_id].get_state() for it in items}
        try:
            reused = [self._chunk(req_id, n) for req_id, n in chunks]
            upto = {req_id: self._published_upto(req_id, n) for req_id, n in chunks}
            skip = {req_id: r for (req_id, _), r in zip(chunks, reused) if req_id in verified}  # cached, not fed
            pre = [ForwardItem(req_id, self.pending[req_id][r:n], 0)
                   for (req_id, n), r in zip(chunks, reused) if req_id not in verified and r < n]
            fitems = pre + [ForwardItem(it.req_id, self.pending[it.req_id][skip.get(it.req_id, 0):] + it.draft,
                                        len(it.draft) + 1) for it in items]
            if self.features is None:
                logits, features, pre_features = self.runner.forward(fitems)[len(pre):], None, []
            else:
                logits, features = self.runner.forward_features(fitems, self.features.layers)
                logits, pre_features, features = logits[len(pre):], features[:len(pre)], features[len(pre):]
            outs = self._accept_all(items, logits, features, cut_q, allowed, proposed, skip, before, rng)
        except BaseException:  # the chunks' KV (and any prefix KV looked up for them) back to before
            for req_id, _ in chunks:
                self.runner.truncate(req_id, before[req_id])
            for req_id in looked_up:
                self.reused.pop(req_id, None)
            raise
        for it, rows in zip(pre, pre_features):
            self.features.append(it.req_id, rows)
        for (req_id, n), r in zip(chunks, reused):
            if req_id not in verified:  # a completing request's pending tokens went with its verify
                del self.pending[req_id][:n]
            self._chunk_written(req_id, r, upto[req_id])
        return reused, outs

    def _accept_all(self, items: list[VerifyItem], logits: list[torch.Tensor], features: list[torch.Tensor] | None,
                    cut_q: dict[str, torch.Tensor], allowed: dict[str, torch.Tensor], proposed: dict[str, int],
                    skip: dict[str, int], before: dict[str, int], rng: dict[str, torch.Tensor]
                    ) -> list[VerifyOutput]:
        """Acceptance of every verified request from its logits rows, its KV cut to what it accepted; or, if one
        request's data fails it, every request back to `before` and `RequestFailed` naming the culprits."""
        # what acceptance reads: the logits masked to what each request's grammar allows (logprobs read them raw)
        masked = [rows if it.req_id not in allowed else
                  rows.masked_fill(~allowed[it.req_id].to(rows.device), float("-inf"))
                  for it, rows in zip(items, logits)]
        # the target's argmax of every greedy request's rows in one device->host copy (not a sync per request)
        greedy = [i for i, it in enumerate(items) if self.params[it.req_id].is_greedy]
        flat = argmax_rows([biased(masked[i], self.params[items[i].req_id]) for i in greedy]) if greedy else []
        picks, at = {}, 0
        for i in greedy:
            picks[i], at = flat[at:at + len(logits[i])], at + len(logits[i])
        results, failed = [], []
        for i, (it, rows) in enumerate(zip(items, masked)):
            try:
                if it.req_id in allowed:
                    self.grammars.check(it.req_id, allowed[it.req_id])
                results.append(self._accept(it, rows, picks.get(i), cut_q.get(it.req_id)))
            except (RuntimeError, ValueError) as e:
                if is_fatal_device_error(e):  # the device, not this request's data: no request is at fault
                    raise
                failed.append((it.req_id, f"{type(e).__name__}: {e}"))
        if failed:  # nothing happened: every request's KV back to where it was, pending untouched
            for req_id, length in before.items():
                self.runner.truncate(req_id, length)
            for req_id, state in rng.items():
                self.generators[req_id].set_state(state)
            raise RequestFailed([r for r, _ in failed], "; ".join(w for _, w in failed))
        outs, t0 = [], time.perf_counter()
        for i, (it, rows, (num_accepted, tokens)) in enumerate(zip(items, logits, results)):
            rejected = len(it.draft) - num_accepted
            self.runner.truncate(it.req_id, self.runner.length(it.req_id) - rejected)
            if features is not None:  # the rows of what it committed: its pending tokens and accepted drafts
                fed = len(self.pending[it.req_id]) - skip.get(it.req_id, 0)
                self.features.append(it.req_id, features[i][:fed + num_accepted])
            self.pending[it.req_id] = tokens[-1:]
            if it.req_id in self.sequences:
                self.sequences[it.req_id] += tokens
            if it.req_id in allowed:
                self.grammars.commit(it.req_id, tokens)
            num_top = self.params[it.req_id].logprobs
            lps = None if num_top is None else token_logprobs(rows, tokens, num_top)
            # drafted: what the drafter proposed (tokens a grammar refused count as rejected drafts), or the verified
            # draft's length where the tokens a grammar forced made it longer
            num_drafted = max(proposed[it.req_id], len(it.draft))
            outs.append(VerifyOutput(it.req_id, num_drafted, num_accepted, tokens, lps))
        if allowed:
            self.grammar_s += time.perf_counter() - t0  # the commits, and the (small) rest of this loop
        return outs

    def _apply_grammars(self, items: list[VerifyItem]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Cut each grammar request's draft at its first token the grammar refuses (before the forward: it costs
        nothing), and the tokens the grammar allows at each position left to verify. Returns the proposal row of
        each cut token (a sampled draft's: see verify_stochastic) and the allowed masks [len(draft) + 1, V]."""
        constrained = [it for it in items if self.grammars is not None and it.req_id in self.grammars]
        if not constrained:
            return {}, {}
        cut_q, ends = {}, {}
        eos = self.grammars.eos_ids
        for it in constrained:
            n = self.grammars.valid_prefix(it.req_id, it.draft)
            end = next((j for j, t in enumerate(it.draft[:n]) if t in eos), None)
            if end is not None:  # the output ends at this EOS: nothing after it is verified
                ends[it.req_id], n = end, end + 1
            elif n < len(it.draft) and it.draft_probs is not None:
                cut_q[it.req_id] = it.draft_probs[n]
            if n < len(it.draft):
                it.draft = it.draft[:n]
                it.draft_probs = None if it.draft_probs is None else it.draft_probs[:n]
            # Tokens the grammar forces next join the draft, where that keeps sampling exact: a point-mass draft (or a
            # greedy request) whose proposal at each position is a function of the tokens before it; not a sampled
            # draft from q (a cut one must reject at its cut: verify_stochastic's cut_q)
            room = it.max_draft - len(it.draft)
            if room > 0 and end is None and (it.draft_probs is None or self.params[it.req_id].is_greedy):
                it.draft = it.draft + self.grammars.forced(it.req_id, it.draft)[:room]
                it.draft_probs = None
        masks = self.grammars.allowed([(it.req_id, it.draft) for it in constrained])
        for it, m in zip(constrained, masks):
            if it.req_id in ends:
                m[ends[it.req_id] + 1:] = True  # past the end: whatever comes is dropped with it
        return cut_q, {it.req_id: m for it, m in zip(constrained, masks)}

    def _accept(self, it: VerifyItem, rows: torch.Tensor, argmax: list[int] | None,
                cut_q: torch.Tensor | None = None) -> tuple[int, list[int]]:
        """Accepted drafts + the recovered/bonus token of one request (no state changes); `argmax`: the rows'
        argmax, for a greedy request; `cut_q`: see verify_stochastic."""
        params = self.params[it.req_id]
        if params.is_greedy:
            res = accept_greedy(argmax, it.draft)
        else:
            probs = to_probs(rows, params)
            if not torch.isfinite(probs).all():
                raise ValueError("the sampling parameters give a non-finite distribution")
            res = verify_stochastic(probs, it.draft, it.draft_probs, self.generators[it.req_id], cut_q)
        return res.num_accepted, res.tokens
