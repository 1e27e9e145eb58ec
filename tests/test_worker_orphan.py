"""A worker process whose coordinator dies exits on its own, also when the coordinator died before the worker
served (while it loaded its model, or before it even read its arguments): it watches the coordinator's PID it was
given (`--parent-pid`), not whichever parent it has when it looks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from spind.config import load_config

pytestmark = pytest.mark.e2e


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (an exited one may linger as a zombie of its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("coordinator_s", [0, 3])  # dies at once (before the worker reads its arguments), or later
def test_a_worker_whose_coordinator_died_before_it_served_exits(tmp_path, coordinator_s: float) -> None:
    (tmp_path / "cfg.json").write_text(json.dumps(asdict(load_config())))
    # a shell starts the target worker in the background, as its coordinator, and exits after coordinator_s: the
    # worker loses its parent before it serves (at 3 s: while it loads, or earlier on a slow machine), and nothing
    # ever binds its endpoint
    script = (f"{sys.executable} -m spind.worker.main --name target --config {tmp_path}/cfg.json "
              f"--endpoint ipc://{tmp_path}/w.sock --probs-endpoint ipc://{tmp_path}/p.sock --threads 1 "
              f"--parent-pid $$ > {tmp_path}/log 2>&1 < /dev/null & echo $!; sleep {coordinator_s}")
    pid = int(subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout)
    try:
        deadline = time.monotonic() + 120
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = (tmp_path / "log").read_text()
        assert not running(pid), f"the orphaned worker is still running: {log[-2000:]}"
        assert "Traceback" not in log and "error" not in log.lower(), log[-2000:]  # it left, it did not fail
    finally:
        if running(pid):
            os.kill(pid, 9)
