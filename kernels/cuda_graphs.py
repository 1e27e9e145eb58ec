"""CUDA-graph capture and replay of the verify forward, for bucketed (batch, tokens per sequence) shapes.

A verify forward launches hundreds of small kernels; replaying a captured graph removes their launch cost.
A graph replays fixed addresses and fixed grid sizes, so:
- inputs live in static buffers sized for the largest bucket; each forward is copied into the front of
  them and padded up to its bucket: pad sequences bring no tokens and have no keys, pad tokens belong to
  no sequence, sit at position 0 and write their K/V to `pad_block`, a KV block no request owns (the
  runner reserves it). Outputs of pad tokens are undefined and dropped.
- the attention backend must support it (`supports_cuda_graphs`: the triton-* modes): its `plan` runs
  eagerly before each replay and only fills buffers that never move; its kernels' grids depend on the
  bucket alone (the capture plans a worst case: every sequence with `query_len` tokens).
- capture follows torch.cuda.CUDAGraph's rules: warm-up runs on a side stream first (Triton compiles,
  allocators settle), one memory pool is shared by every bucket's graph, largest bucket captured first
  so the smaller ones reuse its memory, and the graph's output tensor is read after replay.
Shapes outside every bucket (prefill, oversized batches) and any non-CUDA device run eagerly.

The forward to capture: `forward(tokens [T] int64, positions [T] int64, meta) -> [T, ...]` — embedding,
layers (KV written at meta.slot_mapping, `backend(q, k_cache, v_cache, scale)` per layer), norm and lm_head
over every token. It must not call `backend.plan` (this module does) and must not sync with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from spind.kernels.metadata import AttentionBackend, AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
NUM_WARMUP = 2


@dataclass(frozen=True, order=True)
class Bucket:
    num_seqs: int
    query_len: int  # new tokens per sequence, at most

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len


def make_buckets(max_num_seqs: int, query_lens: Sequence[int]) -> tuple[Bucket, ...]:
    """Batch sizes 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs, for each query length
    (a verify of k drafts has k + 1; a plain decode step 1)."""
    sizes = sorted({n for n in (1, 2, 4) if n < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs})
    return tuple(Bucket(b, q) for b in sizes for q in sorted(set(query_lens)))


def choose_bucket(buckets: Sequence[Bucket], num_seqs: int, max_query_len: int) -> Bucket | None:
    """The smallest bucket (fewest padded tokens, then sequences) that holds the batch; None if none does."""
    fits = [b for b in buckets if b.num_seqs >= num_seqs and b.query_len >= max_query_len]
    return min(fits, key=lambda b: (b.num_tokens, b.num_seqs), default=None)


def padded_lengths(query_lens: Sequence[int], seq_lens: Sequence[int],
                   bucket: Bucket) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-sequence (query lengths, KV lengths) of a batch padded to `bucket` with empty sequences."""
    pad = bucket.num_seqs - len(query_lens)
    if pad < 0 or max(query_lens, default=0) > bucket.query_len:
        raise ValueError(f"a batch of {len(query_lens)} sequences, up to {max(query_lens, default=0)} tokens "
                         f"each, does not fit {bucket}")
    return tuple(query_lens) + (0,) * pad, tuple(seq_lens) + (0,) * pad


