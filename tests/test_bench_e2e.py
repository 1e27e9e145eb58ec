"""`spind bench e2e`: its pure parts, and a tiny real run (a prompt file the test writes; no ../shared)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import os

import pytest

from daemon_util import child_pids
from prompts import write_prompt_file
from spind.bench.datasets import WorkloadFormatError, read_prompt_file, sample_workload
from spind.bench import e2e
from spind.bench.e2e import (E2ESettings, RefusedSystem, RequestRecord, SlotAccount, arrivals, best_arms,
                             drafter_shares, first_row, parse_system, spind_config, round_order, round_ratios,
                             run_repeats)
from spind.cli import main
from spind.bench.report import Progress
from spind.config import load_config
from spind.coordinator.interface import Delta, Usage
from spind.coordinator.selection.protocol import Arm
from spind.policy import Policy


def test_systems_parse_and_unknown_ones_are_refused():
    cfg = load_config()
    spin = parse_system("spin", cfg)
    assert (str(spin.policy), spin.pipeline, spin.attention) == ("lbss", True, None) and "int8" in spin.drafters
    fixed = parse_system("fixed:int8", cfg)
    assert (fixed.policy, fixed.drafters, fixed.pipeline, fixed.attention) == \
        (Policy("fixed", "int8"), ("int8",), False, None)
    assert parse_system("spin-nobatch-nopipe", cfg).attention == "padded"
    # the systems a user chooses between run the attention the daemon serves; only the ablation swaps it
    for name in ("none", "spin", "fixed:int8"):
        assert spind_config(cfg, parse_system(name, cfg), 4).runtime.attention == cfg.runtime.attention == "invariant"
    assert spind_config(cfg, parse_system("spin-nobatch-nopipe", cfg), 4).runtime.attention == "padded"
    assert parse_system("hf-assisted:bf16", cfg).hf_drafter == "bf16"
    for bad in ("fast", "fixed:nope", "fixed:int8@2", "fixed:", "hf-assisted:nope"):
        with pytest.raises(RefusedSystem):
            parse_system(bad, cfg)


def test_a_system_with_settings_is_a_row_of_its_own_and_a_wrong_setting_is_refused():
    cfg = load_config()
    spec = parse_system("spin/selection.price_margin=0.1/runtime.adaptive_threads=false", cfg)
    assert (spec.name, str(spec.policy), spec.pipeline) == \
        ("spin/selection.price_margin=0.1/runtime.adaptive_threads=false", "lbss", True)
    run = spind_config(cfg, spec, 4)
    assert (run.selection.price_margin, run.runtime.adaptive_threads, run.selection.policy, run.speculation.k) == \
        (0.1, False, "lbss", 4)
    assert spind_config(cfg, parse_system("spin", cfg), 4).selection.price_margin == cfg.selection.price_margin
    deep = spind_config(cfg, parse_system("spin/drafters.suffix.max_depth=24/drafters.suffix.factor=2.0", cfg), 4)
    suffix = {d.name: d for d in deep.drafters}["suffix"]
    assert (suffix.max_depth, suffix.factor) == (24, 2.0)  # a drafter's settings; the others' stay as configured
    assert [d for d in deep.drafters if d.name != "suffix"] == [d for d in cfg.drafters if d.name != "suffix"]
    fixed = spind_config(cfg, parse_system("fixed:ngram/runtime.kv_cache_dtype=float32", cfg), 4)
    assert (fixed.runtime.kv_cache_dtype, fixed.selection.policy) == ("float32", "fixed:ngram")  # a bare string
    refused = {"spin/selection.price_margin=x": "must be float", "spin/price_margin=0.1": "SECTION.KEY=VALUE",
               "spin/selection.policy=none": "set by the system", "spin/speculation.k=2": "set by the system",
               "spin/selection.nope=1": "unknown key", "spin/nosec.a=1": "no section", "spin/selection.alpha=-1":
               "alpha >= 0", "hf-plain/selection.alpha=1": "only spind systems", "fast/selection.alpha=1": "unknown",
               "spin/drafters.nope.max_depth=8": "no drafter 'nope'", "spin/drafters.suffix.max_depth=0":
               "max_depth >= 1", "spin/drafters.suffix.nope=1": "unknown key", "spin/drafters.suffix=1":
               "drafters.NAME.KEY=VALUE", "spin/drafters.suffix.max_depth=x": "must be int"}
    for name, why in refused.items():
        with pytest.raises(RefusedSystem, match=why):
            parse_system(name, cfg)


def test_another_engine_of_a_system_is_a_row_of_its_own():
    cfg = load_config()
    copy = parse_system("none#2", cfg)
    assert copy == dataclasses.replace(parse_system("none", cfg), name="none#2")
    assert spind_config(cfg, copy, 4) == spind_config(cfg, parse_system("none", cfg), 4)
    spin = parse_system("spin/selection.price_margin=0.1#3", cfg)
    assert (spin.name, spin.settings) == ("spin/selection.price_margin=0.1#3", (("selection", "price_margin", 0.1),))
    for bad in ("none#", "none#0", "none#x", "#2", "hf-plain#2", "oracle#2", "fast#2"):
        with pytest.raises(RefusedSystem):
            parse_system(bad, cfg)


def test_open_loop_arrivals_are_poisson_and_seeded():
    assert arrivals(3, None, 0) == [0.0, 0.0, 0.0]
    a = arrivals(2000, 4.0, 7)
    assert a == arrivals(2000, 4.0, 7) and a != arrivals(2000, 4.0, 8)
    assert all(x < y for x, y in zip(a, a[1:])) and 2000 / a[-1] == pytest.approx(4.0, rel=0.1)


def test_the_oracle_learns_each_requests_best_fixed_drafter():
    def rec(i, tokens, latency):
        return RequestRecord(i, "", 5, list(range(tokens)), latency_s=latency)

    results = {"none": [rec(0, 10, 2.0), rec(1, 10, 2.0)], "fixed:ngram": [rec(0, 10, 1.0), rec(1, 10, 4.0)],
               "fixed:int8": [rec(0, 10, 1.5), rec(1, 10, 1.0)], "spin": [rec(0, 10, 0.1), rec(1, 10, 0.1)],
               "fixed:ngram/runtime.kv_cache_dtype=float32": [rec(0, 10, 0.1), rec(1, 10, 0.1)],
               "fixed:ngram#2": [rec(0, 10, 0.1), rec(1, 10, 0.1)]}
    # spin's runs are not candidates, nor a fixed drafter's with settings of its own, nor another engine of one
    assert best_arms(results, 4) == {0: Arm("ngram", 4), 1: Arm("int8", 4)}


def test_drafter_shares_count_slots():
    r = RequestRecord(0, "", 1, arms=["none", "int8@4", "int8@2", "ngram@8"])
    assert drafter_shares([r]) == {"int8": 0.5, "ngram": 0.25, "none": 0.25}


def test_prompt_files_and_their_errors_name_the_line(tmp_path):
    good = tmp_path / "q.jsonl"
    good.write_text('{"question_id": 1, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]}\n\n'
                    '{"question_id": 2, "category": "writing", "turns": ["Write a line."]}\n')
    prompts = read_prompt_file(good)
    assert [(p.text, p.category) for p in prompts] == [("What is 2+2?", "math"), ("Write a line.", "writing")]
    assert [p.text for p in sample_workload(str(good), 5, 0)] != []
    (tmp_path / "l.json").write_text(json.dumps(["a", "b", "c"]))
    assert len(sample_workload(str(tmp_path / "l.json"), 2, 3)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": [}\n')
    with pytest.raises(WorkloadFormatError, match="bad.jsonl:2: not valid JSON"):
        read_prompt_file(bad)
    bad.write_text('{"turns": ["ok"]}\n{"question_id": 3}\n')
    with pytest.raises(WorkloadFormatError, match="bad.jsonl:2: got .*a prompt file holds one JSON value per line"):
        read_prompt_file(bad)
    with pytest.raises(ValueError, match="unknown workload 'nope'.*a prompt file"):
        sample_workload("nope", 2, 0)


def test_without_the_datasets_the_error_says_how_to_give_ones_own_prompts(tmp_path, capsys):
    """No shared datasets (a clone on its own): `bench e2e` names --datasets-dir and --workload FILE.jsonl with the
    file's format, which the bench then reads."""
    from spind.cli import main

    missing = tmp_path / "datasets"
    assert main(["bench", "e2e", "--workload", "alpaca", "--datasets-dir", str(missing), "--json",
                 str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "datasets folder not found" in err and "--datasets-dir DIR" in err and "--workload FILE.jsonl" in err
    assert '"turns": ["the prompt", ...]' in err and '{"prompt": "the prompt"}' in err and "prompt string" in err
    own = tmp_path / "own.jsonl"  # each kind of line the error names, run through the bench as it says
    own.write_text('"Say hi."\n{"prompt": "Name three colors.", "category": "mine"}\n'
                   '{"question_id": 1, "category": "writing", "turns": ["Write a line."]}\n')
    assert sorted(p.text for p in sample_workload(str(own), 3, 0, missing)) == [
        "Name three colors.", "Say hi.", "Write a line."]
    out = tmp_path / "r.json"
    assert main(["bench", "e2e", "--workload", str(own), "--datasets-dir", str(missing), "--num-requests", "3",
                 "--batch-size", "3", "--max-tokens", "4", "--systems", "none", "--threads", "1",
                 "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["requests"]["none"]
    assert sorted(r["category"] for r in recs) == ["mine", "own", "writing"]  # a bare string: the file's name
    assert all(r["token_ids"] and r["num_prompt_tokens"] > 5 for r in recs)  # in the chat template


def test_prompt_objects_in_a_json_list_and_their_errors(tmp_path):
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"prompt": "a"}, "b", {"turns": ["c"]}]))
    assert [p.text for p in read_prompt_file(listed)] == ["a", "b", "c"]
    for bad in ({"prompt": ""}, {"prompt": 5}, {"messages": [{"role": "user", "content": "x"}]}):
        listed.write_text(json.dumps([bad]))
        with pytest.raises(WorkloadFormatError, match=r'l.json:1: got .*\{"prompt": "the prompt"\}'):
            read_prompt_file(listed)


