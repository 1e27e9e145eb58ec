"""The HTTP front end's pure parts: request parsing and validation, OpenAI chunk formatting, error mapping,
and the aiohttp app's answers to requests that never reach an engine (auth, unknown routes, bad bodies)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import os
import socket
import stat
import subprocess
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from spind import protocol as P
from spind.client import make_request
from spind.frontend.api import ApiServer
from spind.models.loader import load_generation_defaults
from spind.frontend.openai_schema import (MAX_BODY_BYTES, ApiError, ApiLimits, Choice, ChunkFormatter, InFlight,
                                          check_grammar_off_loop, error_json, from_engine_error, parse_generate, sse)
from spind.frontend.daemon_cli import load_daemon_config, probe_url
from spind.coordinator.interface import Delta, EngineError, Usage
from spind.params import Grammar, SamplingParams
from spind.frontend.server import PidInfo
from spind.coordinator.transport.process_pool import default_run_dir, prepare_run_dir
from spind.frontend.zmq_api import Envelope, ZmqApiServer, client_prompt, split_frames

LIMITS = ApiLimits(model_name="spind", max_model_len=1024, drafter_names=("ngram", "int8"))


def parse(body: object, is_chat: bool = False):
    return parse_generate(json.dumps(body).encode(), is_chat, LIMITS)


def refused(body: object, is_chat: bool = False) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as e:
        parse_generate(raw, is_chat, LIMITS)
    return e.value


# -- parsing -------------------------------------------------------------------------------------------------

def test_completion_defaults_follow_openai():
    a = parse({"prompt": "hello"})
    assert a.prompt == "hello" and a.messages is None
    assert a.params.temperature == 1.0 and a.params.top_p == 1.0 and a.params.top_k == 0
    assert not a.is_stream and not a.include_usage and a.drafter == "auto" and a.k is None
    assert not a.has_max_tokens and a.sampling_params(24, 1024).max_tokens == 1000


def test_logit_bias_is_parsed_and_checked():
    assert parse({"prompt": "hi", "logit_bias": {"7": 2.5, "5": -100}}).params.logit_bias == ((5, -100.0), (7, 2.5))
    assert parse({"prompt": "hi", "logit_bias": {}}).params.logit_bias == ()
    for bad, message in (({"x": 1}, "keys must be token ids"), ({"1": "a"}, "values must be numbers"),
                         ({"1": True}, "values must be numbers"), ([1], "must be an object"),
                         ({"1": 500}, r"must be numbers in \[-100, 100\]"), ({"-1": 1}, "keys must be token ids"),
                         ({str(i): 1 for i in range(301)}, "at most 300")):
        e = refused({"prompt": "hi", "logit_bias": bad})
        assert e.status == 400 and re.search(message, e.message), (bad, e.message)


def test_logprobs_are_parsed_in_each_api_shape_and_checked():
    """Completions: "logprobs": N; chat: "logprobs": true and "top_logprobs": N. Either way SamplingParams.logprobs."""
    assert parse({"prompt": "hi"}).params.logprobs is None
    assert parse({"prompt": "hi", "logprobs": 0}).params.logprobs == 0
    assert parse({"prompt": "hi", "logprobs": 20}).params.logprobs == 20
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(chat, is_chat=True).params.logprobs is None
    assert parse({**chat, "logprobs": False}, is_chat=True).params.logprobs is None
    assert parse({**chat, "logprobs": True}, is_chat=True).params.logprobs == 0
    assert parse({**chat, "logprobs": True, "top_logprobs": 5}, is_chat=True).params.logprobs == 5
    for body, is_chat, param, message in (
            ({"prompt": "hi", "logprobs": 21}, False, "logprobs", r"in \[0, 20\]"),
            ({"prompt": "hi", "logprobs": True}, False, "logprobs", "an integer"),
            ({"prompt": "hi", "top_logprobs": 2}, False, "top_logprobs", "completions take 'logprobs': N"),
            ({**chat, "top_logprobs": 2}, True, "top_logprobs", "needs 'logprobs': true"),
            ({**chat, "logprobs": True, "top_logprobs": 21}, True, "top_logprobs", r"in \[0, 20\]"),
            ({**chat, "logprobs": 3}, True, "logprobs", "a boolean")):
        e = refused(body, is_chat)
        assert e.status == 400 and e.param == param and re.search(message, e.message), (body, e.message)


def test_response_format_and_spind_grammars_are_parsed_and_checked():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse({"prompt": "hi"}).params.grammar is None
    assert parse({"prompt": "hi", "response_format": {"type": "text"}}).params.grammar is None
    assert parse({"prompt": "hi", "response_format": {"type": "json_object"}}).params.grammar == Grammar(
        "json_schema", '{"type": "object"}')
    g = parse({"prompt": "hi", "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": schema}}}).params.grammar
    assert g.kind == "json_schema" and json.loads(g.text) == schema
    assert parse({"prompt": "hi", "spind": {"regex": "[0-9]+"}}).params.grammar == Grammar("regex", "[0-9]+")
    assert parse({"prompt": "hi", "spind": {"grammar": 'root ::= "a"'}}).params.grammar == Grammar("grammar",
                                                                                                'root ::= "a"')
    for body, param, message in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema",
             "schema"),
            ({"response_format": {"type": "yaml"}}, "response_format.type", "text, json_object or json_schema"),
            ({"response_format": "json"}, "response_format", "must be an object"),
            ({"spind": {"regex": "a", "grammar": "b"}}, "spind", "one of"),
            ({"spind": {"regex": 5}}, "spind.regex", "a string"),
            ({"regex": "a"}, "regex", "spind extension"),
            ({"response_format": {"type": "json_object"}, "spind": {"regex": "a"}}, "response_format", "not both"),
            ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos")):
        e = refused({"prompt": "hi", **body})
        assert e.status == 400 and e.param == param and re.search(message, e.message), (body, e.message)


def test_unset_sampling_fields_take_the_models_generation_defaults(tmp_path):
    a = parse_generate(json.dumps({"prompt": "hi"}).encode(), False, LIMITS, {"temperature": 0.3, "top_k": 20})
    assert (a.params.temperature, a.params.top_p, a.params.top_k) == (0.3, 1.0, 20)
    b = parse_generate(json.dumps({"prompt": "hi", "temperature": 0}).encode(), False, LIMITS, {"temperature": 0.3})
    assert b.params.temperature == 0.0  # what the request says wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": False}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.0, "top_p": 0.9}  # do_sample false: greedy
    assert load_generation_defaults(tmp_path / "nowhere") == {}


def test_spind_fields_at_the_top_level_are_refused_with_a_hint_and_unknown_ones_named():
    for field in ("drafter", "k"):
        with pytest.raises(ApiError) as e:
            parse({"prompt": "hi", field: "int8" if field == "drafter" else 2})
        assert e.value.status == 400 and '"spind"' in e.value.message and e.value.param == field
    a = parse({"prompt": "hi", "user": "me", "frobnicate": 1})
    assert a.ignored == ("frobnicate", "user")
    assert parse({"prompt": "hi", "n": 1}).ignored == ()  # neutral values of unimplemented fields are known


def test_all_fields_are_carried():
    a = parse({"model": "spind", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
               "top_k": 40, "seed": 11, "stop": "\n", "n": 1, "stream": True,
               "stream_options": {"include_usage": True}, "spind": {"drafter": "ngram", "k": 3},
               "ignore_eos": True, "user": "ignored"})
    p = a.sampling_params(3, 1024)
    assert a.prompt == [1, 2, 3] and p.max_tokens == 7 and p.temperature == 0.0 and p.top_p == 0.5
    assert p.top_k == 40 and p.seed == 11 and p.stop == ("\n",) and p.ignore_eos
    assert a.is_stream and a.include_usage and a.drafter == "ngram" and a.k == 3


def test_chat_messages_and_content_parts():
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}]
    a = parse({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
               "max_completion_tokens": 5, "stop": ["a", "b"]}, is_chat=True)
    assert a.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi x"}]
    assert a.params.max_tokens == 5 and a.params.stop == ("a", "b")


def test_prompt_batch_of_one_is_unwrapped():
    assert parse({"prompt": ["one"]}).prompt == "one"
    assert parse({"prompt": [[5, 6]]}).prompt == [5, 6]


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"), ({"prompt": [1, -1]}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"), ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_k": 1.5}, "top_k"), ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stop": 3}, "stop"), ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "spind": {"drafter": "nope"}}, "spind.drafter"), ({"prompt": "x", "spind": {"k": -1}}, "spind.k"),
    ({"prompt": "x", "spind": {"k": 99}}, "spind.k"), ({"prompt": "x", "spind": {"other": 1}}, "spind.other"),
    ({"prompt": "x", "spind": "ngram"}, "spind"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "spind": {"drafter": 5}}, "spind.drafter"), ({"prompt": "x", "spind": {"k": "4"}}, "spind.k"),
    ({"prompt": "x", "spind": {"grammar": 5}}, "spind.grammar"),
    ({"prompt": "x", "spind": {"regex": 0}}, "spind.regex"), ({"prompt": "x", "spind": {"regex": ""}}, "spind.regex"),
    ({"prompt": "x", "spind": {"grammar": False}}, "spind.grammar"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "spind": {"regex": "a" * 70_000}}, "spind.regex"),
    ({"prompt": "x", "spind": {"grammar": "a" * 70_000}}, "spind.grammar"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"description": "a" * 70_000}}}}, "response_format.json_schema.schema"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_fields_are_400_naming_the_param(body, param):
    """Every error's `param` is the field's dotted path from the body's root (OpenAI names a top-level field alone)."""
    e = refused(body)
    assert e.status == 400 and e.param == param, e.message


