"""A compact LLaMA-family forward (LLaMA, SmolLM2, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

Tokens of all requests in a forward are packed into one `[T, hidden]` matrix, so the dense layers never
see padding; only attention is per request (see kernels/attention.py). q/k/v and gate/up are fused into
one matmul each. Linear layers are plain `nn.Linear` so that a drafter can swap in quantized ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from spind.kernels.metadata import AttentionBackend, AttentionMetadata
from spind.models.kv_cache import KVCache
from spind.models.layers import Block, LlamaArgs, RMSNorm, rope_tables
from spind.models.quant import QUANTIZED_DTYPES, quantize_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = rope_tables(args, args.max_position)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused_stack = None  # all layers in one kernel call (quantized targets: spind/models/fused.py)
        self.quantized: str | None = None  # the dtype of quantized weights (quant.quantize_target); None: float

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        a = self.args
        return KVCache(len(self.layers), a.num_kv_heads, a.head_dim, num_blocks, block_size,
                       dtype or self.dtype, self.device, max_model_len or a.max_position)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
                attend: AttentionBackend, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T]; KV of the new tokens is written at meta.slot_mapping. `attend` must have been
        planned for `meta` (outside, so that a captured CUDA graph of this forward never re-plans).

        Returns fp32 logits [len(logits_rows), vocab] (all T rows when logits_rows is None).
        """
        cos = self.rope_cos[positions].unsqueeze(1).to(self.dtype)  # [T, 1, D/2]
        sin = self.rope_sin[positions].unsqueeze(1).to(self.dtype)
        h = self.embed_tokens(tokens)
        slots = meta.slot_mapping
        plan = None if self.fused_stack is None else getattr(attend, "kernel_plan", lambda: None)()
        if plan is not None:
            h = self.fused_stack(h, cos, sin, kv.k, kv.v, slots, plan)
        else:
            for i, layer in enumerate(self.layers):
                h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv.k[i], kv.v[i], slots, attend)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
            if h.shape[0] == 0:
                return h.new_empty(0, self.args.vocab_size, dtype=torch.float32)
        return self.lm_head(self.norm(h)).float()


def load_llama(model_dir: Path, dtype: str = "float32", device: str = "cpu",
               layers: tuple[int, ...] | None = None) -> LlamaModel:
    """Build our module from an HF-style directory (config.json + *.safetensors).

    `layers` keeps only those decoder layers (a layer-subset self-draft).
    """
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    args = LlamaArgs.from_hf(cfg)
    keep = list(range(args.num_layers)) if layers is None else list(layers)
    if any(not 0 <= i < args.num_layers for i in keep):
        raise ValueError(f"layer subset {keep} out of range 0..{args.num_layers - 1}")
    args = LlamaArgs(**{**args.__dict__, "num_layers": len(keep)})
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    with torch.device("meta"):
        model = LlamaModel(args)
    model.to_empty(device=device)
    cos, sin = rope_tables(args, args.max_position)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)

    def get(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise ValueError(f"{model_dir}: weight {name} missing") from None

    if dtype not in DTYPES and dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join([*DTYPES, *QUANTIZED_DTYPES])}")
    torch_dtype = DTYPES.get(dtype, torch.float32)  # quantized targets keep fp32 activations, norms and KV
    with torch.no_grad():
        model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
        model.norm.weight.copy_(get("model.norm.weight"))
        for new_i, old_i in enumerate(keep):
            p, layer = f"model.layers.{old_i}.", model.layers[new_i]
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if args.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            attn.o_proj.weight.copy_(get(p + "self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"),
                                                           get(p + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
        if args.tie_word_embeddings or "lm_head.weight" not in sd:
            model.lm_head.weight = model.embed_tokens.weight
        else:
            model.lm_head.weight.copy_(get("lm_head.weight"))
    model.to(torch_dtype)
    if dtype in QUANTIZED_DTYPES:
        quantize_target(model, model_dir, dtype, keep)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # tables stay fp32
    return model.eval().requires_grad_(False)
