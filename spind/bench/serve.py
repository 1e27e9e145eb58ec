"""`spind bench serve`: time to first token and tokens/s of the real daemon per drafter and concurrency, beside
any OpenAI-compatible server (vLLM, llama.cpp server, SGLang) in the same run.

Closed loop over the OpenAI-compatible streaming API: at concurrency C, C clients each send their next request
as soon as their previous one finishes. A level is an (output length, concurrency); levels run in order, and at
each level every drafter runs in turn on every spind daemon (the request's `"spind": {"drafter": ...}`), then
every peer once (it has one mode; its rows' drafter is `peer`), with the same client code, so that all servers
see the same machine state. Per request: TTFT (first non-empty content chunk), end-to-end latency, completion
tokens (the usage chunk), the output text and spind's mean accepted length. The coordinator's overhead per time
slot, and the workers' prefill and verify time per slot (where a slot goes as load grows: at many clients the
newcomers' prefill takes a growing share), come from the `slots` counters of /v1/spind/state, read before and after
each spind level; a peer is only asked for /v1/models (its model name, sent as "model": vLLM rejects another).

Prompts, fair to servers that cache across requests (vLLM's prefix cache; its suffix decoding drafts a response
it has seen before almost perfectly): every level takes its own disjoint slice of the prompt list, and prompt 0
serves only the warm-up requests, so no server sees a prompt twice in a run. Within a level every spind drafter
and every peer get the same slice, so that their rows compare like for like; spind's drafters keep finished
requests' sequences (suffix decoding drafts from them), so before each spind row the bench empties them (POST
/v1/spind/reset_cache): otherwise a drafter run after `none` would draft `none`'s answers to the very same
prompts (that made `auto` read 1.4-2x `none` at 1-4 clients where it is not). A dataset with fewer prompts than the
run needs (the sum of requests per level, + 1) is an error, never a silent repeat. A run's prompts depend only on
the settings, so restart a caching peer between runs (or change --seed of --dataset mix).

Greedy decoding does not depend on the drafter: at temperature 0 each spind drafter's outputs are compared with
the `none` drafter's on the same prompts (`same_as_none`, "equal/compared").

Quiet start: a server keeps a core busy for a while after its last request (vLLM's CPU build spins one core for
~1-1.5 s), so each row waits until the machine's CPUs are idle (`wait_for_quiet`, /proc/stat) before its first
request. Without it, the spind row after a vLLM row ran ~8% slower at 8 and 16 clients than the same drafter second
in the row order (Zen 4, 2 cores): `auto` read 1.07-1.09x `none` in one order and 0.91-0.92x in the other.

Noise: a shared VM's speed drifts by 5-25% from one minute to the next, more than the effects worth measuring.
`--repeats N` runs each level N times in a row, each run with its own prompts (for the caches, as above) and every
row of the level in it, so a row and the rows it is compared with always ran on the same prompts minutes apart;
odd runs take the rows in reverse order (`run_order`), so with an even N no row is always first or last. A
ratio (`x none`, spind against a peer) is then taken within each run and its median over the runs reported
(`medians`, with the runs' least and greatest), which cancels the drift a median of each row's tokens/s alone
would keep.
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
from pathlib import Path

import aiohttp

from spind.bench.datasets import Prompt, load_prompts, sample_workload
from spind.bench.report import Progress, fmt, format_table
from spind.client import http_json
from spind.state import SpindState, decode_state

PLAIN = "none"
PEER = "peer"  # the drafter of a peer's rows: a peer runs in its one mode
MIX_DATASET = "mix"  # --dataset mix: a seeded draw over datasets.MIX
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
    seed: int = 0  # of the mix's draw; a named dataset takes evenly spaced records
    repeats: int = 1  # runs of each level, each on its own prompts (ratios: the median of the runs')
    quiet_timeout_s: float = 15.0  # the most a row waits for the machine to be idle before it starts (0: not at all)
    system_prompt: str = ""  # a system message before every chat prompt (an application's: what prefix caches reuse)

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(4, 2 * concurrency)


@dataclass(frozen=True)
class Level:
    """One row of the bench: a server (spind daemon or peer), an output length, a number of clients, a drafter."""

    daemon: str
    max_tokens: int
    concurrency: int
    drafter: str
    repeat: int = 0  # which run of the level (--repeats)

    @property
    def is_peer(self) -> bool:
        return self.drafter == PEER


@dataclass(kw_only=True)
class RequestRecord:
    daemon: str
    max_tokens: int
    drafter: str
    concurrency: int
    index: int  # into the level's prompts: the same index is the same prompt for every drafter and peer
    repeat: int = 0  # the run of the level: each has its own prompts
    sent_s: float = 0.0  # when it was sent, seconds into its level (its ttft_s and latency_s count from then)
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    time_slots: int = 0
    mean_accepted_length: float = 0.0
    error: str | None = None
    output: str = ""  # the streamed text, for the identity check against `none`
    schema_valid: bool | None = None  # a prompt with a schema: the output parses and follows it


# ---- prompts (pure) ---------------------------------------------------------------------------------------
def prompt_slices(settings: ServeSettings) -> dict[tuple[int, int, int], range]:
    """{(max_tokens, concurrency, repeat): indices into the prompt list}: consecutive, disjoint, in run order,
    after prompt 0 (the warm-up's)."""
    out, start = {}, 1
    for n in settings.max_tokens:
        for c in settings.concurrency:
            for rep in range(settings.repeats):
                out[(n, c, rep)] = range(start, start + settings.requests_at(c))
                start += settings.requests_at(c)
    return out


def prompts_needed(settings: ServeSettings) -> int:
    return 1 + sum(len(r) for r in prompt_slices(settings).values())


def check_prompts(settings: ServeSettings, prompts: list[Prompt]) -> None:
    need = prompts_needed(settings)
    if len(prompts) < need:
        raise ValueError(
            f"the run needs {need} prompts and --dataset {settings.dataset} has {len(prompts)}: every level "
            f"(max tokens x concurrency) takes its own, so that servers caching earlier prompts or responses never "
            f"see one twice, + 1 for the warm-up; lower --num-requests, run fewer levels or take a larger dataset "
            f"(alpaca has 5000)")


def load_serve_prompts(settings: ServeSettings, datasets_dir: Path) -> list[Prompt]:
    """The run's prompts: `mix` drawn by seed, a named dataset evenly spread; too few raise ValueError."""
    need = prompts_needed(settings)
    prompts = (sample_workload(MIX_DATASET, need, settings.seed, datasets_dir) if settings.dataset == MIX_DATASET
               else load_prompts(settings.dataset, need, datasets_dir))
    check_prompts(settings, prompts)
    return prompts


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


def _busy_ms_per_slot(before: dict, after: dict, kind: str, num_slots: int) -> float | None:
    """The workers' busy ms of `kind` per slot between two reads of the `slots` entry (None: no slots, or a daemon
    that does not report busy time)."""
    if not num_slots or "busy_s" not in after:
        return None
    return (after["busy_s"].get(kind, 0.0) - before.get("busy_s", {}).get(kind, 0.0)) * 1e3 / num_slots


def summarize(level: Level, records: list[RequestRecord], wall_s: float, slots_before: dict,
              slots_after: dict) -> dict:
    """One summary row of a level; failed requests are counted, not measured. A peer has no slot counters (pass
    {}) and no accepted lengths: those fields are None."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    steps = sum(r.time_slots for r in ok)
    ttfts_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    (n0, slot0, over0), (n1, slot1, over1) = _slot_totals(slots_before), _slot_totals(slots_after)
    num_slots = n1 - n0
    checked = [r.schema_valid for r in ok if r.schema_valid is not None]
    grammar_tokens = slots_after.get("grammar_tokens", 0) - slots_before.get("grammar_tokens", 0)
    grammar_ms = (slots_after.get("grammar_s", 0.0) - slots_before.get("grammar_s", 0.0)) * 1e3
    return {
        "daemon": level.daemon, "max_tokens": level.max_tokens, "drafter": level.drafter,
        "concurrency": level.concurrency, "repeat": level.repeat, "num_requests": len(records),
        "num_errors": len(records) - len(ok), "completion_tokens": tokens, "wall_s": wall_s,
        # the share of prompt tokens the server's prefix cache held (None where it does not say)
        "cached_share": _cached_share(ok),
        "ttft_p50_ms": percentile(ttfts_ms, 0.5), "ttft_p90_ms": percentile(ttfts_ms, 0.9),
        "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "busy_tokens_per_s": busy_tokens_per_s(records, level.concurrency),
        "request_tokens_per_s_p50": percentile([r.completion_tokens / r.latency_s for r in ok if r.latency_s > 0],
                                               0.5),
        # weighted by time slots: committed tokens per verification over the whole level
        "mean_accepted_length": sum(r.mean_accepted_length * r.time_slots for r in ok) / steps if steps else None,
        "num_slots": num_slots,
        "slot_ms": (slot1 - slot0) / num_slots if num_slots else None,
        "overhead_ms_per_slot": (over1 - over0) / num_slots if num_slots else None,
        # the target's prefill and verify (summed over workers by kind) per slot: where a slot's time goes
        "prefill_ms_per_slot": _busy_ms_per_slot(slots_before, slots_after, "prefill", num_slots),
        "verify_ms_per_slot": _busy_ms_per_slot(slots_before, slots_after, "verify", num_slots),
        "speedup_vs_none": None,
        "same_as_none": None,
        # structured output: outputs that follow their schema, and the target's grammar work per committed token
        "schema_valid": f"{sum(checked)}/{len(checked)}" if checked else None,
        "grammar_ms_per_token": grammar_ms / grammar_tokens if grammar_tokens else None,
    }


def busy_tokens_per_s(records: list[RequestRecord], concurrency: int) -> float | None:
    """Tokens per second while every client had a request in flight: from when the last of the first `concurrency`
    requests was sent to when the level's last one was (past it a client that finishes finds no more work, and the
    level drains, its last requests running a few at a time). A level's `tokens_per_s` counts its whole wall time,
    the drain with it. With two requests a client the window is about the first wave, its prefills all at once; with
    many, the level's steady state. Each request's tokens are spread evenly over its decoding (first token to last),
    so the window counts a request's share of them; prefill inside the window is time without tokens, as it is. None
    where the level has no such window (no more requests than clients) or a request in it has no timing (a peer's
    stream without tokens)."""
    if len(records) <= concurrency:
        return None
    sent = sorted(r.sent_s for r in records)
    start, end = sent[concurrency - 1], sent[-1]
    if end <= start:
        return None
    tokens = 0.0
    for r in records:
        if r.error is not None or not r.completion_tokens:
            continue
        if r.ttft_s is None:
            return None
        first, last = r.sent_s + r.ttft_s, r.sent_s + r.latency_s
        if last <= first:  # one chunk: its tokens at once
            tokens += r.completion_tokens if start <= last <= end else 0
            continue
        inside = min(last, end) - max(first, start)
        if inside > 0:
            tokens += r.completion_tokens * inside / (last - first)
    return tokens / (end - start)


def _cached_share(ok: list[RequestRecord]) -> float | None:
    told = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in told)
    return sum(r.cached_tokens for r in told) / prompt if told and prompt else None


def _cell(r: dict) -> tuple:
    """A level's run: the rows that ran on the same prompts, one after another."""
    return r.get("daemon", ""), r.get("max_tokens", 0), r["concurrency"], r.get("repeat", 0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill `speedup_vs_none`: aggregate tokens/s over the `none` drafter's on the same daemon, output length and
    concurrency; and `busy_speedup_vs_none`, the same of `busy_tokens_per_s` (while every client is busy)."""
    plain = {_cell(r): r for r in rows if r["drafter"] == PLAIN}
    for r in rows:
        p = plain.get(_cell(r), {})
        r["speedup_vs_none"] = _ratio(r["tokens_per_s"], p.get("tokens_per_s"))
        r["busy_speedup_vs_none"] = _ratio(r.get("busy_tokens_per_s"), p.get("busy_tokens_per_s"))
    return rows


def add_identity(rows: list[dict], records: list[RequestRecord], temperature: float) -> list[dict]:
    """Fill `same_as_none` of each spind drafter's row but `none`'s: "equal/compared", its outputs equal to the
    `none` drafter's on the same prompt (same daemon and level), over the prompts both answered. Speculative
    decoding must not change a greedy output; at temperature > 0 the outputs are samples (None there)."""
    plain = {(r.daemon, r.max_tokens, r.concurrency, r.repeat, r.index): r.output
             for r in records if r.drafter == PLAIN and r.error is None}
    counts: dict[tuple, list[int]] = {}
    for r in records:
        key = (r.daemon, r.max_tokens, r.concurrency, r.repeat, r.index)
        if r.drafter not in (PLAIN, PEER) and r.error is None and key in plain:
            equal_compared = counts.setdefault((r.daemon, r.max_tokens, r.concurrency, r.repeat, r.drafter), [0, 0])
            equal_compared[0] += r.output == plain[key]
            equal_compared[1] += 1
    cells_with_none = {_cell(r) for r in rows if r["drafter"] == PLAIN}
    for row in rows:
        applicable = temperature == 0 and row["drafter"] not in (PLAIN, PEER) and _cell(row) in cells_with_none
        equal, compared = counts.get((*_cell(row), row["drafter"]), (0, 0))
        row["same_as_none"] = f"{equal}/{compared}" if applicable else None
    return rows


def versus_peers(rows: list[dict]) -> list[dict]:
    """Per spind daemon, level, run and peer: spind's plain decoding and its fastest drafter (`none` included)
    against the peer's tokens/s; ratios > 1: spind is faster."""
    peers = list(dict.fromkeys(r["daemon"] for r in rows if r["drafter"] == PEER))
    peer_tps = {_cell(r): r["tokens_per_s"] for r in rows if r["drafter"] == PEER}
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["drafter"] != PEER:
            cells.setdefault(_cell(r), []).append(r)
    out = []
    for (daemon, n, c, rep), at in cells.items():
        none_tps = next((r["tokens_per_s"] for r in at if r["drafter"] == PLAIN), None)
        best = max((r for r in at if r["tokens_per_s"] is not None), key=lambda r: r["tokens_per_s"], default=None)
        best_tps = best["tokens_per_s"] if best else None
        for peer in peers:
            tps = peer_tps.get((peer, n, c, rep))
            out.append({"daemon": daemon, "max_tokens": n, "concurrency": c, "repeat": rep, "peer": peer,
                        "none_tokens_per_s": none_tps, "best_drafter": best["drafter"] if best else None,
                        "best_tokens_per_s": best_tps, "peer_tokens_per_s": tps,
                        "none_over_peer": _ratio(none_tps, tps), "best_over_peer": _ratio(best_tps, tps)})
    return out


def _spread(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, least, greatest) of the known values."""
    known = [v for v in values if v is not None]
    return (percentile(known, 0.5), min(known), max(known)) if known else (None, None, None)


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per daemon, output length, concurrency and drafter over its runs (--repeats): the median of its
    tokens/s, TTFT and accepted length, and the median of `x none` taken within each run, with the runs' least and
    greatest; `same_as_none` summed over the runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["daemon"], r["max_tokens"], r["concurrency"], r["drafter"]), []).append(r)
    out = []
    for (daemon, n, c, drafter), runs in groups.items():
        tps, tps_lo, tps_hi = _spread([r["tokens_per_s"] for r in runs])
        x, x_lo, x_hi = _spread([r["speedup_vs_none"] for r in runs])
        bx, bx_lo, bx_hi = _spread([r.get("busy_speedup_vs_none") for r in runs])
        same = [r["same_as_none"] for r in runs if r["same_as_none"]]
        out.append({"daemon": daemon, "max_tokens": n, "concurrency": c, "drafter": drafter, "runs": len(runs),
                    "num_requests": sum(r["num_requests"] for r in runs),
                    "num_errors": sum(r["num_errors"] for r in runs),
                    "tokens_per_s": tps, "tokens_per_s_min": tps_lo, "tokens_per_s_max": tps_hi,
                    "ttft_p50_ms": _spread([r["ttft_p50_ms"] for r in runs])[0],
                    "latency_p50_s": _spread([r["latency_p50_s"] for r in runs])[0],
                    "mean_accepted_length": _spread([r["mean_accepted_length"] for r in runs])[0],
                    "slot_ms": _spread([r["slot_ms"] for r in runs])[0],
                    "overhead_ms_per_slot": _spread([r["overhead_ms_per_slot"] for r in runs])[0],
                    "prefill_ms_per_slot": _spread([r.get("prefill_ms_per_slot") for r in runs])[0],
                    "verify_ms_per_slot": _spread([r.get("verify_ms_per_slot") for r in runs])[0],
                    "speedup_vs_none": x, "speedup_vs_none_min": x_lo, "speedup_vs_none_max": x_hi,
                    "busy_tokens_per_s": _spread([r.get("busy_tokens_per_s") for r in runs])[0],
                    "busy_speedup_vs_none": bx, "busy_speedup_vs_none_min": bx_lo,
                    "busy_speedup_vs_none_max": bx_hi,
                    "same_as_none": (f"{sum(int(v.split('/')[0]) for v in same)}/"
                                     f"{sum(int(v.split('/')[1]) for v in same)}") if same else None})
    return out


def median_versus(entries: list[dict]) -> list[dict]:
    """`versus_peers` over the runs: per spind daemon, level and peer, the medians of the runs' tokens/s and of
    their ratios (each taken within a run), with the ratios' least and greatest."""
    groups: dict[tuple, list[dict]] = {}
    for e in entries:
        groups.setdefault((e["daemon"], e["max_tokens"], e["concurrency"], e["peer"]), []).append(e)
    out = []
    for (daemon, n, c, peer), runs in groups.items():
        best = [e["best_drafter"] for e in runs if e["best_drafter"]]
        row = {"daemon": daemon, "max_tokens": n, "concurrency": c, "peer": peer, "runs": len(runs),
               "best_drafter": max(set(best), key=best.count) if best else None}
        for key in ("none_tokens_per_s", "best_tokens_per_s", "peer_tokens_per_s"):
            row[key] = _spread([e[key] for e in runs])[0]
        for key in ("none_over_peer", "best_over_peer"):
            row[key], row[key + "_min"], row[key + "_max"] = _spread([e[key] for e in runs])
        out.append(row)
    return out


QUIET_BUSY = 0.15  # the machine is quiet when its CPUs are busy less than this share of a window
QUIET_WINDOW_S = 0.25


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]  # user .. steal: guest time is counted in user
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def wait_for_quiet(timeout_s: float, sample=cpu_times, window_s: float = QUIET_WINDOW_S,
                         busy_below: float = QUIET_BUSY) -> float:
    """Wait until a window of `window_s` has the CPUs busy under `busy_below` of the time (the server benched last
    has let go of its cores), at most `timeout_s`; returns the seconds waited. Without /proc/stat, returns at once."""
    start = time.perf_counter()
    before = sample()
    while before is not None and time.perf_counter() - start < timeout_s:
        await asyncio.sleep(window_s)
        after = sample()
        if after is None:
            break
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below:
            break
        before = after
    return time.perf_counter() - start


