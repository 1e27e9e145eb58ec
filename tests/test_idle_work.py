"""Idle work (the suffix cache's inserts of finished outputs) runs on the target's worker only while no op waits,
and yields as soon as one arrives: the worker's socket is polled after each token the cache takes, so an op that
arrives mid-chunk waits for one token's insert, not for the chunk."""

from __future__ import annotations

import os
import threading
import time

import zmq

from spind import protocol as P
from spind.drafters.suffix import INSERT_CHUNK, SuffixDrafter
from spind.worker.main import serve


def test_a_chunk_of_inserts_ends_at_the_token_where_an_op_arrives():
    d = SuffixDrafter("suffix", max_depth=8, cache_mb=8)
    d.observe_finished("a", list(range(100, 100 + 3 * INSERT_CHUNK)))
    asked = []

    def stop() -> bool:  # an op arrives while the third token goes in
        asked.append(1)
        return len(asked) >= 3

    d.background_work(INSERT_CHUNK, stop)
    assert d.cache._partial is not None and d.cache._partial[2] == 3
    d.background_work(INSERT_CHUNK, lambda: False)  # nothing waits: the whole chunk
    assert d.cache._partial[2] == 3 + INSERT_CHUNK
    while d.has_background_work:
        d.background_work(INSERT_CHUNK)
    assert list(d.cache.entries) == ["a"]
    whole = SuffixDrafter("suffix", max_depth=8, cache_mb=8).cache
    whole.add("a", list(range(100, 100 + 3 * INSERT_CHUNK)))  # in parts, as in one go
    assert d.cache.trie.count == whole.trie.count and d.cache.trie.children == whole.trie.children


class _IdleWorker:
    """A worker whose idle work runs until it is told that an op waits (or 10 s pass)."""

    def __init__(self) -> None:
        self.has_idle_work = True
        self.yielded_after: float | None = None

    def run_idle_work(self, stop=None) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 10.0:
            if stop is not None and stop():
                self.yielded_after = time.perf_counter() - start
                break
            time.sleep(0.001)
        self.has_idle_work = False

    def answer(self, msg):
        return P.Ack(msg.seq)


def test_the_worker_loop_tells_idle_work_that_an_op_waits():
    ctx = zmq.Context.instance()
    coord, wsock = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    coord.bind("inproc://idle-work")
    wsock.connect("inproc://idle-work")
    worker = _IdleWorker()
    loop = threading.Thread(target=serve, args=(worker, wsock, os.getppid()), daemon=True)  # a hung loop: no hung run
    try:
        loop.start()
        time.sleep(0.1)  # the worker is in its idle work
        coord.send(P.encode(P.Shutdown(7)))
        assert coord.poll(5000), "the worker did not answer"
        assert P.decode(coord.recv(), P.WorkerReply).seq == 7
        loop.join(5)
        assert not loop.is_alive()
        assert worker.yielded_after is not None and worker.yielded_after < 5.0  # ended by the op, not by its 10 s
    finally:
        coord.close(0)
        wsock.close(0)
