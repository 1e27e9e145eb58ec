"""`spind bench decode`: what a decode step, a verify and a generated token cost per target dtype, batch 1.

All in one process, side by side and interleaved (timings on a shared machine are noisy; ratios hold):
- targets (float32, bfloat16, int8, int4, gguf ...): load s, prefill ms of the probe prompt, median ms of a
  1-token decode step and of a (k+1)-token verify, their ratio, MB of weights a decode step reads, and the
  lm_head GEMM alone at 1, 5 and 16 rows; its prefill logits against float32's, and whether a (k+1)-row verify
  gives bit-identical logits to one-row decode steps (batch invariance: what keeps speculation exact);
- drafters against the configured target: median ms per draft token and its ratio to one target decode step;
- per prompt kind: ms per generated token (wall time from the prompt to the last of `max_tokens` tokens,
  prefill included, EOS ignored) of each target's plain decoding, of the configured target with each drafter,
  and of llama.cpp's plain decoding of the same GGUF at the same thread count (`--llama-cpp`); the best
  drafter per kind; geometric means over kinds; how many speculative outputs equal plain decoding.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from spind.bench.datasets import DEFAULT_DATASETS_DIR, encode_prompt, load_prompts
from spind.bench.drafters import PLAIN, Tally, time_target_steps, with_target_dtype
from spind.bench.report import Progress, fmt, format_table, timed
from spind.config import SpindConfig
from spind.coordinator.local import GenRequest, LocalEngine
from spind.models.llama import LlamaModel
from spind.models.loader import gguf_source, resolve_model_dir
from spind.models.runner import ForwardItem, ModelRunner
from spind.params import SamplingParams
from spind.worker.profile import time_draft_tokens

LLAMA_CPP = "llama.cpp"
LM_HEAD_ROWS = (1, 5, 16)


@dataclass(frozen=True)
class DecodeBenchSettings:
    dtypes: tuple[str, ...]  # targets timed side by side (the configured one is always included)
    drafters: tuple[str, ...]
    datasets: tuple[str, ...]
    num_prompts: int = 4
    max_tokens: int = 64
    k: int = 4
    steps: int = 32
    llama_cpp: bool = False
    datasets_dir: Path = DEFAULT_DATASETS_DIR


def weight_megabytes(model: LlamaModel) -> float:
    """MB a decode step reads: every module's parameters and buffers but the embedding table's (one row is read;
    a tied lm_head still counts) and the RoPE tables."""
    tensors = {id(t): t for name, module in model.named_modules() if name != "embed_tokens"
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
    for table in (model.rope_cos, model.rope_sin):
        tensors.pop(id(table), None)
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6


def time_prefill(runtimes: dict[str, LocalEngine], prompt: list[int], rounds: int) -> dict[str, float]:
    """Median ms of a prefill of `prompt` per target, interleaved."""
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(rounds):
        for dtype, rt in runtimes.items():
            runner = ModelRunner(rt.target.runner.model, -(-len(prompt) // 16), 16, rt.cfg.runtime.attention)
            runner.add_request("prefill")
            start = time.perf_counter()
            runner.forward([ForwardItem("prefill", prompt)])
            times[dtype].append((time.perf_counter() - start) * 1e3)
    return {dtype: statistics.median(t) for dtype, t in times.items()}


def time_lm_heads(models: dict[str, LlamaModel], rows: tuple[int, ...], rounds: int) -> dict[str, dict[int, float]]:
    """Median ms of each target's lm_head GEMM (vocabulary x hidden: a fifth of this model's weights) at `rows`
    rows, interleaved: a small-row GEMM that reads its weights once costs little more at 5 rows than at 1."""
    hidden = next(iter(models.values())).args.hidden_size
    xs = {n: torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)) for n in rows}
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    with torch.inference_mode():
        for _ in range(rounds):
            for dtype, model in models.items():
                for n in rows:
                    x = xs[n].to(model.dtype)
                    times[(dtype, n)].append(timed(lambda: model.lm_head(x)))
    return {dtype: {n: statistics.median(times[(dtype, n)]) for n in rows} for dtype in models}


def check_numerics(models: dict[str, LlamaModel], prompt: list[int], k: int, attention: str) -> dict[str, dict]:
    """Per target: its prefill logits against float32's (max |difference|, share of equal argmaxes), and whether a
    (k+1)-row verify gives bit-identical logits to k+1 one-row decode steps (batch invariance)."""
    reference = models.get("float32")
    draft = prompt[-k - 1:]
    out: dict[str, dict] = {}
    logits: dict[str, torch.Tensor] = {}
    for dtype, model in models.items():
        runner = ModelRunner(model, -(-(2 * len(prompt) + 2 * k + 2) // 16), 16, attention)
        runner.add_request("check")
        logits[dtype] = runner.forward([ForwardItem("check", prompt, len(prompt))])[0]
        verify = runner.forward([ForwardItem("check", draft, len(draft))])[0]
        runner.truncate("check", len(prompt))
        decode = torch.cat([runner.forward([ForwardItem("check", [t])])[0] for t in draft])
        out[dtype] = {"verify_equals_decode": torch.equal(verify, decode)}
    for dtype in models:
        ref = logits["float32"] if reference is not None else None
        out[dtype]["max_logit_diff_vs_float32"] = None if ref is None else (logits[dtype] - ref).abs().max().item()
        out[dtype]["argmax_agreement_vs_float32"] = (None if ref is None else
                                                     (logits[dtype].argmax(-1) == ref.argmax(-1)).float().mean().item())
    return out


def run_decode_bench(cfg: SpindConfig, settings: DecodeBenchSettings) -> dict:
    texts = {name: load_prompts(name, settings.num_prompts, settings.datasets_dir) for name in settings.datasets}
    main = cfg.model.dtype
    start = time.perf_counter()
    rt = LocalEngine.load(cfg, drafters=list(settings.drafters))
    load_s = {main: time.perf_counter() - start}
    runtimes = {main: rt}
    try:
        for dtype in settings.dtypes:
            if dtype not in runtimes:
                start = time.perf_counter()
                runtimes[dtype] = with_target_dtype(cfg, dtype)
                load_s[dtype] = time.perf_counter() - start
        return _measure(cfg, settings, texts, runtimes, load_s)
    finally:
        for r in runtimes.values():
            r.close()


def _measure(cfg: SpindConfig, settings: DecodeBenchSettings, texts: dict[str, list[str]],
             runtimes: dict[str, LocalEngine], load_s: dict[str, float]) -> dict:
    main = cfg.model.dtype
    rt = runtimes[main]
    prompts = {name: [encode_prompt(rt.tokenizer, p) for p in ps] for name, ps in texts.items()}
    probe = max((ids for ps in prompts.values() for ids in ps), key=len)
    modes = [None, *settings.drafters]
    num_prompts = sum(map(len, prompts.values()))
    progress = Progress(total=5 + num_prompts * (len(modes) + len(runtimes) - 1 + settings.llama_cpp))

    models = {dtype: r.target.runner.model for dtype, r in runtimes.items()}
    steps = time_target_steps(models, probe, settings.steps, settings.k, cfg.runtime.kv_block_size,
                              cfg.runtime.attention)
    progress.step(f"target steps: {len(models)} dtypes x {settings.steps} rounds")
    prefill = time_prefill(runtimes, probe, 3)
    progress.step(f"prefill of {len(probe)} tokens: {len(models)} dtypes x 3 rounds")
    heads = time_lm_heads(models, LM_HEAD_ROWS, settings.steps)
    progress.step(f"lm_head GEMMs: {len(models)} dtypes x {settings.steps} rounds")
    numerics = check_numerics(models, probe, settings.k, cfg.runtime.attention)
    progress.step(f"numerics: {len(models)} dtypes against float32, verify vs decode rows")
    draft_ms = time_draft_tokens(rt.drafters, probe, settings.k, settings.steps)
    progress.step(f"draft tokens: {len(rt.drafters)} drafters x {settings.steps} rounds")

    params = SamplingParams(max_tokens=settings.max_tokens, ignore_eos=True)
    llama = _llama_cpp(cfg, settings) if settings.llama_cpp else None
    for r in runtimes.values():  # warm-up: first calls build per-shape state
        r.generate([GenRequest("warm", probe[:32], SamplingParams(max_tokens=4), None, settings.k)])
    tallies: dict[tuple[str, str, str], Tally] = defaultdict(Tally)  # (target, dataset, mode)
    for dataset, id_lists in prompts.items():
        for i, ids in enumerate(id_lists):
            plain = None
            for mode in modes:  # the configured target: plain, then every drafter, back to back
                res = rt.generate([GenRequest(f"{dataset}-{i}-{mode}", ids, params, mode, settings.k)])[0]
                plain = plain or res
                tallies[(main, dataset, mode or PLAIN)].add(res, plain)
                progress.step(f"{main} {dataset} #{i} {mode or PLAIN}: {res.elapsed_s * 1e3 / len(res.token_ids):.1f} "
                              f"ms/token, accepted {res.num_accepted}/{res.num_drafted}")
            for dtype, other in runtimes.items():
                if dtype != main:
                    res = other.generate([GenRequest(f"{dtype}-{dataset}-{i}", ids, params, None, settings.k)])[0]
                    tallies[(dtype, dataset, PLAIN)].add(res, res)
                    progress.step(f"{dtype} {dataset} #{i} plain: {res.elapsed_s * 1e3 / len(res.token_ids):.1f} ms/token")
            if llama is not None:
                tokens, elapsed = llama.generate(ids, settings.max_tokens)
                cell = tallies[(LLAMA_CPP, dataset, PLAIN)]
                cell.num_prompts += 1
                cell.num_tokens += len(tokens)
                cell.elapsed_s += elapsed
                progress.step(f"{LLAMA_CPP} {dataset} #{i}: {elapsed * 1e3 / len(tokens):.1f} ms/token")
    return {
        "settings": {**dataclasses.asdict(settings), "datasets_dir": str(settings.datasets_dir),
                     "probe_prompt_tokens": len(probe), "target_dtype": main},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "model": cfg.model.target, "attention": cfg.runtime.attention},
        "targets": [{"dtype": dtype, "load_s": load_s[dtype], "prefill_ms": prefill[dtype],
                     "weights_mb": weight_megabytes(models[dtype]), **steps[dtype],
                     "lm_head_ms": {str(n): ms for n, ms in heads[dtype].items()}, **numerics[dtype],
                     "verify_over_decode": steps[dtype]["verify_ms"] / steps[dtype]["decode_ms"]} for dtype in runtimes],
        "drafters": [{"name": name, "kind": cfg.drafter(name).kind, "variant": cfg.drafter(name).variant,
                      "ms_per_draft_token": draft_ms[name],
                      "over_target_decode": draft_ms[name] / steps[main]["decode_ms"] if draft_ms[name] else None}
                     for name in settings.drafters],
        "per_token": _per_token(tallies, settings, main, list(runtimes), llama is not None),
    }


def _llama_cpp(cfg: SpindConfig, settings: DecodeBenchSettings):
    from spind.bench.llamacpp import LlamaCppDecoder

    gguf = gguf_source(resolve_model_dir(cfg.model.target, cfg.cache_path))
    if gguf is None:
        raise ValueError("--llama-cpp compares against the target's GGUF; this target is not a GGUF")
    return LlamaCppDecoder(gguf, torch.get_num_threads(), cfg.model.max_model_len)


def _per_token(tallies: dict[tuple[str, str, str], Tally], settings: DecodeBenchSettings, main: str,
               dtypes: list[str], has_llama: bool) -> list[dict]:
    """One row per (system, dataset) with ms per generated token, plus the best drafter and geometric means."""
    systems = [(main, m) for m in [PLAIN, *settings.drafters]] + [(d, PLAIN) for d in dtypes if d != main]
    systems += [(LLAMA_CPP, PLAIN)] if has_llama else []
    rows = []
    for target, mode in systems:
        for dataset in settings.datasets:
            cell = tallies[(target, dataset, mode)]
            plain = tallies[(target, dataset, PLAIN)]
            rows.append({"target": target, "drafter": mode, "dataset": dataset, **cell.to_json(plain),
                         "ms_per_token": cell.elapsed_s * 1e3 / cell.num_tokens if cell.num_tokens else None})
    for dataset in settings.datasets:  # the configured target's best mode per prompt kind
        mine = [r for r in rows if r["target"] == main and r["dataset"] == dataset]
        best = min(mine, key=lambda r: r["ms_per_token"])
        rows.append({**best, "drafter": "best", "best_of": best["drafter"]})
    return rows


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values and all(v > 0 for v in values) else None


def render_tables(results: dict) -> str:
    s, env = results["settings"], results["environment"]
    k = s["k"]
    targets = format_table(
        f"Targets, batch 1, {env['threads']} threads, attention={env['attention']} (medians of {s['steps']} interleaved "
        f"rounds after a {s['probe_prompt_tokens']}-token prompt)",
        ["dtype", "MB/step", "prefill ms", "decode ms (1)", f"verify ms ({k + 1})", "verify/decode", "load s"],
        [[t["dtype"], fmt(t["weights_mb"], 0), fmt(t["prefill_ms"], 0), fmt(t["decode_ms"], 2), fmt(t["verify_ms"], 2),
          fmt(t["verify_over_decode"], 2), fmt(t["load_s"], 1)] for t in results["targets"]])
    one, *more = list(results["targets"][0]["lm_head_ms"])
    heads = format_table(
        "lm_head GEMM alone (vocabulary x hidden): ms by rows, and the ratio to 1 row",
        ["dtype", f"{one} row", *(f"{n} rows" for n in more), *(f"{n} / {one}" for n in more)],
        [[t["dtype"], *(fmt(t["lm_head_ms"][n], 2) for n in (one, *more)),
          *(fmt(t["lm_head_ms"][n] / t["lm_head_ms"][one], 2) for n in more)] for t in results["targets"]])
    numerics = format_table(
        f"Numerics on the {s['probe_prompt_tokens']}-token prompt: prefill logits against the float32 target, and "
        f"whether a {k + 1}-row verify gives bit-identical logits to {k + 1} one-row decode steps",
        ["dtype", "max |logit diff|", "argmax agreement", "verify == decode"],
        [[t["dtype"], fmt(t["max_logit_diff_vs_float32"], 6), fmt(t["argmax_agreement_vs_float32"], 3),
          "yes" if t["verify_equals_decode"] else "no"] for t in results["targets"]])
    drafters = format_table(
        f"Drafters against the {s['target_dtype']} target: ms per draft token (batch 1, k={k})",
        ["drafter", "kind/variant", "ms/token", "x target decode"],
        [[d["name"], d["variant"] or d["kind"], fmt(d["ms_per_draft_token"], 2), fmt(d["over_target_decode"], 2)]
         for d in results["drafters"]])
    datasets = s["datasets"]
    cells = {(r["target"], r["drafter"], r["dataset"]): r for r in results["per_token"]}
    systems = list(dict.fromkeys((r["target"], r["drafter"]) for r in results["per_token"]))
    rows = []
    for target, mode in systems:
        ms = [cells[(target, mode, d)]["ms_per_token"] for d in datasets]
        acc = [cells[(target, mode, d)]["acceptance_rate"] for d in datasets]
        label = target if mode == PLAIN else f"{target} + {mode}"
        notes = ([cells[(target, mode, d)]["best_of"] for d in datasets] if mode == "best"
                 else [None if a is None else fmt(a, 2) for a in acc])
        rows.append([label, *(fmt(m, 1) + (f" ({n})" if n and mode != PLAIN else "") for m, n in zip(ms, notes)),
                     fmt(geomean([m for m in ms if m is not None]), 1)])
    per_token = format_table(
        f"ms per generated token ({s['max_tokens']} tokens, prefill included, {s['num_prompts']} prompts per kind, "
        f"batch 1, {env['threads']} threads); (acceptance) for drafters, (drafter) for the best per kind",
        ["system", *datasets, "geomean"], rows)
    exact = [r for r in results["per_token"] if r["target"] == s["target_dtype"] and r["drafter"] not in (PLAIN, "best")]
    identical = sum(r["num_identical"] for r in exact)
    total = sum(r["num_prompts"] for r in exact)
    note = (f"speculative outputs of the {s['target_dtype']} target equal to its plain decoding: {identical}/{total}")
    return "\n\n".join([targets, heads, numerics, drafters, per_token, note])
