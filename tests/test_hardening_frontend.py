"""Issue 13, the front ends: every door locked and every refusal a JSON 400-class error, over a stub engine
(the aiohttp app in-process, the real HTTP transport on a loopback port, the ZeroMQ API on a socket)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import zlib

import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from spind import protocol as P
from spind.client import make_request
from spind.coordinator.interface import Delta, EngineError, Usage
from spind.frontend.api import ApiServer
from spind.frontend.http_server import CappedAppRunner
from spind.frontend.openai_schema import ApiLimits
from spind.frontend.zmq_api import ZmqApiServer
from spind.logs import RateLimitFilter

LIMITS = ApiLimits(model_name="spind", max_model_len=1024, drafter_names=("ngram",))


class StubEngine:
    """Scripted deltas; records where prompts were tokenized and which requests were closed early."""

    def __init__(self, deltas: list[Delta] | None = None, hang: bool = False) -> None:
        self.deltas = deltas if deltas is not None else [Delta([5], "hi"), Delta([6], "!", "length", Usage(1, 2))]
        self.hang = hang  # never finish (until the consumer goes away)
        self.problem: str | None = None
        self.encode_threads: list[int] = []
        self.requests = []
        self.closed: list[str] = []
        self.generation_defaults: dict = {}

    def health(self) -> str | None:
        return self.problem

    def encode_prompt(self, prompt, messages) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return [1, 2, 3]

    def generate(self, req):
        self.requests.append(req)
        return self._stream(req)

    async def _stream(self, req):
        try:
            for d in self.deltas:
                yield d
            while self.hang:
                await asyncio.sleep(3600)
        finally:
            self.closed.append(req.req_id)


async def _app(engine: StubEngine, check) -> None:
    server = ApiServer(engine, LIMITS, status="ok")  # type: ignore[arg-type]
    async with TestClient(TestServer(server.build_app())) as client:
        await check(client)


def run_app(engine: StubEngine, check) -> None:
    asyncio.run(_app(engine, check))


async def _err(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    return (await resp.json())["error"]


# -- bad data at the door: 400 ---------------------------------------------------------------------------------

def test_lone_surrogates_in_a_prompt_stop_string_or_message_are_400():
    engine = StubEngine()

    async def check(client):
        for body in (b'{"prompt":"a\\ud800b","max_tokens":2}',
                     b'{"prompt":"x","max_tokens":4,"stop":["\\ud800"]}',  # B1
                     b'{"prompt":["\\udfff"],"max_tokens":2}'):
            await _err(await client.post("/v1/completions", data=body), 400)
        chat = b'{"messages":[{"role":"user","content":"hi \\udc80"}]}'
        await _err(await client.post("/v1/chat/completions", data=chat), 400)
        await _err(await client.post("/v1/completions", data=b'{"prompt":"a\xff\xfe","max_tokens":2}'), 400)
    run_app(engine, check)
    assert engine.requests == []


def test_a_vanishing_temperature_is_greedy_not_nan():
    """B2: temperature 1e-300 (or 1e-40) would overflow softmax on the target: it is treated as greedy."""
    engine = StubEngine()

    async def check(client):
        for t in (1e-300, 1e-40):
            resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": t})
            assert resp.status == 200
    run_app(engine, check)
    assert [r.params.temperature for r in engine.requests] == [0.0, 0.0]


def test_garbage_deflate_body_is_400():
    async def check(client):
        err = await _err(await client.post("/v1/completions", data=b"garbage!!",
                                           headers={"Content-Encoding": "deflate"}), 400)
        assert "cannot be read" in err["message"]
        ok = zlib.compress(json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
        assert (await client.post("/v1/completions", data=ok, headers={"Content-Encoding": "deflate"})).status == 200
    run_app(StubEngine(), check)


@pytest.mark.parametrize("field,value", [("response_format", {"type": "xml"}),
                                         ("functions", [{"name": "f", "parameters": {}}]),
                                         ("function_call", "auto"),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_unsupported_openai_features_are_refused_not_ignored(field, value):
    async def check(client):
        body = {"messages": [{"role": "user", "content": "hi"}], field: value}
        err = await _err(await client.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == ("response_format.type" if field == "response_format" else field)  # the field's path
        body[field] = {"type": "text"} if field == "response_format" else "none" if field == "function_call" else []
        assert (await client.post("/v1/chat/completions", json=body)).status == 200  # the neutral value passes
    run_app(StubEngine(), check)


def test_prompts_are_tokenized_off_the_event_loop():
    """B4b: a long prompt's tokenization must not stall every other connection."""
    engine = StubEngine()

    async def check(client):
        loop_thread = threading.get_ident()
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
        assert engine.encode_threads and loop_thread not in engine.encode_threads
    run_app(engine, check)


