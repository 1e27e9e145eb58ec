"""`spind bench batch`: its argument checks, and one short run on the real default model over a quality text made
here (tests never read the shared datasets): the phases it reports add up to the step, the stack's own timers see
its calls, and timing changes no result. `--against`: another tree's kernels built under their own op namespace, a
target loaded on them, and its rounds paired with this build's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from spind.bench.batch import BatchBenchSettings, _measure, render_tables, run_batch_bench
from spind.bench.cli import batch_settings
from spind.bench.quality import QUALITY_DATASET
from spind.bench.report import Progress
from spind.config import SpindConfig
from spind.kernels import cpu_ext

TEXT = ("The keeper climbed the ninety steps of the lighthouse every evening to light the lamp, and the ships that "
        "passed in the night saw its beam sweep across the water. ")


def args(datasets_dir: Path, **overrides) -> argparse.Namespace:
    base = dict(batch="1,4", context=64, k=0, rounds=2, threads=None, datasets_dir=datasets_dir)
    return argparse.Namespace(**{**base, **overrides})


@pytest.fixture
def datasets_dir(tmp_path: Path) -> Path:
    path = tmp_path / QUALITY_DATASET
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([{"instruction": f"Tell story {i}.", "output": TEXT * 3} for i in range(12)]))
    return tmp_path


def test_settings_reject_bad_arguments(cfg: SpindConfig, datasets_dir: Path) -> None:
    s = batch_settings(args(datasets_dir), cfg)
    assert (s.batches, s.context, s.k, s.rounds, s.after_decodes) == ((1, 4), 64, 0, 2, 0)
    assert batch_settings(args(datasets_dir, after_decodes=3), cfg).after_decodes == 3
    for bad, message in ((dict(batch="4,1"), "increasing"), (dict(batch="1,1"), "increasing"),
                         (dict(batch="0"), ">= 1"), (dict(context=0), "context"), (dict(k=-1), "--k"),
                         (dict(context=cfg.model.max_model_len), "max_model_len"), (dict(rounds=0), "rounds"),
                         (dict(after_decodes=-1), "after-decodes")):
        with pytest.raises(ValueError, match=message):
            batch_settings(args(datasets_dir, **bad), cfg)


def test_against_takes_a_checkout_or_its_kernel_sources(cfg: SpindConfig, datasets_dir: Path, tmp_path: Path) -> None:
    assert batch_settings(args(datasets_dir), cfg).against is None
    checkout = tmp_path / "other"
    (checkout / "kernels" / "csrc").mkdir(parents=True)
    (checkout / "kernels" / "csrc" / "ops.cpp").write_text("// a kernel source\n")
    for given in (checkout, checkout / "kernels" / "csrc"):
        assert batch_settings(args(datasets_dir, against=given), cfg).against == (checkout / "kernels" / "csrc")
    with pytest.raises(ValueError, match="holds kernel sources"):
        batch_settings(args(datasets_dir, against=tmp_path / "nothing-here"), cfg)
    with pytest.raises(ValueError, match="holds kernel sources"):
        batch_settings(args(datasets_dir, against=checkout / "kernels"), cfg)


@pytest.mark.parametrize("k", [0, 2])
def test_a_short_run_accounts_for_the_step(cfg: SpindConfig, datasets_dir: Path, k: int) -> None:
    settings = BatchBenchSettings(batches=(1, 3), context=48, k=k, rounds=2, threads=(1,), datasets_dir=datasets_dir)
    results = run_batch_bench(cfg, settings)
    (run,) = results["runs"]
    assert run["stack_profiled"] == cpu_ext.available()  # the default target runs the fused stack
    assert [r["batch"] for r in run["rows"]] == [1, 3] and [r["rows"] for r in run["rows"]] == [k + 1, 3 * (k + 1)]
    for r in run["rows"]:
        phases = r["phases_ms"]
        if run["stack_profiled"]:
            assert min(phases["gemm"], phases["attention"], phases["row_ops"]) > 0
        assert phases["lm_head"] > 0
        # each phase is a disjoint part of the same step (the head timed inside the forward), so none is negative
        assert min(phases.values()) >= 0
        # medians of parts need not add to the median step exactly, but a phase never exceeds the step
        assert max(phases.values()) < r["step_ms"] * 1.5
        assert r["tokens_per_s"] == pytest.approx(r["rows"] / r["step_ms"] * 1e3, rel=0.5)
    assert run["rows"][0]["step_over_first"] == 1.0
    table = render_tables(results)
    assert "Where a batched step goes" in table and ("gemm" in table) == run["stack_profiled"]


def test_after_decodes_steps_the_requests_plainly_before_each_timed_step(cfg: SpindConfig, datasets_dir: Path,
                                                                        monkeypatch) -> None:
    """`--after-decodes N`: every timed (k+1)-row step (the warm-up's too) follows N decode steps of the same requests,
    untimed and rolled back like it, so every round still sees the same contexts."""
    from spind.worker.target import TargetVerifier

    calls = []
    verify = TargetVerifier.verify

    def counted(self, items):
        calls.append(tuple(len(item.draft) for item in items))
        return verify(self, items)
    monkeypatch.setattr(TargetVerifier, "verify", counted)
    settings = BatchBenchSettings(batches=(1, 2), context=48, k=2, rounds=2, threads=(1,), datasets_dir=datasets_dir,
                                  after_decodes=3)
    results = run_batch_bench(cfg, settings)
    timed = [i for i, c in enumerate(calls) if any(c)]
    assert [calls[i] for i in timed] == [(2,), (2, 2)] * 3  # warm-up and 2 rounds, at B = 1 and 2
    for i in timed:  # each after 3 decode steps of its requests
        assert calls[i - 3:i] == [(0,) * len(calls[i])] * 3
    assert len(calls) == 4 * len(timed)
    assert "each after 3 untimed decode steps" in render_tables(results)


@pytest.mark.skipif(not cpu_ext.available(), reason="the fused stack needs spind's CPU kernels")
def test_the_stack_timers_change_no_result(engine) -> None:
    model = engine.target.runner.model
    assert model.fused_stack is not None
    from spind.models.runner import ForwardItem, ModelRunner

    ops = cpu_ext.ops()

    def logits(profiled: bool) -> torch.Tensor:
        runner = ModelRunner(model, 8, 16, "invariant")
        runner.add_request("p")
        ops.stack_profile(profiled)
        try:
            return runner.forward([ForwardItem("p", list(range(100, 140)), 40)])[0]
        finally:
            gemm, attention, row_ops, calls = ops.stack_profile(False).tolist()
            assert (calls, gemm > 0, attention > 0, row_ops > 0) == ((1, True, True, True) if profiled
                                                                      else (0, False, False, False))

    assert torch.equal(logits(True), logits(False))


PROBE = """
#include <torch/library.h>
int64_t probe() { return 7; }
TORCH_LIBRARY(SPIND_OPS, m) { m.def("probe() -> int", &probe); }
"""


@pytest.mark.skipif(not cpu_ext.available(), reason="needs spind's CPU kernels (a build for this CPU)")
def test_another_trees_kernels_build_under_their_own_namespace(tmp_path: Path) -> None:
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "probe.cpp").write_text(PROBE)
    name = cpu_ext.build_other(csrc)
    assert name.startswith(f"spind_cpu_{cpu_ext.best_isa()}_ab")
    assert cpu_ext.ops() is not getattr(torch.ops, name)
    with cpu_ext.ops_from(name):
        assert cpu_ext.ops().probe() == 7
    assert cpu_ext.ops() is getattr(torch.ops, f"spind_cpu_{cpu_ext.best_isa()}")  # back to this build


@pytest.mark.skipif(not cpu_ext.available(), reason="the fused stack needs spind's CPU kernels")
def test_a_run_against_another_build_pairs_every_round(cfg: SpindConfig, datasets_dir: Path) -> None:
    # the other target runs this build's own namespace: what is tested is the pairing of rounds, not a kernel
    namespace = f"spind_cpu_{cpu_ext.best_isa()}"
    settings = BatchBenchSettings(batches=(1, 2), context=48, k=1, rounds=3, threads=(1,), datasets_dir=datasets_dir)
    run = _measure(cfg, settings, Progress(total=3), namespace)
    other = run["against"]
    assert other["namespace"] == namespace and [r["rows"] for r in other["rows"]] == [2, 4]
    for r in other["ratios"]:
        for phase in ("step", "gemm", "attention"):
            q1, median, q3 = r["over_against"][phase]
            assert 0 < q1 <= median <= q3
    table = render_tables({"settings": {**settings.__dict__, "against": "/elsewhere/kernels/csrc"},
                           "environment": {"dtype": "gguf", "cpu": "", "kernels": namespace, "kv_cache_dtype": "auto"},
                           "runs": [run]})
    assert "This build / /elsewhere/kernels/csrc" in table and "step ratio" in table and "attention ratio" in table
