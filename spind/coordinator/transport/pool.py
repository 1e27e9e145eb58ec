"""The coordinator's view of its workers: the `WorkerPool` interface and its in-process implementation.

Two pools implement it (vLLM v1's in-process vs multiprocess engine client is the pattern):
- `ProcessPool` (spind.coordinator.transport.process_pool): one process per worker over ZeroMQ, watched and
  restarted; what the daemon runs.
- `InProcessPool` (here): the same `Worker.answer` called in this process, each worker on a thread of its
  own (torch releases the GIL, so a drafter really drafts while the target verifies); what `spind
  generate`, the benches and most tests run. With a scripted worker it makes coordinator unit tests
  run in milliseconds.

Both keep the semantics the coordinator relies on: a worker handles ops one at a time in the order they
were sent; it runs queued precomputes only while no op waits; a reply's busy intervals are reported to
`on_busy`; an `ErrorReply` fails its call with `WorkerError` (naming the requests at fault, if any); a call
that gets no reply within its timeout fails with `WorkerDied`, and the worker counts as dead (not alive, its
calls in flight failed) until `restart`; so does a worker whose device failed for good (the process exits with
EXIT_DEVICE_ERROR; an in-process worker raises from `answer`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from spind import protocol as P

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"worker {name!r} died: {why}")
        self.name = name


class WorkerError(RuntimeError):
    """The worker answered an op with an ErrorReply: it is alive, the op failed and changed nothing.
    `req_ids` names the requests whose data caused it ([] = the op as a whole)."""

    def __init__(self, name: str, message: str, req_ids: list[str] | None = None) -> None:
        super().__init__(f"worker {name!r}: {message}")
        self.name = name
        self.req_ids = list(req_ids or [])


@dataclass(kw_only=True)
class WorkerInfo:
    """A worker as the coordinator knows it: from config, then from its Ready greeting."""

    name: str
    is_target: bool
    drafters: list[str]
    device: str = "cpu"
    threads: int = 1
    max_model_len: int = 0
    dtype: str = ""
    device_name: str = ""
    kv_num_blocks: int = 0  # blocks of each of its KV pools (0: none reported)
    vocab_size: int = 0  # rows of the target's logits (0: not the target, or not reported)
    ranks: list[str] = field(default_factory=list)  # a tensor-parallel target's devices, rank by rank
    pid: int | None = None
    restarts: int = 0
    hangs: int = 0  # times the watchdog killed it (no heartbeat, no CPU)

    def update(self, ready: P.Ready) -> None:
        """What the worker's greeting says of itself."""
        self.pid, self.max_model_len, self.threads = ready.pid, ready.max_model_len, ready.num_threads
        self.device, self.dtype, self.device_name = ready.device, ready.dtype, ready.device_name
        self.kv_num_blocks = ready.kv_num_blocks
        self.vocab_size = ready.vocab_size
        self.ranks = list(ready.ranks)

    def describe(self, is_alive: bool) -> dict:
        return {"name": self.name, "device": self.device, "dtype": self.dtype, "device_name": self.device_name,
                "pid": self.pid, "alive": is_alive, "restarts": self.restarts, "hangs": self.hangs,
                "threads": self.threads, "is_target": self.is_target, "drafters": self.drafters,
                "kv_num_blocks": self.kv_num_blocks, "ranks": self.ranks}


BusyHook = Callable[[str, P.BusyInterval], None]


class WorkerPool(Protocol):
    on_busy: BusyHook | None
    # the workers are threads of the coordinator's interpreter: Python the coordinator runs while a worker works
    # contends with it for the GIL, so nothing is gained by overlapping the two (SlotPhases.hold_deltas)
    shares_interpreter: bool

    @property
    def names(self) -> list[str]: ...

    def info(self, name: str) -> WorkerInfo: ...

    async def start(self) -> None: ...

    async def stop(self, timeout_s: float = 5.0) -> None: ...

    def is_alive(self, name: str) -> bool: ...

    def cast(self, name: str, msg: object) -> asyncio.Future:
        """Send an op now; the future holds its reply (or WorkerDied / WorkerError)."""

    async def call(self, name: str, msg: object, timeout_s: float) -> object:
        """Send an op and await its reply; a timeout counts as a hung worker (WorkerDied)."""

    def start_call(self, name: str, msg: object, timeout_s: float) -> Awaitable[object]:
        """`call`, with the op sent before this returns: the caller can do other work while the worker computes, and
        await the reply after."""

    async def restart(self, name: str) -> None: ...

    def cpu_seconds(self, name: str) -> float | None:
        """CPU time the worker has used so far, for the watchdog to tell a hung worker from a busy one (None where
        it cannot be told: workers that are threads of one process)."""

    async def kill(self, name: str, why: str) -> None:
        """Stop a hung worker now: not alive, its calls in flight failed with `WorkerDied`; `restart` revives it."""

    def describe(self) -> list[dict]: ...


