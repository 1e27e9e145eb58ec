"""`spind bench serve`: the pure aggregation of per-request records into summary rows (no daemon)."""

from __future__ import annotations

import pytest

from spind.bench.cli import daemon_urls
from spind.bench.serve import (Level, RequestRecord, ServeSettings, add_ratios, compare_table, percentile,
                               summarize)


def record(ttft_s: float | None, latency_s: float, tokens: int, slots: int = 0, accepted_len: float = 0.0,
           error: str | None = None) -> RequestRecord:
    return RequestRecord("spind", 64, "int8", 4, 0, ttft_s, latency_s, tokens, slots, accepted_len, error)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5  # the median of an even count
    assert percentile([float(i) for i in range(1, 11)], 0.9) == pytest.approx(9.1)


def test_summarize_one_level() -> None:
    records = [record(0.1, 1.0, 40, 10, 4.0), record(0.3, 2.0, 40, 20, 2.5), record(0.2, 4.0, 20, 10, 1.0),
               record(None, 0.5, 0, error="HTTP 503: overloaded")]
    before = {"num_slots": 100, "mean_slot_ms": 50.0, "mean_overhead_ms": 1.0}
    after = {"num_slots": 140, "mean_slot_ms": 60.0, "mean_overhead_ms": 0.75}
    row = summarize(Level("spind", 64, 4, "int8"), records, 5.0, before, after)
    assert (row["daemon"], row["max_tokens"], row["drafter"], row["concurrency"]) == ("spind", 64, "int8", 4)
    assert (row["num_requests"], row["num_errors"], row["completion_tokens"]) == (4, 1, 100)
    assert row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["ttft_p90_ms"] == pytest.approx(280.0)
    assert row["latency_p50_s"] == pytest.approx(2.0)
    assert row["tokens_per_s"] == pytest.approx(20.0)  # 100 tokens over the level's 5 s wall time
    assert row["request_tokens_per_s_p50"] == pytest.approx(20.0)  # median of 40, 20, 5
    assert row["mean_accepted_length"] == pytest.approx((40 + 50 + 10) / 40)  # weighted by time slots
    assert row["num_slots"] == 40
    assert row["slot_ms"] == pytest.approx((140 * 60.0 - 100 * 50.0) / 40)
    assert row["overhead_ms_per_slot"] == pytest.approx((140 * 0.75 - 100 * 1.0) / 40)


def test_summarize_without_successes_or_slots() -> None:
    row = summarize(Level("spind", 64, 1, "none"), [record(None, 1.0, 0, error="boom")], 1.0, {}, {})
    assert row["num_errors"] == 1 and row["tokens_per_s"] == 0.0
    assert row["ttft_p50_ms"] is row["latency_p50_s"] is row["mean_accepted_length"] is row["slot_ms"] is None


def test_ratios_against_none_at_the_same_concurrency() -> None:
    rows = add_ratios([{"drafter": "int8", "concurrency": 1, "tokens_per_s": 30.0},
                       {"drafter": "none", "concurrency": 1, "tokens_per_s": 20.0},
                       {"drafter": "int8", "concurrency": 4, "tokens_per_s": 50.0},
                       {"drafter": "ngram", "concurrency": 16, "tokens_per_s": 10.0}])
    assert [r["speedup_vs_none"] for r in rows] == [pytest.approx(1.5), 1.0, None, None]


def test_ratios_stay_within_one_daemon_and_output_length() -> None:
    rows = add_ratios([{"daemon": "a", "max_tokens": 48, "drafter": "none", "concurrency": 1, "tokens_per_s": 10.0},
                       {"daemon": "b", "max_tokens": 48, "drafter": "none", "concurrency": 1, "tokens_per_s": 20.0},
                       {"daemon": "b", "max_tokens": 48, "drafter": "int8", "concurrency": 1, "tokens_per_s": 30.0},
                       {"daemon": "b", "max_tokens": 512, "drafter": "int8", "concurrency": 1, "tokens_per_s": 30.0}])
    assert [r["speedup_vs_none"] for r in rows] == [1.0, 1.0, pytest.approx(1.5), None]


def test_daemons_compare_level_by_level() -> None:
    row = {"max_tokens": 48, "drafter": "none", "concurrency": 16, "ttft_p50_ms": 400.0, "slot_ms": 100.0,
           "overhead_ms_per_slot": 1.0, "tokens_per_s": 50.0}
    rows = [{**row, "daemon": "before"}, {**row, "daemon": "after", "tokens_per_s": 60.0, "ttft_p50_ms": 200.0}]
    table = compare_table(rows, "before", ["after"])
    assert table.splitlines()[-1].split() == ["after", "48", "none", "16", "1.20", "0.50", "1.00", "1.00"]


def test_daemon_urls_take_labels() -> None:
    assert daemon_urls(None) == {}
    assert daemon_urls(["http://h:1/"]) == {"spind": "http://h:1"}
    assert daemon_urls(["old=http://h:1", "new=http://h:2"]) == {"old": "http://h:1", "new": "http://h:2"}
    with pytest.raises(ValueError, match="twice"):
        daemon_urls(["a=http://h:1", "a=http://h:2"])


def test_requests_per_level() -> None:
    assert [ServeSettings((1, 4, 16), ("none",)).requests_at(c) for c in (1, 4, 16)] == [4, 8, 32]
    assert ServeSettings((16,), ("none",), num_requests=6).requests_at(16) == 6
