"""The coordinator's scheduling, selection, capacities, faults and bookkeeping, over scripted in-process
workers (tests/scripted_worker.py): the real Coordinator and InProcessPool, no model, milliseconds a test."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from contextlib import aclosing
from pathlib import Path
from unittest import mock

import pytest

from scripted_worker import EOS, FUSED_S, SHADOW_S, ScriptedWorker, continuation, write_tokenizer
from spind import protocol as P
from spind.config import (DrafterConfig, ModelConfig, RuntimeConfig, SelectionConfig, SpeculationConfig, SpindConfig,
                          WorkerConfig, validate)
from spind.coordinator.engine import Coordinator
from spind.coordinator.interface import Delta, EngineRequest
from spind.coordinator.pipeline import Pipeline
from spind.coordinator.placement import worker_names
from spind.coordinator.transport.pool import InProcessPool
from spind.coordinator.selection.lbss import NUM_BUCKETS, LBSSSelector
from spind.coordinator.selection.protocol import StaticSelector
from spind.coordinator.selection.regime import PLAIN as PLAIN_REGIME
from spind.coordinator.selection.regime import SELECT as SELECT_REGIME
from spind.coordinator.selection.regime import RegimeTrial
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer

DRAFTERS = (DrafterConfig("good", "self", "bf16", worker="draft"), DrafterConfig("bad", "self", "bf16", worker="draft"),
            DrafterConfig("half", "self", "bf16", worker="draft"), DrafterConfig("inl", "ngram", worker="target"))


CACHE_DIR = tempfile.mkdtemp(prefix="spind-test-cache-")  # the scripted profile is cached here, not in ~/.cache
PIPELINE = [False, True]  # every test runs with lockstep slots and with the pipeline
MODE = {"pipeline": False}


@pytest.fixture(autouse=True, params=PIPELINE, ids=["lockstep", "pipeline"])
def mode(request):
    MODE["pipeline"] = request.param
    yield request.param


def make_cfg(max_batch: int = 8, kv_blocks: int = 256, block_size: int = 4, prefill_budget: int = 64,
             drafter_caps: dict[str, int] | None = None, draft_worker_cap: int = 0,
             cache_dir: str = CACHE_DIR, micro_batches: int = 0, policy: str = "fixed:good",
             fuse_prefill: bool = False) -> SpindConfig:
    drafters = tuple(DrafterConfig(d.name, d.kind, d.variant, worker=d.worker,
                                   max_batch_size=(drafter_caps or {}).get(d.name, 0)) for d in DRAFTERS)
    return validate(SpindConfig(
        model=ModelConfig(max_model_len=256, cache_dir=cache_dir),
        runtime=RuntimeConfig(kv_block_size=block_size, kv_num_blocks=kv_blocks, max_batch_size=max_batch,
                              max_prefill_tokens=prefill_budget, pipeline=MODE["pipeline"], profile="measure",
                              micro_batches=micro_batches, fuse_prefill=fuse_prefill),
        speculation=SpeculationConfig(k=4), selection=SelectionConfig(policy=policy), drafters=drafters,
        workers=(WorkerConfig("draft", max_batch_size=draft_worker_cap),)))


class RecordingSelector(StaticSelector):
    def __init__(self) -> None:
        super().__init__("good", 4)
        self.feedback: list[list[P.BusyInterval]] = []
        self.removed: list[str] = []

    def observe(self, feedback) -> None:
        self.feedback.append(list(feedback))

    def remove(self, req_id: str) -> None:
        super().remove(req_id)
        self.removed.append(req_id)


class FlakyPool(InProcessPool):
    """Workers can be declared dead; restart rebuilds them (fresh state), as for a process."""

    dead: set[str]

    def is_alive(self, name: str) -> bool:
        return name not in self.dead and super().is_alive(name)

    async def restart(self, name: str) -> None:
        await super().restart(name)
        self.dead.discard(name)


class Env:
    def __init__(self, tmp_path: Path, cfg: SpindConfig, selector=None, draft_ms: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        hosted = {n: [d.name for d in cfg.drafters if d.worker == n] for n in worker_names(cfg)}
        self.workers: dict[str, ScriptedWorker] = {}  # the latest incarnation of each, kept after the pool stops

        def make(name: str) -> ScriptedWorker:
            self.workers[name] = ScriptedWorker(name, hosted[name], name == "target", draft_ms)
            return self.workers[name]

        self.pool = FlakyPool(list(hosted), make)
        self.pool.dead = set()
        self.coordinator = Coordinator(cfg, self.pool, Tokenizer(write_tokenizer(tmp_path / "tok")), selector)

    def worker(self, name: str) -> ScriptedWorker:
        return self.workers[name]

    def ops(self, name: str, kind: type) -> list:
        return [m for m in self.worker(name).log if isinstance(m, kind)]

    def prefills(self, name: str) -> list:
        """The ops that wrote prefill chunks on the worker, in order: Prefill ops and verifies they rode in."""
        return [m for m in self.worker(name).log if isinstance(m, P.Prefill) or isinstance(m, P.Verify) and m.prefill]


def chunks_of(op: P.Prefill | P.Verify) -> list[P.PrefillItem]:
    return op.items if isinstance(op, P.Prefill) else op.prefill


async def collect(c: Coordinator, req: EngineRequest) -> list[Delta]:
    async with aclosing(c.generate(req)) as stream:
        return [d async for d in stream]


def request(req_id: str, prompt: list[int], drafter: str = "auto", max_tokens: int = 12, k: int | None = None):
    return EngineRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens), drafter, k)


def run(env: Env, reqs: list[EngineRequest]) -> list[list[Delta]]:
    async def go():
        await env.coordinator.start()
        try:
            return await asyncio.gather(*(collect(env.coordinator, r) for r in reqs))
        finally:
            await env.coordinator.shutdown(drain=False)
    return asyncio.run(go())


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


PROMPTS = [[3, 5, 7], [11, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], [9]]


def test_every_drafter_and_plain_decoding_give_the_targets_output(tmp_path):
    env = Env(tmp_path, make_cfg())
    reqs = [request(f"{d}-{i}", p, d) for d in ("none", "good", "bad", "half", "inl", "auto") for i, p in
            enumerate(PROMPTS)]
    out = run(env, reqs)
    for r, deltas in zip(reqs, out):
        assert tokens_of(deltas) == continuation(r.prompt_ids, 12), r.req_id
        assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
        assert "".join(d.text for d in deltas) == " ".join(f"t{t}" for t in tokens_of(deltas))
        u = deltas[-1].usage
        drafted, accepted = (sum(v[key] for v in u.drafters.values()) for key in ("drafted", "accepted"))
        if r.drafter in ("good", "auto"):
            assert drafted > 0 and accepted == drafted and u.num_steps <= 4
        elif r.drafter == "bad":
            assert drafted > 0 and accepted == 0
        elif r.drafter == "none":
            assert u.drafters == {} and u.num_steps == 12


def test_admission_is_fifo_within_the_batch_limit(tmp_path):
    env = Env(tmp_path, make_cfg(max_batch=2))
    reqs = [request(f"r{i}", p, "none") for i, p in enumerate(PROMPTS)]
    out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(p, 12) for p in PROMPTS]
    assert [m.req_id for m in env.ops("target", P.AddRequest)] == ["r0", "r1", "r2", "r3"]
    assert max(len(m.items) for m in env.ops("target", P.Verify)) == 2


def test_the_kv_budget_holds_the_head_and_nobody_overtakes_it(tmp_path):
    # 4-token blocks, 20 in all. r0: 20 + 20 tokens = 10 blocks, r1: 4 + 20 = 6; r2 needs 12 and must wait;
    # r3 needs 2, which would fit, but it arrived after r2.
    env = Env(tmp_path, make_cfg(kv_blocks=20))
    reqs = [request("r0", list(range(1, 21)), "none", 20), request("r1", [1, 2, 3, 4], "none", 20),
            request("r2", list(range(1, 29)), "none", 20), request("r3", [5], "none", 7)]
    out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, r.params.max_tokens) for r in reqs]
    assert [m.req_id for m in env.ops("target", P.AddRequest)] == ["r0", "r1", "r2", "r3"]
    running_at_add = {}
    for m in env.worker("target").log:  # which requests had been freed when r2 and r3 were added
        if isinstance(m, P.AddRequest):
            running_at_add[m.req_id] = {x.req_ids[0] for x in env.ops("target", P.FreeRequests)
                                        if env.worker("target").log.index(x) < env.worker("target").log.index(m)}
    assert running_at_add["r2"] and running_at_add["r3"] >= running_at_add["r2"]
    assert env.coordinator.phases.budget.num_reserved == 0


def test_each_drafter_and_each_worker_keep_their_batch_limits(tmp_path):
    env = Env(tmp_path, make_cfg(drafter_caps={"good": 1}, draft_worker_cap=2))
    reqs = [request(f"g{i}", p, "good") for i, p in enumerate(PROMPTS[:3])] + [request("h", PROMPTS[3], "half"),
                                                                               request("b", PROMPTS[0], "bad")]
    out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, 12) for r in reqs]
    proposes = env.ops("draft", P.Propose)
    assert proposes and max(len(m.items) for m in proposes) <= 2  # the draft worker's own limit
    assert max(sum(it.drafter == "good" for it in m.items) for m in proposes) == 1  # B_good


def test_selector_feedback_and_remove(tmp_path):
    sel = RecordingSelector()
    env = Env(tmp_path, make_cfg(), sel)
    reqs = [request("g", PROMPTS[0], "good"), request("b", PROMPTS[1], "bad"), request("i", PROMPTS[2], "inl"),
            request("n", PROMPTS[3], "none")]
    run(env, reqs)
    assert sorted(sel.removed) == ["b", "g", "i", "n"]  # each finished request removed exactly once
    by_req: dict[str, list] = {}
    for slot in sel.feedback:
        for f in slot:
            by_req.setdefault(f.req_id, []).append(f)
            assert f.batch_size >= len(slot) and f.verify_s == pytest.approx(0.003)  # + first tokens, unselected
            assert 0 <= f.num_accepted <= f.num_drafted <= f.arm.k and 1 <= f.num_committed <= f.num_accepted + 1
            assert f.select_s > 0  # its share of the selector's calls and of the worker's shadow drafting
        # the verify's shadow drafting is split over its requests (those verified with their first token included)
        assert sum(f.select_s for f in slot) >= SHADOW_S * len(slot) / slot[0].batch_size
    for req_id, drafter in (("g", "good"), ("b", "bad"), ("i", "inl")):
        fb = by_req[req_id]
        assert sum(f.num_committed for f in fb) == 12 - 1  # the first token came with the prefill, unselected
        assert all(f.arm.drafter == drafter for f in fb)
    assert all(f.draft_s == pytest.approx(0.002) for f in by_req["g"] if f.num_drafted)  # the Propose's time
    assert all(f.draft_s == pytest.approx(0.001) for f in by_req["i"] if f.num_drafted)  # inline on the target
    assert all(f.num_accepted == 0 for f in by_req["b"]) and all(f.arm.drafter is None for f in by_req["n"])


def test_a_verify_on_the_targets_share_of_the_cores_teaches_the_cost_model_nothing(tmp_path):
    """With adaptive threads the target verifies on every core while nothing drafts beside it, and on its own share
    while a drafter worker drafts: the verify-cost model (and the profile) price the former, so the feedback of a
    slot verified on the share carries no forward to learn from (batch_tokens 0), while one drafted on the target's
    own worker does."""
    cfg = make_cfg()
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, threads=1))
    sel = RecordingSelector()
    env = Env(tmp_path, cfg, sel)
    if env.coordinator.phases.all_threads < 2:
        pytest.skip("one usable core: the target's share is every core")

    async def go():
        c = env.coordinator
        await c.start()
        try:
            shares = c.phases.on_share(0), c.phases.on_share(c.phases.all_threads)
            await collect(c, request("g", PROMPTS[0], "good"))
            await collect(c, request("i", PROMPTS[1], "inl"))
            return shares
        finally:
            await c.shutdown(drain=False)
    assert asyncio.run(go()) == (True, False)
    by_req: dict[str, list] = {}
    for f in (f for slot in sel.feedback for f in slot):
        by_req.setdefault(f.req_id, []).append(f)
    assert by_req["g"] and all(f.batch_tokens == 0 for f in by_req["g"])  # drafted on the draft worker
    assert by_req["i"] and all(f.batch_tokens == f.num_drafted + 1 for f in by_req["i"])  # inline, every core
    fixed = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, adaptive_threads=False))
    assert not started(Env(tmp_path / "fixed", fixed), lambda ph: ph.on_share(0))  # one thread count: no share


def started(env: Env, read):
    """read(phases) while the engine runs (the workers have greeted)."""
    async def go():
        await env.coordinator.start()
        try:
            return read(env.coordinator.phases)
        finally:
            await env.coordinator.shutdown(drain=False)
    return asyncio.run(go())


def test_lbss_leaves_out_drafters_that_cost_more_than_a_target_step(tmp_path):
    # the scripted target's 1-token step costs 2.5 ms; at the smallest k (2) a drafter cannot pay from 3.75 ms a
    # draft token on ("bad"); "half" at 3.5 ms still can, when most drafts are accepted
    env = Env(tmp_path, make_cfg(policy="lbss"), draft_ms={"bad": 3.75, "half": 3.5})
    outs = run(env, [request("a", PROMPTS[0]), request("b", PROMPTS[1], "bad")])
    c = env.coordinator
    assert c.phases.profile.decode_ms == pytest.approx(2.5) and c.dominated_drafters == ["bad"]
    assert c.phases.selector.arm_set.drafters == ("good", "half", "inl")
    assert all(len(tokens_of(o)) == 12 for o in outs)  # a request may still name it
    assert any(it.drafter == "bad" for m in env.ops("draft", P.Propose) for it in m.items)


def test_lockstep_slots_where_selection_may_draft_only_beside_the_target(tmp_path, mode):
    """Every drafter on the draft worker costs more than it can save, so LBSS leaves them out and chooses only "inl"
    (inline on the target): the pipeline would have no drafting to overlap, and the engine runs lockstep slots. A
    request that names a left-out drafter is still served, its draft and verify in turn. Where selection may
    choose a drafter on the draft worker, the configured loop stays."""
    slow = {"good": 10.0, "bad": 10.0, "half": 10.0}
    env = Env(tmp_path, make_cfg(policy="lbss"), draft_ms=slow)
    outs = run(env, [request("a", PROMPTS[0]), request("b", PROMPTS[1], "good")])
    c = env.coordinator
    assert c.selectable == ["inl"] and not isinstance(c.loop, Pipeline)
    assert [tokens_of(o) for o in outs] == [continuation(PROMPTS[0], 12), continuation(PROMPTS[1], 12)]
    assert any(it.drafter == "good" for m in env.ops("draft", P.Propose) for it in m.items)
    env = Env(tmp_path / "b", make_cfg(policy="lbss"))
    run(env, [request("a", PROMPTS[0])])
    assert isinstance(env.coordinator.loop, Pipeline) == mode


def test_a_new_request_gets_its_likely_drafters_kv_precomputed(tmp_path):
    env = Env(tmp_path, make_cfg())
    run(env, [request("a", PROMPTS[2], "auto")])
    add, pre = env.ops("draft", P.AddRequest), env.ops("draft", P.Precompute)
    assert [(m.req_id, m.tokens) for m in add] == [("a", PROMPTS[2])]  # mirrored with its prompt at admission
    assert [(it.req_id, it.drafter, it.base_len) for m in pre for it in m.items] == [("a", "good", len(PROMPTS[2]))]
    assert env.worker("draft").precomputed == [("a", "good")]  # run in the worker's idle time
    log = env.worker("draft").log
    first_propose = env.ops("draft", P.Propose)[0]
    assert log.index(pre[0]) < log.index(first_propose)
    assert first_propose.items[0].base_len == len(PROMPTS[2])  # then only what was committed since


@pytest.mark.parametrize("fuse", [False, True], ids=["prefill-ops", "fused"])
def test_chunked_prefill_keeps_the_budget_and_lets_short_requests_through(tmp_path, fuse):
    env = Env(tmp_path, make_cfg(prefill_budget=8, fuse_prefill=fuse))
    long_prompt = list(range(1, 41))
    out = run(env, [request("long", long_prompt, "none", 4), request("short", [7, 8, 9], "none", 4)])
    assert [tokens_of(d) for d in out] == [continuation(long_prompt, 4), continuation([7, 8, 9], 4)]
    prefills = env.prefills("target")
    # fused: the long prompt's chunks ride in the verifies of the short request's slots (a Prefill op where none runs)
    assert any(isinstance(m, P.Verify) for m in prefills) == fuse
    assert all(sum(it.num_tokens for it in chunks_of(m)) <= 8 for m in prefills)
    assert sum(it.num_tokens for m in prefills for it in chunks_of(m) if it.req_id == "long") == 39  # all but the last
    log = env.worker("target").log
    last_long_prefill = max(log.index(m) for m in prefills if any(it.req_id == "long" for it in chunks_of(m)))
    first_short_verify = min(log.index(m) for m in env.ops("target", P.Verify)
                             if any(it.req_id == "short" for it in m.items))
    assert first_short_verify < last_long_prefill  # the short request did not wait for the long prefill


class PredictingSelector(RecordingSelector):
    """Predicts a verify forward's seconds as a cost model would (`verify_seconds`)."""

    def verify_seconds(self, batch_size: int, tokens: int) -> float:
        return 0.002 + 0.0001 * tokens