def test_unknown_spind_fields_are_named_by_path_and_listed():
    e = refused({"prompt": "x", "spind": {"drafters": "ngram", "kk": 4}})
    assert e.param == "spind.drafters" and "drafters, kk" in e.message
    assert "known: drafter, k, regex, grammar" in e.message


@pytest.mark.parametrize("grammar, param, message", [
    (Grammar("regex", "(unclosed"), "spind.regex", "regex does not compile"),
    (Grammar("grammar", "root ::= ???"), "spind.grammar", "grammar does not compile"),
    (Grammar("json_schema", '{"type": "nonsense"}'), "response_format.json_schema.schema", "schema does not compile")])
def test_a_grammar_that_does_not_compile_is_named_where_the_body_holds_it(grammar, param, message):
    """Compiled off the event loop after parsing: the error still names the field the grammar came from."""
    with pytest.raises(ApiError) as e:
        asyncio.run(check_grammar_off_loop(SamplingParams(grammar=grammar)))
    assert e.value.status == 400 and e.value.param == param and message in e.value.message


@pytest.mark.parametrize("body", [
    {"prompt": "x", "temperature": -1}, {"prompt": "x", "top_p": 0}, {"prompt": "x", "stop": [""]},
    {"prompt": "x", "stop": ["s"] * 17}, {"prompt": "x", "temperature": 1e400}, {"prompt": "x", "stop": [1]},
])
def test_out_of_range_sampling_is_400(body):
    assert refused(body).status == 400


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([3], "messages[0].role"), ([{"role": "user", "content": "\ud800"}], "messages[0].content")])
def test_bad_messages_are_400_naming_the_message(messages, param):
    e = refused({"messages": messages}, is_chat=True)
    assert e.status == 400 and e.param == param, e.message


