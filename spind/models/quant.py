"""Quantized linear layers: quantized targets (`[model].dtype`) and the self-drafts derived from a target.

Target dtypes beyond float32 / bfloat16 / float16 (the model keeps fp32 activations, norms, embeddings and KV;
only the linear layers change):
- `gguf`: the GGUF's own blocks (Q4_1 layers and a Q8_0 lm_head for the default model) through spind's CPU
  kernel (`GGUFLinear`): fp32 activations, the exact dequantized weights, batch-invariant;
- `gguf-q16` / `gguf-q8`: the same blocks, each GEMM's activations quantized to 15 / 8 bits per block of 32
  (llama.cpp's Q8_1 idea, and a two-digit refinement of it): exact integer dot products on AVX2 and AVX-512 VNNI
  alike (bit-identical between them), batch-invariant;
- `int4`: torch's `_weight_int4pack_mm_for_cpu` on the GGUF's 4-bit codes, Q4_1's w = d q + m rewritten as
  (q - 8) d + (m + 8 d) with bf16 scales and zeros; bf16 activations; lm_head as `int8`;
- `int8`: torch's `_weight_int8pack_mm` with one bf16 scale per output channel, requantized from the dequantized
  weights; bf16 activations.
Self-draft variants (`quantize_linears`): weight-only int8 as above, and dynamic int8 (activations quantized per
forward, fbgemm/onednn kernels).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from spind.config import QUANTIZED_DTYPES
from spind.kernels import cpu_ext
from spind.models.fused import FusedStack, fuse_modules
from spind.models.gguf_linear import GGUFLinear, block_fields, concat_blocks
from spind.models.loader import GGUFBlocks, gguf_source, load_gguf_blocks

log = logging.getLogger(__name__)

GGUF_DTYPES = {"gguf": "fp32", "gguf-q16": "q16", "gguf-q8": "q8"}  # GGUFLinear targets -> their activations
INT4_GROUP = 32  # GGUF's block: torch's int4 groups map one to one onto Q4_0 / Q4_1 blocks


class Int8WeightOnlyLinear(nn.Module):
    """int8 weights with a bf16 scale per output channel; bf16 activations, output in the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [out]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous(),
                                      self.weight_int8, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], -1).to(x.dtype)


class Int4Linear(nn.Module):
    """torch's CPU int4 kernel on a Q4_0 / Q4_1 GGUF tensor's 4-bit codes; bf16 activations, bf16 scales."""

    def __init__(self, blocks: GGUFBlocks, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if blocks.qtype not in ("Q4_0", "Q4_1"):
            raise ValueError(f"int4 needs Q4_0 or Q4_1 blocks, got {blocks.qtype}")
        n, k = blocks.shape
        d, qs, m = block_fields(blocks)  # [N, G], [N, G, 16], [N, G]
        d = d.float()
        codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k).to(torch.int32)  # [N, K] in 0..15
        zeros = torch.zeros_like(d) if m is None else m.float() + 8 * d  # (q - 8) d + zero
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_and_zeros", torch.stack([d, zeros], dim=-1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))  # [G, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous(),
                                              self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], -1).to(x.dtype)


