"""Config: the embedded default loads; every bad value is a ConfigError that names the section and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from spind.config import DEFAULT_CONFIG_PATH, ConfigError, SpindConfig, from_dict, load_config

NGRAM = {"name": "ng", "kind": "ngram"}


def test_embedded_default_loads() -> None:
    cfg = load_config()
    assert [d.name for d in cfg.drafters] == ["ngram", "int8", "dyn8", "bf16"]
    assert cfg.model.dtype == "gguf-q16" and cfg.runtime.attention == "invariant"
    assert cfg.selection.policy == "lbss" and cfg.selection.k_set == (2, 4, 8)
    assert cfg.drafter("int8").variant == "int8-weight-only"
    assert cfg.worker("target").device == "cpu" and cfg.worker("unlisted").name == "unlisted"


def test_overrides_apply_and_none_leaves_the_value() -> None:
    cfg = load_config(overrides={"model": {"dtype": "bfloat16", "target": None}, "runtime": {"kv_num_blocks": 8}})
    assert cfg.model.dtype == "bfloat16" and cfg.model.target == "default" and cfg.runtime.kv_num_blocks == 8


def test_unknown_drafter_lists_the_configured_ones() -> None:
    with pytest.raises(ConfigError, match="unknown drafter 'fast'; configured drafters: ngram, int8, dyn8, bf16"):
        load_config().drafter("fast")


def test_frozen() -> None:
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.model.dtype = "float16"  # type: ignore[misc]


BAD_CONFIGS = [
    ({"model": {"dtype": "int3"}}, r"\[model\] dtype must be one of"),
    ({"model": {"dtype": 5}}, r"\[model\] dtype must be str, got 5"),
    ({"model": {"max_model_len": 8}}, r"\[model\] max_model_len must be >= 16"),
    ({"model": {"colour": "red"}}, r"\[model\] unknown key\(s\): colour"),
    ({"runtime": {"attention": "flash"}}, r"\[runtime\] attention must be one of"),
    ({"runtime": {"kv_block_size": 0}}, r"\[runtime\] kv_block_size, kv_num_blocks, max_batch_size must be >= 1"),
    ({"runtime": {"threads": -1}}, r"threads >= 0"),
    ({"speculation": {"k": 33}}, r"\[speculation\] k must be in 0..32"),
    ({"speculation": {"k": 4.0}}, r"\[speculation\] k must be int, got 4.0"),
    ({"selection": {"policy": "fixed:fast"}}, r"\[selection\] policy 'fixed:fast' names no configured drafter"),
    ({"selection": {"policy": "oracle"}}, r"\[selection\] policy 'oracle' is evaluation only"),
    ({"selection": {"policy": "best"}}, r"\[selection\] policy 'best' is not one of"),
    ({"selection": {"policy": "fixed:ngram@0"}}, r"\[selection\] policy 'fixed:ngram@0': k must be an integer >= 1"),
    ({"selection": {"policy": "fixed:"}}, r"\[selection\] policy 'fixed:' needs a drafter name"),
    ({"selection": {"k_set": [4, 4]}}, r"\[selection\] k_set must be distinct"),
    ({"selection": {"alpha": -1}}, r"\[selection\] need alpha >= 0"),
    ({"runtime": {"profile": "sometimes"}}, r"\[runtime\] profile must be auto, measure or off"),
    ({"drafters": [NGRAM, NGRAM]}, r"name 'ng' is duplicated or reserved"),
    ({"drafters": [{"name": "none", "kind": "ngram"}]}, r"'none' is .*reserved"),
    ({"drafters": [{"name": "x", "kind": "rnn"}]}, r"x: kind must be one of"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "int3"}]},
     r"x: variant must be one of"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers"}]},
     r"x: variant 'layers' needs layers = \[...\]"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers", "layers": 3}]},
     r"layers must be a list"),
    ({"drafters": [{"name": "x", "kind": "model"}]}, r"x: kind 'model' needs path"),
    ({"drafters": [{**NGRAM, "ngram_min": 3, "ngram_max": 2}]},
     r"ng: need 1 <= ngram_min <= ngram_max"),
    ({"drafters": [{"name": "x"}]}, r"\[drafters\] .*missing .*'kind'"),
    ({"workers": [{"device": "cpu"}]}, r"\[workers\] .*missing .*'name'"),
    ({"gpu": {}}, r"unknown top-level section\(s\): gpu"),
]


@pytest.mark.parametrize("raw, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_values_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


# Values the loader lets through today or reports confusingly; the fix is proposed to the lead.
LOOSE_CONFIGS = [
    ({"drafters": [{"name": 5, "kind": "ngram"}]}, r"name must be str"),
    ({"model": "default"}, r"\[model\] must be a table"),
    ({"drafters": {"name": "ng", "kind": "ngram"}}, r"drafters.* must be an array"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers", "layers": [0, -1]}]}, r"x: layers must be"),
    ({"speculation": {"k": True}}, r"k must be int"),
]


@pytest.mark.parametrize("raw, message", LOOSE_CONFIGS, ids=[m for _, m in LOOSE_CONFIGS])
def test_loosely_checked_values_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndtype = 1")
    with pytest.raises(ConfigError, match=str(bad)):
        load_config(bad)


def test_a_written_config_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(DEFAULT_CONFIG_PATH.read_text().replace("k = 4", "k = 7"))
    cfg: SpindConfig = load_config(path)
    assert cfg.speculation.k == 7 and cfg == load_config(overrides={"speculation": {"k": 7}})
