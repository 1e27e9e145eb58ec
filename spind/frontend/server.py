"""The daemon's main: bind the HTTP and ZeroMQ front ends, start the engine, write the pid file, serve.

Life of the process:
  starting  sockets bound (a taken port fails at once), engine loading; /health answers 503 "starting"
  ok        serving; the pid file names the pid and the addresses
  draining  first SIGTERM/SIGINT: new requests get 503, in-flight ones finish, the engine stops, exit 0
  second signal while draining: in-flight requests are aborted and the process exits 1 at once
  failed    the engine gave up (a worker crashed more than [server].max_restarts times within
            restart_window_s): /health 503, the process exits 3 so that a supervisor restarts it
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from aiohttp import web

from spind.config import SpindConfig
from spind.frontend.api import ApiLimits, ApiServer
from spind.frontend.http_server import CappedAppRunner
from spind.coordinator.interface import Engine
from spind.coordinator.transport.process_pool import prepare_run_dir
from spind.frontend.zmq_api import ZmqApiServer

log = logging.getLogger(__name__)

PID_FILE = "spind.pid"
LOG_FILE = "spind.log"
ABORT_TIMEOUT_S = 10.0
EXIT_GAVE_UP = 3  # the engine cannot go on (a worker that cannot be restarted)
RESERVED_FDS = 256  # descriptors kept for the daemon itself beyond its HTTP connections


@dataclass(frozen=True)
class PidInfo:
    pid: int
    host: str
    port: int
    zmq_port: int
    started: float

    @classmethod
    def read(cls, run_dir: Path) -> "PidInfo | None":
        try:
            raw = json.loads((run_dir / PID_FILE).read_text())
            return cls(int(raw["pid"]), str(raw["host"]), int(raw["port"]), int(raw["zmq_port"]),
                       float(raw["started"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, run_dir: Path) -> None:
        tmp = run_dir / f".{PID_FILE}.{self.pid}"
        tmp.write_text(json.dumps(self.__dict__))
        tmp.replace(run_dir / PID_FILE)

    @property
    def is_alive(self) -> bool:
        """The process exists and is a spind (not a stranger that reused a stale pid)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # another user's process: not our daemon
        try:
            return b"spind" in Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return True  # no /proc: trust the pid


def build_engine(cfg: SpindConfig, run_dir: Path) -> Engine:
    """The coordinator over worker processes."""
    from spind.coordinator.engine import Coordinator
    from spind.coordinator.transport.process_pool import ProcessPool
    from spind.coordinator.recovery import RestartPolicy

    s = cfg.server
    return Coordinator(cfg, ProcessPool(cfg, run_dir), restarts=RestartPolicy(s.max_restarts, s.restart_window_s),
                       heartbeat_timeout_s=s.heartbeat_timeout_s, watchdog_s=s.watchdog_s)