# ---- the clients --------------------------------------------------------------------------------------
async def send_request(session: aiohttp.ClientSession, url: str, prompt: Prompt, drafter: str | None,
                       settings: ServeSettings, rec: RequestRecord, model: str | None = None) -> RequestRecord:
    """One streamed request; fills `rec` (its `error` on failure, never raises for a failed request). `drafter`
    None: a peer's request (no "spind" field), which names its `model`."""
    body: dict = {"max_tokens": rec.max_tokens, "temperature": settings.temperature,
                  "ignore_eos": settings.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if prompt.schema:  # structured output: the output ends where its JSON does (ignore_eos cannot go with it)
        spec = {"name": prompt.category or "extract", "schema": json.loads(prompt.schema)}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
        body["ignore_eos"] = False
    if drafter is not None:
        body["spind"] = {"drafter": drafter}
    if model is not None:
        body["model"] = model
    if prompt.is_chat:
        system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
        path, body["messages"] = "/v1/chat/completions", [*system, {"role": "user", "content": prompt.text}]
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
    if prompt.schema and rec.error is None:
        rec.schema_valid = follows_schema(rec.output, prompt.schema)
    return rec


def follows_schema(text: str, schema: str) -> bool:
    """The output is one JSON value that validates against the schema (given as JSON)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _read_stream(resp: aiohttp.ClientResponse, is_chat: bool, start: float, rec: RequestRecord) -> None:
    """Server-sent events: TTFT at the first non-empty text; latency, counts and spind's usage at the usage
    chunk (the last before [DONE]; the stream is still read to its end); in-band errors."""
    parts: list[str] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            err = chunk["error"]
            rec.error = str(err.get("message") if isinstance(err, dict) else err)
            break
        choices = chunk.get("choices") or [{}]  # servers differ on the usage chunk: no choices, or []
        text = (choices[0].get("delta") or {}).get("content") if is_chat else choices[0].get("text")
        if text:
            parts.append(text)
            if rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - start
        if chunk.get("usage"):
            spind = chunk.get("spind") or {}
            usage = chunk["usage"]
            rec.completion_tokens = usage["completion_tokens"]
            rec.prompt_tokens = usage.get("prompt_tokens") or 0
            details = usage.get("prompt_tokens_details")  # OpenAI's; vLLM sends it where enabled, else null
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                rec.cached_tokens = details["cached_tokens"]
            rec.time_slots = spind.get("time_slots", 0)
            rec.mean_accepted_length = spind.get("mean_accepted_length", 0.0)
            rec.latency_s = time.perf_counter() - start
    rec.output = "".join(parts)
    if not rec.latency_s and rec.error is None:
        rec.error = "the stream ended without a usage chunk"


async def _state(session: aiohttp.ClientSession, url: str) -> SpindState:
    async with session.get(url + "/v1/spind/state") as resp:
        resp.raise_for_status()
        return decode_state(await resp.read())


async def reset_cache(session: aiohttp.ClientSession, url: str) -> bool:
    """Empty a spind daemon's cross-request drafter caches; False where the daemon has no such endpoint (a
    release before it: its rows after the first on a slice may draft earlier rows' answers)."""
    async with session.post(url + "/v1/spind/reset_cache") as resp:
        if resp.status == 404:
            return False
        if resp.status != 200:
            text = (await resp.text())[:200]
            raise ValueError(f"POST {url}/v1/spind/reset_cache answered HTTP {resp.status}: {text}")
        return True


async def run_level(session: aiohttp.ClientSession, url: str, prompts: list[Prompt], level: Level,
                    settings: ServeSettings, progress: Progress, model: str | None = None
                    ) -> tuple[dict, list[RequestRecord]]:
    """The level's requests over its own `prompts` (request i sends prompts[i]); a peer's level (`model` its
    name) reads no slot counters."""
    todo = iter(range(settings.requests_at(level.concurrency)))  # shared by the clients: each takes the next index
    records: list[RequestRecord] = []

    async def client() -> None:
        for i in todo:
            rec = RequestRecord(daemon=level.daemon, max_tokens=level.max_tokens, drafter=level.drafter,
                                concurrency=level.concurrency, index=i, repeat=level.repeat,
                                sent_s=time.perf_counter() - start)
            rec = await send_request(session, url, prompts[i], None if level.is_peer else level.drafter, settings, rec,
                                     model)
            records.append(rec)
            progress.step(f"{_label(level, settings.repeats)} #{i}: " +
                          (f"error {rec.error}" if rec.error else
                           f"{rec.completion_tokens} tokens, ttft {fmt(rec.ttft_s)}s, {rec.latency_s:.2f}s"))

    before = {} if level.is_peer else (await _state(session, url)).slots
    start = time.perf_counter()  # the clients' records count from here (`sent_s`)
    await asyncio.gather(*(client() for _ in range(level.concurrency)))
    wall_s = time.perf_counter() - start
    after = {} if level.is_peer else (await _state(session, url)).slots
    return summarize(level, records, wall_s, before, after), records


async def _check_daemon(session: aiohttp.ClientSession, label: str, url: str, prompt: Prompt,
                        settings: ServeSettings) -> str:
    state = await _state(session, url)
    unknown = set(settings.drafters) - {"auto", PLAIN, *state.drafters}
    if unknown:
        raise ValueError(f"daemon {label} has no drafter {', '.join(sorted(unknown))}; it has: "
                         f"auto, {PLAIN}, {', '.join(state.drafters)}")
    for d in settings.drafters:  # the first forwards of each model, not timed
        rec = RequestRecord(daemon=label, max_tokens=4, drafter=d, concurrency=0, index=-1)
        rec = await send_request(session, url, prompt, d, settings, rec)
        if rec.error:
            raise ValueError(f"warm-up request to {label} with drafter {d} failed: {rec.error}")
    return state.model


def first_model(name: str, url: str, body: object) -> str:
    """The served model's name from a GET /v1/models body: the first `data[].id`."""
    data = body.get("data") if isinstance(body, dict) else None
    model = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if not isinstance(model, str) or not model:
        raise ValueError(f"peer {name} lists no model at {url}/v1/models (got {json.dumps(body)[:200]})")
    return model


async def _check_peer(session: aiohttp.ClientSession, name: str, url: str, prompt: Prompt,
                      settings: ServeSettings) -> str:
    """The peer's model name, after one untimed request (its first forwards, a compile on vLLM's first call)."""
    try:
        async with session.get(url + "/v1/models") as resp:
            status, text = resp.status, await resp.text()
    except (TimeoutError, aiohttp.ClientError) as e:
        raise ValueError(f"peer {name}: nothing answers at {url}/v1/models ({type(e).__name__}: {e})") from None
    if status != 200:
        raise ValueError(f"peer {name}: GET {url}/v1/models answered HTTP {status}: {text[:200]}")
    try:
        body: object = json.loads(text)
    except ValueError:
        body = text
    model = first_model(name, url, body)
    rec = RequestRecord(daemon=name, max_tokens=4, drafter=PEER, concurrency=0, index=-1)
    rec = await send_request(session, url, prompt, None, settings, rec, model)
    if rec.error:
        raise ValueError(f"warm-up request to peer {name} (model {model!r}) failed: {rec.error}")
    return model


def run_order(rows: list[Level], repeat: int) -> list[Level]:
    """A run's rows in the order they run: as listed in even runs, reversed in odd ones (A B, B A, ...), so that
    over an even number of runs each row runs first as often as last and a steady drift (a VM slowing for
    minutes, a server's caches warming) weighs on both sides of a ratio alike."""
    return rows[::-1] if repeat % 2 else rows


async def run_serve_bench(daemons: dict[str, str], prompts: list[Prompt], settings: ServeSettings,
                          headers: dict[str, str] | None = None, peers: dict[str, str] | None = None) -> dict:
    """Every level on every spind daemon and peer ({label: base URL}), interleaved so that all see the same
    machine load, `settings.repeats` times in a row; `prompts` as `prompt_slices` lays them out. Returns the
    JSON-ready results."""
    peers = peers or {}
    check_prompts(settings, prompts)
    slices = prompt_slices(settings)
    levels = [lv for n in settings.max_tokens for c in settings.concurrency for rep in range(settings.repeats)
              for lv in run_order([*(Level(label, n, c, d, rep) for d in settings.drafters for label in daemons),
                                   *(Level(name, n, c, PEER, rep) for name in peers)], rep)]
    progress = Progress(total=sum(settings.requests_at(lv.concurrency) for lv in levels))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # spind's API key goes to spind only: a peer gets a session without it
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as spind_session, \
            aiohttp.ClientSession(timeout=timeout) as peer_session:
        models = {label: await _check_daemon(spind_session, label, url, prompts[0], settings)
                  for label, url in daemons.items()}
        models |= {name: await _check_peer(peer_session, name, url, prompts[0], settings)
                   for name, url in peers.items()}
        resets = {label: await reset_cache(spind_session, url) for label, url in daemons.items()}
        for label in (label for label, ok in resets.items() if not ok):
            print(f"warning: daemon {label} cannot reset its drafters' caches (no POST /v1/spind/reset_cache): its "
                  "rows after the first at each level may draft earlier rows' answers to the same prompts",
                  file=sys.stderr)
        rows, records = [], []
        for level in levels:
            session, url = (peer_session, peers[level.daemon]) if level.is_peer else \
                (spind_session, daemons[level.daemon])
            if not level.is_peer and resets[level.daemon]:
                await reset_cache(session, url)
            settle_s = await wait_for_quiet(settings.quiet_timeout_s)
            if settings.quiet_timeout_s > 0 and settle_s >= settings.quiet_timeout_s:
                progress.note(f"{_label(level, settings.repeats)}: the CPUs stayed busy for {settle_s:.0f} s (another "
                              "process?); it starts anyway, its figures shared the machine")
            level_prompts = [prompts[i] for i in slices[(level.max_tokens, level.concurrency, level.repeat)]]
            row, recs = await run_level(session, url, level_prompts, level, settings, progress,
                                        models[level.daemon] if level.is_peer else None)
            row["settle_s"] = settle_s
            rows.append(row)
            records += recs
            progress.note(f"{_label(level, settings.repeats)}: "
                          f"{fmt(row['tokens_per_s'], 1)} tokens/s, ttft p50 {fmt(row['ttft_p50_ms'], 0)} ms, "
                          f"slot {fmt(row['slot_ms'], 1)} ms, {row['num_errors']} errors")
    rows = add_identity(add_ratios(rows), records, settings.temperature)
    versus = versus_peers(rows)
    return {"settings": asdict(settings), "daemons": daemons, "peers": peers, "models": models, "cache_reset": resets,
            "cpu_count": os.cpu_count(), "rows": rows, "medians": median_rows(rows), "versus_peers": versus,
            "versus_medians": median_versus(versus), "requests": [asdict(r) for r in records]}


def _label(level: Level, repeats: int) -> str:
    """A row's name in the progress lines."""
    run = f" run {level.repeat + 1}/{repeats}" if repeats > 1 else ""
    return f"{level.daemon} {level.drafter} c={level.concurrency} n={level.max_tokens}{run}"


def render_table(results: dict) -> str:
    s = results["settings"]
    dataset = f"{s['dataset']} (seed {s['seed']})" if s["dataset"] == MIX_DATASET else s["dataset"]
    title = (f"Serving: {dataset} prompts{' (ignore_eos)' if s['ignore_eos'] else ''}, temperature "
             f"{s['temperature']}, closed-loop clients")
    repeats = s.get("repeats", 1)
    header = ["daemon", "max tok", "drafter", "conc", *(["run"] if repeats > 1 else []), "reqs", "err", "TTFT p50 ms",
              "TTFT p90 ms", "cached %", "lat p50 s", "lat p90 s", "tok/s", "tok/s all busy", "tok/s/req p50",
              "acc len", "slot ms", "prefill ms/slot", "verify ms/slot", "overhead ms/slot", "x none",
              "x none all busy", "= none"]
    rows = [[r["daemon"], str(r["max_tokens"]), r["drafter"], str(r["concurrency"]),
             *([str(r.get("repeat", 0) + 1)] if repeats > 1 else []), str(r["num_requests"]),
             str(r["num_errors"]), fmt(r["ttft_p50_ms"], 0), fmt(r["ttft_p90_ms"], 0),
             fmt(None if r.get("cached_share") is None else 100 * r["cached_share"], 1), fmt(r["latency_p50_s"]),
             fmt(r["latency_p90_s"]), fmt(r["tokens_per_s"], 1), fmt(r.get("busy_tokens_per_s"), 1),
             fmt(r["request_tokens_per_s_p50"], 1), fmt(r["mean_accepted_length"]), fmt(r["slot_ms"], 1),
             fmt(r.get("prefill_ms_per_slot"), 1), fmt(r.get("verify_ms_per_slot"), 1),
             fmt(r["overhead_ms_per_slot"], 3), fmt(r["speedup_vs_none"]), fmt(r.get("busy_speedup_vs_none")),
             r["same_as_none"] or "-"]
            for r in results["rows"]]
    if any(r.get("schema_valid") for r in results["rows"]):
        header += ["valid", "grammar ms/tok"]
        for line, r in zip(rows, results["rows"]):
            line += [r.get("schema_valid") or "-", fmt(r.get("grammar_ms_per_token"), 3)]
    tables = [format_table(title, header, rows)]
    if repeats > 1:
        tables.append(medians_table(results["medians"], repeats))
    labels = list(results["daemons"])
    if len(labels) > 1:
        tables.append(compare_table(results["rows"], labels[0], labels[1:]))
    versus = results["versus_medians"] if repeats > 1 else results["versus_peers"]
    if versus:
        tables.append(versus_table(versus))
    return "\n\n".join(tables)


def medians_table(medians: list[dict], repeats: int) -> str:
    """`median_rows`: each row's median over the runs, and its ratio to `none` taken within each run."""
    rows = [[r["daemon"], str(r["max_tokens"]), r["drafter"], str(r["concurrency"]), str(r["runs"]),
             str(r["num_errors"]), fmt(r["ttft_p50_ms"], 0), fmt(r["tokens_per_s"], 1),
             _range(r, "tokens_per_s", 1) or "-", fmt(r["mean_accepted_length"]), fmt(r["speedup_vs_none"]),
             _range(r, "speedup_vs_none") or "-", fmt(r.get("busy_speedup_vs_none")),
             _range(r, "busy_speedup_vs_none") or "-", r["same_as_none"] or "-"] for r in medians]
    return format_table(f"Medians over {repeats} runs (each run its own prompts; x none taken within each run)",
                        ["daemon", "max tok", "drafter", "conc", "runs", "err", "TTFT p50 ms", "tok/s",
                         "tok/s range", "acc len", "x none", "x none range", "x none all busy",
                         "x none all busy range", "= none"], rows)


def compare_table(rows: list[dict], base: str, others: list[str]) -> str:
    """Each daemon against the first, level by level: ratios of tokens/s, TTFT p50, slot and overhead time, each
    taken within a run (--repeats: the median of the runs' ratios)."""
    by = {(r["daemon"], r["max_tokens"], r["concurrency"], r["drafter"], r.get("repeat", 0)): r for r in rows}
    keys = ("tokens_per_s", "ttft_p50_ms", "slot_ms", "overhead_ms_per_slot")
    ratios: dict[tuple, list[list[float | None]]] = {}
    for (daemon, n, c, d, rep), r in by.items():
        b = by.get((base, n, c, d, rep))
        if daemon in others and b is not None:
            ratios.setdefault((daemon, n, c, d), []).append([_ratio(r[k], b[k]) for k in keys])
    out = [[daemon, str(n), d, str(c), *(fmt(_spread([run[i] for run in runs])[0]) for i in range(len(keys)))]
           for (daemon, n, c, d), runs in ratios.items()]
    return format_table(f"Side by side: each daemon / {base} (same level, same run)",
                        ["daemon", "max tok", "drafter", "conc", "tok/s", "TTFT p50", "slot ms", "overhead/slot"], out)


def versus_table(entries: list[dict]) -> str:
    """`versus_peers` as one line per spind daemon and level, a group of columns per peer."""
    peers = list(dict.fromkeys(e["peer"] for e in entries))
    lines: dict[tuple, list[str]] = {}
    for e in entries:
        line = lines.setdefault((e["daemon"], e["max_tokens"], e["concurrency"]), [
            e["daemon"], str(e["max_tokens"]), str(e["concurrency"]), fmt(e["none_tokens_per_s"], 1),
            e["best_drafter"] or "-", fmt(e["best_tokens_per_s"], 1)])
        line += [fmt(e["peer_tokens_per_s"], 1), _with_range(e, "none_over_peer"), _with_range(e, "best_over_peer")]
    header = ["spind", "max tok", "conc", "none tok/s", "best", "best tok/s",
              *(col for p in peers for col in (f"{p} tok/s", f"none/{p}", f"best/{p}"))]
    return format_table("spind vs peers: tokens/s, same prompts in the same run (ratios > 1: spind is faster)",
                        header, list(lines.values()))


def _range(r: dict, key: str, digits: int = 2) -> str | None:
    """"least-greatest" of a median over runs (its `_min` and `_max`); None where they are unknown."""
    lo, hi = r.get(key + "_min"), r.get(key + "_max")
    return None if lo is None else f"{fmt(lo, digits)}-{fmt(hi, digits)}"


def _with_range(e: dict, key: str) -> str:
    """A ratio, and the runs' range where it is a median over several."""
    spread = _range(e, key) if e.get("runs", 1) > 1 else None
    return fmt(e[key]) + (f" ({spread})" if spread else "")


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
