"""OpenAI's wire format for spind: request JSON -> validated `GenerateArgs` (`parse_generate`), deltas ->
OpenAI response and chunk objects (`ChunkFormatter`), errors -> OpenAI error JSON. Pure and unit-tested; the
HTTP and ZeroMQ front ends share it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import msgspec

from aiohttp import web

from spind import protocol as P
from spind.coordinator.interface import Delta, EngineError, Usage
from spind.grammar import GrammarError, check_grammar
from spind.params import (MAX_LOGPROBS, MAX_N, Grammar, SamplingParams, drafter_k_conflict, grammar_param,
                          is_encodable)

MAX_BODY_BYTES = 1 << 20
ABORT = "abort"  # the engine's finish_reason for a request ended early; never sent as an OpenAI finish_reason

class ApiError(Exception):
    """A request answered with an OpenAI error object and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 close_connection: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close_connection = close_connection  # the body was not read to its end: the connection is unusable


@dataclass(frozen=True)
class ApiLimits:
    model_name: str
    max_model_len: int
    drafter_names: tuple[str, ...]
    max_k: int = 32


@dataclass(frozen=True, kw_only=True)
class GenerateArgs:
    """A validated completion or chat request, before its prompt is tokenized."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    has_max_tokens: bool
    drafter: str = "auto"
    k: int | None = None
    n: int = 1  # completions of the prompt, sharing its prefilled KV
    is_stream: bool = False
    include_usage: bool = False
    ignored: tuple[str, ...] = ()  # fields of the body spind does not know and ignores (as vLLM does)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Without max_tokens a request may use the rest of the context (as vLLM does)."""
        if self.has_max_tokens:
            return self.params
        return msgspec.structs.replace(self.params, max_tokens=max(1, max_model_len - num_prompt_tokens))


# Fields parse_generate reads; others are ignored and named back in the X-Spind-Ignored-Fields header
KNOWN_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "top_k", "seed", "stop", "ignore_eos", "logit_bias", "logprobs", "top_logprobs", "n",
                          "stream", "stream_options", "response_format", "spind"})
SPIND_FIELDS = ("drafter", "k", "regex", "grammar")  # spind's own request fields live in the "spind" object

