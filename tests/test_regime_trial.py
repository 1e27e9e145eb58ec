"""The regime trial (spind/coordinator/selection/regime.py): per batch-size bucket, windows of slots run as selection
chooses or plainly, unselected, and the regime whose windows made more tokens per second of wall time runs more.
Scripted slots: a regime's slots make a fixed number of tokens in seconds with a little seeded noise."""

from __future__ import annotations

import numpy as np
import pytest

from spind.coordinator.selection.regime import MIN_PAIRS, PLAIN, SELECT, RegimeTrial

PLAIN_S = {1: 0.006, 2: 0.0065, 3: 0.007, 4: 0.0075, 16: 0.02}  # a plain forward's predicted seconds per batch size


def trial(**kw) -> RegimeTrial:
    return RegimeTrial(6, PLAIN_S.get, **kw)


def run(t: RegimeTrial, slots: int, speed: dict[str, float], bucket: int = 2, batch: int = 4, noise: float = 0.05,
        seed: int = 1) -> list[str]:
    """`slots` slots at `bucket`: each in the regime the trial gives, making `batch` tokens in the seconds of
    batch / speed[regime] plain steps (1 = plain decoding's speed), with noise; the regimes run, in order."""
    rng = np.random.default_rng(seed)
    ran = []
    for _ in range(slots):
        r = t.regime(bucket, batch)
        seconds = PLAIN_S[batch] / speed[r] * (1.0 + noise * rng.standard_normal())
        t.record(bucket, r, batch, batch, seconds)
        ran.append(r)
    return ran


def test_a_bucket_runs_whole_windows_in_pairs_first():
    t = trial(window=16)  # request-steps: 4 slots at batch 4
    ran = run(t, 4 * 2 * MIN_PAIRS, {SELECT: 1.0, PLAIN: 1.0})
    windows = [ran[i:i + 4] for i in range(0, len(ran), 4)]
    assert all(len(set(w)) == 1 for w in windows)  # a window keeps its regime
    pairs = [{windows[i][0], windows[i + 1][0]} for i in range(0, len(windows), 2)]
    assert pairs == [{SELECT, PLAIN}] * MIN_PAIRS  # one of each, in either order
    t.regime(2, 4)  # the last window closes as the next one starts
    assert t.describe()["buckets"]["2"]["pairs"] == MIN_PAIRS


def test_where_speculation_loses_the_slots_go_plain():
    t = trial()
    ran = run(t, 16 * 200, {SELECT: 0.95, PLAIN: 1.0})
    late = ran[len(ran) // 2:]
    assert late.count(PLAIN) / len(late) > 0.9
    assert t.advantage(2) == pytest.approx(0.95, abs=0.02)


def test_where_speculation_pays_plain_slots_all_but_stop():
    t = trial()
    ran = run(t, 16 * 200, {SELECT: 1.2, PLAIN: 1.0}, noise=0.15)
    late = ran[len(ran) // 4:]
    assert late.count(PLAIN) / len(late) < 0.04  # a pair now and then, to keep the evidence fresh
    assert t.advantage(2) == pytest.approx(1.2, abs=0.05)


def test_a_regime_that_turns_is_followed():
    """Speculation lost for a long while, then pays (the workload started copying): the trial goes back to it."""
    t = trial()
    run(t, 16 * 150, {SELECT: 0.9, PLAIN: 1.0})
    ran = run(t, 16 * 150, {SELECT: 1.3, PLAIN: 1.0}, seed=2)
    assert ran[-16 * 50:].count(SELECT) / (16 * 50) > 0.9


def test_windows_at_different_batch_sizes_of_a_bucket_compare_by_plain_steps():
    """A window at batch 3 and one at batch 4 (bucket 2) that both run at plain decoding's speed measure the same,
    though the one at batch 4 makes more tokens a second."""
    t = trial(window=1)
    for batch in (3, 4, 4, 3):
        r = t.regime(2, batch)
        t.record(2, r, batch, batch, PLAIN_S[batch])
    t.regime(2, 4)  # closes the last window
    assert t.describe()["buckets"]["2"]["pairs"] == 2 and t.advantage(2) == pytest.approx(1.0)


def test_a_pair_with_an_unmeasured_window_is_void():
    t = trial(window=8)  # 2 slots at batch 4
    first = t.regime(2, 4)
    t.record(2, first, 4, 4, 0.0)  # a slot whose seconds were not measured (a drafter worker drafted meanwhile) ...
    t.record(2, PLAIN if first == SELECT else SELECT, 100, 4, 0.001)  # ... and one of the other regime: not counted
    t.regime(2, 4)
    t.regime(2, 4)  # the first window closes with nothing measured: its pair is void, a new one starts
    assert t.describe()["buckets"]["2"]["pairs"] == 0
    t = RegimeTrial(6, lambda b: None, window=1)  # no plain forward known yet: no window is measured
    for _ in range(6):
        t.record(0, t.regime(0, 1), 1, 1, 0.01)
    assert t.advantage(0) is None and t.describe()["buckets"]["0"]["pairs"] == 0


def test_buckets_are_tried_apart():
    t = trial(window=16)  # 4 slots at batch 4, 16 at batch 1
    run(t, 16 * 100, {SELECT: 0.9, PLAIN: 1.0}, bucket=2, batch=4)
    ran = run(t, 16 * 100, {SELECT: 1.3, PLAIN: 1.0}, bucket=0, batch=1)
    assert ran[-16 * 50:].count(SELECT) / (16 * 50) > 0.95
    assert t.advantage(2) < 1.0 < t.advantage(0)


def test_a_window_holds_request_steps_not_slots():
    """A window ends once its slots' batch sizes add up to `window`: fewer slots as the batch grows, so the trial
    costs a bigger batch fewer slots for windows of as many request-steps."""
    for batch, slots in ((16, 4), (4, 16), (2, 32), (3, 22)):
        t = trial(window=64)
        ran = run(t, slots * 2 * MIN_PAIRS, {SELECT: 1.0, PLAIN: 1.0}, bucket=4, batch=batch)
        windows = [ran[i:i + slots] for i in range(0, len(ran), slots)]
        assert all(len(set(w)) == 1 for w in windows) and len({w[0] for w in windows[:2]}) == 2
        t.regime(4, batch)
        assert t.describe()["buckets"]["4"]["pairs"] == MIN_PAIRS


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        RegimeTrial(0, PLAIN_S.get)
    with pytest.raises(ValueError):
        RegimeTrial(6, PLAIN_S.get, window=0)
