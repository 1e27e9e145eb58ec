"""`spind bench serve`: time to first token and tokens/s of the real daemon, per drafter and concurrency.

Closed loop over the OpenAI-compatible streaming API: at concurrency C, C clients each send their next
request as soon as their previous one finishes. Levels run in order, and at each level every drafter runs
in turn (the request's `"spind": {"drafter": ...}`) on the same prompts, so drafters are compared side by
side on one daemon. Per request: TTFT (first non-empty content chunk), end-to-end latency, completion
tokens (the usage chunk) and spind's mean accepted length. The coordinator's overhead per time slot comes
from the `slots` counters of /v1/spind/state, read before and after each level.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import aiohttp

from spind.bench.datasets import Prompt
from spind.bench.report import Progress, fmt, format_table
from spind.client import http_json
from spind.state import SpindState, decode_state

PLAIN = "none"
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ServeSettings:
    concurrency: tuple[int, ...]
    drafters: tuple[str, ...]
    dataset: str = "mt_bench"
    num_requests: int | None = None  # per level; None = max(4, 2 x concurrency)
    max_tokens: tuple[int, ...] = (64,)
    ignore_eos: bool = True
    temperature: float = 0.0

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(4, 2 * concurrency)


@dataclass(frozen=True)
class Level:
    """One row of the bench: a daemon, an output length, a number of clients, a drafter."""

    daemon: str
    max_tokens: int
    concurrency: int
    drafter: str


@dataclass
class RequestRecord:
    daemon: str
    max_tokens: int
    drafter: str
    concurrency: int
    index: int
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    time_slots: int = 0
    mean_accepted_length: float = 0.0
    error: str | None = None


# ---- aggregation (pure) -----------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); q=0.5 is the median."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _slot_totals(slots: dict) -> tuple[float, float, float]:
    """(slots, total slot ms, total overhead ms) from the cumulative `slots` entry of /v1/spind/state."""
    n = slots.get("num_slots", 0)
    return n, slots.get("mean_slot_ms", 0.0) * n, slots.get("mean_overhead_ms", 0.0) * n


def summarize(level: Level, records: list[RequestRecord], wall_s: float, slots_before: dict,
              slots_after: dict) -> dict:
    """One summary row of a level; failed requests are counted, not measured."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    steps = sum(r.time_slots for r in ok)
    ttfts_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    (n0, slot0, over0), (n1, slot1, over1) = _slot_totals(slots_before), _slot_totals(slots_after)
    num_slots = n1 - n0
    return {
        "daemon": level.daemon, "max_tokens": level.max_tokens, "drafter": level.drafter,
        "concurrency": level.concurrency, "num_requests": len(records),
        "num_errors": len(records) - len(ok), "completion_tokens": tokens, "wall_s": wall_s,
        "ttft_p50_ms": percentile(ttfts_ms, 0.5), "ttft_p90_ms": percentile(ttfts_ms, 0.9),
        "latency_p50_s": percentile([r.latency_s for r in ok], 0.5),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "request_tokens_per_s_p50": percentile([r.completion_tokens / r.latency_s for r in ok if r.latency_s > 0],
                                               0.5),
        # weighted by time slots: committed tokens per verification over the whole level
        "mean_accepted_length": sum(r.mean_accepted_length * r.time_slots for r in ok) / steps if steps else None,
        "num_slots": num_slots,
        "slot_ms": (slot1 - slot0) / num_slots if num_slots else None,
        "overhead_ms_per_slot": (over1 - over0) / num_slots if num_slots else None,
        "speedup_vs_none": None,
    }


