"""`spind bench serve`: the pure aggregation of per-request records into summary rows, the prompt slices, the
peers' arguments, and the real client code against a fake OpenAI-compatible peer (in process, no daemon)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from aiohttp import web

from spind.bench.cli import daemon_urls, peer_urls, serve_settings
from spind.bench.datasets import Prompt
from spind.bench.serve import (PEER, Level, RequestRecord, ServeSettings, add_identity, add_ratios, check_prompts,
                               compare_table, follows_schema, free_port, load_serve_prompts, median_rows,
                               median_versus, medians_table, percentile, prompt_slices, prompts_needed, render_table,
                               run_serve_bench, summarize, versus_peers, versus_table, wait_for_quiet, cpu_times,
                               busy_tokens_per_s)


def record(ttft_s: float | None, latency_s: float, tokens: int, slots: int = 0, accepted_len: float = 0.0,
           error: str | None = None) -> RequestRecord:
    return RequestRecord(daemon="spind", max_tokens=64, drafter="int8", concurrency=4, index=0, ttft_s=ttft_s,
                         latency_s=latency_s, completion_tokens=tokens, time_slots=slots,
                         mean_accepted_length=accepted_len, error=error)


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
    assert row["prefill_ms_per_slot"] is row["verify_ms_per_slot"] is None  # a daemon that reports no busy time


def test_tokens_per_second_while_every_client_is_busy() -> None:
    """Two clients, four requests: both busy from 0 (the second request sent) to 3 s (the last one sent); after it
    the level drains. Each request's tokens spread over its decoding, first token to last."""
    def sent(at: float, ttft: float | None, latency: float, tokens: int, error: str | None = None) -> RequestRecord:
        return replace(record(ttft, latency, tokens, error=error), sent_s=at, concurrency=2)

    records = [sent(0.0, 1.0, 3.0, 20),  # decodes 1-3 s: all of it inside
               sent(0.0, 0.5, 2.5, 40),  # 0.5-2.5 s: inside
               sent(2.5, 0.5, 4.5, 80),  # 3-7 s: none of it inside (it starts decoding as the window ends)
               sent(3.0, 1.0, 2.0, 10)]  # the last one sent: the window's end; decodes 4-5 s
    assert busy_tokens_per_s(records, 2) == pytest.approx((20 + 40) / 3.0)
    # a request that decodes across the window's end counts the share it decoded inside
    records[2] = sent(2.5, 0.0, 1.0, 80)  # decodes 2.5-3.5 s: half inside
    assert busy_tokens_per_s(records, 2) == pytest.approx((20 + 40 + 40) / 3.0)
    # a failed request is time without tokens; no more requests than clients: no window where clients are replaced
    records[1] = sent(0.0, None, 0.1, 0, error="HTTP 503: overloaded")
    assert busy_tokens_per_s(records, 2) == pytest.approx((20 + 40) / 3.0)
    assert busy_tokens_per_s(records[:2], 2) is None and busy_tokens_per_s(records, 4) is None
    row = summarize(Level("spind", 64, 2, "none"), records, 5.0, {}, {})
    assert row["busy_tokens_per_s"] == pytest.approx(20.0) and row["tokens_per_s"] == pytest.approx(110 / 5.0)


def test_a_slot_s_prefill_and_verify_are_the_workers_busy_time_over_the_level_s_slots() -> None:
    before = {"num_slots": 10, "mean_slot_ms": 20.0, "mean_overhead_ms": 1.0,
              "busy_s": {"prefill": 0.5, "verify": 1.0, "draft": 0.2}}
    after = {"num_slots": 30, "mean_slot_ms": 25.0, "mean_overhead_ms": 1.0,
             "busy_s": {"prefill": 0.7, "verify": 1.3, "draft": 0.2, "precompute": 0.1}}
    row = summarize(Level("spind", 64, 8, "none"), [record(0.1, 1.0, 40, 20, 1.0)], 1.0, before, after)
    assert row["prefill_ms_per_slot"] == pytest.approx(200 / 20) and row["verify_ms_per_slot"] == pytest.approx(15)
    fresh = summarize(Level("spind", 64, 8, "none"), [record(0.1, 1.0, 40, 20, 1.0)], 1.0,
                      {"num_slots": 0}, {"num_slots": 4, "busy_s": {"verify": 0.02}})
    assert fresh["prefill_ms_per_slot"] == 0.0 and fresh["verify_ms_per_slot"] == pytest.approx(5)


