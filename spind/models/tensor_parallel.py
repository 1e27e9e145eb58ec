"""Tensor parallelism: one LLaMA-family model split over the ranks of a process group (Megatron-LM's layout, as
vLLM and SGLang serve it).

- Attention: each rank holds whole KV-head groups (column-parallel q/k/v: its q heads and the KV heads they read)
  and the matching input columns of o_proj (row-parallel); its paged KV cache holds only its KV heads.
- MLP: gate/up column-parallel, down row-parallel, over a slice of the intermediate size.
- One all-reduce after each row-parallel linear (o_proj, down_proj) sums the ranks' partial outputs.
- Embeddings and lm_head split by vocabulary: a rank embeds the tokens in its slice (zeros elsewhere, then an
  all-reduce, exact: every sum has one non-zero term) and computes its slice of the logits, which an all-gather
  joins, so every rank ends a forward with the same hidden states and the same full logits.
- Norms, RoPE tables and everything else are replicated.

Heads split on KV-group boundaries, as evenly as they go: the default model's 3 KV heads over 2 ranks are 2 + 1
(6 + 3 q heads). Fewer KV heads than ranks replicate each KV head over world / num_kv_heads ranks, each taking its
share of the group's q heads (vLLM's rule). The loader reads each rank's slices only (`Shard.slice_of`), from
safetensors and from the GGUF's own blocks alike.

Every op here is row-wise and every collective is elementwise in a fixed rank order, so a row's logits do not depend
on the other rows of the forward: speculative verification stays exact. Against one rank the partial sums of the
row-parallel layers are added in another order: logits agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from spind.models.layers import LlamaArgs

GGUF_BLOCK = 32  # inputs per GGUF block: a row-parallel GGUF weight splits its columns on block boundaries


class TensorParallelError(RuntimeError):
    """A rank of the group is gone or its collective failed: the group as a whole cannot go on (the worker exits to
    be restarted with a fresh group; see spind/worker/device.py's is_fatal_device_error)."""


def split_range(n: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[lo, hi) of rank's share of n items, in whole units of `unit`, as even as they go (the first ranks take one
    more). ValueError when a rank would get nothing."""
    units, rest = divmod(n, unit)
    if rest or units < world:
        raise ValueError(f"{n} cannot be split over {world} ranks in units of {unit}")
    base, extra = divmod(units, world)
    lo = rank * base + min(rank, extra)
    return lo * unit, (lo + base + (rank < extra)) * unit


@dataclass(frozen=True)
class Shard:
    """What one rank of `world` holds of a model: q heads, KV heads, intermediate columns and vocabulary rows, each a
    [lo, hi) range of the full model's."""

    rank: int
    world: int
    head_dim: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def plan(cls, args: LlamaArgs, rank: int, world: int) -> "Shard":
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of a group of {world}")
        h, kv = args.num_heads, args.num_kv_heads
        if h % kv:
            raise ValueError(f"{h} attention heads are not whole groups over {kv} KV heads")
        group = h // kv  # q heads per KV head
        if kv >= world:
            lo, hi = split_range(kv, world, rank)
            kv_heads, heads = (lo, hi), (lo * group, hi * group)
        elif world % kv == 0 and group % (world // kv) == 0:
            share = world // kv  # ranks per KV head, each with group / share of its q heads
            kv_head, part = divmod(rank, share)
            per = group // share
            kv_heads, heads = (kv_head, kv_head + 1), (kv_head * group + part * per, kv_head * group + (part + 1) * per)
        else:
            raise ValueError(f"{h} attention heads over {kv} KV heads cannot be split over {world} ranks (needs "
                             f"num_key_value_heads >= ranks, or ranks a multiple of it that divides each KV group)")
        unit = GGUF_BLOCK if args.intermediate_size % GGUF_BLOCK == 0 else 1
        try:
            inter = split_range(args.intermediate_size, world, rank, unit)
        except ValueError:
            inter = split_range(args.intermediate_size, world, rank)
        return cls(rank, world, args.head_dim, heads, kv_heads, inter, split_range(args.vocab_size, world, rank))

    def local_args(self, args: LlamaArgs) -> LlamaArgs:
        """The shapes of this rank's modules: its heads, KV heads, intermediate size and vocabulary slice."""
        return dataclasses.replace(args, num_heads=self.heads[1] - self.heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.inter[1] - self.inter[0],
                                   vocab_size=self.vocab[1] - self.vocab[0])

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` (HF naming) that this rank holds; None: all of it."""
        d = self.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return 0, self.heads[0] * d, self.heads[1] * d
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                          "self_attn.v_proj.bias")):
            return 0, self.kv_heads[0] * d, self.kv_heads[1] * d
        if name.endswith("self_attn.o_proj.weight"):
            return 1, self.heads[0] * d, self.heads[1] * d
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return 0, *self.inter
        if name.endswith("mlp.down_proj.weight"):
            return 1, *self.inter
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, *self.vocab
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            raise ValueError(f"{name}: a row-parallel layer with a bias is not served split (each rank would add it)")
        return None

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world}: q heads {self.heads[0]}-{self.heads[1] - 1}, KV heads "
                f"{self.kv_heads[0]}-{self.kv_heads[1] - 1}, intermediate {self.inter[0]}-{self.inter[1] - 1}, "
                f"vocab {self.vocab[0]}-{self.vocab[1] - 1}")


class Collectives:
    """The collectives of one group (a torch.distributed ProcessGroup made for it, never the global default one: a
    process may hold several groups over its life, e.g. tests, or a target restarted in-process)."""

    def __init__(self, pg, rank: int, world: int, vocab_sizes: list[int]) -> None:
        self.pg, self.rank, self.world = pg, rank, world
        self.vocab_sizes = vocab_sizes  # each rank's vocabulary slice, in rank order

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo: a peer closed its connection; NCCL: a failed communicator
            raise TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank} of {self.world}: "
                                      f"{e}") from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._wait(self.pg.allreduce([t]), "all-reduce")
        return t

    def _padded(self, local: torch.Tensor) -> torch.Tensor:
        width = max(self.vocab_sizes)
        if local.shape[1] < width:
            local = torch.cat([local, local.new_zeros(local.shape[0], width - local.shape[1])], 1)
        return local.contiguous()

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, local vocab] on every rank -> [rows, full vocab] on every rank (slices padded to one width)."""
        local = self._padded(local)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self._wait(self.pg.allgather([parts], [local]), "all-gather")
        return torch.cat([p[:, :n] for p, n in zip(parts, self.vocab_sizes)], 1)


class ShmArea:
    """A file in /dev/shm that every CPU rank of a group maps: a sequence number per rank, then two buffers of one
    slot per rank (see ShmCollectives). Rank 0 creates it and unlinks it once the group has joined (every rank maps
    it before joining), so nothing is left behind whatever ends the group."""

    HEADER = 4096

    def __init__(self, path: str, world: int, slot_bytes: int, create: bool) -> None:
        self.path, self.world, self.slot_bytes = path, world, slot_bytes
        size = self.HEADER + 2 * world * slot_bytes
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        self.bytes = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.seqs = self.bytes[:8 * world].view(torch.int64).numpy()  # rank r's last posted collective

    def slot(self, buffer: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = self.HEADER + (buffer * self.world + rank) * self.slot_bytes
        return self.bytes[start:start + numel * dtype.itemsize].view(dtype)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmCollectives(Collectives):
    """CPU ranks' collectives through shared memory: ~10 us each where gloo's loopback TCP takes ~0.9 ms (2-vCPU VM,
    a [5, 576] fp32 all-reduce); a decode step of the default model has 62 of them (the embedding, 2 a layer, the
    logits). vLLM's CPU backend does the same (its shm all-reduce).

    Each collective n: a rank copies its part into its slot of buffer n % 2, posts n as its sequence number, waits
    until every rank has posted n, then reads every slot. Every rank sums the parts itself in rank order, so all of
    them hold the same bits, whatever the timing. Two buffers suffice: a rank writes buffer n % 2 again at n + 2
    only after every rank posted n + 1, which each did after reading its slots of n. Tensors larger than a slot go
    in pieces. `alive()` raises TensorParallelError where a rank is gone (rank 0: a rank's process exited; the
    others: rank 0 exited); waiting past `timeout_s` raises it too (a stopped rank)."""

    SPIN = 2000  # polls before a waiting rank starts to yield its core

    def __init__(self, pg, rank: int, world: int, vocab_sizes: list[int], area: ShmArea,
                 alive: Callable[[], None], timeout_s: float) -> None:
        super().__init__(pg, rank, world, vocab_sizes)
        self.area, self.alive, self.timeout_s = area, alive, timeout_s
        self.seq = 0

    def _exchange(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Post `flat` (fits a slot) and return every rank's part of this collective, rank 0's first."""
        a = self.area
        self.seq += 1
        buffer = self.seq % 2
        a.slot(buffer, self.rank, flat.dtype, flat.numel()).copy_(flat)
        a.seqs[self.rank] = self.seq
        self._wait_all()
        return [a.slot(buffer, r, flat.dtype, flat.numel()) for r in range(self.world)]

    def _wait_all(self) -> None:
        seqs, seq = self.area.seqs, self.seq
        polls, deadline, next_check = 0, None, 0.0
        while (seqs[:self.world] < seq).any():
            polls += 1
            if polls < self.SPIN:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            if now >= next_check:
                self.alive()
                if now > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {self.rank}: no peer reached collective "
                                              f"{seq} within {self.timeout_s:.0f} s")
                next_check = now + 0.05
            time.sleep(0 if polls < 4 * self.SPIN else 5e-5)

    def _slot_items(self, itemsize: int) -> int:
        """Elements of `itemsize` bytes one slot holds: a collective's piece."""
        return max(1, self.area.slot_bytes // itemsize)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return super().all_reduce(t)
        t = t.contiguous()
        flat = t.view(-1)
        step = self._slot_items(t.element_size())
        for lo in range(0, flat.numel(), step):
            piece = flat[lo:lo + step]
            parts = self._exchange(piece)
            piece.copy_(parts[0])
            for p in parts[1:]:
                piece.add_(p)
        return t

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        if local.device.type != "cpu":
            return super().gather_vocab(local)
        local = self._padded(local)
        rows, width = local.shape
        step = max(1, self._slot_items(local.element_size()) // width)
        out = []
        for lo in range(0, rows, step):
            piece = local[lo:lo + step]
            parts = self._exchange(piece.reshape(-1))
            out.append(torch.cat([p.view(piece.shape)[:, :n] for p, n in zip(parts, self.vocab_sizes)], 1))
        return out[0] if len(out) == 1 else torch.cat(out)


class RowParallel(nn.Module):
    """A linear layer over this rank's slice of the input features; the ranks' partial outputs are summed."""

    def __init__(self, inner: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding: tokens outside embed to zeros, then the ranks' rows are summed (exact)."""

    def __init__(self, inner: nn.Embedding, lo: int, hi: int, comm: Collectives) -> None:
        super().__init__()
        self.inner, self.lo, self.hi, self.comm = inner, lo, hi, comm

    @property
    def weight(self) -> torch.Tensor:  # the model's dtype and device are read off it
        return self.inner.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.lo) & (tokens < self.hi)
        h = self.inner((tokens - self.lo).clamp(0, self.hi - self.lo - 1))
        return self.comm.all_reduce(h * mine.unsqueeze(-1).to(h.dtype))


class VocabParallelHead(nn.Module):
    """lm_head over this rank's vocabulary rows; the ranks' logits are gathered into the full vocabulary."""

    def __init__(self, inner: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_vocab(self.inner(x))


def parallelize(model: nn.Module, shard: Shard, comm: Collectives, vocab_size: int) -> nn.Module:
    """Wrap a model loaded with `shard`'s slices (load_llama(shard=...)) for its group, in place: all-reduces after
    o_proj and down_proj, the vocabulary-parallel embedding and head. The fused all-layer kernel cannot all-reduce
    mid-layer, so the layers run as modules (the same fused kernels per module, see spind/models/fused.py)."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, *shard.vocab, comm)
    model.lm_head = VocabParallelHead(model.lm_head, comm)
    model.fused_stack = None
    model.args = dataclasses.replace(model.args, vocab_size=vocab_size)  # what callers see: the whole vocabulary
    model.shard = shard
    return model
