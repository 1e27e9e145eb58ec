"""Every message between processes: one msgspec Struct per message, msgpack on the wire, never pickle.

Frame = msgpack `[version, {"type": tag, field: value, ...}]`. Decoding validates each field against its
annotation (types, ranges, no unknown fields) and raises `ProtocolError` on anything else, never a crash.
This module imports neither torch nor the daemon: the coordinator, the client library and the workers share it.

Three families:
- coordinator -> worker ops, each with a `seq` its reply echoes: `AddRequest`, `Prefill`, `Propose`,
  `Verify`, `Precompute`, `FreeRequests`, `ForgetFinished`, `Profile`, `Ping`, `Shutdown`; worker -> coordinator:
  `Ready` (greeting), `Ack`, `Proposed`, `Verified`, `Profiled`, `WorkerStats`, `ErrorReply`.
- worker -> worker: `DraftProbs`, a drafter's proposal distributions sent straight to the target worker,
  so [k, vocab] floats never pass through the coordinator.
- the ZeroMQ client API: `ClientRequest`, `ClientAbort` in; `ClientChunk`, `ClientReply`, `ClientError` out.

Two versions: `CLIENT_PROTOCOL_VERSION` for the client API (a public interface: clients are other programs, of
other releases) and `VERSION` for the internal messages (the coordinator and its workers are one spind build), so
an internal change never breaks a client. Bump a family's version when a change renames, removes or retypes one of
its fields or adds a required one; a frame of another version is refused with `ProtocolVersionError`.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from spind.params import SamplingParams

VERSION = 3  # internal: coordinator <-> worker and worker -> worker (3: VerifyItem cuts by cut_values, cut_prices)
CLIENT_PROTOCOL_VERSION = 2  # the ZeroMQ client API (ClientIn, ClientOut); began at the version both shared

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Name = Annotated[str, msgspec.Meta(max_length=128)]


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


class ProtocolVersionError(ProtocolError):
    """A frame of another version of its family's protocol: the two sides run incompatible spind releases."""

    def __init__(self, message: str, version: object, expected: int) -> None:
        super().__init__(message)
        self.version, self.expected = version, expected