@pytest.mark.parametrize("predicts", [False, True], ids=["rows", "cost-model"])
def test_a_verify_that_carried_prefill_chunks_is_charged_what_it_costs_alone(tmp_path, predicts):
    """The feedback of a fused forward's requests reads the verify's seconds as the selector's cost model predicts
    them alone (capped at the whole forward); without a prediction, the worker's split by rows."""
    sel = PredictingSelector() if predicts else RecordingSelector()
    env = Env(tmp_path, make_cfg(prefill_budget=8, fuse_prefill=True), sel)
    out = run(env, [request("long", list(range(1, 41)), "inl", 4), request("short", [7, 8, 9], "inl", 6)])
    assert tokens_of(out[1]) == continuation([7, 8, 9], 6)
    fused = [m for m in env.ops("target", P.Verify) if m.prefill and m.items]
    assert fused
    seconds = {round(f.verify_s, 9) for slot in sel.feedback for f in slot}
    plain = {0.003}  # every verify without chunks
    assert seconds - plain
    if predicts:  # one request verified beside the chunks: its draft (up to k = 4) and a token more
        assert seconds - plain <= {round(sel.verify_seconds(1, t), 9) for t in range(1, 6)}
    else:  # the verify's 1-5 rows' share of the forward beside 1-8 chunk rows
        assert seconds - plain <= {round(FUSED_S * t / (c + t), 9) for t in range(1, 6) for c in range(1, 9)}


