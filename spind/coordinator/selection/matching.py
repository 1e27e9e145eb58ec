"""Maximum-weight matching of requests to drafter replicas (problem (3) of the paper, solved as in §V-B).

Drafter j has B_j replicas, each serving one request; plain decoding has one replica per request (it is
never limited). The capacity is per drafter, not per arm, so a request's draft length on drafter j is its
best k there, and the matching runs on the drafters alone: a `[n, n + sum_j min(B_j, n)]` matrix for
`scipy.optimize.linear_sum_assignment` (the Kuhn-Munkres algorithm the paper names).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from spind.coordinator.selection.arms import PLAIN_INDEX, ArmSet


def max_weight_assignment(weights: np.ndarray, arm_set: ArmSet, free: dict[str | None, int | None]) -> np.ndarray:
    """Arm index per request maximising the summed weight with at most free[j] requests on drafter j.

    weights: [n, A] finite, columns in arm_set order. Returns [n] arm indices.
    """
    n = weights.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 1:  # one request (batch 1, or one newcomer): its best arm on a drafter with room, the first of ties
        allowed = [PLAIN_INDEX] + [a for a in range(len(arm_set)) if arm_set.drafter_of[a] >= 0
                                   and _room(free, arm_set.drafters[arm_set.drafter_of[a]]) > 0]
        row = weights[0]
        return np.array([max(allowed, key=lambda a: (row[a], -a))], dtype=np.int64)
    columns = [np.full(n, PLAIN_INDEX)] * n  # plain decoding: one replica per request
    for j, drafter in enumerate(arm_set.drafters):
        replicas = min(_room(free, drafter), n)
        if replicas <= 0:
            continue
        arm_ids = np.flatnonzero(arm_set.drafter_of == j)
        best = arm_ids[np.argmax(weights[:, arm_ids], axis=1)]  # [n] the request's best k on drafter j
        columns.extend([best] * replicas)
    arm_of_col = np.stack(columns, axis=1)  # [n, C]: the arm request i runs if matched to column c
    gain = np.take_along_axis(weights, arm_of_col, axis=1)  # [n, C]
    rows, cols = linear_sum_assignment(gain, maximize=True)
    out = np.empty(n, dtype=np.int64)
    out[rows] = arm_of_col[rows, cols]
    return out


def _room(free: dict[str | None, int | None], drafter: str) -> float:
    """Requests drafter `drafter` may take (None: unlimited; absent: none)."""
    room = free.get(drafter, 0)
    return float("inf") if room is None else room


def assignment_value(weights: np.ndarray, arms: np.ndarray) -> float:
    """Summed weight of an assignment: weights [n, A], arms [n]."""
    return float(weights[np.arange(len(arms)), arms].sum())
