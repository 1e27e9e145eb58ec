"""Quantized linear layers for self-drafts derived from the target.

- weight-only int8: int8 weights with a bf16 scale per output channel, bf16 activations
  (`torch._weight_int8pack_mm`, a fused CPU/GPU kernel);
- dynamic int8: int8 weights per channel, activations quantized per forward (fbgemm/onednn kernels).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn


class Int8WeightOnlyLinear(nn.Module):
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
        return y.view(*shape[:-1], -1)


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
