"""Discrete-event replay of a selector over a workload, one time slot per step.

Each slot: arrivals join a FIFO queue and are admitted up to max_batch_size; the selector chooses an arm
per running request (`select`); each request's outcome is drawn from its outcome table for that arm; the
selector learns from the feedback (`observe`); finished requests are removed (`remove`). With
fast_switching the selector's `precompute_hint` is honoured: that drafter's KV for the request is brought up
to date in idle time, so a switch to it next slot catches up one slot's tokens only.

A switch's KV catch-up, (tokens the new drafter lacks) x prefill seconds per token, delays that request's
slot. Regret per slot and request is the paper's: g_i* - E[r_i(t)], the oracle's expected goodput (the best
feasible assignment of the slot's requests, ignoring switching) less the expected reward of the chosen arm,
its switch delay included, so switching cost is counted in goodput terms. Requests that bypass selection
add no regret. Goodputs and regret are reported at batch 1: the batch factor is common to every arm, so it
changes no decision, but policies that finish requests at different speeds run at different batch sizes,
and unscaled means would compare those rather than the choices.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from spind.coordinator.selection.arms import split_bypass, free_capacity
from spind.coordinator.selection.matching import max_weight_assignment
from spind.coordinator.selection.protocol import Capacity, RequestInfo, Selector, SlotFeedback
from spind.sim.workload import Workload


@dataclass(kw_only=True)
class SimResult:
    policy: str
    workload: str
    num_slots: int
    num_finished: int
    tokens: int
    wall_s: float  # the simulator's own time, selector included
    num_switches: int
    switch_s: float  # summed KV catch-up seconds on the critical path
    precompute_s: float  # KV catch-up done ahead of a switch, in idle time
    regret_per_slot: np.ndarray  # [T] summed g* - E[r] over the slot's requests
    # one row per (slot, request) that ran: [M] each; goodputs at batch 1
    slot: np.ndarray
    req: np.ndarray
    arm: np.ndarray
    life: np.ndarray  # slots the request had run before this one
    reward: np.ndarray  # realised committed / (draft + verify + switch) seconds
    expected: np.ndarray  # E[r] of the chosen arm, switch delay included
    best: np.ndarray  # g* (0 for requests that bypass selection: they add no regret)
    extra: dict = field(default_factory=dict)

    def cumulative_regret(self) -> np.ndarray:
        return np.cumsum(self.regret_per_slot)

    def summary(self) -> dict:
        best_sum = float(self.best.sum())
        regret = float(self.regret_per_slot.sum())
        return {"policy": self.policy, "workload": self.workload, "num_slots": self.num_slots,
                "num_finished": self.num_finished, "request_slots": int(len(self.slot)),
                "goodput": float(self.expected.mean()) if len(self.slot) else 0.0,
                "oracle_goodput": float(self.best.mean()) if len(self.slot) else 0.0,
                "regret": regret, "regret_pct": 100 * regret / best_sum if best_sum else 0.0,
                "tokens": self.tokens,
                "num_switches": self.num_switches,
                "switches_per_100": 100 * self.num_switches / max(len(self.slot), 1),
                "switch_s": self.switch_s, "precompute_s": self.precompute_s, "wall_s": self.wall_s}


def simulate(w: Workload, selector: Selector, num_slots: int, *, seed: int = 0,
             fast_switching: bool = True) -> SimResult:
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    arms, o = w.arm_set, w.outcomes
    cdf = np.cumsum(o.prob, axis=2)  # [R, A, O]
    g1 = w.goodput()  # [R, A] at batch 1
    capacity = Capacity(w.capacity)
    generated = np.zeros(w.num_requests, dtype=np.int64)
    life = np.zeros(w.num_requests, dtype=np.int64)
    current = np.full(w.num_requests, -1)  # arm index of the previous slot
    kv_len = np.zeros((w.num_requests, len(arms.drafters)), dtype=np.int64)  # tokens in each drafter's KV
    order = np.argsort(w.arrival_slot, kind="stable")
    waiting: deque[int] = deque()
    running: list[int] = []
    rec = _Recorder(num_slots)
    next_arrival, num_finished, best_arm = 0, 0, None
    for t in range(num_slots):
        while next_arrival < len(order) and w.arrival_slot[order[next_arrival]] <= t:
            waiting.append(int(order[next_arrival]))
            next_arrival += 1
        while waiting and len(running) < w.max_batch_size:
            running.append(waiting.popleft())
            best_arm = None
        if not running:
            if next_arrival == len(order):
                break
            continue
        run = np.array(running)
        infos = [RequestInfo(req_id=w.req_ids[i], requested=w.requested[i], requested_k=None,
                             current=arms.arms[current[i]] if current[i] >= 0 else None,
                             num_prompt_tokens=int(w.num_prompt_tokens[i]), num_output_tokens=int(generated[i]),
                             prompt_repetition=float(w.prompt_repetition[i]))
                 for i in running]
        chosen = selector.select(infos, capacity)
        a = np.array([_arm_index(arms.index, arm) for arm in chosen])  # [n]
        _check_capacity(chosen, capacity)
        if best_arm is None:  # the oracle's arms for this set of running requests
            best_arm = _oracle_arms(g1[run], infos, w, capacity)

        # KV catch-up: a request whose drafter changed (or that starts on one) brings it up to date
        num_tokens = w.num_prompt_tokens[run] + generated[run]  # [n]
        d_new = arms.drafter_of[a]
        d_old = np.where(current[run] >= 0, arms.drafter_of[np.maximum(current[run], 0)], -2)
        on_drafter = d_new >= 0
        catchup = on_drafter & (d_new != d_old)
        d = np.maximum(d_new, 0)
        switch_s = np.where(catchup, (num_tokens - kv_len[run, d]) * w.prefill_s_per_token[d], 0.0)
        is_switch = (current[run] >= 0) & (d_new != d_old)
        kv_len[run[on_drafter], d_new[on_drafter]] = num_tokens[on_drafter]
        if fast_switching:
            rec.precompute_s += _precompute(selector, w, run, num_tokens, kv_len)

        # one slot's outcome per request
        n = len(running)
        batch = 1 + w.batch_slope * (n - 1)
        jitter = float(np.exp(rng.normal(0, w.time_jitter))) if w.time_jitter else 1.0
        pick = np.minimum((cdf[run, a] < rng.random(n)[:, None]).sum(axis=1), cdf.shape[2] - 1)  # [n]
        committed = np.minimum(o.committed[run, a, pick], w.num_tokens[run] - generated[run]).astype(np.int64)
        accepted = np.minimum(o.accepted[run, a, pick], committed - 1)
        draft_s = o.draft_s[run, a, pick] * batch * jitter
        verify_s = o.verify_s[run, a, pick] * batch * jitter
        feedback = [SlotFeedback(req_id=w.req_ids[i], arm=chosen[x], num_drafted=int(o.drafted[i, a[x], pick[x]]),
                                 num_accepted=int(accepted[x]), num_committed=int(committed[x]),
                                 draft_s=float(draft_s[x]), verify_s=float(verify_s[x]), switch_s=float(switch_s[x]),
                                 batch_size=n)
                    for x, i in enumerate(running)]
        selector.observe(feedback)

        # regret: the oracle's expected goodput less the chosen arm's, switch delay included
        expected = g1[run, a].copy()  # [n] at batch 1
        if is_switch.any():
            expected[is_switch] = _expected_with_delay(w, run[is_switch], a[is_switch], switch_s[is_switch] / batch)
        is_auto = np.array([b is None for b in split_bypass(infos, 0)])
        best = np.where(is_auto, g1[run, best_arm], expected)
        rec.add(t, run, a, life[run], committed / (draft_s + verify_s + switch_s) * batch, expected, best)
        rec.num_switches += int(is_switch.sum())
        rec.switch_s += float(switch_s.sum())

        generated[run] += committed
        rec.tokens += int(committed.sum())
        current[run] = a
        life[run] += 1
        done = generated[run] >= w.num_tokens[run]
        if done.any():
            for i in run[done]:
                selector.remove(w.req_ids[i])
                running.remove(int(i))
            num_finished += int(done.sum())
            best_arm = None
    return rec.result(selector.policy, w.name, num_finished, time.perf_counter() - start)


def _arm_index(index: dict, arm) -> int:
    if arm not in index:
        raise ValueError(f"selector chose arm {arm.name!r}, which the workload does not model")
    return index[arm]


def _check_capacity(chosen: list, capacity: Capacity) -> None:
    used: dict[str, int] = {}
    for arm in chosen:
        if arm.drafter is not None:
            used[arm.drafter] = used.get(arm.drafter, 0) + 1
    for drafter, n in used.items():
        if n > capacity.of(drafter):
            raise AssertionError(f"selector put {n} requests on {drafter!r}, capacity {capacity.of(drafter)}")


def _oracle_arms(g: np.ndarray, infos: list[RequestInfo], w: Workload, capacity: Capacity) -> np.ndarray:
    """[n] the best feasible arm per running request: its own best, or the maximum-weight matching of the
    requests that selection decides when their best arms overflow a drafter (bypassing ones keep theirs)."""
    bypass = split_bypass(infos, 0)
    auto = np.array([b is None for b in bypass])
    best = g.argmax(axis=1)
    free = free_capacity(capacity, w.arm_set.drafters, [b for b in bypass if b is not None])
    used = np.bincount(w.arm_set.drafter_of[best[auto]] + 1, minlength=len(w.arm_set.drafters) + 1)[1:]
    if any(free[d] is not None and used[j] > free[d] for j, d in enumerate(w.arm_set.drafters)):
        best[auto] = max_weight_assignment(g[auto], w.arm_set, free)
    return best


def _expected_with_delay(w: Workload, reqs: np.ndarray, arms: np.ndarray, delay_s: np.ndarray) -> np.ndarray:
    """[m] E[committed / (seconds + delay)] at batch 1 for the given requests and arms."""
    o = w.outcomes
    seconds = o.draft_s[reqs, arms] + o.verify_s[reqs, arms] + delay_s[:, None]  # [m, O]
    with np.errstate(invalid="ignore", divide="ignore"):
        per_outcome = np.where(o.prob[reqs, arms] > 0, o.committed[reqs, arms] / seconds, 0.0)
    return (o.prob[reqs, arms] * per_outcome).sum(axis=1) * float(np.exp(w.time_jitter ** 2 / 2))


def _precompute(selector: Selector, w: Workload, run: np.ndarray, num_tokens: np.ndarray, kv_len: np.ndarray) -> float:
    """Bring each hinted drafter's KV up to date (idle time, off the critical path); returns its seconds."""
    seconds = 0.0
    for x, i in enumerate(run):
        j = w.arm_set.drafter_index.get(selector.precompute_hint(w.req_ids[i]))
        if j is not None and kv_len[i, j] < num_tokens[x]:
            seconds += (num_tokens[x] - kv_len[i, j]) * w.prefill_s_per_token[j]
            kv_len[i, j] = num_tokens[x]
    return seconds


