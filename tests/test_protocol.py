"""spind.protocol: every record round-trips; anything malformed is a ProtocolError, never a crash."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from spind import protocol as P
from spind.sampling import SamplingParams

BUSY = [P.BusyInterval("verify", 12.5, 12.75, 3)]
SAMPLING = P.Sampling(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=["\n\n", "END"])
LONG = list(range(49_000, 49_000 + 300))  # longer than PACK_THRESHOLD: travels as raw int32 bytes
PROBS = P.tensor_to_record(torch.softmax(torch.randn(3, 11), -1))

SAMPLES = [
    P.AddRequest(1, "r1", LONG, SAMPLING, True),
    P.Propose(2, [P.ProposeItem("r1", "int8", 300, [5, 6], 4), P.ProposeItem("r2", "ngram", 10, [], 2)]),
    P.Precompute(3, [P.PrecomputeItem("r1", "int8", 302, [7])]),
    P.Verify(4, [P.VerifyItemRecord("r1", [1, 2, 3], PROBS), P.VerifyItemRecord("r2", [])]),
    P.FreeRequests(5, ["r1", "r2"]),
    P.Ping(6),
    P.Shutdown(7),
    P.Ready("target", 1234, True, ["ngram"], 2048, 1),
    P.Ack(8, BUSY),
    P.Proposed(9, [P.DraftRecord("r1", [4, 5], PROBS), P.DraftRecord("r2", [])], BUSY),
    P.Verified(10, [P.VerifyResultRecord("r1", 3, 2, [1, 2, 9])], BUSY),
    P.WorkerStats(11, "draft", 99, ["r1"], {"int8": P.KVStats(512, 500, 1)}, {"int8": ["r1"]}, {"int8": 3.5}, 0, []),
    P.ErrorReply(-1, "protocol error: boom"),
    P.ClientRequest("c1", SAMPLING, messages=[P.ChatMessage("user", "hi")], drafter="int8", k=3, stream=False),
    P.ClientRequest("c2", P.Sampling(), prompt_ids=LONG),
    P.ClientAbort("c1"),
    P.ClientChunk("c1", [1, 2], "hé", "stop", P.UsageRecord(5, 2, {"int8": {"drafted": 4, "accepted": 3}}, 2, 2.5)),
    P.ClientReply("c1", LONG, "text", "length", P.UsageRecord(5, 300)),
    P.ClientError("c1", 413, "context_length_exceeded", "too long"),
]


def test_samples_cover_every_message_type():
    assert {type(m).TAG for m in SAMPLES} == set(P.message_types())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).TAG)
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


def test_long_token_lists_travel_as_raw_int32_bytes():
    frame = P.encode(P.AddRequest(1, "r", LONG, P.Sampling(), False))
    body = msgpack.unpackb(frame)[2]
    assert isinstance(body["tokens"], bytes) and len(body["tokens"]) == 4 * len(LONG)
    short = msgpack.unpackb(P.encode(P.FreeRequests(1, ["a"])))[2]
    assert short["req_ids"] == ["a"]


def test_tensor_round_trip_float32_and_float16():
    t = torch.softmax(torch.randn(4, 49152), -1)  # [k, V] as a drafter sends it
    msg = P.decode(P.encode(P.Proposed(1, [P.DraftRecord("r", [1, 2, 3, 4], P.tensor_to_record(t))])))
    assert torch.equal(P.record_to_tensor(msg.drafts[0].probs), t)
    half = P.record_to_tensor(P.tensor_to_record(t, "float16"))
    assert half.dtype == torch.float32 and torch.allclose(half, t, atol=1e-3)


def test_sampling_params_conversion():
    p = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.8, top_k=3, seed=1, stop=("x",), ignore_eos=True)
    assert P.record_to_sampling(P.sampling_to_record(p)) == p


def _frame(tag: str, body: object, version: int = P.VERSION) -> bytes:
    return msgpack.packb([version, tag, body], use_bin_type=True)


@pytest.mark.parametrize("frame, why", [
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"a": 1}), "frame must be"),
    (_frame("ping", {"seq": 1}, version=2), "version"),
    (_frame("ping", {"seq": 1}, version=True), "version"),
    (_frame("no_such_type", {}), "unknown message type"),
    (_frame("ping", {}), "missing field"),
    (_frame("ping", {"seq": 1, "extra": 2}), "unknown field"),
    (_frame("ping", {"seq": True}), "expected int"),
    (_frame("ping", {"seq": "1"}), "expected int"),
    (_frame("ping", [1]), "map of fields"),
    (_frame("free_requests", {"seq": 1, "req_ids": "abc"}), "expected a list"),
    (_frame("add_request", {"seq": 1, "req_id": "r", "tokens": b"\x00\x00\x00", "is_target": True,
                            "params": {}}), "multiple of 4"),
    (_frame("add_request", {"seq": 1, "req_id": "r", "tokens": [1, 2.5], "is_target": True,
                            "params": {}}), "expected int"),
    (_frame("verify", {"seq": 1, "items": [{"req_id": "r", "draft": [1],
                                            "draft_probs": {"dtype": "float32", "shape": [1, 3], "data": b"1234"}}]}),
     "does not match its shape"),
    (_frame("verify", {"seq": 1, "items": [{"req_id": "r", "draft": [1],
                                            "draft_probs": {"dtype": "int64", "shape": [1], "data": b"12345678"}}]}),
     "dtype"),
    (_frame("verify", {"seq": 1, "items": [{"req_id": "r", "draft": [1], "draft_probs": {
        "dtype": "float32", "shape": [2**32, 2**32], "data": b""}}]}), "tensor shape"),
    (_frame("worker_stats", {"seq": 1, "name": "w", "pid": 1, "req_ids": [], "kv": {1: {}}, "drafter_reqs": {},
                             "ms_per_token": {}, "num_precompute_queued": 0}), "not msgpack"),  # int map key
    (msgpack.packb([P.VERSION, "ping", {"seq": 1}]) + b"\x00", "not msgpack"),
    (b"\x91" * 100_000 + b"\x00", "not msgpack"),  # nesting deeper than the unpacker's stack
    (b"\xdd\xff\xff\xff\xff", "not msgpack"),  # an array claiming 4 billion items
    (msgpack.packb([P.VERSION, "ping", {"seq": msgpack.ExtType(1, b"x")}]), "expected int"),
])
def test_malformed_frames_raise_protocol_error(frame, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(frame)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        P.encode({"seq": 1})
    with pytest.raises(TypeError):
        P.encode(P.ProposeItem("r", "d", 0, [], 1))  # a nested record, not a message


def _random_obj(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "neg", "float", "str", "bytes", "bool", "none"] + (["list", "map"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, 2, 255, 2**31, 2**63 - 1, rng.randrange(10**6)])
    if kind == "neg":
        return -rng.randrange(1, 2**40)
    if kind == "float":
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), rng.random()])
    if kind == "str":
        return rng.choice(["", "seq", "tokens", "items", "req_id", "ping", "verify", "é\u0000", "x" * 40])
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 3, 4, 8, 13]))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_obj(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["seq", "req_id", "tokens", "items", "params", "is_target", "draft", "draft_probs", "k", "x"]
    return {rng.choice(keys): _random_obj(rng, depth + 1) for _ in range(rng.randrange(5))}


def _decode_or_protocol_error(frame: bytes) -> None:
    try:
        msg = P.decode(frame)
    except P.ProtocolError:
        return
    assert type(msg).TAG in P.message_types()  # whatever decodes is a well-typed record
    P.encode(msg)


def test_fuzz_random_bytes_and_objects_only_raise_protocol_error():
    rng = random.Random(1234)
    tags = list(P.message_types())
    for _ in range(1000):
        _decode_or_protocol_error(rng.randbytes(rng.randrange(0, 64)))
    for _ in range(1500):
        obj = ([P.VERSION, rng.choice(tags), _random_obj(rng)] if rng.random() < 0.7 else _random_obj(rng))
        _decode_or_protocol_error(msgpack.packb(obj, use_bin_type=True))


def test_fuzz_mutated_valid_frames_only_raise_protocol_error():
    rng = random.Random(99)
    frames = [P.encode(m) for m in SAMPLES]
    for _ in range(2000):
        b = bytearray(rng.choice(frames))
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(3)
            i = rng.randrange(len(b)) if b else 0
            if op == 0 and b:
                b[i] = rng.randrange(256)
            elif op == 1:
                b.insert(i, rng.randrange(256))
            elif b:
                del b[i:i + rng.randrange(1, 8)]
        _decode_or_protocol_error(bytes(b))