@pytest.mark.parametrize("drafter", ["ngram", "auto"])
def test_k_0_with_a_drafter_that_would_draft_is_a_400_naming_the_conflict(drafter):
    """k = 0 drafts nothing: with a named drafter, or auto, it contradicts the request (it was served silently as
    plain decoding); drafter "none" with k = 0 is plain decoding, as is drafter "none" alone."""
    e = refused({"prompt": "x", "spind": {"drafter": drafter, "k": 0}})
    assert e.status == 400 and e.param == "spind.k" and "k = 0 drafts no tokens" in e.message
    assert repr(drafter) in e.message or "auto selection" in e.message
    assert parse({"prompt": "x", "spind": {"drafter": "none", "k": 0}}).k == 0
    assert parse({"prompt": "x", "spind": {"drafter": drafter, "k": 1}}).k == 1


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"null", b"\xff\xfe", b"[" * 100_000, b'"prompt"'])
def test_malformed_json_is_400(raw):
    assert refused(raw).status == 400


def test_unknown_model_is_404():
    e = refused({"model": "gpt-4", "prompt": "x"})
    assert e.status == 404 and e.code == "model_not_found" and e.param == "model"


# -- formatting ----------------------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=3, completion_tokens=4, drafters={"ngram": {"drafted": 6, "accepted": 2}},
              num_steps=2, mean_accepted_length=2.0)