def test_an_aborted_request_is_freed_everywhere(tmp_path):
    sel = RecordingSelector()
    env = Env(tmp_path, make_cfg(), sel)

    async def go():
        c = env.coordinator
        await c.start()
        try:
            stream = c.generate(request("x", PROMPTS[0], "good", 200))
            got = [await anext(stream), await anext(stream)]
            await stream.aclose()  # the client went away
            other = await collect(c, request("y", PROMPTS[1], "good"))
            return got, other, dict(c.phases.requests), c.phases.budget.num_reserved
        finally:
            await c.shutdown(drain=False)

    got, other, left, reserved = asyncio.run(go())
    assert got[0].finish_reason is None and tokens_of(other) == continuation(PROMPTS[1], 12)
    assert left == {} and reserved == 0 and "x" in sel.removed
    for name in ("target", "draft"):
        assert "x" in {r for m in env.ops(name, P.FreeRequests) for r in m.req_ids}
        assert "x" not in env.worker(name).mirrors


@pytest.mark.parametrize("fuse", [False, True], ids=["prefill-ops", "fused"])
def test_a_request_whose_data_fails_a_verify_fails_alone(tmp_path, fuse):
    """Fused: the first slot's verify carries every prompt's chunk and fails; the slot prefills them with a Prefill op
    and verifies again, failing the culprit alone."""
    env = Env(tmp_path, make_cfg(fuse_prefill=fuse))

    async def go():
        c = env.coordinator
        await c.start()
        env.worker("target").fail_verify_of.add("bad")
        try:
            return await asyncio.gather(*(collect(c, r) for r in reqs))
        finally:
            await c.shutdown(drain=False)

    reqs = [request("ok1", PROMPTS[0], "good"), request("bad", PROMPTS[1], "good"), request("ok2", PROMPTS[2], "inl")]
    ok1, bad, ok2 = asyncio.run(go())
    assert bad[-1].finish_reason == "abort" and "scripted failure" in bad[-1].usage.finish_detail
    assert tokens_of(ok1) == continuation(PROMPTS[0], 12) and tokens_of(ok2) == continuation(PROMPTS[2], 12)
    assert 'spind_request_failures_total 1.0' in env.coordinator.render_metrics()
    log = env.worker("target").log
    fused = [i for i, m in enumerate(log) if isinstance(m, P.Verify) and m.prefill]
    assert bool(fused) == fuse
    if fuse:  # the failed fused verify, then the chunks as a Prefill op
        assert isinstance(log[fused[0] + 1], P.Prefill) and log[fused[0] + 1].items == log[fused[0]].prefill


