"""What `spind bench verify` measures on: the target, a paged KV cache holding prefilled Alpaca prompts,
and verify batches over them as `AttentionMetadata`. The bench keeps its own caches and block tables (it lays
out exactly the batches it compares, and swaps attention modes under one KV) and runs the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spind.kernels.metadata import AttentionBackend, AttentionMetadata, build_metadata
from spind.models.llama import LlamaModel


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, KV written at positions 0 .. len - 1
    blocks: tuple[int, ...]  # block table, room for the prompt and up to max_new_tokens more


class PagedKV:
    """Per-layer K and V `[num_blocks * block_size, Hkv, D]`; block 0 stays zero (padding reads slot 0)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        a = model.args
        shape = (num_blocks * block_size, a.num_kv_heads, a.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.block_size, self.num_blocks = block_size, num_blocks


def verify_forward(model: LlamaModel, kv: PagedKV, tokens: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, attend: AttentionBackend) -> torch.Tensor:
    """The model's forward over the bench's cache: fp32 logits [T, vocab], every token. The caller plans
    `attend` for `meta` first."""
    return model(tokens, positions, meta, kv, attend)


def allocate(prompts: list[list[int]], block_size: int, max_new_tokens: int) -> tuple[list[Request], int]:
    """Consecutive block tables from block 1 on (block 0 is padding's); returns the requests and the pool size."""
    requests, next_block = [], 1
    for ids in prompts:
        num = -(-(len(ids) + max_new_tokens) // block_size)
        requests.append(Request(tuple(ids), tuple(range(next_block, next_block + num))))
        next_block += num
    return requests, next_block


def batch_inputs(requests: list[Request], query_len: int, block_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A verify step: each request brings `query_len` new tokens after its prompt (its last prompt token
    repeated: what they are does not change the cost). -> tokens [T], positions [T], metadata."""
    seq_lens = [len(r.prompt) + query_len for r in requests]
    meta = build_metadata([query_len] * len(requests), seq_lens, [r.blocks for r in requests], block_size, device)
    tokens = torch.tensor([r.prompt[-1] for r in requests for _ in range(query_len)], device=device)
    positions = torch.tensor([p for n in seq_lens for p in range(n - query_len, n)], device=device)
    return tokens, positions, meta


def prefill(model: LlamaModel, kv: PagedKV, request: Request, attend: AttentionBackend) -> None:
    """Write the prompt's KV at positions 0 .. len - 1 with one forward."""
    n, device = len(request.prompt), model.device
    meta = build_metadata([n], [n], [request.blocks], kv.block_size, device)
    attend.plan(meta)
    verify_forward(model, kv, torch.tensor(request.prompt, device=device), torch.arange(n, device=device), meta,
                   attend)
