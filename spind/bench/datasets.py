"""Prompt workloads for benchmarks and tests, read from the shared datasets folder (never a hub).

Each workload yields `Prompt`s picked at evenly spaced records (deterministic, no RNG), so a run with
`num` prompts always sees the same ones and a larger `num` spreads over the whole file:
- `alpaca`:    instruction (+ input), chat;
- `mt_bench`:  first turn of the MT-bench questions, chat;
- `humaneval`: a function signature + docstring to complete, raw text (no chat template);
- `gsm8k`:     a grade-school math word problem, chat;
- `passage`:   "repeat / summarise this passage" over AlpacaEval answers — output that copies its context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spind.models.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATASETS_DIR = REPO_ROOT.parent / "shared" / "datasets"

# passages short enough to keep a prompt under ~400 tokens, long enough to be worth copying
PASSAGE_CHARS = (600, 1600)
PASSAGE_TASKS = ("Repeat the following passage word for word.",
                 "Summarize the following passage, reusing its wording.")


class DatasetNotFoundError(FileNotFoundError):
    """The datasets folder or one of its files is missing; the message says where it looked."""


@dataclass(frozen=True)
class Prompt:
    dataset: str
    text: str
    is_chat: bool  # wrap in the model's chat template; False = a raw completion prompt


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    if prompt.is_chat:
        return tokenizer.apply_chat([{"role": "user", "content": prompt.text}])
    return tokenizer.encode(prompt.text)


def spread(records: list, num: int) -> list:
    """`num` records at evenly spaced indices (all of them when num >= len)."""
    if num >= len(records):
        return list(records)
    return [records[i * len(records) // num] for i in range(num)]


def _read_json(path: Path) -> list:
    if not path.is_file():
        raise DatasetNotFoundError(f"dataset file not found: {path}")
    return json.loads(path.read_text())


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise DatasetNotFoundError(f"dataset file not found: {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _alpaca(root: Path) -> list[Prompt]:
    records = _read_json(root / "alpaca" / "alpaca_5000.json")
    return [Prompt("alpaca", r["instruction"] + (f"\n\n{r['input']}" if r["input"] else ""), True)
            for r in records]


def _mt_bench(root: Path) -> list[Prompt]:
    return [Prompt("mt_bench", r["turns"][0], True) for r in _read_jsonl(root / "mt_bench" / "question.jsonl")]


def _humaneval(root: Path) -> list[Prompt]:
    return [Prompt("humaneval", r["prompt"], False) for r in _read_jsonl(root / "humaneval" / "HumanEval.jsonl")]


def _gsm8k(root: Path) -> list[Prompt]:
    return [Prompt("gsm8k", r["question"], True) for r in _read_jsonl(root / "gsm8k" / "test.jsonl")]


def _passage(root: Path) -> list[Prompt]:
    records = _read_json(root / "alpaca_eval" / "text_davinci_003_model_outputs.json")
    lo, hi = PASSAGE_CHARS
    texts = [r["output"].strip() for r in records if lo <= len(r["output"].strip()) <= hi]
    return [Prompt("passage", f"{PASSAGE_TASKS[i % len(PASSAGE_TASKS)]}\n\n{t}", True) for i, t in enumerate(texts)]


WORKLOADS: dict[str, Callable[[Path], list[Prompt]]] = {
    "alpaca": _alpaca, "mt_bench": _mt_bench, "humaneval": _humaneval, "gsm8k": _gsm8k, "passage": _passage,
}


def check_datasets_dir(datasets_dir: Path) -> Path:
    if not datasets_dir.is_dir():
        raise DatasetNotFoundError(
            f"datasets folder not found: {datasets_dir} (expected the shared/datasets folder next to the repo "
            f"checkout; pass --datasets-dir)")
    return datasets_dir


def load_prompts(name: str, num: int, datasets_dir: Path = DEFAULT_DATASETS_DIR) -> list[Prompt]:
    """`num` prompts of workload `name`, evenly spread over the dataset."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(WORKLOADS)}")
    if num < 1:
        raise ValueError("number of prompts must be >= 1")
    return spread(WORKLOADS[name](check_datasets_dir(datasets_dir)), num)
