"""A real `spind start` daemon for end-to-end tests: free ports, a private run dir, its log, and a clean stop."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spind.client import http_json

START_TIMEOUT_S = 900


def child_pids(pid: int) -> list[int]:
    """The processes `pid`'s main thread started and has not reaped (Linux's /proc/PID/task/PID/children)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(kw_only=True)
class Daemon:
    proc: subprocess.Popen
    config: Path | None
    run_dir: Path
    log: Path
    port: int
    zmq_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def state(self) -> dict:
        status, body = http_json(self.url + "/v1/spind/state")
        assert status == 200, body
        return body

    def worker_pids(self) -> dict[str, int]:
        return {w["name"]: w["pid"] for w in self.state()["workers"]}

    def wait_no_requests(self, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state()
            if not state["requests"]:
                return state
            time.sleep(0.1)
        raise AssertionError(f"requests still held: {state['requests']}")


@contextlib.contextmanager
def start_daemon(config_template: str | None = None, *extra: str) -> Iterator[Daemon]:
    """`spind start` in the foreground of a subprocess; config_template (TOML with {port}, {zmq_port} and
    {run_dir}) or None for the embedded default config."""
    root = Path(tempfile.mkdtemp(prefix="spind-e2e-"))  # short: worker ipc socket paths must fit ~100 bytes
    port, zmq_port = free_port(), free_port()
    argv = [sys.executable, "-m", "spind.cli", "-v", "start", "--port", str(port), "--zmq-port", str(zmq_port),
            "--run-dir", str(root / "run"), *extra]
    config = None
    if config_template is not None:
        config = root / "config.toml"
        config.write_text(config_template.format(port=port, zmq_port=zmq_port, run_dir=root / "run"))
        argv += ["--config", str(config)]
    log = root / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    d = Daemon(proc=proc, config=config, run_dir=root / "run", log=log, port=port, zmq_port=zmq_port)
    deadline = time.monotonic() + START_TIMEOUT_S
    while http_json(d.url + "/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            text = log.read_text()[-4000:]
            shutil.rmtree(root, ignore_errors=True)
            pytest.fail(f"the daemon did not come up:\n{text}")
        time.sleep(0.5)
    try:
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)
