"""The simulator: outcome tables against hand computation and sampling, profiles, its checks on selectors,
fast switching, and `spind bench select`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from spind.cli import main
from spind.coordinator.selection.arms import ArmSet
from spind.coordinator.selection.lbss import LBSSSelector, SelectionConfig
from spind.coordinator.selection.baselines import FixedSelector, OracleSelector
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.sim.simulator import simulate
from spind.sim.workload import ProfileRecorder, load_profile, parametric_outcomes, save_profile
from spind.sim.workloads import build_workload


def test_parametric_goodput_matches_hand_computation():
    arm_set = ArmSet(("d",), (2,))
    outcomes = parametric_outcomes(arm_set, acceptance=np.array([[0.5], [0.5]]), hit=np.array([[1.0], [0.5]]),
                                   draft_s_per_token=np.array([0.1]), miss_s=np.array([0.0]), step_s=1.0,
                                   verify_slope=0.5)
    assert np.allclose(outcomes.prob.sum(axis=2), 1.0)
    w = build_workload("mixed", 2, k_set=(2,), arrival_rate=None, seed=0)
    w.arm_set, w.outcomes, w.time_jitter = arm_set, outcomes, 0.0
    # hit: 0, 1, 2 drafts accepted with p 1/2, 1/4, 1/4 -> 1, 2, 3 tokens in 2 x 0.1 + 1 x (1 + 0.5 x 2) s
    hit = (0.5 * 1 + 0.25 * 2 + 0.25 * 3) / 2.2
    assert w.goodput() == pytest.approx(np.array([[1.0, hit], [1.0, 0.5 * hit + 0.5 * 1.0]]))


def test_sampled_rewards_average_to_the_expected_goodput():
    w = build_workload("mixed", 8, k_set=(2, 4, 8), arrival_rate=None, num_tokens=10 ** 9, seed=1)
    w.prefill_s_per_token[:] = 0.0  # no catch-up delay: realised and expected rewards measure the same thing
    for arm in (Arm("small", 8), Arm("large", 2)):
        r = simulate(w, FixedSelector(arm.drafter, arm.k), 600, seed=1)
        assert r.reward.mean() == pytest.approx(r.expected.mean(), rel=0.03)


def test_oracle_has_zero_regret_when_capacity_does_not_bind():
    w = build_workload("cpu-smollm", 60, k_set=(2, 4, 8), arrival_rate=0.2, seed=2)
    r = simulate(w, OracleSelector(w.arm_set, w.goodput_table(), 4), 5000, seed=2)
    assert r.num_finished == 60 and r.num_switches == 0
    assert abs(r.regret_per_slot.sum()) < 1e-9


def test_profile_round_trip_replays_identically(tmp_path: Path):
    w = build_workload("cpu-smollm", 12, k_set=(2, 4, 8), arrival_rate=0.3, seed=3)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(save_profile(w)))
    loaded = load_profile(path)
    assert loaded.req_ids == w.req_ids and loaded.labels == w.labels and loaded.capacity == w.capacity
    assert np.allclose(loaded.goodput(), w.goodput())
    runs = [simulate(x, LBSSSelector(SelectionConfig(seed=3), x.arm_set.drafters, 4), 3000, seed=3)
            for x in (w, loaded)]
    assert runs[0].regret_per_slot.sum() == pytest.approx(runs[1].regret_per_slot.sum())
    assert runs[0].tokens == runs[1].tokens


def test_profile_recorder_normalises_batch_seconds_and_needs_every_arm():
    recorder = ProfileRecorder(["d"], [2], {"d": 0.001}, {"d": 4}, max_batch_size=4, batch_slope=0.5)
    recorder.add_request(RequestInfo(req_id="r", requested="auto", requested_k=None, current=None,
                                     num_prompt_tokens=30, num_output_tokens=0, prompt_repetition=0.2),
                         num_tokens=64, label="chat")

    def slot(arm: Arm, drafted: int, accepted: int, committed: int, draft_s: float, verify_s: float,
             batch_size: int) -> SlotFeedback:
        return SlotFeedback(req_id="r", arm=arm, num_drafted=drafted, num_accepted=accepted, num_committed=committed,
                            draft_s=draft_s, verify_s=verify_s, batch_size=batch_size)

    recorder.add(slot(PLAIN_ARM, 0, 0, 1, 0.0, 0.2, batch_size=3))  # batch factor 1 + 0.5 x 2 = 2
    recorder.add(slot(Arm("d", 2), 2, 1, 2, 0.1, 0.3, batch_size=1))
    recorder.add(slot(Arm("d", 2), 2, 2, 3, 0.1, 0.3, batch_size=1))
    w = load_profile(json.loads(json.dumps(recorder.to_json())))
    assert w.goodput()[0] == pytest.approx([1 / 0.1, (2 / 0.4 + 3 / 0.4) / 2])
    assert w.num_prompt_tokens[0] == 30 and w.labels == ["chat"]
    partial = recorder.to_json()
    del partial["requests"][0]["samples"]["d@2"]
    with pytest.raises(ValueError, match="no samples for arm 'd@2'"):
        load_profile(partial)


class _EveryoneOnOneArm:
    """A policy that ignores capacity; the simulator must refuse it."""

    policy = "everyone"

    def __init__(self, arm: Arm) -> None:
        self.arm = arm

    def select(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        return [self.arm] * len(reqs)

    def observe(self, feedback: Sequence[SlotFeedback]) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass

    def precompute_hint(self, req_id: str) -> str | None:
        return None

    def describe(self) -> dict:
        return {"policy": self.policy}


def test_simulator_refuses_selectors_that_break_capacity_or_invent_arms():
    w = build_workload("mixed", 10, k_set=(2, 4, 8), arrival_rate=None, seed=4)  # capacity of "large": 4
    with pytest.raises(AssertionError, match="capacity 4"):
        simulate(w, _EveryoneOnOneArm(Arm("large", 4)), 10)
    with pytest.raises(ValueError, match="small@3"):
        simulate(w, _EveryoneOnOneArm(Arm("small", 3)), 10)


def test_fast_switching_moves_kv_catchup_off_the_critical_path():
    """cpu-smollm's model drafters pay 1-2.5 ms per token of KV catch-up; honouring precompute hints does it
    in idle time, so switches wait for one slot's tokens instead of the whole context."""
    w = build_workload("cpu-smollm", 40, k_set=(2, 4, 8), arrival_rate=0.1, seed=5)
    fast, slow = (simulate(w, LBSSSelector(SelectionConfig(seed=5), w.arm_set.drafters, 4), 3000, seed=5,
                           fast_switching=is_fast) for is_fast in (True, False))
    assert slow.precompute_s == 0 < fast.precompute_s
    assert fast.switch_s < 0.5 * slow.switch_s


