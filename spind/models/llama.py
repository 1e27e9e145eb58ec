"""A compact LLaMA-family forward (LLaMA, SmolLM2, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

Tokens of all requests in a forward are packed into one `[T, hidden]` matrix, so the dense layers never
see padding; only attention is per request (see kernels/attention.py). q/k/v and gate/up are fused into
one matmul each. Linear layers are plain `nn.Linear` so that a drafter can swap in quantized ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from spind.kernels.metadata import AttentionBackend, AttentionMetadata
from spind.models.kv_cache import KVCache
from spind.models.quant import QUANTIZED_DTYPES, quantize_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaArgs":
        if cfg.get("model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not LLaMA-family (llama, mistral, qwen2)")
        rope = cfg.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {rope} is not supported yet")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads, num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(args: LlamaArgs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim // 2] in fp32 (HF rotate-half convention)."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, 1, D/2] already in x's dtype
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_slots: torch.Tensor, attend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        k_cache.index_copy_(0, write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, write_slots, v.view(t, self.num_kv_heads, self.head_dim).to(v_cache.dtype))
        o = attend(q, k_cache, v_cache, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)


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