class _Recorder:
    def __init__(self, num_slots: int) -> None:
        self.rows: list[tuple[np.ndarray, ...]] = []
        self.regret = np.zeros(num_slots)
        self.last_slot = -1
        self.tokens = self.num_switches = 0
        self.switch_s = self.precompute_s = 0.0

    def add(self, t: int, run: np.ndarray, a: np.ndarray, life: np.ndarray, reward: np.ndarray,
            expected: np.ndarray, best: np.ndarray) -> None:
        self.rows.append((np.full(len(run), t), run, a, life, reward, expected, best))
        self.regret[t] = float((best - expected).sum())
        self.last_slot = t

    def result(self, policy: str, workload: str, num_finished: int, wall_s: float) -> SimResult:
        columns = [np.concatenate(c) for c in zip(*self.rows)] if self.rows else [np.zeros(0)] * 7
        slot, req, arm, life, reward, expected, best = columns  # the order of add's rows
        return SimResult(policy=policy, workload=workload, num_slots=self.last_slot + 1, num_finished=num_finished,
                         tokens=self.tokens, wall_s=wall_s, num_switches=self.num_switches, switch_s=self.switch_s,
                         precompute_s=self.precompute_s, regret_per_slot=self.regret[:self.last_slot + 1],
                         slot=slot, req=req, arm=arm, life=life, reward=reward, expected=expected, best=best)
