"""Selection replayed over recorded greedy outputs (`spind.sim.replay`, `spind bench replay`): the accounting is
exact, the decisions do not depend on the clock, and the bench records, caches and reports."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import islice

import numpy as np
import pytest
from prompts import write_prompt_file

from spind.config import SelectionConfig
from spind.coordinator.profile import SystemProfile
from spind.bench.replay import ReplaySettings
from spind.sim.replay import HostNoise, Recorded, ReplayCosts, replay

PROFILE = SystemProfile(4, {}, {1: 8.0, 2: 10.0, 4: 16.0}, decode_batch_ms={1: 4.0, 2: 5.0, 4: 7.0})
CALLS = {"ngram": (5e-6, 0.0), "suffix": (15e-6, 30e-6)}


def recording() -> list[Recorded]:
    """Outputs that copy their prompts in long runs (lookup drafts pay) and some that do not."""
    out = []
    for i in range(12):
        prompt = [10 + (i + j) % 7 for j in range(30)]
        tail = prompt[:40] if i % 3 else [50 + (7 * j + i) % 41 for j in range(40)]
        out.append(Recorded(prompt, (prompt[5:25] + tail)[:48], "copy" if i % 3 else "chat"))
    return out


def test_the_cost_model_follows_the_profile():
    costs = ReplayCosts.from_profile(PROFILE, CALLS, base_s=0.0)
    assert costs.curves[1] == ((0, 0.004), (4, 0.008)) and costs.curves[4] == ((0, 0.007), (16, 0.016))
    assert costs.verify_s(1, 5) == pytest.approx(0.008)  # the profile's own verify
    assert costs.verify_s(3, 3) == pytest.approx(0.006)  # between 2 and 4 requests
    assert costs.verify_s(8, 8) == pytest.approx(0.014)  # past the largest: its line, scaled
    assert costs.call_s("suffix", 2) == pytest.approx(75e-6) and costs.call_s("other", 3) == 0.0
    with pytest.raises(ValueError, match="no batch sizes"):
        ReplayCosts.from_profile(SystemProfile(4, {}, {1: 8.0}), CALLS)


def test_a_batch_with_one_request_drafting_is_a_point_of_its_curve():
    """Where the profile timed a batch with one request drafting 1..k (T = B + 1 .. B + k), the forward's seconds
    follow them up to there and the all-drafting forward beyond: one request's drafts cost what they were measured
    to."""
    profile = SystemProfile(4, {}, {1: 8.0, 4: 16.0}, decode_batch_ms={1: 4.0, 4: 7.0},
                            lone_verify_ms={4: [8.0, 9.0, 10.0, 11.0]})
    costs = ReplayCosts.from_profile(profile, CALLS, base_s=0.0)
    assert costs.curves[4] == ((0, 0.007), (1, 0.008), (2, 0.009), (3, 0.010), (4, 0.011), (16, 0.016))
    assert costs.verify_s(4, 6) == pytest.approx(0.009)  # 1 ms a token up to T = B + k
    assert costs.verify_s(4, 14) == pytest.approx(0.011 + 6 * 0.005 / 12)  # then the slope to every one drafting
    assert costs.verify_s(4, 24) == pytest.approx(0.016 + 4 * 0.005 / 12)  # and past it
    assert costs.verify_s(1, 3) == pytest.approx(0.006)  # batch 1's one request is every request


def test_a_forward_that_carries_more_tokens_never_costs_less():
    """A profile timed on a busy host can read a forward faster than one with fewer tokens: the replay's costs are
    the closest curve that never falls (pooled where it does), each forward's timings averaged first."""
    profile = SystemProfile(4, {}, {1: 8.0, 4: 16.0}, decode_batch_ms={1: 4.0, 4: 7.0},
                            lone_verify_ms={4: [8.0, 6.0, 10.0, 11.0]})
    costs = ReplayCosts.from_profile(profile, CALLS, base_s=0.0)
    assert [x for x, _ in costs.curves[4]] == [0, 1, 2, 3, 4, 16]
    assert [round(y * 1e3, 6) for _, y in costs.curves[4]] == [7.0, 7.0, 7.0, 10.0, 11.0, 16.0]  # 7, 8, 6: 7 each
    assert costs.verify_s(4, 6) == pytest.approx(0.007)
    assert all(a[1] <= b[1] for c in costs.curves.values() for a, b in zip(c, c[1:]))