class _Msg(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    pass


class _Rec(msgspec.Struct, forbid_unknown_fields=True):
    pass


class BusyInterval(_Rec):
    """A stretch of worker time and what it was spent on (pipeline occupancy)."""

    kind: Name  # draft | verify | prefill | precompute
    start: float  # time.monotonic() on the worker (one clock per machine)
    end: float
    num_reqs: Count = 0
    drafter: Name = ""  # for draft and precompute: which drafter


# ---- coordinator -> worker ----------------------------------------------------------------------------
class AddRequest(_Msg, tag="add_request"):
    """Mirror a request on a worker; on the target worker (is_target) also register it for verification.
    `tokens` is its whole committed sequence: the prompt, or prompt + output for a re-prefill."""

    seq: int
    req_id: ReqId
    tokens: list[TokenId]
    params: SamplingParams
    is_target: bool
    fork_of: ReqId | None = None  # the target's request with these same tokens whose KV it shares (n > 1)
    num_output: Count = 0  # the last tokens that are output, not prompt (a re-prefill: its grammar has passed them)


class PrefillItem(_Rec):
    req_id: ReqId
    num_tokens: Count  # feed this many more of the request's pending tokens into the target's KV


class Prefill(_Msg, tag="prefill"):
    """Chunked prefill on the target: write KV, compute no logits (the first token comes from a verify)."""

    seq: int
    items: list[PrefillItem]
    threads: Count = 0  # torch threads for this op (0: the worker's own setting)


class ProposeItem(_Rec):
    req_id: ReqId
    drafter: Name
    base_len: Count  # the worker's mirror length before new_tokens; must match (catches lost updates)
    new_tokens: list[TokenId]  # committed since the worker last heard of this request
    k: Count
    assume: list[TokenId] = []  # draft ahead: draft after these tentative tokens (not committed, not mirrored)


class Propose(_Msg, tag="propose"):
    seq: int
    slot: int  # time slot id; keys the DraftProbs this propose sends to the target
    items: list[ProposeItem]


class VerifyItem(_Rec):
    req_id: ReqId
    draft: list[TokenId]  # drafted on another worker ([] for none)
    has_probs: bool = False  # its proposal distributions arrive as DraftProbs(probs_slot, req_id)
    probs_slot: int = -1  # the slot of the Propose that drafted it (a pipelined draft waits for a later verify)
    inline_drafter: Name = ""  # a drafter hosted on the target worker drafts k tokens right before verifying
    k: Count = 0
    max_draft: Count = 0  # a request with a grammar: the tokens it forces may lengthen the draft up to this (0: never)
    shadow: list[Name] = []  # model-free drafters hosted here that draft counterfactually for it (never verified)
    shadow_k: Count = 0  # tokens each shadow draft proposes
    # the inline draft is cut to its prefix of greatest worth (`spind.draft_cut.CutRule`: per confidence bin the
    # chance a token survives, per position what it costs; empty: no cut)
    cut_values: list[float] = []
    cut_prices: list[float] = []


class Verify(_Msg, tag="verify"):
    seq: int
    slot: int
    items: list[VerifyItem]
    threads: Count = 0  # torch threads for this op: all cores when nothing drafts meanwhile
    # a follow-on, sent before the verify ahead of it was answered: it runs only if the last Verify this worker
    # answered succeeded, else it is refused (FOLLOW_REFUSED) with nothing changed
    follows: bool = False
    # prefill chunks written in the same forward, before the rows verified (as a Prefill op would; Verified.reused
    # answers for them): a request among the items completes its prompt here and verifies its first token after it.
    # A verify that fails leaves them unwritten too.
    prefill: list[PrefillItem] = []


FOLLOW_REFUSED = "follow-on refused: the verify before it failed"


class PrecomputeItem(_Rec):
    req_id: ReqId
    drafter: Name
    base_len: Count
    new_tokens: list[TokenId]


class Precompute(_Msg, tag="precompute"):
    """Low priority: bring a drafter's KV of a request up to date in the worker's idle time."""

    seq: int
    items: list[PrecomputeItem]


class FreeRequests(_Msg, tag="free_requests"):
    seq: int
    req_ids: list[ReqId]


class ForgetFinished(_Msg, tag="forget_finished"):
    """Drop what the worker keeps from finished requests (suffix decoding's shared cache of their sequences, the
    target's prefix cache): POST /v1/spind/reset_cache, for a bench that sends one prompt to several drafters in
    turn."""

    seq: int


class Profile(_Msg, tag="profile"):
    """Measure what this worker's models cost: each hosted drafter per draft token, the target's verify
    forward at each batch size (k + 1 tokens for `drafting` of the requests, all of them where 0, one for the
    others; over `context` tokens of KV), on `threads` torch threads (0: the worker's own; the drafters always on
    its own)."""

    seq: int
    k: Count
    batch_sizes: list[Count]
    context: Count
    reps: Count
    drafting: Count = 0
    threads: Count = 0


class Ping(_Msg, tag="ping"):
    seq: int


class Shutdown(_Msg, tag="shutdown"):
    seq: int


# ---- worker -> coordinator ----------------------------------------------------------------------------
class Ready(_Msg, tag="ready", kw_only=True):
    name: Name
    pid: int
    is_target: bool
    drafters: list[Name]
    max_model_len: int
    num_threads: int
    device: str = "cpu"  # as configured ([[workers]] device)
    dtype: str = ""  # [model].dtype as this worker resolved it
    device_name: str = ""  # the GPU's or the CPU's model name: cost profiles are kept per device
    kv_num_blocks: Count = 0  # blocks free to requests in each of its KV pools (0: it hosts none)
    vocab_size: Count = 0  # rows of the target's logits (0: it hosts no target): the token ids it can take
    ranks: list[str] = []  # a tensor-parallel target: each rank's device, as configured ([]: one process)


class Ack(_Msg, tag="ack"):
    seq: int
    busy: list[BusyInterval] = []


class Prefilled(_Msg, tag="prefilled"):
    """Prefill's reply: per item, how many of its tokens the target's prefix cache held (reused, not computed)."""

    seq: int
    reused: list[Count]
    busy: list[BusyInterval] = []


class DraftRecord(_Rec):
    req_id: ReqId
    tokens: list[TokenId]
    has_probs: bool = False  # sent to the target worker as DraftProbs
    slot: int = -1  # the Propose's slot, which keys those DraftProbs
    draft_s: Seconds = 0.0  # wall time of the drafter batch that drafted these tokens
    switch_s: Seconds = 0.0  # this request's share of catching the drafter's KV up beyond one token


class Proposed(_Msg, tag="proposed"):
    seq: int
    drafts: list[DraftRecord]
    busy: list[BusyInterval] = []


class TokenLogprobs(_Rec, array_like=True):
    """A committed token's raw log-probability under the target, and its most likely alternatives (best first)."""

    logprob: float
    top_ids: list[TokenId] = []
    top_logprobs: list[float] = []


class VerifyResult(_Rec):
    req_id: ReqId
    num_drafted: Count
    num_accepted: Count
    tokens: list[TokenId]  # accepted drafts, then the recovered or bonus token
    draft_s: Seconds = 0.0  # an inline drafter's time for its batch
    logprobs: list[TokenLogprobs] | None = None  # one per token, for a request that asked (SamplingParams.logprobs)
    shadow: dict[Name, list[TokenId]] = {}  # what each VerifyItem.shadow drafter would have drafted (before the verify)
    switch_s: Seconds = 0.0  # of draft_s: the inline drafter's catch-up with tokens it had not seen (its first use)
    shadow_confidence: dict[Name, list[float]] = {}  # per shadow draft, its Draft.confidence where its drafter has one


class Verified(_Msg, tag="verified"):
    seq: int
    results: list[VerifyResult]
    verify_s: Seconds = 0.0  # wall time of the verify forward
    busy: list[BusyInterval] = []
    grammar_s: Seconds = 0.0  # of which: structured output's grammar work (draft cuts, masks, advancing matchers)
    shadow_s: Seconds = 0.0  # drafting the shadow drafts the items asked for (VerifyItem.shadow), before the forward
    reused: list[Count] = []  # per Verify.prefill item, the tokens of it the prefix cache held (as Prefilled.reused)


class Profiled(_Msg, tag="profiled"):
    seq: int
    draft_ms_per_token: dict[str, float]  # drafter -> median ms per draft token at batch 1
    verify_ms: dict[int, float]  # batch size -> median ms of one verify forward (target worker only)
    busy: list[BusyInterval] = []


class KVStats(_Rec):
    num_blocks: int
    num_free_blocks: int
    num_seqs: int


class WorkerStats(_Msg, tag="worker_stats", kw_only=True):
    seq: int
    name: Name
    pid: int
    req_ids: list[str]  # mirrored requests
    kv: dict[str, KVStats]  # "target" and each model drafter
    drafter_reqs: dict[str, list[str]]  # drafter -> requests it holds state for
    ms_per_token: dict[str, float]  # measured drafting cost per drafter (absent until it has drafted)
    num_precompute_queued: int
    rss_bytes: int = 0
    busy: list[BusyInterval] = []


class ErrorReply(_Msg, tag="error"):
    seq: int  # -1 when the op was unreadable
    message: str
    req_ids: list[str] = []  # the requests whose data caused the failure (fail them alone); [] = the op


# ---- worker -> worker ----------------------------------------------------------------------------------
class DraftProbs(_Msg, tag="draft_probs"):
    """A drafter's proposal distributions q for one request's draft: [len(draft), vocab] float32."""

    slot: int
    req_id: ReqId
    shape: list[Count]
    data: bytes  # C-contiguous little-endian float32

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or self.shape[0] * self.shape[1] * 4 != len(self.data):
            raise ValueError("draft probabilities must be a [k, vocab] float32 matrix matching its data")


# ---- ZeroMQ client API --------------------------------------------------------------------------------
class ChatMessage(_Rec):
    role: Annotated[str, msgspec.Meta(max_length=32)]
    content: str


class ClientRequest(_Msg, tag="client_request"):
    """Exactly one of prompt (text), prompt_ids or messages is set."""

    req_id: ReqId
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    drafter: Name = "auto"
    k: Count | None = None
    stream: bool = True
    api_key: str = ""


class ClientAbort(_Msg, tag="client_abort"):
    req_id: ReqId
    api_key: str = ""


class UsageRecord(_Rec):
    prompt_tokens: int
    completion_tokens: int
    drafters: dict[str, dict[str, int]] = {}  # per drafter: {"drafted": n, "accepted": n}
    num_steps: int = 0
    mean_accepted_length: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV came from the target's prefix cache


class Logprob(_Rec):
    """One token and its log-probability: its id, its text alone and its exact bytes (a token may be part of a
    UTF-8 character, which its text shows as U+FFFD)."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float


class OutputLogprobs(_Rec):
    """An output token's log-probability (raw: the model's, before logit_bias and temperature) and the `logprobs`
    most likely tokens at its position, best first."""

    chosen: Logprob
    top: list[Logprob] = []


class ClientChunk(_Msg, tag="client_chunk"):
    """One delta of a streamed request."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: UsageRecord | None = None
    logprobs: list[OutputLogprobs] | None = None  # one per token of token_ids, when the request asked for them


