"""The daemon's HTTP transport: aiohttp's server with the limits a public port needs.

- a connection cap: past `max_connections` open connections a new one gets a JSON 503 and is closed, so
  idle or half-open sockets cannot exhaust the process's descriptors;
- an idle timeout (aiohttp's `keepalive_timeout`, which in aiohttp >= 3.10 also covers a connection that
  never completes its request headers): a slowloris is dropped after `idle_timeout_s`;
- JSON errors for what aiohttp answers before any handler runs (an unknown method, a malformed request
  line), without the Server header's versions.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from spind.frontend.openai_schema import error_json

SERVER_HEADER = "spind"


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler; the errors it answers on its own (400 for a request it cannot parse,
    500/504 around a handler) leave as OpenAI error JSON."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response already went out
        text = "malformed HTTP request (unknown method or bad syntax)" if status == 400 else "internal server error"
        resp = web.Response(status=status, text=json.dumps(error_json(status, text)), content_type="application/json",
                            headers={"Server": SERVER_HEADER})
        resp.force_close()
        return resp


class _Refused(asyncio.Protocol):
    """A connection over the cap: one JSON 503, then closed (nothing is read)."""

    BODY = json.dumps(error_json(503, "too many open connections", code="too_many_connections")).encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nServer: {SERVER_HEADER}\r\n"
                f"Content-Length: {len(self.BODY)}\r\nConnection: close\r\n\r\n").encode()
        transport.write(head + self.BODY)  # type: ignore[attr-defined]
        transport.close()


class CappedServer(web.Server):
    """aiohttp's Server (the protocol factory TCPSite listens with) with a connection cap."""

    def __init__(self, *args, max_connections: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.num_refused = 0

    def __call__(self) -> asyncio.Protocol:
        if len(self._connections) >= self.max_connections:
            self.num_refused += 1
            return _Refused()
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


# After a response, aiohttp reads and drops what is left of an unread request body for up to `lingering_time` (its
# default: 10 s) before closing, so that a client still sending can read the response. For a body that missed its
# deadline (408) that let a client dripping bytes hold the connection 10 s past body_timeout_s; 1 s still lets a
# client in the middle of a normal send see the error.
LINGERING_TIME_S = 1.0


class CappedAppRunner(web.AppRunner):
    """AppRunner whose server is a CappedServer around the same application."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs) -> None:
        kwargs.setdefault("lingering_time", LINGERING_TIME_S)
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # starts the app and binds its handler and request factory
        kwargs = {k: v for k, v in self._kwargs.items() if k != "handler_cancellation"}
        return CappedServer(base.request_handler, request_factory=base.request_factory,
                            handler_cancellation=base.handler_cancellation, max_connections=self.max_connections,
                            **kwargs)