def quantize_linears(model: nn.Module, variant: str) -> nn.Module:
    """Replace every nn.Linear (lm_head included) in place; returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, _quantized(child, variant))
        else:
            quantize_linears(child, variant)
    return model


def _quantized(linear: nn.Linear, variant: str) -> nn.Module:
    if variant == "int8-weight-only":
        return Int8WeightOnlyLinear(linear)
    if variant == "int8-dynamic":
        from torch.ao.nn.quantized.dynamic import Linear as DynLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        src = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            src.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                src.bias.copy_(linear.bias.float())
        src.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DynLinear.from_float(src)
    raise ValueError(f"unknown quantization variant {variant!r}")


# our fused linear -> the HF names of the tensors it concatenates (row-wise)
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


def quantize_target(model: nn.Module, model_dir: Path, dtype: str, layers: list[int], shard=None) -> nn.Module:
    """Swap the fp32 model's linear layers for `dtype`'s (see the module docstring), in place.

    `layers[i]` is the checkpoint layer that model layer i was loaded from. A tensor whose GGUF type has no
    kernel for `dtype` keeps its fp32 linear (logged). `shard`: a tensor-parallel rank's (tensor_parallel.Shard),
    whose slices of the GGUF's blocks are read.
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"dtype {dtype!r} is a CPU target; use float32 or bfloat16 on other devices")
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"unknown quantized dtype {dtype!r}; known: {', '.join(QUANTIZED_DTYPES)}")
    model.quantized = dtype
    if dtype == "int8":
        return quantize_linears(model, "int8-weight-only")
    blocks = load_gguf_blocks(model_dir, None if shard is None else shard.slice_of)
    kept = []
    for i, old in enumerate(layers):
        for path, parts in _FUSED.items():
            owner_name, attr = path.split(".")
            owner = getattr(model.layers[i], owner_name)
            names = [f"model.layers.{old}.{p}.weight" for p in parts]
            kept.append(_swap(owner, attr, [blocks.get(n) for n in names], dtype, names[0]))
    head = "lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"
    if dtype in GGUF_DTYPES:
        kept.append(_swap(model, "lm_head", [blocks.get(head)], dtype, head))
    else:  # no int4 kernel for Q8_0: the int4 target's lm_head is weight-only int8
        model.lm_head = Int8WeightOnlyLinear(model.lm_head)
    if not all(kept):
        log.info("%s target: %d of %d linear layers kept fp32 (their GGUF type has no %s kernel)",
                 dtype, kept.count(False), len(kept), dtype)
    if dtype in GGUF_DTYPES and cpu_ext.available():
        cpu_ext.tune_amx_layout()  # once per process: the faster of the AMX path's two layouts on this CPU
        fuse_modules(model)
        model.fused_stack = FusedStack.build(model)
    return model


def _swap(owner: nn.Module, attr: str, parts: list[GGUFBlocks | None], dtype: str, name: str) -> bool:
    """Replace owner.attr by a quantized linear over the fused `parts`; False when it stays fp32."""
    ok = ("Q4_0", "Q4_1") if dtype == "int4" else ("Q4_0", "Q4_1", "Q8_0")
    if any(p is None or p.qtype not in ok for p in parts) or len({p.qtype for p in parts}) != 1:
        log.debug("%s stays fp32 for dtype %s", name, dtype)
        return False
    linear: nn.Linear = getattr(owner, attr)
    blocks = concat_blocks(parts)
    if blocks.shape != tuple(linear.weight.shape):
        raise ValueError(f"{name}: GGUF blocks of shape {blocks.shape}, the model expects {tuple(linear.weight.shape)}")
    quantized = (GGUFLinear.from_blocks(blocks, linear.bias, activations=GGUF_DTYPES[dtype])
                 if dtype in GGUF_DTYPES else Int4Linear(blocks, linear.bias))
    setattr(owner, attr, quantized)
    return True


def float_dtype_for(dtype: str, model_dir: Path) -> str:
    """`dtype` for a model in `model_dir`, or float32 when `dtype` is quantized and the model has no GGUF blocks
    to run it from (a model drafter given as an HF directory beside a quantized target)."""
    if dtype in QUANTIZED_DTYPES and gguf_source(model_dir) is None:
        return "float32"
    return dtype


class TrimmedVocabHead(nn.Module):
    """An lm_head over the first `num_kept` token ids; the rest get -inf logits (a draft never proposes them, and
    its proposal distribution stays a distribution over the whole vocabulary, as stochastic verification needs)."""

    def __init__(self, head: nn.Module, num_kept: int, vocab_size: int) -> None:
        super().__init__()
        self.head, self.num_kept, self.vocab_size = head, num_kept, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(self.head(x)[..., :self.num_kept], (0, self.vocab_size - self.num_kept), value=float("-inf"))


def trim_vocab(model: nn.Module, num_kept: int) -> nn.Module:
    """Keep token ids [0, num_kept) in the model's lm_head, in place (a cheaper self-draft: the lm_head of a
    135M model is a fifth of its weights). Ids follow BPE merge order, which roughly follows frequency."""
    head = model.lm_head
    vocab = head.out_features
    if not 0 < num_kept < vocab:
        raise ValueError(f"vocab must be in 1..{vocab - 1}, got {num_kept}")
    if isinstance(head, GGUFLinear):
        small = head.first_rows(num_kept)
    elif isinstance(head, nn.Linear):
        small = nn.Linear(head.in_features, num_kept, bias=head.bias is not None)
        small.weight = nn.Parameter(head.weight[:num_kept].detach().clone(), requires_grad=False)
        if head.bias is not None:
            small.bias = nn.Parameter(head.bias[:num_kept].detach().clone(), requires_grad=False)
    else:
        raise ValueError(f"cannot trim an lm_head of type {type(head).__name__}")
    model.lm_head = TrimmedVocabHead(small, num_kept, vocab)
    return model
