"""ModelRunner: one model + its paged KV cache. Sequences of token ids in, logits out.

The only object that turns per-request token lists into the packed tensors of a forward.
Targets and model drafters both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionBatch
from spind.models.kv_cache import KVCache
from spind.models.llama import LlamaModel


@dataclass
class ForwardItem:
    req_id: str
    tokens: list[int]  # appended at positions length(req_id) ...
    num_logits: int = 1  # logits of the last `num_logits` new tokens are returned


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, attention: str = "packed",
                 max_model_len: int | None = None) -> None:
        self.model = model
        self.kv: KVCache = model.new_kv_cache(num_blocks, block_size)
        self.attention = attention
        self.max_model_len = min(max_model_len or model.args.max_position, model.args.max_position)

    # ---- request lifecycle (paired verbs) ------------------------------------------------------
    def add_request(self, req_id: str) -> None:
        self.kv.allocate(req_id)

    def free_request(self, req_id: str) -> None:
        self.kv.free(req_id)

    def has_request(self, req_id: str) -> bool:
        return self.kv.has(req_id)

    def truncate(self, req_id: str, length: int) -> None:
        self.kv.truncate(req_id, length)

    def length(self, req_id: str) -> int:
        return self.kv.length(req_id)

    def can_append(self, num_tokens: int) -> bool:
        return self.kv.can_allocate(num_tokens)

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """One batched forward; returns per item fp32 logits [num_logits, vocab]."""
        if not items:
            return []
        kv, device = self.kv, self.model.device
        tokens, positions, write, read, q_lens, ctx_lens, rows = [], [], [], [], [], [], []
        offset = 0
        for it in items:
            n = len(it.tokens)
            if n == 0:
                raise ValueError(f"{it.req_id}: forward with no tokens")
            start = kv.length(it.req_id)
            end = start + n
            if end > self.max_model_len:
                raise ValueError(f"{it.req_id}: {end} tokens exceed the context limit {self.max_model_len}")
            kv.reserve(it.req_id, end)
            slots = kv.slots(it.req_id, 0, end)
            tokens.extend(it.tokens)
            positions.append(torch.arange(start, end))
            write.append(slots[start:])
            read.append(slots.to(device))
            q_lens.append(n)
            ctx_lens.append(end)
            rows.extend(range(offset + n - it.num_logits, offset + n))
            offset += n
        batch = AttentionBatch(q_lens=q_lens, ctx_lens=ctx_lens, write_slots=torch.cat(write).to(device),
                               read_slots=read)
        logits = self.model(torch.tensor(tokens, device=device), torch.cat(positions).to(device), batch, kv,
                            logits_rows=torch.tensor(rows, device=device), attention=self.attention)
        for it in items:
            kv.seqs[it.req_id].length += len(it.tokens)
        return list(logits.split([it.num_logits for it in items]))
