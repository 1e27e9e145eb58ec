"""A worker process: hosts the target verifier (worker "target") and the drafters whose `worker` names it.

Run as `python -m spind.daemon.worker --name NAME --config RUN_DIR/config.json --endpoint ipc://...`.

State: a mirror of each request it serves, keyed by req_id: its sampling params and the committed tokens
the coordinator has told it about (`AddRequest` sends them whole, `Propose`/`Precompute` send only the
tokens committed since). The coordinator owns the truth; a worker never decides what is committed.

Socket: one DEALER, connected to a DEALER the coordinator binds for this worker incarnation. DEALER and
not REQ (lockstep) so the coordinator can queue several ops (add + propose, or a low-priority precompute)
and the worker can see whether anything else is waiting; not PAIR because PAIR does not survive a
reconnect cleanly; not one shared ROUTER because a restarted worker gets a fresh endpoint and thus can
never receive replies-in-flight meant for the incarnation that died.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from spind import protocol as P
from spind.config import SpindConfig, from_dict
from spind.drafters import Drafter, DraftInput, build_drafter
from spind.engine.target import TargetVerifier, VerifyItem
from spind.models.llama import load_llama
from spind.models.loader import resolve_model_dir
from spind.models.runner import ModelRunner
from spind.models.tokenizer import Tokenizer
from spind.sampling import SamplingParams

log = logging.getLogger(__name__)

TARGET_WORKER = "target"  # the worker that hosts the target model (and verifies)
POLL_MS = 500  # idle poll; between polls the worker checks that its parent is alive


def worker_names(cfg: SpindConfig) -> list[str]:
    """The worker processes to start: the target's, then every worker that hosts a configured drafter."""
    names = [TARGET_WORKER]
    for d in cfg.drafters:
        if d.worker not in names:
            names.append(d.worker)
    return names


