"""The coordinator: an asyncio actor that owns every request's state and runs the time-slot loop over a
`WorkerPool` (worker processes for the daemon, in-process workers for `spind generate`, the benches and
the tests: one loop on every path).

One time slot (paper §IV); requests join and leave between slots (continuous batching):
    schedule()   finish aborted requests; admit waiting ones (FIFO, batch limit, KV budget); plan this
                 slot's prefill chunks within the token budget (chunked prefill)
    select()     an Arm (drafter, k) per prefilled request: the selector, then capacities B_j and the
                 workers' own limits
    prefill()    the target writes KV for the planned chunks (sent first, so it runs while drafters draft)
    speculate()  one Propose per drafter worker, all concurrently; drafters hosted beside the target
                 draft inline in the Verify instead
    verify()     one batched Verify on the target: the prefilled requests, plus those whose prefill just
                 completed (their first token, without a draft)
    update()     Sequence.append (stop rules), selector feedback, one Delta per request onto its queue

Each phase takes the requests it works on and returns its result, so a micro-batch is just a smaller batch.
KV admission reserves min(prompt + max_tokens, context limit) target blocks up front and never preempts;
every model drafter's pool is as large as the target's, so the same budget bounds them. A dead worker is
restarted and its requests re-prefilled from the committed sequences held here; greedy output is
unchanged. A request whose data makes a worker op fail is failed alone; the others go on next slot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import AsyncIterator

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig
from spind.coordinator.interface import Delta, EngineError, EngineRequest, Usage
from spind.coordinator.history import History
from spind.coordinator.metrics import EngineMetrics, SlotTimes
from spind.coordinator.phases import SlotPhases
from spind.coordinator.pipeline import Pipeline
from spind.coordinator.transport.pool import WorkerDied, WorkerError, WorkerPool
from spind.coordinator.request import RequestState, Sequence, SpecStats, prompt_repetition
from spind.coordinator.scheduler import KVBudget
from spind.coordinator.recovery import RestartPolicy
from spind.coordinator.selection.baselines import build_selector
from spind.coordinator.profile import SystemProfile, load_or_measure
from spind.coordinator.selection.protocol import AUTO, PLAIN, Capacity, Selector
from spind.coordinator.selection.shadow import ShadowDrafts
from spind.coordinator.snapshot import build_state
from spind.state import SpindState
from spind.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # every worker is pinged this often (its op queue answers in order)


class Coordinator(SlotPhases):
    """Implements spind.coordinator.interface.Engine over a WorkerPool. Use from one asyncio loop:
    `c = Coordinator(cfg, pool, tokenizer); await c.start(); ...; await c.shutdown(drain=True)`."""

    def __init__(self, cfg: SpindConfig, pool: WorkerPool, tokenizer: Tokenizer | None = None,
                 selector: Selector | None = None,
                 call_timeout_s: float = 300.0, restarts: RestartPolicy | None = None,
                 heartbeat_timeout_s: float = 10.0) -> None:
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = cfg.server.model_name
        self.selector: Selector | None = selector  # None: built from [selection] at start
        self.profile: SystemProfile | None = None
        self.dominated_drafters: list[str] = []  # left out of auto selection (profile.dominated_drafters)
        self.metrics = EngineMetrics()
        self.budget = KVBudget(cfg.runtime.kv_num_blocks, cfg.runtime.kv_block_size)
        self.call_timeout_s = call_timeout_s
        self.restarts = restarts or RestartPolicy()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._pings: dict[str, tuple[float, asyncio.Future]] = {}  # worker -> (sent at, reply) of its last ping
        self._heartbeat_task: asyncio.Task | None = None
        self._failed = asyncio.Event()
        self.max_model_len = cfg.model.max_model_len
        self.max_batch_size = cfg.runtime.max_batch_size
        self.requests: dict[str, RequestState] = {}  # waiting + running
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.drafter_counters = {d.name: SpecStats() for d in cfg.drafters}
        self.times = SlotTimes()
        self.slot_id = 0
        self.drafter_worker = {d.name: d.worker for d in cfg.drafters}
        self.capacity = Capacity({d.name: cfg.drafter_capacity(d.name) for d in cfg.drafters})
        self.worker_capacity = {w: cfg.worker_capacity(w) for w in set(self.drafter_worker.values())}
        self.model_drafters = {d.name for d in cfg.drafters if d.kind != "ngram"}
        self.shadows = ShadowDrafts({d.name: (d.ngram_max, d.ngram_min) for d in cfg.drafters if d.kind == "ngram"})
        self.is_accepting = False
        self.failure: str | None = None  # set when the coordinator gave up (a worker cannot be restarted)
        self._is_shut_down = False
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._wait_s = 0.0  # time of the current slot spent awaiting workers
        self.num_cores = os.cpu_count() or 1
        self.history = History()  # busy intervals, per-second throughput, latencies: for the dashboard
        self.generation_defaults: dict[str, float] = {}  # the model's sampling defaults for unset API fields
        self.pipeline: Pipeline | None = Pipeline(self) if cfg.runtime.pipeline else None
        self._held: list[tuple[RequestState, Delta]] | None = None  # deltas held back (hold_deltas), in order

    # ---- Engine protocol ------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve the model (a GGUF is converted once, in a subprocess: this process never imports torch),
        load the tokenizer, start the workers."""
        if self.tokenizer is None:
            from spind.models.loader import load_generation_defaults, resolve_model_dir

            model_dir = await asyncio.to_thread(resolve_model_dir, self.cfg.model.target, self.cfg.cache_path, True)
            self.tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
            self.generation_defaults = load_generation_defaults(model_dir)
        self.pool.on_busy = self._on_busy
        await self.pool.start()
        try:
            self.max_model_len = self.pool.info(TARGET_WORKER).max_model_len or self.max_model_len
            if self.selector is None:
                self.selector = await self._build_selector()
            r = self.cfg.runtime
            if r.pipeline and not r.micro_batches and r.profile != "off" and self.profile is None:
                self.profile = await load_or_measure(self.pool, self.cfg, self.call_timeout_s)
        except BaseException:
            await self.pool.stop()
            raise
        self._idle.set()
        self._loop_task = asyncio.create_task(self._run(), name="spind-coordinator")
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="spind-heartbeat")
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
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        if self.pipeline is not None:
            await self.pipeline.cancel()
        for st in list(self.running) + list(self.waiting):
            self._finish(st, "abort", detail="the server is shutting down")
        self._is_shut_down = True
        await self.pool.stop()

    async def _build_selector(self) -> Selector:
        policy = self.cfg.selection.policy
        drafters = [d.name for d in self.cfg.drafters]
        costs = None
        if policy in ("greedy-length", "lbss") and self.cfg.runtime.profile != "off":
            self.profile = await load_or_measure(self.pool, self.cfg, self.call_timeout_s)
        if policy == "greedy-length":  # ranks drafters by their measured cost per draft token
            measured = self.profile.draft_ms_per_token if self.profile else {}
            costs = {n: measured.get(n, float(i + 1)) / 1e3 for i, n in enumerate(drafters)}
        if policy == "lbss" and self.profile is not None:
            min_k = min(self.cfg.selection.k_set)
            self.dominated_drafters = [d for d in self.profile.dominated_drafters(min_k) if d in drafters]
            if self.dominated_drafters:
                log.info("selection leaves out %s: %d draft tokens cost more than %d target steps (%.1f ms each), "
                         "so they cannot beat plain decoding; requests may still name them",
                         ", ".join(self.dominated_drafters), min_k, min_k + 1, self.profile.decode_ms)
                drafters = [d for d in drafters if d not in self.dominated_drafters]
        try:
            return build_selector(policy, self.cfg.selection, drafters, self.cfg.speculation.k, costs=costs)
        except ValueError as e:
            raise EngineError(str(e), 500, "bad_config") from None

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        try:
            st = self._check(req)
        except EngineError:
            self.metrics.requests.labels(status="rejected").inc()
            raise
        self.requests[req.req_id] = st
        self.waiting.append(st)
        self._idle.clear()
        self._wakeup.set()
        return self._stream(st)

    def encode_prompt(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        """Thread-safe (front ends call it off the event loop); a text too long to fit is refused before it
        is tokenized."""
        if (prompt is None) == (messages is None):
            raise EngineError("give exactly one of a prompt or chat messages")
        self._check_text_size(prompt, messages)
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

    def snapshot(self) -> SpindState:
        return build_state(self)

    def health(self) -> str | None:
        """None while healthy; else why not: the engine gave up, or a worker answers no heartbeat (hung)."""
        if self.failure:
            return self.failure
        now = time.monotonic()
        stalled = {n: now - sent for n, (sent, fut) in self._pings.items()
                   if not fut.done() and now - sent > self.heartbeat_timeout_s}
        if stalled:
            return "; ".join(f"worker {n!r} answered no heartbeat for {s:.0f} s" for n, s in stalled.items())
        return None

    async def wait_failed(self) -> None:
        """Returns once the engine has given up (a worker that cannot be restarted)."""
        await self._failed.wait()

    async def _heartbeat(self) -> None:
        """Keep one ping in flight per live worker; `health` reads one unanswered for too long as a stall."""
        while True:
            for name in self.pool.names:
                last = self._pings.get(name)
                if (last is None or last[1].done()) and self.pool.is_alive(name):
                    self._pings[name] = (time.monotonic(), self.pool.cast(name, P.Ping(0)))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def render_metrics(self) -> str:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        return self.metrics.render()

    async def worker_stats(self, name: str) -> P.WorkerStats:
        """Ping one worker (tests, dashboard): what it mirrors and its KV occupancy."""
        return await self.pool.call(name, P.Ping(0), self.call_timeout_s)

    # ---- admission checks and streaming ---------------------------------------------------------
    def _check_ids(self, ids: object) -> None:
        vocab = self.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _check_text_size(self, prompt: str | list[int] | None, messages: list[dict] | None) -> None:
        texts = [prompt] if isinstance(prompt, str) else [m.get("content") for m in messages or ()
                                                           if isinstance(m, dict)]
        num_chars = sum(len(t) for t in texts if isinstance(t, str))
        limit = self.max_model_len * self.tokenizer.max_token_chars
        if num_chars > limit:
            raise EngineError(f"the prompt has {num_chars} characters, more than {self.max_model_len} tokens (the "
                              f"context limit) can hold", 413, "context_length_exceeded")

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
        except (ValueError, TypeError) as e:
            raise EngineError(str(e)) from None
        n = len(req.prompt_ids)
        if n == 0:
            raise EngineError("empty prompt")
        if n >= self.max_model_len:
            raise EngineError(f"prompt has {n} tokens; the context limit is {self.max_model_len}", 413,
                              "context_length_exceeded")
        if req.drafter not in (AUTO, PLAIN) and req.drafter not in self.drafter_counters:
            raise EngineError(f"unknown drafter {req.drafter!r}; available: {AUTO}, {PLAIN}, "
                              f"{', '.join(self.drafter_counters)}")
        if req.k is not None and (not isinstance(req.k, int) or not 0 <= req.k <= 32):
            raise EngineError("k must be an integer in 0..32")
        blocks = self.budget.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if blocks > self.budget.num_blocks:
            raise EngineError("request needs more KV cache than the whole pool", 413, "context_length_exceeded")
        seq = Sequence(req.req_id, req.prompt_ids, params, self.tokenizer.eos_token_ids, self.max_model_len,
                       self.tokenizer)
        return RequestState(req, seq, blocks, asyncio.Queue(), prompt_repetition(req.prompt_ids))

    async def _stream(self, st: RequestState) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await st.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:  # consumer closed early (client gone) -> abort and free everywhere
            if st.status == "waiting":
                self._finish(st, "abort", detail="the client went away")
            elif st.status == "running":
                st.is_abort_requested = True
                self._wakeup.set()

    # ---- the time-slot loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)  # a slot that never awaited a worker must still let front ends run
            if not self.running and not self.waiting and not (self.pipeline and self.pipeline.is_busy):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await (self.pipeline.tick() if self.pipeline else self.step())
            except Exception:  # a bug, not a request's fault: nothing can be trusted about this slot
                log.exception("time slot failed; aborting the running requests")
                for st in list(self.running):
                    self._finish(st, "abort", detail="internal error")
                if self.pipeline:
                    await self.pipeline.cancel()
                    self.pipeline = Pipeline(self)

    async def step(self) -> None:
        """One time slot for everything waiting and running."""
        start, self._wait_s = time.perf_counter(), 0.0
        if not all(self.pool.is_alive(n) for n in self.pool.names):
            await self._recover()  # a worker died between slots
            if self.failure:
                return
        chunks = self._schedule()
        ready = [st for st in self.running if st.is_prefilled]
        arms = self._select(ready)
        self.slot_id += 1
        prefilled = [st for st, n in chunks if n == st.num_prefill_left]
        threads = self._target_threads(arms)
        try:
            prefill = self._prefill(chunks, threads)
            try:
                drafts = await self._speculate(ready, arms)
            finally:  # the target wrote this KV whatever happened to the drafters: account for it
                error = await self._settle_prefill(prefill, chunks)
            if error is not None:
                raise error
            batch, results, verify_s = await self._verify_isolating(ready + prefilled, arms, drafts, threads)
        except WorkerDied as e:
            log.warning("%s; restarting and re-prefilling", e)
            await self._recover()
            return
        except WorkerError as e:
            self._fail_requests(e)
            return
        self._update(batch, arms, drafts, results, verify_s)
        slot_s = time.perf_counter() - start
        self.times.record(slot_s, slot_s - self._wait_s)
        self.metrics.slot.observe(slot_s)
        self.metrics.overhead.observe(slot_s - self._wait_s)

    async def _settle_prefill(self, prefill: asyncio.Future, chunks) -> BaseException | None:
        try:
            await self._await_workers(prefill)
        except (WorkerDied, WorkerError) as e:
            return e
        self._prefilled(chunks)
        return None

    def _on_busy(self, worker: str, b: P.BusyInterval) -> None:
        seconds = max(0.0, b.end - b.start)
        self.metrics.busy.labels(worker=worker, kind=b.kind).inc(seconds)
        self.history.add_busy(worker, b)

    async def _await_workers(self, aw):
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            self._wait_s += time.perf_counter() - t0

    # ---- streaming ------------------------------------------------------------------------------
    def _emit(self, st: RequestState, delta: Delta) -> None:
        """A delta onto its request's stream, or held back in order while `hold_deltas` is on."""
        if self._held is None:
            st.queue.put_nowait(delta)
        else:
            self._held.append((st, delta))

    def hold_deltas(self) -> None:
        """Hold the deltas of what completes now until `flush_deltas`: waking the front ends (an SSE chunk per request
        and token) is then scheduled after the next verify pass was dispatched, not before it, so the target does not
        idle while the tokens are written (~0.3-1 ms a slot on a 2-core CPU)."""
        if self._held is None:
            self._held = []

    def flush_deltas(self) -> None:
        held, self._held = self._held, None
        for st, delta in held or ():
            st.queue.put_nowait(delta)

    def _finish(self, st: RequestState, reason: str, token_ids: list[int] | None = None, detail: str = "") -> None:
        """Last delta (with usage) to the consumer; free the request everywhere; release its KV."""
        if st.status == "finished":
            return
        if st.status == "running":
            self.running.remove(st)
            self.budget.release(st.num_blocks)
            for name in st.synced:
                self.pool.cast(name, P.FreeRequests(0, [st.req_id]))
            self.selector.remove(st.req_id)
            self.shadows.remove(st.req_id)
        elif st in self.waiting:
            self.waiting.remove(st)
        st.status = "finished"
        st.seq.finish_reason = st.seq.finish_reason or reason
        st.finish_detail = st.finish_detail or detail
        self.requests.pop(st.req_id, None)
        if not self.requests:
            self._idle.set()
        s = st.seq.stats
        usage = Usage(st.seq.num_prompt_tokens, st.seq.num_output_tokens,
                      {n: {"drafted": c.num_drafted, "accepted": c.num_accepted} for n, c in st.per_drafter.items()},
                      s.num_steps, s.mean_accepted_length, st.finish_detail, st.draft_s, st.verify_s, st.arms_used)
        self._emit(st, Delta(token_ids or [], self._text_delta(st, len(st.seq.text)), st.seq.finish_reason, usage))
        self.metrics.requests.labels(status=st.seq.finish_reason).inc()
        latency_s = time.perf_counter() - st.arrival
        self.metrics.latency.observe(latency_s)
        self.history.add_latency(latency_s)

    # ---- faults ---------------------------------------------------------------------------------
    def _fail_requests(self, e: WorkerError) -> None:
        """A worker op failed and changed nothing: fail the requests it names alone (the others run again
        next slot); an op that failed as a whole fails the slot's requests."""
        victims = [self.requests[r] for r in e.req_ids if r in self.requests] if e.req_ids else list(self.running)
        log.error("%s; failing %d request(s)", e, len(victims))
        for st in victims:
            self.metrics.failed.inc()
            self._finish(st, "abort", detail=f"the request failed: {e}")

    async def _recover(self) -> None:
        """Restart dead workers (within the restart policy); re-add the target's requests from the committed
        sequences, to be re-prefilled chunk by chunk; drafter mirrors resync lazily on their next use."""
        for name in [n for n in self.pool.names if not self.pool.is_alive(n)]:
            self.metrics.restarts.labels(worker=name).inc()
            try:
                if not self.restarts.allow(name, time.monotonic()):
                    raise WorkerDied(name, f"restarted {self.restarts.max_restarts} times within "
                                           f"{self.restarts.window_s:.0f} s; giving up")
                await self.pool.restart(name)
            except Exception as e:
                log.error("cannot restart worker %s: %s; failing all requests", name, e)
                self.failure = f"worker {name!r} cannot be restarted: {e}"
                self.is_accepting = False
                self._failed.set()
                for st in list(self.running) + list(self.waiting):
                    self._finish(st, "abort", detail=self.failure)
                return
            hosted = set(self.pool.info(name).drafters)
            for st in self.running:
                st.synced.pop(name, None)
                st.precomputed -= hosted
                if name == TARGET_WORKER:
                    self._add_to_target(st)
