"""The coordinator: an asyncio actor that owns every request's state and runs the time-slot loop over a
`WorkerPool` (worker processes for the daemon, in-process workers for `spind generate`, the benches and
the tests: one loop on every path). `Coordinator` is the engine front ends see (admission, streams, health);
the request tables and the slot's phases are its `SlotPhases` (phases.py), which its loop body drives:
`Lockstep` (lockstep.py) or `Pipeline` (pipeline.py).

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

Each phase takes the requests it works on and returns its result, so a micro-batch is just a smaller batch
(the pipeline runs the same phases per request, as each is ready).
KV admission reserves min(prompt + max_tokens, context limit) target blocks up front and never preempts;
every model drafter's pool is as large as the target's, so the same budget bounds them. A dead worker is
restarted and its requests re-prefilled from the committed sequences held here; greedy output is
unchanged. A request whose data makes a worker op fail is failed alone; the others go on next slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig
from spind.grammar import check_grammar
from spind.params import MAX_N
from spind.coordinator.interface import Delta, EngineError, EngineRequest
from spind.coordinator.lockstep import Lockstep
from spind.coordinator.phases import SlotPhases
from spind.coordinator.pipeline import Pipeline
from spind.coordinator.profile import load_or_measure
from spind.coordinator.placement import describe_placement
from spind.coordinator.recovery import RestartPolicy
from spind.coordinator.request import RequestState, Sequence, choice_id, choice_params, prompt_repetition
from spind.coordinator.selection.baselines import build_selector
from spind.coordinator.selection.protocol import AUTO, PLAIN, Selector
from spind.coordinator.snapshot import build_state
from spind.coordinator.transport.pool import WorkerDied, WorkerError, WorkerPool
from spind.progress import about, say
from spind.state import SpindState
from spind.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LOAD_S = 5  # the default model and its five drafters load in ~5 s on 2 cores (said before they start)

HEARTBEAT_INTERVAL_S = 1.0  # every worker is pinged this often (its op queue answers in order)
WATCHDOG_MAX_CPU_S = 0.05  # CPU a worker may use over watchdog_s and still count as hung (a stopped one uses 0)


class Coordinator:
    """Implements spind.coordinator.interface.Engine over a WorkerPool. Use from one asyncio loop:
    `c = Coordinator(cfg, pool, tokenizer); await c.start(); ...; await c.shutdown(drain=True)`."""

    def __init__(self, cfg: SpindConfig, pool: WorkerPool, tokenizer: Tokenizer | None = None,
                 selector: Selector | None = None,
                 call_timeout_s: float = 300.0, restarts: RestartPolicy | None = None,
                 heartbeat_timeout_s: float = 10.0, watchdog_s: float = 0.0) -> None:
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = cfg.server.model_name
        self.phases = SlotPhases(cfg, pool, call_timeout_s, restarts)
        self.phases.selector = selector  # None: built from [selection] at start
        self.loop: Lockstep | Pipeline = Pipeline(self.phases) if cfg.runtime.pipeline else Lockstep(self.phases)
        self.dominated_drafters: list[str] = []  # left out of auto selection (profile.dominated_drafters)
        self.selectable: list[str] = [d.name for d in cfg.drafters]  # what selection may choose (_build_selector)
        self.max_model_len = cfg.model.max_model_len
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.watchdog_s = watchdog_s  # 0: off
        self.generation_defaults: dict[str, float] = {}  # the model's sampling defaults for unset API fields
        self._accepting = False
        self._is_shut_down = False
        self._pings: dict[str, tuple[float, asyncio.Future]] = {}  # worker -> (sent at, reply) of its last ping
        self._ping_cpu: dict[str, float | None] = {}  # worker -> its CPU seconds when its last ping was sent
        self._heartbeat_task: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None
        self._wakeup = asyncio.Event()

    @property
    def is_accepting(self) -> bool:
        """Started, not draining, and not given up."""
        return self._accepting and self.phases.failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine gave up (a worker that cannot be restarted), or None."""
        return self.phases.failure

    # ---- Engine protocol ------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve the model (a GGUF is converted once, in a subprocess: this process never imports torch),
        load the tokenizer, start the workers."""
        if self.tokenizer is None:
            from spind.models.loader import load_generation_defaults, resolve_model_dir

            model_dir = await asyncio.to_thread(resolve_model_dir, self.cfg.model.target, self.cfg.cache_path, True)
            self.tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
            self.generation_defaults = load_generation_defaults(model_dir)
        self.pool.on_busy = self.phases.on_busy
        self.phases.tokenizer = self.tokenizer
        m = self.cfg.model
        expected = f", {about(LOAD_S)}" if m.target == "default" else ""
        say(f"loading {m.target} ({m.dtype}) with {', '.join(d.name for d in self.cfg.drafters) or 'no drafter'} on "
            f"{len(self.pool.names)} worker(s){expected} ...")
        await self.pool.start()
        say(f"placement: {describe_placement(self.pool.describe())}")
        ph = self.phases
        try:
            self.max_model_len = self.pool.info(TARGET_WORKER).max_model_len or self.max_model_len
            ph.sync_kv_budget()
            if ph.selector is None:
                ph.selector = await self._build_selector()
            if isinstance(self.loop, Pipeline) and not self._pipeline_overlaps():
                log.info("lockstep slots: selection drafts only beside the target (%s), so the pipeline has no "
                         "drafting to overlap with verification", ", ".join(self.selectable) or "no drafter")
                self.loop = Lockstep(ph)
            r = self.cfg.runtime
            if r.pipeline and not r.micro_batches and r.profile != "off" and ph.profile is None:
                ph.profile = await load_or_measure(self.pool, self.cfg, ph.call_timeout_s)
        except BaseException:
            await self.pool.stop()
            raise
        self._loop_task = asyncio.create_task(self._run(), name="spind-coordinator")
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="spind-heartbeat")
        self._accepting = True

    async def shutdown(self, drain: bool = True) -> None:
        self._accepting = False
        if self._is_shut_down:
            return
        if drain and self._loop_task is not None and not self._loop_task.done():
            await self.phases.idle.wait()
        for task in (self._loop_task, self._heartbeat_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.loop.cancel()
        self.phases.flush_deltas()  # what a lockstep slot held for its next verify
        self.phases.finish_all("the server is shutting down")
        self._is_shut_down = True
        await self.pool.stop()

    def _pipeline_overlaps(self) -> bool:
        """Whether the pipeline has drafting to overlap with verification: a drafter selection may choose drafts on
        a worker of its own. Where all it may choose drafts inline on the target's worker (n-gram, suffix; the
        model drafters left out as dominated), lockstep slots do the same work without the pipeline's bookkeeping
        (at batch 1 on a CPU, ~0.4 ms of a 5 ms step). A request that names a drafter elsewhere is still served,
        its draft and verify one after the other."""
        return any(self.phases.drafter_worker.get(d, TARGET_WORKER) != TARGET_WORKER for d in self.selectable)

    async def _build_selector(self) -> Selector:
        ph = self.phases
        policy = self.cfg.selection.parsed_policy
        drafters = [d.name for d in self.cfg.drafters]
        costs = None
        if policy.name in ("greedy-length", "lbss") and self.cfg.runtime.profile != "off":
            ph.profile = await load_or_measure(self.pool, self.cfg, ph.call_timeout_s)
        if policy.name == "greedy-length":  # ranks drafters by their measured cost per draft token
            measured = ph.profile.draft_ms_per_token if ph.profile else {}
            costs = {n: measured.get(n, float(i + 1)) / 1e3 for i, n in enumerate(drafters)}
        verify_points = []
        if policy.name == "lbss" and ph.profile is not None:
            costs = {n: ms / 1e3 for n, ms in ph.profile.draft_ms_per_token.items() if n in drafters}
            verify_points = ph.profile.verify_points()
            min_k = min(self.cfg.selection.k_set)
            self.dominated_drafters = [d for d in ph.profile.dominated_drafters(min_k) if d in drafters]
            if self.dominated_drafters:
                log.info("selection leaves out %s: %d draft tokens cost more than %d target steps (%.1f ms each), "
                         "so they cannot beat plain decoding; requests may still name them",
                         ", ".join(self.dominated_drafters), min_k, min_k + 1, ph.profile.decode_ms)
                drafters = [d for d in drafters if d not in self.dominated_drafters]
        self.selectable = [] if policy.name == "none" else [policy.drafter] if policy.drafter else drafters
        try:
            return build_selector(policy, self.cfg.selection, drafters, self.cfg.speculation.k, costs=costs,
                                  verify_points=verify_points, kv_drafters=sorted(ph.model_drafters))
        except ValueError as e:
            raise EngineError(str(e), 500, "bad_config") from None

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        try:
            group = self._check(req)
        except EngineError:
            self.phases.metrics.requests.labels(status="rejected").inc()
            raise
        for st in group:
            self.phases.add(st)
        self._wakeup.set()
        return self._stream(group)

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
                return self.tokenizer.encode_prompt(prompt)  # a BOS where the model's own tokenizer adds one
            self._check_ids(prompt)
            return list(prompt)
        except ValueError as e:
            raise EngineError(str(e)) from None

    def snapshot(self) -> SpindState:
        return build_state(self.phases, model_name=self.model_name, accepting=self.is_accepting,
                           loop=self.loop.describe())

    def health(self) -> str | None:
        """None while healthy; else why not: the engine gave up, or a worker answers no heartbeat (hung)."""
        if self.phases.failure:
            return self.phases.failure
        now = time.monotonic()
        stalled = {n: now - sent for n, (sent, fut) in self._pings.items()
                   if not fut.done() and now - sent > self.heartbeat_timeout_s}
        if stalled:
            return "; ".join(f"worker {n!r} answered no heartbeat for {s:.0f} s" for n, s in stalled.items())
        return None

    async def wait_failed(self) -> None:
        """Returns once the engine has given up (a worker that cannot be restarted)."""
        await self.phases.failed.wait()

    async def _heartbeat(self) -> None:
        """Keep one ping in flight per live worker; `health` reads one unanswered for too long as a stall, and the
        watchdog kills a worker that leaves it unanswered for `watchdog_s` while using no CPU (a busy worker
        answers late but uses CPU; a stopped or deadlocked one does not): its calls fail with `WorkerDied`, and
        the loop restarts it and re-prefills its requests, as after a crash."""
        while True:
            for name in self.pool.names:
                last = self._pings.get(name)
                if (last is None or last[1].done()) and self.pool.is_alive(name):
                    self._pings[name] = (time.monotonic(), self.pool.cast(name, P.Ping(0)))
                    self._ping_cpu[name] = self.pool.cpu_seconds(name)
                elif last is not None and self._is_hung(name, *last):
                    self.pool.info(name).hangs += 1
                    self.phases.metrics.hangs.labels(worker=name).inc()
                    await self.pool.kill(name, f"no heartbeat and no CPU used for {self.watchdog_s:.0f} s (hung)")
                    self._wakeup.set()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _is_hung(self, name: str, sent: float, reply: asyncio.Future) -> bool:
        if self.watchdog_s <= 0 or reply.done() or time.monotonic() - sent < self.watchdog_s:
            return False
        before, now = self._ping_cpu.get(name), self.pool.cpu_seconds(name)
        return before is not None and now is not None and now - before < WATCHDOG_MAX_CPU_S

    def render_metrics(self) -> str:
        ph = self.phases
        ph.metrics.running.set(len(ph.running))
        ph.metrics.waiting.set(len(ph.waiting))
        return ph.metrics.render()

    async def reset_cache(self) -> None:
        try:
            await asyncio.gather(*(self.pool.call(name, P.ForgetFinished(0), self.phases.call_timeout_s)
                                   for name in self.pool.names))
        except (WorkerDied, WorkerError) as e:  # a worker restarting comes back with empty caches anyway
            raise EngineError(f"the drafters' caches were not all reset: {e}", status=503,
                              code="unavailable") from None

    async def worker_stats(self, name: str) -> P.WorkerStats:
        """Ping one worker (tests, dashboard): what it mirrors and its KV occupancy."""
        return await self.pool.call(name, P.Ping(0), self.phases.call_timeout_s)

    # ---- admission checks and streaming ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Token ids a request may name: the tokenizer's, within the target's logits (a tokenizer's added tokens
        may go past the model's rows, which the model could not embed or score)."""
        model = self.pool.info(TARGET_WORKER).vocab_size
        return min(self.tokenizer.vocab_size, model) if model else self.tokenizer.vocab_size

    def _check_ids(self, ids: object) -> None:
        vocab = self.vocab_size
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

    def _check(self, req: EngineRequest) -> list[RequestState]:
        """The request's n completions (one request each, choice 0 under the request's own id), or EngineError."""
        if not self.is_accepting:
            raise EngineError("the engine is not accepting requests (starting or draining)", 503, "unavailable")
        ph = self.phases
        if type(req.n) is not int or not 1 <= req.n <= MAX_N:
            raise EngineError(f"n must be an integer in [1, {MAX_N}]")
        if req.n > self.cfg.server.max_waiting:
            raise EngineError(f"n = {req.n} is more completions than the queue holds ([server] max_waiting = "
                              f"{self.cfg.server.max_waiting})")
        if len(ph.waiting) + req.n > self.cfg.server.max_waiting:
            raise EngineError(f"too many queued requests ({len(ph.waiting)})", 503, "overloaded")
        ids = [req.req_id] + [choice_id(req.req_id, i) for i in range(1, req.n)]
        if any(r in ph.requests for r in ids):
            raise EngineError(f"request id {req.req_id!r} is already in use")
        try:
            params = req.params.validate()
            self._check_ids(req.prompt_ids)
            if any(t >= self.vocab_size for t, _ in params.logit_bias):
                raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")
            if params.grammar is not None:
                check_grammar(params.grammar)
        except (ValueError, TypeError) as e:
            raise EngineError(str(e)) from None
        n = len(req.prompt_ids)
        if n == 0:
            raise EngineError("empty prompt")
        if n >= self.max_model_len:
            raise EngineError(f"prompt has {n} tokens; the context limit is {self.max_model_len}", 413,
                              "context_length_exceeded")
        if req.drafter not in (AUTO, PLAIN) and req.drafter not in ph.drafter_worker:
            raise EngineError(f"unknown drafter {req.drafter!r}; available: {AUTO}, {PLAIN}, "
                              f"{', '.join(ph.drafter_worker)}")
        if req.k is not None and (not isinstance(req.k, int) or not 0 <= req.k <= 32):
            raise EngineError("k must be an integer in 0..32")
        blocks = ph.budget.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if blocks > ph.budget.num_blocks:
            raise EngineError("request needs more KV cache than the whole pool", 413, "context_length_exceeded")
        queue: asyncio.Queue = asyncio.Queue()  # the completions' deltas, interleaved
        repetition = prompt_repetition(req.prompt_ids)
        group: list[RequestState] = []
        for i, req_id in enumerate(ids):
            choice = req if i == 0 else dataclasses.replace(req, req_id=req_id, params=choice_params(params, i), n=1)
            seq = Sequence(req_id, req.prompt_ids, choice.params if i else params, self.tokenizer.eos_token_ids,
                           self.max_model_len, self.tokenizer)
            group.append(RequestState(choice, seq, blocks, queue, repetition, index=i,
                                      leader=group[0] if group else None))
        return group

    async def _stream(self, group: list[RequestState]) -> AsyncIterator[Delta]:
        left = len(group)
        try:
            while left:
                delta = await group[0].queue.get()
                yield delta
                left -= delta.finish_reason is not None
        finally:  # consumer closed early (client gone) -> abort and free everywhere
            for st in group:
                if st.status == "waiting":
                    self.phases.finish(st, "abort", detail="the client went away")
                elif st.status == "running":
                    st.is_abort_requested = True
                    self._wakeup.set()

    # ---- the time-slot loop ---------------------------------------------------------------------
    async def replace_loop(self, loop: Lockstep | Pipeline) -> None:
        """Drive the slots with another loop body (the pipeline bench compares them on one engine): once no request
        is left and nothing the current one sent is in flight (a draft ahead may outlive its request), so the two
        never run side by side."""
        await self.until_idle()
        self.loop = loop

    async def until_idle(self) -> None:
        """Return once no request is left and nothing the loop sent is in flight (a draft ahead or a follow-on slot
        may outlive its request)."""
        while self.phases.requests or self.loop.is_busy:
            await asyncio.sleep(0.005)

    async def _run(self) -> None:
        ph = self.phases
        while True:
            await asyncio.sleep(0)  # a slot that never awaited a worker must still let front ends run
            if not ph.running and not ph.waiting and not self.loop.is_busy:
                ph.flush_deltas()  # e.g. the last running request was aborted between slots
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.loop.tick()
            except Exception:  # a bug, not a request's fault: nothing can be trusted about this slot
                log.exception("time slot failed; aborting the running requests")
                ph.flush_deltas()
                ph.finish_all("internal error", running_only=True)
                await self.loop.cancel()
