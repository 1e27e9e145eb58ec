"""Bench output: fixed-width tables on stdout, results as JSON, progress lines on stderr."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A title line, then columns padded to their widest cell (first column left-aligned, the rest right)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first, rest = cells[0].ljust(widths[0]), (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([title, line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """`[ 12/150] what  (1m05s, eta 7m30s)` on stderr, one line per finished unit of work."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        width = len(str(self.total))
        print(f"[{self.done:>{width}}/{self.total}] {what}  ({_duration(elapsed)}, eta {_duration(eta)})",
              file=self.stream, flush=True)

    def note(self, what: str) -> None:
        print(what, file=self.stream, flush=True)


def timed(fn) -> float:
    """Run fn() and return its wall time in ms."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
