"""What the machine's models cost, as the coordinator plans with it: each drafter's ms per draft token and
the target's verify latency per batch size, with k + 1 tokens per request and with one (plain decoding): the
points the selection's verify-cost model starts from (`selection/cost.py`). Measured by the workers themselves
(`Profile` op) the first time something needs it, then cached on disk under a key of everything that changes
the numbers (model, dtype, devices by name, threads, drafters, k), so later starts read it in milliseconds.
`[runtime].profile` = "auto" (the cache, else measure), "measure" (always), "off" (never: what needs it falls
back to config order)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig
from spind.coordinator.placement import verify_threads
from spind.progress import about, say

log = logging.getLogger(__name__)

PROFILE_VERSION = 5  # 5: forwards with one request drafting 1..k tokens (`lone_verify_ms`)
CONTEXT = 128  # tokens of KV each probe request holds
REPS = 3
LONE_REPS = 7  # the forwards with one request drafting: their steps span a token, not B k, so they read a forward's
#                noise B k times as loud (at B = 16, the chord over k = 4 from medians of 3 was seen 0.6-1.0 ms a token)
PROFILE_S = 3  # what profiling the default model and its drafters takes on 2 cores (said before it starts)


@dataclass
class SystemProfile:
    k: int
    draft_ms_per_token: dict[str, float]  # drafter -> ms per draft token at batch 1
    verify_ms: dict[int, float]  # batch size -> ms of one verify forward of k + 1 tokens per request
    measured_at: float = 0.0
    decode_ms: float | None = None  # ms of the target's 1-token step at batch 1 (plain decoding)
    decode_batch_ms: dict[int, float] = field(default_factory=dict)  # batch size -> ms of a 1-token step
    # batch size -> [ms of a forward in which one request carries n + 1 tokens and the others one each, n = 1..k]:
    # what one request's drafts add to a batch that decodes plainly, token by token, which selection prices (cost.py)
    lone_verify_ms: dict[int, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "verify_ms": {str(b): ms for b, ms in self.verify_ms.items()},
                "decode_batch_ms": {str(b): ms for b, ms in self.decode_batch_ms.items()},
                "lone_verify_ms": {str(b): list(ms) for b, ms in self.lone_verify_ms.items()}}

    @classmethod
    def from_json(cls, raw: dict) -> "SystemProfile":
        decode = raw.get("decode_ms")
        return cls(int(raw["k"]), {str(n): float(v) for n, v in raw["draft_ms_per_token"].items()},
                   {int(b): float(v) for b, v in raw["verify_ms"].items()}, float(raw.get("measured_at", 0.0)),
                   None if decode is None else float(decode),
                   {int(b): float(v) for b, v in raw.get("decode_batch_ms", {}).items()},
                   {int(b): [float(x) for x in v] for b, v in raw.get("lone_verify_ms", {}).items()})

    def verify_points(self) -> list[tuple[int, int, float]]:
        """(requests, tokens, seconds) of every verify forward measured: the verify-cost model's prior."""
        return ([(b, b * (self.k + 1), ms / 1e3) for b, ms in self.verify_ms.items()]
                + [(b, b, ms / 1e3) for b, ms in self.decode_batch_ms.items()]
                + [(b, b + n, ms / 1e3) for b, row in self.lone_verify_ms.items() for n, ms in enumerate(row, 1)])

    def dominated_drafters(self, min_k: int) -> list[str]:
        """Drafters that cannot beat plain decoding whatever they draft. A request's slot with drafter j at draft
        length k commits at most k + 1 tokens and needs k draft tokens, which take k * d_j even when drafting
        overlaps verification completely (the pipeline), while plain decoding makes k + 1 tokens in
        (k + 1) * decode. So j can never pay at any k >= min_k when k * d_j >= (k + 1) * decode there, i.e.
        d_j >= decode * (min_k + 1) / min_k. Measured at batch 1 (drafter and target batch alike), each on its
        worker's own threads. A 4-bit target on a CPU makes the int8 and bf16 self-drafts of the
        same model such drafters; LBSS leaves them out rather than pay to explore them."""
        if not self.decode_ms:
            return []
        bound = self.decode_ms * (min_k + 1) / min_k
        return sorted(n for n, ms in self.draft_ms_per_token.items() if ms >= bound)

    def implausible(self, slack: float = 1.5) -> str | None:
        """Why these numbers cannot be the machine's own, or None. A forward of B requests' tokens never costs
        more than plain decoding's batch-1 steps of those tokens one by one, unless other work took the cores
        while it was timed (seen: a verify of 5 tokens timed at 21 decode steps while training shared the
        machine; cached, that profile kept LBSS from speculating at all, run after run)."""
        if not self.decode_ms:
            return None
        for b, tokens, seconds in self.verify_points():
            one_by_one = tokens * self.decode_ms
            if seconds * 1e3 > slack * one_by_one:
                return (f"a forward of {b} requests and {tokens} tokens took {seconds * 1e3:.1f} ms, more than "
                        f"{slack}x the {one_by_one:.1f} ms of {tokens} single-token steps")
        return None


