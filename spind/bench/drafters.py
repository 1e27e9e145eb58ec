"""Drafter descriptions, cost probes, and `spind bench drafters`: what each drafter costs and what it earns.

Every figure comes from the project's own runtime, with all drafters measured side by side in one process
(the same prompts, interleaved), so that their ratios hold even when absolute timings are noisy:
- the target: median ms per decode step (1 token) and per verify step (k+1 tokens), batch 1, fp32 and bf16;
- each drafter: median ms per draft token, batch 1, in steady state (a 1-token catch-up, then k drafts);
- per dataset: greedy acceptance rate, and end-to-end tokens/s over plain decoding at batch 1;
- with a bf16 target: the share of each output that matches bf16 plain decoding, since a (k+1)-row bf16
  verify forward rounds differently from 1-row decoding (with fp32 every drafter matches exactly).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from spind.bench.datasets import DEFAULT_DATASETS_DIR, encode_prompt, load_prompts
from spind.bench.report import Progress, fmt, format_table, timed
from spind.config import SpindConfig, with_resolved_dtype
from spind.drafters.model import common_prefix
from spind.coordinator.transport.local import GenRequest, GenResult, LocalEngine
from spind.models.llama import LlamaModel
from spind.models.loader import resolve_model_dir
from spind.models.runner import ForwardItem, ModelRunner
from spind.drafters.base import DraftInput
from spind.worker.profile import time_draft_tokens
from spind.params import SamplingParams

PLAIN = "none"
PROBE = "bench-probe"


def time_target_steps(models: dict[str, LlamaModel], prompt: list[int], steps: int, k: int,
                      block_size: int, attention: str = "packed",
                      verify_rows: tuple[int, ...] = ()) -> dict[str, dict[str, float]]:
    """Median ms of a 1-token decode forward and a (k+1)-token verify forward (rolled back), batch 1, interleaved;
    `verify_rows`: more verify widths, timed the same way (`verify_ms_by_rows`, with k + 1 among them)."""
    widths = list(dict.fromkeys([k + 1, *verify_rows]))
    num_blocks = -(-(len(prompt) + steps + max(widths)) // block_size)
    runners = {label: ModelRunner(m, num_blocks, block_size, attention) for label, m in models.items()}
    decode: dict[str, list[float]] = defaultdict(list)
    verify: dict[tuple[str, int], list[float]] = defaultdict(list)
    for runner in runners.values():
        runner.add_request(PROBE)
        runner.forward([ForwardItem(PROBE, prompt)])
    token = prompt[-1]
    for _ in range(steps):
        for label, runner in runners.items():
            decode[label].append(timed(lambda: runner.forward([ForwardItem(PROBE, [token])])))
            length = runner.length(PROBE)
            for n in widths:
                verify[(label, n)].append(timed(lambda: runner.forward([ForwardItem(PROBE, [token] * n, n)])))
                runner.truncate(PROBE, length)
    return {label: {"decode_ms": statistics.median(decode[label]),
                    "verify_ms": statistics.median(verify[(label, k + 1)]),
                    "verify_ms_by_rows": {n: statistics.median(verify[(label, n)]) for n in widths}}
            for label in runners}


@dataclass(frozen=True)
class DrafterBenchSettings:
    datasets: tuple[str, ...]
    drafters: tuple[str, ...]
    num_prompts: int = 6
    max_tokens: int = 48
    k: int = 4
    decode_steps: int = 32
    datasets_dir: Path = DEFAULT_DATASETS_DIR
    include_bf16: bool = True


@dataclass
class Tally:
    """Sums over the prompts of one (target dtype, dataset, drafter) cell."""

    num_prompts: int = 0
    num_tokens: int = 0
    elapsed_s: float = 0.0
    num_drafted: int = 0
    num_accepted: int = 0
    num_matching: int = 0  # output tokens before the first divergence from plain decoding
    num_compared: int = 0  # sum over prompts of the longer of the two outputs
    num_identical: int = 0  # outputs equal to plain decoding

    def add(self, res: GenResult, plain: GenResult) -> None:
        self.num_prompts += 1
        self.num_tokens += len(res.token_ids)
        self.elapsed_s += res.elapsed_s
        self.num_drafted += res.num_drafted
        self.num_accepted += res.num_accepted
        self.num_matching += common_prefix(res.token_ids, plain.token_ids)
        self.num_compared += max(len(res.token_ids), len(plain.token_ids))
        self.num_identical += res.token_ids == plain.token_ids

    def merged(self, other: "Tally") -> "Tally":
        return Tally(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def to_json(self, plain: "Tally") -> dict:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s,
                "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
                "speedup": self.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None,
                "match_rate": self.num_matching / self.num_compared if self.num_compared else None}


def run_drafter_bench(cfg: SpindConfig, settings: DrafterBenchSettings) -> dict:
    """Run every measurement; returns the JSON-ready results (see the module docstring)."""
    cfg = with_resolved_dtype(cfg, resolve_model_dir(cfg.model.target, cfg.cache_path))  # passes are keyed by dtype
    texts = {name: load_prompts(name, settings.num_prompts, settings.datasets_dir) for name in settings.datasets}
    rt = LocalEngine.load(cfg, drafters=list(settings.drafters))
    prompts = {name: [encode_prompt(rt.tokenizer, p) for p in ps] for name, ps in texts.items()}
    longest = max((ids for ps in prompts.values() for ids in ps), key=len)
    models = {cfg.model.dtype: rt.target.runner.model}
    bf16_runtime = None
    if settings.include_bf16 and cfg.model.dtype != "bfloat16":  # the same drafters before a bf16 target
        bf16_runtime = with_target_dtype(cfg, "bfloat16", settings.drafters)
        models["bfloat16"] = bf16_runtime.target.runner.model
    passes = [(cfg.model.dtype, rt)] + ([("bfloat16", bf16_runtime)] if bf16_runtime else [])
    modes = [None, *settings.drafters]
    progress = Progress(total=len(passes) * len(modes) * sum(map(len, prompts.values())) + 2
                        + len(settings.drafters) * len(prompts))
    target_costs = time_target_steps(models, longest, settings.decode_steps, settings.k, cfg.runtime.kv_block_size,
                                     cfg.runtime.attention)
    progress.step(f"target steps: {len(models)} dtypes x {settings.decode_steps} steps")
    drafters = {name: rt.drafter(name) for name in settings.drafters}
    draft_costs = time_draft_tokens(drafters, longest, settings.k, settings.decode_steps)
    progress.step(f"draft tokens: {len(drafters)} drafters x {settings.decode_steps} rounds")
    cells, positions = [], []
    for dtype, runtime in passes:
        tallies, outputs = _run_pass(runtime, dtype, prompts, modes, settings, progress)
        cells += _cells(dtype, tallies, settings)
        if runtime is rt:  # acceptance by position over the served target's own plain outputs
            for name in settings.drafters:
                for dataset, outs in outputs.items():
                    acc = acceptance_by_position(drafters[name], list(zip(prompts[dataset], outs)), settings.k)
                    positions.append({"drafter": name, "dataset": dataset, **acc})
                    progress.step(f"{name} {dataset}: acceptance by position "
                                  f"{' '.join(f'{a:.2f}' for a in acc['by_position'])}")
        runtime.close()
    return {
        "settings": {**dataclasses.asdict(settings), "datasets_dir": str(settings.datasets_dir),
                     "probe_prompt_tokens": len(longest)},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "model": cfg.model.target},
        "target": [{"dtype": dtype, **costs} for dtype, costs in target_costs.items()],
        "drafters": [{"name": name, "kind": cfg.drafter(name).kind, "variant": cfg.drafter(name).variant,
                      "ms_per_draft_token": draft_costs[name]} for name in settings.drafters],
        "cells": cells,
        "acceptance_by_position": positions,
    }


def with_target_dtype(cfg: SpindConfig, dtype: str, drafters: tuple[str, ...] = ()) -> LocalEngine:
    """Another in-process engine whose target runs in `dtype`, with the named drafters."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    return LocalEngine.load(cfg, drafters=list(drafters))