# -- "abort" is not an OpenAI finish_reason ----------------------------------------------------------------------

ABORTED = [Delta([5], "par"), Delta([], "tial", "abort", Usage(1, 1, finish_detail="the request failed: boom"))]


def test_an_aborted_request_is_an_error_that_says_why():
    async def check(client):
        err = await _err(await client.post("/v1/completions", json={"prompt": "hi"}), 500)
        assert err["code"] == "request_aborted" and "boom" in err["message"]
        resp = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        events = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n") if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if "choices" in e) == "partial"
        assert all(e["choices"][0]["finish_reason"] != "abort" for e in events if "choices" in e)
        assert events[-1]["error"]["code"] == "request_aborted" and "boom" in events[-1]["error"]["message"]
    run_app(StubEngine(ABORTED), check)
    shutdown = [Delta([], "", "abort", Usage(1, 0, finish_detail="the server is shutting down"))]

    async def check_shutdown(client):
        err = await _err(await client.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert err["code"] == "server_shutting_down"
    run_app(StubEngine(shutdown), check_shutdown)


# -- health -----------------------------------------------------------------------------------------------------

def test_health_is_503_while_the_engine_reports_a_problem():
    engine = StubEngine()

    async def check(client):
        assert (await client.get("/health")).status == 200
        engine.problem = "worker(s) draft answered no heartbeat for 10 s"
        resp = await client.get("/health")
        body = await resp.json()
        assert resp.status == 503 and body["status"] == "unhealthy" and "draft" in body["detail"]
    run_app(engine, check)


# -- the HTTP transport: Server header, JSON for aiohttp's own errors, connection cap, idle timeout --------------

@contextlib.asynccontextmanager
async def transport(max_connections: int = 64, idle_timeout_s: float = 15.0, body_timeout_s: float = 30.0):
    server = ApiServer(StubEngine(), LIMITS, status="ok", body_timeout_s=body_timeout_s)  # type: ignore[arg-type]
    runner = CappedAppRunner(server.build_app(), max_connections, handler_cancellation=True, access_log=None,
                             keepalive_timeout=idle_timeout_s)
    await runner.setup()
    from aiohttp import web

    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _raw(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def _split(raw: bytes) -> tuple[str, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.decode(), json.loads(body) if body else {}


def test_no_versions_in_the_server_header_and_json_for_an_unknown_method():
    async def check():
        async with transport() as port:
            head, _ = _split(await _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            assert "\r\nServer: spind\r\n" in head and "aiohttp" not in head and "Python" not in head
            head, body = _split(await _raw(port, b"FOO /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert head.split()[1] == "400" and "application/json" in head and "aiohttp" not in head
            assert body["error"]["type"] == "invalid_request_error"
    asyncio.run(check())


def test_connections_are_capped_and_idle_or_half_sent_ones_time_out():
    """B6: idle and half-open connections are closed after the idle timeout; past the cap, 503 and closed."""
    async def check():
        async with transport(max_connections=3, idle_timeout_s=0.5) as port:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            idle[0][1].write(b"GET /health HTTP/1.1\r\nHost")  # headers never completed (slowloris)
            await asyncio.sleep(0.1)
            head, body = _split(await _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert head.startswith("HTTP/1.1 503") and body["error"]["code"] == "too_many_connections"
            for reader, _ in idle:  # closed by the server within the idle timeout
                assert await asyncio.wait_for(reader.read(), 3) == b""
            head, _ = _split(await _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            assert head.startswith("HTTP/1.1 200")
    asyncio.run(check())


def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_body_deadline():
    """body_timeout_s bounds the whole body, not the gap between its bytes: a client that drips one byte every
    0.1 s (never idle for the idle timeout) gets a 408 and a closed connection once the deadline passes."""
    async def check():
        async with transport(idle_timeout_s=5.0, body_timeout_s=1.0) as port:
            body = json.dumps({"model": "spind", "prompt": "x" * 200, "max_tokens": 1}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            start = asyncio.get_running_loop().time()

            async def drip():
                for b in body:
                    writer.write(bytes([b]))
                    await asyncio.sleep(0.1)

            dripping = asyncio.create_task(drip())
            try:
                raw = await asyncio.wait_for(reader.read(), 10)
            finally:
                dripping.cancel()
                writer.close()
            took = asyncio.get_running_loop().time() - start
            head, answer = _split(raw)
            assert head.startswith("HTTP/1.1 408"), head
            assert "did not arrive within" in answer["error"]["message"]
            assert took < 3.0, took  # the deadline (1 s), not the drip's 20 s
    asyncio.run(check())


def test_repeated_log_messages_are_rate_limited():
    now = [0.0]
    f = RateLimitFilter(burst=3, window_s=10, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, msg, ("1.2.3.4",), None)

    assert [f.filter(rec("Error handling request from %s")) for _ in range(1000)].count(True) == 3
    assert f.filter(rec("another message"))
    now[0] = 11.0
    r = rec("Error handling request from %s")
    assert f.filter(r) and "997 similar message(s) suppressed" in r.getMessage()


# -- ZeroMQ ---------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def zmq_api(engine: StubEngine, api_key: str = ""):
    server = ZmqApiServer(engine, LIMITS, "127.0.0.1", _free_port(), api_key)  # type: ignore[arg-type]
    server.bind()
    server.set_status("ok")
    try:
        yield server
    finally:
        server.close()


def _dealer(ctx: zmq.asyncio.Context, server: ZmqApiServer) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    return sock


def test_zmq_refuses_surrogates_and_reports_aborts_as_errors():
    async def check():
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_api(StubEngine(ABORTED)) as server:
                sock = _dealer(ctx, server)
                lone = b"\xed\xa0\x80"  # U+D800 as (invalid) UTF-8: msgpack carries no lone surrogate
                await sock.send(P.encode(make_request("x", stop=["QQQ"])).replace(b"QQQ", lone))
                await sock.send(P.encode(make_request("aQQQb")).replace(b"QQQ", lone))
                await sock.send(P.encode(make_request("ok", stream=False)))
                replies = [P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut) for _ in range(3)]
                return sorted((r.status, r.code) for r in replies)
        finally:
            ctx.destroy(linger=0)
    assert asyncio.run(check()) == [(400, "bad_frame"), (400, "bad_frame"), (500, "request_aborted")]


def test_zmq_non_streamed_request_is_cancelled_when_its_client_goes_away(monkeypatch):
    monkeypatch.setattr("spind.frontend.zmq_api.PROBE_INTERVAL_S", 0.05)
    engine = StubEngine([], hang=True)

    async def check():
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_api(engine) as server:
                sock = _dealer(ctx, server)
                await sock.send(P.encode(make_request("hi", stream=False)))
                probe = P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut)  # an empty chunk: skipped
                assert isinstance(probe, P.ClientChunk) and not probe.text and probe.finish_reason is None
                sock.close(linger=0)
                for _ in range(100):
                    if engine.closed:
                        break
                    await asyncio.sleep(0.05)
                return engine.closed, server.in_flight.num_active
        finally:
            ctx.destroy(linger=0)
    closed, num_active = asyncio.run(check())
    assert len(closed) == 1 and num_active == 0


# -- the run dir -------------------------------------------------------------------------------------------------

def test_a_start_removes_the_sockets_a_killed_daemon_left(tmp_path):
    from spind.coordinator.transport.process_pool import prepare_run_dir

    dead = 2**22 + 12345  # above pid_max's default: no such process
    run_dir = prepare_run_dir(tmp_path / "run")
    names = [f"w-draft-{dead}-1.sock", f"w-draft-2-{dead}-3.sock", f"probs-{dead}.sock",  # a dead daemon's
             f"w-target-{os.getpid()}-1.sock", f"probs-{os.getpid()}.sock", "spind.log"]      # a live one's, a log
    for n in names:
        (run_dir / n).touch()
    prepare_run_dir(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(names[3:])


def test_the_zmq_api_binds_its_own_host_loopback_by_default_and_checks_the_key(tmp_path):
    """B5: the ZeroMQ API does not follow HTTP onto 0.0.0.0, and carries the API key (refusal tested in
    test_frontend.py::test_zmq_api_refuses_requests_without_the_api_key)."""
    import dataclasses

    from spind.config import ServerConfig, SpindConfig
    from spind.frontend.server import Daemon

    server = ServerConfig(host="0.0.0.0", api_key="k", run_dir=str(tmp_path / "run"))
    daemon = Daemon.create(dataclasses.replace(SpindConfig(), server=server))
    try:
        assert daemon.zmq is not None and daemon.zmq.host == "127.0.0.1" and daemon.zmq.api_key == "k"
    finally:
        daemon.engine.pool.ctx.term()


def test_the_connection_cap_fits_the_descriptor_limit():
    import resource

    from spind.frontend.server import RESERVED_FDS, fit_descriptor_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        capped = fit_descriptor_limit(10**9)  # more than any hard limit
        assert capped == resource.getrlimit(resource.RLIMIT_NOFILE)[0] - RESERVED_FDS
        assert fit_descriptor_limit(64) == 64
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
