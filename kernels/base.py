"""What every attention backend shares: the model's shapes, fixed at construction (once per runner)."""

from __future__ import annotations

import torch

from spind.kernels.ops import Workspace


class Backend:
    """Base of the `AttentionBackend` implementations: `cls(num_heads, num_kv_heads, head_dim, device)`."""

    name: str = ""
    # plan() only fills buffers that keep their storage and __call__ launches work whose shapes depend on
    # (num_seqs, num_tokens, max_query_len) alone: safe to capture __call__ in a CUDA graph (kernels/cuda_graphs.py)
    supports_cuda_graphs: bool = False
    num_kv_slots: int = 0  # keys each query block is scored against in this forward, padding included (per KV head)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.device = torch.device(device)
        self.workspace = Workspace()

    def plan_masks(self, masks: list[torch.Tensor | None]) -> None:
        """Keep this forward's additive masks (planned in fp32) for masks_for()."""
        self._masks = {torch.float32: masks}

    def masks_for(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """The planned masks in the query's dtype (the fused CPU kernel wants them alike), cast once per forward."""
        if dtype not in self._masks:
            self._masks[dtype] = [None if m is None else m.to(dtype) for m in self._masks[torch.float32]]
        return self._masks[dtype]
