"""A tensor-parallel target worker group: rank 0 is the target worker the coordinator talks to; ranks 1..N-1 are
processes it starts, each holding its shard of the model (spind/models/tensor_parallel.py) and its heads' KV.

Rank 0 hands the others its runner's verbs, not the worker's ops: every call that changes the target's KV state
(add, free, fork, truncate of a request; a forward) is mirrored by the other ranks' own `ModelRunner`, so each
rank's block tables, copy-on-write copies and attention plans are the same as rank 0's by construction, and the
coordinator, the protocol, verification, sampling and every drafter stay as they are. Verbs travel as msgpack over
a ZeroMQ PUSH socket per rank (bookkeeping verbs are queued and go with the next forward); the forward's tensors
meet in the collectives (gloo on CPU, NCCL on GPUs) inside the model.

Failure: a rank that dies (or whose collective fails) fails rank 0's next forward with TensorParallelError, which
spind/worker/device.py counts as a lost device: rank 0 exits, the coordinator restarts the target worker, which
starts a fresh group, and replays its requests (re-prefill), as after any worker crash. The other ranks follow
rank 0: they exit when it does (a parent-death signal, and a check of their parent between verbs).

Run as `python -m spind.worker.tensor_parallel --rank R ...` (rank 0 starts it; the config comes on stdin).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import msgspec
import zmq

from spind.config import SpindConfig, from_dict, is_cuda
from spind.models.runner import ForwardItem, ModelRunner

log = logging.getLogger(__name__)

POLL_MS = 500  # a follower's idle poll; between polls it checks that rank 0 is alive
SHM_SLOT_BYTES = 4 << 20  # one rank's part of one shared-memory collective (larger tensors go in pieces)
COLLECTIVE_TIMEOUT_S = 120.0  # a CPU rank waiting this long in a collective for a peer gives the group up
FOLLOWER_COMMAND = (sys.executable, "-m", "spind.worker.tensor_parallel")


def backend_for(devices: list[str]) -> str:
    """NCCL where every rank has a GPU of its own, else gloo (CPU ranks; or GPUs shared by ranks, a test set-up)."""
    cuda = [d for d in devices if is_cuda(d)]
    return "nccl" if len(cuda) == len(devices) and len(set(cuda)) == len(cuda) else "gloo"


def make_process_group(store, rank: int, world: int, backend: str, timeout_s: float):
    """A process group of its own (not torch.distributed's global default group: a process may hold several groups
    over its life, one after another, e.g. a target worker restarted in-process, or tests)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def load_rank(model_dir, dtype: str, device: str, rank: int, world: int, pg, area, alive, timeout_s: float):
    """This rank's shard of the target, wrapped for its group, and every rank's Shard (all ranks call it with the
    same arguments); `pg()` joins the group once the shard is loaded. `area`: the mapped shared-memory file of CPU
    ranks' collectives (None: the process group's); `alive()` raises where a peer is gone."""
    from spind.models.layers import LlamaArgs
    from spind.models.llama import load_llama
    from spind.models.tensor_parallel import Collectives, Shard, ShmCollectives, parallelize

    args = LlamaArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    shards = [Shard.plan(args, r, world) for r in range(world)]
    model = load_llama(model_dir, dtype, device, shard=shards[rank])
    vocab = [s.vocab[1] - s.vocab[0] for s in shards]
    if area is not None:
        comm = ShmCollectives(pg(), rank, world, vocab, area, alive, timeout_s)
    else:
        comm = Collectives(pg(), rank, world, vocab)
    return parallelize(model, shards[rank], comm, args.vocab_size), shards


