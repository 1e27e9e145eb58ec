"""A linear layer that keeps the GGUF's own quantized blocks and runs spind's CPU kernel on them.

`GGUFLinear` holds Q4_0 / Q4_1 / Q8_0 weights at the file's size (0.5625 / 0.625 / 1.0625 bytes per weight)
regrouped in blocks of 32 output rows (the layout of kernels/csrc/quant_gemm.cpp), and computes y = x W^T from
fp32 activations in one of two precisions:
- fp32 (`gguf`): integer dot products of the codes with a 23-bit fixed-point copy of each block of x (AVX-512
  VNNI), or fp32 FMAs on the weights dequantized in registers (AVX2);
- 15-bit (`gguf-q16`) or 8-bit (`gguf-q8`) activations: each block of 32 activations as two or one int8 digits
  and one fp32 scale, dotted with the codes exactly in int32 (vpdpbusd on AVX-512 VNNI, vpmaddubsw / vpmaddwd on
  AVX2): the same integer sums and the same fp32 epilogue on both, so the two builds give bit-identical outputs, at
  2/3 or 1/3 of the fp32 path's integer work on VNNI and well under AVX2's fp32 FMAs: what lets extra rows (a
  verify, a prefill) cost little.
Q4_0 (w = d (q - 8)) rides on the Q4_1 kernel with m = -8 d, which is exact. Both are batch-invariant (a row's
output does not depend on the other rows), which keeps speculative decoding lossless against this target.

Without the kernel (no compiler, no AVX2: see kernels/cpu_ext.py) the layer holds the dequantized fp32
weight and runs torch's matmul: the same values, more bytes per step, and no batch invariance.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from spind.kernels import cpu_ext
from spind.models.loader import BLOCK_BYTES, GGUFBlocks

PAIR = 32  # output rows per packed block: two 16-row tiles, the kernels' widest unit of work
# activation precisions -> int8 digits per activation in the kernels (0: the build's fp32-precision path)
ACTIVATION_DIGITS = {"fp32": 0, "q8": 1, "q16": 2}


def concat_blocks(parts: list[GGUFBlocks]) -> GGUFBlocks:
    """Row-wise concatenation (fused q/k/v or gate/up projections); all parts must share one type."""
    qtypes = {p.qtype for p in parts}
    if len(qtypes) != 1:
        raise ValueError(f"cannot fuse tensors of types {sorted(qtypes)}")
    return GGUFBlocks(parts[0].qtype, torch.cat([p.data for p in parts]))


def block_fields(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(d fp16 [N, G], codes uint8 [N, G, bytes], m fp16 [N, G] or None) of raw GGUF blocks; Q4_x codes hold k and
    k + 16 of a block in the low and high nibble of byte k."""
    rows = blocks.data.shape[0]
    raw = blocks.data.view(rows, -1, BLOCK_BYTES[blocks.qtype])
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if blocks.qtype == "Q4_1":
        return d, raw[..., 4:].contiguous(), raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
    return d, raw[..., 2:].contiguous(), None


def dequantize(blocks: GGUFBlocks) -> torch.Tensor:
    """fp32 [N, K], bit-identical to gguf.quants.dequantize."""
    d, q, m = block_fields(blocks)
    n, g = d.shape
    if blocks.qtype == "Q8_0":
        return (q.view(torch.int8).float() * d.float()[..., None]).reshape(n, g * 32)
    nibbles = torch.cat([q & 15, q >> 4], dim=-1).float()  # [N, G, 32]: low nibbles are k 0..15, high 16..31
    if blocks.qtype == "Q4_0":
        return ((nibbles - 8) * d.float()[..., None]).reshape(n, g * 32)
    return (d.float()[..., None] * nibbles + m.float()[..., None]).reshape(n, g * 32)