# OpenAI fields spind does not implement: accepted only at their neutral values
NEUTRAL_VALUES = {"echo": False, "best_of": 1, "presence_penalty": 0,
                  "frequency_penalty": 0, "suffix": "", "tools": [], "tool_choice": "none",
                  "functions": [], "function_call": "none"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
INT_LIMIT = 2**63


def _get(body: dict, name: str, kinds: type | tuple[type, ...], what: str, default: object = None,
         path: str = "") -> object:
    """body[name] checked to be of `kinds`; `path`: where `body` sits in the request ("spind."), so that an error's
    `param` is the field's dotted path from the body's root, as every error body names it ("spind.k",
    "stream_options.include_usage", "messages[2].content")."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)) \
            or not isinstance(value, kinds):
        raise ApiError(400, f"'{path}{name}' must be {what}", param=path + name)
    return value


def _int(body: dict, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    value = _get(body, name, int, "an integer", default)
    if value is not None and not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return value


def _parse_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        check_text(prompt, "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
        return prompt
    if prompt in (None, "", []):
        raise ApiError(400, "'prompt' is required and must not be empty", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")


def parse_messages(messages: object) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content": str}] (text content parts joined; "developer" = system)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}] needs a role in {CHAT_ROLES}", param=f"messages[{i}].role")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] needs string content", param=f"messages[{i}].content")
        check_text(content, f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def check_text(text: str, param: str) -> None:
    """JSON can carry lone surrogates (\\ud800) that no tokenizer can encode: refused as bad input."""
    if not is_encodable(text):
        raise ApiError(400, f"'{param}' is not valid Unicode (it holds a lone surrogate)", param=param)


def check_extension(drafter: str, k: int | None, limits: ApiLimits) -> None:
    """The spind extension: a configured drafter name, "auto" or "none"; k in [0, max_k] or None (config)."""
    if drafter not in ("auto", "none", *limits.drafter_names):
        known = ", ".join(("auto", "none", *limits.drafter_names))
        raise ApiError(400, f"unknown drafter {drafter!r}; choose one of: {known}", param="spind.drafter")
    if k is not None and not 0 <= k <= limits.max_k:
        raise ApiError(400, f"'spind.k' must be in [0, {limits.max_k}], got {k}", param="spind.k")
    conflict = drafter_k_conflict(drafter, k)
    if conflict is not None:
        raise ApiError(400, conflict, param="spind.k")


def _parse_spind(body: dict, limits: ApiLimits) -> tuple[str, int | None, Grammar | None]:
    ext = _get(body, "spind", dict, 'an object {"drafter": ..., "k": ...}', {})
    unknown = sorted(set(ext) - set(SPIND_FIELDS))
    if unknown:  # named by its path, as OpenAI names an unknown argument; the message lists every one
        raise ApiError(400, f"unknown 'spind' field(s): {', '.join(unknown)}; known: {', '.join(SPIND_FIELDS)}",
                       param=f"spind.{unknown[0]}")
    drafter = _get(ext, "drafter", str, "a string", "auto", path="spind.")
    k = _get(ext, "k", int, "an integer", path="spind.")
    check_extension(drafter, k, limits)
    # present means given: a wrong type (0, false) or an empty text is refused, not taken for "no grammar"
    grammars = [Grammar(kind, _get(ext, kind, str, "a string", path="spind.")) for kind in ("regex", "grammar")
                if ext.get(kind) is not None]
    for g in grammars:
        if not g.text:
            raise ApiError(400, f"'spind.{g.kind}' must not be empty", param=f"spind.{g.kind}")
    if len(grammars) > 1:
        raise ApiError(400, "give one of 'spind.regex' and 'spind.grammar'", param="spind")
    return drafter, k, grammars[0] if grammars else None


def _parse_response_format(body: dict) -> Grammar | None:
    """OpenAI's response_format: text (no grammar), json_object (any JSON object), or json_schema with its schema."""
    rf = _get(body, "response_format", dict, 'an object {"type": "text" | "json_object" | "json_schema", ...}')
    if rf is None or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return Grammar("json_schema", '{"type": "object"}')
    if rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "'response_format' of type json_schema needs \"json_schema\": {\"name\": ..., "
                                "\"schema\": {...}}", param="response_format.json_schema")
        return Grammar("json_schema", json.dumps(schema))
    raise ApiError(400, f"'response_format' type must be text, json_object or json_schema, got {rf.get('type')!r}",
                   param="response_format.type")


