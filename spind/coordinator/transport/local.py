"""The coordinator over in-process workers, driven synchronously: what `spind generate`, every `spind
bench` and the tests run. It is the daemon's own `Coordinator` (same scheduling, selection, capacities,
precompute and verification), with `InProcessPool` in place of worker processes.

    engine = LocalEngine.load(cfg)
    results = engine.generate([GenRequest("r1", prompt_ids, SamplingParams(max_tokens=64), "auto")])
    engine.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig
from spind.coordinator.engine import Coordinator
from spind.coordinator.interface import EngineRequest
from spind.coordinator.placement import threads_for, worker_names
from spind.coordinator.transport.pool import InProcessPool
from spind.coordinator.selection.protocol import Selector
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer


@dataclass
class GenRequest:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str | None = None  # None = plain target decoding; "auto" = the selector; or a drafter name
    k: int | None = None  # None = the selector's / config's


@dataclass(kw_only=True)
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
    elapsed_s: float
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # per drafter used: drafted, accepted
    finish_detail: str = ""
    logprobs: list[P.OutputLogprobs] | None = None  # per output token, when the request asked (params.logprobs)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("logprobs")
        d["acceptance_rate"] = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        d["tokens_per_s"] = len(self.token_ids) / self.elapsed_s if self.elapsed_s else 0.0
        return d


def with_drafters(cfg: SpindConfig, drafters: list[str] | None) -> SpindConfig:
    """cfg with only the named drafters (all configured ones when None), its selection policy falling back to what
    is loaded (none without drafters, lbss where a fixed policy's drafter is left out)."""
    if drafters is None:
        return cfg
    for name in drafters:
        cfg.drafter(name)  # unknown -> ConfigError before anything loads
    cfg = dataclasses.replace(cfg, drafters=tuple(d for d in cfg.drafters if d.name in drafters))
    policy = cfg.selection.parsed_policy
    if not drafters or policy.is_fixed and policy.drafter not in drafters:
        fallback = "none" if not drafters else "lbss"  # auto selects among what is loaded
        cfg = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, policy=fallback))
    return cfg


class LocalEngine:
    def __init__(self, cfg: SpindConfig, pool: InProcessPool, tokenizer: Tokenizer,
                 selector: Selector | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.loop = asyncio.new_event_loop()
        self.coordinator = Coordinator(cfg, pool, tokenizer, selector)
        try:
            self.loop.run_until_complete(self.coordinator.start())
        except BaseException:
            self.loop.close()
            raise

    @classmethod
    def load(cls, cfg: SpindConfig, drafters: list[str] | None = None, selector: Selector | None = None,
             make_worker=None, tokenizer: Tokenizer | None = None) -> "LocalEngine":
        """Load the target and the named drafters (all configured ones when None) in this process; `tokenizer`:
        the target's, when the caller has already loaded it."""
        from spind.models.loader import load_generation_defaults, resolve_model_dir

        cfg = with_drafters(cfg, drafters)
        if make_worker is None:
            lock, shared = threading.Lock(), {}

            def make_worker(name: str):
                # torch comes in here, on the workers' threads, once the engine has said what it loads: imported
                # first, it kept a cached `spind generate` silent for ~1.5 s before its first line
                from spind.worker.probs import LocalProbsChannel
                from spind.worker.worker import Worker

                with lock:  # one channel between the target and the drafters, whichever worker builds first
                    if "channel" not in shared:
                        shared["channel"] = LocalProbsChannel()
                return Worker(name, cfg, probs_out=shared["channel"], probs_in=shared["channel"])

        model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
        pool = InProcessPool(worker_names(cfg), make_worker, lambda name: threads_for(cfg, name))
        engine = cls(cfg, pool, tokenizer or Tokenizer(model_dir), selector)
        engine.coordinator.generation_defaults = load_generation_defaults(model_dir)
        return engine

    @property
    def max_model_len(self) -> int:
        return self.coordinator.max_model_len

    def worker(self, name: str = TARGET_WORKER):
        return self.pool.worker(name)

    @property
    def target(self):
        """The target verifier (its runner and model) of the in-process target worker."""
        return self.worker(TARGET_WORKER).target

    def drafter(self, name: str):
        return self.worker(self.cfg.drafter(name).worker).drafters[name]

    @property
    def drafters(self) -> dict:
        """Every loaded drafter by name (the objects inside the in-process workers)."""
        return {d.name: self.drafter(d.name) for d in self.cfg.drafters}

    def generate(self, requests: list[GenRequest], max_batch: int | None = None) -> list[GenResult]:
        """Run requests to completion through the coordinator (at most max_batch at once)."""
        return self.loop.run_until_complete(self._generate(requests, max_batch))

    async def _generate(self, requests: list[GenRequest], max_batch: int | None) -> list[GenResult]:
        ph = self.coordinator.phases
        saved = ph.max_batch_size
        ph.max_batch_size = max_batch or saved
        try:
            return list(await asyncio.gather(*(self._one(r) for r in requests)))
        finally:
            ph.max_batch_size = saved

    async def _one(self, r: GenRequest) -> GenResult:
        start = time.perf_counter()
        req = EngineRequest(r.req_id, list(r.prompt_ids), r.params, "none" if r.drafter is None else r.drafter, r.k)
        token_ids: list[int] = []
        text = []
        logprobs = None if r.params.logprobs is None else []
        async for d in self.coordinator.generate(req):
            token_ids += d.token_ids
            text.append(d.text)
            if logprobs is not None:
                logprobs += d.logprobs or []
            if d.finish_reason is not None:
                u = d.usage
                return GenResult(req_id=r.req_id, text="".join(text), token_ids=token_ids,
                                 finish_reason=d.finish_reason, drafter=r.drafter, num_prompt_tokens=len(r.prompt_ids),
                                 num_steps=u.num_steps, num_drafted=sum(v["drafted"] for v in u.drafters.values()),
                                 num_accepted=sum(v["accepted"] for v in u.drafters.values()),
                                 elapsed_s=time.perf_counter() - start, draft_s=u.draft_s, verify_s=u.verify_s,
                                 drafters=u.drafters, finish_detail=u.finish_detail, logprobs=logprobs)
        raise RuntimeError(f"{r.req_id}: the coordinator ended the stream without a finish")

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.run_until_complete(self.coordinator.shutdown(drain=False))
            self.loop.close()
