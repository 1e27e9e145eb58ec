"""The coordinator: an asyncio actor that owns every request's state and runs the time-slot loop.

One time slot (paper §IV); requests join and leave between slots (continuous batching):
    schedule()   finish aborted requests (free them on every worker); admit waiting ones, FIFO, within the
                 batch limit and the KV budget
    select()     drafter per request — a pure policy (`StaticSelector` now; the learning bandit later)
    speculate()  one Propose per worker that hosts a selected drafter, all workers concurrently
    verify()     one batched Verify on the target worker
    update()     Sequence.append (stop rules), counters, one Delta per request onto its queue

KV admission: a request reserves target blocks for min(prompt + max_tokens, context limit) up front and is
never preempted. So a running request never meets a full cache and a re-prefill after a worker restart
always fits; the price is idle blocks when max_tokens is a loose bound. Every model drafter's pool has as
many blocks as the target's and a request never holds more KV in one pool than its target reservation, so
the target budget bounds every drafter pool too (also when a selector moves requests between drafters).

A drafter's worker learns of a request lazily (AddRequest + a low-priority Precompute of its prompt, in
that worker's idle time, while the target prefills); after that each Propose carries only the tokens
committed since. A dead worker is restarted and re-prefilled from the committed sequences held here;
the slot it broke is rerun, so greedy output is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from spind import protocol as P
from spind.config import SpindConfig
from spind.daemon.interface import Delta, EngineError, EngineRequest, Usage
from spind.daemon.metrics import EngineMetrics, SlotTimes
from spind.daemon.policies import KVBudget, SelectInput, StaticSelector, apply_capacity, visible_len
from spind.daemon.supervisor import Supervisor, WorkerDied, WorkerError, default_run_dir
from spind.engine.sequence import Sequence, SpecStats
from spind.models.loader import resolve_model_dir
from spind.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# ---- request state --------------------------------------------------------------------------------
@dataclass
class RequestState:
    req: EngineRequest
    seq: Sequence
    k: int
    num_blocks: int  # target KV blocks reserved while running
    queue: asyncio.Queue  # Delta items, the last one has finish_reason set
    arrival: float = field(default_factory=time.perf_counter)
    status: str = "waiting"  # waiting | running | finished
    drafter: str | None = None
    is_abort_requested: bool = False
    synced: dict[str, int] = field(default_factory=dict)  # worker -> committed tokens its mirror holds
    per_drafter: dict[str, SpecStats] = field(default_factory=dict)  # this request's counts per drafter
    num_streamed_chars: int = 0
    first_token_at: float | None = None

    @property
    def req_id(self) -> str:
        return self.req.req_id


# ---- the engine -----------------------------------------------------------------------------------
class SpindEngine:
    """Implements spind.daemon.interface.Engine over worker processes. Use from one asyncio loop:
    `engine = SpindEngine(cfg); await engine.start(); ...; await engine.shutdown(drain=True)`."""

    def __init__(self, cfg: SpindConfig, run_dir: str | Path | None = None, call_timeout_s: float = 300.0,
                 load_timeout_s: float = 600.0, max_restarts: int = 5) -> None:
        self.cfg = cfg
        self.model_name = cfg.server.model_name
        run = Path(run_dir) if run_dir else Path(cfg.server.run_dir) if cfg.server.run_dir else default_run_dir()
        self.supervisor = Supervisor(cfg, run, load_timeout_s)
        for w in self.supervisor.workers.values():
            w.on_busy = self._on_busy
        self.selector = StaticSelector(cfg.speculation.default_drafter)
        self.metrics = EngineMetrics()
        self.budget = KVBudget(cfg.runtime.kv_num_blocks, cfg.runtime.kv_block_size)
        self.call_timeout_s, self.max_restarts = call_timeout_s, max_restarts
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = cfg.model.max_model_len
        self.requests: dict[str, RequestState] = {}  # waiting + running
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.drafter_counters = {d.name: SpecStats() for d in cfg.drafters}
        self.times = SlotTimes()
        self._drafter_worker = {d.name: d.worker for d in cfg.drafters}
        self._worker_capacity = {w: cfg.worker_capacity(w) for w in set(self._drafter_worker.values())}
        self.is_accepting = False
        self._is_shut_down = False
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._wait_s = 0.0  # time of the current slot spent awaiting workers

    # ---- Engine protocol ------------------------------------------------------------------------
    async def start(self) -> None:
        model_dir = await asyncio.to_thread(resolve_model_dir, self.cfg.model.target, self.cfg.cache_path)
        self.tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
        await self.supervisor.start()
        self.max_model_len = self.supervisor.target.ready.max_model_len
        self._idle.set()
        self._loop_task = asyncio.create_task(self._run(), name="spind-engine")
        self.is_accepting = True

    async def shutdown(self, drain: bool = True) -> None:
        self.is_accepting = False
        if self._is_shut_down:
            return
        if drain and self._loop_task is not None and not self._loop_task.done():
            await self._idle.wait()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for st in list(self.running) + list(self.waiting):
            self._finish(st, "abort")
        self._is_shut_down = True
        await self.supervisor.stop()

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        try:
            st = self._check(req)
        except EngineError:
            self.metrics.requests.inc(status="rejected")
            raise
        self.requests[req.req_id] = st
        self.waiting.append(st)
        self._idle.clear()
        self._wakeup.set()
        return self._stream(st)

    def encode_prompt(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise EngineError("give exactly one of a prompt or chat messages")
        try:
            if messages is not None:
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                return self.tokenizer.apply_chat(messages)
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("empty prompt")
                return self.tokenizer.encode(prompt)
            self._check_ids(prompt)
            return list(prompt)
        except ValueError as e:
            raise EngineError(str(e)) from None

    def snapshot(self) -> dict:
        reqs = [{"req_id": st.req_id, "status": st.status, "drafter": st.drafter or "none",
                 "requested_drafter": st.req.drafter, "num_prompt_tokens": len(st.seq.prompt_ids),
                 "num_output_tokens": len(st.seq.output_ids), "num_steps": st.seq.stats.num_steps}
                for st in list(self.running) + list(self.waiting)]
        drafters = {n: {"drafted": c.num_drafted, "accepted": c.num_accepted, "accepted_at": list(c.accepted_at),
                        "num_steps": c.num_steps, "acceptance_rate": c.num_accepted / max(c.num_drafted, 1),
                        "worker": self.cfg.drafter(n).worker} for n, c in self.drafter_counters.items()}
        return {"model": self.model_name, "accepting": self.is_accepting, "now": time.monotonic(),
                "workers": [w.describe() for w in self.supervisor.workers.values()], "requests": reqs,
                "drafters": drafters, "selector": self.selector.describe(), "slots": self.times.describe(),
                "kv": {"num_blocks": self.budget.num_blocks, "num_reserved": self.budget.num_reserved},
                "num_waiting": len(self.waiting), "num_running": len(self.running)}

    def render_metrics(self) -> str:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        return self.metrics.render()

    async def worker_stats(self, name: str) -> P.WorkerStats:
        """Ping one worker (tests, dashboard): what it mirrors and its KV occupancy."""
        return await self.supervisor.workers[name].call(P.Ping(0), self.call_timeout_s)

    # ---- admission checks and streaming ---------------------------------------------------------
    def _check_ids(self, ids: object) -> None:
        vocab = self.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _check(self, req: EngineRequest) -> RequestState:
        if not self.is_accepting:
            raise EngineError("the engine is not accepting requests (starting or draining)", 503, "unavailable")
        if len(self.waiting) >= self.cfg.server.max_waiting:
            raise EngineError(f"too many queued requests ({len(self.waiting)})", 503, "overloaded")
        if req.req_id in self.requests:
            raise EngineError(f"request id {req.req_id!r} is already in use")
        try:
            params = req.params.validate()
            self._check_ids(req.prompt_ids)
        except ValueError as e:
            raise EngineError(str(e)) from None
        n = len(req.prompt_ids)
        if n == 0:
            raise EngineError("empty prompt")
        if n >= self.max_model_len:
            raise EngineError(f"prompt has {n} tokens; the context limit is {self.max_model_len}", 413,
                              "context_length_exceeded")
        if req.drafter not in ("auto", "none") and req.drafter not in self.drafter_counters:
            raise EngineError(f"unknown drafter {req.drafter!r}; available: auto, none, "
                              f"{', '.join(self.drafter_counters)}")
        k = self.cfg.speculation.k if req.k is None else req.k
        if not isinstance(k, int) or not 0 <= k <= 32:
            raise EngineError("k must be an integer in 0..32")
        blocks = self.budget.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if blocks > self.budget.num_blocks:
            raise EngineError("request needs more KV cache than the whole pool", 413, "context_length_exceeded")
        seq = Sequence(req.req_id, list(req.prompt_ids), params, self.tokenizer.eos_token_ids, self.max_model_len)
        return RequestState(req, seq, k, blocks, asyncio.Queue())

    async def _stream(self, st: RequestState) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await st.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:  # consumer closed early (client gone) -> abort and free everywhere
            if st.status == "waiting":
                self._finish(st, "abort")
            elif st.status == "running":
                st.is_abort_requested = True
                self._wakeup.set()

    # ---- the time-slot loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)  # a slot that never awaited a worker must still let front ends run
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._step()
            except Exception:
                log.exception("time slot failed; aborting the running requests")
                for st in list(self.running):
                    self._finish(st, "abort")

    async def _step(self) -> None:
        start, self._wait_s = time.perf_counter(), 0.0
        if not all(w.is_alive for w in self.supervisor.workers.values()):
            await self._recover()  # a worker died between slots
        self._schedule()
        self._select()
        if not self.running:
            return
        try:
            drafts = await self._speculate()
            results = await self._verify(drafts)
        except WorkerDied as e:
            log.warning("%s; restarting and re-prefilling", e)
            await self._recover()
            return
        except WorkerError as e:
            log.error("%s; aborting the slot's requests", e)
            for st in list(self.running):
                self._finish(st, "abort")
            return
        self._update(results)
        slot_s = time.perf_counter() - start
        self.times.record(slot_s, slot_s - self._wait_s)
        self.metrics.slot.observe(slot_s)
        self.metrics.overhead.observe(slot_s - self._wait_s)

    def _on_busy(self, worker: str, b: P.BusyInterval) -> None:
        self.metrics.busy.inc(max(0.0, b.end - b.start), worker=worker, kind=b.kind)

    async def _await_workers(self, aw):
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            self._wait_s += time.perf_counter() - t0

    def _schedule(self) -> None:
        for st in [s for s in self.running if s.is_abort_requested]:
            self._finish(st, "abort")
        target = self.supervisor.target
        while self.waiting and len(self.running) < self.cfg.runtime.max_batch_size:
            st = self.waiting[0]
            if not self.budget.can_reserve(st.num_blocks):
                break  # FIFO: the head waits for blocks; later requests do not overtake it
            self.waiting.popleft()
            self.budget.reserve(st.num_blocks)
            st.status = "running"
            self.running.append(st)
            self.metrics.prompt_tokens.inc(len(st.seq.prompt_ids))
            target.cast(P.AddRequest(0, st.req_id, st.seq.tokens, P.sampling_to_record(st.seq.params), True))
            st.synced[target.name] = len(st.seq.tokens)

    def _select(self) -> None:
        choice = self.selector.select([SelectInput(st.req_id, st.req.drafter, st.drafter) for st in self.running])
        choice = apply_capacity(choice, self._drafter_worker, self._worker_capacity)
        for st, name in zip(self.running, choice):
            st.drafter = name

    async def _speculate(self) -> dict[str, P.DraftRecord]:
        proposes: dict[str, list[P.ProposeItem]] = {}
        precomputes: dict[str, list[P.PrecomputeItem]] = {}
        for st in self.running:
            if st.drafter is None:
                continue
            w, tokens = self.supervisor.worker_of(st.drafter), st.seq.tokens
            if w.name not in st.synced:  # first use on this worker (or it restarted): mirror it
                w.cast(P.AddRequest(0, st.req_id, tokens, P.sampling_to_record(st.seq.params), False))
                st.synced[w.name] = len(tokens)
                if self.cfg.drafter(st.drafter).kind != "ngram":  # prefill its KV while the target prefills
                    precomputes.setdefault(w.name, []).append(P.PrecomputeItem(st.req_id, st.drafter, len(tokens), []))
                    continue
            k = st.seq.max_draft(st.k)
            if k > 0:
                base = st.synced[w.name]
                proposes.setdefault(w.name, []).append(P.ProposeItem(st.req_id, st.drafter, base, tokens[base:], k))
                st.synced[w.name] = len(tokens)
        for name, items in precomputes.items():
            self.supervisor.workers[name].cast(P.Precompute(0, items))
        calls = [self.supervisor.workers[name].call(P.Propose(0, items), self.call_timeout_s)
                 for name, items in proposes.items()]
        replies = await self._await_workers(asyncio.gather(*calls))
        return {d.req_id: d for r in replies for d in r.drafts}

    async def _verify(self, drafts: dict[str, P.DraftRecord]) -> list[P.VerifyResultRecord]:
        items = []
        for st in self.running:
            d = drafts.get(st.req_id)
            items.append(P.VerifyItemRecord(st.req_id, d.tokens, d.probs) if d else P.VerifyItemRecord(st.req_id, []))
        reply = await self._await_workers(self.supervisor.target.call(P.Verify(0, items), self.call_timeout_s))
        if [r.req_id for r in reply.results] != [st.req_id for st in self.running]:
            raise WorkerError("verify results do not match the batch")
        return reply.results

    def _update(self, results: list[P.VerifyResultRecord]) -> None:
        now = time.perf_counter()
        for st, r in zip(list(self.running), results):
            seq = st.seq
            seq.stats.record(r.num_drafted, r.num_accepted)
            if st.drafter is not None and r.num_drafted:
                st.per_drafter.setdefault(st.drafter, SpecStats()).record(r.num_drafted, r.num_accepted)
                self.drafter_counters[st.drafter].record(r.num_drafted, r.num_accepted)
                self.metrics.record_verify(st.drafter, r.num_drafted, r.num_accepted)
            kept = seq.append(r.tokens, self.tokenizer)
            self.metrics.generation_tokens.inc(len(kept))
            if kept and st.first_token_at is None:
                st.first_token_at = now
                self.metrics.ttft.observe(now - st.arrival)
            if seq.is_finished:
                self._finish(st, seq.finish_reason, kept)
            else:
                st.queue.put_nowait(Delta(kept, self._text_delta(st, visible_len(seq.text, seq.params.stop))))

    def _text_delta(self, st: RequestState, end: int) -> str:
        text = st.seq.text[st.num_streamed_chars:end]
        st.num_streamed_chars = max(st.num_streamed_chars, end)
        return text

    def _finish(self, st: RequestState, reason: str, token_ids: list[int] | None = None) -> None:
        """Last delta (with usage) to the consumer; free the request everywhere; release its KV."""
        if st.status == "finished":
            return
        if st.status == "running":
            self.running.remove(st)
            self.budget.release(st.num_blocks)
            for name in st.synced:
                self.supervisor.workers[name].cast(P.FreeRequests(0, [st.req_id]))
        elif st in self.waiting:
            self.waiting.remove(st)
        st.status = "finished"
        st.seq.finish_reason = st.seq.finish_reason or reason
        self.requests.pop(st.req_id, None)
        if not self.requests:
            self._idle.set()
        s = st.seq.stats
        usage = Usage(len(st.seq.prompt_ids), len(st.seq.output_ids),
                      {n: {"drafted": c.num_drafted, "accepted": c.num_accepted} for n, c in st.per_drafter.items()},
                      s.num_steps, s.mean_accepted_length)
        st.queue.put_nowait(Delta(token_ids or [], self._text_delta(st, len(st.seq.text)), reason, usage))
        self.metrics.requests.inc(status=reason)
        self.metrics.latency.observe(time.perf_counter() - st.arrival)

    # ---- faults ---------------------------------------------------------------------------------
    async def _recover(self) -> None:
        """Restart dead workers; re-prefill the target from the committed sequences; drafter mirrors
        resync lazily on their next use."""
        for w in [w for w in self.supervisor.workers.values() if not w.is_alive]:
            self.metrics.restarts.inc(worker=w.name)
            try:
                if w.restarts >= self.max_restarts:
                    raise WorkerDied(w.name, f"gave up after {w.restarts} restarts")
                await w.restart()
            except Exception as e:
                log.error("cannot restart worker %s: %s; failing all requests", w.name, e)
                self.is_accepting = False
                for st in list(self.running) + list(self.waiting):
                    self._finish(st, "abort")
                return
            for st in self.running:
                st.synced.pop(w.name, None)
                if w.is_target:
                    w.cast(P.AddRequest(0, st.req_id, st.seq.tokens, P.sampling_to_record(st.seq.params), True))
                    st.synced[w.name] = len(st.seq.tokens)