def test_a_verify_that_fails_unattributed_is_bisected_to_the_request_behind_it(tmp_path):
    env = Env(tmp_path, make_cfg())

    async def go():
        c = env.coordinator
        await c.start()
        env.worker("target").poison.add("p")
        try:
            return await asyncio.gather(*(collect(c, r) for r in reqs))
        finally:
            await c.shutdown(drain=False)

    reqs = [request(f"ok{i}", PROMPTS[i % 4], "good" if i % 2 else "none") for i in range(5)]
    reqs.insert(2, request("p", PROMPTS[1], "half"))
    out = asyncio.run(go())
    for r, deltas in zip(reqs, out):
        if r.req_id == "p":
            assert deltas[-1].finish_reason == "abort" and "a forward failed" in deltas[-1].usage.finish_detail
        else:
            assert tokens_of(deltas) == continuation(r.prompt_ids, 12) and deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("transient", [False, True], ids=["its-data", "transient"])
def test_a_verify_that_fails_under_a_follow_on_leaves_the_outputs_exact(tmp_path, transient):
    """A verify fails mid-stream while follow-on slots run (lockstep over worker processes, every request plain or
    inline): the follow-on sent behind it is refused by the worker with nothing changed and verified again after
    the failed verify's retries, so the tokens commit in the order the worker made them. Its data at fault: that
    request alone ends. A failure nobody is named for and that does not recur (the retry, bisected, succeeds):
    every output exact (had the follow-on run ahead of the retries, its tokens would have been committed after
    tokens computed from them)."""
    env = Env(tmp_path, make_cfg())
    env.pool.shares_interpreter = False  # as a ProcessPool's workers: follow-ons in lockstep slots
    refused: list[P.Verify] = []
    failed: list[bool] = []

    async def go():
        c = env.coordinator
        await c.start()
        target = env.worker("target")
        verify, answer = target._verify, target.answer

        def failing_later(msg):  # from the request's 5th output token on: its data breaks it, or one forward fails
            time.sleep(0.003)  # a forward's time: the next slot's follow-on is sent before this one is answered
            if len(target.mirrors.get("bad", ())) >= len(PROMPTS[1]) + 5 and (not transient or not failed):
                failed.append(True)
                if transient:
                    raise RuntimeError("a forward failed")
                target.fail_verify_of.add("bad")
            return verify(msg)

        def recording_answer(msg):
            reply = answer(msg)
            if isinstance(reply, P.ErrorReply) and reply.message == P.FOLLOW_REFUSED:
                refused.append(msg)
            return reply

        target._verify, target.answer = failing_later, recording_answer
        try:
            return await asyncio.gather(*(collect(c, r) for r in reqs))
        finally:
            await c.shutdown(drain=False)

    reqs = [request("ok1", PROMPTS[0], "none", 16), request("bad", PROMPTS[1], "inl", 16),
            request("ok2", PROMPTS[2], "inl", 16)]
    ok1, bad, ok2 = asyncio.run(go())
    assert failed
    assert tokens_of(ok1) == continuation(PROMPTS[0], 16) and tokens_of(ok2) == continuation(PROMPTS[2], 16)
    if transient:
        assert tokens_of(bad) == continuation(PROMPTS[1], 16) and bad[-1].finish_reason == "length"
    else:
        assert bad[-1].finish_reason == "abort"
    if not MODE["pipeline"]:
        assert env.coordinator.loop.num_follow_ons > 0 and refused and all(m.follows for m in refused)


