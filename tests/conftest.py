"""Shared fixtures: the real default model (SmolLM2-135M-Instruct), loaded once per test session.

Nothing here is faked: `engine` is the coordinator over in-process workers (`LocalEngine.load` of the
embedded config with every configured drafter), reading the model from the default cache dir
(~/.cache/spind, converted from the GGUF on first use). Tests that need the model take these fixtures;
tests of pure policies do not, and stay fast. Prompts come from tests/prompts.py, never ../shared.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from prompts import PROMPTS, encode
from spind.config import SpindConfig, load_config
from spind.coordinator.transport.local import GenRequest, GenResult, LocalEngine
from spind.models.loader import resolve_model_dir
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer

# One torch thread: the 2 cores are shared with other jobs, and when another process holds a core,
# OpenMP's 2-thread barriers stall each forward 5-10x (measured: 60 ms -> 300-700 ms per decode step).
torch.set_num_threads(1)

# 512 blocks x 16 tokens = 8k tokens of KV per model: room for every batch the tests run, at a
# quarter of the default's memory (the target and three model drafters each hold one pool).
TEST_KV_BLOCKS = 512

_req_ids = itertools.count()


def new_req_id(prefix: str) -> str:
    """A request id no other test uses: the session runtime is shared, and its KV is keyed by req_id."""
    return f"{prefix}-{next(_req_ids)}"


@pytest.fixture(scope="session")
def cfg() -> SpindConfig:
    return load_config(overrides={"runtime": {"kv_num_blocks": TEST_KV_BLOCKS}})


@pytest.fixture(scope="session")
def model_dir(cfg: SpindConfig) -> Path:
    return resolve_model_dir(cfg.model.target, cfg.cache_path)


@pytest.fixture(scope="session")
def engine(cfg: SpindConfig) -> LocalEngine:
    """The default target with all configured drafters (ngram, suffix, int8, dyn8, bf16), loaded once."""
    e = LocalEngine.load(cfg)
    yield e
    e.close()


@pytest.fixture(scope="session")
def tokenizer(engine: LocalEngine) -> Tokenizer:
    return engine.tokenizer


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """Chat, code, maths and copy-the-passage prompts, from 4 to ~290 tokens long."""
    return [encode(tokenizer, p) for p in PROMPTS]


def make_requests(prompt_ids: list[list[int]], drafter: str | None, k: int,
                  params: list[SamplingParams]) -> list[GenRequest]:
    return [GenRequest(new_req_id(drafter or "plain"), ids, p, drafter, k) for ids, p in zip(prompt_ids, params)]


def generate(engine: LocalEngine, prompt_ids: list[list[int]], drafter: str | None, k: int,
             params: list[SamplingParams]) -> list[GenResult]:
    """One batch through the coordinator, all requests admitted together."""
    return engine.generate(make_requests(prompt_ids, drafter, k, params), max_batch=len(prompt_ids))


def save_derived_checkpoint(src: Path, dst: Path, layers: list[int], vocab_size: int | None = None) -> Path:
    """Write an HF directory (config.json, model.safetensors in bf16, tokenizer files) holding `layers`
    of the model in `src`, renumbered from 0: a separate, smaller model sharing the target's tokenizer.
    `vocab_size` truncates the embedding, for a drafter whose vocabulary differs."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index not in layers:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{layers.index(index)}.", 1)
        tensors[name] = w.to(torch.bfloat16)
    if vocab_size is not None:
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:vocab_size].contiguous()
        config["vocab_size"] = vocab_size
    config["num_hidden_layers"] = len(layers)
    config["torch_dtype"] = "bfloat16"
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in [*src.glob("tokenizer*"), *src.glob("chat_template*")]:
        shutil.copy(f, dst / f.name)
    return dst


# The target without its middle layer, in bf16: a separate model close enough to the target that its
# drafts are often accepted (keeping only a few layers of this 135M model drafts nothing acceptable).
SMALL_DRAFTER_LAYERS = 29


@pytest.fixture(scope="session")
def small_drafter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    layers = [i for i in range(SMALL_DRAFTER_LAYERS + 1) if i != 15]
    return save_derived_checkpoint(model_dir, tmp_path_factory.mktemp("small-drafter"), layers)
