"""A tiny random LLaMA checkpoint (an HF directory: config.json, model.safetensors, the scripted word-level tokenizer),
for tests that need real workers and real forwards but not a real model: it loads in milliseconds on any device."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scripted_worker import EOS, VOCAB, write_tokenizer

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def write_tiny_checkpoint(path: Path, torch_dtype: str = "float32", seed: int = 0) -> Path:
    from safetensors.torch import save_file

    write_tokenizer(path)
    head_dim = HIDDEN // HEADS
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
                    p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
                    p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
                    p + "input_layernorm.weight": torch.ones(HIDDEN),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN)}
    save_file({k: v.to(getattr(torch, torch_dtype)).contiguous() for k, v in tensors.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": EOS,
        "torch_dtype": torch_dtype}))
    return path
