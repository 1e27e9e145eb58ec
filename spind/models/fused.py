"""Fused drop-in modules for the quantized (`gguf`) target, swapped in at load time.

At batch 1 a decode step is ~30 layers x ~40 small torch ops; each costs ~1-2 us of dispatch, a quarter of the
step once the GEMMs read 4-bit weights. The fused twins keep the modules' call signatures, so the model's
forward does not change: `FusedRMSNorm` (7 ops -> 1), `FusedMLP` (split + silu + mul -> 1), `FusedAttention`
(split, RoPE of q and k, and the two cache writes: ~22 ops -> 1). All are batch-invariant
(kernels/csrc/fused_ops.cpp): every output row depends on its own input row only.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from spind.kernels import cpu_ext
from spind.models.gguf_linear import ACTIVATION_DIGITS, GGUFLinear
from spind.models.layers import MLP, Attention, RMSNorm


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.ops = cpu_ext.ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps).view(shape)


class FusedMLP(nn.Module):
    """down(silu(gate) * up) with the gate/up product fused into one row-wise op."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj
        self.ops = cpu_ext.ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        gate_up = self.gate_up_proj(x.reshape(-1, shape[-1]))  # [T, 2 * intermediate]
        return self.down_proj(self.ops.silu_mul(gate_up)).view(*shape[:-1], -1)


class FusedAttention(nn.Module):
    """layers.Attention with RoPE and the KV-cache writes in one op; attention itself is the forward's backend."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj
        self.num_heads, self.num_kv_heads, self.q_size, self.scale = (attn.num_heads, attn.num_kv_heads, attn.q_size,
                                                                      attn.scale)
        self.ops = cpu_ext.ops()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_slots: torch.Tensor, attend) -> torch.Tensor:
        q = self.ops.rope_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, write_slots, self.num_heads,
                             self.num_kv_heads)  # [T, H, D]; k, v written at write_slots
        return self.o_proj(attend(q, k_cache, v_cache, self.scale).reshape(x.shape[0], self.q_size))


class FusedStack:
    """Every decoder layer of a quantized target in one kernel call (kernels/csrc/stack.cpp): the same kernels as
    the fused modules, in the same order, so bit-identical to them, without ~11 Python module calls per layer.

    Built by `build` when every layer qualifies (GGUF linears with the kernels, no biases, fused modules); used by
    the model's forward when the forward's attention is the kernels' row attention (`kernel_plan()`), else the
    module loop runs.
    """

    def __init__(self, model: nn.Module, activations: str) -> None:
        self.ops = cpu_ext.ops()
        self.weights, self.q8_0, self.out_features, self.norms = [], [], [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self.weights.append(linear.blocks)
                self.q8_0.append(int(linear.qtype == "Q8_0"))
                self.out_features.append(linear.out_features)
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        first = model.layers[0]
        self.eps = first.input_layernorm.eps
        self.digits = ACTIVATION_DIGITS[activations]
        self.num_heads, self.num_kv_heads, self.scale = (first.self_attn.num_heads, first.self_attn.num_kv_heads,
                                                         first.self_attn.scale)

    @classmethod
    def build(cls, model: nn.Module) -> "FusedStack | None":
        """The stack of a model whose layers were fused by `fuse_modules`, or None when one does not qualify."""
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        fused = all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP) and
                    isinstance(layer.input_layernorm, FusedRMSNorm) and
                    isinstance(layer.post_attention_layernorm, FusedRMSNorm) for layer in model.layers)
        if not (fused and linears and all(isinstance(m, GGUFLinear) and m.has_kernel and m.bias is None
                                          for m in linears)):
            return None
        modes = {m.activations for m in linears}
        if len(modes) != 1:
            return None
        eps = {n.eps for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        return cls(model, modes.pop()) if len(eps) == 1 else None

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], write_slots: torch.Tensor, plan: tuple, start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
        """Layers [start, stop) (all by default): a forward that records the hidden state between two layers (a
        feature-level draft head's input) runs the stack in segments, the same kernels in the same order."""
        stop = len(self.norms) // 2 if stop is None else stop
        slots, slot_start, cu_q, ctx_lens = plan
        return self.ops.decoder_layers(h, self.weights[4 * start:4 * stop], self.q8_0[4 * start:4 * stop],
                                       self.out_features[4 * start:4 * stop], self.norms[2 * start:2 * stop],
                                       self.eps, self.digits, cos, sin, k_caches[start:stop], v_caches[start:stop],
                                       write_slots, slots, slot_start, cu_q, ctx_lens, self.scale, self.num_heads,
                                       self.num_kv_heads)


def fuse_modules(model: nn.Module) -> nn.Module:
    """Swap every fp32 RMSNorm, MLP and attention of a LLaMA model for its fused twin, in place (needs the CPU
    kernels and an fp32 model: the quantized targets)."""
    for name, child in list(model.named_children()):
        if isinstance(child, RMSNorm):
            setattr(model, name, FusedRMSNorm(child))
        elif isinstance(child, MLP):
            setattr(model, name, FusedMLP(child))
        elif isinstance(child, Attention):
            setattr(model, name, FusedAttention(child))
        else:
            fuse_modules(child)
    return model