def test_bench_select_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "select.json"
    assert main(["bench", "select", "--workloads", "mixed", "--num-requests", "20", "--policies",
                 "lbss,greedy-length,fixed:small@2,oracle", "--speed-requests", "40", "--speed-slots", "40",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "fixed:small@2" in captured.out and "simulator wall time" in captured.out
    assert "[5/5]" in captured.err  # progress: 4 policies and the timed run
    results = json.loads(out.read_text())
    assert [row["policy"] for row in results["workloads"]["mixed"]] == ["lbss", "greedy-length", "fixed:small@2",
                                                                        "oracle"]
    assert results["workloads"]["mixed"][-1]["regret"] == pytest.approx(0, abs=1e-6)
    assert results["speed"]["num_requests"] == 40


@pytest.mark.parametrize("args, fragment", [(["--policies", "best"], "policy 'best' is not one of"),
                                            (["--workloads", "wiki"], "unknown workload"),
                                            (["--num-requests", "0"], "must be >= 1")])
def test_bench_select_rejects_bad_arguments(args: list[str], fragment: str, capsys: pytest.CaptureFixture,
                                            tmp_path: Path):
    assert main(["bench", "select", "--speed-requests", "0", "--out", str(tmp_path / "x.json"), *args]) == 2
    assert fragment in capsys.readouterr().err
