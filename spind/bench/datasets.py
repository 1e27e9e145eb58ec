"""Prompt workloads for benchmarks and tests, read from the shared datasets folder (never a hub).

Each workload yields `Prompt`s picked at evenly spaced records (deterministic, no RNG), so a run with
`num` prompts always sees the same ones and a larger `num` spreads over the whole file:
- `alpaca`:    instruction (+ input), chat;
- `mt_bench`:  first turn of the MT-bench questions, chat;
- `humaneval`: a function signature + docstring to complete, raw text (no chat template);
- `gsm8k`:     a grade-school math word problem, chat;
- `passage`:   "repeat / summarise this passage" over AlpacaEval answers — output that copies its context;
- `extract`:   JSON extraction with a schema per prompt (structured output): a document card or the named entities
               of an AlpacaEval passage, the quantities of a GSM8K problem, the task of an Alpaca instruction.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spind.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATASETS_DIR = REPO_ROOT.parent / "shared" / "datasets"

# passages short enough to keep a prompt under ~400 tokens, long enough to be worth copying
PASSAGE_CHARS = (600, 1600)
CP_MAX_CHARS = 2000  # role prompts past this are multi-page documents, not chat prompts
PASSAGE_TASKS = ("Repeat the following passage word for word.",
                 "Summarize the following passage, reusing its wording.")


class DatasetNotFoundError(FileNotFoundError):
    """The datasets folder or one of its files is missing; the message says where it looked."""


@dataclass(frozen=True)
class Prompt:
    dataset: str
    text: str
    is_chat: bool  # wrap in the model's chat template; False = a raw completion prompt
    category: str = ""  # the record's own category, where it has one (MT-bench's writing, coding, ...)
    schema: str = ""  # a JSON schema (as JSON) the output must follow: sent as response_format json_schema


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
    return [Prompt("mt_bench", r["turns"][0], True, r.get("category", ""))
            for r in _read_jsonl(root / "mt_bench" / "question.jsonl")]


def _cp(root: Path) -> list[Prompt]:
    """awesome-chatgpt-prompts: the text prompts (type TEXT) of the 2026-03 release."""
    path = root / "chatgpt_prompts" / "prompts.csv"
    if not path.is_file():
        raise DatasetNotFoundError(f"dataset file not found: {path}")
    csv.field_size_limit(1 << 24)  # a few prompts are long
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, skipinitialspace=True))
    return [Prompt("cp", r["prompt"].strip(), True) for r in rows
            if r.get("prompt") and r.get("type", "TEXT") in ("TEXT", "") and len(r["prompt"]) <= CP_MAX_CHARS]


def _humaneval(root: Path) -> list[Prompt]:
    return [Prompt("humaneval", r["prompt"], False) for r in _read_jsonl(root / "humaneval" / "HumanEval.jsonl")]


def _gsm8k(root: Path) -> list[Prompt]:
    return [Prompt("gsm8k", r["question"], True) for r in _read_jsonl(root / "gsm8k" / "test.jsonl")]


def _passage(root: Path) -> list[Prompt]:
    records = _read_json(root / "alpaca_eval" / "text_davinci_003_model_outputs.json")
    lo, hi = PASSAGE_CHARS
    texts = [r["output"].strip() for r in records if lo <= len(r["output"].strip()) <= hi]
    return [Prompt("passage", f"{PASSAGE_TASKS[i % len(PASSAGE_TASKS)]}\n\n{t}", True) for i, t in enumerate(texts)]


def _strings(max_chars: int, max_items: int) -> dict:
    return {"type": "array", "items": {"type": "string", "maxLength": max_chars}, "maxItems": max_items}


NUMBER = {"type": "integer", "minimum": -10**9, "maximum": 10**9}  # a bounded "number" could run on in decimals
# Extraction schemas: every string, number and array bounded, so that even a degenerate output (a small model
# repeating itself, one character per token) ends within EXTRACT_MAX_TOKENS
EXTRACT_SCHEMAS = {
    "card": {"type": "object", "additionalProperties": False,
             "required": ["title", "topic", "key_points", "sentiment"],
             "properties": {"title": {"type": "string", "maxLength": 60}, "topic": {"type": "string", "maxLength": 30},
                            "key_points": _strings(60, 3),
                            "sentiment": {"enum": ["positive", "neutral", "negative"]}}},
    "entities": {"type": "object", "additionalProperties": False,
                 "required": ["people", "places", "organizations", "dates"],
                 "properties": {k: _strings(24, 3) for k in ("people", "places", "organizations", "dates")}},
    "quantities": {"type": "object", "additionalProperties": False, "required": ["quantities", "asked_for", "answer"],
                   "properties": {"quantities": {"type": "array", "maxItems": 5, "items": {
                       "type": "object", "additionalProperties": False, "required": ["name", "value"],
                       "properties": {"name": {"type": "string", "maxLength": 30}, "value": NUMBER}}},
                       "asked_for": {"type": "string", "maxLength": 80}, "answer": NUMBER}},
    "task": {"type": "object", "additionalProperties": False, "required": ["task", "input_kind", "answer"],
             "properties": {"task": {"type": "string", "maxLength": 60},
                            "input_kind": {"enum": ["text", "list", "sentence", "code", "numbers", "other"]},
                            "answer": {"type": "string", "maxLength": 160}}},
}
EXTRACT_MAX_TOKENS = 512  # `bench serve --dataset extract --max-tokens 512`: no output of these schemas is longer
EXTRACT_TASKS = {
    "card": "Describe the following text as a JSON document card: a title, its topic, up to four key points "
            "and its overall sentiment.",
    "entities": "List the people, places, organizations and dates named in the following text, as JSON.",
    "quantities": "Read the following math problem. As JSON, list every quantity it gives (a short name and its "
                  "value), say what it asks for, and give the numeric answer.",
    "task": "Classify the following instruction and its input as JSON: what the task is, what kind of input it "
            "has, and your answer to it.",
}


def _extract_prompt(kind: str, text: str) -> Prompt:
    schema = json.dumps(EXTRACT_SCHEMAS[kind])
    return Prompt("extract", f"{EXTRACT_TASKS[kind]} Reply with only a JSON object following this JSON schema:\n"
                             f"{schema}\n\n{text}", True, kind, schema)


def _extract(root: Path) -> list[Prompt]:
    """A card and the entities of AlpacaEval passages, GSM8K problems, Alpaca instructions with input: as many of
    each kind, in a fixed shuffled order."""
    lo, hi = PASSAGE_CHARS
    passages = [r["output"].strip() for r in _read_json(root / "alpaca_eval" / "text_davinci_003_model_outputs.json")
                if lo <= len(r["output"].strip()) <= hi]
    problems = [r["question"] for r in _read_jsonl(root / "gsm8k" / "test.jsonl")]
    tasks = [f"Instruction: {r['instruction']}\nInput: {r['input']}"
             for r in _read_json(root / "alpaca" / "alpaca_5000.json") if r["input"].strip()]
    groups = [[_extract_prompt("card", t) for t in passages[0::2]],
              [_extract_prompt("entities", t) for t in passages[1::2]],
              [_extract_prompt("quantities", t) for t in problems], [_extract_prompt("task", t) for t in tasks]]
    prompts = [p for group in zip(*groups) for p in group]
    random.Random(0).shuffle(prompts)  # a fixed order that any even spread (load_prompts) samples every kind from
    return prompts


WORKLOADS: dict[str, Callable[[Path], list[Prompt]]] = {
    "alpaca": _alpaca, "mt_bench": _mt_bench, "mtbench": _mt_bench, "cp": _cp, "humaneval": _humaneval,
    "gsm8k": _gsm8k, "passage": _passage, "extract": _extract,
}
# the paper's Mix blends Alpaca, ChatGPT Prompts and Chatbot Instruction Prompts; the third cannot be had offline,
# so passage (output that copies its context) takes its place: the workload whose best drafter differs most
MIX = ("alpaca", "cp", "passage")


PROMPT_FILE_FORMAT = ('one JSON value per line, each a prompt string, an object {"prompt": "the prompt"} (with an '
                      'optional "category": "..."), or an MT-bench record {"question_id": 1, "category": "writing", '
                      '"turns": ["the prompt", ...]} (its first turn is the prompt); or one JSON list of such values; '
                      'each prompt is sent as a user chat message')


def check_datasets_dir(datasets_dir: Path, prompts_flag: str | None = None) -> Path:
    """The shared datasets folder, or an error saying where it was looked for and, for a bench that also takes a
    prompt file (`prompts_flag`, e.g. --workload), how to give one's own prompts instead."""
    if not datasets_dir.is_dir():
        own = (f"; or give your own prompts: {prompts_flag} FILE.jsonl, {PROMPT_FILE_FORMAT}" if prompts_flag
               else "")
        raise DatasetNotFoundError(
            f"datasets folder not found: {datasets_dir} (expected the shared/datasets folder next to the repo "
            f"checkout; pass --datasets-dir DIR{own})")
    return datasets_dir


