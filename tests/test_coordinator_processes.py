"""The coordinator over real worker processes (ProcessPool) and the real default model (SmolLM2-135M, CPU).

The coordinator runs on an asyncio loop in a background thread (one per harness); tests hand it coroutines.
Greedy output over worker processes must equal plain decoding through the same coordinator over in-process
workers (`LocalEngine`), whatever the drafter, the batch around it, an abort next to it, or a worker
SIGKILLed under it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from contextlib import aclosing

import pytest

from spind import protocol as P
from spind.config import SpindConfig, load_config
from spind.coordinator.engine import Coordinator
from spind.coordinator.interface import Delta, EngineError, EngineRequest
from spind.coordinator.transport.process_pool import ProcessPool
from spind.coordinator.transport.local import GenRequest, LocalEngine
from spind.params import SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = {
    "sea": "Write a short poem about the sea.",
    "colors": "List three primary colors.",
    "repeat": "Repeat this sentence twice: the cat sat on the mat near the door.",
    "math": "What is the capital of France?",
}


# ---- harness --------------------------------------------------------------------------------------
class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 240.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def small_config(drafters: tuple[str, ...] = ("ngram", "int8")) -> SpindConfig:
    cfg = load_config()
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, max_model_len=1024),
        runtime=dataclasses.replace(cfg.runtime, kv_num_blocks=512, max_batch_size=8),
        server=dataclasses.replace(cfg.server, max_waiting=8),
        drafters=tuple(d for d in cfg.drafters if d.name in drafters),
        selection=dataclasses.replace(cfg.selection, policy="fixed:int8" if "int8" in drafters else "none"))


class Harness:
    def __init__(self, cfg: SpindConfig, run_dir) -> None:
        self.lt = LoopThread()
        self.pool = ProcessPool(cfg, run_dir)
        self.engine = Coordinator(cfg, self.pool, call_timeout_s=120)
        self.lt.run(self.engine.start())

    def run(self, coro, timeout: float = 240.0):
        return self.lt.run(coro, timeout)

    def on_loop(self, read):
        """read() called on the engine's own loop, as the API calls it: its rings change between awaits there."""
        async def call():
            return read()
        return self.lt.run(call(), 30)

    def snapshot(self):
        return self.on_loop(self.engine.snapshot)

    def close(self) -> None:
        self.lt.run(self.engine.shutdown(drain=False), 60)
        self.lt.close()


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    h = Harness(small_config(), tmp_path_factory.mktemp("run"))
    yield h
    h.close()


@pytest.fixture(scope="session")
def offline():
    engine = LocalEngine.load(small_config(), drafters=[])
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reference(offline, harness):
    """(prompt name, max_tokens, stop) -> the offline greedy result with no drafter (cached)."""
    cache = {}

    def ref(name: str, max_tokens: int, stop: tuple[str, ...] = ()):
        key = (name, max_tokens, stop)
        if key not in cache:
            ids = chat_ids(harness, name)
            cache[key] = offline.generate([GenRequest(name, ids, SamplingParams(max_tokens=max_tokens, stop=stop))])[0]
        return cache[key]

    return ref


def chat_ids(h: Harness, name: str) -> list[int]:
    return h.engine.encode_prompt(None, [{"role": "user", "content": PROMPTS[name]}])


def request(h: Harness, req_id: str, name: str, drafter: str, max_tokens: int, stop=()) -> EngineRequest:
    return EngineRequest(req_id, chat_ids(h, name), SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), drafter)


async def collect(engine: Coordinator, req: EngineRequest, log: list[Delta] | None = None) -> list[Delta]:
    deltas = log if log is not None else []
    async with aclosing(engine.generate(req)) as stream:
        async for d in stream:
            deltas.append(d)
    return deltas


def check_stream(deltas: list[Delta], ref) -> None:
    """The deltas of one request add up to the offline result; only the last one finishes."""
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == ref.finish_reason
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert last.usage.completion_tokens == len(ref.token_ids)