def pack(blocks: GGUFBlocks) -> torch.Tensor:
    """The kernels' layout (kernels/csrc/quant_gemm.cpp): [Np / 32, G, B] uint8, Np = N padded to 32 rows.

    Per 32 output rows and block of 32 inputs: the 32 fp16 d, (Q4_x) the 32 fp16 m, then each 16-row tile's
    codes as 64-byte rows in which every output row owns 4 consecutive bytes.
    """
    rows = blocks.data.shape[0]
    d, q, m = block_fields(blocks)
    if blocks.qtype == "Q4_0":
        m = d * -8  # exact in fp16: w = d q - 8 d = d (q - 8)
    pad = -rows % PAIR
    parts = [d] if m is None else [d, m]
    scales = [F.pad(t, (0, 0, 0, pad)).view(-1, PAIR, t.shape[1]).transpose(1, 2) for t in parts]  # [P, G, 32]
    q = F.pad(q, (0, 0, 0, 0, 0, pad))
    pairs, groups, nbytes = q.shape[0] // PAIR, q.shape[1], q.shape[2]
    codes = q.view(pairs, 2, 16, groups, nbytes // 4, 4).permute(0, 3, 1, 4, 2, 5)  # [P, G, tile, row, lane, i]
    codes = codes.reshape(pairs, groups, -1)
    return torch.cat([*(s.contiguous().view(torch.uint8) for s in scales), codes], dim=-1).contiguous()


def huge_pages(storage: torch.Tensor) -> torch.Tensor:
    """A copy of the packed weights in memory Linux may back with 2 MB pages (kernels/csrc/stack.cpp): a decode step
    streams every weight once, and on 4 KB pages the TLB misses cost a third of it (default model, measured)."""
    return cpu_ext.ops().huge_page_copy(storage.contiguous())


class GGUFLinear(nn.Module):
    """y = x W^T + b, W as GGUF blocks; fp32 activations in and out."""

    def __init__(self, qtype: str, out_features: int, in_features: int, storage: torch.Tensor,
                 bias: torch.Tensor | None = None, activations: str = "fp32") -> None:
        """Use `from_blocks`; `storage` is `pack(blocks)` with the kernels, else the dequantized weight."""
        super().__init__()
        self.qtype, self.out_features, self.in_features = qtype, out_features, in_features
        if activations not in ACTIVATION_DIGITS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_DIGITS)}, got {activations!r}")
        self.activations = activations
        self.has_kernel = storage.dtype == torch.uint8
        self.ops = cpu_ext.ops() if self.has_kernel else None
        if self.has_kernel:
            name = ("q8_0_linear" if qtype == "Q8_0" else "q4_1_linear") + ("" if activations == "fp32" else
                                                                            f"_{activations}")
            self._op = getattr(self.ops, name)
        self.register_buffer("blocks" if self.has_kernel else "weight", storage)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_blocks(cls, blocks: GGUFBlocks, bias: torch.Tensor | None = None,
                    activations: str = "fp32") -> "GGUFLinear":
        if blocks.qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {blocks.qtype} has no spind kernel; supported: {', '.join(BLOCK_BYTES)}")
        if activations != "fp32" and not cpu_ext.available():
            raise RuntimeError(f"{activations} activations need spind's CPU kernels: {cpu_ext.unavailable_reason()}")
        storage = huge_pages(pack(blocks)) if cpu_ext.available() else dequantize(blocks)
        return cls(blocks.qtype, *blocks.shape, storage, bias, activations)

    def first_rows(self, num_rows: int) -> "GGUFLinear":
        """A copy keeping output rows [0, num_rows) (packed storage is cut at a multiple of 32 rows)."""
        storage = huge_pages(self.blocks[:-(-num_rows // PAIR)]) if self.has_kernel else self.weight[:num_rows].clone()
        bias = None if self.bias is None else self.bias[:num_rows]
        return GGUFLinear(self.qtype, num_rows, self.in_features, storage, bias, self.activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K] fp32 (the kernels check)
        if not self.has_kernel:
            return F.linear(x2.float(), self.weight, self.bias).view(*shape[:-1], -1)
        y = self._op(x2, self.blocks)
        if y.shape[1] != self.out_features:  # rows padded to a multiple of 32 in the packed storage
            y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], -1)

    def extra_repr(self) -> str:
        kernel = "spind kernel" if self.has_kernel else "dequantized fallback"
        return f"{self.in_features}, {self.out_features}, {self.qtype}, {self.activations} activations, {kernel}"
