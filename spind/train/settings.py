"""A draft head's training settings, apart from the trainer (spind/train/eagle.py): the CLI builds its parser's
defaults from them, and building the parser must not import torch (it did, ~1.3 s before every `spind` command's
first line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainSettings:
    steps: int = 4000
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    tokens_per_step: int = 4096  # sequences are packed up to this many tokens per optimizer step
    unroll: int = 4
    decay: float = 0.8
    save_every: int = 100
    eval_every: int = 250
    eval_sequences: int = 48
    seed: int = 0
    bf16: bool = False  # autocast the head's matmuls to bfloat16 (2x on CPUs with AVX-512 BF16 or AMX)
