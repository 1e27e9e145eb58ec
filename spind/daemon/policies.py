"""The coordinator's pure policies: numbers in, decisions out; no I/O, testable in microseconds.

- drafter selection (`StaticSelector`; the learning bandit selector implements the same `select`),
- KV admission budget,
- how much of a running request's text is safe to stream.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SelectInput:
    req_id: str
    requested: str  # "auto" | a drafter name | "none"
    current: str | None  # drafter used in the previous slot (None: plain decoding or new)


class StaticSelector:
    """A named drafter as asked; "auto" -> the configured default; "none" -> plain decoding (None)."""

    policy = "default"

    def __init__(self, default_drafter: str) -> None:
        self.default_drafter = default_drafter

    def select(self, reqs: list[SelectInput]) -> list[str | None]:
        names = [self.default_drafter if r.requested == "auto" else r.requested for r in reqs]
        return [None if n == "none" else n for n in names]

    def describe(self) -> dict:
        return {"policy": self.policy, "default_drafter": self.default_drafter}


def apply_capacity(choices: list[str | None], worker_of: dict[str, str], capacity: dict[str, int]) -> list[str | None]:
    """Enforce each worker's batch limit B_j: requests past it (in batch order) decode without a drafter
    this slot. choices[i] is request i's drafter (None: plain decoding); worker_of maps drafter -> worker."""
    used: dict[str, int] = {}
    out: list[str | None] = []
    for name in choices:
        w = worker_of.get(name) if name is not None else None
        if w is not None:
            used[w] = used.get(w, 0) + 1
            if used[w] > capacity[w]:
                name = None
        out.append(name)
    return out


class KVBudget:
    """Target KV blocks reserved by admitted requests (the workers' caches are the same size)."""

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
