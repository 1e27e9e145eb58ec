"""What the dashboard plots over time, kept by the coordinator in bounded rings: each worker's busy intervals,
one throughput sample per second, and recent TTFT and latency values for percentiles.

Recording is O(1) and allocation-light (the coordinator records per request per slot); the work of windowing,
gap-filling and percentiles happens when a snapshot is asked for.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from spind import protocol as P
from spind.state import PERCENTILES, BusySpan, DraftCounts, LatencyState, ThroughputSample

WINDOW_S = 30.0  # how far back a snapshot's timelines reach
MAX_BUSY = 4096  # busy intervals kept per worker: > WINDOW_S of 10 ms slots with a few ops each
MAX_SECONDS = 120  # throughput samples kept
MAX_LATENCIES = 512  # finished requests kept for percentiles


class History:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.busy: dict[str, deque[P.BusyInterval]] = {}
        self.busy_s: dict[str, dict[str, float]] = {}  # worker -> kind -> seconds since start
        self.seconds: deque[ThroughputSample] = deque(maxlen=MAX_SECONDS)  # closed seconds, oldest first
        self._current = ThroughputSample(t=float(int(clock())))
        self._next_t = self._current.t + 1.0
        self.ttft_s: deque[float] = deque(maxlen=MAX_LATENCIES)
        self.latency_s: deque[float] = deque(maxlen=MAX_LATENCIES)

    # ---- recording (per slot) ---------------------------------------------------------------------------------
    def add_busy(self, worker: str, b: P.BusyInterval) -> None:
        ring = self.busy.get(worker)
        if ring is None:
            ring = self.busy[worker] = deque(maxlen=MAX_BUSY)
            self.busy_s[worker] = {}
        ring.append(b)
        totals = self.busy_s[worker]
        totals[b.kind] = totals.get(b.kind, 0.0) + max(0.0, b.end - b.start)

    def add_step(self, drafter: str, num_committed: int, num_drafted: int, num_accepted: int) -> None:
        """One request's verification step with `drafter` ("none": plain decoding)."""
        by_drafter = self._second().drafters
        counts = by_drafter.get(drafter)
        if counts is None:
            counts = by_drafter[drafter] = DraftCounts()
        counts.num_committed += num_committed
        counts.num_drafted += num_drafted
        counts.num_accepted += num_accepted
        counts.num_steps += 1

    def add_prompt_tokens(self, n: int) -> None:
        self._second().num_prompt_tokens += n

    def add_queue(self, num_running: int, num_waiting: int) -> None:
        """The queues after a slot; a second keeps its last slot's."""
        s = self._second()
        s.num_running, s.num_waiting = num_running, num_waiting

    def add_ttft(self, seconds: float) -> None:
        self.ttft_s.append(seconds)

    def add_latency(self, seconds: float) -> None:
        self.latency_s.append(seconds)

    def _second(self) -> ThroughputSample:
        now = self.clock()
        if now >= self._next_t:  # a new second: it starts from the queues the last one ended with
            last = self._current
            self.seconds.append(last)
            self._current = ThroughputSample(t=float(int(now)), num_running=last.num_running,
                                             num_waiting=last.num_waiting)
            self._next_t = self._current.t + 1.0
        return self._current

    # ---- reading (per snapshot) -------------------------------------------------------------------------------
    def busy_spans(self, worker: str, now: float) -> list[BusySpan]:
        """The worker's intervals that end within the last WINDOW_S, oldest first."""
        since = now - WINDOW_S
        out = []
        for b in reversed(self.busy.get(worker, ())):
            if b.end < since:
                break
            out.append(BusySpan(kind=b.kind, drafter=b.drafter, start=round(b.start, 4), end=round(b.end, 4),
                                num_reqs=b.num_reqs))
        out.reverse()
        return out

    @staticmethod
    def utilisation(spans: list[BusySpan], now: float) -> float:
        """Busy share of the last WINDOW_S (overlapping intervals, e.g. a drafter beside the target, count once)."""
        covered, busy = now - WINDOW_S, 0.0  # time before `covered` is counted already
        for s in sorted(spans, key=lambda s: s.start):
            start, end = max(s.start, covered), min(s.end, now)
            if end > start:
                busy += end - start
                covered = end
        return round(busy / WINDOW_S, 4)

    def throughput(self, now: float) -> list[ThroughputSample]:
        """One sample per whole second of the last WINDOW_S. A second without slots committed nothing and kept
        the queues of the second before."""
        self._second()  # close the current second if it is over
        first, last = int(now - WINDOW_S), int(now)  # the current second (last) is still open
        by_t = {s.t: s for s in self.seconds}
        prev = next((s for s in reversed(self.seconds) if s.t < first), ThroughputSample(t=first - 1.0))
        out = []
        for t in map(float, range(first, last)):
            prev = by_t.get(t) or ThroughputSample(t=t, num_running=prev.num_running, num_waiting=prev.num_waiting)
            out.append(prev)
        return out

    def latency(self) -> LatencyState:
        def pct(values: deque[float]) -> dict[str, float]:
            if not values:
                return {}
            qs = np.percentile(np.fromiter(values, float), PERCENTILES)
            return {f"p{p}": round(float(q) * 1e3, 1) for p, q in zip(PERCENTILES, qs)}

        return LatencyState(num_requests=len(self.latency_s), ttft_ms=pct(self.ttft_s), latency_ms=pct(self.latency_s))