def test_chat_stream_chunks_have_openai_shape():
    f = ChunkFormatter("chatcmpl-1", "spind", is_chat=True, include_usage=True, created=7)
    role = f.role()
    assert role["object"] == "chat.completion.chunk" and role["usage"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    mid = f.delta(Delta([1], "Hel"))
    assert len(mid) == 1 and mid[0]["choices"][0]["delta"] == {"content": "Hel"}
    assert mid[0]["choices"][0]["finish_reason"] is None
    assert f.delta(Delta([], "")) == []  # held-back text: nothing to send yet
    last = f.delta(Delta([2], "lo", "stop", USAGE)) + [f.usage_chunk(USAGE)]
    assert [c["choices"][0]["delta"] for c in last[:2]] == [{"content": "lo"}, {}]
    assert last[1]["choices"][0]["finish_reason"] == "stop" and last[1]["spind"] == USAGE.spind_json()
    assert last[2]["choices"] == [] and last[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                             "total_tokens": 7,
                                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert last[2]["spind"]["drafters"] == {"ngram": {"drafted": 6, "accepted": 2}}
    assert all(c["id"] == "chatcmpl-1" and c["created"] == 7 and c["model"] == "spind" for c in [role, *mid, *last])


def test_completion_stream_chunks_without_usage():
    f = ChunkFormatter("cmpl-1", "spind", is_chat=False)
    chunks = f.delta(Delta([1], "a", "length", USAGE))
    assert [c["object"] for c in chunks] == ["text_completion"] * 2 and "usage" not in chunks[0]
    assert chunks[0]["choices"][0] == {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}
    assert chunks[1]["choices"][0]["finish_reason"] == "length" and chunks[1]["spind"]["time_slots"] == 2


def test_responses_carry_usage_and_spind():
    chat = ChunkFormatter("chatcmpl-2", "spind", is_chat=True).response([Choice("hi", "stop")], USAGE)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant",
                                                                                      "content": "hi"}
    assert chat["usage"]["total_tokens"] == 7 and chat["spind"]["mean_accepted_length"] == 2.0
    text = ChunkFormatter("cmpl-2", "spind", is_chat=False).response([Choice("hi", "length")], USAGE)
    assert text["choices"][0]["text"] == "hi" and text["choices"][0]["finish_reason"] == "length"


def _lp(token_id: int, token: bytes, logprob: float) -> P.Logprob:
    return P.Logprob(token_id, token.decode("utf-8", errors="replace"), token, logprob)


LOGPROBS = [P.OutputLogprobs(_lp(5, b"Hi", -0.25), [_lp(5, b"Hi", -0.25), _lp(9, b"Hey", -2.0)]),
            P.OutputLogprobs(_lp(7, b"\xe6", -1.5), [_lp(8, b" there", -0.5), _lp(7, b"\xe6", -1.5)])]


def test_chat_logprobs_have_openai_shape_with_exact_bytes():
    f = ChunkFormatter("chatcmpl-3", "spind", is_chat=True)
    content = f.response([Choice("Hi\ufffd", "stop", LOGPROBS)], USAGE)["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
        {"token": "Hey", "logprob": -2.0, "bytes": [72, 101, 121]}]}
    assert content[1]["token"] == "\ufffd" and content[1]["bytes"] == [0xE6]  # part of a character: its byte
    assert f.response([Choice("x", "stop")], USAGE)["choices"][0]["logprobs"] is None  # not asked for
    chunks = f.delta(Delta([5], "Hi", logprobs=LOGPROBS[:1])) + f.delta(Delta([7], "", logprobs=LOGPROBS[1:]))
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == ["Hi", "\ufffd"]
    assert chunks[1]["choices"][0]["delta"] == {"content": ""}  # tokens without text yet still report their logprobs