def test_plain_decoding_is_one_token_a_forward_and_every_system_commits_the_recording():
    rec = recording()
    total = sum(len(r.output) for r in rec)
    costs = ReplayCosts.from_profile(PROFILE, CALLS, base_s=1e-4)
    none = replay(rec, "none", 1, costs)
    assert none.tokens == none.slots == none.request_slots == total and none.plain_share == 1.0
    assert none.seconds == pytest.approx(total * (0.004 + 1e-4) + none.select_s)
    for system, batch in (("fixed:ngram", 1), ("fixed:suffix@8", 4), ("spin", 1), ("spin", 4)):
        r = replay(rec, system, batch, costs)
        assert r.tokens == total and r.request_slots < total, system  # drafts committed several tokens a slot
        assert r.drafted_slots and r.plain_share < 1.0
    assert replay(rec, "fixed:ngram", 1, costs).tokens_per_s > none.tokens_per_s  # copying pays here


def test_the_decisions_do_not_depend_on_the_clock():
    """The selector's calls are timed and charged, but it learns only modelled seconds: two replays decide alike."""
    rec = recording()
    costs = ReplayCosts.from_profile(PROFILE, CALLS)
    a, b = (replay(rec, "spin", 2, costs, SelectionConfig(seed=3)) for _ in range(2))
    assert (a.slots, a.request_slots, a.drafted_slots) == (b.slots, b.request_slots, b.drafted_slots)
    assert a.selection is not None and {"ledger", "dominated", "idle"} <= set(a.selection)
    with pytest.raises(ValueError, match="free drafters"):
        replay(rec, "fixed:int8", 1, costs, drafters=("int8",))


def test_the_regime_trial_runs_its_plain_windows_unselected():
    """spin runs the lockstep's regime trial from batch 2 (`selection/regime.py`): its PLAIN windows' requests decode
    plainly, unselected, and every request still commits its recording."""
    rec = recording()
    costs = ReplayCosts.from_profile(PROFILE, CALLS)
    on = replay(rec, "spin", 2, costs, SelectionConfig(seed=3))
    assert on.tokens == sum(len(r.output) for r in rec)
    trial = on.selection["regime"]
    assert on.plain_regime_slots == trial["slots"]["plain"] > 0 and trial["slots"]["select"] > 0
    assert sum(trial["slots"].values()) <= on.slots  # a slot of one request (the tail) runs no window
    undrafted = on.request_slots - sum(on.drafted_slots.values())
    assert undrafted >= on.plain_regime_slots  # each plain window's slot drafted for nobody
    off = replay(rec, "spin", 2, costs, SelectionConfig(seed=3, regime_trial=False))
    assert off.plain_regime_slots == 0 and "regime" not in off.selection
    assert replay(rec, "spin", 1, costs, SelectionConfig(seed=3)).plain_regime_slots == 0  # below its MIN_BATCH


def test_the_trial_finds_what_selecting_costs_unseen():
    """A cost of selecting no feedback shows the selector (`ReplayCosts.hidden_s`: its Python slowing the target's
    forward) is what the regime trial measures: large enough, the trial runs most slots plainly, and beats selection
    without it; without such a cost it runs its pairs and selects."""
    rec = recording() * 3
    costs = ReplayCosts.from_profile(PROFILE, CALLS)
    hidden = replace(costs, hidden_s=0.02)
    none, seen = replay(rec, "none", 2, hidden), replay(rec, "none", 2, costs)
    assert none.seconds - none.select_s == pytest.approx(seen.seconds - seen.select_s)  # none selects nothing
    trial = replay(rec, "spin", 2, hidden, SelectionConfig(seed=3))
    blind = replay(rec, "spin", 2, hidden, SelectionConfig(seed=3, regime_trial=False))
    assert trial.plain_regime_slots > 0.6 * trial.slots
    assert trial.selection["regime"]["buckets"]["1"]["regime"] == "plain"
    assert blind.tokens_per_s < trial.tokens_per_s
    free = replay(rec, "spin", 2, costs, SelectionConfig(seed=3))
    assert free.plain_regime_slots < 0.4 * free.slots and free.tokens_per_s > none.tokens_per_s


