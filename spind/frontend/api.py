"""OpenAI-compatible HTTP front end (aiohttp): completions, chat completions (plain and server-sent events),
models, health, metrics and the engine's state.

The wire format (request parsing, response and chunk objects, error JSON) lives in openai_schema.py. Everything
the engine refuses arrives as an `EngineError` and leaves as OpenAI's error JSON with the engine's status;
nothing else escapes a handler.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import uuid
import zlib
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from spind import protocol as P
from spind.coordinator.interface import Delta, Engine, EngineError, EngineRequest, Usage
from spind.state import ApiState, encode_state
from spind.frontend.openai_schema import (
    ABORT,
    MAX_BODY_BYTES,
    ApiError,
    ApiLimits,
    Choice,
    ChunkFormatter,
    InFlight,
    abort_error,
    check_grammar_off_loop,
    check_serving,
    error_json,
    error_response,
    from_engine_error,
    parse_generate,
    sse,
)
from spind.frontend.http_server import SERVER_HEADER

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPEN_PATHS = ("/health",)  # answered without the API key


@dataclass
class ApiServer:
    """The aiohttp application around one engine; `in_flight` counts generations (a drain waits for them)."""

    engine: Engine
    limits: ApiLimits
    api_key: str = ""
    status: str = "starting"  # starting -> ok -> draining | failed; generation is refused unless "ok"
    body_timeout_s: float = 30.0  # to receive a request's body once its headers are in
    in_flight: InFlight = field(default_factory=InFlight)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth])
        app.on_response_prepare.append(_server_header)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/spind/state", self.state)
        app.router.add_post("/v1/spind/reset_cache", self.reset_cache)
        return app

    def set_status(self, status: str) -> None:
        self.status = status

    # -- middlewares --------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except web.HTTPException as e:  # unknown route (404), wrong method (405), body too large (413)
            if e.status < 400:
                raise
            message = f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else e.reason
            return error_response(ApiError(e.status, message))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("internal error in %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error", code="internal_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key and request.path not in OPEN_PATHS:
            expected = f"Bearer {self.api_key}".encode()
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    # -- plain endpoints ---------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 only while serving with every worker answering; a stalled or given-up worker reads 503."""
        problem = self.engine.health() if self.status == "ok" else None
        body = {"status": "unhealthy" if problem else self.status, "model": self.limits.model_name,
                "pid": os.getpid()}
        if problem:
            body["detail"] = problem
        return web.json_response(body, status=200 if self.status == "ok" and not problem else 503)

    def _model_card(self) -> dict:
        return {"id": self.limits.model_name, "object": "model", "created": 0, "owned_by": "spind",
                "max_model_len": self.limits.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.limits.model_name:
            raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return web.json_response(self._model_card())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.engine.render_metrics(), headers={"Content-Type": PROMETHEUS_TYPE})

    async def reset_cache(self, request: web.Request) -> web.Response:
        """Forget what spind keeps across requests (vLLM's /reset_prefix_cache): the answers the drafters keep from
        finished requests and the target's prefix cache. A bench that sends the same prompts to several drafters in
        turn calls it between them, so that none drafts another's answer to the very prompt it serves or skips the
        prefill of a prompt the one before it prefilled."""
        if self.status != "ok":
            raise ApiError(503, f"the server is {self.status}", code="unavailable")
        try:
            await self.engine.reset_cache()
        except EngineError as e:
            raise from_engine_error(e) from None
        return web.json_response({"status": "ok"})

    async def state(self, request: web.Request) -> web.Response:
        state = msgspec.structs.replace(self.engine.snapshot(),
                                        api=ApiState(status=self.status, num_active=self.in_flight.num_active))
        return web.Response(body=encode_state(state), content_type="application/json")

    # -- generation --------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def _generate(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        check_serving(self.status)
        args = parse_generate(await self._read_body(request), is_chat, self.limits,
                              getattr(self.engine, "generation_defaults", {}))
        try:  # off the event loop: a long prompt must not stall every other connection while it tokenizes
            prompt_ids = await asyncio.to_thread(self.engine.encode_prompt, args.prompt, args.messages)
        except EngineError as e:
            raise from_engine_error(e) from None
        await check_grammar_off_loop(args.params)
        prefix = "chatcmpl-" if is_chat else "cmpl-"
        req = EngineRequest(prefix + uuid.uuid4().hex, prompt_ids,
                            args.sampling_params(len(prompt_ids), self.limits.max_model_len), args.drafter, args.k,
                            args.n)
        fmt = ChunkFormatter(req.req_id, self.limits.model_name, is_chat, args.include_usage)
        if args.ignored:  # unknown fields are ignored, as vLLM does, and named back so nobody is misled
            fmt.headers["X-Spind-Ignored-Fields"] = ",".join(args.ignored)
        try:
            stream = self.engine.generate(req)
        except EngineError as e:
            raise from_engine_error(e) from None
        # closing the iterator (client gone: handler cancelled or write failed) aborts the request
        with self.in_flight:
            async with aclosing(stream) as deltas:
                first = await self._first_delta(deltas)
                if args.is_stream:
                    return await self._stream(request, fmt, first, deltas, args.n)
                return await self._collect(fmt, first, deltas, args.n)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body within body_timeout_s, however it trickles in: then a 408 and the connection closed
        (after at most http_server.LINGERING_TIME_S of reading what is still coming)."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:.0f} s",
                           close_connection=True) from None
        except web.HTTPException:
            raise  # 413: over client_max_size
        except (web.RequestPayloadError, HttpProcessingError, ClientPayloadError, zlib.error) as e:  # no inflate
            raise ApiError(400, f"the request body cannot be read: {_reason(e)}", close_connection=True) from None

    async def _first_delta(self, deltas) -> Delta:
        """The engine refuses a request (bad input, too long, overloaded) before its first delta."""
        try:
            return await anext(deltas)
        except EngineError as e:
            raise from_engine_error(e) from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the request without output", code="internal_error") from None

    async def _collect(self, fmt: ChunkFormatter, first: Delta, deltas, n: int) -> web.Response:
        """The n choices' deltas (interleaved) gathered into one response; any choice aborted fails the request."""
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[P.OutputLogprobs] | None] = [None] * n
        last: list[Delta | None] = [None] * n
        d = first
        while True:
            texts[d.index].append(d.text)
            if d.logprobs is not None:
                logprobs[d.index] = (logprobs[d.index] or []) + d.logprobs
            if d.finish_reason == ABORT:
                raise abort_error(d.usage)
            if d.finish_reason is not None:
                last[d.index] = d
                if all(x is not None for x in last):
                    break
            d = await anext(deltas)
        choices = [Choice("".join(t), x.finish_reason, lp) for t, x, lp in zip(texts, last, logprobs)]
        response = fmt.response(choices, Usage.merge([x.usage for x in last]))
        return web.json_response(response, headers=fmt.headers, dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def _stream(self, request: web.Request, fmt: ChunkFormatter, first: Delta, deltas,
                      n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, **fmt.headers})
        await resp.prepare(request)
        if fmt.is_chat:
            for i in range(n):
                await resp.write(sse(fmt.role(i)))
        d, usages = first, []
        try:
            while True:
                if d.finish_reason == ABORT:  # after the headers went out: report in-band, as OpenAI does
                    if d.text:
                        await resp.write(sse(fmt.delta(Delta(d.token_ids, d.text, index=d.index))[0]))
                    e = abort_error(d.usage)
                    await resp.write(sse(error_json(e.status, e.message, code=e.code)))
                    break
                for chunk in fmt.delta(d):
                    await resp.write(sse(chunk))
                if d.finish_reason is not None:
                    usages.append(d.usage)
                    if len(usages) == n:
                        if fmt.include_usage:
                            await resp.write(sse(fmt.usage_chunk(Usage.merge(usages))))
                        break
                d = await anext(deltas)
        except EngineError as e:
            await resp.write(sse(error_json(e.status, str(e), code=e.code)))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """Never aiohttp's and Python's versions."""
    response.headers["Server"] = SERVER_HEADER


def _reason(e: BaseException) -> str:
    return getattr(e, "message", None) or str(e) or type(e).__name__
