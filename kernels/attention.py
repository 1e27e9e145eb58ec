"""Verification attention over the paged KV cache: the registry of backends (the paper's §VI-A modes).

| name                | what it computes per layer                                                   |
|---------------------|------------------------------------------------------------------------------|
| `padded`            | torch: every sequence's KV padded to the longest, one batched SDPA (baseline) |
| `decomposed`        | torch: Spin's request decomposition, rows of one length L + log-sum-exp merge |
| `packed`            | torch: each sequence over exactly its own KV blocks (varlen), no padding      |
| `triton-packed`     | Triton: paged varlen kernel, causal inside each sequence's query block        |
| `triton-decomposed` | Triton: split-KV partials over the decomposition's rows + log-sum-exp merge   |
| `invariant`         | C++ (CPU, fp32): each query row alone over its paged KV, batch-invariant      |

All give the same numbers (tests/test_kernels*.py). A backend implements `AttentionBackend`
(kernels/metadata.py): built once per model runner, `plan`ned once per forward, called once per layer.
Triton backends import Triton only when asked for (and run on CPU only in its interpreter).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spind.kernels.base import Backend

# The one list of attention modes: spind.config's ATTENTION_BACKENDS ([runtime].attention) is its keys, so this
# module imports no torch (the config is read where torch never loads). The default, `packed`, first.
BACKENDS: dict[str, str] = {
    "packed": "spind.kernels.packed:PackedAttention",
    "padded": "spind.kernels.padded:PaddedAttention",
    "decomposed": "spind.kernels.decomposed:DecomposedAttention",
    "triton-packed": "spind.kernels.triton_backends:TritonPackedAttention",
    "triton-decomposed": "spind.kernels.triton_backends:TritonDecomposedAttention",
    # spind's CPU kernel (kernels/csrc/row_attention.cpp): each query row alone, batch-invariant
    "invariant": "spind.kernels.row_attention:RowInvariantAttention",
}
TORCH_BACKENDS = ("padded", "decomposed", "packed")


def get_backend(name: str) -> type[Backend]:
    """The backend class registered as `name`; construct it with (num_heads, num_kv_heads, head_dim, device)."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)