def _parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> sorted (id, bias) pairs; ids and range are checked by SamplingParams."""
    raw = _get(body, "logit_bias", dict, "an object mapping token ids to numbers", {})
    pairs = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError(400, f"'logit_bias' keys must be token ids (decimal strings), got {key!r}",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"'logit_bias' values must be numbers, got {value!r}", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _parse_logprobs(body: dict, is_chat: bool) -> int | None:
    """Chat: "logprobs": true with "top_logprobs": N alternatives; completions: "logprobs": N. -> N, or None (off)."""
    if not is_chat:
        if body.get("top_logprobs") is not None:
            raise ApiError(400, "'top_logprobs' is a chat completions field; completions take 'logprobs': N",
                           param="top_logprobs")
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _get(body, "logprobs", bool, "a boolean", False):
        if top is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def parse_generate(raw: bytes, is_chat: bool, limits: ApiLimits,
                   defaults: dict[str, float] | None = None) -> GenerateArgs:
    """Body of POST /v1/completions or /v1/chat/completions -> GenerateArgs, or ApiError (400/404)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _get(body, "model", str, "a string")
    if model is not None and model != limits.model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{limits.model_name}'",
                       param="model", code="model_not_found")
    for name, neutral in NEUTRAL_VALUES.items():
        if body.get(name) is not None and body[name] != neutral:
            raise ApiError(400, f"'{name}' is not supported by spind (only {json.dumps(neutral)})", param=name)
    for name in SPIND_FIELDS:
        if name in body:
            raise ApiError(400, f"'{name}' is a spind extension: send it inside the \"spind\" object, as "
                                f"\"spind\": {{\"{name}\": ...}}", param=name)
    drafter, k, grammar = _parse_spind(body, limits)
    response_format = _parse_response_format(body)
    if grammar is not None and response_format is not None:
        raise ApiError(400, "give either 'response_format' or a spind grammar, not both", param="response_format")
    defaults = defaults or {}  # the model's generation defaults, else OpenAI's
    prompt, messages = (None, parse_messages(body.get("messages"))) if is_chat else (_parse_prompt(body), None)
    max_tokens = _int(body, "max_tokens", 1, limits.max_model_len)
    if max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1, limits.max_model_len)
    number = (int, float)
    stop = _get(body, "stop", (str, list), "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    try:
        params = SamplingParams(
            max_tokens=max_tokens or 1,
            temperature=float(_get(body, "temperature", number, "a number", defaults.get("temperature", 1.0))),
            top_p=float(_get(body, "top_p", number, "a number", defaults.get("top_p", 1.0))),
            top_k=max(0, _int(body, "top_k", -1, 2**31 - 1, int(defaults.get("top_k", 0)))),  # -1 = off
            seed=_int(body, "seed", -INT_LIMIT, INT_LIMIT - 1),
            stop=tuple(stop), ignore_eos=bool(_get(body, "ignore_eos", bool, "a boolean", False)),
            logit_bias=_parse_logit_bias(body), logprobs=_parse_logprobs(body, is_chat),
            grammar=grammar or response_format).validate()
    except (ValueError, TypeError, OverflowError) as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    is_stream = bool(_get(body, "stream", bool, "a boolean", False))
    options = _get(body, "stream_options", dict, "an object", None)
    if options is not None and not is_stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = bool(_get(options or {}, "include_usage", bool, "a boolean", False, path="stream_options."))
    ignored = tuple(sorted(set(body) - KNOWN_FIELDS - set(NEUTRAL_VALUES)))
    n = _int(body, "n", 1, MAX_N, 1)
    return GenerateArgs(prompt=prompt, messages=messages, params=params, has_max_tokens=max_tokens is not None,
                        drafter=drafter, k=k, n=n, is_stream=is_stream, include_usage=include_usage, ignored=ignored)


async def check_grammar_off_loop(params: SamplingParams) -> None:
    """A request's grammar compiled off the event loop (a large one takes 100 ms or more), or ApiError(400)."""
    if params.grammar is None:
        return
    try:
        await asyncio.to_thread(check_grammar, params.grammar)
    except GrammarError as e:
        raise ApiError(400, str(e), param=grammar_param(params.grammar.kind)) from None


def check_serving(status: str) -> None:
    """Generation is refused (503) while the daemon is starting or draining."""
    if status != "ok":
        message = {"draining": "the server is shutting down", "failed": "the server failed and is exiting"}.get(
            status, "the server is starting")
        raise ApiError(503, message, code=status)


def error_json(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 429: "rate_limit_error", 503: "overloaded_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: ApiError) -> web.Response:
    resp = web.json_response(error_json(e.status, e.message, e.param, e.code), status=e.status)
    if e.close_connection:
        resp.force_close()
    return resp


def from_engine_error(e: EngineError) -> ApiError:
    return ApiError(e.status, str(e), code=e.code)


SHUTTING_DOWN = "the server is shutting down"


def abort_error(usage: Usage | None) -> ApiError:
    """The engine ended a request early ("abort", not an OpenAI finish_reason): an error object that says
    why; 503 when the server is going away, 500 when the request itself failed."""
    detail = usage.finish_detail if usage is not None and usage.finish_detail else "the request was aborted"
    if SHUTTING_DOWN in detail:
        return ApiError(503, f"request aborted: {detail}", code="server_shutting_down")
    return ApiError(500, f"request aborted: {detail}", code="request_aborted")


@dataclass
class Choice:
    """One completion of a whole (non-streamed) response."""

    text: str
    finish_reason: str
    logprobs: list[P.OutputLogprobs] | None = None


@dataclass
class ChunkFormatter:
    """OpenAI response and stream-chunk objects for one request (`text_completion` or `chat.completion`), whose n
    completions are its choices, by `index`."""

    req_id: str
    model: str
    is_chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers of the response
    _text_offset: dict[int, int] = field(default_factory=dict)  # completions logprobs: per choice, characters so far

    def _chunk(self, choice: dict | None, **extra: object) -> dict:
        obj = {"id": self.req_id, "object": "chat.completion.chunk" if self.is_chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [] if choice is None else [choice]}
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return obj

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: list[P.OutputLogprobs] | None = None, index: int = 0) -> dict:
        lp = None if logprobs is None else self.logprobs_json(logprobs, index)
        if not self.is_chat:
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        delta = {} if text is None else {"content": text}
        if role:
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

    def logprobs_json(self, logprobs: list[P.OutputLogprobs], index: int = 0) -> dict:
        """OpenAI's logprobs object for some output tokens of choice `index`: chat's {"content": [...]}, or the
        completions API's parallel lists (text_offset counts on from the tokens of earlier calls, as a stream goes)."""
        if self.is_chat:
            return {"content": [{**_token_json(t.chosen), "top_logprobs": [_token_json(a) for a in t.top]}
                                for t in logprobs], "refusal": None}
        offsets = []
        at = self._text_offset.get(index, 0)
        for t in logprobs:
            offsets.append(at)
            at += len(t.chosen.token)
        self._text_offset[index] = at
        return {"tokens": [t.chosen.token for t in logprobs], "token_logprobs": [t.chosen.logprob for t in logprobs],
                "top_logprobs": [{**{a.token: a.logprob for a in t.top}, t.chosen.token: t.chosen.logprob}
                                 for t in logprobs],
                "text_offset": offsets}

    def role(self, index: int = 0) -> dict:
        """A choice's first chat chunk: announces the assistant role with empty content."""
        return self._chunk(self._choice("", None, role=True, index=index))

    def delta(self, d: Delta) -> list[dict]:
        """Chunks for one engine delta: its text and its tokens' logprobs (if any), then, on its choice's last, the
        finish chunk (with that choice's spind usage)."""
        chunks = [self._chunk(self._choice(d.text, None, logprobs=d.logprobs, index=d.index))] \
            if d.text or d.logprobs else []
        if d.finish_reason is not None:
            spind = (d.usage.spind_json() if d.usage is not None else {})
            chunks.append(self._chunk(self._choice(None, d.finish_reason, index=d.index), spind=spind))
        return chunks

    def usage_chunk(self, usage: Usage) -> dict:
        """The stream's last chunk, after every choice finished (stream_options.include_usage)."""
        return self._chunk(None, usage=usage.to_json(), spind=usage.spind_json())

    def response(self, choices: list[Choice], usage: Usage) -> dict:
        """The whole (non-streaming) response."""
        out = []
        for i, c in enumerate(choices):
            lp = None if c.logprobs is None else self.logprobs_json(c.logprobs, i)
            if self.is_chat:
                out.append({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                            "finish_reason": c.finish_reason})
            else:
                out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.req_id, "object": "chat.completion" if self.is_chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage.to_json(),
                "spind": usage.spind_json()}


def _token_json(t: P.Logprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}


class InFlight:
    """Counts requests in flight so that a drain can wait for the last one."""

    def __init__(self) -> None:
        self.num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __enter__(self) -> None:
        self.num_active += 1
        self._idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


def sse(obj: dict | str) -> bytes:
    body = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode()


