"""The page's headline rates, each over a recent window of the daemon's own timestamps (no streamlit).

Why a window: the selector's `switches_per_minute` divides all switches by all the slot time it has seen, and the
KV-precompute figure is a total since start, so when the daemon goes idle neither moves and the page kept showing
the last busy value. Every rate here is "what happened between state.now - window_s and state.now" instead, so
with no traffic each one reaches 0 at most a window (and a one-second sample) after the last token:
    tokens per second        the snapshot's per-second throughput samples whose second overlaps the window
    busy share, KV precompute   the workers' busy spans clipped to the window
    switches per minute      the selector's cumulative switch count, sampled at every refresh with the snapshot's
                             `now` (the state has no per-switch timestamps), differenced over the window
The window is a page setting: SPIND_DASHBOARD_WINDOW_S (default 10 s), at most the 30 s the snapshot's
timelines reach back (`state.window_s`).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from spind.state import BusySpan, SpindState, ThroughputSample

WINDOW_ENV = "SPIND_DASHBOARD_WINDOW_S"
DEFAULT_WINDOW_S = 10.0
MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 30.0  # spind.coordinator.history.WINDOW_S: a snapshot's samples and spans reach no further back


def window_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The rate window in seconds: SPIND_DASHBOARD_WINDOW_S when it is a number, clamped to what a snapshot
    covers; DEFAULT_WINDOW_S otherwise."""
    try:
        value = float(environ.get(WINDOW_ENV, DEFAULT_WINDOW_S))
    except ValueError:
        return DEFAULT_WINDOW_S
    return DEFAULT_WINDOW_S if not math.isfinite(value) else min(MAX_WINDOW_S, max(MIN_WINDOW_S, value))


class CounterWindow:
    """A cumulative counter (the selector's switches) seen at each refresh, as (daemon time, count) samples, and
    its rate over the last window: like Prometheus' rate(), for a counter whose increments carry no time.

    A count or a time that goes backwards is another daemon (restarted, or the sidebar's address changed): the
    samples start over rather than yield a negative rate."""

    def __init__(self, keep_s: float = 2 * MAX_WINDOW_S) -> None:
        self.keep_s = keep_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, count: float) -> None:
        if self.samples and (t < self.samples[-1][0] or count < self.samples[-1][1]):
            self.samples.clear()
        if self.samples and t == self.samples[-1][0]:
            self.samples.pop()
        self.samples.append((t, count))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.keep_s:
            self.samples.popleft()  # keep one sample at or before the cut: the base of the longest window

    def per_minute(self, window_s: float) -> float | None:
        """Increments per minute between the newest sample and the newest one at least window_s older (the oldest
        one while the page has seen less than a window); None before two samples."""
        if len(self.samples) < 2:
            return None
        now, count = self.samples[-1]
        base_t, base_count = self.samples[0]
        for t, c in self.samples:
            if t > now - window_s:
                break
            base_t, base_count = t, c
        return 60.0 * (count - base_count) / (now - base_t) if now > base_t else None


def recent_seconds(state: SpindState, window_s: float) -> list[ThroughputSample]:
    """The snapshot's whole-second samples that overlap the last window_s (the open second is not in the state)."""
    since = state.now - window_s
    return [s for s in state.throughput if s.t + 1.0 > since]


def clipped_s(spans: list[BusySpan], since: float, until: float) -> float:
    """Seconds of the spans inside [since, until], each counted on its own (overlaps add up)."""
    return sum(max(0.0, min(s.end, until) - max(s.start, since)) for s in spans)


def covered_s(spans: list[BusySpan], since: float, until: float) -> float:
    """Seconds of [since, until] that any span covers (a drafter beside the target's verify counts once)."""
    covered, busy = since, 0.0
    for s in sorted(spans, key=lambda s: s.start):
        start, end = max(s.start, covered), min(s.end, until)
        if end > start:
            busy += end - start
            covered = end
    return busy


@dataclass(frozen=True)
class Rates:
    """What happened over the last `window_s` seconds of the daemon (see the module's docstring)."""

    window_s: float
    num_seconds: int  # throughput samples the token rates average
    committed_tok_s: float
    prefill_tok_s: float
    acceptance: float | None  # accepted / drafted tokens; None: nothing drafted in the window
    accepted_length: float | None  # tokens committed per verification step; None: no step in the window
    busy: dict[str, float] = field(default_factory=dict)  # worker -> busy share of the window
    precompute_ms_per_s: float = 0.0  # worker ms spent precomputing drafters' KV, per second of the window
    switches_per_min: float | None = None  # None: the selector counts none, or the page has one look so far
    num_active: int = 0  # requests running or waiting now

    @property
    def idle(self) -> bool:
        """Nothing committed, prefilled or busy in the window and no request in the daemon."""
        return (self.num_active == 0 and self.committed_tok_s == 0 and self.prefill_tok_s == 0
                and not any(self.busy.values()) and self.precompute_ms_per_s == 0)


def window_rates(state: SpindState, window_s: float, switches: CounterWindow | None = None) -> Rates:
    """The rates of `state` over its last window_s seconds; `switches` (fed here with this snapshot's count)
    gives switches per minute."""
    window_s = min(window_s, state.window_s)
    seconds = recent_seconds(state, window_s)
    counts = [c for s in seconds for c in s.drafters.values()]
    drafted, accepted = sum(c.num_drafted for c in counts), sum(c.num_accepted for c in counts)
    steps = sum(c.num_steps for c in counts)
    n = max(1, len(seconds))
    since = state.now - window_s
    busy = {w.name: round(covered_s(w.busy, since, state.now) / window_s, 4) for w in state.workers}
    precompute = sum(clipped_s([s for s in w.busy if s.kind == "precompute"], since, state.now) for w in state.workers)
    per_min = None
    sel = state.selection
    if switches is not None and sel is not None and sel.num_switches is not None:
        switches.add(state.now, sel.num_switches)
        per_min = switches.per_minute(window_s)
    return Rates(window_s=window_s, num_seconds=len(seconds),
                 committed_tok_s=sum(c.num_committed for c in counts) / n,
                 prefill_tok_s=sum(s.num_prompt_tokens for s in seconds) / n,
                 acceptance=accepted / drafted if drafted else None,
                 accepted_length=(accepted + steps) / steps if steps else None,
                 busy=busy, precompute_ms_per_s=1e3 * precompute / window_s, switches_per_min=per_min,
                 num_active=state.num_running + state.num_waiting)


def rate_text(value: float | None, unit: str, digits: int = 1) -> str:
    """'12.5 tok/s'; '-' for a rate that cannot be known (never 'nan' or a long tail of zeros)."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f} {unit}"