class TargetGroup:
    """Rank 0's side of the group: the other ranks' processes and their verb channels."""

    def __init__(self, cfg: SpindConfig, model_dir, dtype: str, devices: list[str], threads: int,
                 follower_envs: list[dict[str, str]] | None = None, timeout_s: float = 600.0,
                 command: tuple[str, ...] = FOLLOWER_COMMAND, backend: str | None = None) -> None:
        """`devices`: each rank's device as this process names it (rank 0's first); `follower_envs`: the environment
        of each rank > 0 (its GPU made visible to it); `timeout_s`: for joining and for each collective."""
        import torch.distributed as dist

        self.world = len(devices)
        self.backend = backend or backend_for(devices)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self._queued: list[list] = []
        self.closed = False
        cfg_json = json.dumps(asdict(cfg)).encode()
        self.shm = None
        if all(not is_cuda(d) for d in devices):  # CPU ranks: collectives through shared memory
            from spind.models.tensor_parallel import ShmArea

            path = f"/dev/shm/spind-tp-{os.getpid()}-{id(self):x}"
            self.shm = ShmArea(path, self.world, SHM_SLOT_BYTES, create=True)
        try:
            for rank in range(1, self.world):
                self._spawn(rank, cfg_json, devices[rank], dtype, threads, command,
                            None if follower_envs is None else follower_envs[rank - 1])
            self.model, shards = load_rank(model_dir, dtype, devices[0], 0, self.world, self._join, self.shm,
                                           self.check, min(timeout_s, COLLECTIVE_TIMEOUT_S))
        except BaseException:
            self.close()
            raise
        finally:
            if self.shm is not None:
                self.shm.unlink()  # every rank has it mapped (they map it before joining)
        self.shards = [s.describe() for s in shards]

    def _spawn(self, rank: int, cfg_json: bytes, device: str, dtype: str, threads: int, command: tuple[str, ...],
               env: dict[str, str] | None) -> None:
        """Start rank `rank` (its config on stdin) and the PUSH socket its verbs go through."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.socks.append(sock)
        proc = subprocess.Popen(
            [*command, "--rank", str(rank), "--world", str(self.world), "--store-port", str(self.store.port),
             "--ops", f"tcp://127.0.0.1:{port}", "--device", device, "--dtype", dtype, "--threads", str(threads),
             "--backend", self.backend, "--timeout", str(self.timeout_s), "--shm", self.shm.path if self.shm else ""],
            stdin=subprocess.PIPE, env=env)
        self.procs.append(proc)
        proc.stdin.write(cfg_json)
        proc.stdin.close()

    def _join(self):
        """Rank 0's process group, made while the other ranks are watched: one that exits (a bad model, no memory)
        fails the start at once, naming it, rather than after the join's timeout."""
        out: list = []
        err: list[BaseException] = []

        def join() -> None:
            try:
                out.append(make_process_group(self.store, 0, self.world, self.backend, self.timeout_s))
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=join, daemon=True, name="tp-join")
        t.start()
        while t.is_alive():
            t.join(0.2)
            self.check()
        if err:
            from spind.models.tensor_parallel import TensorParallelError
            raise TensorParallelError(f"the tensor-parallel group did not form: {err[0]}") from err[0]
        return out[0]

    def check(self) -> None:
        """TensorParallelError if a rank's process has exited."""
        from spind.models.tensor_parallel import TensorParallelError

        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {code}")

    def post(self, verb: str, *args) -> None:
        """Queue a bookkeeping verb for the other ranks (sent with the next `send`)."""
        self._queued.append([verb, *args])

    def send(self, verb: str, *args) -> None:
        """The queued verbs and this one, to every other rank, after checking that each is alive."""
        self.check()
        self._queued.append([verb, *args])
        frame = msgspec.msgpack.encode(self._queued)
        self._queued = []
        for sock in self.socks:
            sock.send(frame, copy=False)

    def close(self) -> None:
        """Stop the other ranks (a clean stop; a kill after a short wait), idempotent."""
        if self.closed:
            return
        self.closed = True
        for sock in self.socks:
            try:
                sock.send(msgspec.msgpack.encode([["stop"]]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.socks:
            sock.close()
        self.ctx.term()


def cpu_threads(threads: int, world: int) -> int:
    """Each CPU rank's torch threads when the group is given `threads` cores."""
    return max(1, threads // world)


def start_group(cfg: SpindConfig, model_dir, dtype: str, devices: list[str]) -> TargetGroup:
    """The target's group over `devices` (each rank's, as this process names them): the other ranks started, each
    seeing only its own GPU, and rank 0's shard loaded and joined. CPU ranks share this process's torch threads
    (`cpu_threads`), so that the group never oversubscribes the cores it was given."""
    import torch

    from spind.coordinator.transport.process_pool import worker_env
    from spind.models.layers import LlamaArgs
    from spind.models.tensor_parallel import Shard

    args = LlamaArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    for rank in range(len(devices)):  # a model that does not split is refused before any rank starts
        Shard.plan(args, rank, len(devices))
    envs, names = [], [devices[0]]
    for device in devices[1:]:
        env, name = worker_env(device)
        envs.append(env)
        names.append(name)
    threads = torch.get_num_threads()
    if not is_cuda(devices[0]):
        threads = cpu_threads(threads, len(devices))
        torch.set_num_threads(threads)
    group = TargetGroup(cfg, model_dir, dtype, names, threads, envs, backend=backend_for(devices))
    graphs = (" (its forwards run eagerly: [runtime] cuda_graphs applies to the drafters)" if cfg.runtime.cuda_graphs
              else "")
    print(f"spind: target split over {group.world} ranks ({group.backend}{', shared memory' if group.shm else ''})"
          f"{graphs}: " + "; ".join(f"{d} {s}" for d, s in zip(devices, group.shards)), file=sys.stderr, flush=True)
    return group


class LeaderRunner(ModelRunner):
    """Rank 0's ModelRunner: each verb that changes KV state is mirrored on the other ranks before it runs here."""

    def __init__(self, group: TargetGroup, model, num_blocks: int, block_size: int, attention: str = "packed",
                 max_model_len: int | None = None, max_batch: int = 16, max_tokens: int = 512,
                 kv_cache_dtype: str = "auto", prefix_caching: bool = False) -> None:
        # CUDA graphs stay off: a graph would capture the collectives of one rank only (see the module docstring)
        kwargs = dict(num_blocks=num_blocks, block_size=block_size, attention=attention, max_model_len=max_model_len,
                      max_batch=max_batch, max_tokens=max_tokens, kv_cache_dtype=kv_cache_dtype,
                      prefix_caching=prefix_caching)
        self.group = group
        group.send("runner", kwargs)
        super().__init__(model, cuda_graphs=False, **kwargs)

    def add_request(self, req_id: str) -> None:
        self.group.post("add", req_id)
        super().add_request(req_id)

    def free_request(self, req_id: str) -> None:
        self.group.post("free", req_id)
        super().free_request(req_id)

    def fork(self, src: str, dst: str) -> None:
        self.group.post("fork", src, dst)
        super().fork(src, dst)

    def reuse_prefix(self, req_id: str, tokens: list[int]) -> int:  # every rank's cache decides alike
        self.group.post("reuse", req_id, list(tokens))
        return super().reuse_prefix(req_id, tokens)

    def publish(self, req_id: str, tokens: list[int]) -> None:
        self.group.post("publish", req_id, list(tokens))
        super().publish(req_id, tokens)

    def reset_prefix_cache(self) -> None:
        self.group.post("reset_prefix_cache")
        super().reset_prefix_cache()

    def truncate(self, req_id: str, length: int) -> None:
        self.group.post("truncate", req_id, length)
        super().truncate(req_id, length)

    def _forward(self, items: list[ForwardItem], layers: tuple[int, ...]):
        if items:
            self.group.send("forward", [[it.req_id, it.tokens, it.num_logits] for it in items], list(layers))
        return super()._forward(items, layers)


def _apply(runner: ModelRunner | None, verb: str, args: list, model) -> ModelRunner | None:
    """One verb on a follower's runner; returns the runner (the first verb builds it)."""
    if verb == "runner":
        return ModelRunner(model, cuda_graphs=False, **args[0])
    if verb == "add":
        runner.add_request(args[0])
    elif verb == "free":
        runner.free_request(args[0])
    elif verb == "fork":
        runner.fork(args[0], args[1])
    elif verb == "truncate":
        runner.truncate(args[0], args[1])
    elif verb == "reuse":
        runner.reuse_prefix(args[0], args[1])
    elif verb == "publish":
        runner.publish(args[0], args[1])
    elif verb == "reset_prefix_cache":
        runner.reset_prefix_cache()
    elif verb == "forward":
        runner._forward([ForwardItem(r, list(t), n) for r, t, n in args[0]], tuple(args[1]))
    else:
        raise ValueError(f"unknown verb {verb!r}")
    return runner


def follow(model, sock: zmq.Socket, parent: int) -> None:
    """A follower's loop: rank 0's verbs, in order, until it says stop or is gone."""
    from spind.models.kv_cache import KVCacheFullError

    runner = None
    while True:
        if not sock.poll(POLL_MS):
            if os.getppid() != parent:
                return
            continue
        for verb, *args in msgspec.msgpack.decode(sock.recv()):
            if verb == "stop":
                return
            try:
                runner = _apply(runner, verb, args, model)
            except (KeyError, ValueError, KVCacheFullError) as e:
                # rank 0 holds the same state and failed the same verb the same way, before any collective (a bad
                # request's forward is refused whole): nothing to do but go on in step
                log.debug("verb %s failed as on rank 0: %s", verb, e)


def _die_with_parent() -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spind.worker.tensor_parallel")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--ops", required=True, help="rank 0's verb endpoint")
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--backend", required=True, choices=("gloo", "nccl"))
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--shm", default="", help="the shared-memory file of CPU ranks' collectives")
    args = ap.parse_args(argv)
    parent = os.getppid()
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank[{args.rank}] %(levelname)s %(message)s")
    import torch
    import torch.distributed as dist

    from spind.models.loader import resolve_model_dir
    from spind.worker.device import pin_device

    torch.set_num_threads(max(1, args.threads))
    cfg = from_dict(json.load(sys.stdin))
    pin_device(args.device)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, is_master=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
    def alive() -> None:
        if os.getppid() != parent:
            from spind.models.tensor_parallel import TensorParallelError
            raise TensorParallelError(f"tensor-parallel rank {args.rank}: rank 0 (pid {parent}) is gone")

    from spind.models.tensor_parallel import ShmArea

    area = ShmArea(args.shm, args.world, SHM_SLOT_BYTES, create=False) if args.shm else None  # before joining
    model, _ = load_rank(model_dir, args.dtype, args.device, args.rank, args.world,
                         lambda: make_process_group(store, args.rank, args.world, args.backend, args.timeout),
                         area, alive, min(args.timeout, COLLECTIVE_TIMEOUT_S))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.ops)
    try:
        with torch.inference_mode():
            follow(model, sock, parent)
    finally:
        sock.close()
        ctx.term()
    logging.shutdown()
    os._exit(0)  # not through interpreter teardown: gloo's threads abort the process when destroyed there


if __name__ == "__main__":
    sys.exit(main())