# ---- engine tests ---------------------------------------------------------------------------------
def test_greedy_output_matches_offline_plain_decoding(harness, reference):
    deltas = harness.run(collect(harness.engine, request(harness, "g1", "sea", "none", 24)))
    check_stream(deltas, reference("sea", 24))
    assert deltas[-1].usage.drafters == {} and deltas[-1].usage.num_steps == 24


def test_concurrent_requests_with_different_drafters(harness, reference):
    cases = [("c-none", "colors", "none"), ("c-int8", "sea", "int8"), ("c-ngram", "repeat", "ngram"),
             ("c-auto", "math", "auto")]

    async def go():
        return await asyncio.gather(*(collect(harness.engine, request(harness, rid, name, d, 24))
                                      for rid, name, d in cases))

    results = harness.run(go())
    for (rid, name, drafter), deltas in zip(cases, results):
        check_stream(deltas, reference(name, 24))
    int8_usage = results[1][-1].usage
    assert int8_usage.drafters["int8"]["drafted"] > 0
    assert int8_usage.mean_accepted_length > 1.5  # the int8 copy agrees with the target most of the time
    assert int8_usage.num_steps < 24
    assert "int8" in results[3][-1].usage.drafters  # auto = the fixed:int8 policy
    assert "ngram" in results[2][-1].usage.drafters
    snap = harness.snapshot()
    assert snap.drafters["int8"].drafted >= int8_usage.drafters["int8"]["drafted"]
    assert snap.selection.policy == "fixed:int8@4" and snap.slots["num_slots"] > 0
    draft = next(w for w in snap.workers if w.name == "draft")
    assert {("precompute", "int8"), ("draft", "int8")} <= {(b.kind, b.drafter) for b in draft.busy}
    target = next(w for w in snap.workers if w.name == "target")
    assert {"prefill", "verify", "draft"} <= {b.kind for b in target.busy}  # n-gram drafts inline
    assert 0 < target.utilisation <= 1 and snap.selection.precompute_s > 0
    # the timeline holds closed seconds only: the four requests can finish within the second they started in
    time.sleep(1.05 - time.monotonic() % 1.0)
    closed = harness.snapshot().throughput
    generated = sum(d.usage.completion_tokens for r in results for d in r[-1:])
    assert sum(c.num_committed for s in closed for c in s.drafters.values()) >= generated - len(cases)  # - prefills'
    text = harness.on_loop(harness.engine.render_metrics)
    assert 'spind_draft_tokens_total{drafter="int8"}' in text
    assert 'spind_accepted_at_position_total{drafter="int8",position="0"}' in text
    assert "spind_coordinator_overhead_seconds_count" in text


def test_stochastic_sampling_ships_draft_probabilities(harness):
    """temperature > 0: the int8 drafter's proposal distributions q travel to the target for rejection
    sampling (n-gram drafts are point masses). The int8 copy's q is close to the target's p, so most drafts
    are accepted — which they would not be if q arrived garbled or misaligned."""
    ids = chat_ids(harness, "sea")

    async def go():
        reqs = [EngineRequest(f"t-{d}", ids, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3), d)
                for d in ("int8", "ngram")]
        return await asyncio.gather(*(collect(harness.engine, r) for r in reqs))

    int8, ngram = harness.run(go())
    for deltas in (int8, ngram):
        assert deltas[-1].finish_reason in ("length", "stop") and deltas[-1].usage.completion_tokens >= 1
    c = int8[-1].usage.drafters["int8"]
    assert c["drafted"] >= 8 and c["accepted"] / c["drafted"] > 0.5


def test_stop_string_is_held_back_until_resolved(harness, reference):
    plain = reference("sea", 24).text
    stop = plain[plain.index(" ") + 1: plain.index(" ") + 20]  # spans several tokens
    ref = reference("sea", 24, (stop,))
    assert ref.finish_reason == "stop" and stop not in ref.text
    deltas = harness.run(collect(harness.engine, request(harness, "s1", "sea", "int8", 24, stop=(stop,))))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == ref.text  # nothing of the stop string ever streamed