@pytest.mark.parametrize("victim", ["target", "draft"])
def test_a_restarted_worker_gets_the_committed_sequences_back(tmp_path, victim):
    env = Env(tmp_path, make_cfg(prefill_budget=4))

    async def go():
        c = env.coordinator
        await c.start()
        try:
            tasks = [asyncio.create_task(collect(c, r)) for r in reqs]
            def outputs():
                return [st.seq.num_output_tokens for st in c.phases.running]
            while len(outputs()) < len(reqs) or min(outputs()) == 0 or sum(outputs()) < 6:  # each has output to keep
                await asyncio.sleep(0.001)
            env.pool.dead.add(victim)
            out = await asyncio.gather(*tasks)
            return out, env.pool.info(victim).restarts
        finally:
            await c.shutdown(drain=False)

    reqs = [request("a", PROMPTS[2], "good", 24), request("b", PROMPTS[0], "half", 24), request("c", PROMPTS[1], "inl", 24)]
    out, restarts = asyncio.run(go())
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, 24) for r in reqs]
    assert restarts == 1
    fresh = env.worker(victim)  # the rebuilt worker learnt every running request anew, with its output so far
    readded = {m.req_id: m.tokens for m in fresh.log if isinstance(m, P.AddRequest)}
    assert readded and all(len(tokens) > len(r.prompt_ids) for r, tokens in
                           ((r, readded[r.req_id]) for r in reqs if r.req_id in readded))
    if victim == "target":
        assert set(readded) == {"a", "b", "c"} and env.prefills(victim)  # re-prefilled in chunks


