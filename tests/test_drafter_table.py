"""`spind drafters`: whether auto selection uses each drafter on this machine and why not, by the engine's own rule
(SystemProfile.dominated_drafters), from the machine's cached profile of this config, found without loading a model;
`--measure` loads the models and profiles them where no start has."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from test_profile_cache import AT_REST, LOADED, Pool, config

from spind.cli import main
from spind.config import DrafterConfig, SelectionConfig, load_config, validate
from spind.coordinator.profile import SystemProfile, find_cached, load_or_measure
from spind.drafter_table import describe_drafters, drafter_rows, render_drafters

# decode 5 ms: ngram nearly free, int8 at 1.4 steps a token (pays at k >= 3 only), bf16 at 3 steps
PROFILE = SystemProfile(4, {"ngram": 0.01, "int8": 7.0, "bf16": 15.0}, {1: 12.0}, 1.8e9, 5.0, {1: 5.0})


def cfg_with(tmp_path, policy: str = "lbss", k_set: tuple[int, ...] = (2, 4)):
    drafters = tuple(DrafterConfig(name=n, kind="ngram" if n == "ngram" else "self",
                                   variant="" if n == "ngram" else "int8-weight-only", worker="target")
                     for n in ("ngram", "int8", "bf16"))
    return validate(dataclasses.replace(config(tmp_path), drafters=drafters,
                                        selection=SelectionConfig(policy=policy, k_set=k_set)))


def test_lbss_leaves_out_a_drafter_costing_at_least_k_plus_one_over_k_steps(tmp_path):
    rows = {r["name"]: r for r in drafter_rows(cfg_with(tmp_path), PROFILE)}
    assert rows["ngram"]["used_by_auto"] and rows["ngram"]["why_not"] == ""
    assert not rows["bf16"]["used_by_auto"] and "3.00 target steps >= 1.50" in rows["bf16"]["why_not"]
    assert rows["int8"]["used_by_auto"] and rows["int8"]["cost_ratio"] == 7.0 / 5.0  # 1.4 < (2 + 1) / 2
    assert rows["bf16"]["ms_per_token"] == 15.0 and rows["bf16"]["cost_ratio"] == 3.0


def test_the_bound_follows_the_smallest_k_of_the_selection(tmp_path):
    at_2 = {r["name"]: r["used_by_auto"] for r in drafter_rows(cfg_with(tmp_path, k_set=(2, 4)), PROFILE)}
    at_4 = {r["name"]: r["used_by_auto"] for r in drafter_rows(cfg_with(tmp_path, k_set=(4,)), PROFILE)}
    assert at_2 == {"ngram": True, "int8": True, "bf16": False}  # bound 1.5: int8 at 1.4 may pay
    assert at_4 == {"ngram": True, "int8": False, "bf16": False}  # bound 1.25
    assert "1.40 target steps >= 1.25" in drafter_rows(cfg_with(tmp_path, k_set=(4,)), PROFILE)[1]["why_not"]


def test_other_policies_and_no_profile(tmp_path):
    fixed = drafter_rows(cfg_with(tmp_path, policy="fixed:int8"), PROFILE)
    assert [r["used_by_auto"] for r in fixed] == [False, True, False] and "fixed on int8" in fixed[0]["why_not"]
    none = drafter_rows(cfg_with(tmp_path, policy="none"), PROFILE)
    assert not any(r["used_by_auto"] for r in none) and "policy is none" in none[0]["why_not"]
    greedy = drafter_rows(cfg_with(tmp_path, policy="greedy-length"), PROFILE)  # ranks by cost, leaves none out
    assert all(r["used_by_auto"] for r in greedy) and greedy[2]["cost_ratio"] == 3.0
    unknown = drafter_rows(cfg_with(tmp_path), None)
    assert all(r["used_by_auto"] is None and r["ms_per_token"] is None for r in unknown)
    assert "not profiled" in unknown[0]["why_not"]


def test_with_profiling_off_auto_leaves_nothing_out(tmp_path):
    """[runtime].profile = "off": the engine loads no profile, so even a cached one that condemns bf16 does not
    leave it out; the table says why the rule does not apply."""
    cfg = cfg_with(tmp_path)
    asyncio.run(load_or_measure(Pool([PROFILE]), cfg, 5.0))
    off = validate(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, profile="off")))
    table = describe_drafters(off)
    assert [r["used_by_auto"] for r in table["drafters"]] == [True, True, True]
    assert table["drafters"][2]["cost_ratio"] == 3.0 and not table["rule"]["applies"]
    assert "profile is off" in table["note"] and "profile is off" in render_drafters(table)
    assert not describe_drafters(cfg)["drafters"][2]["used_by_auto"]  # the same cache, profiling on


def test_an_implausible_cached_profile_decides_nothing(tmp_path):
    """A profile timed under load is measured again by the next start: what auto leaves out is not known yet."""
    cfg = config(tmp_path)
    asyncio.run(load_or_measure(Pool([AT_REST]), cfg, 5.0))
    path, _ = find_cached(cfg)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**LOADED.to_json(), "measured_at": 1.0, "fields": raw["fields"]}))
    table = describe_drafters(cfg)
    assert table["profile"]["implausible"] and "implausible" in table["note"]
    assert all(r["used_by_auto"] is None and "implausible" in r["why_not"] for r in table["drafters"])


def test_a_start_caches_what_drafters_then_finds_without_loading(tmp_path):
    cfg = config(tmp_path)
    assert find_cached(cfg) is None and describe_drafters(cfg)["profile"] is None
    assert "spind drafters --measure" in describe_drafters(cfg)["note"]
    assert "spind drafters --measure" in render_drafters(describe_drafters(cfg))
    measured = asyncio.run(load_or_measure(Pool([AT_REST]), cfg, 5.0))
    path, found = find_cached(cfg)
    assert found.draft_ms_per_token == measured.draft_ms_per_token and json.loads(path.read_text())["fields"]
    table = describe_drafters(cfg)
    assert table["profile"]["decode_ms"] == AT_REST.decode_ms and table["profile"]["path"] == str(path)
    assert table["profile"]["verify_ms"] == AT_REST.verify_ms[1] and table["note"] is None
    text = render_drafters(table)
    assert "rule: auto leaves out a drafter" in text and "6.60 ms a plain decode step" in text
    assert "14.60 ms a verify of k + 1 = 5 tokens" in text
    other = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16")))
    assert find_cached(other) is None  # another dtype's costs are not this one's
    raw = json.loads(path.read_text())
    del raw["fields"]
    path.write_text(json.dumps(raw))  # a profile cached before they were recorded: not matched, and a start adds them
    assert find_cached(cfg) is None
    asyncio.run(load_or_measure(Pool([]), cfg, 5.0))  # read from the cache: nothing measured
    assert find_cached(cfg) is not None


def test_json_from_the_command_line_over_a_cached_profile(tmp_path, capsys):
    """`spind drafters --config FILE --json` over a profile a start cached: the drafters' costs, the target's decode
    and verify ms, the rule's bound and whether auto uses each, as the text table shows them."""
    toml = tmp_path / "spind.toml"
    toml.write_text(f'[model]\ncache_dir = "{tmp_path}"\n[selection]\nk_set = [2, 4]\n' + "".join(
        f'[[drafters]]\nname = "{n}"\nkind = "{kind}"\nvariant = "{variant}"\nworker = "target"\n'
        for n, kind, variant in (("ngram", "ngram", ""), ("suffix", "suffix", ""), ("int8", "self", "int8-weight-only"),
                                 ("bf16", "self", "bf16"))))
    cfg = load_config(toml)
    names = [d.name for d in cfg.drafters]
    assert names == ["ngram", "suffix", "int8", "bf16"]
    costs = {n: 0.02 if d.kind in ("ngram", "suffix") else 9.0 for n, d in zip(names, cfg.drafters)}
    asyncio.run(load_or_measure(Pool([SystemProfile(4, costs, {1: 11.0}, 0.0, 6.0, {1: 6.0})]), cfg, 5.0))
    assert main(["drafters", "--config", str(toml), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["profile"]["decode_ms"] == 6.0 and table["profile"]["verify_ms"] == 11.0 and table["note"] is None
    assert table["rule"] == {"applies": True, "min_k": 2, "max_cost_ratio": 1.5}
    rows = {r["name"]: r for r in table["drafters"]}
    assert list(rows) == names
    for name, d in zip(names, cfg.drafters):
        drafts_inline = d.kind in ("ngram", "suffix")
        assert rows[name]["ms_per_token"] == costs[name] and rows[name]["used_by_auto"] is drafts_inline
        assert rows[name]["why_not"] == ("" if drafts_inline else "a draft token costs 1.50 target steps >= 1.50 "
                                                                  "(the rule)")
    assert main(["drafters", "--config", str(toml)]) == 0
    text = capsys.readouterr().out
    assert "6.00 ms a plain decode step" in text and "11.00 ms a verify" in text and "1.50 (the rule)" in text


def test_measure_profiles_the_real_models_and_caches_it(tmp_path, model_dir, capsys):
    """A config no start has profiled (its own cache dir, the converted model linked in): `--measure` loads the
    real models and profiles them, and the next plain `spind drafters` reads the same from the cache. Run under a
    fixed policy, for which a start profiles nothing: --measure profiles whatever the policy."""
    (tmp_path / "models").symlink_to(model_dir.parent)
    toml = tmp_path / "spind.toml"
    toml.write_text(f'[model]\nmax_model_len = 512\ncache_dir = "{tmp_path}"\n[runtime]\nkv_num_blocks = 64\n'
                    f'max_batch_size = 2\nthreads = 1\n[selection]\npolicy = "fixed:int8"\n'
                    '[[drafters]]\nname = "ngram"\nkind = "ngram"\nworker = "target"\n'
                    '[[drafters]]\nname = "int8"\nkind = "self"\nvariant = "int8-weight-only"\nworker = "target"\n'
                    '[[workers]]\nname = "target"\n')
    assert main(["drafters", "--config", str(toml), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert before["profile"] is None and "--measure" in before["note"]
    assert main(["drafters", "--config", str(toml), "--json", "--measure"]) == 0
    measured = json.loads(capsys.readouterr().out)
    prof = measured["profile"]
    assert prof["decode_ms"] > 0 and prof["verify_ms"] > 0 and prof["path"].startswith(str(tmp_path / "profiles"))
    assert all(r["ms_per_token"] > 0 and r["cost_ratio"] == pytest.approx(r["ms_per_token"] / prof["decode_ms"])
               for r in measured["drafters"])
    assert [r["used_by_auto"] for r in measured["drafters"]] == [False, True]  # fixed:int8
    assert main(["drafters", "--config", str(toml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == measured  # read back from the cache, nothing loaded
