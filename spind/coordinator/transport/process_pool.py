"""Worker processes over ZeroMQ: spawn, talk to, watch, restart, stop (the daemon's `WorkerPool`).

`WorkerProcess` is one worker: its process (`python -m spind.worker.main`, its config on stdin so nothing
with the API key lands on disk), the DEALER socket the coordinator binds for it (a fresh ipc:// endpoint
per incarnation, in the private run directory), and the replies in flight, matched by `seq`. Its reader
task notices a dead process (exit) at once and a hung one through the call timeout; either fails every
call in flight with `WorkerDied`, and the coordinator restarts it and re-prefills what it held. A worker whose
device failed for good exits by itself (EXIT_DEVICE_ERROR) and is restarted the same way.

Devices: each worker process sees only its own device. A "cuda:N" worker gets CUDA_VISIBLE_DEVICES = that one GPU
(the Nth of those visible to the daemon) and is told it is "cuda:0", so nothing in it (a library's default device,
pinned memory) can make a CUDA context, or take memory, on another GPU; a "cpu" worker sees no GPU at all. The
worker still pins its device (torch.cuda.set_device), as the in-process pool's threads, which share one
process's GPUs, must.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict
from pathlib import Path

import zmq
import zmq.asyncio

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig, is_cuda
from spind.coordinator.placement import threads_for, worker_names
from spind.coordinator.transport.pool import (BusyHook, WorkerDied, WorkerError, WorkerInfo, quiet_future, reply_within,
                                             settle)
from spind.worker.device import EXIT_DEVICE_ERROR

log = logging.getLogger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "spind.worker.main")  # what runs a worker (tests run one that fails on cue)
MAX_IPC_PATH = 100  # AF_UNIX paths are limited to 107 bytes on Linux
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # units of /proc/PID/stat's CPU times
EXIT_CHECK_S = 0.1  # how often the reader checks that its worker process lives
SOCKET_NAME = re.compile(r"^(?:w-.+-(\d+)-\d+|probs-(\d+))\.sock$")  # w-NAME-PID-INCARNATION, probs-PID


def default_run_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"spind-{os.getuid()}"


def prepare_run_dir(path: Path) -> Path:
    """Create (or check) a private 0700 directory owned by this user for sockets; remove the socket files
    of daemons that no longer run (a SIGKILLed daemon cannot clean up after itself)."""
    path = path.expanduser().resolve()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"run dir {path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    for f in path.iterdir():
        m = SOCKET_NAME.match(f.name)
        if m and not _pid_alive(int(m.group(1) or m.group(2))):
            f.unlink(missing_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerProcess:
    def __init__(self, ctx: zmq.asyncio.Context, name: str, cfg: SpindConfig, run_dir: Path, probs_endpoint: str,
                 load_timeout_s: float, command: tuple[str, ...] = WORKER_COMMAND) -> None:
        self.ctx, self.name, self.cfg = ctx, name, cfg
        self.command = command
        self.run_dir, self.probs_endpoint = run_dir, probs_endpoint
        self.info = WorkerInfo(name=name, is_target=name == TARGET_WORKER,
                               drafters=[d.name for d in cfg.drafters if d.worker == name],
                               device=cfg.worker(name).device, threads=threads_for(cfg, name))
        self.load_timeout_s = load_timeout_s
        self.proc: subprocess.Popen | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.sock_path: Path | None = None
        self.incarnation = 0
        self.is_alive = False
        self.on_busy: BusyHook | None = None
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._ready_fut: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._is_stopping = False

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.incarnation += 1
        self.sock_path = self.run_dir / f"w-{self.name}-{os.getpid()}-{self.incarnation}.sock"
        if len(str(self.sock_path)) > MAX_IPC_PATH:
            raise ValueError(f"run dir {self.run_dir} is too long for ipc sockets; choose a shorter one")
        endpoint = f"ipc://{self.sock_path}"
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._ready_fut = asyncio.get_running_loop().create_future()
        env, device, group = group_env(self.cfg.worker(self.name).group_devices)
        self.proc = subprocess.Popen(
            [*self.command, "--name", self.name, "--config", "-", "--endpoint", endpoint,
             "--probs-endpoint", self.probs_endpoint, "--threads", str(self.info.threads), "--device", device,
             "--parent-pid", str(os.getpid()),
             *(["--group-devices", ",".join(group)] if len(group) > 1 else [])],
            stdin=subprocess.PIPE, env=env)
        self.proc.stdin.write(json.dumps(asdict(self.cfg)).encode())
        self.proc.stdin.close()
        self._reader = asyncio.create_task(self._read_loop(self.proc, self.sock), name=f"reader-{self.name}")
        try:
            ready = await reply_within(self._ready_fut, self.load_timeout_s)
        except TimeoutError:
            await self.kill()
            raise WorkerDied(self.name, f"not ready within {self.load_timeout_s:.0f} s") from None
        if ready.name != self.name:
            await self.kill()
            raise WorkerDied(self.name, f"a worker named {ready.name!r} answered")
        self.info.update(ready)
        self.is_alive = True
        log.info("worker %s ready (pid %d, %d threads)", self.name, self.proc.pid, ready.num_threads)

    async def restart(self) -> None:
        await self.kill()
        self.info.restarts += 1
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
                await asyncio.sleep(0.02)
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
        if self.sock_path is not None:
            self.sock_path.unlink(missing_ok=True)
        self._fail_all("killed")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the running process (Linux /proc), or None (not running, not Linux)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat(5))

    # ---- calls ----------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._pending)

    def cast(self, msg: object) -> asyncio.Future:
        fut = quiet_future(asyncio.get_running_loop())
        if not self.is_alive or self.sock is None:
            fut.set_exception(WorkerDied(self.name, "not running"))
            return fut
        seq = next(self._seq)
        # DEALER with a peer: queues. An asyncio socket does not raise zmq.Again (no peer: the worker process is
        # gone) but returns a future that holds it, already done for a NOBLOCK send; left unread, asyncio logged it
        # as a traceback and the call waited for a reply that could not come.
        sent = self.sock.send(P.encode(P.with_seq(msg, seq)), flags=zmq.NOBLOCK)
        if not sent.done():  # not expected for NOBLOCK; still, never leave an exception unread
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
        elif not sent.cancelled() and sent.exception() is not None:
            fut.set_exception(WorkerDied(self.name, f"not connected ({sent.exception()})"))
            return fut
        self._pending[seq] = fut
        return fut

    async def call(self, msg: object, timeout_s: float) -> object:
        return await self.start_call(msg, timeout_s)

    def start_call(self, msg: object, timeout_s: float) -> Awaitable[object]:
        return self._reply(self.cast(msg), timeout_s)

    async def _reply(self, fut: asyncio.Future, timeout_s: float) -> object:
        try:
            return await reply_within(fut, timeout_s)
        except TimeoutError:
            log.error("worker %s: no reply within %.0f s; killing it", self.name, timeout_s)
            await self.kill()
            raise WorkerDied(self.name, f"no reply within {timeout_s:.0f} s") from None

    async def _read_loop(self, proc: subprocess.Popen, sock: zmq.asyncio.Socket) -> None:
        """Route replies to their calls (`_read_replies`); on process exit fail them all (within EXIT_CHECK_S)."""
        why = ""
        replies = asyncio.ensure_future(self._read_replies(sock))
        try:
            while not why:
                await asyncio.wait((replies,), timeout=EXIT_CHECK_S)
                if replies.done():  # the socket broke under us (or a reply could not be routed): the worker is lost
                    exc = replies.exception()
                    why = f"socket error {exc}" if isinstance(exc, zmq.ZMQError) else \
                        f"reading its replies failed: {type(exc).__name__}: {exc}"
                    log.error("worker %s: %s", self.name, why)
                elif proc.poll() is not None:
                    self._drain(sock)  # what it sent before it exited (a Shutdown's Ack) is its callers', not lost
                    why = f"exit code {proc.returncode}"
                    if proc.returncode == EXIT_DEVICE_ERROR:
                        why += " (its device failed; see its log)"
                    level = logging.INFO if self._is_stopping else logging.ERROR
                    log.log(level, "worker %s (pid %d) exited with %s", self.name, proc.pid, proc.returncode)
        finally:
            replies.cancel()
        self.is_alive = False
        self._fail_all(why)
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(WorkerDied(self.name, f"{why} while loading"))

    async def _read_replies(self, sock: zmq.asyncio.Socket) -> None:
        """Every reply to its call, as it lands. A plain `recv` each: a `poll` with a timeout before each (what the
        exit check once rode on) cost ~0.05 ms a reply on a 2-core CPU (a poller, its reader and its timer made and
        dropped), and the target waits for the next op meanwhile."""
        while True:
            self._dispatch(await sock.recv())

    def _drain(self, sock: zmq.asyncio.Socket) -> None:
        """Route the replies already in the socket, without waiting (the reader may not have had its turn yet)."""
        while True:
            try:
                frame = zmq.Socket.recv(sock, zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: nothing left
                return
            self._dispatch(frame)

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = P.decode(frame, P.WorkerReply)
        except P.ProtocolError as e:
            log.error("worker %s sent a malformed frame: %s", self.name, e)
            return
        if isinstance(msg, P.Ready):
            if self._ready_fut is not None and not self._ready_fut.done():
                self._ready_fut.set_result(msg)
            return
        fut = self._pending.pop(msg.seq, None)
        if fut is None:
            if isinstance(msg, P.ErrorReply):
                log.error("worker %s: %s", self.name, msg.message)
            fut = quiet_future(asyncio.get_running_loop())  # still record its busy intervals
        settle(fut, msg, self.info, self.on_busy)

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(self.name, why))


def worker_env(device: str, environ: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The environment of a worker on `device` and the name it then knows its device by: only its own GPU visible
    (see the module docstring; "cuda" is "cuda:0", and indices count the GPUs the daemon itself may see), none for
    a CPU worker; OpenMP threads that sleep rather than spin when idle, so a worker waiting on the coordinator does
    not burn the core another worker needs."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not is_cuda(device):
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env, device
    index = int(device.partition(":")[2] or 0)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        if index >= len(ids):
            raise ValueError(f"device {device}: CUDA_VISIBLE_DEVICES={visible!r} shows the daemon {len(ids)} GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = ids[index]
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    return env, "cuda:0"


def group_env(devices: tuple[str, ...] | list[str], environ: dict[str, str] | None = None
              ) -> tuple[dict[str, str], str, list[str]]:
    """`worker_env` for a worker whose ranks are on `devices` (one for a worker that is not split): every GPU of the
    group visible to rank 0, which starts the other ranks each with its own (spind/worker/tensor_parallel.py).
    Returns the environment, rank 0's device and every rank's, as the worker process names them."""
    env, device = worker_env(devices[0], environ)
    if len(devices) == 1 or not is_cuda(devices[0]):
        return env, device, [device] * len(devices)
    ids = [worker_env(d, environ)[0]["CUDA_VISIBLE_DEVICES"] for d in devices]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return env, "cuda:0", [f"cuda:{i}" for i in range(len(devices))]


class ProcessPool:
    """All worker processes of one coordinator."""

    shares_interpreter = False

    def __init__(self, cfg: SpindConfig, run_dir: Path, load_timeout_s: float = 600.0,
                 command: tuple[str, ...] = WORKER_COMMAND) -> None:
        self.cfg = cfg
        self.run_dir = prepare_run_dir(run_dir)
        self.ctx = zmq.asyncio.Context()
        probs = f"ipc://{self.run_dir / f'probs-{os.getpid()}.sock'}"
        self.workers = {n: WorkerProcess(self.ctx, n, cfg, self.run_dir, probs, load_timeout_s, command)
                        for n in worker_names(cfg)}
        self._on_busy: BusyHook | None = None

    @property
    def on_busy(self) -> BusyHook | None:
        return self._on_busy

    @on_busy.setter
    def on_busy(self, hook: BusyHook | None) -> None:
        self._on_busy = hook
        for w in self.workers.values():
            w.on_busy = hook

    @property
    def names(self) -> list[str]:
        return list(self.workers)

    def info(self, name: str) -> WorkerInfo:
        return self.workers[name].info

    def is_alive(self, name: str) -> bool:
        return self.workers[name].is_alive

    def cast(self, name: str, msg: object) -> asyncio.Future:
        return self.workers[name].cast(msg)

    async def call(self, name: str, msg: object, timeout_s: float) -> object:
        return await self.workers[name].call(msg, timeout_s)

    def start_call(self, name: str, msg: object, timeout_s: float) -> Awaitable[object]:
        return self.workers[name].start_call(msg, timeout_s)

    async def restart(self, name: str) -> None:
        await self.workers[name].restart()

    def cpu_seconds(self, name: str) -> float | None:
        return self.workers[name].cpu_seconds()

    async def kill(self, name: str, why: str) -> None:
        log.error("worker %s: %s; killing it", name, why)
        await self.workers[name].kill()

    async def start(self) -> None:
        try:  # drafter workers may connect to the draft-probs endpoint before the target binds it
            await asyncio.gather(*(w.start() for w in self.workers.values()))
        except BaseException:
            await self.stop(timeout_s=1.0)
            raise

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self.ctx.closed:
            return
        await asyncio.gather(*(w.stop(timeout_s) for w in self.workers.values()), return_exceptions=True)
        (self.run_dir / f"probs-{os.getpid()}.sock").unlink(missing_ok=True)
        self.ctx.term()

    def describe(self) -> list[dict]:
        return [w.info.describe(w.is_alive) for w in self.workers.values()]


class ProcessEngine:
    """The daemon's coordinator over its worker processes, driven from the caller's thread on an event loop of its
    own: `LocalEngine`'s interface (`loop`, `coordinator`, `close`) for what must be timed as the daemon runs it
    (`spind bench e2e --workers processes`). The run directory, for the sockets, is a fresh temporary one unless
    given."""

    def __init__(self, cfg: SpindConfig, selector=None, run_dir: Path | None = None) -> None:
        from spind.coordinator.engine import Coordinator

        self._tmp = tempfile.mkdtemp(prefix="spind-") if run_dir is None else None  # short: AF_UNIX paths
        self.loop = asyncio.new_event_loop()
        self.coordinator = Coordinator(cfg, ProcessPool(cfg, Path(self._tmp) if run_dir is None else run_dir),
                                       selector=selector)
        try:
            self.loop.run_until_complete(self.coordinator.start())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if not self.loop.is_closed():
                self.loop.run_until_complete(self.coordinator.shutdown(drain=False))
                self.loop.close()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
