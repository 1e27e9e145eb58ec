"""`spind bench e2e`: the paper's evaluation (§VII) on real workloads, every system side by side in one run.

Every spind system is the coordinator users get with one configuration: the daemon's Coordinator over in-process
workers (`LocalEngine`, `--workers threads`, the default) or over worker processes as the daemon runs them
(`ProcessEngine`, `--workers processes`). The two differ where the coordinator's own Python meets the target's
forward: worker threads share the coordinator's GIL, so a slot's streaming and the selector's learning wait for
the forward and the forward for them, while with worker processes they run as the next verify computes
(`SlotPhases.hold_deltas`), as they do in `spind start`. The transformers systems (`e2e_hf.py`) are what a user
would otherwise run on the same weights. Systems, one row each:

| system                 | selection       | drafters | attention | pipeline | the paper's name                     |
|------------------------|-----------------|----------|-----------|----------|--------------------------------------|
| `none`                 | -               | none     | served    | -        | plain decoding (all cores)           |
| `fixed:NAME`           | that drafter    | NAME     | served    | off      | Vanilla speculative decoding         |
| `spin`                 | lbss            | all      | served    | on       | Spin                                 |
| `spin-nopipe`          | lbss            | all      | served    | off      | Spin w/o pipeline                    |
| `spin-nobatch-nopipe`  | lbss            | all      | padded    | off      | Spin w/o batch. & pipe.              |
| `greedy-length`, `epsilon-greedy`, `random`, `oracle` | that policy | all | padded | off | §VII-B's selection baselines |

(§VII-B compares selection policies with fast batch verification and the pipeline off, so the baselines run
like `spin-nobatch-nopipe`.) "served" is the configured [runtime].attention, what the daemon runs (on CPU the
batch-invariant row kernel over an fp16 KV cache; on a GPU triton-packed): the systems a user would choose between
are timed on the engine they would get, and only the ablations swap in padded verification. `oracle` knows each
request's best drafter in hindsight: the one whose `fixed:` run served it fastest in this same bench run, so it
needs those systems in the list. A spind system's name may end in settings of its own config, `/SECTION.KEY=VALUE`
each (`spin/selection.price_margin=0.1`): a row of its own, so that a setting is weighed against the default side
by side, in the same rounds, rather than in two runs minutes apart on a machine whose speed drifts between them.

Requests arrive in a closed loop (`--batch-size` clients, each sending its next request when the previous
ends: the paper's setting) or an open loop (Poisson arrivals at `--rate` requests/s). Greedy outputs are
compared with `none`'s, request by request: the `lossless` flag. In a closed loop a slice of the requests ends in a
drain, the batch shrinking to its last request; it is longer for a system whose requests progress unevenly
(speculation) than for one that keeps equally long requests in step (plain decoding, where most answers run to
--max-tokens), so each spind system's slices are also timed while the batch was full (`x none, full batch`: from a
slice's start until a client first found no request left, with the tokens streamed by then): serving at the batch
size, where `x none` is the slices whole. The spind systems are loaded
side by side and take turns over `--rounds` slices of the requests (`run_spind_rounds`): on a shared, noisy
machine a system run after another meets other conditions, and the ratios between them are what the bench is
for. Each system is warmed up with one untimed request first, whose answer its drafters then forget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
import tomllib
from dataclasses import asdict

from spind.bench.datasets import Prompt, encode_prompt
from spind.bench.e2e_records import E2ESettings, RefusedSystem, RequestRecord, SlotAccount, SystemSpec
from spind.bench.report import Progress, fmt, format_table
from spind.bench.serve import percentile
from spind.config import TARGET_WORKER, ConfigError, SpindConfig, with_drafter_values, with_section_values
from spind.coordinator.interface import EngineRequest
from spind.coordinator.selection.protocol import Arm
from spind.params import SamplingParams
from spind.policy import Policy

POLICIES = ("greedy-length", "epsilon-greedy", "random", "oracle")
SPIN = {"spin": (True, None), "spin-nopipe": (False, None), "spin-nobatch-nopipe": (False, "padded")}  # None: served


def fixed_policy(system: str) -> Policy | None:
    """The policy of a `fixed:NAME` system (vanilla speculative decoding at --k); None for any other system.
    RefusedSystem when it is malformed, or names a k: every system of a run drafts at the same --k."""
    if not system.startswith("fixed:"):
        return None
    try:
        policy = Policy.parse(system)
    except ValueError as e:
        raise RefusedSystem(f"{system}: {e}") from None
    if policy.k is not None:
        raise RefusedSystem(f"{system}: fixed:NAME systems draft at --k; name no @K")
    return policy


def parse_system(name: str, cfg: SpindConfig) -> SystemSpec:
    """A system name -> how to run it; RefusedSystem names what is missing. A spind system's name may end in settings
    of its config, `/SECTION.KEY=VALUE` each (VALUE as TOML writes it): `spin/selection.price_margin=0.1` is `spin`
    with that margin, a row of its own beside `spin`, so that a setting is weighed side by side in one run; a
    drafter's is `/drafters.NAME.KEY=VALUE` (`spin/drafters.suffix.max_depth=24`). A name
    ending in `#N` (N a whole number) is one more engine of the system before it, with rows of its own: `none#2` beside
    `none` reads how far two engines of one system differ in the run, the floor under every other ratio."""
    if "#" in name:
        return _parse_copy(name, cfg)
    base, *settings = name.split("/")
    spec = _parse_base(base, cfg)
    if not settings:
        return spec
    if spec.kind != "spind":
        raise RefusedSystem(f"{name}: only spind systems take /SECTION.KEY=VALUE settings")
    spec = dataclasses.replace(spec, name=name, settings=tuple(_parse_setting(name, text) for text in settings))
    try:
        spind_config(cfg, spec, cfg.speculation.k)
    except ConfigError as e:
        raise RefusedSystem(f"{name}: {e}") from None
    return spec


def _parse_copy(name: str, cfg: SpindConfig) -> SystemSpec:
    system, _, copy = name.rpartition("#")
    if not (system and copy.isdigit() and int(copy) > 0):
        raise RefusedSystem(f"{name}: another engine of a system is SYSTEM#N, N a whole number (e.g. none#2)")
    spec = parse_system(system, cfg)
    if spec.kind != "spind" or spec.policy.name == "oracle":
        raise RefusedSystem(f"{name}: only spind systems other than oracle run as another engine (#N)")
    return dataclasses.replace(spec, name=name)


SET_BY_SYSTEM = ("selection.policy", "runtime.pipeline", "runtime.attention", "speculation.k")  # the system's, --k's


def _parse_setting(name: str, text: str) -> tuple[str, str, object]:
    """`SECTION.KEY=VALUE` -> (section, key, value); VALUE is read as a TOML value, else as a bare string."""
    path, eq, value = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not (eq and dot and section and key):
        raise RefusedSystem(f"{name}: a setting is SECTION.KEY=VALUE (e.g. selection.price_margin=0.1), got {text!r}")
    if f"{section}.{key}" in SET_BY_SYSTEM:
        raise RefusedSystem(f"{name}: {section}.{key} is set by the system's name (or --k), not by a setting")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return section, key, parsed


def _parse_base(name: str, cfg: SpindConfig) -> SystemSpec:
    names = tuple(d.name for d in cfg.drafters)
    if name == "none":
        return SystemSpec(name=name, kind="spind")
    fixed = fixed_policy(name)
    if fixed is not None:
        if fixed.drafter not in names:
            raise RefusedSystem(f"{name}: no configured drafter {fixed.drafter!r} (configured: {', '.join(names)})")
        return SystemSpec(name=name, kind="spind", policy=fixed, drafters=(fixed.drafter,), pipeline=False)
    if name in SPIN:
        pipeline, attention = SPIN[name]
        return SystemSpec(name=name, kind="spind", policy=Policy("lbss"), drafters=names, pipeline=pipeline,
                          attention=attention)
    if name in POLICIES:
        return SystemSpec(name=name, kind="spind", policy=Policy.parse(name), drafters=names, pipeline=False,
                          attention="padded")
    if name == "hf-plain" or name == "hf-prompt-lookup":
        return SystemSpec(name=name, kind="hf")
    if name.startswith("hf-assisted:"):
        drafter = name.removeprefix("hf-assisted:")
        if drafter not in names:
            raise RefusedSystem(f"{name}: no configured drafter {drafter!r}")
        return SystemSpec(name=name, kind="hf", hf_drafter=drafter)
    raise RefusedSystem(f"unknown system {name!r}: none, fixed:NAME, spin, spin-nopipe, spin-nobatch-nopipe, "
                        f"{', '.join(POLICIES)}, hf-plain, hf-assisted:NAME, hf-prompt-lookup")


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Open loop: Poisson arrival times (seconds); closed loop: all zero (the clients pace themselves)."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# ---- spind systems --------------------------------------------------------------------------------
def spind_config(cfg: SpindConfig, spec: SystemSpec, k: int) -> SpindConfig:
    """The config the system runs: `cfg` with its pipeline, attention and policy, --k, and its own settings (ConfigError
    where one is wrong)."""
    r = dataclasses.replace(cfg.runtime, pipeline=spec.pipeline, attention=spec.attention or cfg.runtime.attention)
    out = dataclasses.replace(cfg, runtime=r, speculation=dataclasses.replace(cfg.speculation, k=k),
                              selection=dataclasses.replace(cfg.selection, policy=str(spec.policy)))
    sections: dict[str, dict[str, object]] = {}
    drafters: dict[str, dict[str, object]] = {}  # drafters.NAME.KEY: that [[drafters]] entry's
    for section, key, value in spec.settings:
        if section != "drafters":
            sections.setdefault(section, {})[key] = value
            continue
        name, dot, key = key.partition(".")
        if not (dot and name and key):
            raise ConfigError(f"a drafter's setting is drafters.NAME.KEY=VALUE, got drafters.{name}")
        drafters.setdefault(name, {})[key] = value
    for section, values in sections.items():
        out = with_section_values(out, section, values)
    for name, values in drafters.items():
        out = with_drafter_values(out, name, values)
    return out


async def _drive(coordinator, prompts: list[list[int]], categories: list[str], s: E2ESettings, drafter: str,
                 progress: Progress, label: str, first: int = 0) -> tuple[list[RequestRecord], float, SlotAccount]:
    """Run `prompts` (the workload's requests first .. first + len - 1) through the coordinator; returns the records,
    the wall seconds and, in a closed loop, the full batch's seconds and tokens (`SlotAccount.full_s`)."""
    params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
    records = [RequestRecord(first + i, categories[i], len(p)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    times = arrivals(len(prompts), s.rate, s.seed)
    streamed = [0]  # tokens streamed so far, all requests
    full: list[SlotAccount] = []  # set when a client first finds no request left

    async def one(i: int) -> None:
        rec = records[i]
        await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
        t0 = time.perf_counter()
        rec.arrival_s = t0 - start
        req = EngineRequest(f"e2e-{label}-{first + i}", prompts[i], params, drafter, None)
        async for d in coordinator.generate(req):
            if d.token_ids and rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - t0
            rec.token_ids += d.token_ids
            streamed[0] += len(d.token_ids)
            if d.finish_reason is not None:
                u = d.usage
                rec.finish_reason, rec.num_steps, rec.drafters, rec.arms = d.finish_reason, u.num_steps, u.drafters, u.arms
                rec.num_drafted = sum(v["drafted"] for v in u.drafters.values())
                rec.num_accepted = sum(v["accepted"] for v in u.drafters.values())
        rec.latency_s = time.perf_counter() - t0
        progress.step(f"{label} #{first + i}: {len(rec.token_ids)} tokens in {rec.latency_s:.1f}s")

    if s.rate is None:
        todo = iter(range(len(prompts)))

        async def client() -> None:
            ran = False
            for i in todo:
                await one(i)
                ran = True
            if not full:  # a client that never had a request: the batch was never full
                full.append(SlotAccount(full_s=time.perf_counter() - start, full_tokens=streamed[0]) if ran else
                            SlotAccount())

        await asyncio.gather(*(client() for _ in range(s.batch_size)))
    else:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records, time.perf_counter() - start, full[0] if full else SlotAccount()


async def _warm_up(coordinator, prompts: list[list[int]], s: E2ESettings, drafter: str, label: str) -> None:
    """One short request through the system before the clock starts, untimed: what a running server has already
    paid (first allocations, lazily built state, the selector's first matching) is not charged to the first
    requests of one system and not another's. Its answer (to the first prompt) then leaves the drafters' caches:
    suffix decoding would draft the first timed request from it, as much of it as the worker had inserted by then."""
    params = SamplingParams(max_tokens=8, temperature=s.temperature, seed=s.seed)
    async for _ in coordinator.generate(EngineRequest(f"e2e-{label}-warmup", prompts[0], params, drafter, None)):
        pass
    await coordinator.reset_cache()


def _load(cfg: SpindConfig, spec: SystemSpec, prompts: list[list[int]], s: E2ESettings,
          oracle: dict[int, Arm] | None = None):
    """The system's engine, warmed up."""
    from spind.coordinator.selection.arms import ArmSet
    from spind.coordinator.selection.baselines import OracleSelector
    from spind.coordinator.transport.local import LocalEngine, with_drafters
    from spind.coordinator.transport.process_pool import ProcessEngine

    run_cfg = spind_config(cfg, spec, s.k)
    selector = None
    if spec.policy.name == "oracle":
        table = {f"e2e-{spec.name}-{i}": {arm: 1.0} for i, arm in (oracle or {}).items()}
        arm_set = ArmSet(spec.drafters, tuple(sorted({*run_cfg.selection.k_set, s.k})))
        selector = OracleSelector(arm_set, lambda r: table.get(r, {}), s.k)
    if s.workers == "processes":
        engine = ProcessEngine(with_drafters(run_cfg, list(spec.drafters)), selector=selector)
    else:
        engine = LocalEngine.load(run_cfg, drafters=list(spec.drafters), selector=selector)
    try:
        engine.loop.run_until_complete(_warm_up(engine.coordinator, prompts, s, _drafter(spec), spec.name))
    except BaseException:
        engine.close()
        raise
    return engine


def _drafter(spec: SystemSpec) -> str:
    return "none" if spec.policy.name == "none" else "auto"


def slot_account(coordinator) -> SlotAccount:
    """The engine's slot totals so far (the difference of two around a run is the run's)."""
    ph = coordinator.phases
    busy = {w: sum(kinds.values()) for w, kinds in ph.history.busy_s.items()}
    target = busy.pop(TARGET_WORKER, 0.0)
    workers_cpu = sum(ph.pool.cpu_seconds(name) or 0.0 for name in ph.pool.names)
    return SlotAccount(ph.times.num_slots, ph.times.total_slot_s, ph.times.total_overhead_s, target,
                       sum(busy.values()), time.process_time(), workers_cpu)


SELECTION_KEYS = ("dominated", "idle", "ledger", "overhead_ms", "nothing_pays", "settled_slots", "settled_on",
                  "settled_on_slots", "cut_slots", "price", "plain_price", "regime")


def selector_state(coordinator) -> dict | None:
    """What a learning selector ended the run with (its describe(), the parts that explain its choices: the drafters
    it left out, whether it idled, what the shadow drafts were worth); None for one that does not learn."""
    state = coordinator.phases.describe_selection() or {}
    return {k: state[k] for k in SELECTION_KEYS if k in state} or None


def _drive_accounted(engine, prompts: list[list[int]], categories: list[str], s: E2ESettings, spec: SystemSpec,
                     progress: Progress, first: int = 0) -> tuple[list[RequestRecord], float, SlotAccount]:
    before = slot_account(engine.coordinator)
    records, wall, full = engine.loop.run_until_complete(
        _drive(engine.coordinator, prompts, categories, s, _drafter(spec), progress, spec.name, first))
    # what is still in flight (a follow-on slot sent for a request that then ended) settles before this engine's loop
    # stops until its next turn, else that slot would span the other systems' turns
    engine.loop.run_until_complete(engine.coordinator.until_idle())
    return records, wall, slot_account(engine.coordinator) - before + full


def run_spind(cfg: SpindConfig, spec: SystemSpec, prompts: list[list[int]], categories: list[str], s: E2ESettings,
              progress: Progress, oracle: dict[int, Arm] | None = None, states: dict | None = None
              ) -> tuple[list[RequestRecord], float, SlotAccount]:
    """states: filled with the system's selector_state at the end."""
    engine = _load(cfg, spec, prompts, s, oracle)
    try:
        out = _drive_accounted(engine, prompts, categories, s, spec, progress)
        if states is not None:
            states[spec.name] = selector_state(engine.coordinator)
        return out
    finally:
        engine.close()


def run_repeats(cfg: SpindConfig, specs: dict[str, SystemSpec], prompts: list[list[int]], categories: list[str],
                s: E2ESettings, progress: Progress, states: dict | None = None
                ) -> dict[str, tuple[list[RequestRecord], list[float], SlotAccount]]:
    """`run_spind_rounds` `s.repeats` times over the same requests, each time on engines loaded afresh (a drafter
    that learns from finished outputs, the suffix trie, must not meet a request it has already served), each
    repeat starting on another row of the rounds' Williams square (`first_row`). Where the requests allow fewer
    rounds than there are systems (81 prompts at batch 16: 2 rounds for 4 systems) one run is half a square, and
    the first slice after the engines load is always the same system's (`none`'s). On this project's 2-core VM, in
    runs that loaded `spin`, that slice prefilled 10-15% faster a token than the next system's slice of the same
    prompts, whichever system had it (passage, batch 16: `none` first, 0.369 ms a token against `spin`'s 0.425;
    `spin` first, 0.405 against `none`'s 0.444), so the system listed first gained in every run. Each system's
    records, round wall times and slots are those of every repeat, in order (`round` counts on across repeats);
    `states` holds the last repeat's selectors."""
    out: dict[str, tuple[list[RequestRecord], list[float], SlotAccount]] = {}
    rounds = s.num_rounds()
    for rep in range(s.repeats):
        for n, (recs, slices, account) in run_spind_rounds(cfg, specs, prompts, categories, s, progress, states,
                                                           first_row(len(specs), rounds, rep)).items():
            for rec in recs:
                rec.round += rep * rounds
            before = out.get(n, ([], [], SlotAccount()))
            out[n] = (before[0] + recs, before[1] + slices, before[2] + account)
    return out


def first_row(num_systems: int, rounds: int, rep: int) -> int:
    """The Williams-square row repeat `rep` starts on (its rounds take the rows after it). The rows go on where
    the last repeat left off, so that the repeats together run whole squares (every system in every place equally
    often), and each time the rows have come round to the square's start they shift by one, so that over
    `num_systems` repeats each system runs first after the engines load once."""
    cycle = num_systems // math.gcd(rounds, num_systems)  # repeats until the rows come round to the start
    return (rep * rounds + rep // cycle) % num_systems


def run_spind_rounds(cfg: SpindConfig, specs: dict[str, SystemSpec], prompts: list[list[int]], categories: list[str],
                     s: E2ESettings, progress: Progress, states: dict | None = None, row: int = 0
                     ) -> dict[str, tuple[list[RequestRecord], list[float], SlotAccount]]:
    """The systems loaded side by side, taking turns over `s.num_rounds()` contiguous slices of the requests (the
    order rotating each round), so that the machine's drift (other tenants, thermal state) falls on all of them
    alike instead of on whichever ran last. Each system's wall time is the sum of its slices'; its engine (and
    selector) lives through all of its slices, as a server's would; round r runs in the order of the Williams
    square's row `row` + r. Returns each system's records (`round` set), its slices' wall times, round by round,
    and its slots over all of them; `states` is filled with each system's selector_state at the end."""
    names = list(specs)
    rounds = s.num_rounds()
    bounds = [len(prompts) * r // rounds for r in range(rounds + 1)]
    engines = {}
    records: dict[str, list[RequestRecord]] = {n: [] for n in names}
    walls: dict[str, list[float]] = {n: [] for n in names}
    accounts = dict.fromkeys(names, SlotAccount())
    try:
        for n in names:
            progress.note(f"system {n}: loading")
            engines[n] = _load(cfg, specs[n], prompts, s)
        for r in range(rounds):
            lo, hi = bounds[r], bounds[r + 1]
            for n in round_order(names, row + r):
                recs, wall, account = _drive_accounted(engines[n], prompts[lo:hi], categories[lo:hi], s, specs[n],
                                                       progress, first=lo)
                for rec in recs:
                    rec.round = r
                records[n].extend(recs)
                walls[n].append(wall)
                accounts[n] += account
        if states is not None:
            states.update((n, selector_state(e.coordinator)) for n, e in engines.items())
    finally:
        for e in engines.values():
            e.close()
    return {n: (records[n], walls[n], accounts[n]) for n in names}


def round_order(names: list[str], r: int) -> list[str]:
    """The order the systems run in round r: row r of a Williams square (0, 1, n-1, 2, n-2, ... shifted by r), so
    that over n rounds each system runs in every place and, for an even n, after every other system once. A slice
    run right after a costly engine's (one that leaves a suffix trie's inserts or a model drafter's caches behind)
    meets other conditions; with a plain rotation a system kept its predecessor in every round but one."""
    n = len(names)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    return [names[(i + r) % n] for i in base]


# ---- aggregation ----------------------------------------------------------------------------------
def summarize(system: str, records: list[RequestRecord], wall_s: float) -> dict:
    tokens = sum(len(r.token_ids) for r in records)
    drafted, accepted, steps = (sum(getattr(r, a) for r in records) for a in ("num_drafted", "num_accepted",
                                                                           "num_steps"))
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    lat = [r.latency_s for r in records]
    compared = [r.lossless for r in records if r.lossless is not None]
    return {"system": system, "num_requests": len(records), "tokens": tokens, "wall_s": wall_s,
            "goodput": tokens / wall_s if wall_s else 0.0,  # committed tokens (accepted drafts + bonus) per second
            "request_tokens_per_s_p50": percentile([r.goodput for r in records], 0.5),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + steps) / steps if steps else None,
            "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "lossless": all(compared) if compared else None, "speedup_vs_none": None}


def round_ratios(results: dict[str, list[RequestRecord]], round_walls: dict[str, list[float]],
                 base: str = "none") -> dict[str, list[float]]:
    """Per system that took turns with `base`, its goodput over `base`'s in each round: the same requests, run
    minutes apart at most. Their median is the bench's robust ratio: one slice that met a noisy neighbour moves the
    pooled ratio, not the median."""
    if base not in round_walls:
        return {}

    def goodputs(name: str) -> list[float]:
        tokens = [0] * len(round_walls[name])
        for rec in results[name]:
            tokens[rec.round] += len(rec.token_ids)
        return [t / w if w else 0.0 for t, w in zip(tokens, round_walls[name])]

    ref = goodputs(base)
    return {n: [g / b if b else float("nan") for g, b in zip(goodputs(n), ref)] for n in round_walls}


def drafter_shares(records: list[RequestRecord]) -> dict[str, float]:
    """Share of slots per drafter ("none" included) over all the system's requests."""
    counts: dict[str, int] = {}
    for r in records:
        for arm in r.arms:
            name = arm.split("@")[0]
            counts[name] = counts.get(name, 0) + 1
    total = sum(counts.values())
    return {n: c / total for n, c in sorted(counts.items())} if total else {}


def best_arms(results: dict[str, list[RequestRecord]], k: int) -> dict[int, Arm]:
    """Each request's best drafter in hindsight: the fixed:NAME run (or none) that served it at the highest
    goodput in this bench run (a system with settings of its own, or another engine of one, is not one of them)."""
    best: dict[int, tuple[float, Arm]] = {}
    for system, records in results.items():
        if "/" in system or "#" in system:
            continue
        fixed = fixed_policy(system)
        if system != "none" and fixed is None:
            continue
        arm = Arm(None, 0) if fixed is None else Arm(fixed.drafter, k)
        for r in records:
            if r.index not in best or r.goodput > best[r.index][0]:
                best[r.index] = (r.goodput, arm)
    return {i: arm for i, (_, arm) in best.items()}


def run_e2e(cfg: SpindConfig, s: E2ESettings, prompts_text: list[Prompt]) -> dict:
    """Every system in turn over the same requests; returns the JSON-ready results."""
    from spind.models.loader import resolve_model_dir
    from spind.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_dir(cfg.model.target, cfg.cache_path))
    prompts = [encode_prompt(tokenizer, p) for p in prompts_text]
    categories = [p.category or p.dataset for p in prompts_text]
    specs, refused = {}, {}
    for name in s.systems:
        try:
            specs[name] = parse_system(name, cfg)
        except RefusedSystem as e:
            refused[name] = str(e)
    if "oracle" in specs and not any(spec.policy.is_fixed for spec in specs.values()):
        refused["oracle"] = "oracle needs fixed:NAME systems in the same run (it picks each request's best of them)"
        del specs["oracle"]
    # the references first, the oracle after what it learns from
    order = sorted(specs, key=lambda n: (n != "none", n == "oracle", n.startswith("hf-")))
    together = {n: specs[n] for n in order if specs[n].kind == "spind" and specs[n].policy.name != "oracle"}
    turns = s.rate is None and len(together) > 1 and s.num_rounds() * s.repeats > 1
    if s.repeats > 1 and not turns:
        raise ValueError("--repeats reruns the spind systems that take turns: it needs two or more of them (the oracle "
                         "and transformers systems run once) in a closed loop")
    progress = Progress((len(order) + (s.repeats - 1) * len(together)) * len(prompts))
    results: dict[str, list[RequestRecord]] = {}
    walls: dict[str, float] = {}
    round_walls: dict[str, list[float]] = {}
    accounts: dict[str, SlotAccount] = {}  # the spind systems'
    states: dict[str, dict | None] = {}  # ... and their selectors' at the end
    if turns:  # taking turns; the oracle and transformers systems after them, once
        for name, (records, slices, account) in run_repeats(cfg, together, prompts, categories, s,
                                                            progress, states).items():
            results[name], walls[name], round_walls[name], accounts[name] = records, sum(slices), slices, account
        order = [n for n in order if n not in together]
    for name in order:
        spec = specs[name]
        progress.note(f"system {name}: loading")
        try:
            if spec.kind == "hf":
                from spind.bench.e2e_hf import run_hf

                records, wall = run_hf(cfg, spec, prompts, categories, s, progress)
            else:
                oracle = best_arms(results, s.k) if spec.policy.name == "oracle" else None
                records, wall, accounts[name] = run_spind(cfg, spec, prompts, categories, s, progress, oracle,
                                                          states)
        except RefusedSystem as e:
            refused[name] = str(e)
            continue
        results[name], walls[name] = records, wall
    if "none" in results and s.temperature == 0.0:
        for name, records in results.items():
            for r, ref in zip(records, results["none"]):
                r.lossless = r.token_ids == ref.token_ids
    rows = [summarize(n, results[n], walls[n]) for n in results]
    base = next((r["goodput"] for r in rows if r["system"] == "none"), None)
    ratios = round_ratios(results, round_walls)
    full = {n: a.full_batch_goodput for n, a in accounts.items()}
    for r in rows:
        r["speedup_vs_none"] = r["goodput"] / base if base else None
        r["full_batch_goodput"] = full.get(r["system"])  # None: transformers, or an open loop
        r["full_batch_speedup_vs_none"] = (r["full_batch_goodput"] / full["none"] if r["full_batch_goodput"]
                                           and full.get("none") else None)
        r["round_speedups_vs_none"] = ratios.get(r["system"])
        r["speedup_vs_none_round_median"] = percentile(ratios[r["system"]], 0.5) if r["system"] in ratios else None
        r["drafter_shares"] = drafter_shares(results[r["system"]])
        r["slots"] = accounts[r["system"]].per_slot() if r["system"] in accounts else None  # None: transformers
        r["selection"] = states.get(r["system"])  # a learning selector's state at the end (selector_state)
    cats = sorted({c for c in categories if c})
    per_category = {}
    for c in cats if len(cats) > 1 else ():  # per category: per-request rates (the wall time is the whole run's)
        per_category[c] = []
        for n in results:
            recs = [r for r in results[n] if r.category == c]
            per_category[c].append({**summarize(n, recs, walls[n]), "drafter_shares": drafter_shares(recs)})
    target = cfg.worker(TARGET_WORKER)
    return {"settings": {**asdict(s), "num_rounds": s.num_rounds()}, "model": cfg.model.target, "rows": rows,
            "refused": refused, "target_ranks": list(target.group_devices) if target.tensor_parallel > 1 else [],
            "per_category": per_category,
            "requests": {n: [asdict(r) for r in recs] for n, recs in results.items()}}


def render_table(results: dict) -> str:
    s = results["settings"]
    loop = f"open loop, {s['rate']} req/s" if s["rate"] else f"closed loop, batch {s['batch_size']}"
    title = (f"spind bench e2e: {s['workload']}, {s['num_requests']} requests, {s['max_tokens']} tokens max, "
             f"{loop}, temperature {s['temperature']}, worker {s.get('workers', 'threads')}")
    if s.get("num_rounds", 1) > 1:
        title += f", {s['num_rounds']} rounds"
    if s.get("repeats", 1) > 1:
        title += f", the requests run {s['repeats']} times (engines loaded afresh each time)"
    if results.get("target_ranks"):
        title += f", target split over {len(results['target_ranks'])} ranks ({', '.join(results['target_ranks'])})"
    header = ["system", "goodput tok/s", "x none", "x none, round median", "x none, full batch", "tok/s/req p50", "accept", "acc len", "lat p50 s", "lat p99 s",
              "TTFT p50 s", "TTFT p99 s", "slot ms", "coordinator ms/slot", "target busy ms/slot", "side busy ms/slot",
              "process CPU ms/slot", "workers CPU ms/slot", "lossless", "drafter shares"]
    rows = [[r["system"], fmt(r["goodput"], 1), fmt(r["speedup_vs_none"]), fmt(r.get("speedup_vs_none_round_median")),
             fmt(r.get("full_batch_speedup_vs_none")), fmt(r["request_tokens_per_s_p50"], 1),
             fmt(r["acceptance_rate"]), fmt(r["mean_accepted_length"]), fmt(r["latency_p50_s"]),
             fmt(r["latency_p99_s"]), fmt(r["ttft_p50_s"]), fmt(r["ttft_p99_s"]),
             *(fmt((r.get("slots") or {}).get(key)) for key in ("slot_ms", "coordinator_ms", "target_busy_ms",
                                                               "side_busy_ms", "process_cpu_ms", "workers_cpu_ms")),
             "-" if r["lossless"] is None else "yes" if r["lossless"] else "NO",
             " ".join(f"{n}:{v:.0%}" for n, v in r["drafter_shares"].items())] for r in results["rows"]]
    tables = [format_table(title, header, rows)]
    for cat, cat_rows in results["per_category"].items():
        tables.append(format_table(f"category {cat}", ["system", "tok/s/req p50", "accept", "acc len", "lat p50 s",
                                                       "lossless", "drafter shares"],
                                   [[r["system"], fmt(r["request_tokens_per_s_p50"], 1), fmt(r["acceptance_rate"]),
                                     fmt(r["mean_accepted_length"]), fmt(r["latency_p50_s"]),
                                     "-" if r["lossless"] is None else "yes" if r["lossless"] else "NO",
                                     " ".join(f"{n}:{v:.0%}" for n, v in r["drafter_shares"].items())]
                                    for r in cat_rows]))
    if results["refused"]:
        tables.append("refused:\n" + "\n".join(f"  {n}: {why}" for n, why in results["refused"].items()))
    return "\n\n".join(tables)