def test_eos_and_unknown_drafters(tmp_path):
    env = Env(tmp_path, make_cfg())
    from spind.coordinator.interface import EngineError

    async def go():
        c = env.coordinator
        await c.start()
        try:
            with pytest.raises(EngineError, match="unknown drafter"):
                c.generate(request("u", PROMPTS[0], "nope"))
            with pytest.raises(EngineError, match="token ids"):
                c.generate(request("v", [EOS, 99], "none"))
            return await collect(c, request("w", PROMPTS[0], "none", 3))
        finally:
            await c.shutdown(drain=False)

    assert tokens_of(asyncio.run(go())) == continuation(PROMPTS[0], 3)


def metric(c: Coordinator, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in c.render_metrics().splitlines() if line.startswith(name))


def test_draft_ahead_is_used_when_the_guess_holds_and_dropped_when_not(tmp_path, mode):
    if not mode:
        pytest.skip("draft ahead is part of the pipeline")
    env = Env(tmp_path, make_cfg())
    out = run(env, [request("good", PROMPTS[0], "good", 40)])
    assert tokens_of(out[0]) == continuation(PROMPTS[0], 40)
    used = metric(env.coordinator, 'spind_draft_ahead_total{outcome="used"}')
    assert used >= 3  # all accepted every time: the next draft is ready when the verify ends
    assert any(m.items[0].assume for m in env.ops("draft", P.Propose))
    env = Env(tmp_path, make_cfg())
    out = run(env, [request("half", PROMPTS[0], "half", 40)])
    assert tokens_of(out[0]) == continuation(PROMPTS[0], 40)  # a wrong guess costs nothing but the draft
    assert metric(env.coordinator, 'spind_draft_ahead_total{outcome="used"}') == 0
    assert metric(env.coordinator, 'spind_draft_ahead_total{outcome="dropped"}') >= 3


def test_shadow_drafts_go_to_one_request_a_slot_in_turn(tmp_path, mode):
    """A batch's shadow drafts cost one request's lookups a select, not the batch's: a lockstep verify asks them for
    at most one request, every request's turn comes, and the outputs are plain decoding's."""
    cfg = make_cfg(policy="lbss")  # selection's own turns: no regime trial (whose PLAIN windows shadow nothing)
    cfg = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, regime_trial=False))
    env = Env(tmp_path, cfg, draft_ms={"inl": 0.001})  # a lookup: drafts may pay
    reqs = [EngineRequest(f"r{i}", [i + 2, i + 3, i + 2, i + 3], SamplingParams(max_tokens=24, temperature=0.0),
                          "auto", None) for i in range(4)]  # greedy: only greedy requests get shadow drafts
    out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, 24) for r in reqs]
    verifies = [m for m in env.ops("target", P.Verify) if len(m.items) >= 2]
    shadowed = [[it.req_id for it in m.items if it.shadow] for m in verifies]
    assert verifies and {r for s in shadowed for r in s} == {r.req_id for r in reqs}  # every request's turn came
    if not mode:  # lockstep: one select a slot, one request shadowed in it
        assert all(len(s) <= 1 for s in shadowed), shadowed
    else:  # the pipeline selects the requests back from their verify: one of each select's
        assert sum(map(len, shadowed)) <= sum(len(m.items) for m in verifies) / 2, shadowed