def test_abort_frees_request_on_every_worker(harness):
    engine = harness.engine

    async def go():
        stream = engine.generate(request(harness, "ab1", "sea", "int8", 400))
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()  # the client went away
        for _ in range(200):
            if not engine.phases.requests:
                break
            await asyncio.sleep(0.05)
        return got, await engine.worker_stats("target"), await engine.worker_stats("draft")

    got, target, draft = harness.run(go())
    assert got[0].finish_reason is None
    assert target.req_ids == [] and target.kv["target"].num_seqs == 0
    assert target.kv["target"].num_free_blocks == target.kv["target"].num_blocks
    assert draft.req_ids == [] and draft.kv["int8"].num_seqs == 0
    assert engine.phases.budget.num_reserved == 0
    assert 'spind_requests_total{status="abort"}' in harness.on_loop(engine.render_metrics)


def test_refusals(harness):
    engine = harness.engine
    ids = chat_ids(harness, "sea")

    def status(req: EngineRequest) -> int:
        with pytest.raises(EngineError) as e:
            engine.generate(req)
        return e.value.status

    p = SamplingParams(max_tokens=4)
    assert status(EngineRequest("x1", [], p)) == 400
    assert status(EngineRequest("x2", [1] * 1024, p)) == 413
    assert status(EngineRequest("x3", ids, p, drafter="nope")) == 400
    assert status(EngineRequest("x4", ids, p, k=99)) == 400
    assert status(EngineRequest("x5", [10**9], p)) == 400
    assert status(EngineRequest("x6", ids, SamplingParams(max_tokens=0))) == 400
    with pytest.raises(EngineError):
        engine.encode_prompt("hi", [{"role": "user", "content": "hi"}])
    with pytest.raises(EngineError):
        engine.encode_prompt(None, [{"role": "user"}])

    async def overload():  # max_waiting = 8: the 9th queued request is refused with 503
        streams = [engine.generate(EngineRequest(f"q{i}", ids, SamplingParams(max_tokens=1), "none"))
                   for i in range(8)]
        with pytest.raises(EngineError) as e:
            engine.generate(EngineRequest("q8", ids, SamplingParams(max_tokens=1), "none"))
        with pytest.raises(EngineError):  # a req_id in use
            engine.generate(EngineRequest("q0", ids, SamplingParams(max_tokens=1), "none"))
        outs = [[d async for d in s] for s in streams]
        return e.value.status, outs

    code, outs = harness.run(overload())
    assert code == 503 and all(o[-1].finish_reason == "length" for o in outs)


def test_worker_answers_garbage_and_bad_ops_without_dying(harness):
    w = harness.pool.workers["target"]
    pid = w.proc.pid

    async def go():
        w.sock.send(b"\xc1 not msgpack")
        with pytest.raises(Exception, match="unknown request"):
            await w.call(P.Verify(0, 1, [P.VerifyItem("no-such-request", [])]), 30)
        with pytest.raises(Exception, match="unknown request"):
            await w.call(P.Propose(0, 1, [P.ProposeItem("no-such-request", "ngram", 0, [], 2)]), 30)
        with pytest.raises(Exception, match="unknown request"):
            await w.call(P.Prefill(0, [P.PrefillItem("no-such-request", 3)]), 30)
        return await harness.engine.worker_stats("target")

    stats = harness.run(go())
    assert stats.pid == pid and w.is_alive


@pytest.mark.parametrize("victim, fault", [("target", signal.SIGKILL), ("draft", signal.SIGKILL),
                                           ("draft", signal.SIGSTOP)], ids=["kill-target", "kill-draft", "hang-draft"])
