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
