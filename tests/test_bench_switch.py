"""`spind bench switch`: a tiny real run on the default model's draft worker, and its argument checks."""

from __future__ import annotations

import json

import pytest

from spind.cli import main


def test_a_tiny_switch_run_reports_both_modes_per_context(tmp_path, capsys):
    out = tmp_path / "switch.json"
    assert main(["bench", "switch", "--contexts", "8,24", "--reps", "2", "--k", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["worker"] == "draft" and results["settings"]["from_drafter"] == "int8"
    assert [r["context"] for r in results["rows"]] == [8, 24]
    for r in results["rows"]:
        assert all(r[key] > 0 for key in ("switch_cold_ms", "switch_precomputed_ms", "steady_ms", "precompute_ms"))
        assert r["speedup"] == pytest.approx(r["switch_cold_ms"] / r["switch_precomputed_ms"])
    assert "int8 -> dyn8" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--to", "ngram"], "two different model drafters"),
    (["--to", "int8"], "two different model drafters"),
    (["--to", "turbo"], "unknown drafter 'turbo'"),
    (["--contexts", "8,x"], "comma-separated integers"),
    (["--contexts", "4096"], "below max_model_len"),
])
def test_bad_arguments_fail_before_any_model_loads(args, message, capsys):
    assert main(["bench", "switch", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
