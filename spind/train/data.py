"""A draft head's training data: the target's own answers to local prompts, and its features on them.

`training_prompts` picks the prompts: the shared datasets for the default model (or a JSONL / JSON list given by
the user), minus every prompt the benches draw at their usual sizes and seeds (so a bench never scores a head on
what it trained on) and minus a held-aside split (1 in `HOLDOUT`, by a hash of the text) on which training
reports acceptance. `generate` has the target answer them (greedy, batched, through spind's own runner: the
tokens the served target would produce) into JSONL shards, resumable: a rerun skips the prompts already answered.
`TargetFeatures` computes the features a served target hands its head (the same kernels, batch-invariant), so
features are recomputed at training time rather than stored (~3.5 KB a token for the default model).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spind.bench.datasets import (DEFAULT_DATASETS_DIR, MIX, WORKLOADS, Prompt, check_datasets_dir, encode_prompt,
                                  read_prompt_file, sample_workload, spread)

HOLDOUT = 20  # 1 prompt in HOLDOUT is held aside for the acceptance report
TRAIN_WORKLOADS = ("alpaca", "cp", "gsm8k")  # mt_bench, humaneval and passage stay unseen
BENCH_SIZES = (8, 12, 16, 24, 32, 48, 64, 96, 128)
BENCH_SEEDS = (0, 1, 2, 3)


@dataclass(frozen=True)
class Sequence:
    key: str  # the prompt's hash: its identity across runs
    prompt: list[int]
    answer: list[int]
    held_out: bool

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.answer


def prompt_key(prompt: Prompt) -> str:
    return hashlib.sha1(f"{prompt.dataset}\x00{prompt.text}".encode()).hexdigest()[:16]


def is_held_out(key: str) -> bool:
    return int(key, 16) % HOLDOUT == 0


def bench_texts(name: str, root: Path) -> set[str]:
    """Every prompt text a bench draws from workload `name` at the usual sizes and seeds (spread and seeded
    samples, alone and as a third of `mix`)."""
    records = WORKLOADS[name](root)
    sizes = sorted({*BENCH_SIZES, *(math.ceil(n / len(MIX)) for n in BENCH_SIZES)})
    out: set[str] = set()
    for n in sizes:
        out.update(p.text for p in spread(records, n))
        for seed in BENCH_SEEDS:
            out.update(p.text for p in sample_workload(name, n, seed, root))
    return out


def training_prompts(datasets_dir: Path = DEFAULT_DATASETS_DIR, files: list[Path] = ()) -> list[Prompt]:
    """The prompts to answer: `files` (JSONL / JSON lists, see read_prompt_file) or else the shared datasets'
    TRAIN_WORKLOADS minus what the benches draw; shuffled by a fixed seed, so that a partial run covers each
    source in proportion."""
    if files:
        prompts = [p for f in files for p in read_prompt_file(Path(f))]
    else:
        root = check_datasets_dir(datasets_dir)
        prompts = []
        for name in TRAIN_WORKLOADS:
            seen = bench_texts(name, root)
            prompts += [p for p in WORKLOADS[name](root) if p.text not in seen]
    unique = {prompt_key(p): p for p in prompts}
    keys = sorted(unique)
    random.Random(0).shuffle(keys)
    return [unique[k] for k in keys]


def read_shards(data_dir: Path) -> list[Sequence]:
    out = []
    for shard in sorted(Path(data_dir).glob("answers-*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out.append(Sequence(r["key"], r["prompt"], r["answer"], is_held_out(r["key"])))
    return out


def generate(runner, tokenizer, prompts: list[Prompt], data_dir: Path, max_tokens: int, batch_size: int = 16,
             shard_size: int = 256, log=print) -> int:
    """The target's greedy answers to `prompts` appended to `data_dir/answers-NNNNN.jsonl`; returns how many were
    answered now (those already in a shard are skipped). A batch's shard line is written as the batch ends."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    done = {s.key for s in read_shards(data_dir)}
    todo = [p for p in prompts if prompt_key(p) not in done]
    eos = set(tokenizer.eos_token_ids)
    limit = runner.max_model_len
    start, answered, tokens_out = time.perf_counter(), 0, 0
    shard_index = len(list(data_dir.glob("answers-*.jsonl")))
    in_shard = 0
    for b in range(0, len(todo), batch_size):
        batch = todo[b:b + batch_size]
        encoded = [encode(tokenizer, p)[: limit - 2] for p in batch]
        answers = greedy_answers(runner, encoded, max_tokens, eos)
        if in_shard >= shard_size:
            shard_index, in_shard = shard_index + 1, 0
        with open(data_dir / f"answers-{shard_index:05d}.jsonl", "a") as f:
            for p, prompt, answer in zip(batch, encoded, answers):
                f.write(json.dumps({"key": prompt_key(p), "dataset": p.dataset, "prompt": prompt,
                                    "answer": answer}) + "\n")
        in_shard += len(batch)
        answered += len(batch)
        tokens_out += sum(len(a) for a in answers)
        spent = time.perf_counter() - start
        eta = spent / answered * (len(todo) - answered)
        log(f"generate: {answered + len(done)}/{len(prompts)} prompts, {tokens_out / spent:.0f} tok/s, "
            f"eta {eta / 60:.0f} min")
    return answered


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt as the served model reads it: in its chat template, or as plain text where it has none (a base
    model's head learns from completions)."""
    if prompt.is_chat and not tokenizer.has_chat_template:
        return tokenizer.encode_prompt(prompt.text)
    return encode_prompt(tokenizer, prompt)


@torch.inference_mode()
def greedy_answers(runner, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """Plain greedy decoding of a batch through `runner` (what spind serves at temperature 0)."""
    from spind.models.runner import ForwardItem

    ids = [f"gen{i}" for i in range(len(prompts))]
    for rid in ids:
        runner.add_request(rid)
    try:
        logits = runner.forward([ForwardItem(rid, p) for rid, p in zip(ids, prompts)])
        nxt = [int(row[-1].argmax()) for row in logits]
        out: list[list[int]] = [[t] for t in nxt]
        live = [i for i, t in enumerate(nxt) if t not in eos and max_tokens > 1]
        while live:
            live = [i for i in live if len(prompts[i]) + len(out[i]) < runner.max_model_len]
            if not live:
                break
            logits = runner.forward([ForwardItem(ids[i], [out[i][-1]]) for i in live])
            still = []
            for i, row in zip(live, logits):
                t = int(row[-1].argmax())
                out[i].append(t)
                if t not in eos and len(out[i]) < max_tokens:
                    still.append(i)
            live = still
        return out
    finally:
        for rid in ids:
            runner.free_request(rid)


class TargetFeatures:
    """The features a served target hands its draft head, for whole sequences (teacher-forced), cached in memory
    as fp16 (recomputed by a resumed run)."""

    def __init__(self, runner, layers: tuple[int, ...], max_tokens_per_forward: int = 4096) -> None:
        self.runner, self.layers, self.budget = runner, layers, max_tokens_per_forward
        self.cache: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def get(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """[len(tokens), width] fp16 per sequence (row p: the features after reading token p)."""
        from spind.models.runner import ForwardItem

        todo = list({s.key: s for s in seqs if s.key not in self.cache}.values())  # a batch may repeat one
        while todo:
            group, total = [], 0
            while todo and (not group or total + len(todo[0].tokens) <= self.budget):
                s = todo.pop(0)
                group.append(s)
                total += len(s.tokens)
            for s in group:
                self.runner.add_request(s.key)
            try:
                _, feats = self.runner.forward_features([ForwardItem(s.key, s.tokens, 0) for s in group],
                                                        self.layers)
                for s, f in zip(group, feats):
                    self.cache[s.key] = f.to(torch.float16)
            finally:
                for s in group:
                    self.runner.free_request(s.key)
        return [self.cache[s.key] for s in seqs]