def test_completion_logprobs_have_the_legacy_shape_and_offsets_run_on_across_chunks():
    f = ChunkFormatter("cmpl-3", "spind", is_chat=False)
    lp = f.response([Choice("Hi\ufffd", "length", LOGPROBS)], USAGE)["choices"][0]["logprobs"]
    assert lp == {"tokens": ["Hi", "\ufffd"], "token_logprobs": [-0.25, -1.5],
                  "top_logprobs": [{"Hi": -0.25, "Hey": -2.0}, {" there": -0.5, "\ufffd": -1.5}], "text_offset": [0, 2]}
    f = ChunkFormatter("cmpl-4", "spind", is_chat=False)
    chunks = [c for d in (Delta([5], "Hi", logprobs=LOGPROBS[:1]), Delta([7], "x", logprobs=LOGPROBS[1:]))
              for c in f.delta(d)]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [2]]


def test_n_choices_are_indexed_with_their_own_offsets_and_usage_merges():
    f = ChunkFormatter("cmpl-5", "spind", is_chat=False)
    chunks = [c for d in (Delta([5], "Hi", logprobs=LOGPROBS[:1], index=1), Delta([5], "Hi", logprobs=LOGPROBS[:1]),
                          Delta([7], "x", "stop", USAGE, logprobs=LOGPROBS[1:], index=1)) for c in f.delta(d)]
    assert [c["choices"][0]["index"] for c in chunks] == [1, 0, 1, 1]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0], [0], [2]]  # per choice
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    response = ChunkFormatter("chatcmpl-5", "spind", is_chat=True).response(
        [Choice("a", "stop"), Choice("bc", "length")], Usage.merge([USAGE, USAGE]))
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in response["choices"]] == [
        (0, "a", "stop"), (1, "bc", "length")]
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,  # prompt once
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert response["spind"]["drafters"] == {"ngram": {"drafted": 12, "accepted": 4}}
    assert response["spind"]["time_slots"] == 4 and response["spind"]["mean_accepted_length"] == 2.0
    assert parse({"prompt": "hi", "n": 4}).n == 4 and parse({"prompt": "hi"}).n == 1


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_error_mapping():
    e = from_engine_error(EngineError("prompt too long", 413, "context_length_exceeded"))
    assert (e.status, e.code) == (413, "context_length_exceeded")
    body = error_json(503, "busy", code="overloaded")["error"]
    assert body == {"message": "busy", "type": "overloaded_error", "param": None, "code": "overloaded"}
    assert error_json(401, "no")["error"]["type"] == "authentication_error"
    assert error_json(404, "no")["error"]["type"] == "invalid_request_error"


# -- the app, on requests refused before the engine is reached (the engine answers /health only) -------------

class _HealthyEngine:
    """Answers /health only: any other use fails the test."""

    def health(self) -> None:
        return None


async def _with_client(api_key: str, check) -> None:
    server = ApiServer(engine=_HealthyEngine(), limits=LIMITS, api_key=api_key, status="ok")  # type: ignore[arg-type]
    async with TestClient(TestServer(server.build_app())) as client:
        await check(client, server)


def run_app(check, api_key: str = "") -> None:
    asyncio.run(_with_client(api_key, check))


