"""`spind train-drafter`: train an EAGLE-3 head for the configured target, resumably, in one work directory.

  1. prompts: the shared datasets (minus what the benches draw, minus a held-aside split) or --prompts files;
  2. generate: the target answers them (greedy) into work/data/answers-*.jsonl (a rerun skips what is done);
  3. train: the head, with checkpoints in work/ckpt (a rerun resumes from the newest);
  4. write: work/head (config.json + model.safetensors in the EAGLE-3 layout), and print the config entry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from spind.cli_args import add_config_args, config_from_args


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_target_runner(cfg, max_batch: int, max_len: int):
    """The target as served on this machine (its dtype and kernels) in a ModelRunner of its own."""
    import torch

    from spind.config import resolve_dtype
    from spind.models.llama import load_llama
    from spind.models.loader import resolve_model_dir
    from spind.models.runner import ModelRunner
    from spind.tokenizer import Tokenizer
    from spind.worker.device import bf16_supported

    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
    device = cfg.worker("target").device
    dtype = resolve_dtype(cfg, model_dir, device, bf16_supported(device))
    model = load_llama(model_dir, dtype, device)
    block = cfg.runtime.kv_block_size
    max_len = min(max_len, model.args.max_position)
    blocks = max_batch * -(-max_len // block) + 4
    runner = ModelRunner(model, blocks, block, cfg.runtime.attention, max_len, max_batch,
                         kv_cache_dtype=cfg.runtime.kv_cache_dtype)
    return runner, Tokenizer(model_dir), dtype


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import torch

    from spind.models.eagle import default_aux_layers, save_eagle_head
    from spind.train import data as D
    from spind.train.eagle import Trainer, TrainSettings, bf16_fast, draft_vocabulary, new_head

    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in fields(TrainSettings)
                                if getattr(args, f.name, None) is not None})
    if args.bf16 == "auto":
        settings.bf16 = bf16_fast()
    else:
        settings.bf16 = args.bf16 == "on"
    if args.num_prompts < 1 or args.max_tokens < 1 or args.draft_vocab < 2 or settings.steps < 1:
        raise ValueError("--num-prompts, --max-tokens, --steps must be >= 1 and --draft-vocab >= 2")
    cfg = config_from_args(args)
    work = Path(args.out).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    prompts = D.training_prompts(Path(args.datasets_dir), [Path(p) for p in args.prompts or ()])[: args.num_prompts]
    _log(f"train-drafter: {len(prompts)} prompts ({sum(D.is_held_out(D.prompt_key(p)) for p in prompts)} held "
         f"aside); work dir {work}")
    # a sequence is a prompt (cut to 1024 tokens) and an answer
    runner, tokenizer, dtype = load_target_runner(cfg, args.batch_size, 1024 + args.max_tokens + 8)
    if args.stage in ("all", "generate"):
        D.generate(runner, tokenizer, prompts, work / "data", args.max_tokens, args.batch_size, log=_log)
    if args.stage == "generate":
        return 0
    keys = {D.prompt_key(p) for p in prompts}
    seqs = [s for s in D.read_shards(work / "data") if s.key in keys]
    if not seqs:
        raise ValueError(f"no answers in {work / 'data'}: run the generate stage first")
    target = runner.model.args
    vocab_file = work / "draft_vocab.json"
    if vocab_file.is_file():  # fixed at the first training run: a resumed run must keep the same ids
        vocab = torch.tensor(json.loads(vocab_file.read_text()))
    else:
        vocab = draft_vocabulary([s for s in seqs if not s.held_out], min(args.draft_vocab, target.vocab_size))
        vocab_file.write_text(json.dumps(vocab.tolist()))
    covered = set(vocab.tolist())
    answer_tokens = [t for s in seqs if s.held_out for t in s.answer]
    coverage = sum(t in covered for t in answer_tokens) / max(1, len(answer_tokens))
    layers = default_aux_layers(target.num_layers)
    head = new_head(target, vocab, layers)
    head.bind_target(runner.model.embed_tokens, max_position=runner.max_model_len)
    feats = D.TargetFeatures(runner, layers)
    _log(f"train-drafter: {len(seqs)} answered sequences, {sum(len(s.answer) for s in seqs)} answer tokens; draft "
         f"vocabulary {len(vocab)} (covers {coverage:.1%} of held-aside answer tokens); features of layers {layers} "
         f"of the {dtype} target")
    trainer = Trainer(head, seqs, feats, work / "ckpt", settings, log=_log)
    trainer.resume()
    trainer.run()
    out = work / "head"
    save_eagle_head(head, out, {"float16": torch.float16, "int8": torch.int8}[args.head_dtype])
    report = {"steps": trainer.step, "sequences": len(seqs), "draft_vocab": len(vocab),
              "draft_vocab_coverage": coverage, "feature_layers": list(layers), "history": trainer.history,
              "settings": {f.name: getattr(settings, f.name) for f in fields(TrainSettings)}}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"train-drafter: wrote {out}")
    print(f'[[drafters]]\nname = "eagle"\nkind = "eagle"\npath = "{out}"\nworker = "target"')
    return 0


def add_parser(sub, datasets_default: Path) -> None:
    from spind.train.settings import TrainSettings  # not spind.train.eagle: building the parser imports no torch

    d = TrainSettings()
    p = sub.add_parser("train-drafter", help="train an EAGLE-3 draft head for the target (resumable)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    add_config_args(p)
    p.add_argument("--out", required=True, help="work directory: answers, checkpoints and the head (resumable)")
    p.add_argument("--prompts", action="append", help="a JSONL / JSON list of prompts (repeatable; default: the "
                                                       "shared datasets)")
    p.add_argument("--datasets-dir", default=str(datasets_default), help="the shared datasets folder")
    p.add_argument("--num-prompts", type=int, default=100000, help="prompts to answer at most (default: all)")
    p.add_argument("--max-tokens", type=int, default=384, help="answer length at most (default: 384)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts answered at once (default: 16)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default: 8192)")
    p.add_argument("--stage", choices=("all", "generate", "train"), default="all")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default: {d.steps})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--tokens-per-step", type=int, default=None, help=f"default: {d.tokens_per_step}")
    p.add_argument("--unroll", type=int, default=None, help=f"training-time-test steps (default: {d.unroll})")
    p.add_argument("--save-every", type=int, default=None, help=f"default: {d.save_every}")
    p.add_argument("--eval-every", type=int, default=None, help=f"default: {d.eval_every}")
    p.add_argument("--head-dtype", choices=("float16", "int8"), default="float16",
                   help="the written head's weights: float16 (any EAGLE-3 loader reads it) or int8 (per-row "
                        "scales, half the bytes; spind reads it)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="train with bfloat16 matmuls (auto: where the CPU has BF16 units)")
    p.set_defaults(func=cmd_train_drafter)
