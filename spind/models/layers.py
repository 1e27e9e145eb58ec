"""The building blocks of a LLaMA-family decoder layer: the model's shape (`LlamaArgs`), RMSNorm, RoPE, attention
(q/k/v fused into one matmul) and the SwiGLU MLP (gate/up fused).

Apart from `spind.models.llama` (the model and its loader) so that `spind.models.fused` can recognise these modules
to swap in their fused twins without importing the model, which imports the quantization that imports `fused`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ROPE_TYPES = ("default", "linear", "llama3")  # what rope_tables computes exactly (transformers' formulas)


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE frequency scaling (transformers' `rope_parameters`, formerly `rope_scaling`).

    Both types keep transformers' attention_scaling at 1, so only the inverse frequencies change."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only, like the two below
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict) -> "RopeScaling | None":
        """None for plain RoPE; ValueError for a type spind does not compute."""
        params = _rope_params(cfg)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not served by spind (it computes "
                             f"{', '.join(ROPE_TYPES)}); its logits would be wrong from the first token")
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not served by spind (it rotates whole heads)")
        if rope_type == "default":
            return None
        if rope_type == "linear":
            return cls("linear", float(params["factor"]))
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins, else the
        # dict's, else max_position_embeddings
        original = cfg.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        return cls("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]), int(original))

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """transformers' _compute_linear_scaling_rope_parameters / _compute_llama3_parameters, op for op."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (beyond the pre-training context) are divided by factor, short ones kept,
        # the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def _rope_params(cfg: dict) -> dict:
    """The RoPE dict as transformers reads it: `rope_scaling` (older checkpoints) wins over `rope_parameters`
    (transformers 5). A dict per layer type (nested) is refused: spind's layers share one table."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters {params} are not served by spind")
    return params


def sliding_window(cfg: dict) -> int | None:
    """The attention window of any layer, as transformers applies it: a query at position i attends keys
    j in (i - window, i] (masking_utils.sliding_window_overlay). None where no layer has one."""
    window, model_type = cfg.get("sliding_window"), cfg.get("model_type", "llama")
    if window is None or model_type == "llama":  # LlamaAttention has no window, whatever the config says
        return None
    if model_type == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return None
        layer_types = cfg.get("layer_types")  # transformers 5 writes it; older configs imply it:
        if layer_types is None:  # layers from max_window_layers on slide
            layer_types = ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]
        if "sliding_attention" not in layer_types:
            return None
    return int(window)  # mistral: every layer (MistralModel ignores layer_types)


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
    max_position: int  # the longest sequence served (the runner's max_model_len is at most this)
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    # The checkpoint's attention window where it is shorter than max_position_embeddings, else None. spind's
    # attention kernels have no window, so max_position is capped to it: a query at position i < window sees every
    # key 0..i under the window too (transformers' keys (i - W, i]; flash-attention's window_size=(W, 0) keeps one
    # more), so the window never binds and the output is exact. Refusing instead would turn away Mistral-7B-v0.1
    # (a 4096 window, 32k positions) whose first 4096 tokens spind serves exactly.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.max_position > self.sliding_window:
            raise ValueError(f"max_position {self.max_position} > sliding_window {self.sliding_window}: spind's "
                             f"attention has no window, so it would attend where the model does not")

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaArgs":
        if cfg.get("model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not LLaMA-family (llama, mistral, qwen2)")
        # transformers puts the top-level rope_theta into the RoPE dict only where that has none
        theta = _rope_params(cfg).get("rope_theta") or cfg.get("rope_theta") or 10000.0
        max_position = cfg.get("max_position_embeddings", 2048)
        window = sliding_window(cfg)
        window = window if window is not None and window < max_position else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads, num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position=max_position if window is None else window,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            rope_scaling=RopeScaling.from_hf(cfg), sliding_window=window)


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
    """cos, sin: [max_len, head_dim // 2] in fp32 on the CPU (HF rotate-half convention).

    On the CPU even inside `torch.device("meta")`: the first op on a meta tensor imports torch's Python meta kernels
    (~150 MB resident for the process's life)."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64, device="cpu").float()
                                     / args.head_dim))
    if args.rope_scaling is not None:
        inv = args.rope_scaling.scale(inv)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64, device="cpu").float(), inv)
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
