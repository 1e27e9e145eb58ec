"""The client API's protocol version stands apart from the internal (coordinator <-> worker) one: bumping the
internal version breaks no client, and a client or daemon of another client version is refused with a clear error,
on both sides. The real ZmqApiServer and clients over loopback ZeroMQ, a stub engine: no model."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
import zmq
import zmq.asyncio

from spind import protocol as P
from spind.client import AsyncSpindClient, SpindClient, make_request
from spind.coordinator.interface import Delta, Usage
from spind.frontend.openai_schema import ApiLimits
from spind.frontend.zmq_api import ZmqApiServer

LIMITS = ApiLimits(model_name="spind", max_model_len=1024, drafter_names=("ngram",))


class StubEngine:
    def health(self) -> str | None:
        return None

    def encode_prompt(self, prompt, messages) -> list[int]:
        return [1, 2, 3]

    async def _deltas(self):
        yield Delta([5], "hi")
        yield Delta([6], "!", "length", Usage(3, 2))

    def generate(self, req):
        return self._deltas()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def zmq_api():
    server = ZmqApiServer(StubEngine(), LIMITS, "127.0.0.1", _free_port())  # type: ignore[arg-type]
    server.bind()
    server.set_status("ok")
    try:
        yield f"tcp://127.0.0.1:{server.port}"
    finally:
        server.close()


def _version_of(frame: bytes) -> int:
    return msgspec.msgpack.decode(frame)[0]


async def _exchange(address: str, frame: bytes) -> bytes:
    """One raw frame to the server and its answer, as a client of any version would send it."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        await sock.send(frame)
        return await asyncio.wait_for(sock.recv(), 5)
    finally:
        sock.close(0)
        ctx.term()


def test_client_frames_carry_the_client_version_and_internal_frames_the_internal_one(monkeypatch):
    monkeypatch.setattr(P, "VERSION", P.VERSION + 7)
    request, reply = make_request("hi"), P.ClientError("r", 400, "bad", "no")
    assert _version_of(P.encode(request)) == _version_of(P.encode(reply)) == P.CLIENT_PROTOCOL_VERSION
    assert P.decode(P.encode(request), P.ClientIn) == request
    assert _version_of(P.encode(P.Ping(1))) == P.VERSION
    assert P.decode(P.encode(P.Ping(1)), P.WorkerOp) == P.Ping(1)


def test_clients_work_whatever_the_internal_version(monkeypatch):
    """A daemon whose internal protocol moved on (a bumped VERSION) still serves clients of the client version: a
    frame recorded before the bump (a client of the released version) and the client library's own."""
    released = P.encode(make_request("hello", max_tokens=2, stream=False))
    monkeypatch.setattr(P, "VERSION", P.VERSION + 1)

    async def check():
        async with zmq_api() as address:
            raw = msgspec.msgpack.decode(await _exchange(address, released))
            async with AsyncSpindClient(address, timeout_s=10) as client:
                done = await client.complete("hello", max_tokens=2)
                pieces = [p async for p in client.stream("hello", max_tokens=2)]

            def blocking() -> str:
                with SpindClient(address, timeout_s=10) as c:
                    return c.generate("hello", max_tokens=2)

            return raw, done, pieces, await asyncio.to_thread(blocking)

    raw, done, pieces, text = asyncio.run(check())
    assert raw[0] == _version_of(released) and raw[1]["type"] == "client_reply" and raw[1]["text"] == "hi!"
    assert (done.text, done.token_ids, done.finish_reason) == ("hi!", [5, 6], "length")
    assert pieces == ["hi", "!"] and text == "hi!"


def test_the_daemon_refuses_a_client_of_another_client_version_clearly():
    body = msgspec.msgpack.decode(P.encode(make_request("hello", max_tokens=2)))[1]

    async def check():
        async with zmq_api() as address:
            return P.decode(await _exchange(address, msgspec.msgpack.encode([P.CLIENT_PROTOCOL_VERSION + 1, body])),
                            P.ClientOut)

    reply = asyncio.run(check())
    assert isinstance(reply, P.ClientError) and (reply.status, reply.code) == (400, "unsupported_version")
    assert (f"unsupported client protocol version {P.CLIENT_PROTOCOL_VERSION + 1}; this side speaks "
            f"{P.CLIENT_PROTOCOL_VERSION}") in reply.message


@contextlib.asynccontextmanager
async def newer_daemon():
    """A ROUTER that answers every frame with a frame of the next client protocol version."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    async def serve():
        while True:
            identity, _ = await sock.recv_multipart()
            await sock.send_multipart([identity, msgspec.msgpack.encode(
                [P.CLIENT_PROTOCOL_VERSION + 1, {"type": "client_error", "req_id": "", "status": 400, "code": "x",
                                                 "message": "from the future"}])])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(0)
        ctx.term()


def test_a_client_refuses_a_daemon_of_another_client_version_at_once():
    """Not a timeout: both clients raise ProtocolVersionError naming the two versions."""
    match = (f"unsupported client protocol version {P.CLIENT_PROTOCOL_VERSION + 1}; this side speaks "
             f"{P.CLIENT_PROTOCOL_VERSION}")

    async def check():
        async with newer_daemon() as address:
            async with AsyncSpindClient(address, timeout_s=30) as client:
                with pytest.raises(P.ProtocolVersionError, match=match):
                    await asyncio.wait_for(client.complete("hello", max_tokens=2), 10)

            def blocking() -> None:
                with SpindClient(address, timeout_s=30) as c, pytest.raises(P.ProtocolVersionError, match=match):
                    c.generate("hello", max_tokens=2)

            await asyncio.to_thread(blocking)

    asyncio.run(check())
