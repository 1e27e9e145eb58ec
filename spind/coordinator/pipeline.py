"""The speculative decoding pipeline (paper §VI-B): drafter workers draft while the target verifies.

Requests flow through the workers instead of moving in lockstep:

    fresh ──select──► draft queue (its drafter's worker) ──► drafting ──► drafted ──┐
      ▲        └──► needs no draft (plain decoding, n-gram inline on the target) ───┤
      └──────────────────────────── verifying ◄── one verify pass: all that is ready ◄┘

- Each drafter worker drafts its queue in micro-batches of ceil(n / b) requests, b chosen by the paper's
  heuristic over the target's profile (`microbatch.py`) or fixed by [runtime].micro_batches, so it drafts
  micro-batch m+1 while the target verifies micro-batch m.
- The target verifies everything ready in one pass, merging micro-batches of different SSMs, with this
  slot's prefill chunks; requests that need no draft ride every pass, so model-free drafting never waits
  behind a model drafter. Each verify pass is a slot: the requests it verified are selected again at once.
- Draft ahead (beyond the paper, after PEARL): a drafter worker with nothing queued drafts for requests under
  verification, k + 1 tokens past their drafts as if all will be accepted (the first is its guess of the
  bonus token). If the verify accepts them all and the bonus is the guess, the next draft is ready when the
  verify ends; otherwise it is dropped, at no cost to the output. Greedy requests only.
- The target takes every core while nothing drafts beside it (`SlotPhases._target_threads`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from spind import protocol as P
from spind.coordinator.microbatch import B0, choose_micro_batches
from spind.coordinator.transport.pool import WorkerDied, WorkerError
from spind.coordinator.request import RequestState
from spind.coordinator.selection.protocol import Arm

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    assume: list[int]  # the draft under verification it was drafted past
    draft: P.DraftRecord | None = None  # None while the Propose is in flight


@dataclass
class _VerifyPass:
    chunks: list[tuple[RequestState, int]]
    batch: list[RequestState]
    arms: dict[str, Arm]
    drafts: dict[str, P.DraftRecord]


@dataclass
class PipelineState:
    arms: dict[str, Arm] = field(default_factory=dict)  # arm of each request's current cycle
    drafts: dict[str, P.DraftRecord] = field(default_factory=dict)  # drafted, waiting for a verify pass
    drafting: dict[str, str] = field(default_factory=dict)  # req_id -> worker drafting it
    verifying: set[str] = field(default_factory=set)
    ahead: dict[str, _Ahead] = field(default_factory=dict)
    awaiting: dict[str, list[int]] = field(default_factory=dict)  # verified, its ahead still in flight: tokens
    micro_batches: dict[str, int] = field(default_factory=dict)  # worker -> count last chosen

    def in_flight(self) -> set[str]:
        return set(self.drafting) | self.verifying | set(self.awaiting)


class Pipeline:
    """The coordinator's loop body while [runtime].pipeline is on."""

    def __init__(self, coordinator, micro_batches: int | None = None, draft_ahead: bool | None = None) -> None:
        self.c = coordinator
        r = coordinator.cfg.runtime
        self.micro_batches = r.micro_batches if micro_batches is None else micro_batches  # 0: the heuristic
        self.draft_ahead = r.draft_ahead if draft_ahead is None else draft_ahead
        self.state = PipelineState()
        self.target_task: asyncio.Task | None = None
        self.draft_tasks: dict[str, asyncio.Task] = {}  # worker -> its Propose in flight
        self._pass: _VerifyPass | None = None
        self._ahead_batch: dict[str, list[str]] = {}  # worker -> req_ids of its draft-ahead Propose
        self._last_pass_end = time.perf_counter()
        self._overhead_s = 0.0  # coordinator time since the last verify pass ended (not awaiting workers)

    @property
    def is_busy(self) -> bool:
        return self.target_task is not None or bool(self.draft_tasks)

    # ---- one turn of the loop -------------------------------------------------------------------
    async def tick(self) -> None:
        c = self.c
        start = time.perf_counter()
        if not all(c.pool.is_alive(n) for n in c.pool.names):
            await self.reset_and_recover()
            return
        self._dispatch()
        tasks = self._tasks()
        self._overhead_s += time.perf_counter() - start
        if not tasks:
            await asyncio.sleep(0)
            return
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        start = time.perf_counter()
        # What completed streams its tokens only after the next passes are dispatched: their sends are scheduled
        # first, so the target computes while the front ends write (the deltas are never dropped: `finally`).
        c.hold_deltas()
        try:
            try:
                self._complete_all(done)
            except WorkerDied as e:
                log.warning("%s; restarting and re-prefilling", e)
                await self.reset_and_recover()
            else:
                if all(c.pool.is_alive(n) for n in c.pool.names):
                    self._dispatch()
        finally:
            c.flush_deltas()
        self._overhead_s += time.perf_counter() - start

    def _dispatch(self) -> None:
        """Schedule and select when the target is free, then send what can go: drafts, the verify pass, drafts
        ahead."""
        c, s = self.c, self.state
        chunks: list[tuple[RequestState, int]] = []
        if self.target_task is None:
            chunks = c._schedule(busy=frozenset(s.in_flight()))
            self._purge()
            fresh = [st for st in c.running if st.is_prefilled and st.req_id not in s.arms
                     and st.req_id not in s.in_flight()]
            s.arms.update(c._select(fresh, held=s.arms))
        self._dispatch_drafts()
        if self.target_task is None:
            self._dispatch_verify(chunks)
        self._dispatch_ahead()

    def _tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.target_task, *self.draft_tasks.values()) if t is not None]

    def _complete_all(self, done: set[asyncio.Task]) -> None:
        """The target's results first: whatever else failed, what the target did must be accounted for."""
        died = None
        for task in sorted(done, key=lambda t: t is not self.target_task):
            try:
                self._complete(task)
            except WorkerDied as e:
                died = died or e
        if died is not None:
            raise died

    def _purge(self) -> None:
        """Forget the pipeline state of requests that finished (aborted, failed) while it was held."""
        s, live = self.state, self.c.requests
        for d in (s.arms, s.drafts, s.ahead, s.awaiting):
            for req_id in [r for r in d if r not in live]:
                del d[req_id]

    # ---- dispatch -------------------------------------------------------------------------------
    def _micro_batch_size(self, worker: str, num_requests: int) -> int:
        fixed = self.micro_batches
        profile = self.c.profile
        if fixed:
            b = fixed
        elif profile is not None and profile.verify_ms:
            b = choose_micro_batches(profile.verify_ms, num_requests)
        else:
            b = min(B0, num_requests)
        self.state.micro_batches[worker] = max(1, min(b, num_requests))
        return math.ceil(num_requests / self.state.micro_batches[worker])

    def _dispatch_drafts(self) -> None:
        c, s = self.c, self.state
        queues: dict[str, list[RequestState]] = {}
        assigned: dict[str, int] = {}
        for st in c.running:
            arm = s.arms.get(st.req_id)
            if arm is None or not c._needs_draft(st, arm):
                continue
            w = c.drafter_worker[arm.drafter]
            assigned[w] = assigned.get(w, 0) + 1
            if st.req_id not in s.drafts and st.req_id not in s.in_flight():
                queues.setdefault(w, []).append(st)
        for w, queue in queues.items():
            if w in self.draft_tasks:
                continue  # busy: the next micro-batch goes when this one is drafted
            take = queue[:self._micro_batch_size(w, assigned[w])]
            items = [c._propose_item(st, s.arms[st.req_id])[1] for st in take]
            for st in take:
                s.drafting[st.req_id] = w
            self.draft_tasks[w] = asyncio.create_task(c._propose(w, items), name=f"draft-{w}")

    def _dispatch_ahead(self) -> None:
        """Idle drafter workers draft ahead for the greedy requests under verification."""
        c, s = self.c, self.state
        if not self.draft_ahead or self._pass is None:
            return
        by_worker: dict[str, list[tuple[RequestState, list[int]]]] = {}
        for st in self._pass.batch:
            arm, d = s.arms.get(st.req_id), self._pass.drafts.get(st.req_id)
            if (arm is None or d is None or not d.tokens or st.req_id in s.ahead or not st.seq.params.is_greedy
                    or not c._needs_draft(st, arm)):
                continue
            w = c.drafter_worker[arm.drafter]
            if w not in self.draft_tasks:
                by_worker.setdefault(w, []).append((st, list(d.tokens)))
        for w, reqs in by_worker.items():
            items = []
            for st, assume in reqs:
                s.ahead[st.req_id] = _Ahead(assume)
                items.append(c._propose_item(st, s.arms[st.req_id], assume)[1])
            self._ahead_batch[w] = [st.req_id for st, _ in reqs]
            self.draft_tasks[w] = asyncio.create_task(c._propose(w, items), name=f"ahead-{w}")

    def _dispatch_verify(self, chunks: list[tuple[RequestState, int]]) -> None:
        c, s = self.c, self.state
        completing = [st for st, n in chunks if n == st.num_prefill_left]  # their first token, no draft
        batch = [st for st in c.running if st.req_id in s.arms and st.req_id not in s.in_flight()
                 and (st.req_id in s.drafts or not c._needs_draft(st, s.arms[st.req_id]))]
        batch += [st for st in completing if st not in batch]
        if not batch and not chunks:
            return
        arms = {st.req_id: s.arms[st.req_id] for st in batch if st.req_id in s.arms}
        drafts = {st.req_id: s.drafts.pop(st.req_id) for st in batch if st.req_id in s.drafts}
        s.verifying.update(st.req_id for st in batch)
        c.slot_id += 1
        self._pass = _VerifyPass(chunks, batch, arms, drafts)
        threads = c._target_threads(s.arms)
        self.target_task = asyncio.create_task(self._verify_pass(self._pass, threads), name="verify")

    async def _verify_pass(self, vp: _VerifyPass, threads: int):
        await self.c._prefill(vp.chunks, threads)
        self.c._prefilled(vp.chunks)
        if not vp.batch:
            return [], [], 0.0
        return await self.c._verify_isolating(vp.batch, vp.arms, vp.drafts, threads)

    # ---- completions ----------------------------------------------------------------------------
    def _complete(self, task: asyncio.Task) -> None:
        if task is self.target_task:
            self.target_task = None
            vp, self._pass = self._pass, None
            self._verified(vp, task)
            return
        w = next(name for name, t in self.draft_tasks.items() if t is task)
        del self.draft_tasks[w]
        ahead = self._ahead_batch.pop(w, None)
        try:
            drafts = task.result()
        except WorkerError as e:  # a request's data broke the drafter: fail it alone
            self.c._fail_requests(e)
            drafts = {}
        if ahead is not None:
            self._drafted_ahead(ahead, drafts)
            return
        for req_id in [r for r, worker in self.state.drafting.items() if worker == w]:
            del self.state.drafting[req_id]
            self.state.drafts[req_id] = drafts.get(req_id) or P.DraftRecord(req_id, [])

    def _verified(self, vp: _VerifyPass, task: asyncio.Task) -> None:
        c, s = self.c, self.state
        s.verifying.difference_update(st.req_id for st in vp.batch)
        try:
            verified, results, verify_s = task.result()
        except WorkerError as e:
            c._fail_requests(e)  # transactional: the others are as they were, and are verified again
            s.drafts.update(vp.drafts)
            for st in vp.batch:
                s.ahead.pop(st.req_id, None)
            return
        live = [(st, r) for st, r in zip(verified, results) if st.status == "running"]
        c._update([st for st, _ in live], vp.arms, vp.drafts, [r for _, r in live], verify_s)
        now = time.perf_counter()
        c.times.record(now - self._last_pass_end, self._overhead_s)
        c.metrics.slot.observe(now - self._last_pass_end)
        c.metrics.overhead.observe(self._overhead_s)
        self._last_pass_end, self._overhead_s = now, 0.0
        for st, r in live:
            arm = s.arms.pop(st.req_id, None)
            ahead = s.ahead.pop(st.req_id, None)
            if ahead is None or st.status != "running":
                continue
            if ahead.draft is None:  # its draft ahead is still in flight: decide when it lands
                s.ahead[st.req_id] = ahead
                s.awaiting[st.req_id] = list(r.tokens)
                s.arms[st.req_id] = arm
            else:
                self._use_ahead(st, arm, ahead, r.tokens)

    def _drafted_ahead(self, req_ids: list[str], drafts: dict[str, P.DraftRecord]) -> None:
        s = self.state
        for req_id in req_ids:
            ahead = s.ahead.get(req_id)
            if ahead is None:
                continue
            ahead.draft = drafts.get(req_id) or P.DraftRecord(req_id, [])
            if req_id in s.awaiting:  # its verify already ended
                committed = s.awaiting.pop(req_id)
                del s.ahead[req_id]
                arm = s.arms.pop(req_id)
                st = self.c.requests.get(req_id)
                if st is not None and st.status == "running":
                    self._use_ahead(st, arm, ahead, committed)

    def _use_ahead(self, st: RequestState, arm: Arm, ahead: _Ahead, committed: list[int]) -> None:
        """If the verify accepted the whole draft and the bonus token is the drafter's guess, the draft ahead
        is the next draft: the request keeps its arm and goes straight to the next verify pass."""
        guess = ahead.draft.tokens
        k = st.seq.max_draft(arm.k)
        if guess and committed == ahead.assume + guess[:1] and len(guess) > 1 and k > 0:
            self.state.arms[st.req_id] = arm
            self.state.drafts[st.req_id] = P.DraftRecord(st.req_id, guess[1:1 + k], False, ahead.draft.slot,
                                                         ahead.draft.draft_s)
            self.c.metrics.ahead.labels(outcome="used").inc()
        else:
            self.c.metrics.ahead.labels(outcome="dropped").inc()

    # ---- faults ---------------------------------------------------------------------------------
    async def reset_and_recover(self) -> None:
        """A worker died. Let the calls to the workers that live finish and account for them (a verify the
        target ran must be committed, never dropped), drop every draft, restart the dead, re-prefill."""
        tasks = self._tasks()
        if tasks:
            done, _ = await asyncio.wait(tasks)
            try:
                self._complete_all(done)
            except WorkerDied:
                pass
        self.target_task, self.draft_tasks, self._pass, self._ahead_batch = None, {}, None, {}
        self.state = PipelineState(micro_batches=self.state.micro_batches)
        await self.c._recover()

    async def cancel(self) -> None:
        """Shutting down: stop waiting for the workers."""
        tasks = self._tasks()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def describe(self) -> dict:
        return {"micro_batches": dict(self.state.micro_batches), "drafting": len(self.state.drafting),
                "drafted": len(self.state.drafts), "verifying": len(self.state.verifying),
                "ahead": len(self.state.ahead)}

