"""Draft probabilities, drafter worker -> target worker, without passing through the coordinator.

A sampled draft needs its proposal distributions q ([k, vocab] floats: 0.8 MB per request at k=4 here)
on the target for rejection sampling. The drafter sends them straight to the target worker, keyed by
(slot, req_id), before it replies to the coordinator; the coordinator's Verify says which requests have
them under which slot, and the target takes them from its channel (waiting for any still in flight).
Entries never taken (their slot was aborted) are dropped once STALE_SLOTS newer slots have been taken.

- `LocalProbsChannel`: the in-process pool's channel (a dict and a condition variable).
- `ZmqProbsSender` / `ZmqProbsReceiver`: between processes. The target worker binds a PULL socket at an
  endpoint fixed for the daemon's life; drafter workers connect PUSH sockets to it, which reconnect on
  their own when a restarted target binds it again. Frames of older slots are dropped on arrival.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import numpy as np
import torch
import zmq

from spind import protocol as P


STALE_SLOTS = 64


def drop_stale(held: dict[tuple[int, str], torch.Tensor], newest: int) -> None:
    for key in [k for k in held if k[0] < newest - STALE_SLOTS]:
        del held[key]


class ProbsTimeout(RuntimeError):
    """Draft probabilities announced by the coordinator never arrived."""


class ProbsSender(Protocol):
    def send(self, slot: int, req_id: str, probs: torch.Tensor) -> None: ...


class ProbsReceiver(Protocol):
    def take(self, keys: list[tuple[int, str]], timeout_s: float) -> dict[str, torch.Tensor]:
        """The probabilities sent under each (slot, req_id), waiting for any still in flight."""

    def put_back(self, taken: dict[tuple[int, str], torch.Tensor]) -> None:
        """Hold taken probabilities again: the verify that took them changed nothing (a request in it failed), and
        the others' drafts are verified again."""


def to_record(slot: int, req_id: str, probs: torch.Tensor) -> P.DraftProbs:
    arr = probs.detach().to("cpu", torch.float32).contiguous().numpy()
    return P.DraftProbs(slot, req_id, list(arr.shape), arr.astype("<f4", copy=False).tobytes())


def from_record(rec: P.DraftProbs) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(rec.data, dtype="<f4").reshape(rec.shape).copy())


class LocalProbsChannel:
    def __init__(self) -> None:
        self._items: dict[tuple[int, str], torch.Tensor] = {}
        self._cond = threading.Condition()

    def send(self, slot: int, req_id: str, probs: torch.Tensor) -> None:
        with self._cond:
            self._items[(slot, req_id)] = probs
            self._cond.notify_all()

    def take(self, keys: list[tuple[int, str]], timeout_s: float) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not all(key in self._items for key in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProbsTimeout(f"draft probabilities of {keys} did not arrive")
                self._cond.wait(left)
            out = {r: self._items.pop((slot, r)) for slot, r in keys}
            drop_stale(self._items, max(slot for slot, _ in keys))
            return out

    def put_back(self, taken: dict[tuple[int, str], torch.Tensor]) -> None:
        with self._cond:
            self._items.update(taken)


class ZmqProbsSender:
    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, slot: int, req_id: str, probs: torch.Tensor) -> None:
        self.sock.send(P.encode(to_record(slot, req_id, probs)), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class ZmqProbsReceiver:
    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._held: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, keys: list[tuple[int, str]], timeout_s: float) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        while not all(key in self._held for key in keys):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                raise ProbsTimeout(f"draft probabilities of {keys} did not arrive")
            try:
                rec = P.decode(self.sock.recv(), P.DraftProbs)
            except P.ProtocolError:
                continue  # not ours to crash on; the timeout reports what is missing
            self._held[(rec.slot, rec.req_id)] = from_record(rec)
        out = {r: self._held.pop((slot, r)) for slot, r in keys}
        drop_stale(self._held, max(slot for slot, _ in keys))
        return out

    def put_back(self, taken: dict[tuple[int, str], torch.Tensor]) -> None:
        self._held.update(taken)

    def close(self) -> None:
        self.sock.close(linger=0)
