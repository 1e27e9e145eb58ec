"""What the dashboard plots over time, kept by the coordinator in bounded rings: each worker's busy time per
0.2 s, one throughput sample per second, and recent TTFT and latency values for percentiles.

Recording is O(1) and allocation-light (the coordinator records per request per slot); the work of windowing,
gap-filling and percentiles happens when a snapshot is asked for.

Busy time is kept per RESOLUTION_S bin, not per interval: a worker under load records a few hundred intervals a
second (a verify and an n-gram draft per slot), so a ring of intervals either truncated the window (4096 of them
held ~20 s of the 30 s at 4 clients) or grew with the load, and the page drew thousands of sub-pixel bars every
second (the browser test on CI twice found none of them drawn after 90 s of redraws). A bin holds each activity's
seconds in it; the snapshot lays them side by side from the bin's start, so the timeline reads like the intervals at the
grain the page can show (0.2 s of 30 s is ~10 px), every share over a window of whole bins is exact, and a
snapshot carries at most a few spans per bin.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from spind import protocol as P
from spind.state import PERCENTILES, BusySpan, DraftCounts, LatencyState, ThroughputSample

WINDOW_S = 30.0  # how far back a snapshot's timelines reach
RESOLUTION_S = 0.2  # the busy timeline's grain
NUM_BINS = int(WINDOW_S / RESOLUTION_S) + 2  # busy bins kept per worker: the window and the bins at its two ends
MAX_SECONDS = 120  # throughput samples kept
MAX_LATENCIES = 512  # finished requests kept for percentiles


class History:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.busy: dict[str, deque[_Bin]] = {}  # worker -> its busy bins, oldest first (idle ones absent)
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
            ring = self.busy[worker] = deque(maxlen=NUM_BINS)
            self.busy_s[worker] = {}
        totals = self.busy_s[worker]
        totals[b.kind] = totals.get(b.kind, 0.0) + max(0.0, b.end - b.start)
        first, last = _index(b.start), _index(b.end)
        for index in range(max(first, last - NUM_BINS + 1), last + 1):
            seconds = min(b.end, (index + 1) * RESOLUTION_S) - max(b.start, index * RESOLUTION_S)
            if seconds > 0:
                bin_ = _bin(ring, index)
                if bin_ is not None:
                    bin_.add(b.kind, b.drafter, seconds, b.num_reqs)

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
        """The worker's busy time in the last WINDOW_S, oldest first: per bin, each activity's seconds as one span
        from where the one before it in the bin ended (time that overlapped in a bin shares it)."""
        since = _index(now - WINDOW_S)
        out = []
        for bin_ in self.busy.get(worker, ()):
            if bin_.index >= since:
                bin_.lay_out(out)
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


def _index(t: float) -> int:
    """The bin that time `t` falls in (a time on a bin's edge, to float rounding, starts the later one)."""
    return math.floor(t / RESOLUTION_S + 1e-9)


class _Bin:
    """One worker's busy time in [index, index + 1) * RESOLUTION_S: (kind, drafter) -> [seconds, most requests of
    one interval], in the order the activities first ran in it."""

    __slots__ = ("index", "by_activity")

    def __init__(self, index: int) -> None:
        self.index = index
        self.by_activity: dict[tuple[str, str], list] = {}

    def add(self, kind: str, drafter: str, seconds: float, num_reqs: int) -> None:
        acc = self.by_activity.get((kind, drafter))
        if acc is None:
            self.by_activity[(kind, drafter)] = [seconds, num_reqs]
        else:
            acc[0] += seconds
            acc[1] = max(acc[1], num_reqs)

    def lay_out(self, out: list[BusySpan]) -> None:
        start = self.index * RESOLUTION_S
        scale = min(1.0, RESOLUTION_S / max(1e-12, sum(s for s, _ in self.by_activity.values())))
        for (kind, drafter), (seconds, num_reqs) in self.by_activity.items():
            end = start + seconds * scale
            out.append(BusySpan(kind=kind, drafter=drafter, start=round(start, 4), end=round(end, 4),
                                num_reqs=num_reqs))
            start = end


def _bin(ring: deque[_Bin], index: int) -> _Bin | None:
    """The ring's bin `index`, added where it is new (a full ring drops its oldest); None where it is older than
    every bin a full ring holds."""
    if not ring or ring[-1].index < index:
        ring.append(_Bin(index))
        return ring[-1]
    after = -1  # the position of the last bin before `index`; an interval reported late is a few bins back at most
    for i in range(len(ring) - 1, -1, -1):
        if ring[i].index == index:
            return ring[i]
        if ring[i].index < index:
            after = i
            break
    if len(ring) == ring.maxlen:
        if after < 0:
            return None
        ring.popleft()
        after -= 1
    ring.insert(after + 1, _Bin(index))
    return ring[after + 1]
