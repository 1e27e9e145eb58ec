"""The micro-batch heuristic (paper §VI-B): on the profile recorded on this CPU it picks what a brute-force sweep
of the pipeline model over the same profile picks; on a saturated target (the paper's regime) it splits."""

from __future__ import annotations

import pytest

from spind.coordinator.microbatch import (best_micro_batches, choose_micro_batches, interpolate, pipeline_goodput,
                                          throughput)

K = 4
# Recorded here: the fp32 SmolLM2-135M target on 2 CPU cores, ms per verify pass of k+1 = 5 tokens a request;
# the int8 self-draft, 35 ms per draft token at batch 1, +5 % per extra request (reading the weights dominates).
CPU_VERIFY = {1: 85.0, 2: 95.0, 4: 120.0, 8: 180.0, 16: 300.0}
CPU_DRAFT = {1: K * 35.0, 16: K * 35.0 * 1.75}
# The paper's setting: LLaMA-7B on a V100 verifying batches of 5-token drafts over long contexts is compute
# bound past a few requests (8 ms + 6 ms a request), and its SSMs' batch drafting grows with the batch too
# (4 ms + 5 ms a request): there, smaller micro-batches let drafting and verification overlap.
GPU_VERIFY = {m: 8.0 + 6.0 * m for m in (1, 2, 4, 8, 16, 32)}
GPU_DRAFT = {m: 4.0 + 5.0 * m for m in (1, 2, 4, 8, 16, 32)}
PROFILES = {"cpu": (CPU_VERIFY, CPU_DRAFT), "gpu": (GPU_VERIFY, GPU_DRAFT)}


def test_interpolation_and_throughput():
    assert interpolate(CPU_VERIFY, 3) == pytest.approx(107.5) and interpolate(CPU_VERIFY, 1) == 85.0
    assert interpolate(CPU_VERIFY, 32) == pytest.approx(600.0)  # beyond the profile: no better than linear
    assert throughput(GPU_VERIFY, 16) > throughput(GPU_VERIFY, 8) > throughput(GPU_VERIFY, 1)


@pytest.mark.parametrize("batch", [2, 4, 8, 16])
def test_on_the_recorded_cpu_profile_the_heuristic_picks_the_brute_force_count(batch):
    d, v = (lambda m: interpolate(CPU_DRAFT, m)), (lambda m: interpolate(CPU_VERIFY, m))
    tokens = K * 0.8 + 1  # committed per request and round
    assert choose_micro_batches(CPU_VERIFY, batch) == best_micro_batches(batch, tokens, d, v)


@pytest.mark.parametrize("batch", [8, 16])
def test_on_a_saturated_target_splitting_pays_and_the_heuristic_splits(batch):
    d, v = (lambda m: interpolate(GPU_DRAFT, m)), (lambda m: interpolate(GPU_VERIFY, m))
    chosen = choose_micro_batches(GPU_VERIFY, batch)
    assert chosen >= 2 and pipeline_goodput(batch, chosen, 4.2, d, v) > pipeline_goodput(batch, 1, 4.2, d, v)


def test_counts_that_leave_the_micro_batch_size_unchanged_are_skipped():
    flat = {m: 10.0 * m for m in (1, 2, 4, 8, 16)}  # a fully saturated target: splitting never costs throughput
    b = choose_micro_batches(flat, 16)
    assert b == 8  # 9 would leave micro-batches of 2, as 8 does, with one more pass


def test_a_cpu_batch_is_not_split_and_a_gpu_batch_is():
    assert choose_micro_batches(CPU_VERIFY, 8) == 1  # halving the pass costs the CPU target a third of its rate
    assert choose_micro_batches(GPU_VERIFY, 16) >= 2  # a saturated target barely notices smaller passes
    assert choose_micro_batches(GPU_VERIFY, 1) == 1 and choose_micro_batches(GPU_VERIFY, 3, max_b=2) <= 2
