"""`spind start | status | stop`.

`start` runs the daemon in the foreground (`--detach`: in the background, returning once /health answers);
`status` and `stop` find it through the pid file in the run dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from spind.config import SpindConfig, load_config, with_tensor_parallel
from spind.progress import PREFIX as PROGRESS_PREFIX
from spind.state import SpindState, StateVersionError, decode_state

if TYPE_CHECKING:
    from spind.frontend.server import PidInfo

POLL_S = 0.25


def load_daemon_config(args: argparse.Namespace) -> SpindConfig:
    """The config with CLI overrides applied and `server.run_dir` resolved to a concrete path."""
    server = {"host": getattr(args, "host", None), "port": getattr(args, "port", None),
              "zmq_port": getattr(args, "zmq_port", None), "run_dir": args.run_dir}
    cfg = load_config(args.config, {"model": {"target": getattr(args, "model", None),
                                              "dtype": getattr(args, "dtype", None)},
                                    "runtime": {"threads": getattr(args, "threads", None)}, "server": server})
    cfg = with_tensor_parallel(cfg, getattr(args, "tensor_parallel", None))
    from spind.coordinator.transport.process_pool import default_run_dir

    run_dir = Path(cfg.server.run_dir).expanduser() if cfg.server.run_dir else default_run_dir()
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, run_dir=str(run_dir.absolute())))


def probe_url(host: str, port: int, path: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


def cmd_start(args: argparse.Namespace) -> int:
    cfg = load_daemon_config(args)
    if args.detach:
        return _start_detached(args, cfg)
    from spind.frontend.server import serve

    return serve(cfg)


def _start_detached(args: argparse.Namespace, cfg: SpindConfig) -> int:
    from spind.client import http_json
    from spind.frontend.server import LOG_FILE
    from spind.coordinator.transport.process_pool import prepare_run_dir

    run_dir = prepare_run_dir(Path(cfg.server.run_dir))
    argv = [sys.executable, "-m", "spind.cli", *(["-v"] if args.verbose else []), "start",
            "--run-dir", cfg.server.run_dir, "--host", cfg.server.host, "--port", str(cfg.server.port),
            "--zmq-port", str(cfg.server.zmq_port)]
    for flag, value in (("--config", args.config), ("--model", args.model), ("--dtype", args.dtype),
                        ("--threads", args.threads), ("--tensor-parallel", getattr(args, "tensor_parallel", None))):
        if value is not None:
            argv += [flag, str(value)]
    log_path = run_dir / LOG_FILE
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                start_new_session=True)
    url = probe_url(cfg.server.host, cfg.server.port, "/health")
    log_start = log_path.stat().st_size
    print(f"spind: starting the daemon (pid {proc.pid}): loading the models, log: {log_path}", file=sys.stderr,
          flush=True)
    deadline = time.monotonic() + args.timeout
    echoed = log_start
    while time.monotonic() < deadline:
        echoed = echo_progress(log_path, echoed)
        if proc.poll() is not None:  # it died: its own words, not a readiness probe answered by someone else
            with open(log_path, errors="replace") as f:
                f.seek(log_start)
                tail = f.read().splitlines()[-10:]
            print(f"spind: the daemon exited with code {proc.returncode}:", *tail, sep="\n", file=sys.stderr)
            return 1
        status, body = http_json(url, timeout=2.0)
        if status == 200 and (body or {}).get("pid") == proc.pid:
            print(f"spind serving on {probe_url(cfg.server.host, cfg.server.port, '')} (pid {proc.pid}); "
                  f"log: {log_path}")
            return 0
        time.sleep(POLL_S)
    print(f"spind: no answer from {url} after {args.timeout:.0f}s; the daemon (pid {proc.pid}) is still "
          f"starting or stuck, see {log_path}", file=sys.stderr)
    return 1


def echo_progress(log_path: Path, offset: int) -> int:
    """Print the start-up steps the daemon wrote to its log since `offset` (its `spind: ...` lines: converting the
    model, profiling, compiling kernels; spind/progress.py), so that a detached start is not silent while it loads;
    returns the offset read up to (whole lines only)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode(errors="replace").splitlines():
        if line.startswith(PROGRESS_PREFIX):
            print(line, file=sys.stderr, flush=True)
    return offset + end


def find_daemon(args: argparse.Namespace) -> tuple[SpindConfig, PidInfo | None]:
    """The config and the live daemon's pid file (None, with a message, when none is running)."""
    from spind.frontend.server import PidInfo  # noqa: F811 - imported here: the server pulls in aiohttp and zmq

    cfg = load_daemon_config(args)
    info = PidInfo.read(Path(cfg.server.run_dir))
    if info is None or not info.is_alive:
        print(f"spind is not running (no live pid file in {cfg.server.run_dir})")
        return cfg, None
    return cfg, info


