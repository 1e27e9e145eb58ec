"""Paged KV cache: fixed-size blocks in one preallocated pool per model, and a block table per sequence.

Layout: `k[layer]`, `v[layer]` are `[num_blocks * block_size, num_kv_heads, head_dim]` (flat slots), so a
token's KV lives at slot `block_table[pos // block_size] * block_size + pos % block_size`. Blocks make the
memory budget exact (admission asks `can_allocate`), rollback cheap (truncate frees whole trailing blocks),
and give the verification modes their unit (a decomposed plan splits a long sequence at block boundaries).

Blocks are reference-counted so that sequences can share them: `fork` gives a new sequence another's blocks (the
n completions of one prompt share its prefilled KV), and `make_writable` copies a shared block before a sequence
writes into it (copy on write), so no sequence ever sees another's tokens. A block returns to the free list when
its last sequence lets it go.

Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache, at block granularity): a full block of
committed tokens can be published under its content, the exact chain of tokens from position 0 to its end
(`publish`), and a new sequence whose tokens begin the same way takes those blocks instead of computing their KV
again (`reuse_prefix`). A key is (the previous block's serial, this block's tokens): exact, never a hash that could
collide, and a serial is never reused, so a block evicted from a chain leaves nothing that could match wrongly
below it. Published blocks that no sequence holds stay cached, least recently released first out, and count as
free: `_take` evicts one only when no block is free, so the cache never costs a request its KV. A KV row depends
only on the tokens up to it (the CPU kernels are batch-invariant: the same bits in any batch or chunk), so a
reused prefix gives the same output as computing it.

Block tables live in one host tensor `tables: [rows, max_blocks_per_seq]` int32, a row per sequence,
updated incrementally as blocks are reserved and freed, so a forward gathers its batch's tables with one
`index_select` instead of rebuilding them from lists. Entries past a sequence's blocks are 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

INITIAL_ROWS = 64


class KVCacheFullError(RuntimeError):
    """Not enough free blocks; the scheduler should have asked `can_allocate` first."""


@dataclass
class SeqKV:
    row: int  # this sequence's row of `tables`
    block_table: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written
    num_published: int = 0  # leading blocks published or reused (the prefix cache knows their content)
    last_serial: int = 0  # the prefix cache's serial of the content of block num_published - 1 (0: none)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 max_model_len: int = 2048, prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages are only committed as blocks get used. Block 0 is what padded attention
        # reads for padding (masked out), so it must at least hold finite numbers.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k + self.v:
            t[:block_size].zero_()
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks  # sequences holding each block
        self.tables = torch.zeros(INITIAL_ROWS, self.max_blocks_per_seq, dtype=torch.int32)
        self._free_rows = list(range(INITIAL_ROWS - 1, -1, -1))
        self.seqs: dict[str, SeqKV] = {}
        # the prefix cache: (previous block's serial, block tokens) -> block, and block -> (its key, its serial)
        self.prefix_caching = prefix_caching
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self._entry: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}
        self._next_serial = 1
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by no sequence; oldest first

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: the free ones and the cached ones no sequence holds (evicted on demand)."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache knows the content of (held by sequences or not)."""
        return len(self._entry)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence holds: counted free, evicted when no other block is."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def length(self, req_id: str) -> int:
        seq = self.seqs.get(req_id)
        return seq.length if seq else 0

    def has(self, req_id: str) -> bool:
        return req_id in self.seqs

    def row(self, req_id: str) -> int:
        return self.seqs[req_id].row

    # ---- lifecycle --------------------------------------------------------------------------
    def allocate(self, req_id: str) -> None:
        if req_id in self.seqs:
            raise KeyError(f"request {req_id!r} already has KV")
        if not self._free_rows:
            self._grow_rows()
        self.seqs[req_id] = SeqKV(self._free_rows.pop())

    def reserve(self, req_id: str, new_length: int) -> None:
        """Grow the block table so that positions < new_length have slots."""
        seq = self.seqs[req_id]
        need = self.blocks_for(new_length) - len(seq.block_table)
        if need <= 0:
            return
        if len(seq.block_table) + need > self.max_blocks_per_seq:
            raise KVCacheFullError(f"{req_id}: {new_length} tokens exceed the context limit of the cache")
        if need > self.num_free_blocks:
            raise KVCacheFullError(f"KV cache full: need {need} blocks, {self.num_free_blocks} free")
        new = [self._take() for _ in range(need)]
        self.tables[seq.row, len(seq.block_table):len(seq.block_table) + need] = torch.tensor(new, dtype=torch.int32)
        seq.block_table.extend(new)

    def fork(self, src: str, dst: str) -> None:
        """A new sequence `dst` holding `src`'s KV: the same blocks, shared until one of them writes (make_writable)."""
        s = self.seqs[src]
        self.allocate(dst)
        d = self.seqs[dst]
        d.block_table, d.length = list(s.block_table), s.length
        for b in s.block_table:
            self._refs[b] += 1
        n = len(s.block_table)
        self.tables[d.row, :n] = self.tables[s.row, :n]

    def reuse_prefix(self, req_id: str, tokens: list[int]) -> int:
        """Give a sequence that has no KV yet the cached blocks that begin `tokens` (its whole sequence): returns
        how many tokens' KV it now has (whole blocks, and never the last token: a forward must compute the logits
        that follow it). 0 without prefix caching."""
        seq = self.seqs[req_id]
        if seq.length or seq.block_table:
            raise ValueError(f"{req_id}: reuse_prefix on a sequence that already has KV")
        if not self.prefix_caching:
            return 0
        bs, parent, found = self.block_size, 0, []
        for i in range((len(tokens) - 1) // bs):
            b = self._cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            found.append(b)
            parent = self._entry[b][1]
        for b in found:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        if found:
            self.tables[seq.row, :len(found)] = torch.tensor(found, dtype=torch.int32)
        seq.block_table = found
        seq.length = len(found) * bs
        seq.num_published, seq.last_serial = len(found), parent
        return seq.length

    def publish(self, req_id: str, tokens: list[int]) -> None:
        """The sequence's first len(tokens) tokens are `tokens`, their KV written and final (committed, never
        rolled back): publish its full blocks among them, so later sequences beginning the same way reuse them. A
        block whose content is cached already (another sequence computed it) stays this sequence's own."""
        if not self.prefix_caching:
            return
        seq, bs = self.seqs[req_id], self.block_size
        if len(tokens) > seq.length:
            raise ValueError(f"{req_id}: publish of {len(tokens)} tokens with KV of {seq.length}")
        parent = seq.last_serial
        for i in range(seq.num_published, len(tokens) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            b = self._cached.get(key)
            if b is None:
                b = seq.block_table[i]
                if b in self._entry:  # a block a fork shares that another content chain published first
                    break
                self._cached[key], self._entry[b] = b, (key, self._next_serial)
                self._next_serial += 1
            parent = self._entry[b][1]
            seq.num_published, seq.last_serial = i + 1, parent

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: blocks no sequence holds are free again; held ones stay their sequences'."""
        self._free_blocks.extend(reversed(self._evictable))
        self._evictable.clear()
        self._cached.clear()
        self._entry.clear()
        for seq in self.seqs.values():
            seq.num_published, seq.last_serial = 0, 0

    @staticmethod
    def _unpublish_from(seq: SeqKV, block: int) -> None:
        """Its blocks from `block` on are no longer known to be what was published: `publish` walks its chain
        again from the start (finding its own blocks where they are still cached)."""
        if seq.num_published > block:
            seq.num_published, seq.last_serial = 0, 0

    def _uncache(self, b: int) -> None:
        del self._cached[self._entry.pop(b)[0]]

    def num_shared_blocks(self, req_id: str) -> int:
        return sum(self._refs[b] > 1 for b in self.seqs[req_id].block_table)

    def make_writable(self, req_id: str, start: int, end: int) -> None:
        """Before writing positions [start, end): each block of theirs that another sequence shares is copied into a
        block of this sequence's own (copy on write). Call after `reserve`."""
        seq = self.seqs[req_id]
        for i in range(start // self.block_size, min(len(seq.block_table), self.blocks_for(end))):
            old = seq.block_table[i]
            if self._refs[old] == 1:
                if old in self._entry:  # its content changes: no longer what the cache says it is
                    self._uncache(old)
                    self._unpublish_from(seq, i)
                continue
            if not self.num_free_blocks:  # (a cached block no one holds is evicted for it)
                raise KVCacheFullError(f"KV cache full: no block free to copy {req_id}'s shared block into")
            new = self._take()
            lo, hi, at = old * self.block_size, (old + 1) * self.block_size, new * self.block_size
            for t in self.k + self.v:
                t[at:at + self.block_size].copy_(t[lo:hi])
            self._refs[old] -= 1
            seq.block_table[i] = new
            self.tables[seq.row, i] = new

    def _take(self) -> int:
        if self._free_blocks:
            b = self._free_blocks.pop()
        else:  # the least recently released cached block (a chain's last blocks go first: released in reverse)
            b = self._evictable.popitem(last=False)[0]
            self._uncache(b)
        self._refs[b] = 1
        return b

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._entry:
                    self._evictable[b] = None
                else:
                    self._free_blocks.append(b)

    def commit(self, req_id: str, num_tokens: int) -> None:
        """KV of num_tokens more positions has been written."""
        self.seqs[req_id].length += num_tokens

    def truncate(self, req_id: str, length: int) -> None:
        """Forget KV at positions >= length (rolled-back drafts); frees whole trailing blocks."""
        seq = self.seqs[req_id]
        if length > seq.length:
            raise ValueError(f"truncate to {length} > length {seq.length}")
        seq.length = length
        keep = self.blocks_for(length)
        self._unpublish_from(seq, length // self.block_size)
        if len(seq.block_table) > keep:
            self.tables[seq.row, keep:len(seq.block_table)] = 0
            self._release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self._release(seq.block_table)
            self.tables[seq.row] = 0
            self._free_rows.append(seq.row)

    def _grow_rows(self) -> None:
        old = self.tables.shape[0]
        self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    # ---- slots ------------------------------------------------------------------------------
    def slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions [start, end) of a request. # [end - start]"""
        table = self.tables[self.seqs[req_id].row].long()
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