def load_prompts(name: str, num: int, datasets_dir: Path = DEFAULT_DATASETS_DIR) -> list[Prompt]:
    """`num` prompts of workload `name`, evenly spread over the dataset."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(WORKLOADS)}")
    if num < 1:
        raise ValueError("number of prompts must be >= 1")
    return spread(WORKLOADS[name](check_datasets_dir(datasets_dir)), num)


class WorkloadFormatError(ValueError):
    """A prompt file not in PROMPT_FILE_FORMAT; the message names the line."""


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def read_prompt_file(path: Path) -> list[Prompt]:
    """Prompts from a file of one's own (PROMPT_FILE_FORMAT): JSONL or one JSON list of prompt strings, {"prompt"}
    objects (the shape most prompt files have) or MT-bench records ({"question_id", "category", "turns": [...]}:
    the first turn), each a chat prompt. One clear error naming the line otherwise."""
    if not path.is_file():
        raise DatasetNotFoundError(f"prompt file not found: {path}")
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise WorkloadFormatError(f"{path}: not valid JSON: {e}") from None
        rows = list(enumerate(items, 1))
    else:
        rows = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((line_no, json.loads(line)))
                except ValueError as e:
                    raise WorkloadFormatError(f"{path}:{line_no}: not valid JSON: {e}") from None
    prompts = []
    for where, item in rows:
        if _nonempty_str(item):
            prompts.append(Prompt(path.stem, item, True))
        elif isinstance(item, dict) and _nonempty_str(item.get("prompt")):
            prompts.append(Prompt(path.stem, item["prompt"], True, str(item.get("category", ""))))
        elif isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"] \
                and _nonempty_str(item["turns"][0]):
            prompts.append(Prompt(path.stem, item["turns"][0], True, str(item.get("category", ""))))
        else:
            raise WorkloadFormatError(f"{path}:{where}: got {json.dumps(item)[:80]}; a prompt file holds "
                                      f"{PROMPT_FILE_FORMAT}")
    if not prompts:
        raise WorkloadFormatError(f"{path}: no prompts")
    return prompts


def sample_workload(name: str, num: int, seed: int, datasets_dir: Path = DEFAULT_DATASETS_DIR) -> list[Prompt]:
    """`num` prompts of a workload (a name, `mix`, or a prompt file's path), drawn deterministically by seed.
    In `mix` each prompt's category is the workload it came from."""
    if num < 1:
        raise ValueError("number of prompts must be >= 1")
    rng = random.Random(seed)
    if name == "mix":
        parts = [sample_workload(w, -(-num // len(MIX)), seed, datasets_dir) for w in MIX]
        mixed = [Prompt(p.dataset, p.text, p.is_chat, p.dataset) for group in zip(*parts) for p in group]
        return mixed[:num]
    if name in WORKLOADS:
        records = WORKLOADS[name](check_datasets_dir(datasets_dir, "--workload"))
    elif "/" in name or name.endswith((".json", ".jsonl")):
        records = read_prompt_file(Path(name).expanduser())
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join([*WORKLOADS, 'mix'])}, or a prompt file "
                         f"(a path ending in .jsonl or .json, or holding a /: {PROMPT_FILE_FORMAT})")
    return rng.sample(records, num) if num < len(records) else rng.sample(records, len(records))
