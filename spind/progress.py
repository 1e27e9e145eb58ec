"""Start-up steps a user waits through, said as they begin: one `spind: ...` line on stderr naming the step and how
long it takes, so that no wait is silent (a cold first run converts the model, starts the workers and profiles them:
~15 s on a 2-core CPU). In `spind generate` the lines reach the terminal; in the daemon, its log (whose stderr it
is), and `spind start --detach` echoes them while it waits (frontend/daemon_cli.py reads lines with this prefix).

No torch, no logging configuration: the loader, the profile and the CLI all say their steps through here.
"""

from __future__ import annotations

import sys

PREFIX = "spind: "


def say(message: str) -> None:
    print(f"{PREFIX}{message}", file=sys.stderr, flush=True)


def about(seconds: float | None) -> str:
    """A step's expected time as the lines print it: "~6 s"; "" when unknown."""
    return "" if seconds is None else f"~{max(1, round(seconds))} s"
