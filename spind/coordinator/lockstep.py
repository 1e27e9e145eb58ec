"""The coordinator's loop body while [runtime].pipeline is off: one synchronous time slot per tick, every request
through the whole cycle within it (paper §IV).

    schedule -> select -> (prefill || speculate) -> verify -> update

The target's prefill is sent first and runs while the drafter workers draft; the verify waits for both.

Each slot runs in a regime (`SlotPhases.regime_of`, `selection/regime.py`): as selection chooses, or with the
requests left to selection decoding plainly and unselected; the trial weighs the two by what their slots made in
their wall time, per batch size, so that speculation runs where it makes serving faster, as measured, and not only
where its predictions say so.
"""

from __future__ import annotations

import logging
import time

from spind.coordinator.phases import SlotPhases
from spind.coordinator.selection.regime import PLAIN
from spind.coordinator.transport.pool import WorkerDied, WorkerError

log = logging.getLogger(__name__)


class Lockstep:
    def __init__(self, phases: SlotPhases) -> None:
        self.phases = phases

    @property
    def is_busy(self) -> bool:
        return False  # nothing is in flight between ticks

    async def tick(self) -> None:
        """One time slot for everything waiting and running. With worker processes the slot's tokens stream, and the
        selector learns from them, once the next slot's verify is on its way (`SlotPhases.hold_deltas`): the target
        computes while the front ends write, instead of idling between slots (~0.3-1 ms a slot on a 2-core CPU).
        With nothing left to run they go at once. In-process workers share the coordinator's GIL, and overlapping
        its Python with theirs cost more than it hid (alpaca at batch 1: `spin` 0.91x `none` against 0.97x)."""
        ph = self.phases
        try:
            await self._slot()
        finally:
            if not ph.running and not ph.waiting:
                ph.flush_deltas()

    async def _slot(self) -> None:
        ph = self.phases
        start, ph.wait_s = time.perf_counter(), 0.0
        if not ph.workers_alive():
            ph.flush_deltas()
            await ph.recover()  # a worker died between slots
            return
        chunks = ph.schedule()
        ready = [st for st in ph.running if st.is_prefilled]
        completing = [st for st, n in chunks if n == st.num_prefill_left]  # their first token, without a draft
        regime = ph.regime_of(ready + completing)
        selection = ph.select(ready, plain=regime == PLAIN)
        ph.send_side_work(selection)
        arms = selection.arms
        ph.next_slot()
        threads = ph.target_threads(arms)
        tokens = ph.committed_tokens
        try:
            t0 = time.perf_counter()
            drafts = await ph.prefill_and_speculate(chunks, ready, arms, threads)
            prefill_s = time.perf_counter() - t0 if chunks else 0.0
            outcome = await ph.verify_isolating(ready + completing, arms, drafts, threads)
        except WorkerDied as e:
            ph.flush_deltas()
            log.warning("%s; restarting and re-prefilling", e)
            await ph.recover()
            return
        except WorkerError as e:
            ph.flush_deltas()
            ph.fail_requests(e)
            return
        ph.flush_deltas()  # what a slot without a verify (prefill only) did not release
        if not ph.pool.shares_interpreter:
            ph.hold_deltas()
        ph.update(outcome, arms, drafts)
        slot_s = time.perf_counter() - start
        ph.record_slot(slot_s, slot_s - ph.wait_s)
        # the regime trial weighs the slot's seconds less its prefill's (the same whatever the regime), unless drafter
        # workers drafted meanwhile (the regime's own time then: the slot is not counted)
        measured = slot_s - prefill_s if not (chunks and drafts) and outcome.num_forwards == 1 else 0.0
        ph.record_regime(regime, len(outcome.batch), ph.committed_tokens - tokens, measured)

    async def cancel(self) -> None:
        """Nothing to stop between ticks."""

    def describe(self) -> dict | None:
        return None