def settle(fut: asyncio.Future, reply: object, info: WorkerInfo, on_busy: BusyHook | None) -> None:
    """Report a reply's busy intervals to on_busy and resolve its call (an ErrorReply becomes WorkerError)."""
    if on_busy is not None:
        for b in getattr(reply, "busy", ()):
            on_busy(info.name, b)
    if fut.done():
        return
    if isinstance(reply, P.ErrorReply):
        fut.set_exception(WorkerError(info.name, reply.message, reply.req_ids))
    else:
        fut.set_result(reply)


async def reply_within(fut: asyncio.Future, timeout_s: float) -> object:
    """The result of `fut` (a call's reply), or TimeoutError after timeout_s (set on `fut` itself). `fut` is awaited
    directly, so a reply wakes the caller in the loop iteration after it lands: through `asyncio.shield` and
    `asyncio.timeout` it took two more, ~0.1 ms of every slot on a 2-core CPU, where the target waits for the next op.
    A caller cancelled meanwhile cancels `fut`, which the pool's bookkeeping allows for (`settle` passes a done
    future by), and the cancellation always reaches the caller: not `asyncio.wait_for`, which on Python 3.11 returns
    the result and drops the cancellation when the reply lands in the iteration the caller is cancelled in (CPython
    gh-86296; the coordinator's loop then ran on past `shutdown(drain=False)`: a hang a CI run met)."""
    def expire() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await fut
    finally:
        timer.cancel()