def cmd_status(args: argparse.Namespace) -> int:
    from spind.client import http_json

    cfg, info = find_daemon(args)
    if info is None:
        return 1
    headers = {"Authorization": f"Bearer {cfg.server.api_key}"} if cfg.server.api_key else {}
    status, health = http_json(probe_url(info.host, info.port, "/health"))
    state_status, state = http_json(probe_url(info.host, info.port, "/v1/spind/state"), headers=headers)
    if args.json:
        print(json.dumps({"pid": info.pid, "port": info.port, "zmq_port": info.zmq_port, "health": health,
                          "state": state}))
    else:
        print(f"spind pid {info.pid}, http://{info.host}:{info.port}, zmq port {info.zmq_port or 'off'}, "
              f"up {time.time() - info.started:.0f}s: {(health or {}).get('status', 'no answer')}")
        try:
            lines = summarize_state(decode_state(state)) if state_status == 200 else [f"no state (HTTP {state_status})"]
        except (StateVersionError, msgspec.ValidationError) as e:
            lines = [f"cannot read the daemon's state: {e}"]
        for line in lines:
            print("  " + line)
    return 0 if status == 200 else 1


def summarize_state(state: SpindState) -> list[str]:
    """A few lines from /v1/spind/state: requests and selection, then one line per worker."""
    lines = [f"requests: {state.num_running} running, {state.num_waiting} waiting"]
    sel = state.selection
    if sel is not None:
        stage = f", epoch {sel.epoch} {sel.stage} slot {sel.slot_in_stage}/{sel.stage_slots}" if sel.stage else ""
        lines.append(f"selection: {sel.policy}{stage}")
    for w in state.workers:
        mib = f"{w.rss_bytes / 2**20:.0f} MiB" if w.rss_bytes else "? MiB"
        lines.append(f"worker {w.name}: {'alive' if w.alive else 'DEAD'}, pid {w.pid}, {w.device} {w.dtype}, {mib}, "
                     f"{w.utilisation:.0%} busy, {w.restarts} restarts; {w.model}")
    return lines


def daemon_url(cfg: SpindConfig) -> str:
    """The HTTP address of this config's daemon: from its pid file when it runs, else from [server]."""
    from spind.frontend.server import PidInfo  # noqa: F811

    info = PidInfo.read(Path(cfg.server.run_dir))
    host, port = (info.host, info.port) if info is not None and info.is_alive else (cfg.server.host, cfg.server.port)
    return probe_url(host, port, "")


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve the live dashboard (a Streamlit page, the `dashboard` extra) for this config's daemon."""
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        raise ValueError("the dashboard needs streamlit and altair: pip install 'spind[dashboard]'")
    cfg = load_daemon_config(argparse.Namespace(config=args.config, run_dir=args.run_dir))
    page, url = importlib.util.find_spec("spind.dashboard.app").origin, args.url or daemon_url(cfg)
    argv = [sys.executable, "-m", "streamlit", "run", page, "--server.address", args.host,
            "--server.port", str(args.port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "minimal", "--", "--url", url, *(["--config", args.config] if args.config else [])]
    print(f"spind dashboard: http://{args.host}:{args.port} (daemon {url})", flush=True)
    os.execv(sys.executable, argv)  # the API key is read from the config by the page, never put on a command line


def cmd_stop(args: argparse.Namespace) -> int:
    _, info = find_daemon(args)
    if info is None:
        return 1
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not info.is_alive:
            print(f"spind (pid {info.pid}) stopped")
            return 0
        time.sleep(POLL_S)
    print(f"spind (pid {info.pid}) is still draining after {args.timeout:.0f}s; a second "
          f"`kill -TERM {info.pid}` aborts the requests in flight", file=sys.stderr)
    return 1


def _add_where(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None, help="private dir for the pid file, log and worker sockets "
                                                   "(default: [server].run_dir, else /tmp/spind-$UID)")


def add_parsers(sub, add_config_args) -> None:
    """Register the daemon subcommands."""
    s = sub.add_parser("start", help="run the serving daemon (foreground unless --detach)")
    add_config_args(s, tensor_parallel=True)
    _add_where(s)
    s.add_argument("--host", default=None, help="bind address (default: [server].host, 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (default: [server].port, 8000)")
    s.add_argument("--zmq-port", type=int, default=None, help="ZeroMQ client API port; 0 disables it")
    s.add_argument("--detach", action="store_true", help="run in the background; return once /health answers")
    s.add_argument("--timeout", type=float, default=600.0, help="with --detach: seconds to wait for /health")
    s.set_defaults(func=cmd_start)

    st = sub.add_parser("status", help="is the daemon running? pid, address, requests, workers")
    st.add_argument("--config", default=None, help="config.toml (default: the embedded one)")
    _add_where(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    db = sub.add_parser("dashboard", help="serve the live dashboard page (needs the `dashboard` extra)")
    db.add_argument("--config", default=None, help="config.toml: the daemon's address and API key (default: embedded)")
    _add_where(db)
    db.add_argument("--url", default=None, help="the daemon's HTTP address (default: its pid file, else [server])")
    db.add_argument("--host", default="127.0.0.1", help="address the page listens on (default: 127.0.0.1)")
    db.add_argument("--port", type=int, default=8501, help="port the page listens on (default: 8501)")
    db.set_defaults(func=cmd_dashboard)

    sp = sub.add_parser("stop", help="SIGTERM the daemon (it drains in-flight requests) and wait for it to exit")
    sp.add_argument("--config", default=None, help="config.toml (default: the embedded one)")
    _add_where(sp)
    sp.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the drain")
    sp.set_defaults(func=cmd_stop)
