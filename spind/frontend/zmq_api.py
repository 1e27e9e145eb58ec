"""ZeroMQ client API, server side: a ROUTER on tcp://host:zmq_port speaking `spind.protocol` client records.

In:  `ClientRequest` (prompt | prompt_ids | messages, sampling, drafter, k, stream), `ClientAbort`.
Out: streamed: `ClientChunk`s, the last with finish_reason and usage; not streamed: one `ClientReply`;
     refused: one `ClientError` (HTTP-style status). A frame that does not decode gets a `ClientError` with
     req_id "" and status 400 - the server never crashes on input; one of another client protocol version
     (`protocol.CLIENT_PROTOCOL_VERSION`, apart from the workers' internal one) gets code "unsupported_version".

A client is a DEALER; its identity plus its own req_id names a request (the engine sees a fresh unique id).
ROUTER_MANDATORY makes a send to a vanished client fail, which aborts its request like an HTTP disconnect; a
non-streamed request is probed every PROBE_INTERVAL_S with an empty `ClientChunk` (clients skip it) so that
its client going away is noticed too. A message over MAX_FRAME_BYTES makes ZeroMQ drop that client's
connection (the body limit of this API). With [server].api_key set every request must carry it (401
otherwise). A request the engine ended early (finish_reason "abort") is answered with a `ClientError`
saying why, as over HTTP.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from spind import protocol as P
from spind.coordinator.interface import Engine, EngineError, EngineRequest, Usage
from spind.frontend.openai_schema import (ABORT, ApiError, ApiLimits, InFlight, abort_error, check_extension,
                                          check_grammar_off_loop, check_serving, check_text, from_engine_error,
                                          parse_messages)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 20
SEND_HWM = 10_000  # messages queued per client before a send waits
PROBE_INTERVAL_S = 2.0  # a non-streamed request's client is probed this often while it waits


@dataclass(frozen=True)
class Envelope:
    """Routing frames of one client message: [identity] (DEALER) or [identity, b""] (REQ)."""

    frames: tuple[bytes, ...]

    @property
    def identity(self) -> bytes:
        return self.frames[0]


def split_frames(frames: list[bytes]) -> tuple[Envelope, bytes] | None:
    """ROUTER frames -> (envelope, payload), or None when there is not even an identity to answer."""
    if len(frames) == 2:
        return Envelope((frames[0],)), frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return Envelope((frames[0], b"")), frames[2]
    if frames:
        return Envelope((frames[0],)), b""  # wrong shape: answered as an undecodable payload
    return None


def usage_record(u: Usage) -> P.UsageRecord:
    return P.UsageRecord(u.prompt_tokens, u.completion_tokens, {k: dict(v) for k, v in u.drafters.items()},
                         u.num_steps, float(u.mean_accepted_length), u.cached_tokens)


def client_prompt(msg: P.ClientRequest, limits: ApiLimits) -> tuple[str | list[int] | None, list[dict] | None]:
    """Validate a ClientRequest the same way as the HTTP API; returns (prompt, messages) for encode_prompt."""
    given = [x is not None for x in (msg.prompt, msg.prompt_ids, msg.messages)]
    if sum(given) != 1:
        raise ApiError(400, "exactly one of prompt, prompt_ids or messages must be set", param="prompt")
    if msg.prompt is not None and not msg.prompt or msg.prompt_ids is not None and not msg.prompt_ids:
        raise ApiError(400, "empty prompt", param="prompt")
    if msg.prompt is not None:
        check_text(msg.prompt, "prompt")
    check_extension(msg.drafter, msg.k, limits)
    if not 1 <= msg.params.max_tokens <= limits.max_model_len:
        raise ApiError(400, f"max_tokens must be in [1, {limits.max_model_len}]", param="max_tokens")
    messages = None
    if msg.messages is not None:
        messages = parse_messages([{"role": m.role, "content": m.content} for m in msg.messages])
    return msg.prompt if msg.prompt is not None else msg.prompt_ids, messages


@dataclass
class ZmqApiServer:
    engine: Engine
    limits: ApiLimits
    host: str
    port: int  # 0 is never passed: the daemon leaves the server out instead
    api_key: str = ""  # when set, every ClientRequest and ClientAbort must carry it
    status: str = "starting"  # starting -> ok -> draining, as ApiServer
    in_flight: InFlight = field(default_factory=InFlight)
    _ctx: zmq.asyncio.Context | None = None
    _sock: zmq.asyncio.Socket | None = None
    _reader: asyncio.Task | None = None
    _tasks: dict[tuple[bytes, str], asyncio.Task] = field(default_factory=dict)  # (identity, req_id) -> request
    _replies: set[asyncio.Task] = field(default_factory=set)  # error replies being sent (held: tasks are weak)

    def bind(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{self.host}:{self.port}")
        self._sock = sock
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    def set_status(self, status: str) -> None:
        self.status = status

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self._reader:
            self._reader.cancel()
        if self._ctx:
            self._ctx.destroy(linger=0)  # closes the socket too, also one whose bind failed

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self._dispatch(frames)
            except Exception:  # a bug here must not stop the API for every other client
                log.exception("zmq api: dispatching a frame")

    def _dispatch(self, frames: list[bytes]) -> None:
        split = split_frames(frames)
        if split is None:
            return
        env, payload = split
        try:
            msg = P.decode(payload, P.ClientIn)
        except P.ProtocolVersionError as e:
            self._spawn_error(env, "", ApiError(400, str(e), code="unsupported_version"))
            return
        except P.ProtocolError as e:
            self._spawn_error(env, "", ApiError(400, f"malformed frame: {e}", code="bad_frame"))
            return
        if self.api_key and not hmac.compare_digest(msg.api_key.encode(), self.api_key.encode()):
            self._spawn_error(env, msg.req_id, ApiError(401, "missing or incorrect api_key", code="invalid_api_key"))
            return
        if isinstance(msg, P.ClientAbort):
            task = self._tasks.get((env.identity, msg.req_id))
            if task is not None:
                task.cancel()
        elif isinstance(msg, P.ClientRequest):
            key = (env.identity, msg.req_id)
            if key in self._tasks:
                self._spawn_error(env, msg.req_id, ApiError(400, f"req_id {msg.req_id!r} is already in flight"))
                return
            task = asyncio.get_running_loop().create_task(self._serve(env, msg))
            self._tasks[key] = task
            task.add_done_callback(lambda _t, key=key: self._tasks.pop(key, None))

    def _spawn_error(self, env: Envelope, req_id: str, e: ApiError) -> None:
        task = asyncio.get_running_loop().create_task(self._send_error(env, req_id, e))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _send(self, env: Envelope, msg: object) -> None:
        assert self._sock is not None
        await self._sock.send_multipart([*env.frames, P.encode(msg)])

    async def _send_error(self, env: Envelope, req_id: str, e: ApiError) -> None:
        try:
            await self._send(env, P.ClientError(req_id, e.status, e.code or "invalid_request_error", e.message,
                                                  e.param))
        except zmq.ZMQError:
            pass  # the client is gone

    async def _serve(self, env: Envelope, msg: P.ClientRequest) -> None:
        """One request: validate, stream the engine's deltas back, and abort if the client vanishes."""
        try:
            with self.in_flight:
                await self._generate(env, msg)
        except ApiError as e:
            await self._send_error(env, msg.req_id, e)
        except EngineError as e:
            await self._send_error(env, msg.req_id, from_engine_error(e))
        except zmq.ZMQError as e:
            log.info("zmq api: client of %s gone (%s); aborted", msg.req_id, e)
        except asyncio.CancelledError:
            pass  # ClientAbort or shutdown; the engine iterator is closed already
        except Exception:
            log.exception("zmq api: request %s", msg.req_id)
            await self._send_error(env, msg.req_id, ApiError(500, "internal server error", code="internal_error"))

    async def _generate(self, env: Envelope, msg: P.ClientRequest) -> None:
        check_serving(self.status)
        prompt, messages = client_prompt(msg, self.limits)
        try:
            params = msg.params.validate()
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
        prompt_ids = await asyncio.to_thread(self.engine.encode_prompt, prompt, messages)  # off the event loop
        await check_grammar_off_loop(params)
        req = EngineRequest("zmq-" + uuid.uuid4().hex, prompt_ids, params, msg.drafter, msg.k)
        token_ids: list[int] = []
        parts: list[str] = []
        logprobs: list[P.OutputLogprobs] | None = None if params.logprobs is None else []
        async with aclosing(self.engine.generate(req)) as deltas:
            probe = None if msg.stream else asyncio.create_task(self._probe(env, msg.req_id))
            try:
                async for d in self._until_client_gone(deltas, probe):
                    if d.finish_reason == ABORT:
                        raise abort_error(d.usage)
                    usage = usage_record(d.usage or Usage(len(prompt_ids), 0)) if d.finish_reason else None
                    lps = None if logprobs is None else d.logprobs or []
                    if msg.stream and (d.token_ids or d.text or d.finish_reason):
                        await self._send(env, P.ClientChunk(msg.req_id, d.token_ids, d.text, d.finish_reason, usage,
                                                            lps))
                    token_ids += d.token_ids
                    parts.append(d.text)
                    if logprobs is not None:
                        logprobs += lps
                    if d.finish_reason is not None:
                        if not msg.stream:
                            reply = P.ClientReply(msg.req_id, token_ids, "".join(parts), d.finish_reason, usage,
                                                  logprobs)
                            await self._send(env, reply)
                        return
            finally:
                if probe is not None:
                    probe.cancel()
                    await asyncio.gather(probe, return_exceptions=True)
        raise ApiError(500, "the engine ended the request without output", code="internal_error")

    async def _probe(self, env: Envelope, req_id: str) -> None:
        """Send an empty chunk every PROBE_INTERVAL_S; ends (ZMQError) once the client is gone."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self._send(env, P.ClientChunk(req_id, [], "", None, None))

    @staticmethod
    async def _until_client_gone(deltas, probe: asyncio.Task | None):
        """The engine's deltas, until the probe fails (its ZMQError is raised: the request is then aborted)."""
        while True:
            try:
                if probe is None:
                    yield await anext(deltas)
                    continue
                nxt = asyncio.ensure_future(anext(deltas))
                await asyncio.wait({nxt, probe}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    probe.result()  # raises the probe's ZMQError
                d = nxt.result()
            except StopAsyncIteration:
                return
            yield d
