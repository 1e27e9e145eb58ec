"""Worker processes seen from the coordinator: spawn, talk to, watch, restart, stop.

`WorkerHandle` is one worker: its process (`python -m spind.daemon.worker`), the DEALER socket the
coordinator binds for it (one fresh ipc:// endpoint per incarnation, in the private run directory), and
the replies in flight, matched by `seq`. Its reader task notices a dead process (exit) at once and a hung
one through the call timeout; either fails every call in flight with `WorkerDied`, and the engine calls
`restart` and re-prefills what the worker held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable

import zmq
import zmq.asyncio

from spind import protocol as P
from spind.config import SpindConfig
from spind.daemon.worker import TARGET_WORKER, threads_for, worker_names

log = logging.getLogger(__name__)

MAX_IPC_PATH = 100  # AF_UNIX paths are limited to 107 bytes on Linux


class WorkerDied(RuntimeError):
    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"worker {name!r} died: {why}")
        self.name = name


class WorkerError(RuntimeError):
    """The worker answered an op with an ErrorReply (it is alive; the op was refused)."""


def default_run_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"spind-{os.getuid()}"


def prepare_run_dir(path: Path) -> Path:
    """Create (or check) a private 0700 directory owned by this user for sockets."""
    path = path.expanduser().resolve()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"run dir {path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class WorkerHandle:
    def __init__(self, ctx: zmq.asyncio.Context, name: str, cfg: SpindConfig, run_dir: Path, config_path: Path,
                 load_timeout_s: float = 600.0) -> None:
        self.ctx, self.name, self.cfg = ctx, name, cfg
        self.run_dir, self.config_path = run_dir, config_path
        self.device = cfg.worker(name).device
        self.threads = threads_for(cfg, name)
        self.drafters = [d.name for d in cfg.drafters if d.worker == name]
        self.is_target = name == TARGET_WORKER
        self.load_timeout_s = load_timeout_s
        self.proc: subprocess.Popen | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.ready: P.Ready | None = None
        self.incarnation = 0
        self.restarts = 0
        self.is_alive = False
        self.busy: deque[P.BusyInterval] = deque(maxlen=256)  # most recent forwards, for occupancy
        self.on_busy: Callable[[str, P.BusyInterval], None] | None = None  # (worker name, interval) -> metrics
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._ready_fut: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._is_stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.incarnation += 1
        path = self.run_dir / f"w-{self.name}-{os.getpid()}-{self.incarnation}.sock"
        if len(str(path)) > MAX_IPC_PATH:
            raise ValueError(f"run dir {self.run_dir} is too long for ipc sockets; choose a shorter one")
        endpoint = f"ipc://{path}"
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._ready_fut = asyncio.get_running_loop().create_future()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spind.daemon.worker", "--name", self.name, "--config", str(self.config_path),
             "--endpoint", endpoint, "--threads", str(self.threads)], stdin=subprocess.DEVNULL)
        self._reader = asyncio.create_task(self._read_loop(self.proc, self.sock), name=f"reader-{self.name}")
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), self.load_timeout_s)
        except asyncio.TimeoutError:
            await self.kill()
            raise WorkerDied(self.name, f"not ready within {self.load_timeout_s:.0f} s") from None
        if self.ready.name != self.name:
            await self.kill()
            raise WorkerDied(self.name, f"a worker named {self.ready.name!r} answered")
        self.is_alive = True
        log.info("worker %s ready (pid %d, %d threads)", self.name, self.proc.pid, self.ready.num_threads)

    async def restart(self) -> None:
        await self.kill()
        self.restarts += 1
        await self.start()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not within timeout_s."""
        self._is_stopping = True
        if self.is_alive:
            try:
                await self.call(P.Shutdown(0), timeout_s)
            except (WorkerDied, WorkerError):
                pass
        if self.proc is not None:
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await self.kill()

    async def kill(self) -> None:
        """SIGKILL the process (if still running), reap it, close the socket, fail all calls in flight."""
        self.is_alive = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self._fail_all("killed")

    # ---- calls ----------------------------------------------------------------------------------
    def cast(self, msg: object) -> asyncio.Future:
        """Send an op now; the returned future holds its reply (or WorkerDied/WorkerError).
        Ops are handled in send order, so a cast followed by a call is seen in that order."""
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # a dropped reply is not an error
        if not self.is_alive or self.sock is None:
            fut.set_exception(WorkerDied(self.name, "not running"))
            return fut
        seq = next(self._seq)
        msg = dataclasses.replace(msg, seq=seq)
        try:
            self.sock.send(P.encode(msg), flags=zmq.NOBLOCK)  # DEALER with a connected peer: queues
        except zmq.Again:  # no peer: the worker process is gone
            fut.set_exception(WorkerDied(self.name, "not connected"))
            return fut
        self._pending[seq] = fut
        return fut

    async def call(self, msg: object, timeout_s: float) -> object:
        """Send an op and wait for its reply; a timeout counts as a hung worker (killed: WorkerDied)."""
        fut = self.cast(msg)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            log.error("worker %s: no reply within %.0f s; killing it", self.name, timeout_s)
            await self.kill()
            raise WorkerDied(self.name, f"no reply within {timeout_s:.0f} s") from None

    async def _read_loop(self, proc: subprocess.Popen, sock: zmq.asyncio.Socket) -> None:
        """Route replies to their calls; on process exit fail them all (within 100 ms)."""
        why = ""
        try:
            while not why:
                if await sock.poll(100):
                    self._dispatch(await sock.recv())
                elif proc.poll() is not None:
                    why = f"exit code {proc.returncode}"
                    level = logging.INFO if self._is_stopping else logging.ERROR
                    log.log(level, "worker %s (pid %d) exited with %s", self.name, proc.pid, proc.returncode)
        except zmq.ZMQError as e:  # the socket broke under us: treat the worker as lost
            why = f"socket error {e}"
            log.error("worker %s: %s", self.name, why)
        self.is_alive = False
        self._fail_all(why)
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(WorkerDied(self.name, f"{why} while loading"))

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = P.decode(frame)
        except P.ProtocolError as e:
            log.error("worker %s sent a malformed frame: %s", self.name, e)
            return
        if isinstance(msg, P.Ready):
            if self._ready_fut is not None and not self._ready_fut.done():
                self._ready_fut.set_result(msg)
            return
        for b in getattr(msg, "busy", ()):
            self.busy.append(b)
            if self.on_busy is not None:
                self.on_busy(self.name, b)
        fut = self._pending.pop(getattr(msg, "seq", -1), None)
        if fut is None:
            if isinstance(msg, P.ErrorReply):
                log.error("worker %s: %s", self.name, msg.message)
            return
        if fut.done():
            return
        if isinstance(msg, P.ErrorReply):
            fut.set_exception(WorkerError(f"worker {self.name!r}: {msg.message}"))
        else:
            fut.set_result(msg)

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(self.name, why))

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device, "pid": self.pid, "alive": self.is_alive,
                "restarts": self.restarts, "threads": self.threads, "is_target": self.is_target,
                "drafters": self.drafters,
                "busy": [{"kind": b.kind, "start": round(b.start, 6), "end": round(b.end, 6), "num_reqs": b.num_reqs}
                         for b in list(self.busy)[-64:]]}


class Supervisor:
    """All workers of one coordinator."""

    def __init__(self, cfg: SpindConfig, run_dir: Path, load_timeout_s: float = 600.0) -> None:
        self.cfg = cfg
        self.run_dir = prepare_run_dir(run_dir)
        self.ctx = zmq.asyncio.Context()
        self.config_path = self.run_dir / f"config-{os.getpid()}.json"
        self.workers = {n: WorkerHandle(self.ctx, n, cfg, self.run_dir, self.config_path, load_timeout_s)
                        for n in worker_names(cfg)}

    @property
    def target(self) -> WorkerHandle:
        return self.workers[TARGET_WORKER]

    def worker_of(self, drafter: str) -> WorkerHandle:
        return self.workers[self.cfg.drafter(drafter).worker]

    async def start(self) -> None:
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(self.cfg), f)
        try:
            await asyncio.gather(*(w.start() for w in self.workers.values()))
        except BaseException:
            await self.stop(timeout_s=1.0)
            raise

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self.ctx.closed:
            return
        await asyncio.gather(*(w.stop(timeout_s) for w in self.workers.values()), return_exceptions=True)
        self.config_path.unlink(missing_ok=True)
        self.ctx.term()
