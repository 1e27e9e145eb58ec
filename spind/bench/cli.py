"""`spind bench ...` subcommands: each prints a table, writes JSON, and reports progress on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Callable

from spind.bench.datasets import DEFAULT_DATASETS_DIR, MIX, WORKLOADS, check_datasets_dir
from spind.cli_args import config_from_args
from spind.config import DTYPES, SpindConfig
from spind.coordinator.placement import usable_cores

if TYPE_CHECKING:
    from spind.bench.batch import BatchBenchSettings
    from spind.bench.decode import DecodeBenchSettings
    from spind.bench.drafters import DrafterBenchSettings
    from spind.bench.serve import ServeSettings
    from spind.bench.verify import VerifyBenchSettings

DEFAULT_DATASETS = ("alpaca", "mt_bench", "humaneval", "gsm8k", "passage")


def add_parsers(sub: argparse._SubParsersAction,
                add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `spind bench <name>` subcommands."""
    bench = sub.add_parser("bench", help="benchmarks: print a table, write JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from spind.bench import first_run  # no torch: it times `spind generate` in subprocesses

    first_run.add_parser(bench_sub)

    d = bench_sub.add_parser("drafters", help="cost, acceptance and speedup of every drafter, side by side")
    add_config_args(d)
    d.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                   help=f"comma-separated workloads from: {', '.join(WORKLOADS)}")
    d.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR,
                   help="the shared datasets folder (default: shared/datasets next to the repo checkout)")
    d.add_argument("--drafters", default=None, help="comma-separated drafter names (default: all configured)")
    d.add_argument("--num-prompts", type=int, default=6, help="prompts per dataset")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: config)")
    d.add_argument("--decode-steps", type=int, default=32, help="steps (and probe rounds) timed per forward kind")
    d.add_argument("--no-bf16", action="store_true", help="skip the bf16-target pass")
    d.add_argument("--out", type=Path, default=Path("bench-results/drafters.json"))
    d.set_defaults(func=cmd_bench_drafters)

    e = bench_sub.add_parser("e2e", help="the paper's evaluation: every system side by side on a workload")
    add_config_args(e, tensor_parallel=True)
    e.add_argument("--workload", default="mix",
                   help="alpaca, cp, mtbench, humaneval, gsm8k, passage, extract or mix (the shared datasets), or "
                        "your own prompts: FILE.jsonl, one JSON value per line, each a prompt string, "
                        '{"prompt": "..."} or an MT-bench record {"turns": ["...", ...]}')
    e.add_argument("--num-requests", type=int, default=24)
    e.add_argument("--batch-size", type=int, default=8, help="closed-loop clients (the paper's batch size)")
    e.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals per second")
    e.add_argument("--rounds", type=int, default=0,
                   help="closed loop: the spind systems take turns over this many slices of the requests (at least "
                        "two batches each; 1: one system after another; default 0: as many as the requests allow, "
                        "so that the host's drift in speed, seconds apart, falls on every system alike)")
    e.add_argument("--repeats", type=int, default=1,
                   help="closed loop: run the requests this many times, the spind systems on engines loaded afresh "
                        "each time and their turns' order going on where the last left off (a Williams square: with "
                        "R rounds and N systems, N / R repeats give every system every place, and N repeats give "
                        "each system the first turn after a load once); the ratios pool them")
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--workers", choices=("threads", "processes"), default="threads",
                   help="the spind systems' workers: threads of this process, or worker processes as `spind start` "
                        "runs them (the coordinator's Python then overlaps the forward instead of sharing its GIL)")
    e.add_argument("--systems", default="none,fixed:ngram,fixed:int8,spin,spin-nopipe,spin-nobatch-nopipe",
                   help="comma-separated: none, fixed:NAME, spin, spin-nopipe, spin-nobatch-nopipe, greedy-length, "
                        "epsilon-greedy, random, oracle, hf-plain, hf-assisted:NAME, hf-prompt-lookup; a spind "
                        "system may end in /SECTION.KEY=VALUE settings of its config (a row of its own: "
                        "spin/selection.price_margin=0.1), or in #N: one more engine of that system (none#2 beside "
                        "none: how far two engines of one system differ, the run's noise floor)")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--k", type=int, default=None, help="draft length of fixed:NAME (default: [speculation].k)")
    e.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    e.add_argument("--json", type=Path, default=Path("bench-results/e2e.json"))
    e.add_argument("--plot", type=Path, default=None, help="directory for PNG plots (needs the bench extra)")
    e.set_defaults(func=cmd_bench_e2e)

    pp = bench_sub.add_parser("pipeline", help="goodput vs micro-batches per SSM, pipeline on vs off, occupancy")
    add_config_args(pp, tensor_parallel=True)
    pp.add_argument("--workload", default="alpaca", help="prompts (a workload name or a prompt file)")
    pp.add_argument("--batch-sizes", default="1,8", help="comma-separated closed-loop client counts")
    pp.add_argument("--drafter", default="int8", help="the model drafter the pipeline overlaps with verification")
    pp.add_argument("--max-tokens", type=int, default=64)
    pp.add_argument("--max-micro-batches", type=int, default=9)
    pp.add_argument("--requests-per-client", type=int, default=2)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    pp.add_argument("--out", type=Path, default=Path("bench-results/pipeline.json"), help="JSON; the plot beside it")
    pp.set_defaults(func=cmd_bench_pipeline)

    c = bench_sub.add_parser("decode", help="ms per decode step, verify and generated token per target dtype, "
                                             "with drafters and against llama.cpp, side by side")
    add_config_args(c, thread_counts=True)
    c.add_argument("--dtypes", default="float32,bfloat16,int8,int4,gguf,gguf-q16,gguf-q8",
                   help=f"comma-separated target dtypes timed side by side, from: {', '.join(DTYPES)}")
    c.add_argument("--datasets", default="alpaca,mt_bench,humaneval,gsm8k",
                   help=f"comma-separated prompt kinds from: {', '.join(WORKLOADS)}")
    c.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    c.add_argument("--drafters", default=None, help="comma-separated drafter names (default: all configured)")
    c.add_argument("--num-prompts", type=int, default=4, help="prompts per kind")
    c.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (EOS ignored)")
    c.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: config)")
    c.add_argument("--steps", type=int, default=32, help="interleaved rounds timed per forward kind")
    c.add_argument("--llama-cpp", action="store_true",
                   help="also time llama.cpp's plain decoding of the same GGUF (needs the bench-llamacpp extra)")
    c.add_argument("--verify-rows", default="9", help="comma-separated verify widths timed beside k + 1")
    c.add_argument("--ttft-tokens", type=int, default=1000,
                   help="prompt tokens of the time-to-first-token measure (0: skip)")
    c.add_argument("--quality-positions", type=int, default=2048,
                   help="positions of AlpacaEval's outputs scored for top-1 agreement and perplexity (0: skip)")
    c.add_argument("--out", type=Path, default=Path("bench-results/decode.json"))
    c.set_defaults(func=cmd_bench_decode)

    b = bench_sub.add_parser("batch", help="where a batched target step's time goes at 1, 4, 8, 16 requests "
                                            "(GEMM, attention, row-wise ops, lm_head, Python, acceptance)")
    add_config_args(b, thread_counts=True)
    b.add_argument("--batch", default="1,4,8,16", help="comma-separated increasing batch sizes (requests per step)")
    b.add_argument("--context", type=int, default=256, help="KV tokens each request holds")
    b.add_argument("--k", type=int, default=0, help="draft tokens per request (0: decode rows; k: (k+1)-row verifies)")
    b.add_argument("--rounds", type=int, default=16, help="interleaved rounds timed per batch size")
    b.add_argument("--after-decodes", type=int, default=0, metavar="N",
                   help="untimed decode steps of the same requests before each timed one: a verify as it runs after "
                        "plain slots (default 0: after the previous round's step)")
    b.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    b.add_argument("--against", type=Path, default=None, metavar="DIR",
                   help="another checkout (or its kernels/csrc): its CPU kernels built beside this one's and timed "
                        "against them round by round, in one process (a kernel change against its parent)")
    b.add_argument("--out", type=Path, default=Path("bench-results/batch.json"))
    b.set_defaults(func=cmd_bench_batch)

    s = bench_sub.add_parser("serve", help="TTFT and tokens/s of the daemon per drafter and concurrency, side by side "
                                            "with other OpenAI-compatible servers (--peer)")
    add_config_args(s)
    s.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of closed-loop clients")
    s.add_argument("--drafters", default="int8,none", help="comma-separated drafters ('none', 'auto' or configured)")
    s.add_argument("--dataset", default="mt_bench",
                   help=f"prompt workload, one of: {', '.join(WORKLOADS)}, or mix (a seeded draw over "
                        f"{', '.join(MIX)}); every level takes its own prompts, never one seen before in the run")
    s.add_argument("--seed", type=int, default=0, help="the draw of --dataset mix (a named dataset takes evenly "
                                                       "spaced records)")
    s.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    s.add_argument("--num-requests", type=int, default=None, help="requests per level (default: 2 x concurrency, >= 4)")
    s.add_argument("--max-tokens", default="64", help="comma-separated output lengths (each a level)")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens tokens per request (default: on)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--repeats", type=int, default=1,
                   help="runs of each level in a row, each on its own prompts, odd runs in reverse row order (use "
                        "an even N); the table adds each row's median over them, its x none the median of the runs' "
                        "own ratios (a shared VM drifts by 5-25%%)")
    s.add_argument("--system-prompt", default="", metavar="TEXT",
                   help="a system message sent before every chat prompt, as an application sends its own: the "
                        "prefix a server's prefix cache can reuse across requests (the table's cached %%)")
    s.add_argument("--url", action="append", default=None, metavar="[LABEL=]URL",
                   help="a running daemon's HTTP base URL; repeat to compare daemons side by side "
                        "(default: start one, stop it after)")
    s.add_argument("--peer", action="append", default=None, metavar="NAME=URL",
                   help="another OpenAI-compatible server (vLLM, llama.cpp server, SGLang) run on the same prompts "
                        "after spind's drafters at each level, its model name from URL/v1/models; repeatable. "
                        "Restart a peer that caches across requests between runs: the next run sends the same prompts")
    s.add_argument("--out", type=Path, default=Path("bench-results/serve.json"))
    s.set_defaults(func=cmd_bench_serve)

    sel = bench_sub.add_parser("select", help="selection policies side by side in the simulator: goodput, regret")
    sel.add_argument("--workloads", default="mixed,cpu-smollm,gpu-paper", help="comma-separated synthetic workloads")
    sel.add_argument("--profiles", default="", help="comma-separated profile JSON files to replay as well")
    sel.add_argument("--policies", default="", help="comma-separated (default: every baseline, fixed:NAME, oracle)")
    sel.add_argument("--num-requests", type=int, default=500)
    sel.add_argument("--max-slots", type=int, default=20_000, help="stop there even if requests remain")
    sel.add_argument("--k", type=int, default=4, help="k of fixed:NAME, greedy-length and named drafters")
    sel.add_argument("--seed", type=int, default=0)
    sel.add_argument("--speed-requests", type=int, default=10_000, help="size of the timed run (0: skip it)")
    sel.add_argument("--speed-slots", type=int, default=10_000)
    sel.add_argument("--out", type=Path, default=Path("bench-results/select.json"))
    sel.set_defaults(func=cmd_bench_select)

    rp = bench_sub.add_parser("replay", help="selection replayed over recorded greedy outputs, side by side: "
                              "deterministic, for judging a selector change below the machine's noise")
    add_config_args(rp)
    rp.add_argument("--workloads", default="alpaca,cp,mtbench,humaneval,gsm8k,passage,mix",
                    help="comma-separated workloads of the shared datasets, or mix (see bench e2e)")
    rp.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR,
                    help="the shared datasets folder (default: shared/datasets next to the repo checkout)")
    rp.add_argument("--batch-size", default="1,4,16", help="comma-separated closed-loop batch sizes")
    rp.add_argument("--systems", default="none,fixed:ngram,fixed:suffix,spin",
                    help="comma-separated: none, spin, fixed:ngram[@K], fixed:suffix[@K]")
    rp.add_argument("--num-requests", type=int, default=32, help="per workload")
    rp.add_argument("--max-tokens", type=int, default=96)
    rp.add_argument("--seed", type=int, default=0, help="which prompts each workload draws")
    rp.add_argument("--profile", type=Path, default=None,
                    help="a start-up profile JSON to take the verify costs from (default: this machine's)")
    rp.add_argument("--recordings", type=Path, default=None,
                    help="where recorded outputs are cached (default: the cache folder's replay/)")
    rp.add_argument("--noise", default="0", metavar="SLOT_SD[,DRIFT_SD]",
                    help="a shared host's hand in each slot's seconds, drawn by --seed (sim.replay.HostNoise): a "
                         "log-normal jitter slot by slot and a slow drift (default 0: none, the replay is exact)")
    rp.add_argument("--select-ms", type=float, default=None,
                    help="what a fully selected slot's selecting costs the daemon, ms (default: replay's model)")
    rp.add_argument("--hidden-ms", type=float, default=0.0,
                    help="what a selected slot costs that no feedback shows the selector, ms (its Python slowing the "
                         "target's forward on shared cores): only the regime trial sees it")
    rp.add_argument("--out", type=Path, default=Path("bench-results/replay.json"))
    rp.set_defaults(func=cmd_bench_replay)

    v = bench_sub.add_parser("verify", help="verification latency and memory per attention mode and batch size, "
                                            "and verify(k+1)/decode(1)")
    add_config_args(v)
    v.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    v.add_argument("--modes", default=None,
                   help="comma-separated attention modes (default: padded,decomposed,packed; +triton-* on CUDA)")
    v.add_argument("--query-len", type=int, default=5, help="new tokens per request (k+1) in the mode comparison")
    v.add_argument("--ks", default="1,2,4,8", help="comma-separated k for verify(k+1)/decode(1) at batch 1")
    v.add_argument("--num-batches", type=int, default=3, help="Alpaca batches per batch size")
    v.add_argument("--generated", type=int, default=0,
                   help="requests are uniformly 0..N tokens into their answers (default 0: contexts are prompts)")
    v.add_argument("--repeats", type=int, default=5, help="timed runs per mode and batch")
    v.add_argument("--rows-per-seq", type=float, default=2.0, help="decomposition: B = ceil(rows_per_seq x batch)")
    v.add_argument("--no-forward", action="store_true", help="time attention only, not the whole verify forward")
    v.add_argument("--device", default="cpu", help="cpu or cuda")
    v.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    v.add_argument("--out", type=Path, default=Path("bench-results/verify.json"), help="JSON; the plot goes beside it")
    v.set_defaults(func=cmd_bench_verify)

    sw = bench_sub.add_parser("switch", help="a drafter switch's slot latency, with and without KV precompute")
    add_config_args(sw)
    sw.add_argument("--from", dest="from_drafter", default="int8", help="the drafter the request used before")
    sw.add_argument("--to", dest="to_drafter", default="dyn8", help="the drafter it switches to")
    sw.add_argument("--contexts", default="64,256,1024", help="comma-separated context lengths (tokens)")
    sw.add_argument("--k", type=int, default=None, help="tokens drafted per slot (default: config)")
    sw.add_argument("--reps", type=int, default=4, help="reps per cell (the first warms up)")
    sw.add_argument("--out", type=Path, default=Path("bench-results/switch.json"))
    sw.set_defaults(func=cmd_bench_switch)