async def _error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_app_refuses_bad_requests_with_openai_errors():
    async def check(client, server):
        await _error(await client.post("/v1/completions", data=b"{nope"), 400)
        await _error(await client.post("/v1/chat/completions", json={"messages": []}), 400)
        err = await _error(await client.post("/v1/completions", json={"model": "x", "prompt": "a"}), 404)
        assert err["code"] == "model_not_found"
        err = await _error(await client.get("/v1/nothing"), 404)
        assert "/v1/nothing" in err["message"]
        await _error(await client.get("/v1/completions"), 405)
        await _error(await client.post("/v1/completions", data=b"x" * (MAX_BODY_BYTES + 1)), 413)
        assert (await client.get("/health")).status == 200
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "spind"
        await _error(await client.get("/v1/models/other"), 404)
        server.set_status("draining")
        await _error(await client.post("/v1/completions", json={"prompt": "a"}), 503)
        assert (await client.get("/health")).status == 503
    run_app(check)


def test_app_checks_the_api_key_but_leaves_health_open():
    async def check(client, server):
        err = await _error(await client.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        await _error(await client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        await _error(await client.post("/v1/completions", json={"prompt": "a"}), 401)
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200
        assert (await client.get("/health")).status == 200
    run_app(check, api_key="s3cret")


# -- ZeroMQ client API: records and frames (the engine is never reached by these) -----------------------------

def test_client_request_round_trips_through_the_protocol():
    req = make_request("hi", max_tokens=5, temperature=0, stop=["\n"], drafter="ngram", k=2, stream=False)
    back = P.decode(P.encode(req), P.ClientIn)
    assert back == req and back.prompt == "hi" and back.prompt_ids is None and back.params.stop == ("\n",)
    ids = make_request(list(range(100)), seed=3)
    assert P.decode(P.encode(ids), P.ClientIn).prompt_ids == list(range(100))
    chat = make_request(messages=[{"role": "user", "content": "x"}])
    assert P.decode(P.encode(chat), P.ClientIn).messages == [P.ChatMessage("user", "x")]


def test_client_prompt_validation_matches_http():
    assert client_prompt(make_request("hi"), LIMITS) == ("hi", None)
    assert client_prompt(make_request([1, 2]), LIMITS) == ([1, 2], None)
    _, messages = client_prompt(make_request(messages=[{"role": "developer", "content": "x"}]), LIMITS)
    assert messages == [{"role": "system", "content": "x"}]
    for bad in (make_request(None), make_request(""), make_request([]), make_request("x", drafter="nope"),
                make_request("x", k=-1), make_request("x", max_tokens=0), make_request("x", max_tokens=10**6),
                make_request(messages=[{"role": "tool", "content": "x"}])):
        with pytest.raises(ApiError) as e:
            client_prompt(bad, LIMITS)
        assert e.value.status == 400
    both = msgspec.structs.replace(make_request("x"), prompt_ids=[1])
    with pytest.raises(ApiError):
        client_prompt(both, LIMITS)


def test_split_frames():
    assert split_frames([b"id", b"x"]) == (Envelope((b"id",)), b"x")
    assert split_frames([b"id", b"", b"x"]) == (Envelope((b"id", b"")), b"x")
    assert split_frames([b"id", b"a", b"b", b"c"]) == (Envelope((b"id",)), b"")
    assert split_frames([]) is None


@contextlib.asynccontextmanager
async def zmq_server(api_key: str = ""):
    """A ZeroMQ API server with no engine behind it (nothing here reaches one), and a DEALER connected to it."""
    server = ZmqApiServer(engine=None, limits=LIMITS, host="127.0.0.1", port=_free_port(), api_key=api_key)  # type: ignore
    server.bind()
    server.set_status("ok")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        yield server, sock
    finally:
        sock.close(0)
        ctx.term()
        server.close()


def test_zmq_server_answers_malformed_frames_with_errors():
    async def check():
        async with zmq_server() as (server, sock):
            bad = [b"", b"\xc1", P.encode(P.Ping(1)),
                   msgspec.msgpack.encode([P.CLIENT_PROTOCOL_VERSION, {"type": "client_request", "req_id": 5}]),
                   msgspec.msgpack.encode([9, {"type": "client_request"}]), P.encode(make_request("x", drafter="nope"))]
            for frame in bad:
                await sock.send(frame)
                msg = P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut)
                assert isinstance(msg, P.ClientError) and msg.status == 400, msg
            await sock.send_multipart([b"a", b"b", b"c"])
            assert isinstance(P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut), P.ClientError)
            server.set_status("draining")
            await sock.send(P.encode(make_request("x")))
            msg = P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut)
            assert isinstance(msg, P.ClientError) and msg.status == 503 and msg.code == "draining"
    asyncio.run(check())


