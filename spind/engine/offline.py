"""Offline generation: the whole speculative loop in one process (tests, bench, `spind generate`).

One time slot = speculate (each drafter drafts for its requests) -> verify (one batched target forward)
-> update (commit, stop rules). The daemon runs the same pieces, split across worker processes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from spind.config import SpindConfig
from spind.drafters import Drafter, DraftInput, build_drafter
from spind.engine.sequence import Sequence
from spind.engine.target import TargetVerifier, VerifyItem
from spind.models.llama import load_llama
from spind.models.loader import resolve_model_dir
from spind.models.runner import ModelRunner
from spind.models.tokenizer import Tokenizer
from spind.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class GenRequest:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str | None = None  # None = plain target decoding
    k: int = 4


@dataclass
class GenResult:
    req_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    drafter: str | None
    num_prompt_tokens: int
    num_steps: int
    num_drafted: int
    num_accepted: int
    accepted_at: list[int]
    elapsed_s: float
    draft_s: float = 0.0
    verify_s: float = 0.0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        d["tokens_per_s"] = len(self.token_ids) / self.elapsed_s if self.elapsed_s else 0.0
        return d


@dataclass
class Runtime:
    """Everything one process needs to generate: target, tokenizer, drafters."""

    cfg: SpindConfig
    tokenizer: Tokenizer
    target: TargetVerifier
    drafters: dict[str, Drafter] = field(default_factory=dict)

    @classmethod
    def load(cls, cfg: SpindConfig, drafters: list[str] | None = None, device: str = "cpu") -> "Runtime":
        """Load the target and the named drafters (all configured ones when None)."""
        model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
        tokenizer = Tokenizer(model_dir)
        model = load_llama(model_dir, cfg.model.dtype, device)
        r = cfg.runtime
        runner = ModelRunner(model, r.kv_num_blocks, r.kv_block_size, r.attention, cfg.model.max_model_len)
        names = [d.name for d in cfg.drafters] if drafters is None else drafters
        built = {n: build_drafter(cfg.drafter(n), cfg, model_dir, tokenizer, device) for n in names}
        return cls(cfg, tokenizer, TargetVerifier(runner), built)

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} "
                             f"and at least one token must be generated")

    def new_sequence(self, req: GenRequest) -> Sequence:
        self.check_prompt(req.prompt_ids)
        if req.drafter is not None and req.drafter not in self.drafters:
            raise ValueError(f"unknown drafter {req.drafter!r}; available: {', '.join(self.drafters) or '(none)'}")
        if req.k < 0:
            raise ValueError("k must be >= 0")
        return Sequence(req.req_id, list(req.prompt_ids), req.params.validate(), self.tokenizer.eos_token_ids,
                        self.max_model_len)

    def generate(self, requests: list[GenRequest], max_batch: int | None = None) -> list[GenResult]:
        """Run requests to completion with continuous batching (at most max_batch at once)."""
        max_batch = max_batch or self.cfg.runtime.max_batch_size
        seqs = {r.req_id: self.new_sequence(r) for r in requests}
        by_id = {r.req_id: r for r in requests}
        waiting = list(requests)
        running: list[GenRequest] = []
        results: dict[str, GenResult] = {}
        timers: dict[str, list[float]] = {}
        while waiting or running:
            while waiting and len(running) < max_batch:
                r = waiting.pop(0)
                self._add(r)
                running.append(r)
                timers[r.req_id] = [time.perf_counter(), 0.0, 0.0]
            self.step([by_id[r.req_id] for r in running], seqs, timers)
            for r in [r for r in running if seqs[r.req_id].is_finished]:
                running.remove(r)
                self._free(r)
                t = timers[r.req_id]
                results[r.req_id] = self._result(r, seqs[r.req_id], time.perf_counter() - t[0], t[1], t[2])
        return [results[r.req_id] for r in requests]

    def _add(self, r: GenRequest) -> None:
        self.target.add_request(r.req_id, r.prompt_ids, r.params)
        if r.drafter is not None:
            self.drafters[r.drafter].add_request(r.req_id, r.params)

    def _free(self, r: GenRequest) -> None:
        self.target.free_request(r.req_id)
        if r.drafter is not None:
            self.drafters[r.drafter].free_request(r.req_id)

    def step(self, running: list[GenRequest], seqs: dict[str, Sequence], timers: dict[str, list[float]]) -> None:
        """One time slot for all running requests: speculate -> verify -> update."""
        drafts: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        groups: dict[str, list[GenRequest]] = {}
        for r in running:
            if r.drafter is not None and seqs[r.req_id].max_draft(r.k) > 0:
                groups.setdefault(r.drafter, []).append(r)
        for name, reqs in groups.items():
            t0 = time.perf_counter()
            out = self.drafters[name].propose(
                [DraftInput(r.req_id, seqs[r.req_id].tokens, seqs[r.req_id].max_draft(r.k)) for r in reqs])
            dt = (time.perf_counter() - t0) / len(reqs)
            for r, d in zip(reqs, out):
                drafts[r.req_id] = (d.tokens, d.probs)
                timers[r.req_id][1] += dt
        t0 = time.perf_counter()
        items = [VerifyItem(r.req_id, *drafts.get(r.req_id, ([], None))) for r in running]
        outs = self.target.verify(items)
        dt = (time.perf_counter() - t0) / len(running)
        for r, o in zip(running, outs):
            seq = seqs[r.req_id]
            seq.stats.record(o.num_drafted, o.num_accepted)
            seq.append(o.tokens, self.tokenizer)
            timers[r.req_id][2] += dt

    def _result(self, r: GenRequest, seq: Sequence, elapsed: float, draft_s: float, verify_s: float) -> GenResult:
        s = seq.stats
        return GenResult(r.req_id, seq.text, list(seq.output_ids), seq.finish_reason or "abort", r.drafter,
                         len(r.prompt_ids), s.num_steps, s.num_drafted, s.num_accepted, list(s.accepted_at),
                         elapsed, draft_s, verify_s)