def test_the_pipeline_drafts_in_micro_batches_and_merges_them_in_verify(tmp_path, mode):
    if not mode:
        pytest.skip("micro-batches are part of the pipeline")
    env = Env(tmp_path, make_cfg(micro_batches=3))
    reqs = [request(f"g{i}", [i + 2, i + 3], "good", 24) for i in range(6)] + [request("n", [9], "none", 24)]
    out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, 24) for r in reqs]
    sizes = [len(m.items) for m in env.ops("draft", P.Propose) if not m.items[0].assume]
    assert max(sizes) < 6  # never the whole batch at once: micro-batches
    assert env.coordinator.snapshot().pipeline["micro_batches"]["draft"] == 3
    verifies = env.ops("target", P.Verify)
    assert sum(any(it.req_id == "n" for it in m.items) for m in verifies) >= 23  # plain rides every pass


def test_the_next_verify_is_sent_before_the_last_ones_tokens_stream(tmp_path, mode):
    """A verify pass's tokens reach the client after the next pass was sent (`SlotPhases.hold_deltas`), so the
    target computes while the front ends write, in lockstep slots as in the pipeline; no token is held back at
    the end. (Lockstep slots hold them only with worker processes: threads share the coordinator's GIL.)"""
    env = Env(tmp_path, make_cfg())
    env.pool.shares_interpreter = False  # as a ProcessPool's workers
    events: list[str] = []
    cast = env.pool.cast

    def recording_cast(name: str, msg: object):
        if isinstance(msg, P.Verify):
            events.append("verify")
        return cast(name, msg)

    env.pool.cast = recording_cast

    async def go():
        await env.coordinator.start()
        try:
            async with aclosing(env.coordinator.generate(request("r", [3, 5, 7], "none", max_tokens=6))) as stream:
                async for delta in stream:
                    events.append("delta")
                    tokens.extend(delta.token_ids)
        finally:
            await env.coordinator.shutdown(drain=False)

    tokens: list[int] = []
    asyncio.run(go())
    assert tokens == continuation([3, 5, 7], 6)
    verifies_before = [events[:i].count("verify") for i, e in enumerate(events) if e == "delta"]
    # the n-th delta (the n-th pass's token; the last pass's is the request's end) arrives after pass n + 1 was sent
    assert all(sent >= n + 1 for n, sent in enumerate(verifies_before[:-1], start=1)), events
    assert verifies_before[-1] == 6 and events.count("verify") == 6, events


def test_a_follow_on_slot_is_sent_while_the_one_before_runs(tmp_path, mode):
    """With nothing to prefill, nobody waiting and nothing for a drafter worker to draft, lockstep slots (over worker
    processes) send the next slot's verify while the one before runs (the worker takes ops in order: no round trip
    between the two). The outputs are those of the same loop without follow-ons, token for token and finish for
    finish: plain decoding, an inline drafter near max_tokens (no verify drafts past it: the scripted worker checks
    each against the request's max_tokens), and a stop string the worker does not know of (the follow-on's tokens
    are dropped). A request that ends by length costs no extra verify. The pipeline sends one pass at a time."""
    cont = continuation([3, 5, 7], 12)
    stop = f"t{cont[6]}"

    def serve(follow_on: bool):
        cfg = make_cfg()
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, follow_on=follow_on))
        env = Env(tmp_path / f"follow-{follow_on}", cfg)
        env.pool.shares_interpreter = False  # as a ProcessPool's workers
        outstanding, most = [0], [0]
        cast = env.pool.cast

        def recording_cast(name: str, msg: object):
            fut = cast(name, msg)
            if isinstance(msg, P.Verify):
                outstanding[0] += 1
                most[0] = max(most[0], outstanding[0])
                fut.add_done_callback(lambda f: outstanding.__setitem__(0, outstanding[0] - 1))
            return fut

        env.pool.cast = recording_cast
        reqs = [request("plain", [3, 5, 7], "none", max_tokens=9), request("inline", [2, 4], "inl", max_tokens=11),
                EngineRequest("stop", [3, 5, 7], SamplingParams(max_tokens=12, stop=(stop,)), "none")]
        out = run(env, reqs)
        passes = [sum(it.req_id == r.req_id for m in env.ops("target", P.Verify) for it in m.items) for r in reqs]
        return [(tokens_of(d), d[-1].finish_reason) for d in out], most[0], passes, env.coordinator.loop

    followed, most, passes, loop = serve(True)
    plain, most_plain, passes_plain, _ = serve(False)
    assert followed == plain
    assert followed[0] == (continuation([3, 5, 7], 9), "length")
    assert followed[1] == (continuation([2, 4], 11), "length")
    assert followed[2][1] == "stop" and len(followed[2][0]) <= 7 and followed[2][0] == cont[:len(followed[2][0])]
    assert most_plain == 1
    if mode:
        assert most == 1 and isinstance(loop, Pipeline)
        return
    assert most == 2 and loop.num_follow_ons > 0
    assert passes[0] == passes_plain[0] == 9  # one token a pass, none past max_tokens
    assert passes[2] >= passes_plain[2]  # the follow-on sent before the stop string was seen