def _run_pass(rt: LocalEngine, dtype: str, prompts: dict[str, list[list[int]]], modes: list[str | None],
              settings: DrafterBenchSettings, progress: Progress) -> dict[tuple[str, str], Tally]:
    """Each prompt alone (batch 1), plain first, then every drafter on it, back to back."""
    params = SamplingParams(max_tokens=settings.max_tokens)
    warm = next(iter(prompts.values()))[0]
    rt.generate([GenRequest(f"warm-{dtype}-{m}", warm, SamplingParams(max_tokens=4), m, settings.k) for m in modes])
    tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
    outputs: dict[str, list[list[int]]] = defaultdict(list)
    for dataset, id_lists in prompts.items():
        for i, ids in enumerate(id_lists):
            plain: GenResult | None = None
            for mode in modes:
                for name in rt.drafters:  # each drafter meets the prompt for the first time (suffix's cache)
                    rt.drafter(name).forget_finished()
                res = rt.generate([GenRequest(f"{dtype}-{dataset}-{i}-{mode}", ids, params, mode, settings.k)])[0]
                plain = plain or res
                tallies[(dataset, mode or PLAIN)].add(res, plain)
                progress.step(f"{dtype} {dataset} #{i} {mode or PLAIN}: {len(res.token_ids)} tokens "
                              f"in {res.elapsed_s:.2f}s, accepted {res.num_accepted}/{res.num_drafted}")
            outputs[dataset].append(plain.token_ids)
    return tallies, outputs