def _cell(r: dict) -> tuple:
    return r.get("daemon", ""), r.get("max_tokens", 0), r["concurrency"]


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill `speedup_vs_none`: aggregate tokens/s over the `none` drafter's on the same daemon, output length and
    concurrency."""
    plain = {_cell(r): r["tokens_per_s"] for r in rows if r["drafter"] == PLAIN}
    for r in rows:
        base = plain.get(_cell(r))
        r["speedup_vs_none"] = r["tokens_per_s"] / base if base and r["tokens_per_s"] is not None else None
    return rows


# ---- the clients --------------------------------------------------------------------------------------
async def send_request(session: aiohttp.ClientSession, url: str, prompt: Prompt, drafter: str,
                       settings: ServeSettings, rec: RequestRecord) -> RequestRecord:
    """One streamed request; fills `rec` (its `error` on failure, never raises for a failed request)."""
    body: dict = {"max_tokens": rec.max_tokens, "temperature": settings.temperature,
                  "ignore_eos": settings.ignore_eos, "stream": True, "stream_options": {"include_usage": True},
                  "spind": {"drafter": drafter}}
    if prompt.is_chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt.text}]
    else:
        path, body["prompt"] = "/v1/completions", prompt.text
    start = time.perf_counter()
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                await _read_stream(resp, prompt.is_chat, start, rec)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency_s = rec.latency_s or time.perf_counter() - start
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, is_chat: bool, start: float, rec: RequestRecord) -> None:
    """Server-sent events: TTFT at the first non-empty text; latency, counts and spind's usage at the usage
    chunk (the last before [DONE]; the stream is still read to its end); in-band errors."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            rec.error = str(chunk["error"].get("message"))
            return
        choice = chunk["choices"][0] if chunk["choices"] else {}
        text = choice.get("delta", {}).get("content") if is_chat else choice.get("text")
        if text and rec.ttft_s is None:
            rec.ttft_s = time.perf_counter() - start
        if chunk.get("usage"):
            spind = chunk.get("spind") or {}
            rec.completion_tokens = chunk["usage"]["completion_tokens"]
            rec.time_slots = spind.get("time_slots", 0)
            rec.mean_accepted_length = spind.get("mean_accepted_length", 0.0)
            rec.latency_s = time.perf_counter() - start
    if not rec.latency_s:
        rec.error = "the stream ended without a usage chunk"


async def _state(session: aiohttp.ClientSession, url: str) -> SpindState:
    async with session.get(url + "/v1/spind/state") as resp:
        resp.raise_for_status()
        return decode_state(await resp.read())


async def run_level(session: aiohttp.ClientSession, url: str, prompts: list[Prompt], level: Level,
                    settings: ServeSettings, progress: Progress) -> tuple[dict, list[RequestRecord]]:
    todo = iter(range(settings.requests_at(level.concurrency)))  # shared by the clients: each takes the next index
    records: list[RequestRecord] = []

    async def client() -> None:
        for i in todo:
            rec = await send_request(session, url, prompts[i % len(prompts)], level.drafter, settings,
                                     RequestRecord(level.daemon, level.max_tokens, level.drafter, level.concurrency, i))
            records.append(rec)
            progress.step(f"{level.daemon} {level.drafter} c={level.concurrency} n={level.max_tokens} #{i}: " +
                          (f"error {rec.error}" if rec.error else
                           f"{rec.completion_tokens} tokens, ttft {fmt(rec.ttft_s)}s, {rec.latency_s:.2f}s"))

    before = (await _state(session, url)).slots
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(level.concurrency)))
    wall_s = time.perf_counter() - start
    after = (await _state(session, url)).slots
    return summarize(level, records, wall_s, before, after), records


async def _check_daemon(session: aiohttp.ClientSession, label: str, url: str, prompt: Prompt,
                        settings: ServeSettings) -> str:
    state = await _state(session, url)
    unknown = set(settings.drafters) - {"auto", PLAIN, *state.drafters}
    if unknown:
        raise ValueError(f"daemon {label} has no drafter {', '.join(sorted(unknown))}; it has: "
                         f"auto, {PLAIN}, {', '.join(state.drafters)}")
    for d in settings.drafters:  # the first forwards of each model, not timed
        rec = await send_request(session, url, prompt, d, settings, RequestRecord(label, 4, d, 0, -1))
        if rec.error:
            raise ValueError(f"warm-up request to {label} with drafter {d} failed: {rec.error}")
    return state.model


