"""The coordinator's scheduling policies: numbers in, decisions out; no I/O, testable in microseconds.

- admission: FIFO within the batch limit and the KV budget (a request reserves its whole KV up front:
  min(prompt + max_tokens, context limit), and is never preempted);
- chunked prefill: a per-slot token budget shared by the prompts still being prefilled, shortest remaining
  first (with a guaranteed share for the oldest), so a long prompt neither stalls the running streams nor
  makes a short prompt behind it wait for its whole prefill;
- how much of a running request's text is safe to stream.
"""

from __future__ import annotations

from collections.abc import Sequence


class KVBudget:
    """Target KV blocks reserved by admitted requests (every model drafter's pool is the same size)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size, self.num_reserved = num_blocks, block_size, 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, num_blocks: int) -> bool:
        return self.num_reserved + num_blocks <= self.num_blocks

    def reserve(self, num_blocks: int) -> None:
        self.num_reserved += num_blocks

    def release(self, num_blocks: int) -> None:
        self.num_reserved -= num_blocks


def num_admissible(block_needs: Sequence[int], num_running: int, max_batch_size: int, budget: KVBudget) -> int:
    """How many of the waiting requests (their KV needs in arrival order) to admit now: FIFO, so the head
    waits for blocks and no later request overtakes it."""
    free = budget.num_blocks - budget.num_reserved
    n = 0
    for need in block_needs:
        if num_running + n >= max_batch_size or need > free:
            break
        free -= need
        n += 1
    return n


OLDEST_SHARE = 4  # the oldest prompt still prefilling always gets at least 1/4 of the budget


def plan_prefill(num_left: Sequence[int], token_budget: int) -> list[int]:
    """Prefill tokens each request gets this slot from a shared token budget. num_left[i] = prompt tokens
    request i still has to prefill (0: done), in arrival order.

    Shortest remaining first: it minimises mean time to first token (a short prompt behind a long one is
    prefilled at once, and a burst of similar prompts finishes one by one instead of all together at the
    end); the oldest pending prompt is guaranteed a share of every slot, so no stream of short arrivals
    can starve a long one."""
    out = [0] * len(num_left)
    pending = [i for i, left in enumerate(num_left) if left > 0]
    if not pending:
        return out
    oldest = pending[0]
    out[oldest] = min(num_left[oldest], token_budget // OLDEST_SHARE)
    token_budget -= out[oldest]
    for i in sorted(pending, key=lambda i: (num_left[i] - out[i], i)):
        take = min(num_left[i] - out[i], token_budget)
        out[i] += take
        token_budget -= take
    return out


def visible_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of a running request's text that is safe to stream: without a trailing incomplete UTF-8
    character and without a tail that could still grow into a stop string."""
    n = len(text.rstrip("\ufffd"))
    hold = 0
    for s in stop:
        for j in range(min(len(s) - 1, n), hold, -1):
            if text.endswith(s[:j], 0, n):
                hold = j
                break
    return n - hold
