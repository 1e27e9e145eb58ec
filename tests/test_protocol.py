"""spind.protocol: every message round-trips; anything malformed is a ProtocolError, never a crash."""

from __future__ import annotations

import random
import subprocess
import sys

import msgspec
import pytest

from spind import protocol as P
from spind.params import SamplingParams

BUSY = [P.BusyInterval("verify", 12.5, 12.75, 3), P.BusyInterval("draft", 12.0, 12.4, 2, "int8")]
SAMPLING = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=("\n\n", "END"))
LONG = list(range(49_000, 49_000 + 300))

SAMPLES = [
    (P.WorkerOp, P.AddRequest(1, "r1", LONG, SAMPLING, True)),
    (P.WorkerOp, P.Prefill(2, [P.PrefillItem("r1", 256), P.PrefillItem("r2", 3)])),
    (P.WorkerOp, P.Propose(3, 17, [P.ProposeItem("r1", "int8", 300, [5, 6], 4), P.ProposeItem("r2", "d", 10, [], 2)])),
    (P.WorkerOp, P.Precompute(4, [P.PrecomputeItem("r1", "int8", 302, [7])])),
    (P.WorkerOp, P.Verify(5, 17, [P.VerifyItem("r1", [1, 2, 3], True), P.VerifyItem("r2", [], inline_drafter="ngram",
                                                                                     k=4)])),
    (P.WorkerOp, P.FreeRequests(6, ["r1", "r2"])),
    (P.WorkerOp, P.ForgetFinished(11)),
    (P.WorkerOp, P.Profile(13, 4, [1, 2, 4], 128, 3)),
    (P.WorkerOp, P.Ping(7)),
    (P.WorkerOp, P.Shutdown(8)),
    (P.WorkerReply, P.Ready(name="target", pid=1234, is_target=True, drafters=["ngram"], max_model_len=2048,
                            num_threads=1, device="cpu", dtype="float32")),
    (P.WorkerReply, P.Ack(8, BUSY)),
    (P.WorkerReply, P.Prefilled(8, [32, 0], BUSY)),
    (P.WorkerReply, P.Proposed(9, [P.DraftRecord(req_id="r1", tokens=[4, 5], has_probs=True, slot=17, draft_s=0.07,
                                                switch_s=0.01), P.DraftRecord("r2", [])], BUSY)),
    (P.WorkerReply, P.Verified(10, [P.VerifyResult("r1", 3, 2, [1, 2, 9], 0.001)], 0.09, BUSY)),
    (P.WorkerReply, P.WorkerStats(seq=11, name="draft", pid=99, req_ids=["r1"], kv={"int8": P.KVStats(512, 500, 1)},
                                  drafter_reqs={"int8": ["r1"]}, ms_per_token={"int8": 3.5}, num_precompute_queued=0,
                                  rss_bytes=10**9, busy=[])),
    (P.WorkerReply, P.Profiled(13, {"int8": 35.2}, {1: 55.0, 2: 61.5, 4: 80.25}, BUSY)),
    (P.WorkerReply, P.ErrorReply(-1, "protocol error: boom")),
    (P.WorkerReply, P.ErrorReply(12, "bad temperature", ["r2"])),
    (P.DraftProbs, P.DraftProbs(17, "r1", [2, 3], bytes(24))),
    (P.ClientIn, P.ClientRequest("c1", SAMPLING, messages=[P.ChatMessage("user", "hi")], drafter="int8", k=3,
                                 stream=False, api_key="secret")),
    (P.ClientIn, P.ClientRequest("c2", SamplingParams(), prompt_ids=LONG)),
    (P.ClientIn, P.ClientAbort("c1")),
    (P.ClientOut, P.ClientChunk("c1", [1, 2], "hé", "stop", P.UsageRecord(5, 2, {"int8": {"drafted": 4, "accepted": 3}},
                                                                           2, 2.5))),
    (P.ClientOut, P.ClientReply("c1", LONG, "text", "length", P.UsageRecord(5, 300))),
    (P.ClientOut, P.ClientError("c1", 413, "context_length_exceeded", "too long")),
]
KINDS = (P.WorkerOp, P.WorkerReply, P.ClientIn, P.ClientOut, P.DraftProbs)


def test_samples_cover_every_message_type():
    assert {type(m) for _, m in SAMPLES} == set(P.MESSAGE_TYPES)