def test_host_noise_is_drawn_by_its_seed_and_scales_each_slots_seconds():
    assert list(islice(HostNoise().factors(), 5)) == [1.0] * 5
    draw = list(islice(HostNoise(0.1, 0.2, 20.0, seed=1).factors(), 4000))
    assert draw == list(islice(HostNoise(0.1, 0.2, 20.0, seed=1).factors(), 4000))
    assert draw != list(islice(HostNoise(0.1, 0.2, 20.0, seed=2).factors(), 4000))
    logs = np.log(draw)
    assert abs(logs.mean()) < 0.1 and 0.15 < logs.std() < 0.3  # sqrt(0.1^2 + 0.2^2) = 0.22 in all
    drift = np.log(list(islice(HostNoise(0.0, 0.2, 20.0, seed=1).factors(), 4000)))
    assert np.corrcoef(drift[:-1], drift[1:])[0, 1] > 0.85  # exp(-1/20) = 0.95: slow
    rec = recording()
    costs = ReplayCosts.from_profile(PROFILE, CALLS)
    quiet = replay(rec, "none", 1, costs)
    noisy = replay(rec, "none", 1, costs, noise=HostNoise(0.1, 0.1, seed=1))
    assert (noisy.tokens, noisy.slots) == (quiet.tokens, quiet.slots)
    assert abs(noisy.seconds / quiet.seconds - 1.0) > 1e-3
    a, b = (replay(rec, "spin", 2, costs, SelectionConfig(seed=3), noise=HostNoise(0.1, 0.1, seed=1))
            for _ in range(2))
    assert (a.slots, a.request_slots, a.drafted_slots, a.plain_regime_slots) == \
        (b.slots, b.request_slots, b.drafted_slots, b.plain_regime_slots)


def test_settings_refuse_what_replay_cannot_run():
    ok = dict(workloads=("gsm8k", "mix"), batch_sizes=(1,), systems=("none", "spin", "fixed:suffix@8"))
    ReplaySettings(**ok).check()
    for bad, match in ((dict(systems=("spin",)), "needs none"), (dict(systems=("none", "fixed:int8")), "free"),
                       (dict(workloads=("nope",)), "unknown workload"), (dict(batch_sizes=(0,)), ">= 1"),
                       (dict(noise=(0.1, -0.1)), "--noise"), (dict(select_ms=-1.0), "--select-ms"),
                       (dict(hidden_ms=-1.0), "--hidden-ms")):
        with pytest.raises(ValueError, match=match):
            ReplaySettings(**{**ok, **bad}).check()


@pytest.mark.e2e
def test_the_bench_records_once_and_replays_side_by_side(tmp_path, capsys):
    from spind.cli import main

    prompts = write_prompt_file(tmp_path / "prompts.json")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    args = ["bench", "replay", "--workloads", str(prompts), "--batch-size", "1,2", "--num-requests", "3",
            "--max-tokens", "12", "--systems", "none,fixed:suffix,spin", "--profile", str(profile),
            "--recordings", str(tmp_path / "rec"), "--out", str(tmp_path / "out.json")]
    assert main(args) == 0
    results = json.loads((tmp_path / "out.json").read_text())
    assert [(r["batch_size"], r["system"]) for r in results["rows"]] == [
        (b, s) for b in (1, 2) for s in ("none", "fixed:suffix", "spin")]
    assert all(r["tokens"] == results["rows"][0]["tokens"] > 0 for r in results["rows"])  # the recording's
    assert all(r["vs_none"] == 1.0 for r in results["rows"] if r["system"] == "none")
    recorded = list((tmp_path / "rec").glob("*.json"))
    assert len(recorded) == 1 and len(json.loads(recorded[0].read_text())["requests"]) == 3
    assert "spind bench replay" in capsys.readouterr().out
    spin2 = next(r for r in results["rows"] if r["system"] == "spin" and r["batch_size"] == 2)
    assert spin2["regime"] is not None and 0.0 <= spin2["plain_regime_share"] <= 1.0
    before = recorded[0].stat().st_mtime_ns
    assert main(args) == 0  # the second run reads the recording
    assert recorded[0].stat().st_mtime_ns == before
    assert json.loads((tmp_path / "out.json").read_text())["rows"][0]["tokens"] == results["rows"][0]["tokens"]
    assert main([*args, "--noise", "0.1,0.2", "--select-ms", "0.5", "--hidden-ms", "1"]) == 0  # a modelled host
    noisy = json.loads((tmp_path / "out.json").read_text())
    assert noisy["settings"]["noise"] == [0.1, 0.2] and noisy["settings"]["hidden_ms"] == 1.0
    assert "host noise" in capsys.readouterr().out
    assert [r["tokens"] for r in noisy["rows"]] == [r["tokens"] for r in results["rows"]]
    with pytest.raises(SystemExit, match="--noise"):
        main([*args, "--noise", "0.1,x"])
