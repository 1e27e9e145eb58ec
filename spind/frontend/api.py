"""OpenAI-compatible HTTP front end (aiohttp): completions, chat completions (plain and server-sent events),
models, health, metrics and the engine's state.

The wire format (request parsing, response and chunk objects, error JSON) lives in openai_schema.py. Everything
the engine refuses arrives as an `EngineError` and leaves as OpenAI's error JSON with the engine's status;
nothing else escapes a handler.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import json
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from spind.coordinator.interface import Delta, Engine, EngineError, EngineRequest, Usage
from spind.state import ApiState, encode_state
from spind.frontend.openai_schema import (
    MAX_BODY_BYTES,
    ApiError,
    ApiLimits,
    ChunkFormatter,
    InFlight,
    check_serving,
    error_json,
    error_response,
    from_engine_error,
    parse_generate,
    sse,
)

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
    status: str = "starting"  # starting -> ok -> draining; generation is refused unless "ok"
    in_flight: InFlight = field(default_factory=InFlight)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/spind/state", self.state)
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
        return web.json_response({"status": self.status, "model": self.limits.model_name, "pid": os.getpid()},
                                 status=200 if self.status == "ok" else 503)

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
        args = parse_generate(await request.read(), is_chat, self.limits, getattr(self.engine, "generation_defaults", {}))
        try:
            prompt_ids = self.engine.encode_prompt(args.prompt, args.messages)
        except EngineError as e:
            raise from_engine_error(e) from None
        prefix = "chatcmpl-" if is_chat else "cmpl-"
        req = EngineRequest(prefix + uuid.uuid4().hex, prompt_ids,
                            args.sampling_params(len(prompt_ids), self.limits.max_model_len), args.drafter, args.k)
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
                    return await self._stream(request, fmt, first, deltas, len(prompt_ids))
                return await self._collect(fmt, first, deltas, len(prompt_ids))

    async def _first_delta(self, deltas) -> Delta:
        """The engine refuses a request (bad input, too long, overloaded) before its first delta."""
        try:
            return await anext(deltas)
        except EngineError as e:
            raise from_engine_error(e) from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the request without output", code="internal_error") from None

    async def _collect(self, fmt: ChunkFormatter, first: Delta, deltas, num_prompt_tokens: int) -> web.Response:
        parts, last = [first.text], first
        while last.finish_reason is None:
            last = await anext(deltas)
            parts.append(last.text)
        usage = last.usage or Usage(num_prompt_tokens, 0)
        return web.json_response(fmt.response("".join(parts), last.finish_reason, usage), headers=fmt.headers,
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def _stream(self, request: web.Request, fmt: ChunkFormatter, first: Delta, deltas,
                      num_prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, **fmt.headers})
        await resp.prepare(request)
        if fmt.is_chat:
            await resp.write(sse(fmt.role()))
        d = first
        try:
            while True:
                for chunk in fmt.delta(d, num_prompt_tokens):
                    await resp.write(sse(chunk))
                if d.finish_reason is not None:
                    break
                d = await anext(deltas)
        except EngineError as e:  # after the headers went out: report in-band, as OpenAI does
            await resp.write(sse(error_json(e.status, str(e), code=e.code)))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp
