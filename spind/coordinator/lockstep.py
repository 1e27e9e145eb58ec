"""The coordinator's loop body while [runtime].pipeline is off: one synchronous time slot per tick, every request
through the whole cycle within it (paper §IV).

    schedule -> select -> (prefill || speculate) -> verify -> update

The target's prefill is sent first and runs while the drafter workers draft; the verify waits for both.

Each slot runs in a regime (`SlotPhases.regime_of`, `selection/regime.py`): as selection chooses, or with the
requests left to selection decoding plainly and unselected; the trial weighs the two by what their slots made in
their wall time, per batch size, so that speculation runs where it makes serving faster, as measured, and not only
where its predictions say so.

Follow-on slots (beyond the paper; SGLang's overlap scheduler and vLLM's async scheduling hide a GPU step's CPU
scheduling the same way). Where the next slot would verify exactly this slot's requests, with no prompt to prefill,
none waiting and nothing for a drafter worker to draft (plain decoding, drafters inline on the target), it is
selected and its verify sent while this slot's verify runs: the target's worker takes ops in order and starts it
the moment this one ends. On a 2-core CPU the round trip between two slots (the reply's way to the coordinator,
commit, selection, the next op's way back: each a wake-up of an idle core) was ~1.4 ms of a 12-15 ms slot at batch
1 (`spind bench e2e`, worker processes). The follow-on is decided on the state before this slot commits, so:
- its drafts are capped so that, whatever this slot commits, it never drafts past max_tokens or the context
  (`_caps`); a request that ends by length in this slot gets no follow-on;
- a request that ends otherwise here (EOS, a stop string, an abort) has its follow-on's tokens dropped;
- the worker runs it only if the verify it answered last succeeded (`Verify.follows`), else refuses it with
  nothing changed; it is sent at once, right after this slot's verify and ahead of any retry of it, so that verify
  is the one; a refused or failed follow-on is verified again as a plain slot's verify would be (`_await_follow`);
- selection chooses for it with what the slot before this one taught it (the deltas and feedback it held are
  released first, once this slot's verify is on its way), as it would without follow-ons; choosing on one slot
  less (before that release) put `spin` back on n-gram lookup for 24-96% of its slots on mtbench (`bench e2e`,
  batch 1), where it otherwise runs suffix decoding on ~95%; a selection that wants a drafter worker's draft is
  kept for the next slot, which then runs as a whole (no follow-on).
Only with worker processes (threads share the coordinator's GIL, as above) and `[runtime] follow_on` (default on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from spind import protocol as P
from spind.coordinator.phases import Chunks, Selection, SlotPhases, VerifyOutcome
from spind.coordinator.request import RequestState
from spind.coordinator.selection.protocol import Arm
from spind.coordinator.selection.regime import PLAIN
from spind.coordinator.transport.pool import WorkerDied, WorkerError

log = logging.getLogger(__name__)


BIG = 1 << 30


@dataclass
class _Pass:
    """A slot's verify as decided, and its task; a follow-on's is sent while the slot before it runs."""

    batch: list[RequestState]
    arms: dict[str, Arm]
    items: dict[str, P.VerifyItem]
    shadow: dict[str, list[str]]
    regime: str | None
    threads: int
    task: asyncio.Task
    chunks: Chunks = field(default_factory=list)
    drafts: dict[str, P.DraftRecord] = field(default_factory=dict)
    prefill_s: float = 0.0


@dataclass
class _Preselected:
    """A selection made while the slot before ran that wants a drafter worker's draft: the next slot's own."""

    req_ids: frozenset[str]
    selection: Selection
    regime: str | None


class Lockstep:
    def __init__(self, phases: SlotPhases) -> None:
        self.phases = phases
        self.follow_on = phases.cfg.runtime.follow_on
        self._follow: _Pass | None = None
        self._preselected: _Preselected | None = None
        self._following = False  # a slot awaits its follow-on (sent by the slot before)
        self.num_follow_ons = 0

    @property
    def is_busy(self) -> bool:
        return self._follow is not None or self._following  # only a follow-on is in flight between ticks

    async def tick(self) -> None:
        """One time slot for everything waiting and running. With worker processes the slot's tokens stream, and the
        selector learns from them, once the next slot's verify is on its way (`SlotPhases.hold_deltas`): the target
        computes while the front ends write, instead of idling between slots (~0.3-1 ms a slot on a 2-core CPU).
        With nothing left to run they go at once. In-process workers share the coordinator's GIL, and overlapping
        its Python with theirs cost more than it hid (alpaca at batch 1: `spin` 0.91x `none` against 0.97x)."""
        ph = self.phases
        self._following = self._follow is not None
        try:
            await self._slot()
        finally:
            self._following = False
            if not ph.running and not ph.waiting:
                ph.flush_deltas()

    async def _slot(self) -> None:
        ph = self.phases
        start, ph.wait_s = time.perf_counter(), 0.0
        follow, self._follow = self._follow, None
        if not ph.workers_alive():
            await self._drop(follow)
            ph.flush_deltas()
            await ph.recover()  # a worker died between slots
            return
        tokens = ph.committed_tokens
        try:
            p = follow if follow is not None else await self._start()
            pending = p.task if follow is None else asyncio.ensure_future(self._await_follow(follow))
            if not p.chunks and not ph.pool.shares_interpreter:
                await asyncio.sleep(0)  # this slot's verify goes first (its task's first step sends it)
                ph.flush_deltas()  # the last slot streams, and selection learns from it before it selects the next
                self._follow = self._next(p.batch, p.items)  # sent after this slot's verify: the worker runs it next
            outcome = await pending
        except WorkerDied as e:
            await self._drop(self._follow)
            self._follow = None
            ph.flush_deltas()
            log.warning("%s; restarting and re-prefilling", e)
            await ph.recover()
            return
        except WorkerError as e:
            await self._drop(self._follow)  # refused by the worker (this slot's verify failed): nothing changed
            self._follow = None
            ph.flush_deltas()
            ph.fail_requests(e)
            return
        ph.flush_deltas()  # what a slot without a verify (prefill only) did not release
        if not ph.pool.shares_interpreter:
            ph.hold_deltas()
        ph.update(outcome.live(), p.arms, p.drafts, p.shadow)
        slot_s = time.perf_counter() - start
        ph.record_slot(slot_s, slot_s - ph.wait_s)
        # the regime trial weighs the slot's seconds less its prefill's (the same whatever the regime: a prefill op's,
        # or the chunks' share of the verify's forward they rode in), unless drafter workers drafted meanwhile (the
        # regime's own time then: the slot is not counted)
        measured = (slot_s - p.prefill_s - outcome.prefill_s if not (p.chunks and p.drafts)
                    and outcome.num_forwards == 1 else 0.0)
        ph.record_regime(p.regime, len(outcome.batch), ph.committed_tokens - tokens, measured)

    async def _start(self) -> _Pass:
        """A slot run as a whole: schedule, select (or take the selection made while the last slot ran), prefill
        and draft, then its verify sent (its task)."""
        ph = self.phases
        chunks = ph.schedule()
        ready = [st for st in ph.running if st.is_prefilled]
        completing = [st for st, n in chunks if n == st.num_prefill_left]  # their first token, without a draft
        batch = ready + completing
        pre, self._preselected = self._preselected, None
        if pre is not None and pre.req_ids == frozenset(st.req_id for st in ready):
            selection, regime = pre.selection, pre.regime
        else:
            regime = ph.regime_of(batch)
            selection = ph.select(ready, plain=regime == PLAIN)
        ph.send_side_work(selection)
        arms = selection.arms
        slot = ph.next_slot()
        threads = ph.target_threads(arms)
        # the chunks ride in the verify's forward, unless a drafter worker drafts meanwhile (a prefill op overlaps it)
        fuse = ph.fuses(chunks, batch) and not ph.drafts_elsewhere(ready, arms)
        t0 = time.perf_counter()
        drafts = await ph.prefill_and_speculate([] if fuse else chunks, ready, arms, threads)
        prefill_s = time.perf_counter() - t0 if chunks and not fuse else 0.0
        items = ph.verify_items(batch, arms, drafts)
        verify = (ph.prefill_and_verify(chunks, batch, arms, drafts, threads, items, slot) if fuse else
                  ph.verify_isolating(batch, arms, drafts, threads, items, slot))
        task = asyncio.ensure_future(verify)
        return _Pass(batch, arms, items, self._take_shadow(batch), regime, threads, task, chunks, drafts, prefill_s)

    @staticmethod
    def _take_shadow(batch: list[RequestState]) -> dict[str, list[str]]:
        """The shadow drafts selection asked of this slot's verify, per request (a follow-on's selection sets the
        next slot's on the requests before this slot commits)."""
        shadow = {}
        for st in batch:
            shadow[st.req_id], st.shadow = st.shadow, []
        return shadow

    def _next(self, batch: list[RequestState], items: dict[str, P.VerifyItem]) -> _Pass | None:
        """Select the next slot and send its verify now, if it would verify just `batch` with nothing to prefill,
        nobody waiting and no draft from a drafter worker (None: the next slot runs as a whole)."""
        ph = self.phases
        if not self.follow_on or not batch or ph.waiting or len(ph.running) != len(batch):
            return None
        if any(st.status != "running" or st.seq.params.grammar is not None or st.is_abort_requested
               for st in batch):
            return None
        caps = self._caps(batch, items)
        if caps is None:
            return None
        regime = ph.regime_of(batch)
        selection = ph.select(batch, plain=regime == PLAIN, ahead=True)
        arms = selection.arms
        if any(ph.needs_draft(st, arms.get(st.req_id)) for st in batch if st.req_id in arms):
            self._preselected = _Preselected(frozenset(st.req_id for st in batch), selection, regime)
            return None
        ph.send_side_work(selection)
        follow_items = ph.verify_items(batch, arms, {}, caps)
        threads = ph.target_threads(arms)
        # sent now, not by a task's first step: a retry of this slot's verify (which needs its failed reply read
        # first, in a later turn of the event loop) can then never reach the worker ahead of it
        task = asyncio.ensure_future(ph.send_follow_on(batch, follow_items, threads, ph.next_slot()))
        self.num_follow_ons += 1
        return _Pass(batch, arms, follow_items, self._take_shadow(batch), regime, threads, task)

    @staticmethod
    def _caps(batch: list[RequestState], items: dict[str, P.VerifyItem]) -> dict[str, int] | None:
        """Per request, the most tokens its follow-on may draft: what it could still take (`max_draft`) after this
        slot committed the most it can (its whole draft and the bonus token); None if one of them would have no
        room left even for the follow-on's own token."""
        caps = {}
        for st in batch:
            it = items[st.req_id]
            room = st.seq.max_draft(BIG) - (max(it.k, len(it.draft)) + it.max_draft + 1)
            if room < 0:
                return None
            caps[st.req_id] = room
        return caps

    async def _await_follow(self, follow: _Pass) -> VerifyOutcome:
        """A follow-on's outcome. Refused (the verify before it failed and was retried) or failed without naming
        its culprits, the worker changed nothing: its requests still running are verified again, as any slot's."""
        ph = self.phases
        try:
            return await ph.await_workers(follow.task)
        except WorkerError as e:
            if e.req_ids:
                raise
        batch = [st for st in follow.batch if st.status == "running"]
        return await ph.verify_isolating(batch, follow.arms, {}, follow.threads, follow.items, ph.next_slot())

    @staticmethod
    async def _drop(follow: _Pass | None) -> None:
        """Let a follow-on that will not be used end (refused, or its worker gone); its outcome is not committed."""
        if follow is not None:
            await asyncio.gather(follow.task, return_exceptions=True)

    async def cancel(self) -> None:
        """Stop waiting for a follow-on in flight (shutting down, or the slot failed and its requests were aborted)."""
        follow, self._follow, self._preselected = self._follow, None, None
        if follow is not None:
            follow.task.cancel()
            await asyncio.gather(follow.task, return_exceptions=True)

    def describe(self) -> dict | None:
        return None