@dataclass
class Daemon:
    cfg: SpindConfig
    run_dir: Path
    engine: Engine
    api: ApiServer
    zmq: ZmqApiServer | None
    runner: CappedAppRunner | None = None
    num_signals: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _abort: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def create(cls, cfg: SpindConfig) -> "Daemon":
        run_dir = prepare_run_dir(Path(cfg.server.run_dir))
        engine = build_engine(cfg, run_dir)
        s = cfg.server
        limits = ApiLimits(s.model_name, cfg.model.max_model_len, tuple(d.name for d in cfg.drafters))
        api = ApiServer(engine, limits, api_key=s.api_key, body_timeout_s=s.body_timeout_s)
        zmq = ZmqApiServer(engine, limits, s.zmq_host, s.zmq_port, s.api_key) if s.zmq_port else None
        return cls(cfg, run_dir, engine, api, zmq)

    def on_signal(self) -> None:
        self.num_signals += 1
        (self._stop if self.num_signals == 1 else self._abort).set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal)
        existing = PidInfo.read(self.run_dir)
        if existing is not None and existing.is_alive and existing.pid != os.getpid():
            raise ValueError(f"a spind daemon (pid {existing.pid}) already uses run dir {self.run_dir}")
        try:
            port = await self._bind()
            if not await self._start_engine():
                return 0
            self._set_status("ok")
            zmq_port = self.zmq.port if self.zmq else 0
            PidInfo(os.getpid(), self.cfg.server.host, port, zmq_port, time.time()).write(self.run_dir)
            log.info("spind serving %s on http://%s:%d (zmq port %d), pid %d", self.cfg.server.model_name,
                     self.cfg.server.host, port, zmq_port, os.getpid())
            if await self._wait_stop_or_failure():
                return await self._shutdown()
            return await self._give_up()
        finally:
            await self._close()

    async def _wait_stop_or_failure(self) -> bool:
        """True on a stop signal, False when the engine gave up."""
        stop = asyncio.create_task(self._stop.wait())
        failed = asyncio.create_task(self.engine.wait_failed())
        await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
        for t in (stop, failed):
            t.cancel()
        return self._stop.is_set()

    async def _give_up(self) -> int:
        log.error("the engine gave up (%s); exiting with code %d", self.engine.health(), EXIT_GAVE_UP)
        self._set_status("failed")
        await _stop_engine_quietly(self.engine)
        return EXIT_GAVE_UP

    async def _bind(self) -> int:
        s = self.cfg.server
        max_connections = fit_descriptor_limit(s.max_connections)
        self.runner = CappedAppRunner(self.api.build_app(), max_connections, handler_cancellation=True,
                                      access_log=None, keepalive_timeout=s.idle_timeout_s)
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, s.host, s.port).start()
        except OSError as e:
            raise ValueError(f"cannot serve HTTP on {s.host}:{s.port}: {e.strerror}") from None
        if self.zmq:
            try:
                self.zmq.bind()
            except zmq.ZMQError as e:
                raise ValueError(f"cannot serve the ZeroMQ API on {s.zmq_host}:{s.zmq_port}: {e}") from None
        return self.runner.addresses[0][1]

    async def _start_engine(self) -> bool:
        """Load the workers; a signal meanwhile stops the loading (False) instead of waiting it out."""
        log.info("starting the engine")
        start = asyncio.create_task(self.engine.start())
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if start.done():
            start.result()
            return True
        log.warning("signal while starting: stopping")
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await asyncio.wait_for(self.engine.shutdown(drain=False), ABORT_TIMEOUT_S)
        return False

    def _set_status(self, status: str) -> None:
        self.api.set_status(status)
        if self.zmq:
            self.zmq.set_status(status)

    async def _drain(self) -> None:
        await self.api.in_flight.wait_idle()
        if self.zmq:
            await self.zmq.in_flight.wait_idle()
        await self.engine.shutdown(drain=True)

    async def _shutdown(self) -> int:
        """First signal: drain. A second signal during the drain aborts everything in flight."""
        log.info("draining: %d HTTP and %d ZeroMQ requests in flight", self.api.in_flight.num_active,
                    self.zmq.in_flight.num_active if self.zmq else 0)
        self._set_status("draining")
        drain = asyncio.create_task(self._drain())
        abort = asyncio.create_task(self._abort.wait())
        await asyncio.wait({drain, abort}, return_when=asyncio.FIRST_COMPLETED)
        abort.cancel()
        if drain.done():
            drain.result()
            log.info("drained; exiting")
            return 0
        log.warning("second signal: aborting in-flight requests")
        drain.cancel()
        try:
            await asyncio.wait_for(self.engine.shutdown(drain=False), ABORT_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.error("the engine did not stop within %.0fs", ABORT_TIMEOUT_S)
        return 1

    async def _close(self) -> None:
        if self.zmq:
            self.zmq.close()
        if self.runner:
            await self.runner.cleanup()
        info = PidInfo.read(self.run_dir)
        if info is not None and info.pid == os.getpid():
            (self.run_dir / PID_FILE).unlink(missing_ok=True)


def fit_descriptor_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit to fit max_connections plus the daemon's own (workers, ZeroMQ, files),
    up to the hard limit; past it, fewer connections: the cap must bite before accept() fails (EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("[server] max_connections %d does not fit the descriptor limit %d; capping at %d",
                    max_connections, soft, soft - RESERVED_FDS)
        return max(1, soft - RESERVED_FDS)
    return max_connections


def serve(cfg: SpindConfig) -> int:
    """Run the daemon in the foreground until a signal; returns the exit code."""
    return asyncio.run(_serve(cfg))


async def _serve(cfg: SpindConfig) -> int:
    daemon = Daemon.create(cfg)
    try:
        return await daemon.run()
    except BaseException:
        await _stop_engine_quietly(daemon.engine)
        raise


async def _stop_engine_quietly(engine: Engine) -> None:
    try:
        await asyncio.wait_for(engine.shutdown(drain=False), ABORT_TIMEOUT_S)
    except Exception:
        log.exception("stopping the engine after a failure")
