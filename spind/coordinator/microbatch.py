"""How many micro-batches each SSM's batch is split into (paper §VI-B), and a model of what a split costs.

The paper's heuristic: start at b0 = 2 micro-batches and add one while the target's profiled throughput at
the smaller micro-batch does not drop significantly below its throughput at the whole batch; more micro-
batches shorten the target's wait for drafts, but each verify pass then carries fewer rows, and past some
point the target's passes stop filling it. Pure: numbers in (the `SystemProfile`'s verify latency per batch
size), a count out.

`pipeline_goodput` is the steady-state model the heuristic is checked against (by a brute-force sweep over
the same profile): an SSM drafts micro-batch m+1 while the target verifies micro-batch m, so a round of b
micro-batches takes b * max(draft(m), verify(m)) plus one fill, one drain of the shorter stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

B0 = 2
MAX_MICRO_BATCHES = 9
DROP = 0.15  # a throughput drop larger than this is "significant" (the paper says "obvious")


def interpolate(table: Mapping[int, float], batch: int) -> float:
    """Latency at `batch` from a profile measured at a few batch sizes (linear between, clamped outside)."""
    sizes = sorted(table)
    if batch <= sizes[0]:
        return table[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if batch <= hi:
            return table[lo] + (table[hi] - table[lo]) * (batch - lo) / (hi - lo)
    top = sizes[-1]
    return table[top] * batch / top  # beyond the profile: no better than linear


def throughput(verify_ms: Mapping[int, float], batch: int) -> float:
    """Requests verified per second at one verify pass of `batch` requests."""
    return batch / interpolate(verify_ms, batch) * 1e3


def choose_micro_batches(verify_ms: Mapping[int, float], batch: int, drop: float = DROP,
                         b0: int = B0, max_b: int = MAX_MICRO_BATCHES) -> int:
    """The paper's heuristic for one SSM's batch of `batch` requests: split into b0 micro-batches and keep
    adding one while the target's throughput at the micro-batch size stays within `drop` of its throughput at
    the whole batch. If b0 already costs that much (a target whose passes are far from full at this batch, as
    a CPU's), the batch is not split (1: the pipeline then overlaps by drafting ahead)."""
    if batch <= 1:
        return 1

    def keeps_up(b: int) -> bool:
        return throughput(verify_ms, math.ceil(batch / b)) >= (1 - drop) * whole

    whole = throughput(verify_ms, batch)
    b = min(b0, batch, max_b)
    if not keeps_up(b):
        return 1
    while b < min(max_b, batch):
        nxt = b + 1
        while nxt < min(max_b, batch) and math.ceil(batch / nxt) == math.ceil(batch / b):
            nxt += 1  # a count that leaves the micro-batch size as it was only adds passes
        if math.ceil(batch / nxt) == math.ceil(batch / b) or not keeps_up(nxt):
            break
        b = nxt
    return b


def pipeline_goodput(batch: int, b: int, tokens_per_request: float, draft_ms: Callable[[int], float],
                     verify_ms: Callable[[int], float]) -> float:
    """Committed tokens per second of one SSM's batch split into b micro-batches, in steady state."""
    m = math.ceil(batch / b)
    d, v = draft_ms(m), verify_ms(m)
    round_ms = b * max(d, v) + min(d, v)  # the slower stage back to back, plus fill/drain of the faster
    return batch * tokens_per_request / round_ms * 1e3


def best_micro_batches(batch: int, tokens_per_request: float, draft_ms: Callable[[int], float],
                       verify_ms: Callable[[int], float], max_b: int = MAX_MICRO_BATCHES) -> int:
    """The brute-force sweep: the count with the highest modelled goodput."""
    counts = range(1, min(max_b, batch) + 1)
    return max(counts, key=lambda b: pipeline_goodput(batch, b, tokens_per_request, draft_ms, verify_ms))