def quiet_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A future whose unobserved exception is not logged (a dropped reply is not an error)."""
    fut = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


class _Local:
    """One in-process worker: its object, its thread, its op queue."""

    def __init__(self, worker, info: WorkerInfo, executor: ThreadPoolExecutor) -> None:
        self.worker = worker
        self.info = info
        self.executor = executor
        self.ops: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.calls: set[asyncio.Future] = set()  # sent, not yet answered
        self.is_hung = False  # a call timed out: dead to the coordinator until restarted


class InProcessPool:
    """Workers in this process. `make_worker(name)` builds one (models load in its own thread);
    `threads_of(name)` is the torch intra-op thread count set on that thread."""

    shares_interpreter = True

    def __init__(self, names: list[str], make_worker: Callable[[str], object],
                 threads_of: Callable[[str], int] = lambda name: 1) -> None:
        self._names = list(names)
        self._make, self._threads_of = make_worker, threads_of
        self._local: dict[str, _Local] = {}
        self._seq = itertools.count(1)
        self.on_busy: BusyHook | None = None

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> WorkerInfo:
        return self._local[name].info

    def worker(self, name: str):
        """The worker object itself (tests and benches reach into models through it)."""
        return self._local[name].worker

    async def start(self) -> None:
        """Every worker loads at once, each on its own thread (a cold `spind generate` waited for the target's
        load, then the draft worker's, one after the other)."""
        results = await asyncio.gather(*(self._start_one(name) for name in self._names), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.stop()
            raise failed

    async def _start_one(self, name: str, restarts: int = 0) -> None:
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"spind-{name}")
        threads = self._threads_of(name)
        worker, ready = await asyncio.get_running_loop().run_in_executor(executor, self._build, name, threads)
        info = WorkerInfo(name=name, is_target=ready.is_target, drafters=list(ready.drafters), restarts=restarts)
        info.update(ready)
        local = _Local(worker, info, executor)
        local.task = asyncio.create_task(self._serve(local), name=f"worker-{name}")
        self._local[name] = local

    def _build(self, name: str, threads: int):
        _set_threads(threads)
        worker = self._make(name)
        return worker, worker.ready(threads)

    async def _serve(self, local: _Local) -> None:
        loop = asyncio.get_running_loop()
        worker = local.worker
        try:
            while True:
                if local.ops.empty() and worker.has_idle_work:
                    await loop.run_in_executor(local.executor, worker.run_idle_work, lambda: not local.ops.empty())
                    continue
                msg, fut = await local.ops.get()
                reply = await loop.run_in_executor(local.executor, worker.answer, msg)
                settle(fut, reply, local.info, self.on_busy)
        except Exception as e:  # what `answer` raises (a lost device) or a precompute's failure: as a crash
            why = f"{type(e).__name__}: {e}"
            log.error("worker %s failed: %s; giving it up", local.info.name, why)
            self._give_up(local.info.name, why)

    async def stop(self, timeout_s: float = 5.0) -> None:
        for name in list(self._local):
            await self._stop_one(name)

    async def _stop_one(self, name: str) -> None:
        local = self._local.pop(name)
        if local.task is not None:
            local.task.cancel()
            await asyncio.gather(local.task, return_exceptions=True)
        local.executor.shutdown(wait=not local.is_hung)  # a hung op's thread cannot be stopped: leave it behind
        close = getattr(local.worker, "close", None)  # a tensor-parallel target's other ranks are processes
        if close is not None and not local.is_hung:
            close()
        while not local.ops.empty():
            _, fut = local.ops.get_nowait()
            if not fut.done():
                fut.set_exception(WorkerDied(name, "stopped"))

    def is_alive(self, name: str) -> bool:
        return name in self._local and not self._local[name].is_hung

    def cast(self, name: str, msg: object) -> asyncio.Future:
        fut = quiet_future(asyncio.get_running_loop())
        local = self._local.get(name)
        if local is None or local.is_hung:
            fut.set_exception(WorkerDied(name, "not running"))
            return fut
        local.calls.add(fut)
        fut.add_done_callback(local.calls.discard)
        local.ops.put_nowait((P.with_seq(msg, next(self._seq)), fut))
        return fut

    async def call(self, name: str, msg: object, timeout_s: float) -> object:
        """As `ProcessPool.call`: no reply within timeout_s means a hung worker, `WorkerDied`. A thread cannot be
        killed as a process is, so the worker is only given up: not alive, its calls in flight failed, its thread
        left to finish the op it is stuck in; `restart` builds a fresh one."""
        return await self.start_call(name, msg, timeout_s)

    def start_call(self, name: str, msg: object, timeout_s: float) -> Awaitable[object]:
        return self._reply(name, self.cast(name, msg), timeout_s)

    async def _reply(self, name: str, fut: asyncio.Future, timeout_s: float) -> object:
        try:
            return await reply_within(fut, timeout_s)
        except TimeoutError:
            why = f"no reply within {timeout_s:.3g} s"
            await self.kill(name, why)
            raise WorkerDied(name, why) from None

    def cpu_seconds(self, name: str) -> float | None:
        return None  # threads of this process: no CPU time of their own to read

    async def kill(self, name: str, why: str) -> None:
        log.error("worker %s: %s; giving it up", name, why)
        self._give_up(name, why)

    def _give_up(self, name: str, why: str) -> None:
        local = self._local.get(name)
        if local is None or local.is_hung:
            return
        local.is_hung = True
        if local.task is not None:
            local.task.cancel()  # no further op reaches its thread
        for fut in list(local.calls):
            if not fut.done():
                fut.set_exception(WorkerDied(name, why))

    async def restart(self, name: str) -> None:
        """Rebuild the worker from scratch (its state is lost, as a restarted process's would be)."""
        restarts = self._local[name].info.restarts + 1 if name in self._local else 1
        if name in self._local:
            await self._stop_one(name)
        await self._start_one(name, restarts)

    def describe(self) -> list[dict]:
        return [local.info.describe(not local.is_hung) for local in self._local.values()]


def _set_threads(threads: int) -> None:
    """torch's intra-op threads for the calling thread's work (set on each worker's own thread)."""
    try:
        import torch
    except ImportError:  # a scripted worker in tests needs no torch
        return
    torch.set_num_threads(max(1, threads))