def test_zmq_errors_name_the_field_as_http_does():
    """The k = 0 conflict, a bad drafter, a sampling field out of range and a grammar too long: the same 400 and
    `param` as over HTTP."""
    async def check():
        async with zmq_server() as (_, sock):
            out = []
            for req in (make_request("x", drafter="ngram", k=0), make_request("x", drafter="nope"),
                        make_request("x", temperature=-1.0), make_request("x", grammar=Grammar("regex", "a" * 70_000)),
                        make_request("x", drafter="none", k=0)):
                await sock.send(P.encode(req))
                out.append(P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut))
            return out
    conflict, unknown, temperature, regex, plain = asyncio.run(check())
    assert (conflict.status, conflict.param) == (400, "spind.k") and "k = 0 drafts no tokens" in conflict.message
    assert (unknown.status, unknown.param) == (400, "spind.drafter")
    assert (temperature.status, temperature.param) == (400, "temperature")
    assert (regex.status, regex.param) == (400, "spind.regex") and "at most 65536 characters" in regex.message
    assert (plain.status, plain.code) == (500, "internal_error")  # "none" with k = 0 passes validation (no engine)


def test_zmq_api_refuses_requests_without_the_api_key():
    """With [server].api_key set, every ClientRequest and ClientAbort must carry it (401 otherwise)."""
    async def check():
        async with zmq_server(api_key="sesame") as (_, sock):
            replies = []
            for key in ("", "wrong", "sesame"):  # a valid key reaches validation: the bad drafter is a 400
                await sock.send(P.encode(make_request("x", drafter="nope", api_key=key)))
                replies.append(P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut))
            await sock.send(P.encode(P.ClientAbort("x")))
            replies.append(P.decode(await asyncio.wait_for(sock.recv(), 5), P.ClientOut))
            return [(r.status, r.code) for r in replies]
    assert asyncio.run(check()) == [(401, "invalid_api_key"), (401, "invalid_api_key"),
                                    (400, "invalid_request_error"), (401, "invalid_api_key")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- run dir and pid file -------------------------------------------------------------------------------------

def test_run_dir_is_private_and_the_pid_file_round_trips(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    assert stat.S_IMODE(os.stat(prepare_run_dir(run_dir)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(prepare_run_dir(tmp_path / "new" / "run")).st_mode) == 0o700
    assert PidInfo.read(run_dir) is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    info = PidInfo(dead.pid, "127.0.0.1", 8000, 0, 1.0)
    info.write(run_dir)
    assert PidInfo.read(run_dir) == info and not info.is_alive


def test_cli_resolves_the_run_dir(tmp_path):
    args = argparse.Namespace(config=None, run_dir=str(tmp_path / "r"), port=9123)
    cfg = load_daemon_config(args)
    assert cfg.server.run_dir == str(tmp_path / "r") and cfg.server.port == 9123
    cfg = load_daemon_config(argparse.Namespace(config=None, run_dir=None))
    assert cfg.server.run_dir == str(default_run_dir()) and Path(cfg.server.run_dir).is_absolute()
    assert probe_url("0.0.0.0", 1, "/health") == "http://127.0.0.1:1/health"
    assert probe_url("::1", 1, "/x") == "http://[::1]:1/x"


def test_in_flight_counts_and_wakes_the_drain():
    async def check():
        flight = InFlight()
        await asyncio.wait_for(flight.wait_idle(), 1)
        with flight:
            waiter = asyncio.create_task(flight.wait_idle())
            await asyncio.sleep(0.01)
            assert flight.num_active == 1 and not waiter.done()
        await asyncio.wait_for(waiter, 1)
        assert flight.num_active == 0
    asyncio.run(check())