def test_structured_output_rows_count_valid_outputs_and_the_grammars_cost_per_token() -> None:
    schema = json.dumps({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    assert follows_schema('{"a": 3}', schema) and not follows_schema('{"a": "x"}', schema)
    assert not follows_schema('{"a": 3', schema) and not follows_schema("", schema)
    records = [record(0.1, 1.0, 10), record(0.1, 1.0, 10), record(0.1, 1.0, 10)]
    records[0].schema_valid, records[1].schema_valid = True, False
    row = summarize(Level("spind", 64, 1, "ngram"), records, 1.0, {"grammar_s": 0.5, "grammar_tokens": 100},
                    {"grammar_s": 0.6, "grammar_tokens": 300})
    assert row["schema_valid"] == "1/2" and row["grammar_ms_per_token"] == pytest.approx(0.5)
    plain = summarize(Level("spind", 64, 1, "ngram"), [record(0.1, 1.0, 10)], 1.0, {}, {})
    assert plain["schema_valid"] is None and plain["grammar_ms_per_token"] is None


def test_summarize_without_successes_or_slots() -> None:
    row = summarize(Level("spind", 64, 1, "none"), [record(None, 1.0, 0, error="boom")], 1.0, {}, {})
    assert row["num_errors"] == 1 and row["tokens_per_s"] == 0.0
    assert row["ttft_p50_ms"] is row["latency_p50_s"] is row["mean_accepted_length"] is row["slot_ms"] is None


def test_ratios_against_none_at_the_same_concurrency() -> None:
    rows = add_ratios([{"drafter": "int8", "concurrency": 1, "tokens_per_s": 30.0, "busy_tokens_per_s": 33.0},
                       {"drafter": "none", "concurrency": 1, "tokens_per_s": 20.0, "busy_tokens_per_s": 30.0},
                       {"drafter": "int8", "concurrency": 4, "tokens_per_s": 50.0},
                       {"drafter": "ngram", "concurrency": 16, "tokens_per_s": 10.0}])
    assert [r["speedup_vs_none"] for r in rows] == [pytest.approx(1.5), 1.0, None, None]
    assert [r["busy_speedup_vs_none"] for r in rows] == [pytest.approx(1.1), 1.0, None, None]


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
    # over --repeats runs: each run's own ratio, then their median (run 2 was slower for both daemons)
    runs = rows + [{**r, "repeat": 1, "tokens_per_s": r["tokens_per_s"] / 2} for r in rows[:1]] + [
        {**rows[1], "repeat": 1, "tokens_per_s": 40.0}]
    table = compare_table(runs, "before", ["after"])
    assert table.splitlines()[-1].split()[:5] == ["after", "48", "none", "16", "1.40"]  # runs: 1.20 and 1.60


def test_daemon_urls_take_labels() -> None:
    assert daemon_urls(None) == {}
    assert daemon_urls(["http://h:1/"]) == {"spind": "http://h:1"}
    assert daemon_urls(["old=http://h:1", "new=http://h:2"]) == {"old": "http://h:1", "new": "http://h:2"}
    with pytest.raises(ValueError, match="twice"):
        daemon_urls(["a=http://h:1", "a=http://h:2"])


def test_requests_per_level() -> None:
    assert [ServeSettings((1, 4, 16), ("none",)).requests_at(c) for c in (1, 4, 16)] == [4, 8, 32]
    assert ServeSettings((16,), ("none",), num_requests=6).requests_at(16) == 6


# ---- arguments -------------------------------------------------------------------------------------------
def test_peer_urls_take_names() -> None:
    assert peer_urls(None, ["spind"]) == {}
    assert peer_urls(["vllm=http://127.0.0.1:8011/", " sglang = https://h:30000"], ["spind"]) == {
        "vllm": "http://127.0.0.1:8011", "sglang": "https://h:30000"}
    with pytest.raises(ValueError, match="twice"):
        peer_urls(["vllm=http://h:1", "vllm=http://h:2"], ["spind"])
    with pytest.raises(ValueError, match="spind daemon's label"):
        peer_urls(["spind=http://h:1"], ["spind"])
    with pytest.raises(ValueError, match="spind daemon's label"):
        peer_urls(["old=http://h:1"], daemon_urls(["old=http://h:2", "new=http://h:3"]))
    for bad in ("http://127.0.0.1:8011", "=http://h:1", "vllm=", "vllm"):
        with pytest.raises(ValueError, match="NAME=URL"):
            peer_urls([bad], ["spind"])
    with pytest.raises(ValueError, match="http:// or https://"):
        peer_urls(["vllm=127.0.0.1:8011"], ["spind"])


def serve_args(**overrides: object) -> argparse.Namespace:
    args = {"concurrency": "1,4", "drafters": "none,int8", "dataset": "mt_bench", "max_tokens": "64",
            "num_requests": None, "ignore_eos": True, "temperature": 0.0, "seed": 0, "repeats": 1, "system_prompt": ""}
    return argparse.Namespace(**(args | overrides))


def test_serve_settings_take_mix_and_reject_repeats() -> None:
    settings = serve_settings(serve_args(dataset="mix", seed=3))
    assert (settings.dataset, settings.seed, settings.concurrency, settings.repeats) == ("mix", 3, (1, 4), 1)
    assert serve_settings(serve_args(repeats=3)).repeats == 3
    assert serve_settings(serve_args(system_prompt="Be brief.")).system_prompt == "Be brief."
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        serve_settings(serve_args(repeats=0))
    with pytest.raises(ValueError, match="unknown dataset"):
        serve_settings(serve_args(dataset="mixed"))
    with pytest.raises(ValueError, match="--concurrency lists a value twice"):
        serve_settings(serve_args(concurrency="4,4"))
    with pytest.raises(ValueError, match="--max-tokens lists a value twice"):
        serve_settings(serve_args(max_tokens="64,64"))
    with pytest.raises(ValueError, match="--peer"):
        serve_settings(serve_args(drafters=f"none,{PEER}"))


# ---- prompts ---------------------------------------------------------------------------------------------
def test_every_level_takes_its_own_prompts() -> None:
    settings = ServeSettings((1, 4), ("none", "int8"), max_tokens=(32, 64))
    slices = prompt_slices(settings)
    assert list(slices) == [(32, 1, 0), (32, 4, 0), (64, 1, 0), (64, 4, 0)]  # run order
    assert [len(r) for r in slices.values()] == [4, 8, 4, 8]
    taken = [i for r in slices.values() for i in r]
    assert sorted(taken) == list(range(1, 25))  # disjoint, consecutive, prompt 0 left to the warm-up
    assert prompts_needed(settings) == 25
    check_prompts(settings, [Prompt("t", str(i), True) for i in range(25)])
    with pytest.raises(ValueError, match="needs 25 prompts and --dataset mt_bench has 24"):
        check_prompts(settings, [Prompt("t", str(i), True) for i in range(24)])
    # --repeats: each run of a level its own prompts, the runs of a level one after another
    twice = prompt_slices(ServeSettings((1, 4), ("none",), max_tokens=(32,), repeats=2))
    assert {k: (v.start, v.stop) for k, v in twice.items()} == {
        (32, 1, 0): (1, 5), (32, 1, 1): (5, 9), (32, 4, 0): (9, 17), (32, 4, 1): (17, 25)}


def write_datasets(root: Path, num: int) -> Path:
    """Tiny stand-ins for the shared datasets files that mt_bench and mix read."""
    (root / "mt_bench").mkdir(parents=True)
    (root / "mt_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"mt {i}"]}) + "\n"
                for i in range(num)))
    (root / "alpaca").mkdir()
    (root / "alpaca" / "alpaca_5000.json").write_text(json.dumps([{"instruction": f"al {i}", "input": ""}
                                                                   for i in range(num)]))
    (root / "chatgpt_prompts").mkdir()
    (root / "chatgpt_prompts" / "prompts.csv").write_text(
        "act,prompt,type\n" + "".join(f"role {i},cp {i},TEXT\n" for i in range(num)))
    (root / "alpaca_eval").mkdir()
    (root / "alpaca_eval" / "text_davinci_003_model_outputs.json").write_text(
        json.dumps([{"output": f"passage {i} " + "x" * 700} for i in range(num)]))
    return root


def test_load_serve_prompts_mix_and_named(tmp_path: Path) -> None:
    root = write_datasets(tmp_path, 10)
    settings = ServeSettings((1, 4), ("none",), dataset="mix", max_tokens=(16,))  # 4 + 8 + 1 = 13 prompts
    prompts = load_serve_prompts(settings, root)
    assert len(prompts) == 13 and len({p.text for p in prompts}) == 13
    assert {p.dataset for p in prompts} == {"alpaca", "cp", "passage"}
    assert load_serve_prompts(settings, root) == prompts  # the seed decides
    assert load_serve_prompts(replace(settings, seed=1), root) != prompts
    with pytest.raises(ValueError, match="needs 13 prompts and --dataset mt_bench has 10"):
        load_serve_prompts(replace(settings, dataset="mt_bench"), root)
    named = load_serve_prompts(replace(settings, dataset="mt_bench", concurrency=(1,)), root)
    assert [p.text for p in named] == [f"mt {i}" for i in (0, 2, 4, 6, 8)]  # evenly spread, as before
    with pytest.raises(ValueError, match="needs 31 prompts and --dataset mix has 30"):
        load_serve_prompts(replace(settings, concurrency=(1, 4, 9)), root)


# ---- peers' rows, identity, spind vs peers ---------------------------------------------------------------
def test_summarize_a_peer_level() -> None:
    records = [RequestRecord(daemon="vllm", max_tokens=64, drafter=PEER, concurrency=2, index=i, ttft_s=0.1 * (i + 1),
                             latency_s=1.0 + i, completion_tokens=64) for i in range(4)]
    row = summarize(Level("vllm", 64, 2, PEER), records, 4.0, {}, {})
    assert (row["daemon"], row["drafter"], row["num_errors"], row["completion_tokens"]) == ("vllm", PEER, 0, 256)
    assert row["tokens_per_s"] == pytest.approx(64.0)
    assert row["ttft_p50_ms"] == pytest.approx(250.0) and row["ttft_p90_ms"] == pytest.approx(370.0)
    assert row["latency_p50_s"] == pytest.approx(2.5) and row["latency_p90_s"] == pytest.approx(3.7)
    assert row["mean_accepted_length"] is row["slot_ms"] is row["overhead_ms_per_slot"] is None
    assert row["num_slots"] == 0
    assert add_ratios([row])[0]["speedup_vs_none"] is None


def test_identity_against_none_per_prompt_and_level() -> None:
    def rec(daemon: str, drafter: str, conc: int, index: int, output: str, error: str | None = None) -> RequestRecord:
        return RequestRecord(daemon=daemon, max_tokens=64, drafter=drafter, concurrency=conc, index=index, ttft_s=0.1,
                             latency_s=1.0, completion_tokens=8, error=error, output=output)

    records = [rec("spind", "none", 4, 0, "a"), rec("spind", "none", 4, 1, "b"), rec("spind", "none", 4, 2, "", "x"),
               rec("spind", "int8", 4, 0, "a"), rec("spind", "int8", 4, 1, "B"), rec("spind", "int8", 4, 2, "c"),
               rec("spind", "auto", 4, 0, "a"), rec("spind", "auto", 4, 1, "", "HTTP 503"),
               rec("spind", "auto", 4, 2, "c"),
               rec("spind", "none", 1, 0, "z"), rec("spind", "int8", 1, 0, "z"),  # index 0 of another level
               rec("vllm", PEER, 4, 0, "a"), rec("other", "int8", 4, 0, "a")]
    cells = [("spind", "none", 4), ("spind", "int8", 4), ("spind", "auto", 4), ("spind", "none", 1),
             ("spind", "int8", 1), ("vllm", PEER, 4), ("other", "int8", 4)]

    def rows() -> list[dict]:
        return [{"daemon": d, "max_tokens": 64, "drafter": dr, "concurrency": c} for d, dr, c in cells]

    same = [r["same_as_none"] for r in add_identity(rows(), records, 0.0)]
    # int8 differs on prompt 1, prompt 2 is not compared (none failed); auto failed prompt 1; "other" has no none
    assert same == [None, "1/2", "1/1", None, "1/1", None, None]
    assert all(r["same_as_none"] is None for r in add_identity(rows(), records, 0.7))  # samples differ by design


def spind_vs_peers_rows() -> list[dict]:
    def row(daemon: str, drafter: str, conc: int, tps: float) -> dict:
        return {"daemon": daemon, "max_tokens": 64, "drafter": drafter, "concurrency": conc, "tokens_per_s": tps}

    return [row("spind", "none", 1, 10.0), row("spind", "int8", 1, 15.0), row("spind", "ngram", 1, 12.0),
            row("vllm", PEER, 1, 20.0), row("sglang", PEER, 1, 5.0),
            row("spind", "none", 4, 30.0), row("spind", "int8", 4, 25.0), row("vllm", PEER, 4, 0.0)]


def test_versus_peers_ratios() -> None:
    out = versus_peers(spind_vs_peers_rows())
    assert [(e["concurrency"], e["peer"], e["best_drafter"]) for e in out] == [
        (1, "vllm", "int8"), (1, "sglang", "int8"), (4, "vllm", "none"), (4, "sglang", "none")]
    assert (out[0]["none_over_peer"], out[0]["best_over_peer"]) == (pytest.approx(0.5), pytest.approx(0.75))
    assert (out[1]["none_over_peer"], out[1]["best_over_peer"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert out[2]["peer_tokens_per_s"] == 0.0 and out[2]["none_over_peer"] is out[2]["best_over_peer"] is None
    assert out[3]["peer_tokens_per_s"] is None and out[3]["best_tokens_per_s"] == 30.0  # sglang missed c=4
    assert versus_peers([r for r in spind_vs_peers_rows() if r["drafter"] != PEER]) == []


def test_render_table_adds_spind_vs_peers() -> None:
    rows = [{**summarize(Level(r["daemon"], 64, r["concurrency"], r["drafter"]), [], 1.0, {}, {}), **r}
            for r in spind_vs_peers_rows()]
    rows = add_identity(add_ratios(rows), [], 0.0)
    results = {"settings": asdict(ServeSettings((1, 4), ("none", "int8", "ngram"), dataset="mix", seed=2)),
               "daemons": {"spind": "http://h:1"}, "rows": rows, "versus_peers": versus_peers(rows)}
    text = render_table(results)
    main, versus = text.split("\n\n")
    assert main.startswith("Serving: mix (seed 2) prompts")
    assert "lat p90 s" in main.splitlines()[1] and main.splitlines()[1].endswith("= none")
    lines = versus.splitlines()
    assert lines[0].startswith("spind vs peers")
    assert lines[1].split() == ["spind", "max", "tok", "conc", "none", "tok/s", "best", "best", "tok/s", "vllm",
                                "tok/s", "none/vllm", "best/vllm", "sglang", "tok/s", "none/sglang", "best/sglang"]
    assert lines[3].split() == ["spind", "64", "1", "10.0", "int8", "15.0", "20.0", "0.50", "0.75", "5.0", "2.00",
                                "3.00"]
    assert lines[4].split() == ["spind", "64", "4", "30.0", "none", "30.0", "0.0", "-", "-", "-", "-", "-"]


def test_medians_take_each_runs_own_ratio() -> None:
    """Over --repeats runs a row reads its median tokens/s and the median of its runs' own x none: in a VM whose
    speed drifts between runs, auto/none of the same run is what compares like with like (here the runs' medians
    of tokens/s would say 40/40 = 1.00, while auto was ahead in two runs of three)."""
    def row(drafter: str, rep: int, tps: float, same: str | None = None) -> dict:
        return {"daemon": "spind", "max_tokens": 96, "concurrency": 4, "drafter": drafter, "repeat": rep,
                "num_requests": 8, "num_errors": 0, "tokens_per_s": tps, "busy_tokens_per_s": tps + 10.0,
                "ttft_p50_ms": 100.0 + rep,
                "latency_p50_s": 1.0, "mean_accepted_length": 1.0, "slot_ms": 10.0, "overhead_ms_per_slot": 0.5,
                "same_as_none": same}

    rows = add_ratios([row("none", 0, 50.0), row("auto", 0, 55.0, "8/8"), row("none", 1, 40.0),
                       row("auto", 1, 30.0, "8/8"), row("none", 2, 30.0), row("auto", 2, 40.0, "7/8")])
    none, auto = median_rows(rows)
    assert (none["drafter"], none["runs"], none["tokens_per_s"], none["speedup_vs_none"]) == ("none", 3, 40.0, 1.0)
    assert (auto["tokens_per_s"], auto["tokens_per_s_min"], auto["tokens_per_s_max"]) == (40.0, 30.0, 55.0)
    assert auto["speedup_vs_none"] == pytest.approx(1.1)  # runs: 1.10, 0.75, 1.33
    assert (auto["speedup_vs_none_min"], auto["speedup_vs_none_max"]) == (pytest.approx(0.75), pytest.approx(4 / 3))
    assert auto["busy_speedup_vs_none"] == pytest.approx(65 / 60)  # runs: 65/60, 40/50, 50/40
    assert (auto["busy_speedup_vs_none_min"], auto["busy_speedup_vs_none_max"]) == (0.8, 1.25)
    assert auto["same_as_none"] == "23/24" and auto["num_requests"] == 24 and auto["ttft_p50_ms"] == 101.0
    table = medians_table([none, auto], 3)
    assert table.startswith("Medians over 3 runs")
    assert table.splitlines()[-1].split() == ["spind", "96", "auto", "4", "3", "0", "101", "40.0", "30.0-55.0",
                                              "1.00", "1.10", "0.75-1.33", "1.08", "0.80-1.25", "23/24"]


def test_versus_peers_over_runs_takes_each_runs_ratio() -> None:
    def row(daemon: str, drafter: str, rep: int, tps: float) -> dict:
        return {"daemon": daemon, "max_tokens": 64, "drafter": drafter, "concurrency": 1, "repeat": rep,
                "tokens_per_s": tps}

    runs = [row("spind", "none", 0, 10.0), row("spind", "auto", 0, 12.0), row("vllm", PEER, 0, 8.0),
            row("spind", "none", 1, 20.0), row("spind", "auto", 1, 18.0), row("vllm", PEER, 1, 25.0),
            row("spind", "none", 2, 15.0), row("spind", "auto", 2, 16.0), row("vllm", PEER, 2, 15.0)]
    per_run = versus_peers(runs)
    assert [(e["repeat"], e["best_drafter"], e["none_over_peer"]) for e in per_run] == [
        (0, "auto", pytest.approx(1.25)), (1, "none", pytest.approx(0.8)), (2, "auto", pytest.approx(1.0))]
    (m,) = median_versus(per_run)
    assert (m["runs"], m["best_drafter"], m["none_tokens_per_s"], m["peer_tokens_per_s"]) == (3, "auto", 15.0, 15.0)
    assert (m["none_over_peer"], m["none_over_peer_min"], m["none_over_peer_max"]) == (
        pytest.approx(1.0), pytest.approx(0.8), pytest.approx(1.25))
    assert m["best_over_peer"] == pytest.approx(16 / 15)  # runs: 1.5, 0.8, 1.07
    assert "1.00 (0.80-1.25)" in versus_table([m])


# ---- the real clients against a fake peer ----------------------------------------------------------------
class FakePeer:
    """An OpenAI-compatible streaming server that is not spind: /v1/models and the completion routes only, vLLM's
    habits (an empty first chat delta, a usage chunk with no choices, HTTP 400 for a model it does not serve)."""

    def __init__(self, models: list[str]) -> None:
        self.models = models
        self.paths: list[str] = []
        self.bodies: list[dict] = []

    def app(self) -> web.Application:
        @web.middleware
        async def log(request: web.Request, handler):  # type: ignore[no-untyped-def]
            self.paths.append(request.path)
            return await handler(request)

        app = web.Application(middlewares=[log])
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    def refuses(self, body: dict) -> bool:
        return body.get("model") not in self.models or "spind" in body

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.refuses(body):
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                                     status=400)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "REJECT" in prompt:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(chunk: dict) -> None:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
        for i in range(body["max_tokens"]):
            await send({"choices": [{"index": 0, "delta": {"content": f"w{i} "}} if chat else
                                    {"index": 0, "text": f"w{i} "}], "usage": None})
        if "NOUSAGE" not in prompt and body["stream_options"]["include_usage"]:
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
            if chat and body["messages"][0]["role"] == "system":  # a server that caches the shared system turn
                usage["prompt_tokens_details"] = {"cached_tokens": 2}
            await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def test_a_peer_end_to_end_through_the_real_clients() -> None:
    # levels: prompts 1-3, 4-6
    settings = ServeSettings((1, 2), ("none", "int8"), num_requests=3, max_tokens=(5,), quiet_timeout_s=0)
    prompts = [Prompt("t", f"prompt {i}" + (" REJECT" if i == 2 else " NOUSAGE" if i == 5 else ""), i % 2 == 0)
               for i in range(prompts_needed(settings))]
    fake = FakePeer(["smol", "other"])

    async def main() -> dict:
        async with serving(fake.app()) as url:
            return await run_serve_bench({}, prompts, settings, peers={"fake": url})

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert results["models"] == {"fake": "smol"} and results["peers"]["fake"].startswith("http://127.0.0.1:")
    assert "/v1/spind/state" not in fake.paths and fake.paths[0] == "/v1/models"
    assert all(b["model"] == "smol" and "spind" not in b and b["stream"] and b["ignore_eos"]
               and b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    # every prompt once in the run: the warm-up's (4 tokens), then each level its own, once per peer
    sent = [b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in fake.bodies]
    assert sorted(sent) == sorted(p.text for p in prompts) and fake.bodies[0]["max_tokens"] == 4
    assert [(r["daemon"], r["drafter"], r["concurrency"], r["num_requests"], r["num_errors"], r["completion_tokens"])
            for r in results["rows"]] == [("fake", PEER, 1, 3, 1, 10), ("fake", PEER, 2, 3, 1, 10)]
    assert all(r["same_as_none"] is None and r["slot_ms"] is None for r in results["rows"])
    assert results["versus_peers"] == []
    by_prompt = {prompts[1 + 3 * (r["concurrency"] == 2) + r["index"]].text: r for r in results["requests"]}
    assert by_prompt["prompt 2 REJECT"]["error"].startswith("HTTP 400: ") and "too long" in by_prompt[
        "prompt 2 REJECT"]["error"]
    assert by_prompt["prompt 5 NOUSAGE"]["error"] == "the stream ended without a usage chunk"
    ok = [r for r in results["requests"] if r["error"] is None]
    assert len(ok) == 4 and all(r["output"] == "w0 w1 w2 w3 w4 " and r["completion_tokens"] == 5
                                and 0 < r["ttft_s"] <= r["latency_s"] for r in ok)
    # each request's send time in its level: a client sends its next request once its last one ended, so one client's
    # follow one another, and of two clients' the third goes once the first of the first two ended
    for c in (1, 2):
        reqs = sorted((r for r in results["requests"] if r["concurrency"] == c), key=lambda r: r["sent_s"])
        assert reqs[c]["sent_s"] >= min(r["sent_s"] + r["latency_s"] for r in reqs[:c])
    assert all(r["busy_tokens_per_s"] is not None and r["busy_tokens_per_s"] > 0 for r in results["rows"])
    assert "fake" in render_table(results)


class FakeSpind(FakePeer):
    """The routes of a spind daemon that the bench uses: its state, the drafters' cache reset (absent in a release
    before it), and completions that name a drafter."""

    def __init__(self, can_reset: bool) -> None:
        super().__init__(["spind"])
        self.can_reset = can_reset
        self.resets = 0
        self.sent: list[tuple[int, str, str]] = []  # per completion: (resets so far, drafter, prompt)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/v1/spind/state", self.state)
        if self.can_reset:
            app.router.add_post("/v1/spind/reset_cache", self.reset)
        return app

    async def state(self, request: web.Request) -> web.Response:
        return web.Response(text=(Path(__file__).parent / "data" / "idle.json").read_text(),
                            content_type="application/json")

    async def reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.json_response({"status": "ok"})

    def refuses(self, body: dict) -> bool:
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        self.sent.append((self.resets, body["spind"]["drafter"], text))
        return "model" in body


@pytest.mark.parametrize("can_reset", [True, False])
def test_each_spind_row_starts_with_the_drafters_caches_emptied(can_reset: bool,
                                                                capsys: pytest.CaptureFixture) -> None:
    """Within a level every drafter gets the same prompts, and suffix decoding keeps finished requests' answers:
    the bench empties the caches before each spind row, so no row drafts an earlier row's answer to its prompt. A
    daemon without the reset is benched anyway, with a warning."""
    settings = ServeSettings((1, 2), ("none", "auto"), num_requests=2, max_tokens=(3,), quiet_timeout_s=0)
    prompts = [Prompt("t", f"prompt {i}", i % 2 == 0) for i in range(prompts_needed(settings))]
    fake = FakeSpind(can_reset)

    async def main() -> dict:
        async with serving(fake.app()) as url:
            return await run_serve_bench({"s": url}, prompts, settings)

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert results["cache_reset"] == {"s": can_reset}
    assert all(r["num_errors"] == 0 for r in results["rows"])
    timed = fake.sent[len(settings.drafters):]  # after the warm-up requests; rows run one after another
    rows = [timed[i:i + 2] for i in range(0, len(timed), 2)]
    assert [(sorted(p for _, _, p in row), {d for _, d, _ in row}) for row in rows] == [
        (["prompt 1", "prompt 2"], {"none"}), (["prompt 1", "prompt 2"], {"auto"}),
        (["prompt 3", "prompt 4"], {"none"}), (["prompt 3", "prompt 4"], {"auto"})]
    if can_reset:  # the probe, then one reset before each row
        assert [{n for n, _, _ in row} for row in rows] == [{2}, {3}, {4}, {5}]
        assert "warning" not in capsys.readouterr().err
    else:
        assert fake.resets == 0 and "daemon s cannot reset its drafters' caches" in capsys.readouterr().err


@pytest.mark.parametrize("models", [[], None])
def test_a_peer_that_serves_no_model_or_is_not_there(models: list[str] | None) -> None:
    settings = ServeSettings((1,), ("none",), num_requests=1, quiet_timeout_s=0)
    prompts = [Prompt("t", "hi", True)] * prompts_needed(settings)

    async def main() -> dict:
        if models is None:
            return await run_serve_bench({}, prompts, settings, peers={"gone": f"http://127.0.0.1:{free_port()}"})
        async with serving(FakePeer(models).app()) as url:
            return await run_serve_bench({}, prompts, settings, peers={"empty": url})

    with pytest.raises(ValueError, match="peer gone: nothing answers" if models is None else
                       "peer empty lists no model"):
        asyncio.run(asyncio.wait_for(main(), 60))


def test_repeated_runs_end_to_end_each_on_its_own_prompts() -> None:
    """--repeats 2 against a spind daemon and a peer: each run of the level sends its own prompts to every row (so
    a caching peer never sees one twice), and the results add the medians over the runs and the peer comparison
    taken within each run."""
    settings = ServeSettings((1,), ("none", "auto"), num_requests=2, max_tokens=(3,), repeats=2, quiet_timeout_s=0)
    prompts = [Prompt("t", f"prompt {i}", True) for i in range(prompts_needed(settings))]
    spind, peer = FakeSpind(can_reset=True), FakePeer(["smol"])

    async def main() -> dict:
        async with serving(spind.app()) as spind_url, serving(peer.app()) as peer_url:
            return await run_serve_bench({"s": spind_url}, prompts, settings, peers={"vllm": peer_url})

    results = asyncio.run(asyncio.wait_for(main(), 60))
    # run 2 takes the rows in reverse order: over the two runs each row ran first once and last once
    assert [(r["daemon"], r["drafter"], r["repeat"]) for r in results["rows"]] == [
        ("s", "none", 0), ("s", "auto", 0), ("vllm", PEER, 0), ("vllm", PEER, 1), ("s", "auto", 1), ("s", "none", 1)]
    timed = spind.sent[len(settings.drafters):]
    assert sorted(p for _, _, p in timed[:4]) == ["prompt 1", "prompt 1", "prompt 2", "prompt 2"]  # run 1
    assert [d for _, d, _ in timed[:4]] == ["none", "none", "auto", "auto"]
    assert sorted(p for _, _, p in timed[4:]) == ["prompt 3", "prompt 3", "prompt 4", "prompt 4"]  # its own prompts
    assert [d for _, d, _ in timed[4:]] == ["auto", "auto", "none", "none"]
    peer_sent = sorted(b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in peer.bodies[1:])
    assert peer_sent == ["prompt 1", "prompt 2", "prompt 3", "prompt 4"]
    medians = {(m["daemon"], m["drafter"]): m for m in results["medians"]}
    assert set(medians) == {("s", "none"), ("s", "auto"), ("vllm", PEER)}
    assert medians[("s", "auto")]["runs"] == 2 and medians[("s", "auto")]["same_as_none"] == "4/4"
    (versus,) = results["versus_medians"]
    assert (versus["peer"], versus["runs"]) == ("vllm", 2) and len(results["versus_peers"]) == 2
    text = render_table(results)
    assert "Medians over 2 runs" in text and "spind vs peers" in text


def test_a_row_starts_once_the_machine_is_quiet() -> None:
    """A server keeps a core busy for a while after its last request (vLLM's CPU build: ~1-1.5 s): the next row
    waits for a window in which the CPUs are busy under QUIET_BUSY, at most the timeout; no /proc/stat, no wait."""
    def sampler(shares: list[float]):
        state = {"busy": 0, "total": 0, "i": 0}

        def sample() -> tuple[int, int]:
            if state["i"]:
                share = shares[min(state["i"] - 1, len(shares) - 1)]
                state["busy"] += int(100 * share)
                state["total"] += 100
            state["i"] += 1
            return state["busy"], state["total"]
        return sample, state

    sample, state = sampler([0.5, 0.5, 0.05])
    waited = asyncio.run(wait_for_quiet(10.0, sample, window_s=0.01))
    assert state["i"] == 4 and 0.03 <= waited < 5  # two busy windows, then a quiet one
    sample, state = sampler([0.9])
    assert 0.05 <= asyncio.run(wait_for_quiet(0.05, sample, window_s=0.01)) < 5  # never quiet: the timeout
    assert asyncio.run(wait_for_quiet(10.0, lambda: None, window_s=0.01)) < 0.01
    sample, state = sampler([0.9])
    assert asyncio.run(wait_for_quiet(0.0, sample, window_s=0.01)) < 0.01 and state["i"] == 1  # 0: no wait
    assert cpu_times() is None or cpu_times()[1] > 0


def test_a_system_prompt_goes_before_every_chat_prompt_and_the_cached_share_is_read_from_usage() -> None:
    settings = ServeSettings((2,), ("none",), num_requests=4, max_tokens=(3,), quiet_timeout_s=0,
                             system_prompt="You are terse.")
    prompts = [Prompt("t", f"prompt {i}", i != 3) for i in range(prompts_needed(settings))]  # one raw completion

    async def main() -> dict:
        async with serving(FakePeer(["smol"]).app()) as url:
            return await run_serve_bench({}, prompts, settings, peers={"fake": url})

    results = asyncio.run(asyncio.wait_for(main(), 60))
    chats = [r for r in results["requests"] if r["index"] >= 0 and prompts[1 + r["index"]].is_chat]
    assert len(chats) == 3 and all(r["cached_tokens"] == 2 and r["prompt_tokens"] == 3 for r in chats)
    raw = [r for r in results["requests"] if r["index"] >= 0 and not prompts[1 + r["index"]].is_chat]
    assert [r["cached_tokens"] for r in raw] == [None]  # the server said nothing: not counted as 0
    assert results["rows"][0]["cached_share"] == pytest.approx(2 / 3)
    assert "cached %" in render_table(results) and "66.7" in render_table(results)


def test_no_cached_share_where_no_server_reports_it() -> None:
    rows = summarize(Level("vllm", 64, 1, PEER), [record(0.1, 1.0, 8)], 1.0, {}, {})
    assert rows["cached_share"] is None