@pytest.mark.parametrize("kind, msg", SAMPLES, ids=lambda x: type(x).__name__ if not isinstance(x, type) else "")
def test_round_trip(kind, msg):
    assert P.decode(P.encode(msg), kind) == msg


def test_a_message_of_another_family_is_refused():
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(P.Ping(1)), P.ClientIn)  # a worker op is not a client request
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(P.ClientAbort("x")), P.WorkerOp)


def _frame(body: object, version: int = P.VERSION) -> bytes:
    return msgspec.msgpack.encode([version, body])


@pytest.mark.parametrize("frame, why", [
    (b"", "not a frame"),
    (b"\xc1", "not a frame"),
    (msgspec.msgpack.encode({"a": 1}), "not a frame"),
    (_frame({"type": "ping", "seq": 1}, version=1), "unsupported protocol version"),
    (_frame({"type": "nope", "seq": 1}), "Invalid value 'nope'"),
    (_frame({"type": "ping"}), "missing required field `seq`"),
    (_frame({"type": "ping", "seq": 1, "extra": 2}), "unknown field `extra`"),
    (_frame({"type": "ping", "seq": "1"}), "Expected `int`"),
    (_frame({"type": "add_request", "seq": 1, "req_id": "r", "tokens": [-1], "params": {}, "is_target": True}),
     ">= 0"),
    (_frame({"type": "add_request", "seq": 1, "req_id": "r", "tokens": [2**31], "params": {}, "is_target": True}),
     "<= 2147483647"),
    (_frame({"type": "add_request", "seq": 1, "req_id": "", "tokens": [1], "params": {}, "is_target": True}),
     "length >= 1"),
    (_frame({"type": "add_request", "seq": 1, "req_id": "r", "tokens": [1], "params": {"temperature": "hot"},
             "is_target": True}), "Expected `float`"),
    (_frame({"type": "free_requests", "seq": 1, "req_ids": "r1"}), "Expected `array`"),
    (_frame({"type": "ping", "seq": 1}) + b"\x00", "not a frame"),
    (b"\x91" * 100_000 + b"\x00", "not a frame"),  # nesting deeper than any sane frame
    (b"\xdd\xff\xff\xff\xff", "not a frame"),  # an array claiming 4 billion items
])
def test_malformed_frames_raise_protocol_error(frame, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(frame, P.WorkerOp)


def test_draft_probs_must_match_their_shape():
    with pytest.raises(P.ProtocolError, match="matrix"):
        P.decode(_frame({"type": "draft_probs", "slot": 1, "req_id": "r", "shape": [2, 3], "data": bytes(8)}),
                 P.DraftProbs)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        P.encode({"seq": 1})
    with pytest.raises(TypeError):
        P.encode(P.ProposeItem("r", "d", 0, [], 1))  # a nested record, not a message


def test_the_protocol_and_the_client_import_no_torch():
    code = "import sys, spind.protocol, spind.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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
    keys = ["type", "seq", "req_id", "tokens", "items", "params", "is_target", "draft", "slot", "k", "x"]
    return {rng.choice(keys): _random_obj(rng, depth + 1) for _ in range(rng.randrange(5))}


TAGS = [t.__struct_config__.tag for t in P.MESSAGE_TYPES]


def _decode_or_protocol_error(frame: bytes) -> None:
    for kind in KINDS:
        try:
            msg = P.decode(frame, kind)
        except P.ProtocolError:
            continue
        assert isinstance(msg, P.MESSAGE_TYPES)  # whatever decodes is a well-typed message
        P.encode(msg)


def test_fuzz_random_bytes_and_objects_only_raise_protocol_error():
    rng = random.Random(1234)
    for _ in range(1000):
        _decode_or_protocol_error(rng.randbytes(rng.randrange(0, 64)))
    for _ in range(1500):
        body = _random_obj(rng)
        if isinstance(body, dict) and rng.random() < 0.7:
            body["type"] = rng.choice(TAGS)
        obj = [P.VERSION, body] if rng.random() < 0.8 else body
        _decode_or_protocol_error(msgspec.msgpack.encode(obj))


def test_fuzz_mutated_valid_frames_only_raise_protocol_error():
    rng = random.Random(99)
    frames = [P.encode(m) for _, m in SAMPLES]
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
