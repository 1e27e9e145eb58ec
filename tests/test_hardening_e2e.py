"""Issue 13 through the real daemon: nothing secret on disk, nothing left in the run dir after a stop, and
what a SIGKILL leaves is cleared by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from daemon_util import start_daemon
from spind.frontend.server import PidInfo

pytestmark = pytest.mark.e2e

KEY = "e2e-secret-key"
CONFIG = 'api_key = ""'


def _config() -> str:
    from spind.config import DEFAULT_CONFIG_PATH

    text = DEFAULT_CONFIG_PATH.read_text()
    assert CONFIG in text
    return text.replace(CONFIG, f'api_key = "{KEY}"').replace("{", "{{").replace("}", "}}")


def _leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".sock") or p.name.startswith("config-"))


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_no_key_on_disk_and_a_clean_run_dir_after_sigkill_and_after_stop():
    run_dir = Path(tempfile.mkdtemp(prefix="spind-rd-")) / "run"
    with start_daemon(_config(), "--run-dir", str(run_dir)) as d:
        with urllib.request.urlopen(d.url + "/health") as resp:
            assert resp.headers["Server"] == "spind"
        for p in run_dir.iterdir():
            assert not p.is_file() or KEY.encode() not in p.read_bytes(), p
        workers = [int(line) for line in subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        assert workers and _leftovers(run_dir)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        assert all(_gone(pid) for pid in workers), "workers outlived their daemon"
        stale = _leftovers(run_dir)
        assert stale and not PidInfo.read(run_dir).is_alive  # what a SIGKILL cannot clean up
    with start_daemon(_config(), "--run-dir", str(run_dir)) as d:  # the next start clears it
        assert not set(stale) & set(_leftovers(run_dir))
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(120) == 0
        assert _leftovers(run_dir) == [] and not (run_dir / "spind.pid").exists()
