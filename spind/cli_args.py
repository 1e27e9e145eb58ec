"""The config arguments every `spind` command shares (--config, --model, --dtype, --kv-cache-dtype, --threads,
--tensor-parallel) and
the `SpindConfig` they make. Apart from spind/cli.py so that the subcommands' own modules (spind/bench/cli.py) use
them without importing the entry point, which imports those modules.
"""

from __future__ import annotations

import argparse

from spind.config import DTYPES, KV_CACHE_DTYPES, SpindConfig, load_config, with_tensor_parallel


def add_config_args(p: argparse.ArgumentParser, thread_counts: bool = False, tensor_parallel: bool = False) -> None:
    """--config, --model, --dtype and --threads; `thread_counts`: --threads is a comma-separated list of counts (a
    bench pass at each), not a config override; `tensor_parallel`: --tensor-parallel too, for the commands that
    serve through the engine (the benches that time the model's runner directly do not take a split target)."""
    p.add_argument("--config", default=None, help="config.toml (default: the embedded one)")
    p.add_argument("--model", default=None, help="override [model].target: 'default', an HF dir or a .gguf")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="override [model].dtype")
    p.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES, help="override [runtime].kv_cache_dtype")
    if tensor_parallel:
        p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                       help="split the target over N processes (override the target's [[workers]] tensor_parallel; "
                            "on GPUs rank r takes cuda:r unless the config lists its devices)")
    if thread_counts:
        p.add_argument("--threads", default=None, help="comma-separated torch thread counts, a pass at each "
                                                       "(default: every core)")
    else:
        p.add_argument("--threads", type=int, default=None,
                       help="torch threads per worker (default: [runtime].threads, else cores / workers)")


def config_from_args(args: argparse.Namespace, **server: object) -> SpindConfig:
    threads = args.threads if isinstance(args.threads, int) else None  # a list of counts is the bench's own
    cfg = load_config(args.config, {"model": {"target": args.model, "dtype": args.dtype},
                                     "runtime": {"threads": threads,
                                                 "kv_cache_dtype": getattr(args, "kv_cache_dtype", None)},
                                     "server": dict(server)})
    return with_tensor_parallel(cfg, getattr(args, "tensor_parallel", None))
