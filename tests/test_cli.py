"""`spind` command line: JSON output through the real entry point, one clear error line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import new_req_id
from spind.cli import main
from spind.config import DEFAULT_CONFIG_PATH
from spind.coordinator.transport.local import GenRequest, LocalEngine
from spind.params import SamplingParams

QUESTION = "What is the capital of France?"


def run_spind(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spind.cli", *args], capture_output=True, text=True, timeout=300)


def assert_one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spind: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_generate_json_is_one_object_matching_in_process_decoding(engine: LocalEngine) -> None:
    proc = run_spind("generate", "--prompt", QUESTION, "--chat", "--max-tokens", "8", "--drafter", "ngram",
                     "--k", "3", "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert {"text", "token_ids", "num_drafted", "num_accepted", "elapsed_s"} <= set(out)
    assert out["drafter"] == "ngram" and out["elapsed_s"] > 0 and 0 <= out["num_accepted"] <= out["num_drafted"]
    assert 0 < len(out["token_ids"]) <= 8 and out["text"] == engine.tokenizer.decode(out["token_ids"])
    prompt = engine.tokenizer.apply_chat([{"role": "user", "content": QUESTION}])
    plain = engine.generate([GenRequest(new_req_id("cli"), prompt, SamplingParams(max_tokens=8))])[0]
    assert out["token_ids"] == plain.token_ids  # the CLI's speculative output is the target's greedy output


def test_bad_argument_exits_non_zero_with_one_line() -> None:
    proc = run_spind("generate", "--prompt", "hi", "--drafter", "turbo")
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_error_line(proc.stderr, "unknown drafter 'turbo'", "ngram, suffix, int8, dyn8, bf16")


@pytest.mark.parametrize("args, fragments", [
    (["--prompt", "hi", "--drafter", "turbo"], ["unknown drafter 'turbo'"]),
    (["--prompt", "hi", "--k", "-1"], ["--k must be >= 0"]),
    (["--prompt", "   "], ["empty prompt"]),
    (["--prompt", "hi", "--config", "/nonexistent/spind.toml"], ["config file not found"]),
    (["--prompt", "hi", "--drafter", "ngram", "--k", "0"], ["k = 0 drafts no tokens", "drafter 'ngram'", '"none"']),
    (["--prompt", "hi", "--k", "0"], ["k = 0 drafts no tokens", "auto selection"]),
], ids=["unknown-drafter", "negative-k", "empty-prompt", "missing-config", "k0-named-drafter", "k0-auto"])
def test_bad_generate_arguments(capsys: pytest.CaptureFixture, args: list[str], fragments: list[str]) -> None:
    assert main(["generate", *args]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert_one_error_line(out.err, *fragments)


def test_prompt_over_the_context_limit(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(DEFAULT_CONFIG_PATH.read_text().replace("max_model_len = 2048", "max_model_len = 16"))
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    assert main(["generate", "--config", str(config), "--prompt", prompt, "--drafter", "none", "--threads", "1"]) == 2
    assert_one_error_line(capsys.readouterr().err, "the context limit is 16")


def test_drafters_json_lists_the_configured_drafters(capsys: pytest.CaptureFixture) -> None:
    assert main(["drafters", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    rows = table["drafters"]
    assert [(r["name"], r["kind"], r["variant"]) for r in rows] == [
        ("ngram", "ngram", ""), ("suffix", "suffix", ""), ("int8", "self", "int8-weight-only"),
        ("dyn8", "self", "int8-dynamic"),
        ("bf16", "self", "bf16")]
    # this machine's cached profile when a start made one (tests run before may have), else nothing measured
    if table["profile"] is None:
        assert all(r["ms_per_token"] is None and r["used_by_auto"] is None for r in rows)
        assert "--measure" in table["note"]
    elif table["profile"]["implausible"] is None:  # the default lbss: auto uses a drafter iff it is under the bound
        bound = table["rule"]["max_cost_ratio"]
        assert table["rule"] == {"applies": True, "min_k": 2, "max_cost_ratio": 1.5}
        assert all(r["used_by_auto"] is (r["cost_ratio"] is None or r["cost_ratio"] < bound) for r in rows)
        assert all(r["used_by_auto"] or f">= {bound:.2f} (the rule)" in r["why_not"] for r in rows)


def test_bench_drafters_without_datasets_fails_before_loading(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    missing = tmp_path / "datasets"
    assert main(["bench", "drafters", "--datasets-dir", str(missing), "--out", str(tmp_path / "r.json")]) == 2
    assert_one_error_line(capsys.readouterr().err, "datasets folder not found", str(missing), "--datasets-dir")
    assert not (tmp_path / "r.json").exists()


def test_bench_drafters_rejects_unknown_names(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "drafters", "--datasets", "alpaca,wiki"]) == 2
    assert_one_error_line(capsys.readouterr().err, "unknown dataset 'wiki'")
    assert main(["bench", "drafters", "--drafters", "int8,turbo"]) == 2
    assert_one_error_line(capsys.readouterr().err, "unknown drafter 'turbo'")
