"""When to restart a dead worker: a rate limit over a sliding window, not a count over the daemon's life
(a worker that crashed five times last week must not make today's sixth crash fatal; one that crashes in
a loop must not be restarted forever). Pure: the caller passes the clock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # per worker, within window_s
    window_s: float = 300.0
    _history: dict[str, deque] = field(default_factory=dict)

    def allow(self, worker: str, now: float) -> bool:
        """Record a restart of `worker` at `now` if the window has room for it; False: give up."""
        times = self._history.setdefault(worker, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def recent(self, worker: str, now: float) -> int:
        return sum(1 for t in self._history.get(worker, ()) if now - t <= self.window_s)