@pytest.mark.e2e
def test_a_tiny_run_reports_every_system_lossless_and_the_refused_ones(tmp_path, capsys):
    prompts = write_prompt_file(tmp_path / "prompts.json")
    out = tmp_path / "e2e.json"
    code = main(["bench", "e2e", "--workload", str(prompts), "--num-requests", "3", "--batch-size", "2",
                 "--max-tokens", "8", "--systems", "none,fixed:ngram,spin,hf-plain,fixed:nope,hf-assisted:int8,"
                 "spin/selection.price_margin=0.0,spin/selection.price_margin=-1.0",
                 "--threads", "1", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    rows = {r["system"]: r for r in results["rows"]}
    assert set(rows) == {"none", "fixed:ngram", "spin", "hf-plain", "spin/selection.price_margin=0.0"}
    assert set(results["refused"]) == {"fixed:nope", "hf-assisted:int8", "spin/selection.price_margin=-1.0"}
    assert all(r["lossless"] is True for r in rows.values())  # greedy: every system reproduces plain decoding
    assert rows["none"]["speedup_vs_none"] == 1.0 and rows["none"]["drafter_shares"] == {"none": 1.0}
    assert rows["hf-plain"]["slots"] is None  # transformers' generate: no slots of spind's to account
    assert rows["none"]["full_batch_speedup_vs_none"] == 1.0 and rows["spin"]["full_batch_goodput"] > 0
    assert rows["hf-plain"]["full_batch_goodput"] is None
    assert all(rows[n]["slots"]["num_slots"] > 0 for n in ("none", "fixed:ngram", "spin"))
    assert rows["none"]["selection"] is None and rows["fixed:ngram"]["selection"] is None  # nothing learned
    assert {"dominated", "idle", "ledger", "overhead_ms"} <= set(rows["spin"]["selection"])  # what LBSS learned
    for name, recs in results["requests"].items():
        assert len(recs) == 3 and all(len(r["token_ids"]) <= 8 and r["latency_s"] > 0 for r in recs)
        if name in ("fixed:ngram", "spin", "spin/selection.price_margin=0.0"):
            assert all(len(r["arms"]) == r["num_steps"] for r in recs)
    assert "refused:" in capsys.readouterr().out


def test_rounds_need_two_batches_a_slice_and_a_closed_loop():
    s = E2ESettings(workload="mix", num_requests=32, batch_size=4, max_tokens=8, systems=("none",), rounds=4)
    assert s.num_rounds() == 4
    assert dataclasses.replace(s, batch_size=16).num_rounds() == 1  # a slice of 8 would never fill 16 clients
    assert dataclasses.replace(s, batch_size=8).num_rounds() == 2
    assert dataclasses.replace(s, rate=2.0).num_rounds() == 1  # open loop: arrivals are timed from the start
    assert dataclasses.replace(s, rounds=0).num_rounds() == 4  # as many as leave each slice two batches
    assert dataclasses.replace(s, rounds=0, batch_size=1).num_rounds() == 16
    assert dataclasses.replace(s, rounds=0, num_requests=5).num_rounds() == 1


def test_negative_rounds_are_refused_before_anything_loads(tmp_path, capsys):
    assert main(["bench", "e2e", "--workload", "alpaca", "--rounds", "-1", "--datasets-dir", str(tmp_path)]) == 2
    assert "--rounds must be >= 0 (0: as many as the requests allow)" in capsys.readouterr().err


def test_systems_taking_turns_keep_every_request_once_and_in_order(tmp_path, capsys):
    """... and each system's slots are its own: how many, their wall time, and the coordinator's and the target's
    shares of it. Asked for more requests than the workload has prompts, it runs (and counts, and slices in rounds:
    by default as many as leave two batches a slice) the prompts it has."""
    prompts = write_prompt_file(tmp_path / "prompts.json", 4)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--workload", str(prompts), "--num-requests", "9", "--batch-size", "1",
                 "--max-tokens", "6", "--systems", "none,fixed:ngram", "--threads", "1", "--json", str(out)]) == 0
    assert "has 4 prompts: 4 requests, not 9" in capsys.readouterr().err
    results = json.loads(out.read_text())
    assert results["settings"]["num_requests"] == 4
    assert results["settings"]["rounds"] == 0 and results["settings"]["num_rounds"] == 2
    for recs in results["requests"].values():
        assert [r["index"] for r in recs] == [0, 1, 2, 3] and all(r["lossless"] for r in recs)
        assert all(r["latency_s"] > 0 and r["token_ids"] for r in recs)
    assert all(r["goodput"] > 0 for r in results["rows"])
    for row in results["rows"]:  # each system's own slots, summed over its slices (its warm-up not among them)
        slots, recs = row["slots"], results["requests"][row["system"]]
        steps = sum(r["num_steps"] for r in recs)  # batch 1: one request a slot, each step its own slot
        assert steps <= slots["num_slots"] <= steps + len(recs), (slots, steps)
        assert 0 < slots["coordinator_ms"] < slots["slot_ms"] and 0 < slots["target_busy_ms"] <= slots["slot_ms"]
        assert slots["side_busy_ms"] == 0  # no worker but the target's
        assert slots["process_cpu_ms"] > 0 and slots["workers_cpu_ms"] == 0  # workers in this process: its CPU time
        assert row["full_batch_goodput"] == pytest.approx(row["goodput"], rel=0.05)  # batch 1: full to the end
    for row in results["rows"]:  # paired per round: the same slice of requests, minutes apart at most
        assert len(row["round_speedups_vs_none"]) == 2 and row["speedup_vs_none_round_median"] > 0
        if row["system"] == "none":
            assert row["round_speedups_vs_none"] == [1.0, 1.0]
    for recs in results["requests"].values():
        assert [r["round"] for r in recs] == [0, 0, 1, 1]


