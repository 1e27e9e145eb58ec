"""Every message between processes: one typed record (a dataclass) per message, msgpack on the wire.

Frame = msgpack `[VERSION, tag, {field: value}]`. Nested records travel as field maps without a tag (their
type is known from the field's annotation). Token-id lists (`list[int]`) travel as int arrays, or as raw
little-endian int32 bytes once longer than `PACK_THRESHOLD`; probability tensors as `TensorRecord` (raw
float32/float16 bytes + shape). Never pickle.

`decode` checks the frame against the record's annotations (int, float, str, bool, bytes, `X | None`,
`list[X]`, `dict[str, X]`, nested records) and raises `ProtocolError` on anything else: never a crash,
never an eval.

Two families share the module:
- coordinator <-> worker ops (`AddRequest`, `Propose`, `Precompute`, `Verify`, `FreeRequests`, `Ping`,
  `Shutdown`) with their replies (`Ack`, `Proposed`, `Verified`, `WorkerStats`, `ErrorReply`) and the
  worker's `Ready` greeting. Every op carries `seq`, echoed by its reply.
- the ZeroMQ client API (`ClientRequest`, `ClientAbort` in; `ClientChunk`, `ClientReply`, `ClientError` out).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgpack
import numpy as np
import torch

VERSION = 1
PACK_THRESHOLD = 64  # list[int] longer than this goes as raw little-endian int32 bytes
_INT32 = (-(2**31), 2**31 - 1)
_DTYPES = {"float32": (torch.float32, np.float32, 4), "float16": (torch.float16, np.float16, 2)}


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


_RECORDS: dict[str, type] = {}  # tag -> record class (top-level messages)
_HINTS: dict[type, dict[str, Any]] = {}
R = TypeVar("R")


def message(tag: str) -> Callable[[type[R]], type[R]]:
    """Register a dataclass as a top-level message with a wire tag."""

    def wrap(cls: type[R]) -> type[R]:
        if tag in _RECORDS:
            raise ValueError(f"duplicate message tag {tag!r}")
        cls.TAG = tag  # type: ignore[attr-defined]
        _RECORDS[tag] = cls
        return cls

    return wrap


# ---- shared records -------------------------------------------------------------------------------
@dataclass
class TensorRecord:
    dtype: str  # float32 | float16
    shape: list[int]
    data: bytes  # C-contiguous, little-endian

    def check(self) -> None:
        if self.dtype not in _DTYPES:
            raise ProtocolError(f"tensor dtype must be one of {list(_DTYPES)}")
        if len(self.shape) > 4 or any(not 0 <= d < 2**31 for d in self.shape):
            raise ProtocolError("tensor shape must be at most 4 dims in [0, 2**31)")
        numel = 1
        for d in self.shape:
            numel *= d  # Python ints: no wrap-around
        if numel * _DTYPES[self.dtype][2] != len(self.data):
            raise ProtocolError("tensor data length does not match its shape")


def tensor_to_record(t: torch.Tensor, dtype: str = "float32") -> TensorRecord:
    arr = t.detach().to("cpu", _DTYPES[dtype][0]).contiguous().numpy()
    return TensorRecord(dtype, list(arr.shape), arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def record_to_tensor(r: TensorRecord) -> torch.Tensor:
    """-> float32 tensor of r.shape (a copy: the frame's buffer is read-only)."""
    arr = np.frombuffer(r.data, dtype=np.dtype(_DTYPES[r.dtype][1]).newbyteorder("<")).reshape(r.shape)
    return torch.from_numpy(arr.astype(np.float32))


@dataclass
class Sampling:
    """spind.sampling.SamplingParams on the wire."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


def sampling_to_record(p: Any) -> Sampling:
    return Sampling(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop), p.ignore_eos)


def record_to_sampling(r: Sampling) -> Any:
    from spind.sampling import SamplingParams
    return SamplingParams(r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, tuple(r.stop), r.ignore_eos)


@dataclass
class BusyInterval:
    kind: str  # propose | verify | precompute | prefill
    start: float  # time.monotonic() on the worker (system-wide clock on one machine)
    end: float
    num_reqs: int = 0


# ---- coordinator -> worker ------------------------------------------------------------------------
@message("add_request")
@dataclass
class AddRequest:
    """Mirror a request on a worker; on the target worker (is_target) also register it for verification.
    `tokens` is the whole committed sequence: the prompt, or prompt + output for a re-prefill."""

    seq: int
    req_id: str
    tokens: list[int]
    params: Sampling
    is_target: bool


@dataclass
class ProposeItem:
    req_id: str
    drafter: str
    base_len: int  # length of the worker's mirror before new_tokens; must match (catches lost updates)
    new_tokens: list[int]  # committed since the worker last heard of this request
    k: int


@message("propose")
@dataclass
class Propose:
    seq: int
    items: list[ProposeItem]


@dataclass
class PrecomputeItem:
    req_id: str
    drafter: str
    base_len: int
    new_tokens: list[int]


@message("precompute")
@dataclass
class Precompute:
    """Low priority: the worker runs these only when no other op is queued."""

    seq: int
    items: list[PrecomputeItem]


@dataclass
class VerifyItemRecord:
    req_id: str
    draft: list[int]
    draft_probs: TensorRecord | None = None  # [len(draft), V]; None = point mass


@message("verify")
@dataclass
class Verify:
    seq: int
    items: list[VerifyItemRecord]


@message("free_requests")
@dataclass
class FreeRequests:
    seq: int
    req_ids: list[str]


@message("ping")
@dataclass
class Ping:
    seq: int


@message("shutdown")
@dataclass
class Shutdown:
    seq: int


# ---- worker -> coordinator ------------------------------------------------------------------------
@message("ready")
@dataclass
class Ready:
    name: str
    pid: int
    is_target: bool
    drafters: list[str]
    max_model_len: int
    num_threads: int


@message("ack")
@dataclass
class Ack:
    seq: int
    busy: list[BusyInterval] = field(default_factory=list)


@dataclass
class DraftRecord:
    req_id: str
    tokens: list[int]
    probs: TensorRecord | None = None


@message("proposed")
@dataclass
class Proposed:
    seq: int
    drafts: list[DraftRecord]
    busy: list[BusyInterval] = field(default_factory=list)


@dataclass
class VerifyResultRecord:
    req_id: str
    num_drafted: int
    num_accepted: int
    tokens: list[int]


@message("verified")
@dataclass
class Verified:
    seq: int
    results: list[VerifyResultRecord]
    busy: list[BusyInterval] = field(default_factory=list)


@dataclass
class KVStats:
    num_blocks: int
    num_free_blocks: int
    num_seqs: int


@message("worker_stats")
@dataclass
class WorkerStats:
    seq: int
    name: str
    pid: int
    req_ids: list[str]  # mirrored requests
    kv: dict[str, KVStats]  # "target" and each model drafter
    drafter_reqs: dict[str, list[str]]  # drafter -> requests it holds state for
    ms_per_token: dict[str, float]  # measured drafting cost per drafter (absent until it has drafted)
    num_precompute_queued: int
    busy: list[BusyInterval] = field(default_factory=list)


@message("error")
@dataclass
class ErrorReply:
    seq: int  # -1 when the op was unreadable
    message: str


# ---- ZeroMQ client API ----------------------------------------------------------------------------
@dataclass
class ChatMessage:
    role: str
    content: str


@message("client_request")
@dataclass
class ClientRequest:
    """Exactly one of prompt (text), prompt_ids or messages is set."""

    req_id: str
    params: Sampling
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    drafter: str = "auto"
    k: int | None = None
    stream: bool = True


@message("client_abort")
@dataclass
class ClientAbort:
    req_id: str


@dataclass
class UsageRecord:
    prompt_tokens: int
    completion_tokens: int
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)
    num_steps: int = 0
    mean_accepted_length: float = 0.0


@message("client_chunk")
@dataclass
class ClientChunk:
    """One Delta of a streamed request."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: UsageRecord | None = None


@message("client_reply")
@dataclass
class ClientReply:
    """The whole result of a non-streamed request."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: UsageRecord


@message("client_error")
@dataclass
class ClientError:
    req_id: str
    status: int  # HTTP-style: 400 bad input, 413 too long, 503 overloaded/draining, 500 internal
    code: str
    message: str


def usage_to_record(u: Any) -> UsageRecord:
    return UsageRecord(u.prompt_tokens, u.completion_tokens, {k: dict(v) for k, v in u.drafters.items()},
                       u.num_steps, float(u.mean_accepted_length))


def record_to_usage(r: UsageRecord) -> Any:
    from spind.daemon.interface import Usage
    return Usage(r.prompt_tokens, r.completion_tokens, r.drafters, r.num_steps, r.mean_accepted_length)


# ---- encode / decode ------------------------------------------------------------------------------
def encode(msg: Any) -> bytes:
    tag = getattr(type(msg), "TAG", None)
    if tag is None or _RECORDS.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a protocol message")
    return msgpack.packb([VERSION, tag, _enc_record(msg)], use_bin_type=True)


def decode(frame: bytes) -> Any:
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("frame must be [version, tag, fields]")
    version, tag, body = obj
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}; this side speaks {VERSION}")
    if not isinstance(tag, str) or tag not in _RECORDS:
        raise ProtocolError(f"unknown message type {tag!r}")
    try:
        return _dec_record(body, _RECORDS[tag], tag)
    except ProtocolError:
        raise
    except Exception as e:  # belt and braces: a validator bug must still not crash a peer
        raise ProtocolError(f"{tag}: malformed ({type(e).__name__})") from None


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _enc_record(rec: Any) -> dict[str, Any]:
    hints = _hints(type(rec))
    return {f.name: _enc(getattr(rec, f.name), hints[f.name]) for f in dataclasses.fields(rec)}


def _enc(value: Any, tp: Any) -> Any:
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return _enc_record(value)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        return _enc(value, inner)
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is int and len(value) > PACK_THRESHOLD and _INT32[0] <= min(value) and max(value) <= _INT32[1]:
            return np.asarray(value, dtype="<i4").tobytes()
        return [_enc(v, item) for v in value]
    if origin is dict:
        _, item = typing.get_args(tp)
        return {k: _enc(v, item) for k, v in value.items()}
    if tp is float:
        return float(value)
    return value


def _dec_record(raw: Any, cls: type, path: str) -> Any:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{path}: expected a map of fields")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ProtocolError(f"{path}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for name, f in fields.items():
        if name in raw:
            kwargs[name] = _dec(raw[name], hints[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{path}: missing field {name!r}")
    rec = cls(**kwargs)
    if hasattr(rec, "check"):
        rec.check()
    return rec


def _dec(raw: Any, tp: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _dec_record(raw, tp, path)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if raw is None:
            return None
        return _dec(raw, next(a for a in typing.get_args(tp) if a is not type(None)), path)
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is int and isinstance(raw, bytes):
            if len(raw) % 4:
                raise ProtocolError(f"{path}: packed int32 list length is not a multiple of 4")
            return np.frombuffer(raw, dtype="<i4").tolist()
        if not isinstance(raw, list):
            raise ProtocolError(f"{path}: expected a list")
        return [_dec(v, item, f"{path}[{i}]") for i, v in enumerate(raw)]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
            raise ProtocolError(f"{path}: expected a map with string keys")
        return {k: _dec(v, item, f"{path}.{k}") for k, v in raw.items()}
    if tp is float:
        if type(raw) not in (int, float):
            raise ProtocolError(f"{path}: expected a number")
        return float(raw)
    if tp in (int, str, bool, bytes):
        if type(raw) is not tp:  # exact: a bool is not an int here
            raise ProtocolError(f"{path}: expected {tp.__name__}")
        return raw
    raise ProtocolError(f"{path}: unsupported field type")  # never reached for registered records


def message_types() -> dict[str, type]:
    """tag -> record class, for tests and docs."""
    return dict(_RECORDS)
