"""`spind` command line. Each subcommand lives in its own module; this file only parses and dispatches.

Bad input gets one clear `spind: error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from spind.cli_args import add_config_args, config_from_args
from spind.config import ConfigError
from spind.progress import say


def check_prompt_fits(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_tokens} tokens; the context limit is {max_model_len} "
                         f"and at least one token must be generated")


def cmd_generate(args: argparse.Namespace) -> int:
    from spind.models.loader import resolve_model_dir
    from spind.params import SamplingParams, drafter_k_conflict
    from spind.tokenizer import Tokenizer

    if not args.prompt.strip():
        raise ValueError("empty prompt")
    if args.k is not None and args.k < 0:
        raise ValueError("--k must be >= 0")
    conflict = drafter_k_conflict(args.drafter, args.k)  # as the HTTP and ZeroMQ APIs refuse it
    if conflict is not None:
        raise ValueError(conflict)
    cfg = config_from_args(args)
    if args.drafter not in ("none", "auto"):
        cfg.drafter(args.drafter)  # unknown name -> ConfigError before any model loads
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ())).validate()
    drafters = [] if args.drafter == "none" else None if args.drafter == "auto" else [args.drafter]
    # the tokenizer alone (no torch, no weights) checks the prompt, so a prompt over the limit fails at once
    tok = Tokenizer(resolve_model_dir(cfg.model.target, cfg.cache_path))
    prompt = tok.apply_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode_prompt(args.prompt)
    check_prompt_fits(len(prompt), cfg.model.max_model_len)
    # after the model is resolved (a first run says it converts it): the engine's imports take ~0.5 s
    from spind.coordinator.transport.local import GenRequest, LocalEngine

    start = time.perf_counter()  # the engine says what it loads (spind/progress.py)
    engine = LocalEngine.load(cfg, drafters=drafters, tokenizer=tok)
    say(f"loaded in {time.perf_counter() - start:.1f}s; generating")
    try:
        check_prompt_fits(len(prompt), engine.max_model_len)  # the model's own limit may be lower
        res = engine.generate([GenRequest("cli", prompt, params, None if args.drafter == "none" else args.drafter,
                                          args.k)])[0]
    finally:
        engine.close()
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print(res.text)
        rate = res.num_accepted / res.num_drafted if res.num_drafted else 0.0
        used = ", ".join(res.drafters) or "none"
        print(f"[{len(res.token_ids)} tokens in {res.elapsed_s:.2f}s, {len(res.token_ids) / res.elapsed_s:.1f} tok/s; "
              f"drafter={args.drafter} ({used}) accepted {res.num_accepted}/{res.num_drafted} ({rate:.0%})]",
              file=sys.stderr)
    return 0


def cmd_drafters(args: argparse.Namespace) -> int:
    from spind.drafter_table import describe_drafters, render_drafters

    table = describe_drafters(config_from_args(args), measure=args.measure)
    print(json.dumps(table) if args.json else render_drafters(table))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spind", description="speculative decoding with heterogeneous drafters")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate", help="generate in this process (no daemon)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text in this process, with the daemon's own coordinator over in-process workers\n"
                    "(no daemon needed). Greedy by default (--temperature 0), so the output is exactly the target\n"
                    "model's; speculative decoding makes it faster, never different.",
        epilog="examples:\n"
               "  spind generate --chat --prompt 'Write a haiku about the sea.'\n"
               "  spind generate --prompt 'def fibonacci(n):' --drafter ngram --k 8 --max-tokens 64\n"
               "  spind generate --chat --prompt 'Tell me a story.' --temperature 0.8 --seed 1 --json\n"
               "threads: each worker gets cores / workers torch threads; --threads N (or [runtime].threads)\n"
               "sets it. Progress goes to stderr, so --json output on stdout stays clean.")
    add_config_args(g, tensor_parallel=True)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    g.add_argument("--drafter", default="auto",
                   help="'auto' (spind chooses per request: [selection].policy), 'none' (plain decoding), or a "
                        "configured drafter: see `spind drafters` (default: auto)")
    g.add_argument("--k", type=int, default=None,
                   help="tokens drafted per step (default: [speculation].k, 4); 0 drafts nothing, so it goes only "
                        "with --drafter none")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (default: 0, off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, timings, drafters")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("drafters", help="the configured drafters: whether auto selection uses each on this machine "
                                        "and why not, with their measured costs")
    add_config_args(d)
    d.add_argument("--measure", action="store_true",
                   help="load the models and profile them where no start has (as `spind start` does), then show")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_drafters)

    from spind.bench import cli as bench_cli
    from spind.frontend import daemon_cli
    from spind.bench.datasets import DEFAULT_DATASETS_DIR
    from spind.train import cli as train_cli
    daemon_cli.add_parsers(sub, add_config_args)
    bench_cli.add_parsers(sub, add_config_args)
    train_cli.add_parser(sub, DEFAULT_DATASETS_DIR)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads that sleep instead of spinning when they wait: on a machine with other busy processes, spinning
    # barriers made a 2-thread decode step ~10x slower (measured: ~1,000 vs ~95 ms per slot), while passive waiting
    # loses nothing when the machine is idle. It must be set before torch loads OpenMP: here, first thing, for the
    # commands that load torch in this process (`spind generate`, `spind bench ...`); the daemon's workers get it from
    # their launcher (transport/process_pool.py worker_env). An explicit OMP_WAIT_POLICY from the user wins. Importing
    # spind (the client library, say) changes no environment.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    daemon = args.command == "start"  # a daemon's log records its normal life at INFO; commands stay quiet
    logging.basicConfig(level=logging.INFO if args.verbose or daemon else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if daemon:
        from spind.logs import install_rate_limit

        install_rate_limit()
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"spind: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