def batch_sizes(max_batch: int) -> list[int]:
    """Powers of two up to the batch limit, and the limit itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def probe_context(max_model_len: int, k: int) -> int:
    """KV tokens each probe request holds: CONTEXT, or less where the context limit leaves no room for the
    k + 1 verified tokens after it (a small max_model_len is a valid config, not a reason to fail at start)."""
    return max(1, min(CONTEXT, max_model_len - (k + 1)))


@functools.cache
def kernels_digest() -> str:
    """A digest of spind's CPU kernel sources (new kernels, new costs), read without importing them (no torch
    here), and the build `SPIND_CPU_ISA` forces, if any."""
    spec = importlib.util.find_spec("spind.kernels")
    digest = hashlib.sha256(os.environ.get("SPIND_CPU_ISA", "").encode())
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted((Path(folder) / "csrc").glob("*")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def served_context(cfg: SpindConfig, pool) -> int:
    """The longest sequence the target serves: [model].max_model_len, or less where the model caps it (a sliding
    window spind keeps from binding, spind/models/layers.py)."""
    return pool.info(TARGET_WORKER).max_model_len or cfg.model.max_model_len  # the worker reports the smaller


def _config_fields(cfg: SpindConfig) -> dict:
    """What a profile depends on that the config alone says (no worker needed to know it)."""
    return {"version": PROFILE_VERSION, "kernels": kernels_digest(), "model": cfg.model.target,
            "dtype": cfg.model.dtype, "k": cfg.speculation.k, "attention": cfg.runtime.attention,
            "batch": batch_sizes(cfg.runtime.max_batch_size), "drafters": [asdict(d) for d in cfg.drafters]}


def profile_fields(cfg: SpindConfig, workers: list[dict], max_model_len: int) -> dict:
    """Everything that changes a profile's numbers: the config's part, the probe context, and the workers as they
    reported themselves (devices by name, dtype, threads, and a tensor-parallel target's ranks: a split target's
    forwards cost what one process's do not)."""
    workers_ = sorted([w["name"], w["device"], w.get("device_name", ""), w.get("dtype", ""), w["threads"]]
                      + ([f"ranks {' + '.join(w['ranks'])}"] if w.get("ranks") else []) for w in workers)
    return {**_config_fields(cfg), "context": probe_context(max_model_len, cfg.speculation.k), "workers": workers_,
            "target_threads": verify_threads(cfg, next((w["device"] for w in workers if w["name"] == TARGET_WORKER),
                                                       "cpu"))}


def profile_key(cfg: SpindConfig, workers: list[dict], max_model_len: int) -> str:
    return _digest(profile_fields(cfg, workers, max_model_len))


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def find_cached(cfg: SpindConfig) -> tuple[Path, SystemProfile] | None:
    """The newest cached profile of this config (model, dtype, drafters, k, kernels) on this machine, whatever its
    workers' threads: what `spind drafters` shows without loading a model. None when no start has profiled it."""
    want, found = json.loads(json.dumps(_config_fields(cfg))), []  # as JSON reads it back: tuples are lists
    for path in (cfg.cache_path / "profiles").glob("*.json"):
        try:
            raw = json.loads(path.read_text())
            fields = raw.get("fields") or {}
            if all(fields.get(k) == v for k, v in want.items()):
                found.append((path, SystemProfile.from_json(raw)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable, or written before profiles recorded their fields
    return max(found, key=lambda f: f[1].measured_at, default=None)


async def load_or_measure(pool, cfg: SpindConfig, timeout_s: float) -> SystemProfile:
    max_model_len = served_context(cfg, pool)
    fields = profile_fields(cfg, pool.describe(), max_model_len)
    path = cfg.cache_path / "profiles" / f"{_digest(fields)}.json"
    if cfg.runtime.profile == "auto" and path.is_file():
        try:
            raw = json.loads(path.read_text())
            cached = SystemProfile.from_json(raw)
            why = cached.implausible()
            if why is None:
                if "fields" not in raw:  # cached before profiles recorded them: `spind drafters` finds it from now on
                    _write(path, cached, fields)
                return cached
            log.warning("measuring again: the cached profile %s is implausible (%s)", path, why)
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable profile cache %s", path)
    expected = about(PROFILE_S) if cfg.model.target == "default" else "longer for a larger model"
    say(f"profiling the models ({expected}; once per model, device and threads: cached in {path.parent}, later "
        f"starts read it)")
    profile = await _measure(pool, cfg, max_model_len, timeout_s)
    why = profile.implausible()
    if why is not None:  # other work shared the cores: once more, and only a plausible profile is cached
        log.warning("profiling again: %s (was other work running?)", why)
        profile = await _measure(pool, cfg, max_model_len, timeout_s)
        why = profile.implausible()
    if why is None:
        _write(path, profile, fields)
    else:
        log.warning("serving with a profile measured under load, not cached (%s): selection may speculate less "
                    "than this machine allows; the next start measures again", why)
    return profile


async def _measure(pool, cfg: SpindConfig, max_model_len: int, timeout_s: float) -> SystemProfile:
    """Every worker's drafters at once, each on its worker's own threads; then the target alone, on the threads it
    verifies with while nothing drafts beside it (`placement.verify_threads`: every core's on a CPU with
    [runtime].adaptive_threads): its verify at each batch size, each batch with one request drafting n = 1..k, and
    plain decoding's step (the same probe with no draft, k = 0). Nearly every slot verifies on those threads, and a
    profile timed on the target's share (1 of 2 cores with a drafter worker beside it) priced a draft token at batch
    1 at 2.65 ms where serving's took ~1.6 (the default model, AMD EPYC, 2 cores)."""
    k, sizes = cfg.speculation.k, batch_sizes(cfg.runtime.max_batch_size)
    context = probe_context(max_model_len, k)
    threads = verify_threads(cfg, pool.info(TARGET_WORKER).device)
    replies = await asyncio.gather(*(pool.call(name, P.Profile(0, k, [], context, REPS), timeout_s)
                                     for name in pool.names))
    verify = await pool.call(TARGET_WORKER, P.Profile(0, k, sizes, context, REPS, threads=threads), timeout_s)
    lone: dict[int, list[float]] = {}
    for n in range(1, k + 1):
        one = await pool.call(TARGET_WORKER, P.Profile(0, n, sizes, context, LONE_REPS, drafting=1, threads=threads),
                              timeout_s)
        for b, ms in one.verify_ms.items():
            lone.setdefault(b, []).append(ms)
    decode = await pool.call(TARGET_WORKER, P.Profile(0, 0, sizes, context, REPS, threads=threads), timeout_s)
    return SystemProfile(k, {n: ms for r in replies for n, ms in r.draft_ms_per_token.items()}, dict(verify.verify_ms),
                         time.time(), decode.verify_ms.get(1), dict(decode.verify_ms),
                         {b: row for b, row in lone.items() if len(row) == k})


def _write(path: Path, profile: SystemProfile, fields: dict) -> None:
    """The profile, with the fields its key hashes (`find_cached` matches a config against them)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**profile.to_json(), "fields": fields}, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache is no reason not to serve
        log.warning("cannot cache the profile in %s: %s", path, e)
