"""`spind` command line. Each subcommand lives in its own module; this file only parses and dispatches.

Bad input gets one clear `spind: error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from spind.config import ConfigError, SpindConfig, load_config


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="config.toml (default: the embedded one)")
    p.add_argument("--model", default=None, help="override [model].target: 'default', an HF dir or a .gguf")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def config_from_args(args: argparse.Namespace, **server: object) -> SpindConfig:
    return load_config(args.config, {"model": {"target": args.model, "dtype": args.dtype},
                                     "server": dict(server)})


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from spind.engine.offline import GenRequest, Runtime
    from spind.sampling import SamplingParams

    if not args.prompt.strip():
        raise ValueError("empty prompt")
    if args.k is not None and args.k < 0:
        raise ValueError("--k must be >= 0")
    cfg = config_from_args(args)
    if args.drafter not in ("none", "auto"):
        cfg.drafter(args.drafter)  # unknown name -> ConfigError before any model loads
    drafter = cfg.speculation.default_drafter if args.drafter == "auto" else args.drafter
    drafter = None if drafter == "none" else drafter
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    rt = Runtime.load(cfg, drafters=[drafter] if drafter else [])
    prompt = (rt.tokenizer.apply_chat([{"role": "user", "content": args.prompt}]) if args.chat
              else rt.tokenizer.encode(args.prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    k = cfg.speculation.k if args.k is None else args.k
    res = rt.generate([GenRequest("cli", prompt, params, drafter, k)])[0]
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print(res.text)
        rate = res.num_accepted / res.num_drafted if res.num_drafted else 0.0
        print(f"[{len(res.token_ids)} tokens in {res.elapsed_s:.2f}s, {len(res.token_ids) / res.elapsed_s:.1f} tok/s; "
              f"drafter={res.drafter or 'none'} accepted {res.num_accepted}/{res.num_drafted} ({rate:.0%})]",
              file=sys.stderr)
    return 0


def cmd_drafters(args: argparse.Namespace) -> int:
    from spind.bench.drafters import describe_drafters

    cfg = config_from_args(args)
    rows = describe_drafters(cfg, measure=args.measure)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'name':<10} {'kind':<7} {'variant':<18} {'worker':<8} ms/draft-token")
        for r in rows:
            ms = "-" if r["ms_per_token"] is None else f"{r['ms_per_token']:.1f}"
            print(f"{r['name']:<10} {r['kind']:<7} {r['variant'] or '-':<18} {r['worker']:<8} {ms}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spind", description="speculative decoding with heterogeneous drafters")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline in this process (no daemon)")
    add_config_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--drafter", default="auto", help="a configured drafter name, 'auto' or 'none'")
    g.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: config)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("drafters", help="list the configured drafters")
    add_config_args(d)
    d.add_argument("--measure", action="store_true", help="load each drafter and measure ms per draft token")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_drafters)

    from spind.bench import cli as bench_cli
    from spind.daemon import cli as daemon_cli
    daemon_cli.add_parsers(sub, add_config_args)
    bench_cli.add_parsers(sub, add_config_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"spind: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
