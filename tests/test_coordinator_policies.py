"""The coordinator's pure parts, no processes, no model: scheduling, selection, capacities, restarts,
placement, metrics, stop-string hold-back and incremental detokenization."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import pytest

from spind.config import TARGET_WORKER, load_config
from spind.coordinator.metrics import EngineMetrics, SlotTimes
from spind.coordinator.placement import target_all_threads, threads_for, usable_cores, worker_names
from spind.coordinator.recovery import RestartPolicy
from spind.coordinator.request import Sequence, prompt_repetition
from spind.coordinator.scheduler import KVBudget, num_admissible, plan_prefill, visible_len
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, StaticSelector, fit_capacity
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer


def samples(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_engine_metrics_speculation_counters():
    m = EngineMetrics()
    m.record_verify("int8", 4, 2)
    m.record_verify("int8", 4, 0)
    m.record_verify("ngram", 0, 0)  # nothing drafted: nothing counted
    m.busy.labels(worker="draft", kind="draft").inc(0.25)
    s = samples(m.render())
    assert s['spind_draft_tokens_total{drafter="int8"}'] == 8
    assert s['spind_accepted_tokens_total{drafter="int8"}'] == 2
    assert s['spind_accepted_at_position_total{drafter="int8",position="1"}'] == 1
    assert s['spind_worker_busy_seconds_total{kind="draft",worker="draft"}'] == 0.25
    assert not any("ngram" in k for k in s) and not any(k.endswith("_created") for k in s)
    assert samples(EngineMetrics().render()) == samples(EngineMetrics().render())  # private registries


def test_slot_times():
    t = SlotTimes()
    t.record(0.1, 0.001)
    t.record(0.3, 0.003)
    d = t.describe()
    assert d["num_slots"] == 2 and d["mean_slot_ms"] == pytest.approx(200) and d["last_overhead_ms"] == pytest.approx(3)
    assert d["busy_s"] == {}
    t.record_busy("prefill", 0.02)
    t.record_busy("verify", 0.05)
    t.record_busy("prefill", 0.01)
    t.record_busy("verify", -1e-6)  # a clock that stepped back counts nothing
    assert t.describe()["busy_s"] == {"prefill": pytest.approx(0.03), "verify": pytest.approx(0.05)}
    d["busy_s"]["prefill"] = 9.0  # a snapshot: reading it changes nothing
    assert t.describe()["busy_s"]["prefill"] == pytest.approx(0.03)


def test_worker_plan_and_thread_shares():
    cfg = load_config()
    assert worker_names(cfg) == [TARGET_WORKER, "draft"]
    assert threads_for(cfg, "draft", num_cores=2) == 1 and threads_for(cfg, "target", num_cores=16) == 8
    assert threads_for(cfg, "target", num_cores=1) == 1  # never zero
    pinned = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, threads=3))
    assert threads_for(pinned, "draft", num_cores=2) == 3
    ngram_only = dataclasses.replace(cfg, drafters=tuple(d for d in cfg.drafters if d.kind == "ngram"))
    assert worker_names(ngram_only) == [TARGET_WORKER]


def test_the_target_alone_takes_the_threads_every_worker_was_granted():
    """adaptive_threads gives the target every worker's threads while nothing drafts elsewhere: the usable cores by
    default, never more than a threads setting grants (`--threads 2` on a 16-core host stays on 2 cores)."""
    cfg = load_config()
    assert target_all_threads(cfg, num_cores=16) == 16 and target_all_threads(cfg, num_cores=3) == 2  # 1 + 1
    pinned = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, threads=2))
    ngram_only = dataclasses.replace(pinned, drafters=tuple(d for d in cfg.drafters if d.kind == "ngram"))
    assert target_all_threads(ngram_only, num_cores=16) == 2 and target_all_threads(pinned, num_cores=16) == 4
    assert target_all_threads(pinned, num_cores=3) == 3  # two workers of 2 threads on 3 cores: never above the cores


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two usable cores")
def test_usable_cores_follow_the_cpu_affinity():
    """A process pinned to one core (taskset, a container's cpuset) counts one core, though os.cpu_count() counts
    the host's: threads sized by the host's count would oversubscribe it."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from spind.coordinator.placement import usable_cores; print(usable_cores(), os.cpu_count())")
    pinned, host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=60).stdout.split()
    assert int(pinned) == 1 and int(host) >= 2
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))  # a cgroup quota may bound it further


def test_visible_len_holds_back_stop_prefixes_and_partial_utf8():
    assert visible_len("hello wor", ("world",)) == len("hello ")
    assert visible_len("hello", ("xyz",)) == 5
    assert visible_len("ab\ufffd", ()) == 2
    assert visible_len("a END", ("END", "E")) == len("a END")  # a whole stop string is cut by Sequence, not here
    assert visible_len("abcab", ("abcabd",)) == 0


def test_kv_budget_and_fifo_admission():
    b = KVBudget(num_blocks=10, block_size=16)
    assert b.blocks_for(33) == 3
    assert num_admissible([3, 3, 3, 3], 0, 16, b) == 3  # the 4th does not fit
    assert num_admissible([3, 3], 15, 16, b) == 1  # batch limit
    assert num_admissible([11, 1], 0, 16, b) == 0  # FIFO: the head waits, nobody overtakes it
    b.reserve(9)
    assert not b.can_reserve(2) and num_admissible([1], 0, 16, b) == 1
    b.release(9)
    assert b.can_reserve(10)