def threads_for(cfg: SpindConfig, name: str, num_cores: int | None = None) -> int:
    """torch intra-op threads of one worker: its own setting, else [runtime].threads, else an even share."""
    w = cfg.worker(name)
    share = max(1, (num_cores or os.cpu_count() or 1) // len(worker_names(cfg)))
    return w.threads or cfg.runtime.threads or share


@dataclass
class Mirror:
    params: SamplingParams
    tokens: list[int]  # committed sequence as last told by the coordinator


class Worker:
    """Everything one worker hosts, and the handling of one op at a time (no I/O here)."""

    def __init__(self, name: str, cfg: SpindConfig) -> None:
        self.name = name
        self.device = cfg.worker(name).device
        model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
        tokenizer = Tokenizer(model_dir)
        self.target: TargetVerifier | None = None
        if name == TARGET_WORKER:
            r = cfg.runtime
            model = load_llama(model_dir, cfg.model.dtype, self.device)
            self.target = TargetVerifier(ModelRunner(model, r.kv_num_blocks, r.kv_block_size, r.attention,
                                                     cfg.model.max_model_len))
        self.drafters: dict[str, Drafter] = {
            d.name: build_drafter(d, cfg, model_dir, tokenizer, self.device) for d in cfg.drafters if d.worker == name}
        self.drafter_reqs: dict[str, set[str]] = {n: set() for n in self.drafters}
        self.mirrors: dict[str, Mirror] = {}
        self.precompute_queue: deque[tuple[str, str]] = deque()  # (req_id, drafter)
        self.busy: list[P.BusyInterval] = []  # since the last reply
        self.max_model_len = self.target.max_model_len if self.target else cfg.model.max_model_len

    # ---- dispatch -------------------------------------------------------------------------------
    def handle(self, msg: object) -> object:
        """One op -> its reply. Raises on a bad op (the loop turns that into an ErrorReply)."""
        if isinstance(msg, P.AddRequest):
            self.add_request(msg)
            return self._ack(msg.seq)
        if isinstance(msg, P.Propose):
            drafts = self.propose(msg.items)
            return P.Proposed(msg.seq, drafts, self._take_busy())
        if isinstance(msg, P.Verify):
            return P.Verified(msg.seq, self.verify(msg.items), self._take_busy())
        if isinstance(msg, P.Precompute):
            self.enqueue_precompute(msg.items)
            return self._ack(msg.seq)
        if isinstance(msg, P.FreeRequests):
            for req_id in msg.req_ids:
                self.free_request(req_id)
            return self._ack(msg.seq)
        if isinstance(msg, P.Ping):
            return self.stats(msg.seq)
        raise ValueError(f"worker cannot handle {type(msg).__name__}")

    def _ack(self, seq: int) -> P.Ack:
        return P.Ack(seq, self._take_busy())

    def _take_busy(self) -> list[P.BusyInterval]:
        busy, self.busy = self.busy, []
        return busy

    def _timed(self, kind: str, num_reqs: int, fn):
        start = time.monotonic()
        try:
            return fn()
        finally:
            self.busy.append(P.BusyInterval(kind, start, time.monotonic(), num_reqs))

    # ---- request lifecycle ----------------------------------------------------------------------
    def add_request(self, msg: P.AddRequest) -> None:
        if not msg.tokens:
            raise ValueError(f"{msg.req_id}: empty token list")
        if msg.req_id in self.mirrors:  # a resync: start over from the full sequence
            self.free_request(msg.req_id)
        params = P.record_to_sampling(msg.params)
        if msg.is_target:
            if self.target is None:
                raise ValueError(f"worker {self.name!r} does not host the target")
            self.target.add_request(msg.req_id, msg.tokens, params)
        self.mirrors[msg.req_id] = Mirror(params, list(msg.tokens))

    def free_request(self, req_id: str) -> None:
        if self.target is not None:
            self.target.free_request(req_id)
        for name, reqs in self.drafter_reqs.items():
            if req_id in reqs:
                self.drafters[name].free_request(req_id)
                reqs.discard(req_id)
        self.mirrors.pop(req_id, None)

    def _sync(self, req_id: str, drafter: str, base_len: int, new_tokens: list[int]) -> Mirror:
        """Apply the coordinator's news to the mirror; make sure `drafter` holds the request."""
        m = self.mirrors.get(req_id)
        if m is None:
            raise ValueError(f"{req_id}: unknown request on worker {self.name!r}")
        if len(m.tokens) != base_len:
            raise ValueError(f"{req_id}: mirror has {len(m.tokens)} tokens, coordinator assumed {base_len}")
        if drafter not in self.drafters:
            raise ValueError(f"drafter {drafter!r} is not hosted on worker {self.name!r}")
        m.tokens.extend(new_tokens)
        if req_id not in self.drafter_reqs[drafter]:
            self.drafters[drafter].add_request(req_id, m.params)
            self.drafter_reqs[drafter].add(req_id)
        return m

    # ---- ops ------------------------------------------------------------------------------------
    def propose(self, items: list[P.ProposeItem]) -> list[P.DraftRecord]:
        groups: dict[str, list[tuple[int, DraftInput]]] = {}  # drafter -> (position in items, input)
        for i, it in enumerate(items):
            m = self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
            groups.setdefault(it.drafter, []).append((i, DraftInput(it.req_id, list(m.tokens), max(0, it.k))))
        out: list[P.DraftRecord | None] = [None] * len(items)
        for name, batch in groups.items():
            inputs = [x for _, x in batch]
            drafts = self._timed("propose", len(inputs), lambda: self.drafters[name].propose(inputs))
            for (i, x), d in zip(batch, drafts):
                probs = None if d.probs is None else P.tensor_to_record(d.probs)
                out[i] = P.DraftRecord(x.req_id, list(d.tokens), probs)
        return out

    def verify(self, items: list[P.VerifyItemRecord]) -> list[P.VerifyResultRecord]:
        if self.target is None:
            raise ValueError(f"worker {self.name!r} does not host the target")
        for it in items:
            if not self.target.has_request(it.req_id):
                raise ValueError(f"{it.req_id}: unknown request on the target")
        device = self.target.runner.model.device  # q [len(draft), V] meets the target's p on its device
        vitems = [VerifyItem(it.req_id, it.draft,
                             None if it.draft_probs is None else P.record_to_tensor(it.draft_probs).to(device))
                  for it in items]
        outs = self._timed("verify", len(items), lambda: self.target.verify(vitems))
        return [P.VerifyResultRecord(o.req_id, o.num_drafted, o.num_accepted, o.tokens) for o in outs]

    def enqueue_precompute(self, items: list[P.PrecomputeItem]) -> None:
        for it in items:
            self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
            self.precompute_queue.append((it.req_id, it.drafter))

    def run_precompute(self) -> None:
        """One queued precompute, if its request is still here (called only when no op is waiting)."""
        req_id, drafter = self.precompute_queue.popleft()
        if req_id in self.mirrors and req_id in self.drafter_reqs[drafter]:
            tokens = list(self.mirrors[req_id].tokens)
            self._timed("precompute", 1, lambda: self.drafters[drafter].precompute(req_id, tokens))

    def stats(self, seq: int) -> P.WorkerStats:
        kv = {}
        runners = {TARGET_WORKER: self.target.runner} if self.target else {}
        runners.update({n: d.runner for n, d in self.drafters.items() if hasattr(d, "runner")})
        for n, r in runners.items():
            kv[n] = P.KVStats(r.kv.num_blocks, r.kv.num_free_blocks, len(r.kv.seqs))
        ms = {n: float(d.ms_per_token) for n, d in self.drafters.items() if d.ms_per_token is not None}
        return P.WorkerStats(seq, self.name, os.getpid(), sorted(self.mirrors), kv,
                             {n: sorted(r) for n, r in self.drafter_reqs.items()}, ms,
                             len(self.precompute_queue), self._take_busy())


def serve(worker: Worker, sock: zmq.Socket) -> None:
    """Answer ops in arrival order; run queued precomputes only while nothing else waits."""
    parent = os.getppid()
    while True:
        if worker.precompute_queue and not sock.poll(0):
            try:
                worker.run_precompute()
            except Exception:
                log.exception("precompute failed on worker %s", worker.name)
            continue
        if not sock.poll(POLL_MS):
            if os.getppid() != parent:  # the coordinator died: do not linger as an orphan
                return
            continue
        frame = sock.recv()
        try:
            msg = P.decode(frame)
        except P.ProtocolError as e:
            sock.send(P.encode(P.ErrorReply(-1, f"protocol error: {e}")))
            continue
        seq = getattr(msg, "seq", -1)
        if isinstance(msg, P.Shutdown):
            sock.send(P.encode(P.Ack(seq)))
            return
        try:
            reply = worker.handle(msg)
        except Exception as e:
            log.debug("op failed: %s", traceback.format_exc())
            reply = P.ErrorReply(seq, f"{type(e).__name__}: {e}")
        sock.send(P.encode(reply))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spind.daemon.worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", required=True, help="JSON dump of the coordinator's SpindConfig")
    ap.add_argument("--endpoint", required=True, help="ipc:// endpoint the coordinator bound for this worker")
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s worker[{args.name}] %(levelname)s %(message)s")
    torch.set_num_threads(max(1, args.threads))
    with open(args.config) as f:
        cfg = from_dict(json.load(f))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)
    worker = Worker(args.name, cfg)
    sock.send(P.encode(P.Ready(args.name, os.getpid(), worker.target is not None, sorted(worker.drafters),
                               worker.max_model_len, torch.get_num_threads())))
    try:
        serve(worker, sock)
    finally:
        sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