async def run_serve_bench(daemons: dict[str, str], prompts: list[Prompt], settings: ServeSettings,
                          headers: dict[str, str] | None = None) -> dict:
    """Every level on every daemon ({label: base URL}), interleaved so that all daemons see the same machine
    load; returns the JSON-ready results."""
    levels = [Level(label, n, c, d) for n in settings.max_tokens for c in settings.concurrency
              for d in settings.drafters for label in daemons]
    progress = Progress(total=sum(settings.requests_at(lv.concurrency) for lv in levels))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        models = {label: await _check_daemon(session, label, url, prompts[0], settings)
                  for label, url in daemons.items()}
        rows, records = [], []
        for level in levels:
            row, recs = await run_level(session, daemons[level.daemon], prompts, level, settings, progress)
            rows.append(row)
            records += recs
            progress.note(f"{level.daemon} {level.drafter} c={level.concurrency} n={level.max_tokens}: "
                          f"{fmt(row['tokens_per_s'], 1)} tokens/s, ttft p50 {fmt(row['ttft_p50_ms'], 0)} ms, "
                          f"slot {fmt(row['slot_ms'], 1)} ms, {row['num_errors']} errors")
    return {"settings": asdict(settings), "daemons": daemons, "models": models, "cpu_count": os.cpu_count(),
            "rows": add_ratios(rows), "requests": [asdict(r) for r in records]}


def render_table(results: dict) -> str:
    s = results["settings"]
    title = (f"Serving: {s['dataset']} prompts{' (ignore_eos)' if s['ignore_eos'] else ''}, temperature "
             f"{s['temperature']}, closed-loop clients")
    header = ["daemon", "max tok", "drafter", "conc", "reqs", "err", "TTFT p50 ms", "TTFT p90 ms", "lat p50 s",
              "tok/s", "tok/s/req p50", "acc len", "slot ms", "overhead ms/slot", "x none"]
    rows = [[r["daemon"], str(r["max_tokens"]), r["drafter"], str(r["concurrency"]), str(r["num_requests"]),
             str(r["num_errors"]), fmt(r["ttft_p50_ms"], 0), fmt(r["ttft_p90_ms"], 0), fmt(r["latency_p50_s"]),
             fmt(r["tokens_per_s"], 1), fmt(r["request_tokens_per_s_p50"], 1), fmt(r["mean_accepted_length"]),
             fmt(r["slot_ms"], 1), fmt(r["overhead_ms_per_slot"], 3), fmt(r["speedup_vs_none"])]
            for r in results["rows"]]
    tables = [format_table(title, header, rows)]
    labels = list(results["daemons"])
    if len(labels) > 1:
        tables.append(compare_table(results["rows"], labels[0], labels[1:]))
    return "\n\n".join(tables)


def compare_table(rows: list[dict], base: str, others: list[str]) -> str:
    """Each daemon against the first, level by level: ratios of tokens/s, TTFT p50, slot and overhead time."""
    by = {(r["daemon"], r["max_tokens"], r["concurrency"], r["drafter"]): r for r in rows}

    def ratio(a: float | None, b: float | None) -> str:
        return fmt(a / b) if a is not None and b else "-"

    out = []
    for (daemon, n, c, d), r in by.items():
        if daemon in others and (base, n, c, d) in by:
            b = by[(base, n, c, d)]
            out.append([daemon, str(n), d, str(c), ratio(r["tokens_per_s"], b["tokens_per_s"]),
                        ratio(r["ttft_p50_ms"], b["ttft_p50_ms"]), ratio(r["slot_ms"], b["slot_ms"]),
                        ratio(r["overhead_ms_per_slot"], b["overhead_ms_per_slot"])])
    return format_table(f"Side by side: each daemon / {base} (same level, same run)",
                        ["daemon", "max tok", "drafter", "conc", "tok/s", "TTFT p50", "slot ms", "overhead/slot"], out)


# ---- a daemon of our own ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the daemon drains), then SIGKILL its process group if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group is the daemon and its workers
        proc.wait()


@contextmanager
def local_daemon(options: list[str]) -> Iterator[str]:
    """`spind start` on free ports in a private run dir; yields its base URL; stops it on the way out."""
    run_dir = tempfile.mkdtemp(prefix="spind-bench-")
    log_path = os.path.join(run_dir, "daemon.log")
    port = free_port()
    argv = [sys.executable, "-m", "spind.cli", "start", "--run-dir", run_dir, "--port", str(port),
            "--zmq-port", str(free_port()), *options]
    url = f"http://127.0.0.1:{port}"
    print(f"starting the daemon: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_json(url + "/health", timeout=2.0)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    tail = "\n".join(f.read().splitlines()[-10:])
                raise ValueError(f"the daemon did not come up (exit code {proc.poll()}); its log:\n{tail}")
            time.sleep(0.25)
        print(f"daemon up at {url} (pid {proc.pid})", file=sys.stderr, flush=True)
        yield url
    finally:
        _stop(proc)
        shutil.rmtree(run_dir, ignore_errors=True)
