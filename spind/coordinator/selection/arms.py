"""The arm set every learning selector chooses from, and Algorithm 2's capacity step.

An arm is a (drafter, k) pair or plain decoding. Arms are indexed 0..A-1 with plain decoding at index 0, so
that per-request statistics are small numpy rows `[A]` and the matching works on `[n, A]` matrices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, bypass_arm

PLAIN_INDEX = 0


class ArmSet:
    """PLAIN_ARM, then every drafter at every k, in the order given."""

    def __init__(self, drafters: Sequence[str], k_set: Sequence[int]) -> None:
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"duplicate drafter names in {list(drafters)}")
        self.drafters = tuple(drafters)
        self.drafter_index = {d: j for j, d in enumerate(self.drafters)}
        self.k_set = tuple(k_set)
        self.arms: tuple[Arm, ...] = (PLAIN_ARM, *(Arm(d, k) for d in self.drafters for k in self.k_set))
        self.index = {arm: i for i, arm in enumerate(self.arms)}
        self.names = [arm.name for arm in self.arms]
        # [A] drafter position of each arm in self.drafters; -1 for plain decoding
        self.drafter_of = np.array([self.drafter_index.get(a.drafter, -1) for a in self.arms])

    def __len__(self) -> int:
        return len(self.arms)

    def available(self, free: dict[str | None, int | None]) -> list[list[int]]:
        """Arm indices per drafter with room (plain decoding, which always has, first)."""
        groups = [[PLAIN_INDEX]]
        for j, d in enumerate(self.drafters):
            if free.get(d, 0) != 0:
                groups.append(np.flatnonzero(self.drafter_of == j).tolist())
        return groups

    def draw(self, groups: list[list[int]], rng: np.random.Generator) -> int:
        """A random arm: a drafter (or plain decoding) uniformly, then one of its draft lengths uniformly, so
        every drafter is explored as often whatever the size of the k set."""
        arms = groups[rng.integers(len(groups))]
        return arms[rng.integers(len(arms))]


def free_capacity(capacity: Capacity, drafters: Iterable[str], taken: Iterable[Arm]) -> dict[str | None, int | None]:
    """B_j left for selection after the `taken` arms (requests that bypass selection); None = unlimited."""
    free: dict[str | None, int | None] = {None: None}
    for d in drafters:
        free[d] = capacity.of(d)
    for arm in taken:
        if arm.drafter is not None:
            free[arm.drafter] = max(0, free.get(arm.drafter, capacity.of(arm.drafter)) - 1)
    return free


def split_bypass(reqs: Sequence[RequestInfo], default_k: int) -> list[Arm | None]:
    """Each request's own arm when it bypasses selection (a named drafter, "none", or k = 0); None for AUTO."""
    out = []
    for r in reqs:
        arm = bypass_arm(r, default_k)
        if arm is None and r.requested_k == 0:
            arm = PLAIN_ARM
        out.append(arm)
    return out


def with_requested_k(arm: Arm, req: RequestInfo) -> Arm:
    """An AUTO request that asked for a k gets the chosen drafter at that k."""
    if arm.drafter is None or req.requested_k is None:
        return arm
    return Arm(arm.drafter, req.requested_k)


def random_drop(choice: dict[str, int], arm_set: ArmSet, free: dict[str | None, int | None],
                rng: np.random.Generator) -> dict[str, int]:
    """Algorithm 2's capacity step: where more requests drew drafter j than it has room for (B_j), keep B_j
    of them chosen at random; the others decode plainly. `choice` maps req_id -> arm index."""
    by_drafter: dict[str, list[str]] = {}
    for req_id, a in choice.items():
        drafter = arm_set.arms[a].drafter
        if drafter is not None:
            by_drafter.setdefault(drafter, []).append(req_id)
    out = dict(choice)
    for drafter, req_ids in by_drafter.items():
        room = free.get(drafter, 0)
        if room is not None and len(req_ids) > room:
            for i in rng.permutation(len(req_ids))[room:]:
                out[req_ids[i]] = PLAIN_INDEX
    return out


def take(free: dict[str | None, int | None], arm: Arm) -> None:
    """Use one unit of the arm's drafter's free capacity."""
    room = free.get(arm.drafter)
    if room is not None:
        free[arm.drafter] = room - 1
