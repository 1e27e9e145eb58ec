"""The start-up profile's cache: a profile timed while other work shared the cores (a forward of several tokens
slower than decoding them one by one) is measured again and never cached, so one bad start cannot keep LBSS
from speculating on every start after it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

from spind import protocol as P
from spind.config import ModelConfig, RuntimeConfig, SpindConfig, validate
from spind.coordinator.placement import worker_names
from spind.coordinator.profile import SystemProfile, load_or_measure

# measured on a 2-core VM while a draft head trained beside it, then cached: verify 21x a decode step
LOADED = SystemProfile(4, {"ngram": 0.01, "eagle": 13.3}, {1: 116.7, 2: 50.9, 4: 184.5}, 0.0, 5.5,
                       {1: 5.5, 2: 8.3, 4: 10.9})
AT_REST = SystemProfile(4, {"ngram": 0.01, "eagle": 1.0}, {1: 14.6, 2: 20.1, 4: 31.0}, 0.0, 6.6,
                        {1: 6.6, 2: 8.3, 4: 10.9})


def test_a_forward_slower_than_its_tokens_one_by_one_is_implausible():
    assert AT_REST.implausible() is None
    why = LOADED.implausible()
    assert why is not None and "116.7 ms" in why and "5 single-token steps" in why
    assert SystemProfile(4, {}, {1: 14.6}, 0.0, 6.6, {1: 6.6, 8: 90.0}).implausible() is not None  # decode, batch 8
    assert SystemProfile(4, {}, {1: 500.0}, 0.0, None).implausible() is None  # nothing to judge it by


class Pool:
    """A target worker whose Profile replies come from `profiles`, one per measurement."""

    def __init__(self, profiles: list[SystemProfile]) -> None:
        self.profiles, self.calls, self.msgs = list(profiles), 0, []

    names = ["target"]

    def info(self, name):
        return SimpleNamespace(max_model_len=256, device="cpu")

    def describe(self):
        return [{"name": "target", "device": "cpu", "threads": 1}]

    async def call(self, name, msg, timeout_s):
        self.calls += 1
        self.msgs.append(msg)
        p = self.profiles[0]
        if msg.k == 0:  # the decode pass closes a measurement
            self.profiles.pop(0)
            return P.Profiled(msg.seq, {}, dict(p.decode_batch_ms))
        if msg.drafting:  # one request of each batch drafting msg.k
            return P.Profiled(msg.seq, {}, {b: p.lone_verify_ms[b][msg.k - 1] for b in msg.batch_sizes
                                            if b in p.lone_verify_ms})
        return P.Profiled(msg.seq, dict(p.draft_ms_per_token), dict(p.verify_ms))


def config(tmp_path) -> SpindConfig:
    return validate(SpindConfig(model=ModelConfig(max_model_len=256, cache_dir=str(tmp_path)),
                                runtime=RuntimeConfig(max_batch_size=4)))


def test_a_loaded_measurement_is_measured_again_and_only_a_plausible_one_cached(tmp_path):
    cfg = config(tmp_path)
    got = asyncio.run(load_or_measure(Pool([LOADED, AT_REST]), cfg, 10.0))
    assert got.verify_ms == AT_REST.verify_ms
    cached = list((tmp_path / "profiles").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["verify_ms"]["1"] == 14.6
    again = Pool([])  # the cache answers: nothing is measured
    assert asyncio.run(load_or_measure(again, cfg, 10.0)).verify_ms == AT_REST.verify_ms and again.calls == 0


def test_loaded_twice_serves_the_measurement_uncached_and_a_bad_cache_is_replaced(tmp_path):
    cfg = config(tmp_path)
    got = asyncio.run(load_or_measure(Pool([LOADED, LOADED]), cfg, 10.0))
    assert got.verify_ms == LOADED.verify_ms and not list((tmp_path / "profiles").glob("*.json"))
    asyncio.run(load_or_measure(Pool([AT_REST]), cfg, 10.0))
    path = next((tmp_path / "profiles").glob("*.json"))
    path.write_text(json.dumps(LOADED.to_json()))  # a cache written by an older spind, under load
    pool = Pool([AT_REST])
    assert asyncio.run(load_or_measure(pool, cfg, 10.0)).verify_ms == AT_REST.verify_ms and pool.calls == 7
    assert json.loads(path.read_text())["verify_ms"]["1"] == 14.6


def test_the_verify_probe_prefills_once_and_frees_every_block(tmp_path):
    """time_verify's probe requests share one prefilled context (forked KV, copied on write where a verify writes
    into a shared block): one prefill forward whatever the batch sizes, and every block back afterwards."""
    from tiny_model import write_tiny_checkpoint

    from spind.models.llama import load_llama
    from spind.models.runner import ModelRunner
    from spind.worker.profile import time_verify

    runner = ModelRunner(load_llama(write_tiny_checkpoint(tmp_path), "float32"), 64, 16, "packed", max_batch=8)
    free = runner.kv.num_free_blocks
    widths = []
    forward = runner.forward
    runner.forward = lambda items: widths.append([len(i.tokens) for i in items]) or forward(items)
    ms = time_verify(runner, [1, 2, 8], context=40, k=4, reps=2)  # 40: the verify writes into a shared block
    assert sorted(ms) == [1, 2, 8] and all(v > 0 for v in ms.values())
    assert widths[0] == [40] and all(w == [5] * len(w) for w in widths[1:])  # the one prefill, then verifies only
    assert sorted({len(w) for w in widths[1:]}) == [1, 2, 8]
    assert runner.kv.num_free_blocks == free and not runner.kv.seqs
    widths.clear()
    assert sorted(time_verify(runner, [2, 8], context=40, k=4, reps=1, drafting=1)) == [2, 8]
    assert widths[1:] and all(w == [5] + [1] * (len(w) - 1) for w in widths[1:])  # one request drafts, the rest not
    assert runner.kv.num_free_blocks == free and not runner.kv.seqs


def test_the_target_is_timed_alone_on_the_threads_it_verifies_with(tmp_path):
    """The drafters are timed first, every worker at once on its own threads, and the target's forwards then alone,
    on the threads it verifies with while nothing drafts beside it (all the cores, with adaptive threads): timed on
    its share, the profile priced batch 1's draft tokens at a 1-thread forward's cost while serving ran on 2."""
    from spind.coordinator.placement import verify_threads

    cfg = config(tmp_path)
    pool = Pool([AT_REST])
    asyncio.run(load_or_measure(pool, cfg, 10.0))
    first, *target = pool.msgs
    assert first.batch_sizes == [] and first.threads == 0  # the drafters alone, on the worker's own threads
    assert target and all(m.batch_sizes and m.threads == verify_threads(cfg, "cpu") for m in target)
    assert verify_threads(cfg, "cpu", num_cores=4) == 4 and verify_threads(cfg, "cuda", num_cores=4) == 4 // len(
        worker_names(cfg))
    still = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, adaptive_threads=False))
    assert verify_threads(still, "cpu", num_cores=4) == 4 // len(worker_names(cfg))
