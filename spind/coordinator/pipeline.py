"""The speculative decoding pipeline (paper §VI-B): drafter workers draft while the target verifies.

Requests flow through the workers instead of moving in lockstep; each one's `Stage` says where it is:

    READY ──select──► SELECTED (its drafter worker's queue) ──► DRAFTING ──► DRAFTED ──┐
      ▲         └──► needs no draft (plain decoding, n-gram inline on the target) ───────┤
      └──────────────────────────── VERIFYING ◄── one verify pass: all that is ready ◄───┘

- Each drafter worker drafts its queue in micro-batches of ceil(n / b) requests, b chosen by the paper's
  heuristic over the target's profile (`microbatch.py`) or fixed by [runtime].micro_batches, so it drafts
  micro-batch m+1 while the target verifies micro-batch m.
- The target verifies everything ready in one pass, merging micro-batches of different SSMs, with this
  slot's prefill chunks; requests that need no draft ride every pass, so model-free drafting never waits
  behind a model drafter. Each verify pass is a slot: the requests it verified are selected again at once.
- Draft ahead (beyond the paper, after PEARL): a drafter worker with nothing queued drafts for requests under
  verification, k + 1 tokens past their drafts as if all will be accepted (the first is its guess of the
  bonus token). If the verify accepts them all and the bonus is the guess, the next draft is ready when the
  verify ends (the request goes straight to DRAFTED); otherwise it is dropped, at no cost to the output. A
  verify that ends before its draft ahead lands leaves the request AWAITING_AHEAD. Greedy requests only.
- The target takes every core while nothing drafts beside it (`SlotPhases.target_threads`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from spind import protocol as P
from spind.coordinator.microbatch import B0, choose_micro_batches
from spind.coordinator.phases import Chunks, SlotPhases, VerifyOutcome
from spind.coordinator.request import Ahead, RequestState, Stage
from spind.coordinator.selection.protocol import Arm
from spind.coordinator.transport.pool import WorkerDied, WorkerError

log = logging.getLogger(__name__)


@dataclass
class _DraftOp:
    """A Propose in flight on one drafter worker: its requests, and for a draft ahead the Ahead of each."""

    task: asyncio.Task
    requests: list[RequestState]
    aheads: list[Ahead] | None = None  # None: drafts for the next verify pass


@dataclass
class _VerifyPass:
    chunks: Chunks
    batch: list[RequestState]
    arms: dict[str, Arm]
    drafts: dict[str, P.DraftRecord] = field(default_factory=dict)


class Pipeline:
    """The coordinator's loop body while [runtime].pipeline is on."""

    def __init__(self, phases: SlotPhases, micro_batches: int | None = None, draft_ahead: bool | None = None) -> None:
        self.phases = phases
        r = phases.cfg.runtime
        self.micro_batches = r.micro_batches if micro_batches is None else micro_batches  # 0: the heuristic
        self.draft_ahead = r.draft_ahead if draft_ahead is None else draft_ahead
        self.chosen_micro_batches: dict[str, int] = {}  # worker -> count last chosen
        self.target_task: asyncio.Task | None = None
        self._pass: _VerifyPass | None = None
        self.draft_ops: dict[str, _DraftOp] = {}  # worker -> its Propose in flight
        self._last_pass_end = time.perf_counter()
        self._overhead_s = 0.0  # coordinator time since the last verify pass ended (not awaiting workers)

    @property
    def is_busy(self) -> bool:
        return self.target_task is not None or bool(self.draft_ops)

    # ---- one turn of the loop -------------------------------------------------------------------
    async def tick(self) -> None:
        ph = self.phases
        start = time.perf_counter()
        if not ph.workers_alive():
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
        ph.hold_deltas()
        try:
            try:
                self._complete_all(done)
            except WorkerDied as e:
                log.warning("%s; restarting and re-prefilling", e)
                await self.reset_and_recover()
            else:
                if ph.workers_alive():
                    self._dispatch()
        finally:
            ph.flush_deltas()
        self._overhead_s += time.perf_counter() - start

    def _dispatch(self) -> None:
        """Schedule and select when the target is free, then send what can go: drafts, the verify pass, drafts
        ahead."""
        ph = self.phases
        chunks: Chunks = []
        selection = None
        if self.target_task is None:
            chunks = ph.schedule(busy=frozenset(st.req_id for st in ph.running if st.stage.is_in_flight))
            fresh = [st for st in ph.running if st.is_prefilled and st.stage is Stage.READY]
            selection = ph.select(fresh, held=self._arms())
            for st in fresh:
                st.cycle_arm, st.stage = selection.arms[st.req_id], Stage.SELECTED
        self._dispatch_drafts()
        if self.target_task is None:
            self._dispatch_verify(chunks)
        if selection is not None:  # shadow drafts and precompute once the target has its pass (nothing commits
            ph.send_side_work(selection)  # in between: the shadows still see the tokens the pass starts from)
        self._dispatch_ahead()

    def _arms(self) -> dict[str, Arm]:
        """The arm of every request mid-cycle."""
        return {st.req_id: st.cycle_arm for st in self.phases.running if st.cycle_arm is not None}

    def _tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.target_task, *(op.task for op in self.draft_ops.values())) if t is not None]

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

    # ---- dispatch -------------------------------------------------------------------------------
    def _micro_batch_size(self, worker: str, num_requests: int) -> int:
        profile = self.phases.profile
        if self.micro_batches:
            b = self.micro_batches
        elif profile is not None and profile.verify_ms:
            b = choose_micro_batches(profile.verify_ms, num_requests)
        else:
            b = min(B0, num_requests)
        self.chosen_micro_batches[worker] = max(1, min(b, num_requests))
        return math.ceil(num_requests / self.chosen_micro_batches[worker])

    def _dispatch_drafts(self) -> None:
        """Each idle drafter worker drafts the next micro-batch of its queue (its SELECTED requests)."""
        ph = self.phases
        queues: dict[str, list[RequestState]] = {}
        assigned: dict[str, int] = {}  # per worker: its requests mid-cycle that draft there
        for st in ph.running:
            if st.cycle_arm is None or not ph.needs_draft(st, st.cycle_arm):
                continue
            w = ph.drafter_worker[st.cycle_arm.drafter]
            assigned[w] = assigned.get(w, 0) + 1
            if st.stage is Stage.SELECTED:
                queues.setdefault(w, []).append(st)
        for w, queue in queues.items():
            if w in self.draft_ops:
                continue  # busy: the next micro-batch goes when this one is drafted
            take = queue[:self._micro_batch_size(w, assigned[w])]
            items = [ph.propose_item(st, st.cycle_arm) for st in take]
            for st in take:
                st.stage = Stage.DRAFTING
            self.draft_ops[w] = _DraftOp(asyncio.create_task(ph.propose(w, items), name=f"draft-{w}"), take)

    def _dispatch_ahead(self) -> None:
        """Idle drafter workers draft ahead for the greedy requests under verification."""
        ph = self.phases
        if not self.draft_ahead or self._pass is None:
            return
        by_worker: dict[str, list[RequestState]] = {}
        for st in self._pass.batch:
            arm, d = st.cycle_arm, self._pass.drafts.get(st.req_id)
            if (st.status != "running" or arm is None or d is None or not d.tokens or st.ahead is not None
                    or not st.seq.params.is_greedy or not ph.needs_draft(st, arm)):
                continue
            w = ph.drafter_worker[arm.drafter]
            if w not in self.draft_ops:
                by_worker.setdefault(w, []).append(st)
        for w, reqs in by_worker.items():
            items = []
            for st in reqs:
                st.ahead = Ahead(list(self._pass.drafts[st.req_id].tokens))
                items.append(ph.propose_item(st, st.cycle_arm, st.ahead.assume))
            self.draft_ops[w] = _DraftOp(asyncio.create_task(ph.propose(w, items), name=f"ahead-{w}"), reqs,
                                         [st.ahead for st in reqs])

    def _dispatch_verify(self, chunks: Chunks) -> None:
        """One verify pass on the target: everything drafted (or needing no draft), this slot's prefill chunks,
        and the requests whose prefill they complete (their first token, without a draft)."""
        ph = self.phases
        completing = [st for st, n in chunks if n == st.num_prefill_left]
        batch = [st for st in ph.running if st.stage is Stage.DRAFTED
                 or st.stage is Stage.SELECTED and not ph.needs_draft(st, st.cycle_arm)]
        batch += [st for st in completing if st not in batch]
        if not batch and not chunks:
            return
        arms = {st.req_id: st.cycle_arm for st in batch if st.cycle_arm is not None}
        drafts = {st.req_id: st.draft for st in batch if st.draft is not None}
        for st in batch:
            st.stage, st.draft = Stage.VERIFYING, None
        ph.next_slot()
        self._pass = _VerifyPass(chunks, batch, arms, drafts)
        threads = ph.target_threads(self._arms())
        self.target_task = asyncio.create_task(ph.prefill_and_verify(chunks, batch, arms, drafts, threads),
                                               name="verify")

    # ---- completions ----------------------------------------------------------------------------
    def _complete(self, task: asyncio.Task) -> None:
        if task is self.target_task:
            self.target_task = None
            vp, self._pass = self._pass, None
            self._verified(vp, task)
            return
        w = next(name for name, op in self.draft_ops.items() if op.task is task)
        op = self.draft_ops.pop(w)
        try:
            drafts = task.result()
        except WorkerError as e:  # a request's data broke the drafter: fail it alone
            self.phases.fail_requests(e)
            drafts = {}
        if op.aheads is not None:
            self._drafted_ahead(op, drafts)
            return
        for st in op.requests:
            if st.status == "running" and st.stage is Stage.DRAFTING:
                st.draft, st.stage = drafts.get(st.req_id) or P.DraftRecord(st.req_id, []), Stage.DRAFTED

    def _verified(self, vp: _VerifyPass, task: asyncio.Task) -> None:
        ph = self.phases
        try:
            outcome: VerifyOutcome = task.result()
        except WorkerError as e:
            ph.fail_requests(e)  # transactional: the others are as they were, and are verified again
            for st in vp.batch:
                st.ahead = None
                st.draft = vp.drafts.get(st.req_id)
                st.stage = (Stage.DRAFTED if st.draft is not None else
                            Stage.SELECTED if st.cycle_arm is not None else Stage.READY)
            return
        live = outcome.live()  # taken before the update, which finishes some of them
        ph.update(live, vp.arms, vp.drafts)
        now = time.perf_counter()
        ph.record_slot(now - self._last_pass_end, self._overhead_s)
        self._last_pass_end, self._overhead_s = now, 0.0
        for st, r in zip(live.batch, live.results):
            arm, ahead = st.cycle_arm, st.ahead
            st.reset_cycle()
            if ahead is None or st.status != "running":
                continue
            if ahead.draft is None:  # its draft ahead is still in flight: decide when it lands
                ahead.committed = list(r.tokens)
                st.ahead, st.cycle_arm, st.stage = ahead, arm, Stage.AWAITING_AHEAD
            else:
                self._use_ahead(st, arm, ahead, r.tokens)

    def _drafted_ahead(self, op: _DraftOp, drafts: dict[str, P.DraftRecord]) -> None:
        for st, ahead in zip(op.requests, op.aheads):
            if st.ahead is not ahead or st.status != "running":
                continue  # dropped meanwhile (its verify failed, or it finished)
            ahead.draft = drafts.get(st.req_id) or P.DraftRecord(st.req_id, [])
            if st.stage is Stage.AWAITING_AHEAD:  # its verify already ended
                arm = st.cycle_arm
                st.reset_cycle()
                self._use_ahead(st, arm, ahead, ahead.committed)

    def _use_ahead(self, st: RequestState, arm: Arm, ahead: Ahead, committed: list[int]) -> None:
        """If the verify accepted the whole draft and the bonus token is the drafter's guess, the draft ahead
        is the next draft: the request keeps its arm and goes straight to the next verify pass."""
        guess = ahead.draft.tokens
        k = st.seq.max_draft(arm.k)
        if guess and committed == ahead.assume + guess[:1] and len(guess) > 1 and k > 0:
            st.cycle_arm, st.stage = arm, Stage.DRAFTED
            st.draft = P.DraftRecord(req_id=st.req_id, tokens=guess[1:1 + k], slot=ahead.draft.slot,
                                     draft_s=ahead.draft.draft_s)
            self.phases.metrics.ahead.labels(outcome="used").inc()
        else:
            self.phases.metrics.ahead.labels(outcome="dropped").inc()

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
        self.target_task, self.draft_ops, self._pass = None, {}, None
        for st in self.phases.running:  # its draft and draft ahead went with the drafters' state
            st.reset_cycle()
        await self.phases.recover()

    async def cancel(self) -> None:
        """Stop waiting for the workers (shutting down, or the slot failed and its requests were aborted)."""
        tasks = self._tasks()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.target_task, self.draft_ops, self._pass = None, {}, None
        for st in self.phases.running:
            st.reset_cycle()

    def describe(self) -> dict:
        stages = [st.stage for st in self.phases.running]
        return {"micro_batches": dict(self.chosen_micro_batches), "drafting": stages.count(Stage.DRAFTING),
                "drafted": stages.count(Stage.DRAFTED), "verifying": stages.count(Stage.VERIFYING),
                "ahead": sum(st.ahead is not None for st in self.phases.running)}
