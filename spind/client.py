"""Python client for a running spind daemon.

ZeroMQ (the daemon's `[server].zmq_port`, records from `spind.protocol` at its `CLIENT_PROTOCOL_VERSION`):
    with SpindClient("tcp://127.0.0.1:8001") as c:
        print(c.generate("The capital of France is", max_tokens=16, temperature=0))
        for piece in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)
`AsyncSpindClient` is the same with `await` / `async for`, and runs many requests at once over one socket.
Breaking out of a stream aborts the request on the daemon. A daemon of another client protocol version is
refused with `protocol.ProtocolVersionError`. The HTTP API is OpenAI's: use the `openai`
package with base_url="http://127.0.0.1:8000/v1"; `http_json` is a small GET for health and state.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from spind import protocol as P
from spind.errors import StatusError
from spind.params import Grammar, SamplingParams

DEFAULT_ADDRESS = "tcp://127.0.0.1:8001"


class SpindError(StatusError):
    """The daemon refused or failed a request; `status` is HTTP-style (400, 401, 413, 503, ...); `param`: the field at
    fault, named as the HTTP API's error bodies name it ("spind.k", "temperature"), or None."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message, status, code)
        self.param = param


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: P.UsageRecord  # prompt/completion tokens and spind's per-drafter counts
    logprobs: list[P.OutputLogprobs] | None = None  # per output token, when asked for (make_request's logprobs)


def make_request(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | tuple[str, ...] = (), ignore_eos: bool = False,
                 logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
                 grammar: Grammar | None = None, drafter: str = "auto", k: int | None = None, stream: bool = True,
                 api_key: str = "") -> P.ClientRequest:
    """Build a ClientRequest: `prompt` is text or token ids, or pass chat `messages` instead; `logit_bias` maps
    token ids to biases in [-100, 100] (-100 bans a token); `logprobs=N` returns each output token's log-probability
    under the target and its N most likely alternatives (`Completion.logprobs`); `grammar` constrains the output
    (`Grammar("json_schema", json.dumps(schema))`, `Grammar("regex", ...)`, `Grammar("grammar", lark_or_gbnf)`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                            seed=seed, stop=tuple(stop), ignore_eos=ignore_eos,
                            logit_bias=tuple(sorted((logit_bias or {}).items())), logprobs=logprobs,
                            grammar=grammar)
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    chat = None if messages is None else [P.ChatMessage(m["role"], m["content"]) for m in messages]
    return P.ClientRequest(req_id=uuid.uuid4().hex, params=params, prompt=text, prompt_ids=ids, messages=chat,
                           drafter=drafter, k=k, stream=stream, api_key=api_key)


def _check(msg: object) -> P.ClientChunk | P.ClientReply:
    if isinstance(msg, P.ProtocolVersionError):  # routed to every waiting request by the async reader
        raise msg
    if isinstance(msg, P.ClientError):
        raise SpindError(msg.message, msg.status, msg.code, msg.param)
    if not isinstance(msg, (P.ClientChunk, P.ClientReply)):
        raise P.ProtocolError(f"unexpected {type(msg).__name__} from the daemon")
    return msg


def _completion(msg: P.ClientReply) -> Completion:
    return Completion(msg.text, msg.token_ids, msg.finish_reason, msg.usage, msg.logprobs)


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class SpindClient:
    """Blocking client; one request at a time per instance (not thread-safe: one client per thread)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float = 600.0, api_key: str = "") -> None:
        self.api_key = api_key
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = _dealer(self._ctx, address)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "SpindClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, req_id: str) -> P.ClientChunk | P.ClientReply:
        while True:
            if not self._sock.poll(self.timeout_ms):
                raise TimeoutError(f"no answer from the daemon in {self.timeout_ms / 1000:.0f}s")
            msg = P.decode(self._sock.recv(), P.ClientOut)
            if getattr(msg, "req_id", None) in (req_id, ""):  # skip leftovers of an aborted stream
                return _check(msg)

    def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        """The whole result: text, token ids, finish reason and usage (with the spind counters)."""
        req = make_request(prompt, stream=False, api_key=self.api_key, **kw)
        self._sock.send(P.encode(req))
        msg = self._recv(req.req_id)
        while _is_probe(msg):  # the daemon checks that we are still here
            msg = self._recv(req.req_id)
        if not isinstance(msg, P.ClientReply):
            raise P.ProtocolError("expected a ClientReply to a non-streamed request")
        return _completion(msg)

    def generate(self, prompt: str | list[int] | None = None, **kw) -> str:
        return self.complete(prompt, **kw).text

    def stream(self, prompt: str | list[int] | None = None, **kw) -> Iterator[str]:
        """Yields text deltas; closing the generator early aborts the request on the daemon."""
        req = make_request(prompt, stream=True, api_key=self.api_key, **kw)
        self._sock.send(P.encode(req))
        is_done = False
        try:
            while not is_done:
                msg = self._recv(req.req_id)
                is_done = msg.finish_reason is not None
                if msg.text:
                    yield msg.text
        finally:
            if not is_done:
                self._sock.send(P.encode(P.ClientAbort(req.req_id, self.api_key)))


class AsyncSpindClient:
    """asyncio client; any number of concurrent requests share one socket (a reader task routes replies)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float = 600.0, api_key: str = "") -> None:
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = _dealer(self._ctx, address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncSpindClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = P.decode(await self._sock.recv(), P.ClientOut)
            except P.ProtocolVersionError as e:  # a daemon of another release: nothing it sends will decode
                for q in self._queues.values():
                    q.put_nowait(e)
                continue
            except P.ProtocolError:
                continue  # not for us to crash on; the request it belonged to times out
            req_id = getattr(msg, "req_id", "")
            for q in ([self._queues[req_id]] if req_id in self._queues else
                      list(self._queues.values()) if req_id == "" else []):
                q.put_nowait(msg)

    async def _open(self, req: P.ClientRequest) -> asyncio.Queue:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.req_id] = q
        await self._sock.send(P.encode(req))
        return q

    async def _recv(self, q: asyncio.Queue) -> P.ClientChunk | P.ClientReply:
        return _check(await asyncio.wait_for(q.get(), self.timeout_s))

    async def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        req = make_request(prompt, stream=False, api_key=self.api_key, **kw)
        try:
            q = await self._open(req)
            msg = await self._recv(q)
            while _is_probe(msg):  # the daemon checks that we are still here
                msg = await self._recv(q)
        finally:
            self._queues.pop(req.req_id, None)
        if not isinstance(msg, P.ClientReply):
            raise P.ProtocolError("expected a ClientReply to a non-streamed request")
        return _completion(msg)

    async def generate(self, prompt: str | list[int] | None = None, **kw) -> str:
        return (await self.complete(prompt, **kw)).text

    async def stream(self, prompt: str | list[int] | None = None, **kw) -> AsyncIterator[str]:
        req = make_request(prompt, stream=True, api_key=self.api_key, **kw)
        is_done = False
        try:
            q = await self._open(req)
            while not is_done:
                msg = await self._recv(q)
                is_done = msg.finish_reason is not None
                if msg.text:
                    yield msg.text
        finally:
            self._queues.pop(req.req_id, None)
            if not is_done:
                await self._sock.send(P.encode(P.ClientAbort(req.req_id, self.api_key)))


def _is_probe(msg: object) -> bool:
    """An empty chunk the daemon sends while a non-streamed request runs, to notice a client gone."""
    return isinstance(msg, P.ClientChunk) and msg.finish_reason is None and not msg.token_ids and not msg.text


def http_json(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict | None]:
    """GET a JSON endpoint: (status, body); (0, None) when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None
