"""The /v1/spind/state schema (spind.state) and the coordinator's bounded history behind it."""

from __future__ import annotations

import json

import pytest

from spind import protocol as P
from spind.coordinator.history import MAX_BUSY, WINDOW_S, History
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


def test_history_is_bounded_and_windows_busy_time():
    clock = Clock()
    h = History(clock)
    for i in range(MAX_BUSY + 10):  # 10 ms busy in every 20 ms
        t = clock.t - 100 + i * 0.02
        h.add_busy("target", P.BusyInterval("verify", t, t + 0.01, 2))
    assert len(h.busy["target"]) == MAX_BUSY
    now = clock.t - 100 + (MAX_BUSY + 10) * 0.02
    spans = h.busy_spans("target", now)
    assert spans and all(s.end >= now - WINDOW_S for s in spans) and spans[0].start < spans[-1].start
    assert h.utilisation(spans, now) == pytest.approx(0.5, abs=0.01)
    assert h.busy_s["target"]["verify"] == pytest.approx(0.01 * (MAX_BUSY + 10))  # totals are not windowed


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