def test_chunked_prefill_is_shortest_first_with_a_share_for_the_oldest():
    assert plan_prefill([2047, 7, 40], 256) == [209, 7, 40]  # the short ones at once, the long one the rest
    assert plan_prefill([100, 7, 400], 256) == [100, 7, 149]
    assert plan_prefill([100] * 4, 256) == [100, 100, 56, 0]  # a burst finishes one by one, not all at the end
    assert plan_prefill([2047] + [50] * 10, 256)[0] == 64  # never starved by a stream of short prompts
    assert plan_prefill([0, 5], 4) == [0, 4] and plan_prefill([], 4) == []
    rng = random.Random(3)
    for _ in range(200):  # never over budget, never more than asked, and the budget is used up when it can be
        left = [rng.choice([0, 1, 5, 40, 300]) for _ in range(rng.randrange(6))]
        got = plan_prefill(left, 64)
        assert sum(got) == min(64, sum(left)) and all(0 <= g <= n for g, n in zip(got, left))


def test_static_selector_bypass_default_and_capacity():
    sel = StaticSelector("int8", 4)
    reqs = [RequestInfo(req_id=r, requested=requested, requested_k=k, current=None, num_prompt_tokens=10,
                        num_output_tokens=0)
            for r, requested, k in (("a", "auto", None), ("b", "none", None), ("c", "ngram", 8), ("d", "auto", 2),
                                    ("e", "auto", None))]
    arms = sel.select(reqs, Capacity({"int8": 2, "ngram": 4}))
    assert arms == [Arm("int8", 4), PLAIN_ARM, Arm("ngram", 8), Arm("int8", 2), PLAIN_ARM]  # e: past B_int8
    assert sel.describe()["assignment"] == {"int8@4": 1, "none": 2, "ngram@8": 1, "int8@2": 1}
    sel.remove("a")
    assert "int8@4" not in sel.describe()["assignment"]
    assert StaticSelector("none", 4).select(reqs[:1], Capacity()) == [PLAIN_ARM]


def test_fit_capacity_drops_to_plain_in_request_order():
    arms = [Arm("x", 4), Arm("y", 4), Arm("x", 2), Arm("x", 4), PLAIN_ARM]
    assert fit_capacity(arms, Capacity({"x": 2, "y": 0})) == [Arm("x", 4), PLAIN_ARM, Arm("x", 2), PLAIN_ARM,
                                                               PLAIN_ARM]


def test_drafter_capacity_is_bounded_by_its_worker():
    cfg = load_config()
    assert cfg.drafter_capacity("int8") == cfg.runtime.max_batch_size
    small = dataclasses.replace(cfg, workers=(dataclasses.replace(cfg.worker("draft"), max_batch_size=3),),
                                drafters=tuple(dataclasses.replace(d, max_batch_size=5) for d in cfg.drafters))
    assert small.worker_capacity("draft") == 3 and small.drafter_capacity("int8") == 3
    assert small.drafter_capacity("ngram") == 5


def test_restarts_are_rate_limited_over_a_window_not_counted_forever():
    p = RestartPolicy(max_restarts=2, window_s=60)
    assert p.allow("w", 0) and p.allow("w", 10)
    assert not p.allow("w", 20)  # a crash loop gives up
    assert p.allow("other", 20)  # per worker
    assert p.allow("w", 75) and p.recent("w", 75) == 1  # the old restarts have left the window


def test_prompt_repetition_is_high_for_text_that_repeats_itself():
    assert prompt_repetition([1, 2]) == 0.0
    assert prompt_repetition(list(range(100))) == 0.0
    assert prompt_repetition(list(range(20)) * 5) == pytest.approx(78 / 98)  # 20 distinct cyclic 3-grams


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def test_incremental_text_equals_decoding_the_whole_output(tokenizer: Tokenizer):
    """Token by token and in random chunks, with multi-byte characters, emoji and special tokens mixed in:
    the streamed text always equals decoding all the output tokens at once."""
    texts = ["Héllo wörld 你好 🎉 code:\n    return x", "  leading spaces\n\n\ttabs", "family 👩‍👩‍👧 flag 🇫🇷."]
    rng = random.Random(0)
    cases = [tokenizer.encode(t) for t in texts] + [[rng.randrange(tokenizer.vocab_size) for _ in range(30)]
                                                   for _ in range(50)]
    for ids in cases:
        seq = Sequence("s", [1, 2], SamplingParams(max_tokens=len(ids), ignore_eos=True), frozenset(), 4096, tokenizer)
        i = 0
        while i < len(ids):
            n = rng.randint(1, 5)
            seq.append(ids[i:i + n])
            i += n
        assert seq.finish_reason == "length" and seq.text == tokenizer.decode(ids)


def test_stop_string_straddling_two_appends_is_found(tokenizer: Tokenizer):
    ids = tokenizer.encode("The answer is forty-two. Done.")
    seq = Sequence("s", [1], SamplingParams(max_tokens=64, stop=("forty-two",)), frozenset(), 4096, tokenizer)
    for t in ids:
        seq.append([t])
        if seq.is_finished:
            break
    assert seq.text == "The answer is " and seq.finish_reason == "stop"
    assert tokenizer.decode(seq.output_ids).startswith("The answer is forty-two")  # ids kept up to the completing one