def test_worker_fault_mid_generation_output_unchanged(harness, reference, victim, fault):
    """SIGKILL: the process exit is noticed at once; SIGSTOP: a hung worker, noticed by the call timeout.
    Either way the worker is restarted, re-prefilled, and every request finishes as if nothing happened."""
    engine = harness.engine
    cases = [(f"k-{victim}-{fault}-int8", "sea", "int8"), (f"k-{victim}-{fault}-ngram", "repeat", "ngram"),
             (f"k-{victim}-{fault}-none", "colors", "none")]
    restarts_before = harness.pool.info(victim).restarts
    old_pid = harness.pool.info(victim).pid
    engine.call_timeout_s = 5.0 if fault == signal.SIGSTOP else 120.0

    async def go():
        logs = [[] for _ in cases]
        tasks = [asyncio.create_task(collect(engine, request(harness, rid, name, d, 24), log))
                 for (rid, name, d), log in zip(cases, logs)]
        while not all(log for log in logs):  # every request has its first token (plain ones run ahead)
            await asyncio.sleep(0.01)
        assert all(log[-1].finish_reason is None for log in logs)
        os.kill(old_pid, fault)
        return await asyncio.gather(*tasks)

    try:
        results = harness.run(go())
    finally:
        engine.call_timeout_s = 120.0
    for (rid, name, drafter), deltas in zip(cases, results):
        check_stream(deltas, reference(name, 24))
    info = harness.pool.info(victim)
    assert info.restarts == restarts_before + 1 and info.pid != old_pid and harness.pool.is_alive(victim)
    snap = {w.name: w for w in harness.snapshot().workers}
    assert snap[victim].restarts == info.restarts and snap[victim].alive


def test_admission_bounds_token_ids_by_the_targets_logits(harness):
    """The target reports its logits' rows; prompt ids and logit_bias ids beyond them (a tokenizer's added tokens
    can go past the model) are refused at admission, for that request alone, not left to fail a whole pass."""
    info = harness.pool.info("target")
    assert info.vocab_size == harness.engine.tokenizer.vocab_size == harness.engine.vocab_size == 49152
    saved, info.vocab_size = info.vocab_size, 100
    try:
        for prompt, bias in (([5, 150], ()), ([5, 6], ((150, 1.0),))):
            req = EngineRequest(f"vocab-{len(bias)}", prompt, SamplingParams(max_tokens=2, logit_bias=bias), "none")
            with pytest.raises(EngineError, match=r"\[0, 100\)|below the vocabulary size 100"):
                harness.engine.generate(req)
    finally:
        info.vocab_size = saved


WATCHDOG_S = 3.0


def test_watchdog_restarts_a_stopped_worker_and_outputs_are_unchanged(harness, reference):
    """A SIGSTOPped target (hung: no heartbeat, no CPU) with requests in flight and the call timeout far away: the
    watchdog kills it after watchdog_s, it is restarted and re-prefilled, every request finishes as if nothing
    happened, and the hang is counted (worker info, snapshot, /metrics). A busy worker is left alone: the first
    part runs with the watchdog on and no fault, and nothing is killed."""
    engine = harness.engine
    victim = "target"
    cases = [("w-sea", "sea", "int8"), ("w-colors", "colors", "none")]
    before = harness.pool.info(victim)
    restarts, hangs, old_pid = before.restarts, before.hangs, before.pid
    engine.watchdog_s = WATCHDOG_S

    async def go(fault: bool, tag: str):
        logs = [[] for _ in cases]
        tasks = [asyncio.create_task(collect(engine, request(harness, rid + tag, name, d, 24), log))
                 for (rid, name, d), log in zip(cases, logs)]
        while not all(log for log in logs):
            await asyncio.sleep(0.01)
        stopped_at = time.monotonic()
        if fault:
            os.kill(old_pid, signal.SIGSTOP)
        results = await asyncio.gather(*tasks)
        return results, time.monotonic() - stopped_at

    try:
        healthy, _ = harness.run(go(False, "-ok"))
        assert harness.pool.info(victim).hangs == hangs  # busy, answering late or not: never killed
        results, took = harness.run(go(True, "-stop"), timeout=120)
    finally:
        engine.watchdog_s = 0.0
        try:
            os.kill(old_pid, signal.SIGCONT)  # if the test failed before the watchdog killed it
        except ProcessLookupError:
            pass
    for deltas, (_, name, _) in zip([*healthy, *results], [*cases, *cases]):
        check_stream(deltas, reference(name, 24))
    info = harness.pool.info(victim)
    assert info.hangs == hangs + 1 and info.restarts == restarts + 1 and info.pid != old_pid
    # killed after watchdog_s (+ a heartbeat), restarted, re-prefilled and finished: far below call_timeout_s (120 s)
    assert took < WATCHDOG_S + 15, took
    snap = {w.name: w for w in harness.snapshot().workers}
    assert snap[victim].hangs == info.hangs and snap[victim].alive
    assert 'spind_worker_hangs_total{worker="target"} 1.0' in harness.on_loop(engine.render_metrics)


