"""Rate-limited logging: a flood of one message (a client hammering a bad request, a connection storm)
must not fill the disk. Records are keyed by logger and message template; each key passes `burst`
records per `window_s`, the rest are counted and summed up in the first record of the next window."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitFilter(logging.Filter):
    def __init__(self, burst: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        super().__init__()
        self.burst, self.window_s, self.clock, self.max_keys = burst, window_s, clock, max_keys
        self._windows: dict[tuple, list] = {}  # key -> [window start, passed, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if len(self._windows) >= self.max_keys:
                self._windows.clear()  # bounded memory; at worst a burst passes again
            suppressed = w[2] if w is not None else 0
            self._windows[key] = w = [now, 0, 0]
            if suppressed:
                record.msg = f"{record.msg} [{suppressed} similar message(s) suppressed in the last " \
                             f"{self.window_s:.0f} s]"
        if w[1] < self.burst:
            w[1] += 1
            return True
        w[2] += 1
        return False


def install_rate_limit(burst: int = 10, window_s: float = 60.0) -> None:
    """On every handler of the root logger (call after logging.basicConfig)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RateLimitFilter(burst, window_s))