def acceptance_by_position(drafter, sequences: list[tuple[list[int], list[int]]], k: int,
                           stride: int = 1) -> dict:
    """Greedy chain acceptance per draft position: from every `stride`-th point of each plain-decoding output
    (the prompt and the output's first n + 1 tokens committed), the drafter proposes k tokens, and position j
    counts as accepted when it and every earlier one equal plain decoding's (what a verify would keep). Returns
    P(position j accepted) for j = 1..k, the mean accepted drafts per verify, and tau (tokens per verify with the
    bonus token)."""
    hits, counts = [0] * k, [0] * k
    for i, (prompt, out) in enumerate(sequences):
        rid = f"{PROBE}-position-{i}"
        full = prompt + out
        drafter.forget_finished()  # the generation passes' answers to these very prompts
        drafter.add_request(rid, SamplingParams())
        try:
            drafter.prepare_probe(rid, full)
            for n in range(0, len(out) - 1, stride):
                truth = out[n + 1:n + 1 + k]
                draft = drafter.propose([DraftInput(rid, full[:len(prompt) + n + 1], k)])[0].tokens
                alive = True
                for j, want in enumerate(truth):
                    counts[j] += 1
                    alive = alive and j < len(draft) and draft[j] == want
                    hits[j] += alive
        finally:
            drafter.free_request(rid)
    rates = [h / c if c else 0.0 for h, c in zip(hits, counts)]
    return {"by_position": rates, "mean_accepted": sum(rates), "tau": 1 + sum(rates), "num_chains": counts[0]}


def _cells(dtype: str, tallies: dict[tuple[str, str], Tally], settings: DrafterBenchSettings) -> list[dict]:
    """One JSON row per (dataset, drafter), plus dataset "all" summed over datasets."""
    modes = [PLAIN, *settings.drafters]
    totals = {m: Tally() for m in modes}
    rows = []
    for dataset in settings.datasets:
        for mode in modes:
            totals[mode] = totals[mode].merged(tallies[(dataset, mode)])
            rows.append({"target_dtype": dtype, "dataset": dataset, "drafter": mode,
                         **tallies[(dataset, mode)].to_json(tallies[(dataset, PLAIN)])})
    rows += [{"target_dtype": dtype, "dataset": "all", "drafter": m, **totals[m].to_json(totals[PLAIN])}
             for m in modes]
    return rows


def render_tables(results: dict) -> str:
    """The results as the tables of the issue note."""
    s = results["settings"]
    k, drafters, datasets = s["k"], s["drafters"], [*s["datasets"], "all"]
    target = format_table(
        f"Target forward, batch 1 (median of {s['decode_steps']} steps after a {s['probe_prompt_tokens']}-token "
        f"prompt; {results['environment']['threads']} torch threads)",
        ["dtype", "decode ms (1 token)", f"verify ms ({k + 1} tokens)"],
        [[t["dtype"], fmt(t["decode_ms"], 1), fmt(t["verify_ms"], 1)] for t in results["target"]])
    plain_ms = results["target"][0]["decode_ms"]
    costs = format_table(
        f"Drafters: ms per draft token (batch 1, k={k}); ratio to one {results['target'][0]['dtype']} decode step",
        ["drafter", "kind/variant", "ms/token", "x target"],
        [[d["name"], d["variant"] or d["kind"], fmt(d["ms_per_draft_token"], 3),
          fmt(d["ms_per_draft_token"] / plain_ms if d["ms_per_draft_token"] is not None else None, 3)]
         for d in results["drafters"]])
    tables = [target, costs]
    if results.get("acceptance_by_position"):
        tables.append(format_table(
            f"Greedy acceptance by draft position, k={k} (chains from every point of plain decoding's outputs, "
            f"{results['target'][0]['dtype']} target): P(position j accepted); tau = tokens per verify with the "
            f"bonus token",
            ["drafter", "dataset", *(f"pos {j + 1}" for j in range(k)), "accepted/verify", "tau", "chains"],
            [[a["drafter"], a["dataset"], *(fmt(x, 3) for x in a["by_position"]), fmt(a["mean_accepted"], 2),
              fmt(a["tau"], 2), str(a["num_chains"])] for a in results["acceptance_by_position"]]))
    for dtype in dict.fromkeys(c["target_dtype"] for c in results["cells"]):
        cell = {(c["dataset"], c["drafter"]): c for c in results["cells"] if c["target_dtype"] == dtype}

        def matrix(title: str, field: str, rows: list[str], digits: int = 2) -> str:
            return format_table(title, ["drafter", *datasets],
                                [[r, *(fmt(cell[(d, r)][field], digits) for d in datasets)] for r in rows])

        where = f"{dtype} target, {s['num_prompts']} prompts/dataset, {s['max_tokens']} tokens max, batch 1"
        tables += [matrix(f"Plain decoding tokens/s ({where})", "tokens_per_s", [PLAIN], 1),
                   matrix(f"Greedy acceptance rate, accepted/drafted ({where})", "acceptance_rate", drafters),
                   matrix(f"End-to-end speedup over plain decoding, tokens/s ratio ({where})", "speedup", drafters),
                   matrix(f"Output tokens matching plain decoding before the first divergence ({where})",
                          "match_rate", drafters, 3)]
    return "\n\n".join(tables)
