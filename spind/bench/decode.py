"""`spind bench decode`: what a decode step, a verify and a generated token cost per target dtype, batch 1.

All in one process, side by side and interleaved (timings on a shared machine are noisy; ratios hold), at each
thread count of `--threads` (e.g. `1,2`) in turn:
- targets (float32, bfloat16, int8, int4, gguf, gguf-q8 ...): load s, prefill ms of the probe prompt, time to first
  token of a `--ttft-tokens` prompt, median ms of a 1-token decode step and of verifies of k + 1 and
  `--verify-rows` rows, their ratios to the step, MB of weights a step reads and its byte floor (those bytes over the
  machine's memcpy and read bandwidth at the same threads), and the lm_head GEMM alone at 1, 5 and 16 rows; its
  prefill logits against float32's, and whether a (k+1)-row verify gives bit-identical logits to one-row decode steps
  (batch invariance: what keeps speculation exact);
- drafters against the configured target: median ms per draft token and its ratio to one target decode step;
- per prompt kind: ms per generated token (wall time from the prompt to the last of `max_tokens` tokens,
  prefill included, EOS ignored) of each target's plain decoding, of the configured target with each drafter,
  and of llama.cpp's plain decoding of the same GGUF at the same thread count (`--llama-cpp`, which also times its
  first token of the long prompt); the best drafter per kind; geometric means over kinds; how many speculative
  outputs equal plain decoding;
- once: each target's quality against the `gguf` (fp32-activation) target, else float32: top-1 agreement over
  `--quality-positions` positions of AlpacaEval's reference outputs, and their perplexity (spind/bench/quality.py).
The kernel build each run used (`SPIND_CPU_ISA` forces one) is in the tables' titles and the JSON.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from spind.bench.datasets import DEFAULT_DATASETS_DIR, encode_prompt, load_prompts
from spind.bench.drafters import PLAIN, Tally, time_target_steps, with_target_dtype
from spind.bench.quality import compare_quality, memory_bandwidth, quality_windows, time_first_token
from spind.bench.report import Progress, fmt, format_table, timed
from spind.config import SpindConfig, with_resolved_dtype
from spind.coordinator.transport.local import GenRequest, LocalEngine
from spind.kernels import cpu_ext
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
    threads: tuple[int, ...] = (1,)  # each a pass of every measure but quality
    verify_rows: tuple[int, ...] = (9,)  # verify widths timed beside k + 1
    ttft_tokens: int = 1000  # prompt length of the time-to-first-token measure (0: skip)
    quality_positions: int = 2048  # positions of the quality text scored (0: skip)


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
    cfg = with_resolved_dtype(cfg, resolve_model_dir(cfg.model.target, cfg.cache_path))  # runs are keyed by dtype
    texts = {name: load_prompts(name, settings.num_prompts, settings.datasets_dir) for name in settings.datasets}
    runs, quality = [], None
    for threads in settings.threads:
        torch.set_num_threads(threads)
        # the target keeps `threads` whatever drafts beside it (adaptive threads would give it every core)
        cfg_t = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, threads=threads,
                                                                     adaptive_threads=False))
        runtimes, load_s = _load_targets(cfg_t, settings)
        try:
            if quality is None and settings.quality_positions:
                quality = _quality(cfg, settings, runtimes)
            runs.append(_measure(cfg_t, settings, texts, runtimes, load_s))
        finally:
            for r in runtimes.values():
                r.close()
    main = cfg.model.dtype
    return {
        "settings": {**dataclasses.asdict(settings), "datasets_dir": str(settings.datasets_dir), "target_dtype": main},
        "environment": {"torch": torch.__version__, "cpu_count": os.cpu_count(), "model": cfg.model.target,
                        "attention": cfg.runtime.attention, "kernels": cpu_ext.describe(), "cpu": _cpu_name()},
        "quality": quality, "runs": runs,
    }


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _load_targets(cfg: SpindConfig, settings: DecodeBenchSettings) -> tuple[dict[str, LocalEngine], dict[str, float]]:
    main = cfg.model.dtype
    start = time.perf_counter()
    runtimes = {main: LocalEngine.load(cfg, drafters=list(settings.drafters))}
    load_s = {main: time.perf_counter() - start}
    try:
        for dtype in settings.dtypes:
            if dtype not in runtimes:
                start = time.perf_counter()
                runtimes[dtype] = with_target_dtype(cfg, dtype)
                load_s[dtype] = time.perf_counter() - start
    except BaseException:
        for r in runtimes.values():
            r.close()
        raise
    return runtimes, load_s


def _quality(cfg: SpindConfig, settings: DecodeBenchSettings, runtimes: dict[str, LocalEngine]) -> dict:
    models = {dtype: r.target.runner.model for dtype, r in runtimes.items()}
    reference = "gguf" if "gguf" in models else "float32" if "float32" in models else None
    if reference is None:
        return {"reference": None, "targets": {}}
    tokenizer = runtimes[cfg.model.dtype].tokenizer
    windows = quality_windows(tokenizer, settings.datasets_dir, settings.quality_positions)
    print(f"quality: {len(models)} targets over {sum(len(w) - 1 for w in windows)} positions", file=sys.stderr)
    return {"reference": reference, "targets": compare_quality(models, reference, windows, cfg.runtime.attention,
                                                               cfg.runtime.kv_block_size)}


def _measure(cfg: SpindConfig, settings: DecodeBenchSettings, texts: dict[str, list[str]],
             runtimes: dict[str, LocalEngine], load_s: dict[str, float]) -> dict:
    main = cfg.model.dtype
    rt = runtimes[main]
    threads = torch.get_num_threads()
    prompts = {name: [encode_prompt(rt.tokenizer, p) for p in ps] for name, ps in texts.items()}
    probe = max((ids for ps in prompts.values() for ids in ps), key=len)
    modes = [None, *settings.drafters]
    num_prompts = sum(map(len, prompts.values()))
    progress = Progress(total=7 + num_prompts * (len(modes) + len(runtimes) - 1 + settings.llama_cpp))

    models = {dtype: r.target.runner.model for dtype, r in runtimes.items()}
    bandwidth = memory_bandwidth()
    progress.step(f"{threads} threads: memory bandwidth {bandwidth['read_gbps']:.1f} GB/s read, "
                  f"{bandwidth['memcpy_gbps']:.1f} GB/s memcpy")
    steps = time_target_steps(models, probe, settings.steps, settings.k, cfg.runtime.kv_block_size,
                              cfg.runtime.attention, settings.verify_rows)
    progress.step(f"target steps: {len(models)} dtypes x {settings.steps} rounds")
    prefill = time_prefill(runtimes, probe, 3)
    progress.step(f"prefill of {len(probe)} tokens: {len(models)} dtypes x 3 rounds")
    long_prompt = _long_prompt(rt, settings)
    llama = _llama_cpp(cfg, settings) if settings.llama_cpp else None
    ttft = {dtype: time_first_token(m, long_prompt, cfg.runtime.attention, cfg.runtime.kv_block_size)
            for dtype, m in models.items()} if long_prompt else {}
    if llama is not None and long_prompt:
        ttft[LLAMA_CPP] = statistics.median(llama.generate(long_prompt, 1)[1] * 1e3 for _ in range(3))
    progress.step(f"first token of a {len(long_prompt)}-token prompt: {len(ttft)} systems")
    heads = time_lm_heads(models, LM_HEAD_ROWS, settings.steps)
    progress.step(f"lm_head GEMMs: {len(models)} dtypes x {settings.steps} rounds")
    numerics = check_numerics(models, probe, settings.k, cfg.runtime.attention)
    progress.step(f"numerics: {len(models)} dtypes against float32, verify vs decode rows")
    draft_ms = time_draft_tokens(rt.drafters, probe, settings.k, settings.steps)
    progress.step(f"draft tokens: {len(rt.drafters)} drafters x {settings.steps} rounds")

    params = SamplingParams(max_tokens=settings.max_tokens, ignore_eos=True)
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
    targets = []
    for dtype in runtimes:
        mb, st = weight_megabytes(models[dtype]), steps[dtype]
        targets.append({
            "dtype": dtype, "load_s": load_s[dtype], "prefill_ms": prefill[dtype], "ttft_ms": ttft.get(dtype),
            "weights_mb": mb, **st, "lm_head_ms": {str(n): ms for n, ms in heads[dtype].items()}, **numerics[dtype],
            "verify_over_decode": st["verify_ms"] / st["decode_ms"],
            "verify_over_decode_by_rows": {n: ms / st["decode_ms"] for n, ms in st["verify_ms_by_rows"].items()},
            "floor_ms": {kind: mb / gbps for kind, gbps in (("read", bandwidth["read_gbps"]),
                                                             ("memcpy", bandwidth["memcpy_gbps"]))}})
    return {
        "threads": threads, "probe_prompt_tokens": len(probe), "ttft_prompt_tokens": len(long_prompt),
        "bandwidth": bandwidth, "llama_cpp_ttft_ms": ttft.get(LLAMA_CPP), "targets": targets,
        "drafters": [{"name": name, "kind": cfg.drafter(name).kind, "variant": cfg.drafter(name).variant,
                      "ms_per_draft_token": draft_ms[name],
                      "over_target_decode": draft_ms[name] / steps[main]["decode_ms"] if draft_ms[name] else None}
                     for name in settings.drafters],
        "per_token": _per_token(tallies, settings, main, list(runtimes), llama is not None),
    }


def _long_prompt(rt: LocalEngine, settings: DecodeBenchSettings) -> list[int]:
    """`ttft_tokens` tokens of the quality text (AlpacaEval's outputs), or none when that measure is off."""
    if not settings.ttft_tokens:
        return []
    windows = quality_windows(rt.tokenizer, settings.datasets_dir, settings.ttft_tokens, settings.ttft_tokens + 1)
    return windows[0][:settings.ttft_tokens]


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
    where = f"{env['cpu'] or 'CPU'}, kernels {env['kernels'] or 'none (torch fallback)'}"
    parts = [f"{where}; {env['cpu_count']} cores"]
    for run in results["runs"]:
        parts += _run_tables(s, env, run)
    if len(results["runs"]) > 1:
        parts.append(_threads_table(results["runs"]))
    if results["runs"] and results["runs"][0].get("llama_cpp_ttft_ms") is not None or any(
            r["target"] == LLAMA_CPP for run in results["runs"] for r in run["per_token"]):
        parts.append(_llama_table(s, results["runs"]))
    if results.get("quality") and results["quality"]["reference"]:
        q = results["quality"]
        first = next(iter(q["targets"].values()))
        parts.append(format_table(
            f"Quality against the {q['reference']} target with an fp32 KV cache over {first['positions']} positions of AlpacaEval's reference "
            "outputs: top-1 agreement, and the text's perplexity",
            ["dtype", "top-1 agreement", "perplexity", f"/ {q['reference']}"],
            [[d, fmt(t["top1_agreement"] * 100, 2) + " %", fmt(t["perplexity"], 3), fmt(t["perplexity_ratio"], 4)]
             for d, t in q["targets"].items()]))
    return "\n\n".join(parts)


def _run_tables(s: dict, env: dict, run: dict) -> list[str]:
    k, threads = s["k"], run["threads"]
    rows = sorted({int(n) for t in run["targets"] for n in t["verify_ms_by_rows"]})
    targets = format_table(
        f"Targets, batch 1, {threads} threads, attention={env['attention']} (medians of {s['steps']} interleaved "
        f"rounds after a {run['probe_prompt_tokens']}-token prompt; TTFT: a {run['ttft_prompt_tokens']}-token prompt)",
        ["dtype", "MB/step", "prefill ms", "TTFT ms", "decode ms (1)", *(f"verify ms ({n})" for n in rows),
         *(f"verify({n})/decode" for n in rows), "load s"],
        [[t["dtype"], fmt(t["weights_mb"], 0), fmt(t["prefill_ms"], 0), fmt(t["ttft_ms"], 0), fmt(t["decode_ms"], 2),
          *(fmt(_by_rows(t["verify_ms_by_rows"], n), 2) for n in rows),
          *(fmt(_by_rows(t["verify_over_decode_by_rows"], n), 2) for n in rows), fmt(t["load_s"], 1)]
         for t in run["targets"]])
    bw = run["bandwidth"]
    floor = format_table(
        f"Byte floor, {threads} threads: MB a step reads over this machine's bandwidth at the same threads (read: a sum "
        f"over huge-page memory, {bw['read_gbps']:.1f} GB/s; memcpy: bytes copied, {bw['memcpy_gbps']:.1f} GB/s)",
        ["dtype", "decode ms", "floor ms (read)", "decode / floor (read)", "floor ms (memcpy)",
         "decode / floor (memcpy)"],
        [[t["dtype"], fmt(t["decode_ms"], 2), fmt(t["floor_ms"]["read"], 2),
          fmt(t["decode_ms"] / t["floor_ms"]["read"], 2), fmt(t["floor_ms"]["memcpy"], 2),
          fmt(t["decode_ms"] / t["floor_ms"]["memcpy"], 2)] for t in run["targets"]])
    one, *more = list(run["targets"][0]["lm_head_ms"])
    heads = format_table(
        f"lm_head GEMM alone (vocabulary x hidden), {threads} threads: ms by rows, and the ratio to 1 row",
        ["dtype", f"{one} row", *(f"{n} rows" for n in more), *(f"{n} / {one}" for n in more)],
        [[t["dtype"], *(fmt(t["lm_head_ms"][n], 2) for n in (one, *more)),
          *(fmt(t["lm_head_ms"][n] / t["lm_head_ms"][one], 2) for n in more)] for t in run["targets"]])
    numerics = format_table(
        f"Numerics on the {run['probe_prompt_tokens']}-token prompt: prefill logits against the float32 target, and "
        f"whether a {k + 1}-row verify gives bit-identical logits to {k + 1} one-row decode steps",
        ["dtype", "max |logit diff|", "argmax agreement", "verify == decode"],
        [[t["dtype"], fmt(t["max_logit_diff_vs_float32"], 6), fmt(t["argmax_agreement_vs_float32"], 3),
          "yes" if t["verify_equals_decode"] else "no"] for t in run["targets"]])
    drafters = format_table(
        f"Drafters against the {s['target_dtype']} target: ms per draft token (batch 1, k={k}, {threads} threads)",
        ["drafter", "kind/variant", "ms/token", "x target decode"],
        [[d["name"], d["variant"] or d["kind"], fmt(d["ms_per_draft_token"], 2), fmt(d["over_target_decode"], 2)]
         for d in run["drafters"]])
    datasets = s["datasets"]
    cells = {(r["target"], r["drafter"], r["dataset"]): r for r in run["per_token"]}
    systems = list(dict.fromkeys((r["target"], r["drafter"]) for r in run["per_token"]))
    table = []
    for target, mode in systems:
        ms = [cells[(target, mode, d)]["ms_per_token"] for d in datasets]
        acc = [cells[(target, mode, d)]["acceptance_rate"] for d in datasets]
        label = target if mode == PLAIN else f"{target} + {mode}"
        notes = ([cells[(target, mode, d)]["best_of"] for d in datasets] if mode == "best"
                 else [None if a is None else fmt(a, 2) for a in acc])
        table.append([label, *(fmt(m, 1) + (f" ({n})" if n and mode != PLAIN else "") for m, n in zip(ms, notes)),
                      fmt(geomean([m for m in ms if m is not None]), 1)])
    per_token = format_table(
        f"ms per generated token ({s['max_tokens']} tokens, prefill included, {s['num_prompts']} prompts per kind, "
        f"batch 1, {threads} threads); (acceptance) for drafters, (drafter) for the best per kind",
        ["system", *datasets, "geomean"], table)
    exact = [r for r in run["per_token"] if r["target"] == s["target_dtype"] and r["drafter"] not in (PLAIN, "best")]
    identical = sum(r["num_identical"] for r in exact)
    total = sum(r["num_prompts"] for r in exact)
    note = f"speculative outputs of the {s['target_dtype']} target equal to its plain decoding: {identical}/{total}"
    return [targets, floor, heads, numerics, drafters, per_token, note]


def _by_rows(values: dict, n: int) -> float | None:
    """A per-rows dict read back from JSON (string keys) or built here (int keys)."""
    return values.get(n, values.get(str(n)))


def _plain_geomean(run: dict, target: str) -> float | None:
    return geomean([r["ms_per_token"] for r in run["per_token"] if r["target"] == target and r["drafter"] == PLAIN
                    and r["ms_per_token"]])


def _threads_table(runs: list[dict]) -> str:
    """Each target's times at every thread count over its time at the first."""
    base, rest = runs[0], runs[1:]
    rows = []
    for t0 in base["targets"]:
        others = [next(t for t in run["targets"] if t["dtype"] == t0["dtype"]) for run in rest]
        n_rows = max(int(n) for n in t0["verify_ms_by_rows"])
        for name, get in (("decode(1)", lambda t: t["decode_ms"]), ("verify(5)", lambda t: _by_rows(
                t["verify_ms_by_rows"], 5)), (f"verify({n_rows})", lambda t: _by_rows(t["verify_ms_by_rows"], n_rows)),
                          ("TTFT", lambda t: t["ttft_ms"]), ("ms/token (plain, geomean)", None)):
            if get is None:
                values = [_plain_geomean(run, t0["dtype"]) for run in runs]
            else:
                values = [get(t) for t in (t0, *others)]
            if values[0] is None:
                continue
            rows.append([t0["dtype"], name, *(fmt(v, 2) for v in values),
                         *(fmt(values[0] / v, 2) if v else "-" for v in values[1:])])
    threads = [run["threads"] for run in runs]
    return format_table(f"Threads: ms at {', '.join(map(str, threads))} threads, and the speedup over {threads[0]}",
                        ["dtype", "measure", *(f"{n} thr ms" for n in threads),
                         *(f"x at {n} thr" for n in threads[1:])], rows)


def _llama_table(s: dict, runs: list[dict]) -> str:
    """Each target against llama.cpp on the same GGUF and threads: ms per generated token (plain decoding, prefill
    included, geomean over the prompt kinds) and time to the first token of the long prompt."""
    rows = []
    for run in runs:
        llama_ms, llama_ttft = _plain_geomean(run, LLAMA_CPP), run.get("llama_cpp_ttft_ms")
        for t in run["targets"]:
            ms = _plain_geomean(run, t["dtype"])
            rows.append([str(run["threads"]), t["dtype"], fmt(ms, 2), fmt(llama_ms, 2),
                         fmt(llama_ms / ms, 2) if ms and llama_ms else "-", fmt(t["ttft_ms"], 0), fmt(llama_ttft, 0),
                         fmt(llama_ttft / t["ttft_ms"], 2) if llama_ttft and t["ttft_ms"] else "-"])
    return format_table(
        "Against llama.cpp on the same GGUF and threads: ms per generated token (plain, prefill included, geomean "
        f"over {', '.join(s['datasets'])}) and ms to the first token of the long prompt; x = llama.cpp / spind",
        ["threads", "dtype", "ms/token", "llama.cpp", "x faster", "TTFT ms", "llama.cpp TTFT", "x faster"], rows)