class ClientReply(_Msg, tag="client_reply"):
    """The whole result of a non-streamed request."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: UsageRecord
    logprobs: list[OutputLogprobs] | None = None  # one per token of token_ids, when the request asked for them


class ClientError(_Msg, tag="client_error"):
    req_id: str
    status: int  # HTTP-style: 400 bad input, 401 key, 413 too long, 503 overloaded/draining, 500 internal
    code: str
    message: str
    param: str | None = None  # the offending field, named as the HTTP API's error bodies name it ("spind.k")


WorkerOp = Union[AddRequest, Prefill, Propose, Verify, Precompute, FreeRequests, ForgetFinished, Profile, Ping,
                 Shutdown]
WorkerReply = Union[Ready, Ack, Prefilled, Proposed, Verified, Profiled, WorkerStats, ErrorReply]
ClientIn = Union[ClientRequest, ClientAbort]
ClientOut = Union[ClientChunk, ClientReply, ClientError]
CLIENT_TYPES: tuple[type, ...] = (*ClientIn.__args__, *ClientOut.__args__)  # type: ignore[attr-defined]
MESSAGE_TYPES: tuple[type, ...] = (*WorkerOp.__args__, *WorkerReply.__args__, DraftProbs,  # type: ignore[attr-defined]
                                   *CLIENT_TYPES)

_ENCODER = msgspec.msgpack.Encoder()
_FRAME = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
_DECODERS = {kind: msgspec.msgpack.Decoder(kind) for kind in (WorkerOp, WorkerReply, ClientIn, ClientOut, DraftProbs)}


def encode(msg: msgspec.Struct) -> bytes:
    """A message -> its frame, stamped with its family's version (the client API's or the internal one)."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"{type(msg).__name__} is not a protocol message")
    return _ENCODER.encode((CLIENT_PROTOCOL_VERSION if isinstance(msg, CLIENT_TYPES) else VERSION, msg))


def decode(frame: bytes, kind: object) -> msgspec.Struct:
    """frame -> a message of `kind` (WorkerOp, WorkerReply, ClientIn, ClientOut or DraftProbs); a frame of another
    version of that family's protocol raises ProtocolVersionError."""
    try:
        version, raw = _FRAME.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"not a frame [version, message]: {e}") from None
    if kind is ClientIn or kind is ClientOut:
        if version != CLIENT_PROTOCOL_VERSION:
            raise ProtocolVersionError(f"unsupported client protocol version {version!r}; this side speaks "
                                       f"{CLIENT_PROTOCOL_VERSION} (the client and the daemon are of incompatible "
                                       f"spind releases)", version, CLIENT_PROTOCOL_VERSION)
    elif version != VERSION:
        raise ProtocolVersionError(f"unsupported protocol version {version!r}; this side speaks {VERSION}",
                                   version, VERSION)
    try:
        return _DECODERS[kind].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)) from None
    except (ValueError, TypeError) as e:  # a __post_init__ check
        raise ProtocolError(str(e)) from None


def with_seq(msg: msgspec.Struct, seq: int) -> msgspec.Struct:
    return msgspec.structs.replace(msg, seq=seq)
