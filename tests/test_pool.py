"""InProcessPool keeps the WorkerPool contract (spind/coordinator/transport/pool.py) where a worker hangs: a call
with no reply within its timeout fails with WorkerDied, as ProcessPool's does, and the worker counts as dead until
restarted. A stub worker, no model: milliseconds."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from spind import protocol as P
from spind.coordinator.transport.pool import InProcessPool, WorkerDied


class HangingWorker:
    """Answers every op at once, except a Ping while `hang` is set: that one blocks until `release` is set."""

    def __init__(self, name: str, hang: bool) -> None:
        self.name = name
        self.hang = hang
        self.release = threading.Event()
        self.has_idle_work = False  # no precompute is ever queued here
        self.answered: list[object] = []

    def ready(self, num_threads: int) -> P.Ready:
        return P.Ready(name=self.name, pid=os.getpid(), is_target=True, drafters=[], max_model_len=64,
                       num_threads=num_threads, device="cpu", dtype="stub")

    def answer(self, msg: object) -> object:
        if isinstance(msg, P.Ping) and self.hang:
            self.release.wait(30)
        self.answered.append(msg)
        return P.Ack(msg.seq)


def test_a_call_that_times_out_raises_worker_died_and_the_worker_counts_as_dead_until_restarted():
    built: list[HangingWorker] = []

    def make(name: str) -> HangingWorker:
        built.append(HangingWorker(name, hang=not built))  # the first incarnation hangs, the restarted one not
        return built[-1]

    async def go():
        pool = InProcessPool(["target"], make)
        await pool.start()
        try:
            assert await pool.call("target", P.FreeRequests(0, []), 5.0) == P.Ack(1)  # a healthy call first
            hung = asyncio.create_task(pool.call("target", P.Ping(0), 0.3))
            await asyncio.sleep(0.05)
            queued = pool.cast("target", P.FreeRequests(0, ["r"]))  # waits behind the op that hangs
            with pytest.raises(WorkerDied, match="no reply within 0.3 s"):
                await hung
            with pytest.raises(WorkerDied, match="no reply within"):
                await queued  # a call in flight on a hung worker fails too, as ProcessPool's kill fails them
            assert not pool.is_alive("target")
            assert [w["alive"] for w in pool.describe()] == [False]
            with pytest.raises(WorkerDied, match="not running"):
                await pool.call("target", P.Ping(0), 5.0)
            built[0].release.set()  # the stuck thread finishes its op; nothing it answers reaches the pool
            await pool.restart("target")  # what the coordinator's recovery does with a worker that is not alive
            assert pool.is_alive("target") and pool.info("target").restarts == 1
            assert isinstance(await pool.call("target", P.Ping(0), 5.0), P.Ack)
            assert len(built) == 2 and not any(isinstance(m, P.FreeRequests) and m.req_ids == ["r"]
                                               for m in built[0].answered)
        finally:
            built[0].release.set()
            await pool.stop()

    asyncio.run(go())


def test_workers_load_at_once_and_a_failed_load_stops_the_others() -> None:
    """Each worker builds on its own thread at the same time: two workers that each wait for the other to be
    building could not both finish if the pool built them one after another. A load that fails stops the rest."""
    building = threading.Barrier(2, timeout=10)

    def make(name: str) -> HangingWorker:
        building.wait()  # BrokenBarrierError after 10 s where the other worker is not being built beside it
        if name == "bad":
            raise RuntimeError("no weights")
        return HangingWorker(name, hang=False)

    async def main() -> None:
        pool = InProcessPool(["target", "draft"], make)
        await pool.start()
        assert pool.is_alive("target") and pool.is_alive("draft")
        await pool.stop()
        building.reset()
        pool = InProcessPool(["target", "bad"], make)
        with pytest.raises(RuntimeError, match="no weights"):
            await pool.start()
        assert not pool.is_alive("target")

    asyncio.run(main())


@pytest.mark.parametrize("pool_kind", ["in-process", "process"])
def test_a_call_cancelled_as_its_reply_lands_is_cancelled(pool_kind: str, tmp_path) -> None:
    """The reply lands in the loop iteration its caller is cancelled in: the caller must still end cancelled.
    `asyncio.wait_for` returned the reply instead on Python 3.11 (CPython gh-86296); the coordinator's loop then
    ran on after `shutdown(drain=False)` cancelled it, and the shutdown waited for it forever (a CI run's hang)."""
    import zmq.asyncio

    from spind.config import load_config
    from spind.coordinator.transport.process_pool import WorkerProcess

    async def main(ctx: zmq.asyncio.Context) -> None:
        reply = asyncio.get_running_loop().create_future()
        if pool_kind == "in-process":
            pool = InProcessPool(["target"], lambda name: HangingWorker(name, hang=False))
            pool.cast = lambda name, msg: reply
            call = pool.call("target", P.Ping(0), 5.0)
        else:
            worker = WorkerProcess(ctx, "target", load_config(), tmp_path, "ipc://unused", 1.0)
            worker.cast = lambda msg: reply
            call = worker.call(P.Ping(0), 5.0)
        caller = asyncio.create_task(call)
        await asyncio.sleep(0)  # the caller now waits for the reply
        reply.set_result(P.Ack(1))
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert reply.result() == P.Ack(1)  # the shared reply future itself is left alone

    ctx = zmq.asyncio.Context()
    try:
        asyncio.run(main(ctx))
    finally:
        ctx.term()


def test_a_reply_wakes_its_caller_in_the_next_loop_iteration_and_start_call_sends_at_once() -> None:
    """The target waits for the coordinator's next op while the reply travels to its caller: awaited directly, the
    caller runs in the iteration after the reply lands (through `asyncio.shield` and `asyncio.timeout` it took two
    more). `start_call` has sent the op when it returns, so the caller can work before it awaits the reply. A caller
    cancelled before its reply lands cancels its call, and the late reply harms nothing."""
    async def main() -> None:
        pool = InProcessPool(["target"], lambda name: HangingWorker(name, hang=False))
        await pool.start()
        replies: list[asyncio.Future] = []

        def cast(name: str, msg: object) -> asyncio.Future:
            replies.append(asyncio.get_running_loop().create_future())
            return replies[-1]

        pool.cast = cast
        pending = pool.start_call("target", P.Ping(0), 5.0)
        assert len(replies) == 1  # sent before anything awaited
        caller = asyncio.create_task(pending)
        await asyncio.sleep(0)  # the caller now waits for the reply
        replies[0].set_result(P.Ack(1))
        await asyncio.sleep(0)  # one iteration: the caller's wake-up
        assert caller.done() and caller.result() == P.Ack(1)

        caller = asyncio.create_task(pool.call("target", P.Ping(0), 5.0))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert replies[1].cancelled()
        from spind.coordinator.transport.pool import settle
        settle(replies[1], P.Ack(2), pool.info("target"), None)  # the late reply: passed by

        expired = pool.start_call("target", P.Ping(0), 0.05)
        with pytest.raises(WorkerDied, match="no reply within 0.05 s"):
            await expired
        assert isinstance(replies[2].exception(), TimeoutError) and not pool.is_alive("target")
        await pool.stop()

    asyncio.run(main())
