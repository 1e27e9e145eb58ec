"""Drafters (SSMs): build one from its config entry."""

from __future__ import annotations

from pathlib import Path

from spind.config import DrafterConfig, SpindConfig, configured_kv_blocks, resolve_dtype
from spind.drafters.base import Draft, DraftInput, Drafter
from spind.drafters.model import ModelDrafter
from spind.drafters.ngram import NgramDrafter
from spind.drafters.suffix import SuffixDrafter
from spind.models.llama import LlamaModel, load_llama
from spind.models.loader import resolve_model_dir
from spind.models.quant import GGUF_DTYPES, float_dtype_for, quantize_linears, trim_vocab
from spind.tokenizer import Tokenizer

__all__ = ["Draft", "DraftInput", "Drafter", "build_drafter", "load_drafter_model", "make_drafter",
           "resolve_head_dir", "TokenizerMismatchError"]

# the draft head spind trains for its embedded default model and ships (see its MODEL_CARD.md)
DEFAULT_HEAD_DIR = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"


class TokenizerMismatchError(ValueError):
    """A drafter model does not share the target's tokenizer, so its tokens would mean something else."""


def check_same_tokenizer(name: str, drafter_dir: Path, target_tok: Tokenizer, drafter_vocab: int,
                         target_vocab: int) -> None:
    if drafter_vocab != target_vocab:
        raise TokenizerMismatchError(
            f"drafter {name!r}: vocabulary size {drafter_vocab} != target's {target_vocab}; "
            f"a drafter must share the target's tokenizer")
    if (drafter_dir / "tokenizer.json").is_file():
        if Tokenizer(drafter_dir).fingerprint() != target_tok.fingerprint():
            raise TokenizerMismatchError(f"drafter {name!r}: its tokenizer differs from the target's")


def build_drafter(dc: DrafterConfig, cfg: SpindConfig, target_dir: Path, target_tok: Tokenizer,
                  device: str = "cpu") -> Drafter:
    """One drafter, loaded and ready: its model at [model].dtype as resolved on `device`, its KV pool of
    [runtime].kv_num_blocks (0: as many as max_batch_size requests of max_model_len can fill)."""
    model = load_drafter_model(dc, cfg, target_dir, target_tok, device, resolve_dtype(cfg, target_dir, device))
    return make_drafter(dc, cfg, model, configured_kv_blocks(cfg))


def load_drafter_model(dc: DrafterConfig, cfg: SpindConfig, target_dir: Path, target_tok: Tokenizer,
                       device: str, dtype: str) -> LlamaModel | None:
    """A drafter's model (None for n-gram lookup); `dtype`: [model].dtype as resolved on `device`. Apart from
    `make_drafter` so a worker can size the KV pools of all its models once they are loaded."""
    if dc.kind in ("ngram", "suffix", "eagle"):  # model-free, or a head beside the target (make_eagle_drafters)
        return None
    if dc.kind == "self":
        if dc.variant == "bf16":
            return load_llama(target_dir, "bfloat16", device)
        if dc.variant == "int8-weight-only":
            return quantize_linears(load_llama(target_dir, "bfloat16", device), dc.variant)
        if dc.variant == "int8-dynamic":
            return quantize_linears(load_llama(target_dir, "float32", device), dc.variant)
        if dc.variant in GGUF_DTYPES:
            model = load_llama(target_dir, dc.variant, device, layers=dc.layers or None)
            if dc.vocab:
                trim_vocab(model, dc.vocab)
            return model
        return load_llama(target_dir, float_dtype_for(dtype, target_dir), device, layers=dc.layers)  # layers
    drafter_dir = resolve_model_dir(dc.path, cfg.cache_path)
    model = load_llama(drafter_dir, float_dtype_for(dtype, drafter_dir), device)
    target_vocab = load_vocab_size(target_dir)
    check_same_tokenizer(dc.name, drafter_dir, target_tok, model.args.vocab_size, target_vocab)
    return model


def make_drafter(dc: DrafterConfig, cfg: SpindConfig, model: LlamaModel | None, num_blocks: int) -> Drafter:
    if dc.kind == "eagle":
        raise ValueError(f"drafter {dc.name!r}: an eagle head is built beside its target (make_eagle_drafters)")
    if dc.kind == "suffix":
        return SuffixDrafter(dc.name, dc.max_depth, dc.factor, dc.min_prob, dc.cache_mb)
    if model is None:
        return NgramDrafter(dc.name, dc.ngram_max, dc.ngram_min)
    r = cfg.runtime
    return ModelDrafter(dc.name, dc.kind, model, num_blocks, r.kv_block_size, r.attention, cfg.model.max_model_len,
                        r.max_batch_size, cuda_graphs=r.cuda_graphs and model.device.type == "cuda")


def resolve_head_dir(path: str) -> Path:
    """An eagle drafter's `path`: "default" is the head shipped for the embedded default model."""
    if path == "default":
        return DEFAULT_HEAD_DIR
    return Path(path).expanduser()


def load_vocab_size(model_dir: Path) -> int:
    import json
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