def test_replacing_the_loop_waits_for_the_ops_the_old_one_has_in_flight(tmp_path, mode):
    """A draft ahead may outlive its request; a loop body put in place meanwhile must not run beside the old one (both
    would prefill the next request: the target refuses a second prefill of the same tokens)."""
    if not mode:
        pytest.skip("draft ahead is part of the pipeline")
    env = Env(tmp_path, make_cfg())
    propose = ScriptedWorker.handle

    def slow_drafts(self, msg):  # drafts ahead land well after their verify
        if isinstance(msg, P.Propose) and msg.items[0].assume:
            time.sleep(0.2)
        return propose(self, msg)

    async def go():
        c = env.coordinator
        await c.start()
        try:
            first = await collect(c, request("a", PROMPTS[0], "good", 4))
            await asyncio.sleep(0.05)  # the old loop body now awaits that draft ahead in its turn
            assert c.loop.is_busy
            await c.replace_loop(Pipeline(c.phases, 1, True))
            second = await collect(c, request("b", PROMPTS[1], "good", 4))
            return first, second
        finally:
            await c.shutdown(drain=False)

    with mock.patch.object(ScriptedWorker, "handle", slow_drafts):
        first, second = asyncio.run(go())
    assert tokens_of(first) == continuation(PROMPTS[0], 4)
    assert tokens_of(second) == continuation(PROMPTS[1], 4) and second[-1].finish_reason == "length"
    prefills = [i.num_tokens for m in env.prefills("target") for i in chunks_of(m) if i.req_id == "b"]
    assert prefills == [len(PROMPTS[1]) - 1]  # one loop prefilled it, once


class PlainTrial(RegimeTrial):
    """The regime trial with every window planned PLAIN (its accounting as it is)."""

    def _plan(self, b) -> list[str]:
        return [PLAIN_REGIME]


def test_a_plain_regime_slot_decodes_the_auto_requests_unselected(tmp_path, mode):
    """In a PLAIN window of the regime trial (selection/regime.py) a request that leaves its drafter to spind decodes
    plainly with no selecting at all: no draft, no shadow draft, no feedback to the selector; one that named a
    drafter drafts as always; every output is plain decoding's, and the trial measured its windows."""
    if mode:
        pytest.skip("the regime trial runs on lockstep slots")
    env = Env(tmp_path, make_cfg(policy="lbss"), draft_ms={"inl": 0.001})  # a lookup: drafts may pay
    trial = env.coordinator.phases.regime_trial = PlainTrial(NUM_BUCKETS, lambda batch_size: 0.003, window=4)
    reqs = [EngineRequest("a", [2, 3, 2, 3], SamplingParams(max_tokens=24, temperature=0.0), "auto", None),
            EngineRequest("b", [4, 5, 4, 5], SamplingParams(max_tokens=24, temperature=0.0), "inl", None)]
    observed = []
    observe = LBSSSelector.observe

    def spy(self, feedback):
        observed.extend(f.req_id for f in feedback if f.batch_size >= 2)
        observe(self, feedback)

    with mock.patch.object(LBSSSelector, "observe", spy):
        out = run(env, reqs)
    assert [tokens_of(d) for d in out] == [continuation(r.prompt_ids, 24) for r in reqs]
    # the trial runs from batch 2 (MIN_BATCH): "a" beside "b"; alone, where "b" finished first, it is selected
    items = [it for m in env.ops("target", P.Verify) if len(m.items) >= 2 for it in m.items]
    assert sum(it.req_id == "a" for it in items) >= 5
    assert all(not it.inline_drafter and not it.draft and not it.shadow for it in items if it.req_id == "a")
    assert any(it.inline_drafter == "inl" for it in items if it.req_id == "b")
    assert "a" not in observed and "b" in observed
    described = trial.describe()
    assert described["slots"][SELECT_REGIME] == 0 and described["slots"][PLAIN_REGIME] >= 5
    assert described["buckets"]["1"]["regime"] == PLAIN_REGIME  # batch 2: bucket 1


def test_the_regime_trial_runs_with_lbss_unless_turned_off(tmp_path, mode):
    """With LBSS the lockstep slots measure their windows into the trial (the pipeline's never do); a fixed policy,
    or `regime_trial = false`, runs none."""
    env = Env(tmp_path, make_cfg(policy="lbss"))
    if not mode:
        env.coordinator.phases.regime_trial = RegimeTrial(NUM_BUCKETS, lambda batch_size: 0.003, window=2)
    run(env, [request("a", PROMPTS[0], max_tokens=40), request("b", PROMPTS[1], max_tokens=40)])
    trial = env.coordinator.phases.regime_trial
    assert trial is not None and "regime" in env.coordinator.snapshot().selector
    buckets = trial.describe()["buckets"]
    assert buckets["1"]["pairs"] >= 3 if not mode else buckets == {}  # batch 2: bucket 1
    assert "0" not in buckets  # batch 1 (the last request's tail) is left to selection alone
    cfg = make_cfg(policy="lbss")
    off = dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, regime_trial=False))
    env = Env(tmp_path / "off", off)
    run(env, [request("a", PROMPTS[0])])
    assert env.coordinator.phases.regime_trial is None
    env = Env(tmp_path / "fixed", make_cfg())  # a fixed policy predicts no plain forward: no trial
    run(env, [request("a", PROMPTS[0])])
    assert env.coordinator.phases.regime_trial is None
