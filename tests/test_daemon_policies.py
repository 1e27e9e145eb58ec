"""The daemon's pure parts, no processes: the metrics registry's Prometheus text, the engine's policies
(selector, KV budget, stop-string hold-back) and the worker plan."""

from __future__ import annotations

import dataclasses

import pytest

from spind.config import load_config
from spind.daemon.policies import KVBudget, SelectInput, StaticSelector, apply_capacity, visible_len
from spind.daemon.metrics import EngineMetrics, Registry, SlotTimes
from spind.daemon.worker import TARGET_WORKER, threads_for, worker_names


def samples(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_counter_gauge_render_with_labels_and_escaping():
    r = Registry()
    c = r.counter("x_total", "things", ("kind",))
    c.inc(kind="a")
    c.inc(2.5, kind='q"u\\o\nte')
    g = r.gauge("y", "level")
    text = r.render()
    assert "# TYPE x_total counter" in text and "# HELP y level" in text
    s = samples(text)
    assert s['x_total{kind="a"}'] == 1
    assert s['x_total{kind="q\\"u\\\\o\\nte"}'] == 2.5
    assert s["y"] == 0  # an unlabelled series exists from the start
    g.set(7)
    assert samples(r.render())["y"] == 7
    with pytest.raises(ValueError):
        c.inc(-1, kind="a")
    with pytest.raises(ValueError):
        c.inc(kind="a", extra="b")
    with pytest.raises(ValueError):
        r.counter("x_total", "again")


def test_histogram_buckets_are_cumulative():
    r = Registry()
    h = r.histogram("lat_seconds", "latency", (0.1, 1.0), ("op",))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v, op="v")
    s = samples(r.render())
    assert s['lat_seconds_bucket{op="v",le="0.1"}'] == 2  # le is inclusive
    assert s['lat_seconds_bucket{op="v",le="1"}'] == 3
    assert s['lat_seconds_bucket{op="v",le="+Inf"}'] == 4
    assert s['lat_seconds_count{op="v"}'] == 4 and s['lat_seconds_sum{op="v"}'] == pytest.approx(3.65)


def test_engine_metrics_speculation_counters():
    m = EngineMetrics()
    m.record_verify("int8", 4, 2)
    m.record_verify("int8", 4, 4)
    m.record_verify("ngram", 0, 0)  # nothing drafted: nothing recorded
    s = samples(m.render())
    assert s['spind_draft_tokens_total{drafter="int8"}'] == 8
    assert s['spind_accepted_tokens_total{drafter="int8"}'] == 6
    assert s['spind_accepted_at_position_total{drafter="int8",position="0"}'] == 2
    assert s['spind_accepted_at_position_total{drafter="int8",position="3"}'] == 1
    assert not any("ngram" in k for k in s)


def test_slot_times():
    t = SlotTimes()
    t.record(0.1, 0.001)
    t.record(0.3, 0.003)
    d = t.describe()
    assert d["num_slots"] == 2 and d["mean_slot_ms"] == pytest.approx(200) and d["last_overhead_ms"] == pytest.approx(3)


def test_worker_plan_and_thread_shares():
    cfg = load_config()
    assert worker_names(cfg) == [TARGET_WORKER, "draft"]
    assert threads_for(cfg, "draft", num_cores=2) == 1 and threads_for(cfg, "target", num_cores=16) == 8
    assert threads_for(cfg, "target", num_cores=1) == 1  # never zero
    pinned = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, threads=3))
    assert threads_for(pinned, "draft", num_cores=2) == 3
    ngram_only = dataclasses.replace(cfg, drafters=tuple(d for d in cfg.drafters if d.kind == "ngram"))
    assert worker_names(ngram_only) == [TARGET_WORKER]


def test_visible_len_holds_back_stop_prefixes_and_partial_utf8():
    assert visible_len("hello wor", ("world",)) == len("hello ")
    assert visible_len("hello", ("xyz",)) == 5
    assert visible_len("ab\ufffd", ()) == 2
    assert visible_len("a END", ("END", "E")) == len("a END")  # a whole stop string is cut by Sequence, not here
    assert visible_len("abcab", ("abcabd",)) == 0


def test_static_selector_and_kv_budget():
    sel = StaticSelector("int8")
    reqs = [SelectInput("a", "auto", None), SelectInput("b", "none", None), SelectInput("c", "ngram", None)]
    assert sel.select(reqs) == ["int8", None, "ngram"]
    assert sel.describe()["policy"] == "default"
    b = KVBudget(num_blocks=4, block_size=16)
    assert b.blocks_for(33) == 3 and b.can_reserve(3)
    b.reserve(3)
    assert not b.can_reserve(2)
    b.release(3)
    assert b.can_reserve(4)


def test_capacity_sends_requests_past_a_workers_batch_limit_to_plain_decoding():
    worker_of = {"int8": "draft", "bf16": "draft", "ngram": "target"}
    capacity = {"draft": 2, "target": 16}
    choices = ["int8", "ngram", "bf16", "int8", None, "ngram"]
    assert apply_capacity(choices, worker_of, capacity) == ["int8", "ngram", "bf16", None, None, "ngram"]


def test_worker_capacity_defaults_to_the_runtime_batch_limit():
    cfg = load_config()
    assert cfg.worker_capacity("draft") == cfg.runtime.max_batch_size
    small = dataclasses.replace(cfg, workers=(dataclasses.replace(cfg.worker("draft"), max_batch_size=3),))
    assert small.worker_capacity("draft") == 3