def test_repeated_requests_run_again_on_fresh_engines_and_pool(tmp_path, capsys):
    """Two prompts at batch 1 give one round; two repeats run them twice, every system on a fresh engine each time:
    every record kept (the second pass compared with none's second), a ratio per repeat, the table says so."""
    prompts = write_prompt_file(tmp_path / "prompts.json", 2)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--workload", str(prompts), "--num-requests", "2", "--batch-size", "1",
                 "--max-tokens", "5", "--systems", "none,fixed:suffix", "--threads", "1", "--repeats", "2",
                 "--json", str(out)]) == 0
    assert "the requests run 2 times (engines loaded afresh each time)" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["settings"]["repeats"] == 2 and results["settings"]["num_rounds"] == 1
    for recs in results["requests"].values():
        assert [(r["index"], r["round"]) for r in recs] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert all(r["lossless"] for r in recs)
    # a fresh suffix trie: the second pass drafts as the first did (a trie kept on would know these outputs)
    suffix = results["requests"]["fixed:suffix"]
    assert [r["num_accepted"] for r in suffix[:2]] == [r["num_accepted"] for r in suffix[2:]]
    for row in results["rows"]:
        assert len(row["round_speedups_vs_none"]) == 2


def test_systems_over_worker_processes_as_the_daemon_runs_them(tmp_path):
    """--workers processes: each spind system is the daemon's coordinator over real worker processes, timed and
    accounted as over threads, its outputs the same, and its processes gone with the run."""
    prompts = write_prompt_file(tmp_path / "prompts.json", 2)
    out = tmp_path / "e2e.json"
    before = set(child_pids(os.getpid()))
    assert main(["bench", "e2e", "--workload", str(prompts), "--num-requests", "2", "--batch-size", "1",
                 "--max-tokens", "8", "--systems", "none,fixed:ngram", "--workers", "processes", "--threads", "1",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["workers"] == "processes"
    rows = {r["system"]: r for r in results["rows"]}
    assert set(rows) == {"none", "fixed:ngram"} and all(r["lossless"] is True for r in rows.values())
    for row in rows.values():
        slots = row["slots"]
        assert slots["num_slots"] > 0 and 0 < slots["target_busy_ms"] <= slots["slot_ms"]
    # the forwards ran in the worker processes: their CPU time (in 10 ms ticks) is counted, over all the slots
    assert sum(r["slots"]["workers_cpu_ms"] * r["slots"]["num_slots"] for r in rows.values()) > 0
    assert set(child_pids(os.getpid())) <= before  # every worker stopped and reaped


def test_round_order_changes_each_systems_first_place_and_predecessor():
    names = ["none", "fixed:ngram", "fixed:suffix", "spin"]
    orders = [round_order(names, r) for r in range(4)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for n in names:
        assert len({o.index(n) for o in orders}) >= 3
        assert len({o[o.index(n) - 1] if o.index(n) else None for o in orders}) >= 3


def test_repeats_run_on_fresh_engines_complete_squares_and_take_turns_at_the_first_slice(monkeypatch):
    """81 prompts at batch 16 leave 2 rounds for 4 systems: half a Williams square, `none` first after the load.
    Four repeats (each a `run_spind_rounds` call: engines loaded afresh) run rows 0-1, 2-3, 1-2, 3-0: two whole
    squares, and each system has the first slice after the engines load once; records (their rounds counted on),
    round walls and slots add up in order."""
    names = ["none", "none#2", "fixed:suffix", "spin"]
    rows, places, first = [], {n: [0] * 4 for n in names}, []

    def rounds(cfg, specs, prompts, categories, s, progress, states=None, row=0):
        out = {}
        for r in range(s.num_rounds()):
            rows.append((row + r) % 4)
            order = round_order(list(specs), row + r)
            if r == 0:
                first.append(order[0])
            for n in specs:
                places[n][order.index(n)] += 1
        for n in specs:
            recs = [RequestRecord(r, "", 1, round=r) for r in range(s.num_rounds())]
            out[n] = (recs, [1.0 + len(first)] * s.num_rounds(), SlotAccount(num_slots=3))
        return out

    monkeypatch.setattr(e2e, "run_spind_rounds", rounds)
    s = E2ESettings(workload="passage", num_requests=81, batch_size=16, max_tokens=8, systems=tuple(names),
                    rounds=0, repeats=4)
    assert s.num_rounds() == 2
    out = run_repeats(None, dict.fromkeys(names), [], [], s, None)
    assert rows == [0, 1, 2, 3, 1, 2, 3, 0]
    assert sorted(first) == sorted(names)  # each system once the first after a load
    assert all(p == [2, 2, 2, 2] for p in places.values()), places  # every place twice: two whole squares
    for n in names:
        recs, walls, account = out[n]
        assert [r.round for r in recs] == list(range(8)) and walls == [2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0, 5.0]
        assert account.num_slots == 12


def test_the_first_rows_of_repeats_make_whole_squares_and_move_the_first_slice():
    for n in (2, 3, 4, 5):
        for rounds in (1, 2, 3, 4, 6):
            starts = [first_row(n, rounds, rep) for rep in range(n)]
            assert starts[0] == 0
            assert sorted(starts) == list(range(n)), (n, rounds, starts)  # every system first after a load once
            cycle = n // math.gcd(rounds, n)
            counts = [0] * n
            for rep in range(cycle):  # the first cycle of repeats runs each row equally often: whole squares
                for r in range(rounds):
                    counts[(first_row(n, rounds, rep) + r) % n] += 1
            assert len(set(counts)) == 1, (n, rounds, counts)


def test_repeats_need_a_closed_loop_and_systems_taking_turns(tmp_path, capsys):
    prompts = write_prompt_file(tmp_path / "prompts.json", 2)
    for extra, why in ((["--repeats", "0"], "--repeats must be >= 1"),
                       (["--repeats", "2", "--rate", "1"], "1 in an open loop"),
                       (["--repeats", "2", "--systems", "none"], "needs two or more of them")):
        assert main(["bench", "e2e", "--workload", str(prompts), "--num-requests", "2", "--max-tokens", "4",
                     "--threads", "1", *extra]) == 2, extra
        assert why in capsys.readouterr().err


def test_round_ratios_pair_each_round_with_none():
    def rec(round_, tokens):
        return RequestRecord(0, "", 1, token_ids=[1] * tokens, round=round_)

    results = {"none": [rec(0, 10), rec(1, 10)], "spin": [rec(0, 12), rec(1, 9)]}
    ratios = round_ratios(results, {"none": [1.0, 1.0], "spin": [1.0, 1.5]})
    assert ratios["none"] == [1.0, 1.0] and ratios["spin"] == pytest.approx([1.2, 0.6])
    assert round_ratios(results, {}) == {}  # one after another: no pairs


class _PacedEngine:
    """A coordinator stand-in that streams request i's `lengths[i]` tokens one every 10 ms."""

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths = lengths

    async def generate(self, req):
        n = self.lengths[len(req.prompt_ids)]
        for t in range(n):
            await asyncio.sleep(0.01)
            yield Delta([t], "x", "length" if t == n - 1 else None,
                        Usage(1, n, num_steps=n) if t == n - 1 else None)


def test_the_full_batch_ends_when_a_client_first_finds_no_request_left():
    """Two clients, four requests of 2, 12, 2 and 2 tokens: the first client runs requests 0, 2 and 3 and finds none
    left while request 1 is half streamed: the full batch's time ends there, with every token of 0, 2, 3 and some of
    1's; the slice's wall time runs on to request 1's end. A client that never had a request: no full batch."""
    prompts = [[0] * n for n in (1, 2, 3, 4)]
    engine = _PacedEngine({1: 2, 2: 12, 3: 2, 4: 2})
    s = E2ESettings(workload="w", num_requests=4, batch_size=2, max_tokens=16, systems=("none",))
    records, wall, full = asyncio.run(e2e._drive(engine, prompts, [""] * 4, s, "none", Progress(4, io.StringIO()),
                                                 "t"))
    assert [len(r.token_ids) for r in records] == [2, 12, 2, 2]
    assert 6 < full.full_tokens < 18 and 0 < full.full_s < wall
    assert full.full_batch_goodput == pytest.approx(full.full_tokens / full.full_s)
    s3 = dataclasses.replace(s, batch_size=3)
    _, _, none_full = asyncio.run(e2e._drive(_PacedEngine({1: 2, 2: 2}), prompts[:2], [""] * 2, s3, "none",
                                             Progress(2, io.StringIO()), "t"))
    assert none_full.full_s == 0 and none_full.full_batch_goodput is None
    open_loop = dataclasses.replace(s, rate=100.0)
    _, _, open_full = asyncio.run(e2e._drive(engine, prompts, [""] * 4, open_loop, "none", Progress(4, io.StringIO()),
                                             "t"))
    assert open_full.full_batch_goodput is None
