"""The /v1/spind/state schema (spind.state) and the coordinator's bounded history behind it."""

from __future__ import annotations

import json

import pytest

from spind import protocol as P
from spind.coordinator.history import NUM_BINS, RESOLUTION_S, WINDOW_S, History
from spind.state import STATE_VERSION, LatencyState, SpindState, StateVersionError, decode_state, encode_state


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def minimal_state(**fields) -> SpindState:
    return SpindState(model="m", accepting=True, failure=None, now=1.0, window_s=WINDOW_S, num_waiting=0,
                      num_running=0, workers=[], requests=[], drafters={}, selection=None, selector=None,
                      throughput=[], latency=LatencyState(), slots={}, kv={}, **fields)


def test_state_round_trips_through_json_and_dicts():
    state = minimal_state()
    data = encode_state(state)
    assert json.loads(data)["version"] == STATE_VERSION
    assert decode_state(data) == state == decode_state(json.loads(data))


def test_another_version_is_refused_with_a_clear_message():
    raw = json.loads(encode_state(minimal_state()))
    raw["version"] = STATE_VERSION + 1
    with pytest.raises(StateVersionError, match=f"version {STATE_VERSION + 1}.*reads version {STATE_VERSION}"):
        decode_state(raw)
    with pytest.raises(StateVersionError, match="version None"):
        decode_state(b'{"detail": "not a state"}')


def test_history_keeps_the_whole_window_of_busy_time_in_bounded_bins_under_any_load():
    """200 intervals a second (a 4 ms verify and a 1 ms n-gram draft every 10 ms) for a minute: the snapshot still
    reaches back the whole window (a ring of 4096 intervals held 20 s of it) with a few spans per bin, and each
    activity's seconds in it are the intervals'."""
    clock = Clock()
    h = History(clock)
    start = clock.t - 60
    for i in range(6000):
        t = start + i * 0.01
        h.add_busy("target", P.BusyInterval("verify", t, t + 0.004, 2))
        h.add_busy("target", P.BusyInterval("draft", t + 0.004, t + 0.005, 2, "ngram"))
    now = start + 60
    assert len(h.busy["target"]) <= NUM_BINS
    spans = h.busy_spans("target", now)
    assert len(spans) <= 2 * (WINDOW_S / RESOLUTION_S + 1)
    assert spans[0].start <= now - WINDOW_S and spans[-1].start >= now - RESOLUTION_S
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    verify = sum(s.end - s.start for s in spans if s.kind == "verify")
    draft = sum(s.end - s.start for s in spans if s.kind == "draft" and s.drafter == "ngram")
    assert verify == pytest.approx(0.4 * WINDOW_S, rel=0.01) and draft == pytest.approx(0.1 * WINDOW_S, rel=0.01)
    assert h.utilisation(spans, now) == pytest.approx(0.5, abs=0.01)
    assert {s.num_reqs for s in spans} == {2}
    assert h.busy_s["target"]["verify"] == pytest.approx(0.004 * 6000)  # totals are not windowed


def test_an_interval_across_bins_is_split_and_one_reported_late_lands_in_its_own_bin():
    clock = Clock()
    h = History(clock)
    r = RESOLUTION_S
    h.add_busy("target", P.BusyInterval("prefill", 990 + 0.5 * r, 990 + 3.5 * r, 1))  # 3 bins' time across 4
    h.add_busy("draft", P.BusyInterval("draft", 991.0, 991.0 + r / 2, 1, "int8"))
    h.add_busy("draft", P.BusyInterval("precompute", 990.0, 990.0 + r / 4, 0, "int8"))  # ran before the draft
    spans = h.busy_spans("target", 1000.0)
    assert [s.kind for s in spans] == ["prefill"] * 4
    assert sum(s.end - s.start for s in spans) == pytest.approx(3 * r)
    assert spans[0].start == pytest.approx(990.0) and spans[-1].end == pytest.approx(990 + 3.5 * r, abs=1e-4)
    assert [(s.kind, s.start) for s in h.busy_spans("draft", 1000.0)] == [("precompute", 990.0), ("draft", 991.0)]
    # a bin outside the window is not shown; one older than a full ring holds is dropped, not misfiled
    assert h.busy_spans("target", 990 + 4 * r + WINDOW_S) == []
    for i in range(NUM_BINS):
        h.add_busy("late", P.BusyInterval("verify", 2000 + i * r, 2000 + i * r + r / 10))
    h.add_busy("late", P.BusyInterval("verify", 1000.0, 1000.0 + r / 10))
    assert len(h.busy["late"]) == NUM_BINS and min(b.index for b in h.busy["late"]) >= round(2000 / r)


def test_a_long_interval_keeps_its_last_window():
    h = History(Clock())
    h.add_busy("target", P.BusyInterval("prefill", 900.0, 1000.0, 1))  # 100 s (longer than the ring reaches)
    assert NUM_BINS - 1 <= len(h.busy["target"]) <= NUM_BINS  # (the bin starting at 1000.0 has none of it)
    assert h.utilisation(h.busy_spans("target", 1000.0), 1000.0) == pytest.approx(1.0, abs=1e-3)


def test_overlapping_busy_intervals_count_once():
    h = History(Clock())
    h.add_busy("target", P.BusyInterval("verify", 990.0, 1000.0))
    h.add_busy("target", P.BusyInterval("draft", 995.0, 1000.0, 1, "ngram"))  # inline, during the verify
    assert h.utilisation(h.busy_spans("target", 1000.0), 1000.0) == pytest.approx(10 / WINDOW_S, abs=1e-3)


def test_throughput_samples_one_per_second_with_gaps_filled():
    clock = Clock(1000.2)
    h = History(clock)
    h.add_step("ngram", 5, 4, 4)
    h.add_step("ngram", 1, 4, 0)
    h.add_step("none", 1, 0, 0)
    h.add_queue(3, 1)
    clock.t = 1002.5
    h.add_prompt_tokens(7)  # an admission, no slot yet: the queues are still those of 1000
    clock.t = 1003.5
    h.add_step("int8", 2, 4, 1)
    samples = h.throughput(clock.t)
    assert len(samples) == WINDOW_S and samples[-1].t == 1002.0  # the open second (1003) is not shown
    by_t = {s.t: s for s in samples}
    first = by_t[1000.0]
    assert first.drafters["ngram"].num_committed == 6 and first.drafters["ngram"].num_steps == 2
    assert first.drafters["none"].num_drafted == 0 and first.num_running == 3 and first.num_waiting == 1
    assert by_t[1001.0].drafters == {}  # a second without slots committed nothing
    assert (by_t[1001.0].num_running, by_t[1001.0].num_waiting) == (3, 1)  # and kept the queues
    assert by_t[1002.0].num_prompt_tokens == 7 and by_t[1002.0].num_running == 3


def test_latency_percentiles_in_ms():
    h = History(Clock())
    assert h.latency() == LatencyState()
    for i in range(1, 101):
        h.add_latency(i / 100)
        h.add_ttft(i / 1000)
    lat = h.latency()
    assert lat.num_requests == 100 and lat.latency_ms["p50"] == pytest.approx(505, abs=1)
    assert lat.ttft_ms["p99"] == pytest.approx(99, abs=1)