def _names(csv: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in csv.split(",") if n.strip())


def _workloads(csv: str) -> tuple[str, ...]:
    names = _names(csv)
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown dataset {name!r}; known: {', '.join(WORKLOADS)}")
    if not names:
        raise ValueError("need at least one dataset")
    return names


def _drafters(csv: str | None, cfg: SpindConfig) -> tuple[str, ...]:
    """Named drafters (all configured ones when None); an unknown name raises ConfigError."""
    names = _names(csv) if csv is not None else tuple(d.name for d in cfg.drafters)
    for name in names:
        cfg.drafter(name)
    return names


def _check_positive(**values: int) -> None:
    for flag, value in values.items():
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")


def drafter_settings(args: argparse.Namespace, cfg: SpindConfig) -> DrafterBenchSettings:
    """Validate the arguments before any model loads; bad ones raise ValueError / ConfigError."""
    from spind.bench.drafters import DrafterBenchSettings

    datasets, drafters = _workloads(args.datasets), _drafters(args.drafters, cfg)
    k = cfg.speculation.k if args.k is None else args.k
    _check_positive(num_prompts=args.num_prompts, max_tokens=args.max_tokens, k=k, decode_steps=args.decode_steps)
    if not drafters:
        raise ValueError("need at least one dataset and one drafter")
    return DrafterBenchSettings(datasets=datasets, drafters=drafters, num_prompts=args.num_prompts,
                                max_tokens=args.max_tokens, k=k, decode_steps=args.decode_steps,
                                datasets_dir=check_datasets_dir(args.datasets_dir), include_bf16=not args.no_bf16)


