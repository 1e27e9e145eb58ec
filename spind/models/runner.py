"""ModelRunner: one model, its paged KV cache and its attention backend. Token lists in, logits out.

The only object that turns per-request token lists into the tensors of a forward. Targets and model
drafters both use it. Per forward it allocates blocks (per request: only the new ones), then builds the
`AttentionMetadata` with a handful of tensor ops over the whole batch (no per-request tensors or copies)
and stages every index tensor into buffers preallocated on the model's device: their storage never moves,
which is what CUDA-graph replay needs, and a forward's metadata costs O(batch) host work.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from spind.kernels import cpu_ext
from spind.kernels.attention import get_backend
from spind.kernels.metadata import AttentionMetadata
from spind.models.kv_cache import KVCache
from spind.models.llama import LlamaModel


PAD_SEQ = "\x00pad"  # the KV cache entry holding the CUDA graphs' padding block


@dataclass
class ForwardItem:
    req_id: str
    tokens: list[int]  # appended at positions length(req_id) ...
    num_logits: int = 1  # logits of the last `num_logits` new tokens are returned (0: none, e.g. prefill)


class StagingBuffers:
    """Fixed-capacity device buffers the forward's index tensors are copied into (grown on demand)."""

    def __init__(self, device: torch.device, max_seqs: int, max_tokens: int, max_blocks: int) -> None:
        self.device = device
        self.max_blocks = max_blocks
        self._alloc(max_seqs, max_tokens)

    def _alloc(self, max_seqs: int, max_tokens: int) -> None:
        d, i32, i64 = self.device, torch.int32, torch.int64
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.tokens = torch.zeros(max_tokens, dtype=i64, device=d)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=d)
        self.slot_mapping = torch.zeros(max_tokens, dtype=i64, device=d)
        self.logits_rows = torch.zeros(max_tokens, dtype=i64, device=d)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=i32, device=d)
        self.seq_lens = torch.zeros(max_seqs, dtype=i32, device=d)
        self.block_tables = torch.zeros(max_seqs, self.max_blocks, dtype=i32, device=d)

    def fit(self, num_seqs: int, num_tokens: int) -> None:
        if num_seqs > self.max_seqs or num_tokens > self.max_tokens:
            self._alloc(max(num_seqs, self.max_seqs), max(num_tokens, self.max_tokens))

    @staticmethod
    def stage(buf: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy src into the front of buf; returns the view (non_blocking from pinned/CPU memory)."""
        view = buf[: src.shape[0]] if src.dim() == 1 else buf[: src.shape[0], : src.shape[1]]
        view.copy_(src, non_blocking=True)
        return view


def resolve_kv_dtype(setting: str, model: LlamaModel, attention: str) -> torch.dtype:
    """The KV cache's dtype for [runtime].kv_cache_dtype. `auto`: fp16 for a quantized target (`gguf*`, int4, int8:
    fp32 activations over quantized weights) where spind's CPU row-attention kernel reads the cache (`invariant`
    attention), else the model's dtype: a float32 model keeps the reference numerics. fp16 halves the bytes a decode
    step's attention streams (at 16 requests of ~350 tokens, as many as the 4-bit weights) and the cache's memory;
    each K/V value is rounded once, when written (11 significant bits), and read back exactly, so every output stays
    batch-invariant. float16 where the model is not fp32 on CPU is refused rather than served through conversions."""
    cpu_fp32 = model.device.type == "cpu" and model.dtype == torch.float32
    if setting == "auto":
        kernel = (attention == "invariant" and cpu_fp32 and model.quantized is not None and cpu_ext.available()
                  and cpu_ext.row_attention_supports(model.args.head_dim))
        return torch.float16 if kernel else model.dtype
    if setting == "float32":
        if model.dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype float32 needs a float32 model, this one computes in {model.dtype}")
        return torch.float32
    if setting == "float16":
        if not cpu_fp32:
            raise ValueError(f"kv_cache_dtype float16 is for float32 models on CPU (this one: {model.dtype} on "
                             f"{model.device.type}); use auto")
        return torch.float16
    raise ValueError(f"unknown kv_cache_dtype {setting!r}")


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, attention: str = "packed",
                 max_model_len: int | None = None, max_batch: int = 16, max_tokens: int = 512,
                 cuda_graphs: bool = False, graph_query_lens: tuple[int, ...] = (1, 3, 5, 9),
                 kv_cache_dtype: str = "auto", prefix_caching: bool = False) -> None:
        self.model = model
        self.max_model_len = min(max_model_len or model.args.max_position, model.args.max_position)
        self.kv: KVCache = model.new_kv_cache(num_blocks, block_size, self.max_model_len,
                                              resolve_kv_dtype(kv_cache_dtype, model, attention))
        self.kv.prefix_caching = prefix_caching
        a = model.args
        self.attention = attention
        self.attn = get_backend(attention)(a.num_heads, a.num_kv_heads, a.head_dim, model.device)
        self.buffers = StagingBuffers(model.device, max_batch, max_tokens, self.kv.max_blocks_per_seq)
        self.graph = self._graphed_forward(max_batch, graph_query_lens) if cuda_graphs else None

    def _graphed_forward(self, max_batch: int, query_lens: tuple[int, ...]):
        """Verify forwards replayed from CUDA graphs per (batch, tokens) bucket (kernels/cuda_graphs.py); None
        where graphs cannot apply (not CUDA, or an attention mode that cannot be captured): eager."""
        from spind.kernels.cuda_graphs import CudaGraphForward, make_buckets

        if self.model.device.type != "cuda" or not getattr(self.attn, "supports_cuda_graphs", False):
            return None
        self.kv.allocate(PAD_SEQ)  # a block no request owns: where padded tokens write their K/V
        self.kv.reserve(PAD_SEQ, 1)

        def forward(tokens, positions, meta):
            return self.model(tokens, positions, meta, self.kv, self.attn)

        graphs = CudaGraphForward(forward, self.attn, make_buckets(max_batch, query_lens),
                                  max_blocks_per_seq=self.kv.max_blocks_per_seq, block_size=self.kv.block_size,
                                  pad_block=self.kv.seqs[PAD_SEQ].block_table[0], device=self.model.device)
        # every bucket now, at start-up: a capture inside serving would stall the first requests of each shape
        start = time.perf_counter()
        graphs.capture()
        print(f"spind: captured {len(graphs.buckets)} CUDA graphs of {self.model.args.num_layers}-layer forwards "
              f"(batch x tokens: {', '.join(f'{b.num_seqs}x{b.query_len}' for b in graphs.buckets)}) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return graphs

    # ---- request lifecycle (paired verbs) ------------------------------------------------------
    def add_request(self, req_id: str) -> None:
        self.kv.allocate(req_id)

    def free_request(self, req_id: str) -> None:
        self.kv.free(req_id)

    def fork(self, src: str, dst: str) -> None:
        """A new request holding `src`'s KV, its blocks shared (copied on write)."""
        self.kv.fork(src, dst)

    def reuse_prefix(self, req_id: str, tokens: list[int]) -> int:
        """A new request takes the cached KV of the longest published prefix of `tokens`: tokens now in its KV."""
        return self.kv.reuse_prefix(req_id, tokens)

    def publish(self, req_id: str, tokens: list[int]) -> None:
        """`tokens` begin the request's committed sequence, their KV final: cache its full blocks for others."""
        self.kv.publish(req_id, tokens)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

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
        return self._forward(items, ())[0]

    def forward_features(self, items: list[ForwardItem], layers: tuple[int, ...]
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`forward`, also returning per item the features of every token it fed ([len(tokens), width], see
        LlamaModel.forward's `feature_layers`): what a feature-level draft head reads. Runs eagerly (a captured
        CUDA graph returns logits only)."""
        return self._forward(items, layers)

    def _forward(self, items: list[ForwardItem], layers: tuple[int, ...]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not items:
            return [], []
        starts = []
        for it in items:
            if not it.tokens:
                raise ValueError(f"{it.req_id}: forward with no tokens")
            start = self.kv.length(it.req_id)
            end = start + len(it.tokens)
            if end > self.max_model_len:
                raise ValueError(f"{it.req_id}: {end} tokens exceed the context limit {self.max_model_len}")
            if not 0 <= it.num_logits <= len(it.tokens):
                raise ValueError(f"{it.req_id}: num_logits {it.num_logits} out of range")
            starts.append(start)
        for it, start in zip(items, starts):  # only after every check: a refused batch allocates nothing
            self.kv.reserve(it.req_id, start + len(it.tokens))
            self.kv.make_writable(it.req_id, start, start + len(it.tokens))  # a block it shares: copied first
        meta, tokens, positions, rows = self._prepare(items, starts)
        features = None
        if self.graph is not None and not layers and all(it.num_logits == len(it.tokens) for it in items):
            logits = self.graph(tokens, positions, meta).index_select(0, rows)  # verify: every row is needed
        else:
            self.attn.plan(meta)
            out = self.model(tokens, positions, meta, self.kv, self.attn, logits_rows=rows, feature_layers=layers)
            logits, features = out if layers else (out, None)
        for it in items:
            self.kv.commit(it.req_id, len(it.tokens))
        split = list(logits.split([it.num_logits for it in items]))
        return split, [] if features is None else list(features.split([len(it.tokens) for it in items]))

    def _prepare(self, items: list[ForwardItem], starts: list[int]):
        # The index arithmetic runs on host lists (a batch has at most a few hundred new tokens), each result
        # becoming one tensor: as ~20 small torch ops it cost ~0.35 ms of a ~6 ms CPU decode step, on one core.
        b = len(items)
        q_lens = [len(it.tokens) for it in items]
        bs = self.kv.block_size
        cu = [0]
        flat: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        for it, start, q in zip(items, starts, q_lens):
            flat.extend(it.tokens)
            table = self.kv.seqs[it.req_id].block_table
            span = range(start, start + q)
            positions.extend(span)
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in span)
            logits_rows.extend(range(cu[-1] + q - it.num_logits, cu[-1] + q))  # its last num_logits rows
            cu.append(cu[-1] + q)
        t = len(flat)
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        rows_t = torch.tensor([self.kv.row(it.req_id) for it in items], dtype=torch.int64)
        tables = self.kv.tables.index_select(0, rows_t)  # [B, max_blocks_per_seq]

        buf = self.buffers
        buf.fit(b, t)
        stage = buf.stage
        i32, i64 = torch.int32, torch.int64
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=t, query_start_loc=stage(buf.query_start_loc, torch.tensor(cu, dtype=i32)),
            seq_lens=stage(buf.seq_lens, torch.tensor(seq_lens, dtype=i32)),
            block_tables=stage(buf.block_tables, tables),
            slot_mapping=stage(buf.slot_mapping, torch.tensor(slot_mapping, dtype=i64)), block_size=bs,
            query_lens_cpu=tuple(q_lens), seq_lens_cpu=tuple(seq_lens))
        tokens = stage(buf.tokens, torch.tensor(flat, dtype=i64))
        return (meta, tokens, stage(buf.positions, torch.tensor(positions, dtype=i64)),
                stage(buf.logits_rows, torch.tensor(logits_rows, dtype=i64)))
