"""`spind bench ...` subcommands: each prints a table, writes JSON, and reports progress on stderr."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from spind.bench.datasets import DEFAULT_DATASETS_DIR, WORKLOADS, check_datasets_dir
from spind.config import SpindConfig

if TYPE_CHECKING:
    from spind.bench.drafters import DrafterBenchSettings
    from spind.bench.serve import ServeSettings

DEFAULT_DATASETS = ("alpaca", "mt_bench", "humaneval", "gsm8k", "passage")


def add_parsers(sub: argparse._SubParsersAction,
                add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `spind bench <name>` subcommands."""
    bench = sub.add_parser("bench", help="benchmarks: print a table, write JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

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

    s = bench_sub.add_parser("serve", help="TTFT and tokens/s of the daemon per drafter and concurrency, side by side")
    add_config_args(s)
    s.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of closed-loop clients")
    s.add_argument("--drafters", default="int8,none", help="comma-separated drafters ('none', 'auto' or configured)")
    s.add_argument("--dataset", default="mt_bench", help=f"prompt workload, one of: {', '.join(WORKLOADS)}")
    s.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    s.add_argument("--num-requests", type=int, default=None, help="requests per level (default: 2 x concurrency, >= 4)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens tokens per request (default: on)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--url", default=None, help="a running daemon's HTTP base URL (default: start one, stop it after)")
    s.add_argument("--out", type=Path, default=Path("bench-results/serve.json"))
    s.set_defaults(func=cmd_bench_serve)


def _names(csv: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in csv.split(",") if n.strip())


def drafter_settings(args: argparse.Namespace, cfg: SpindConfig) -> DrafterBenchSettings:
    """Validate the arguments before any model loads; bad ones raise ValueError / ConfigError."""
    from spind.bench.drafters import DrafterBenchSettings

    datasets = _names(args.datasets)
    for name in datasets:
        if name not in WORKLOADS:
            raise ValueError(f"unknown dataset {name!r}; known: {', '.join(WORKLOADS)}")
    drafters = _names(args.drafters) if args.drafters else tuple(d.name for d in cfg.drafters)
    for name in drafters:
        cfg.drafter(name)
    k = cfg.speculation.k if args.k is None else args.k
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens), ("--k", k),
                        ("--decode-steps", args.decode_steps)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    if not datasets or not drafters:
        raise ValueError("need at least one dataset and one drafter")
    return DrafterBenchSettings(datasets=datasets, drafters=drafters, num_prompts=args.num_prompts,
                                max_tokens=args.max_tokens, k=k, decode_steps=args.decode_steps,
                                datasets_dir=check_datasets_dir(args.datasets_dir), include_bf16=not args.no_bf16)


def cmd_bench_drafters(args: argparse.Namespace) -> int:
    import torch

    from spind.bench.drafters import render_tables, run_drafter_bench
    from spind.bench.report import write_json
    from spind.cli import config_from_args

    cfg = config_from_args(args)
    settings = drafter_settings(args, cfg)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    results = run_drafter_bench(cfg, settings)
    print(render_tables(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """Validate the arguments before the daemon starts; bad ones raise ValueError."""
    from spind.bench.serve import ServeSettings

    try:
        concurrency = tuple(int(c) for c in _names(args.concurrency))
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    drafters = _names(args.drafters)
    if args.dataset not in WORKLOADS:
        raise ValueError(f"unknown dataset {args.dataset!r}; known: {', '.join(WORKLOADS)}")
    if not concurrency or not drafters or min(concurrency) < 1:
        raise ValueError("need at least one drafter and concurrency levels >= 1")
    if args.max_tokens < 1 or (args.num_requests is not None and args.num_requests < 1):
        raise ValueError("--max-tokens and --num-requests must be >= 1")
    return ServeSettings(concurrency, drafters, args.dataset, args.num_requests, args.max_tokens, args.ignore_eos,
                         args.temperature)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from spind.bench.datasets import load_prompts
    from spind.bench.report import write_json
    from spind.bench.serve import local_daemon, render_table, run_serve_bench
    from spind.cli import config_from_args
    from spind.client import http_json

    cfg = config_from_args(args)
    settings = serve_settings(args)
    for name in settings.drafters:
        if name not in ("auto", "none") and not args.url:
            cfg.drafter(name)  # unknown name -> ConfigError before the daemon starts
    num_prompts = max(settings.requests_at(c) for c in settings.concurrency)
    prompts = load_prompts(settings.dataset, num_prompts, check_datasets_dir(args.datasets_dir))
    headers = {"Authorization": f"Bearer {cfg.server.api_key}"} if cfg.server.api_key else None
    options = [arg for flag, value in (("--config", args.config), ("--model", args.model), ("--dtype", args.dtype),
                                       ("--threads", args.threads)) if value is not None for arg in (flag, str(value))]
    if args.url and http_json(args.url.rstrip("/") + "/health")[0] != 200:
        raise ValueError(f"no healthy spind daemon answers at {args.url}/health")
    with contextlib.nullcontext(args.url.rstrip("/")) if args.url else local_daemon(options) as url:
        results = asyncio.run(run_serve_bench(url, prompts, settings, headers))
    print(render_table(results))
    print(f"wrote {write_json(args.out, results)}", file=sys.stderr)
    return 0