class StaticBatch:
    """Input buffers of the largest bucket; a bucket's inputs are views of their fronts (fixed addresses)."""

    def __init__(self, largest: Bucket, max_blocks_per_seq: int, block_size: int, pad_block: int,
                 device: torch.device) -> None:
        t, b, i32, i64 = largest.num_tokens, largest.num_seqs, torch.int32, torch.int64
        self.block_size, self.pad_slot, self.largest = block_size, pad_block * block_size, largest
        self.tokens = torch.zeros(t, dtype=i64, device=device)
        self.positions = torch.zeros(t, dtype=i64, device=device)
        self.slot_mapping = torch.full((t,), self.pad_slot, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(b + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(b, dtype=i32, device=device)
        self.block_tables = torch.full((b, max_blocks_per_seq), pad_block, dtype=i32, device=device)

    def load(self, bucket: Bucket, tokens: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy a forward's inputs into the buffers, padded to `bucket`; returns the bucket's views."""
        q_lens, seq_lens = padded_lengths(meta.query_lens_cpu, meta.seq_lens_cpu, bucket)
        t, b = meta.num_tokens, meta.num_seqs
        for buf, src, fill in ((self.tokens, tokens, 0), (self.positions, positions, 0),
                               (self.slot_mapping, meta.slot_mapping, self.pad_slot)):
            buf[:t].copy_(src, non_blocking=True)
            buf[t:bucket.num_tokens].fill_(fill)
        self.query_start_loc[:b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[b + 1:bucket.num_seqs + 1].fill_(t)  # pad sequences: empty, after the real ones
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:bucket.num_seqs].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        return self._views(bucket, q_lens, seq_lens)

    def load_worst_case(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """What a capture plans for: every sequence with bucket.query_len tokens, its keys in the pad block."""
        q = bucket.query_len
        self.tokens.zero_()
        self.positions[:bucket.num_tokens].copy_(torch.arange(q).repeat(bucket.num_seqs))
        self.slot_mapping[:bucket.num_tokens].copy_(self.pad_slot + torch.arange(q).repeat(bucket.num_seqs)
                                                    % self.block_size)
        self.query_start_loc[:bucket.num_seqs + 1].copy_(torch.arange(bucket.num_seqs + 1) * q)
        self.seq_lens[:bucket.num_seqs].fill_(q)
        self.block_tables.fill_(self.pad_slot // self.block_size)
        return self._views(bucket, (q,) * bucket.num_seqs, (q,) * bucket.num_seqs)

    def _views(self, bucket: Bucket, q_lens: tuple[int, ...],
               seq_lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        t, b = bucket.num_tokens, bucket.num_seqs
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=t, query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:t], block_size=self.block_size,
            query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
        return self.tokens[:t], self.positions[:t], meta


class CudaGraphForward:
    """`forward` replayed from per-bucket CUDA graphs when enabled and the batch fits a bucket, else eager.

    Call it like the forward; the returned tensor is a view of the graph's output buffer, valid until the
    next call (read or copy it first)."""

    def __init__(self, forward: Forward, backend: AttentionBackend, buckets: Sequence[Bucket], *,
                 max_blocks_per_seq: int, block_size: int, pad_block: int, device: torch.device | str,
                 enabled: bool = True) -> None:
        self.forward, self.backend, self.device = forward, backend, torch.device(device)
        self.buckets = tuple(sorted(buckets, key=lambda b: (b.num_tokens, b.num_seqs)))
        self.enabled = (enabled and bool(self.buckets) and self.device.type == "cuda"
                        and getattr(backend, "supports_cuda_graphs", False))
        if self.enabled and self.buckets[-1].num_seqs > getattr(backend, "max_num_seqs", self.buckets[-1].num_seqs):
            raise ValueError(f"bucket {self.buckets[-1]} exceeds the backend's preallocated batch size")
        largest = Bucket(max(b.num_seqs for b in self.buckets), max(b.query_len for b in self.buckets)) \
            if self.buckets else Bucket(1, 1)
        self.static = StaticBatch(largest, max_blocks_per_seq, block_size, pad_block, self.device)
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        bucket = choose_bucket(self.buckets, meta.num_seqs, meta.max_query_len) if self.enabled else None
        if bucket is None:
            self.backend.plan(meta)
            return self.forward(tokens, positions, meta)
        if bucket not in self._graphs:
            self.capture([bucket])
        _, _, static_meta = self.static.load(bucket, tokens, positions, meta)
        self.backend.plan(static_meta)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:meta.num_tokens]

    def capture(self, buckets: Sequence[Bucket] | None = None) -> None:
        """Capture the given buckets (default: all), largest first, sharing one memory pool."""
        if not self.enabled:
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(buckets or self.buckets, key=lambda b: (b.num_tokens, b.num_seqs), reverse=True):
            tokens, positions, meta = self.static.load_worst_case(bucket)
            self.backend.plan(meta)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(NUM_WARMUP):
                    self.forward(tokens, positions, meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.forward(tokens, positions, meta)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.device)