def cmd_bench_drafters(args: argparse.Namespace) -> int:
    import torch

    from spind.bench.drafters import render_tables, run_drafter_bench
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    settings = drafter_settings(args, cfg)
    torch.set_num_threads(args.threads or usable_cores())
    results = run_drafter_bench(cfg, settings)
    print(render_tables(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0


def decode_settings(args: argparse.Namespace, cfg: SpindConfig) -> DecodeBenchSettings:
    """Validate the arguments before any model loads; bad ones raise ValueError / ConfigError."""
    from spind.bench.decode import DecodeBenchSettings

    dtypes = _names(args.dtypes)
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    datasets, drafters = _workloads(args.datasets), _drafters(args.drafters, cfg)
    k = cfg.speculation.k if args.k is None else args.k
    _check_positive(num_prompts=args.num_prompts, max_tokens=args.max_tokens, k=k, steps=args.steps)
    threads = _ints("--threads", args.threads) if args.threads else (usable_cores(),)
    verify_rows = _ints("--verify-rows", args.verify_rows) if args.verify_rows else ()
    if args.ttft_tokens < 0 or args.quality_positions < 0:
        raise ValueError("--ttft-tokens and --quality-positions must be >= 0")
    if args.ttft_tokens >= cfg.model.max_model_len:
        raise ValueError(f"--ttft-tokens {args.ttft_tokens} must be below max_model_len {cfg.model.max_model_len}")
    return DecodeBenchSettings(dtypes=dtypes, drafters=drafters, datasets=datasets, num_prompts=args.num_prompts,
                               max_tokens=args.max_tokens, k=k, steps=args.steps, llama_cpp=args.llama_cpp,
                               datasets_dir=check_datasets_dir(args.datasets_dir), threads=threads,
                               verify_rows=verify_rows, ttft_tokens=args.ttft_tokens,
                               quality_positions=args.quality_positions)


def batch_settings(args: argparse.Namespace, cfg: SpindConfig) -> BatchBenchSettings:
    """Validate the arguments before any model loads; bad ones raise ValueError."""
    from spind.bench.batch import BatchBenchSettings

    batches = _ints("--batch", args.batch)
    if list(batches) != sorted(set(batches)):
        raise ValueError(f"--batch must be increasing batch sizes, got {args.batch!r}")
    _check_positive(context=args.context, rounds=args.rounds)
    if args.k < 0:
        raise ValueError("--k must be >= 0")
    if getattr(args, "after_decodes", 0) < 0:
        raise ValueError("--after-decodes must be >= 0")
    if args.context + args.k + 1 > cfg.model.max_model_len:
        raise ValueError(f"--context {args.context} + k + 1 must fit max_model_len {cfg.model.max_model_len}")
    threads = _ints("--threads", args.threads) if args.threads else (usable_cores(),)
    against = getattr(args, "against", None)
    if against is not None:
        csrc = against / "kernels" / "csrc" if (against / "kernels" / "csrc").is_dir() else against
        if not any(csrc.glob("*.cpp")):
            raise ValueError(f"--against {against}: neither it nor its kernels/csrc holds kernel sources (*.cpp)")
        against = csrc.resolve()
    return BatchBenchSettings(batches=batches, context=args.context, k=args.k, rounds=args.rounds, threads=threads,
                              datasets_dir=check_datasets_dir(args.datasets_dir), against=against,
                              after_decodes=getattr(args, "after_decodes", 0))


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from spind.bench.batch import render_tables, run_batch_bench
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    results = run_batch_bench(cfg, batch_settings(args, cfg))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    print(render_tables(results))
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from spind.bench.decode import render_tables, run_decode_bench
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    settings = decode_settings(args, cfg)
    results = run_decode_bench(cfg, settings)
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    print(render_tables(results))
    return 0


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """Validate the arguments before the daemon starts; bad ones raise ValueError."""
    from spind.bench.serve import MIX_DATASET, PEER, ServeSettings

    try:
        concurrency = tuple(int(c) for c in _names(args.concurrency))
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    drafters = _names(args.drafters)
    if args.dataset not in WORKLOADS and args.dataset != MIX_DATASET:
        raise ValueError(f"unknown dataset {args.dataset!r}; known: {', '.join(WORKLOADS)}, {MIX_DATASET}")
    try:
        max_tokens = tuple(int(n) for n in _names(args.max_tokens))
    except ValueError:
        raise ValueError(f"--max-tokens must be comma-separated integers, got {args.max_tokens!r}") from None
    if not concurrency or not drafters or min(concurrency) < 1:
        raise ValueError("need at least one drafter and concurrency levels >= 1")
    if not max_tokens or min(max_tokens) < 1 or (args.num_requests is not None and args.num_requests < 1):
        raise ValueError("--max-tokens and --num-requests must be >= 1")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    for flag, values in (("--concurrency", concurrency), ("--max-tokens", max_tokens), ("--drafters", drafters)):
        if len(set(values)) < len(values):
            raise ValueError(f"{flag} lists a value twice: {','.join(map(str, values))}")
    if PEER in drafters:
        raise ValueError(f"{PEER!r} names the rows of --peer servers, not a drafter")
    return ServeSettings(concurrency=concurrency, drafters=drafters, dataset=args.dataset,
                         num_requests=args.num_requests, max_tokens=max_tokens, ignore_eos=args.ignore_eos,
                         temperature=args.temperature, seed=args.seed, repeats=args.repeats,
                         system_prompt=args.system_prompt)


def daemon_urls(urls: list[str] | None) -> dict[str, str]:
    """--url [LABEL=]URL ... -> {label: base URL}."""
    out = {}
    for i, spec in enumerate(urls or []):
        label, sep, url = spec.partition("=")
        label, url = (label, url) if sep else (f"daemon{i + 1}" if len(urls) > 1 else "spind", spec)
        if label in out:
            raise ValueError(f"--url label {label!r} given twice")
        out[label] = url.rstrip("/")
    return out


def peer_urls(specs: list[str] | None, daemon_labels: Iterable[str]) -> dict[str, str]:
    """--peer NAME=URL ... -> {name: base URL}; a name must be new (nor a spind daemon's label: rows and the JSON
    tell servers apart by it), a URL http(s)."""
    taken, out = set(daemon_labels), {}
    for spec in specs or []:
        name, sep, url = (part.strip() for part in spec.partition("="))
        if not sep or not name or not url:
            raise ValueError(f"--peer takes NAME=URL (e.g. vllm=http://127.0.0.1:8011), got {spec!r}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--peer {name}: the URL must start with http:// or https://, got {url!r}")
        if name in out:
            raise ValueError(f"--peer name {name!r} given twice")
        if name in taken:
            raise ValueError(f"--peer name {name!r} is a spind daemon's label; name the peer otherwise")
        out[name] = url.rstrip("/")
    return out


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from spind.bench.report import write_json
    from spind.bench.serve import load_serve_prompts, local_daemon, render_table, run_serve_bench
    from spind.client import http_json

    cfg = config_from_args(args)
    settings = serve_settings(args)
    daemons = daemon_urls(args.url)
    peers = peer_urls(args.peer, daemons or ["spind"])
    for name in settings.drafters:
        if name not in ("auto", "none") and not daemons:
            cfg.drafter(name)  # unknown name -> ConfigError before the daemon starts
    prompts = load_serve_prompts(settings, check_datasets_dir(args.datasets_dir))
    headers = {"Authorization": f"Bearer {cfg.server.api_key}"} if cfg.server.api_key else None
    options = [arg for flag, value in (("--config", args.config), ("--model", args.model), ("--dtype", args.dtype),
                                       ("--threads", args.threads)) if value is not None for arg in (flag, str(value))]
    for label, url in daemons.items():
        if http_json(url + "/health")[0] != 200:
            raise ValueError(f"no healthy spind daemon answers at {url}/health ({label})")
    for name, url in peers.items():  # before a daemon of our own takes minutes to start
        if http_json(url + "/v1/models")[0] != 200:
            raise ValueError(f"peer {name} does not answer GET {url}/v1/models with 200")
    with contextlib.nullcontext(daemons) if daemons else local_daemon(options) as url:
        targets = url if daemons else {"spind": url}
        results = asyncio.run(run_serve_bench(targets, prompts, settings, headers, peers))
    print(render_table(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0


def cmd_bench_replay(args: argparse.Namespace) -> int:
    from spind.bench.replay import ReplaySettings, render_table, run_replay_bench
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    settings = ReplaySettings(workloads=_names(args.workloads), batch_sizes=_ints("--batch-size", args.batch_size),
                              systems=_names(args.systems), num_requests=args.num_requests,
                              max_tokens=args.max_tokens, seed=args.seed, datasets_dir=args.datasets_dir,
                              profile=args.profile, recordings_dir=args.recordings,
                              noise=_noise(args.noise), select_ms=args.select_ms, hidden_ms=args.hidden_ms)
    results = run_replay_bench(cfg, settings)
    print(render_table(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0


def _noise(text: str) -> tuple[float, float]:
    """--noise SLOT_SD[,DRIFT_SD] as (slot_sd, drift_sd)."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 2 or min(parts) < 0:
        raise SystemExit(f"spind: --noise takes SLOT_SD[,DRIFT_SD], numbers >= 0, not {text!r}")
    return parts[0], parts[1] if len(parts) > 1 else 0.0


def cmd_bench_select(args: argparse.Namespace) -> int:
    from spind.bench.report import write_json
    from spind.bench.select import SelectBenchSettings, render_tables, run_select_bench
    from spind.coordinator.selection.lbss import SelectionConfig
    from spind.sim.workloads import WORKLOADS

    settings = SelectBenchSettings(workloads=_names(args.workloads), policies=_names(args.policies),
                                   num_requests=args.num_requests, max_slots=args.max_slots, seed=args.seed,
                                   profiles=tuple(Path(p) for p in _names(args.profiles)), default_k=args.k,
                                   speed_requests=args.speed_requests, speed_slots=args.speed_slots)
    for name in settings.workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if min(args.num_requests, args.max_slots, args.k) < 1 or min(args.speed_requests, args.speed_slots) < 0:
        raise ValueError("--num-requests, --max-slots and --k must be >= 1, --speed-* >= 0")
    results = run_select_bench(settings, SelectionConfig())
    print(render_tables(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0


def _ints(flag: str, csv: str) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in _names(csv))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {csv!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} needs integers >= 1")
    return values


def verify_settings(args: argparse.Namespace) -> VerifyBenchSettings:
    """Validate the arguments before any model loads; bad ones raise ValueError."""
    from spind.bench.verify import VerifyBenchSettings
    from spind.kernels.attention import BACKENDS, TORCH_BACKENDS

    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    default = TORCH_BACKENDS + (("triton-decomposed", "triton-packed") if args.device == "cuda" else ())
    modes = _names(args.modes) if args.modes else default
    for m in modes:
        if m not in BACKENDS:
            raise ValueError(f"unknown attention mode {m!r}; known: {', '.join(BACKENDS)}")
        if m.startswith("triton") and args.device != "cuda":
            raise ValueError(f"{m} needs --device cuda (on CPU Triton only interprets, far too slowly to time)")
    if args.query_len < 1 or args.num_batches < 1 or args.repeats < 1 or args.rows_per_seq < 1:
        raise ValueError("--query-len, --num-batches, --repeats and --rows-per-seq must be >= 1")
    if args.generated < 0:
        raise ValueError("--generated must be >= 0")
    return VerifyBenchSettings(batch_sizes=_ints("--batch-sizes", args.batch_sizes), modes=modes,
                               query_len=args.query_len, ks=_ints("--ks", args.ks), num_batches=args.num_batches,
                               generated=args.generated,
                               repeats=args.repeats, rows_per_seq=args.rows_per_seq,
                               with_forward=not args.no_forward, datasets_dir=check_datasets_dir(args.datasets_dir),
                               device=args.device)


def cmd_bench_verify(args: argparse.Namespace) -> int:
    import torch

    from spind.bench.report import write_json
    from spind.bench.verify import render_tables, run_verify_bench, write_plot

    cfg = config_from_args(args)
    settings = verify_settings(args)
    torch.set_num_threads(args.threads or usable_cores())
    results = run_verify_bench(cfg, settings)
    print(render_tables(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    plot = write_plot(results, args.out.with_suffix(".png"))
    print(f"wrote {plot}" if plot else "no plot: matplotlib is missing (pip install 'spind[bench]')", file=sys.stderr)
    return 0


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from spind.bench.datasets import sample_workload
    from spind.bench.e2e import E2ESettings, render_table, run_e2e
    from spind.bench.e2e_plots import write_plots
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    systems = _names(args.systems)
    if not systems:
        raise ValueError("--systems needs at least one system")
    _check_positive(num_requests=args.num_requests, batch_size=args.batch_size, max_tokens=args.max_tokens)
    if args.rounds < 0:
        raise ValueError("--rounds must be >= 0 (0: as many as the requests allow)")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be > 0 requests per second")
    if args.repeats < 1 or (args.repeats > 1 and args.rate is not None):
        raise ValueError("--repeats must be >= 1, and 1 in an open loop (--rate: arrivals are timed from the start)")
    k = cfg.speculation.k if args.k is None else args.k
    prompts = sample_workload(args.workload, args.num_requests, args.seed, args.datasets_dir)
    if len(prompts) < args.num_requests:  # the settings (rounds, the table, the JSON) count the requests that run
        print(f"{args.workload} has {len(prompts)} prompts: {len(prompts)} requests, not {args.num_requests}",
              file=sys.stderr)
    settings = E2ESettings(workload=args.workload, num_requests=len(prompts), batch_size=args.batch_size,
                           max_tokens=args.max_tokens, systems=systems, temperature=args.temperature, seed=args.seed,
                           rate=args.rate, k=k, rounds=args.rounds, workers=args.workers,
                           repeats=args.repeats)
    results = run_e2e(cfg, settings, prompts)
    print(render_table(results))
    print(f"wrote {write_json(args.json, results)}", file=sys.stderr)
    if args.plot is not None:
        plots = write_plots(results, args.plot)
        print("wrote " + ", ".join(map(str, plots)) if plots else "no plots: pip install -e '.[bench]' (matplotlib)",
              file=sys.stderr)
    return 0


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    import dataclasses

    from spind.bench.datasets import sample_workload
    from spind.bench.pipeline import PipelineBenchSettings, render_tables, run_pipeline_bench, write_plot
    from spind.bench.report import write_json

    cfg = config_from_args(args)
    cfg.drafter(args.drafter)
    batches = _ints("--batch-sizes", args.batch_sizes)
    _check_positive(max_tokens=args.max_tokens, max_micro_batches=args.max_micro_batches,
                    requests_per_client=args.requests_per_client)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, pipeline=True,
                                                               max_batch_size=max(cfg.runtime.max_batch_size,
                                                                                  max(batches))))
    settings = PipelineBenchSettings(batch_sizes=batches, drafter=args.drafter, max_tokens=args.max_tokens,
                                     max_micro_batches=args.max_micro_batches,
                                     requests_per_client=args.requests_per_client, k=cfg.speculation.k)
    prompts = sample_workload(args.workload, max(batches) * args.requests_per_client, args.seed, args.datasets_dir)
    results = run_pipeline_bench(cfg, settings, prompts)
    print(render_tables(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    plot = write_plot(results, args.out.with_suffix(".png"))
    print(f"wrote {plot}" if plot else "no plot: pip install -e '.[bench]' (matplotlib)", file=sys.stderr)
    return 0


def cmd_bench_switch(args: argparse.Namespace) -> int:
    from spind.bench.report import write_json
    from spind.bench.switch import SwitchBenchSettings, render_table, run_switch_bench

    cfg = config_from_args(args)
    drafters = _drafters(f"{args.from_drafter},{args.to_drafter}", cfg)
    if len(set(drafters)) != 2 or any(cfg.drafter(d).kind == "ngram" for d in drafters):
        raise ValueError("--from and --to must be two different model drafters (n-gram lookup keeps no KV)")
    lengths = _ints("--contexts", args.contexts)
    k = cfg.speculation.k if args.k is None else args.k
    _check_positive(k=k)
    if args.reps < 2:
        raise ValueError("--reps must be >= 2 (the first warms up)")
    if max(lengths) + k >= cfg.model.max_model_len:
        raise ValueError(f"--contexts must stay below max_model_len - k ({cfg.model.max_model_len - k})")
    results = run_switch_bench(cfg, SwitchBenchSettings(drafters[0], drafters[1], lengths, k, args.reps))
    print(render_table(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0
