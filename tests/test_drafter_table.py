"""`spind drafters`: whether auto selection uses each drafter on this machine and why not, by the engine's own rule
(SystemProfile.dominated_drafters), from the machine's cached profile of this config, found without loading a model."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from test_profile_cache import AT_REST, Pool, config

from spind.config import DrafterConfig, SelectionConfig, validate
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


def test_other_policies_and_no_profile(tmp_path):
    fixed = drafter_rows(cfg_with(tmp_path, policy="fixed:int8"), PROFILE)
    assert [r["used_by_auto"] for r in fixed] == [False, True, False] and "fixed on int8" in fixed[0]["why_not"]
    none = drafter_rows(cfg_with(tmp_path, policy="none"), PROFILE)
    assert not any(r["used_by_auto"] for r in none) and "policy is none" in none[0]["why_not"]
    unknown = drafter_rows(cfg_with(tmp_path), None)
    assert all(r["used_by_auto"] is None and r["ms_per_token"] is None for r in unknown)
    assert "not profiled" in unknown[0]["why_not"]


def test_a_start_caches_what_drafters_then_finds_without_loading(tmp_path):
    cfg = config(tmp_path)
    assert find_cached(cfg) is None and describe_drafters(cfg)["profile"] is None
    assert "spind drafters --measure" in render_drafters(describe_drafters(cfg))
    measured = asyncio.run(load_or_measure(Pool([AT_REST]), cfg, 5.0))
    path, found = find_cached(cfg)
    assert found.draft_ms_per_token == measured.draft_ms_per_token and json.loads(path.read_text())["fields"]
    table = describe_drafters(cfg)
    assert table["profile"]["decode_ms"] == AT_REST.decode_ms and table["profile"]["path"] == str(path)
    assert "rule: auto leaves out a drafter" in render_drafters(table)
    other = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16")))
    assert find_cached(other) is None  # another dtype's costs are not this one's
    raw = json.loads(path.read_text())
    del raw["fields"]
    path.write_text(json.dumps(raw))  # a profile cached before they were recorded: not matched, and a start adds them
    assert find_cached(cfg) is None
    asyncio.run(load_or_measure(Pool([]), cfg, 5.0))  # read from the cache: nothing measured
    assert find_cached(cfg) is not None