def test_shutdown_drain_finishes_in_flight_requests(tmp_path, harness, reference):
    h = Harness(small_config(drafters=("ngram",)), tmp_path)  # only the target worker: quick to start
    try:
        ids, ref = chat_ids(harness, "repeat"), reference("repeat", 24)

        async def go():
            reqs = [EngineRequest(f"d{i}", ids, SamplingParams(max_tokens=24), d)
                    for i, d in enumerate(["ngram", "none"])]
            tasks = [asyncio.create_task(collect(h.engine, r)) for r in reqs]
            await asyncio.sleep(0.2)
            drain = asyncio.create_task(h.engine.shutdown(drain=True))
            await asyncio.sleep(0)
            with pytest.raises(EngineError) as e:
                h.engine.generate(EngineRequest("late", ids, SamplingParams(max_tokens=4)))
            outs = await asyncio.gather(*tasks)
            await drain
            return e.value.status, outs

        code, outs = h.run(go())
        assert code == 503
        for deltas in outs:
            check_stream(deltas, ref)
        assert all(not w.is_alive and w.proc.poll() is not None for w in h.pool.workers.values())
        assert not list(tmp_path.glob("*.sock"))  # every socket file removed
    finally:
        h.close()


def test_shutdown_without_drain_aborts_at_once(tmp_path):
    h = Harness(small_config(drafters=("ngram",)), tmp_path)
    try:
        ids = h.engine.encode_prompt(None, [{"role": "user", "content": PROMPTS["sea"]}])

        async def go():
            log: list[Delta] = []
            task = asyncio.create_task(collect(h.engine, EngineRequest("a0", ids, SamplingParams(max_tokens=500)), log))
            while not log:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            await h.engine.shutdown(drain=False)
            return await task, time.perf_counter() - t0

        deltas, took = h.run(go())
        assert deltas[-1].finish_reason == "abort" and len([t for d in deltas for t in d.token_ids]) < 500
        assert took < 10
    finally:
        h.close()


def test_a_call_to_a_worker_whose_process_is_gone_fails_at_once(tmp_path) -> None:
    """No peer on the worker's socket (its process died): the asyncio socket's send holds zmq.Again in a future
    instead of raising it. The call must fail with WorkerDied right away, and nothing may be left for asyncio to
    log as an unretrieved exception (a daemon test found such a traceback after SIGKILLing both workers)."""
    import zmq.asyncio

    from spind.coordinator.transport.pool import WorkerDied
    from spind.coordinator.transport.process_pool import WorkerProcess

    async def run() -> list[dict]:
        loop = asyncio.get_running_loop()
        unretrieved: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
        ctx = zmq.asyncio.Context()
        worker = WorkerProcess(ctx, "target", load_config(), tmp_path, "ipc://unused", 1.0)
        worker.sock = ctx.socket(zmq.DEALER)
        worker.sock.setsockopt(zmq.LINGER, 0)
        worker.sock.bind(f"ipc://{tmp_path}/w.sock")  # bound, never connected: as after the worker's death
        worker.is_alive = True
        try:
            with pytest.raises(WorkerDied, match="not connected"):
                await worker.call(P.Ping(0), timeout_s=5.0)
            assert worker.num_pending == 0
        finally:
            worker.sock.close(linger=0)
            ctx.term()
        import gc

        gc.collect()  # an unretrieved future's exception is reported when it is collected
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(run()) == []
