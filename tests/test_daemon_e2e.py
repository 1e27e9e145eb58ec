"""End to end through the real daemon: `spind start` as a subprocess with its real worker processes and the
default model; HTTP through aiohttp and the unmodified `openai` client, and the ZeroMQ client API.

The daemon is started once for each target layout: one process, then split over 2 ranks (`--tensor-parallel 2`,
gloo), whose outputs must equal the same one-process references. Tests run in file order; the last one drains it
with SIGTERM.
Greedy references come from the offline `LocalEngine` in this process (plain target decoding, one at a time).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
import zmq

from spind import protocol as P
from spind.client import AsyncSpindClient, SpindClient, SpindError, http_json, make_request
from spind.params import Grammar, SamplingParams
from daemon_util import Daemon, child_pids, free_port, start_daemon

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "Name three colors."}]
CONFIG = """
[model]
max_model_len = 1024
[runtime]
kv_num_blocks = 512
[selection]
policy = "fixed:int8"
[server]
port = {port}
zmq_port = {zmq_port}
run_dir = "{run_dir}"
[[drafters]]
name = "ngram"
kind = "ngram"
worker = "target"
[[drafters]]
name = "int8"
kind = "self"
variant = "int8-weight-only"
worker = "draft"
[[drafters]]
name = "suffix"           # keeps finished requests' sequences: POST /v1/spind/reset_cache forgets them
kind = "suffix"
worker = "target"
[[drafters]]
name = "q16"              # batch-invariant kernels: seeded sampled output is reproducible under any batching
kind = "self"
variant = "gguf-q16"
layers = [0, 1, 2, 3, 4, 5, 6, 7]
worker = "draft"
[[workers]]
name = "target"
[[workers]]
name = "draft"
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["target", "target-tp2"])
def daemon(request: pytest.FixtureRequest) -> Daemon:
    with start_daemon(CONFIG, "--tensor-parallel", str(request.param)) as d:
        yield d


def target_ranks(daemon: Daemon) -> list[str]:
    (target,) = [w for w in daemon.state()["workers"] if w["name"] == "target"]
    return target["ranks"]


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


@pytest.fixture(scope="module")
def refs(daemon: Daemon) -> dict[str, Reference]:
    """Greedy outputs of the offline engine (plain decoding, one request at a time) for PROMPTS and CHAT."""
    import torch

    from spind.config import load_config
    from spind.coordinator.transport.local import GenRequest, LocalEngine
    from spind.params import SamplingParams

    torch.set_num_threads(1)
    rt = LocalEngine.load(load_config(daemon.config), drafters=[])
    try:
        inputs = {p: rt.tokenizer.encode(p) for p in PROMPTS} | {"chat": rt.tokenizer.apply_chat(CHAT)}
        out = {}
        for name, ids in inputs.items():
            res = rt.generate([GenRequest(name, ids, SamplingParams(max_tokens=MAX_TOKENS), None, 0)], max_batch=1)[0]
            out[name] = Reference(ids, res.token_ids, res.text, res.finish_reason)
        return out
    finally:
        rt.close()


# ---- HTTP helpers ------------------------------------------------------------------------------------------

async def post(session: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data) as resp:
        return resp.status, await resp.json(content_type=None)


async def read_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    """SSE `data:` payloads in order; "[DONE]" stays a string."""
    events = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line
    return events


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict | str]:
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        return await read_events(resp)


def stream_text(events: list[dict | str], is_chat: bool) -> str:
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    pieces = [c["choices"][0]["delta"].get("content") or "" if is_chat else c["choices"][0]["text"]
              for c in events[:-1] if c["choices"]]
    return "".join(pieces)


def finish_chunk(events: list[dict | str]) -> dict:
    (last,) = [c for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    return last


def run(coro):
    return asyncio.run(coro)


# ---- tests -------------------------------------------------------------------------------------------------

def test_completions_match_offline_greedy_for_every_drafter(daemon: Daemon, refs: dict[str, Reference]):
    ref = refs[PROMPTS[0]]

    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            for drafter in ("none", "ngram", "int8", "auto"):
                body = {"model": "spind", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "spind": {"drafter": drafter}}
                status, out = await post(s, "/v1/completions", body)
                assert status == 200, out
                assert out["object"] == "text_completion" and out["choices"][0]["text"] == ref.text, drafter
                assert out["choices"][0]["finish_reason"] == ref.finish_reason
                assert out["usage"] == {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": len(ref.token_ids),
                                        "total_tokens": len(ref.prompt_ids) + len(ref.token_ids),
                                        "prompt_tokens_details": {"cached_tokens": 0}}  # under one KV block
                spind = out["spind"]
                assert spind["time_slots"] >= 1 and spind["mean_accepted_length"] >= 1.0
                used = {"none": set(), "auto": {"int8"}}.get(drafter, {drafter})
                assert set(spind["drafters"]) <= used and (drafter == "none" or spind["drafters"])
                events = await stream(s, "/v1/completions", body)
                assert stream_text(events, is_chat=False) == ref.text
                assert {c["id"] for c in events[:-1]} == {events[0]["id"]}
                assert finish_chunk(events)["spind"]["time_slots"] >= 1
            status, out = await post(s, "/v1/completions", {"prompt": ref.prompt_ids, "max_tokens": MAX_TOKENS,
                                                            "temperature": 0})
            assert status == 200 and out["choices"][0]["text"] == ref.text
    run(check())


def test_chat_plain_and_streamed_with_usage(daemon: Daemon, refs: dict[str, Reference]):
    ref = refs["chat"]

    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            body = {"messages": CHAT, "max_completion_tokens": MAX_TOKENS, "temperature": 0}
            status, out = await post(s, "/v1/chat/completions", body)
            assert status == 200, out
            assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
            assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
            assert out["usage"]["completion_tokens"] == len(ref.token_ids) and "drafters" in out["spind"]
            events = await stream(s, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
            assert events[0]["object"] == "chat.completion.chunk"
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert stream_text(events, is_chat=True) == ref.text
            assert finish_chunk(events)["choices"][0]["delta"] == {} and "spind" in finish_chunk(events)
            usage = events[-2]
            # the same prompt again: its whole KV blocks (the chat template's system turn) come from the prefix cache
            cached = (len(ref.prompt_ids) - 1) // 16 * 16
            assert cached >= 16 and out["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, cached)
            assert usage["choices"] == [] and usage["usage"] == {**out["usage"], "prompt_tokens_details": {
                "cached_tokens": cached}} and usage["spind"]["time_slots"] >= 1
            assert all(c["usage"] is None for c in events[:-2])
    run(check())


def test_unmodified_openai_client(daemon: Daemon, refs: dict[str, Reference]):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["spind"]
    chat = client.chat.completions.create(model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == refs["chat"].text
    assert chat.usage.completion_tokens == len(refs["chat"].token_ids) and "spind" in chat.model_extra
    chunks = list(client.chat.completions.create(model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"spind": {"drafter": "ngram", "k": 3}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == refs["chat"].text
    assert chunks[-1].usage.completion_tokens == len(refs["chat"].token_ids)
    assert set(chunks[-1].model_extra["spind"]["drafters"]) <= {"ngram"}
    text = client.completions.create(model="spind", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert text.choices[0].text == refs[PROMPTS[1]].text
    pieces = client.completions.create(model="spind", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces) == refs[PROMPTS[1]].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="spind", messages=CHAT, presence_penalty=0.5)  # still refused
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="spind", prompt="x", extra_body={"spind": {"drafter": "nope"}})
    # the README's call: auto with k = 4, and what the response reports about the drafters that served it
    readme = client.chat.completions.create(model="spind", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"spind": {"drafter": "auto", "k": 4}})
    assert readme.choices[0].message.content == refs["chat"].text
    report = readme.model_extra["spind"]
    assert set(report) == {"drafters", "time_slots", "mean_accepted_length"} and report["time_slots"] >= 1
    assert all(set(n) == {"drafted", "accepted"} and n["accepted"] <= n["drafted"] for n in report["drafters"].values())
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="spind", messages=CHAT, extra_body={"spind": {"drafter": "ngram", "k": 0}})
    assert refused.value.body["param"] == "spind.k" and "k = 0 drafts no tokens" in refused.value.body["message"]


def test_the_readme_openai_snippet_runs_as_written(daemon: Daemon, capsys: pytest.CaptureFixture):
    """The README's openai-client lines, run as written against this daemon (its port in place of 8000): they print
    the reply and the `spind` object saying which drafters served it, and auto's reply is plain decoding's."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "from openai import OpenAI" in b)
    assert snippet.count("http://localhost:8000/v1") == 1
    names: dict = {}
    exec(snippet.replace("http://localhost:8000/v1", daemon.url + "/v1"), names)  # the README's own lines
    r, printed = names["r"], capsys.readouterr().out
    report = r.model_extra["spind"]
    assert printed == f"{r.choices[0].message.content}\n{report}\n" and r.choices[0].message.content.strip()
    assert set(report) == {"drafters", "time_slots", "mean_accepted_length"} and report["time_slots"] >= 1
    assert set(report["drafters"]) == {"int8"}  # this module's config: auto is fixed:int8, here at the snippet's k 4
    assert 0 <= report["drafters"]["int8"]["accepted"] <= report["drafters"]["int8"]["drafted"]
    client = names["client"]
    plain = client.chat.completions.create(model="spind", messages=[{"role": "user", "content":
                                                                    "Write a haiku about the sea."}],
                                           temperature=0, max_tokens=64, extra_body={"spind": {"drafter": "none"}})
    assert plain.choices[0].message.content == r.choices[0].message.content
    assert plain.model_extra["spind"]["drafters"] == {}


def test_logit_bias_through_the_openai_client_and_zmq(daemon: Daemon, refs: dict[str, Reference]):
    """A banned token (-100) never appears, and speculation keeps the biased output exact: the same text with and
    without a drafter, over HTTP (the unmodified openai client) and ZeroMQ (token ids)."""
    ref = refs[PROMPTS[1]]
    banned = ref.token_ids[0]
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    texts = [client.completions.create(model="spind", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       logit_bias={str(banned): -100}, extra_body={"spind": spind}).choices[0].text
             for spind in ({"drafter": "none"}, {"drafter": "ngram", "k": 3}, {"drafter": "int8", "k": 4})]
    assert texts[0] != ref.text and texts[1] == texts[0] and texts[2] == texts[0]
    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        done = c.complete(PROMPTS[1], max_tokens=MAX_TOKENS, drafter="ngram", logit_bias={banned: -100.0})
        assert banned not in done.token_ids and done.text == texts[0]
        with pytest.raises(SpindError) as e:
            c.complete(PROMPTS[1], max_tokens=2, logit_bias={10**6: 1.0})  # beyond the vocabulary
        assert e.value.status == 400 and "vocabulary" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="spind", prompt="x", max_tokens=1, logit_bias={"1": 101})


def _close(got: list[float], want: list[float]) -> bool:
    return got == pytest.approx(want, abs=1e-4)


def test_logprobs_through_the_openai_client_and_zmq(daemon: Daemon, refs: dict[str, Reference]):
    """Each output token's log-probability and its best alternatives, through the unmodified openai client (chat and
    completions, streamed and not) and ZeroMQ: the target's values, the same under every drafter."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    chats = [client.chat.completions.create(model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body={"spind": spind}).choices[0]
             for spind in ({"drafter": "none"}, {"drafter": "ngram", "k": 3}, {"drafter": "int8", "k": 4})]
    plain = chats[0].logprobs.content
    assert chats[0].message.content == refs["chat"].text and len(plain) == len(refs["chat"].token_ids)
    assert b"".join(bytes(t.bytes) for t in plain).decode() == refs["chat"].text
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in plain)
    for choice in chats[1:]:
        got = choice.logprobs.content
        assert [t.token for t in got] == [t.token for t in plain]
        assert _close([t.logprob for t in got], [t.logprob for t in plain])
        assert [[a.token for a in t.top_logprobs] for t in got] == [[a.token for a in t.top_logprobs] for t in plain]
    streamed = [t for chunk in client.chat.completions.create(
        model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3,
        stream=True, extra_body={"spind": {"drafter": "ngram"}}) if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in plain]
    assert _close([t.logprob for t in streamed], [t.logprob for t in plain])

    ref = refs[PROMPTS[1]]
    texts = [client.completions.create(model="spind", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=2, extra_body={"spind": spind}).choices[0]
             for spind in ({"drafter": "none"}, {"drafter": "ngram", "k": 3})]
    for choice in texts:
        lp = choice.logprobs
        assert choice.text == ref.text and len(lp.tokens) == len(ref.token_ids)
        assert _close(lp.token_logprobs, texts[0].logprobs.token_logprobs)
        assert all(len(top) in (2, 3) and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        done = c.complete(PROMPTS[1], max_tokens=MAX_TOKENS, drafter="int8", logprobs=2)
        assert done.token_ids == ref.token_ids and [t.chosen.token_id for t in done.logprobs] == ref.token_ids
        assert _close([t.chosen.logprob for t in done.logprobs], texts[0].logprobs.token_logprobs)
        assert c.complete(PROMPTS[1], max_tokens=2).logprobs is None
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="spind", messages=CHAT, max_tokens=1, **bad)


def test_n_completions_through_the_openai_client(daemon: Daemon, refs: dict[str, Reference]):
    """n choices of one prompt (sharing its prefilled KV): greedy, n copies of the plain output; sampled and seeded,
    reproducible; streamed, each choice's chunks by index; usage counts the prompt once."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    ref = refs[PROMPTS[1]]
    greedy = client.completions.create(model="spind", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, n=4,
                                       extra_body={"spind": {"drafter": "ngram"}})
    assert [(c.index, c.text) for c in greedy.choices] == [(i, ref.text) for i in range(4)]
    assert greedy.usage.prompt_tokens == len(ref.prompt_ids)
    assert greedy.usage.completion_tokens == 4 * len(ref.token_ids)

    # Seeded sampling repeats exactly when the drafts do: the draft is sampled from the drafter's probabilities,
    # which the int8 drafter's torch kernels compute differently (in the last bits) in batches of other sizes, so
    # this uses the batch-invariant q16 self-draft (the three choices batch differently from run to run).
    def sampled() -> list[str]:
        out = client.chat.completions.create(model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0,
                                             seed=3, n=3, extra_body={"spind": {"drafter": "q16", "k": 3}})
        return [c.message.content for c in out.choices]
    first = sampled()
    assert sampled() == first and len(set(first)) >= 2
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in client.chat.completions.create(model="spind", messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0,
                                                seed=3, n=3, stream=True, stream_options={"include_usage": True},
                                                extra_body={"spind": {"drafter": "q16", "k": 3}}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert texts == first and finished == {0, 1, 2}
    assert usage.completion_tokens >= 3 and usage.prompt_tokens == len(refs["chat"].prompt_ids)
    status, metrics = 0, ""
    with urllib.request.urlopen(daemon.url + "/metrics") as resp:
        status, metrics = resp.status, resp.read().decode()
    shared = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("spind_shared_prompt_tokens_total"))
    assert status == 200 and shared >= 3 * (len(ref.prompt_ids) - 1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="spind", prompt="x", max_tokens=1, n=129)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Reply in JSON with name, age and city: Ana Lima is 31 and lives in Porto."}]


def test_structured_output_through_the_openai_client(daemon: Daemon):
    """response_format json_schema: 60 sampled requests at once, every output parses and validates; greedy output is
    the same under every drafter; json_object and spind's regex; bad grammars are 400s."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def sampled() -> list:
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*[client.chat.completions.create(
                model="spind", messages=EXTRACT, max_tokens=120, temperature=1.0, seed=i, response_format=fmt,
                extra_body={"spind": {"drafter": ("auto", "ngram", "int8", "none")[i % 4]}}) for i in range(60)])
        finally:
            await client.close()
    outs = run(sampled())
    for out in outs:
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    greedy = [client.chat.completions.create(
        model="spind", messages=EXTRACT, max_tokens=80, temperature=0, response_format=fmt,
        extra_body={"spind": spind}).choices[0].message.content
        for spind in ({"drafter": "none"}, {"drafter": "ngram", "k": 4}, {"drafter": "int8", "k": 4})]
    assert greedy[1] == greedy[0] and greedy[2] == greedy[0] and json.loads(greedy[0])["city"]
    anything = client.chat.completions.create(model="spind", messages=EXTRACT, max_tokens=80, temperature=0,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    regex = client.completions.create(model="spind", prompt="Is Paris in France? Answer:", max_tokens=8,
                                      temperature=0, extra_body={"spind": {"regex": "(Yes|No)[.!]"}})
    assert regex.choices[0].text in ("Yes.", "Yes!", "No.", "No!")
    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        done = c.complete(messages=EXTRACT, max_tokens=80, drafter="ngram",
                          grammar=Grammar("json_schema", json.dumps(PERSON)))
        assert done.text == greedy[0]
        with pytest.raises(SpindError) as e:
            c.complete(PROMPTS[0], max_tokens=4, grammar=Grammar("regex", "(unclosed"))
        assert e.value.status == 400 and "regex does not compile" in str(e.value)
    for bad in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                {"response_format": {"type": "xml"}}, {"extra_body": {"spind": {"regex": "(unclosed"}}},
                {"extra_body": {"spind": {"grammar": "root ::= ???"}}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="spind", messages=EXTRACT, max_tokens=4, **bad)


def test_zmq_clients(daemon: Daemon, refs: dict[str, Reference]):
    ref = refs[PROMPTS[2]]
    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        done = c.complete(PROMPTS[2], max_tokens=MAX_TOKENS, drafter="int8")
        assert done.token_ids == ref.token_ids and done.text == ref.text and done.finish_reason == ref.finish_reason
        assert done.usage.completion_tokens == len(ref.token_ids) and done.usage.num_steps >= 1
        assert "".join(c.stream(ref.prompt_ids, max_tokens=MAX_TOKENS, drafter="ngram")) == ref.text
        assert c.generate(messages=CHAT, max_tokens=MAX_TOKENS) == refs["chat"].text
        with pytest.raises(SpindError) as e:
            c.generate(PROMPTS[2], drafter="nope")
        assert (e.value.status, e.value.param) == (400, "spind.drafter")  # named as the HTTP API names it
        with pytest.raises(SpindError) as e:
            c.generate(PROMPTS[2], drafter="ngram", k=0)
        assert (e.value.status, e.value.param) == (400, "spind.k") and "k = 0 drafts no tokens" in str(e.value)
        with pytest.raises(SpindError) as e:
            c.generate(list(range(1, 1100)), max_tokens=4)
        assert e.value.status == 413

    async def concurrent():
        async with AsyncSpindClient(daemon.zmq_address, timeout_s=120) as a:
            texts = await asyncio.gather(*[a.generate(p, max_tokens=MAX_TOKENS) for p in PROMPTS])
            assert texts == [refs[p].text for p in PROMPTS]
            assert "".join([t async for t in a.stream(PROMPTS[3], max_tokens=MAX_TOKENS)]) == refs[PROMPTS[3]].text
    run(concurrent())


def test_16_concurrent_streaming_clients(daemon: Daemon, refs: dict[str, Reference]):
    drafters = ("auto", "ngram", "none", "int8")

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "spind": {"drafter": drafters[i // 4]}}
        return prompt, stream_text(await stream(s, "/v1/completions", body), is_chat=False)

    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            return await asyncio.gather(*[one(s, i) for i in range(16)])
    results = run(check())
    assert [text for _, text in results] == [refs[p].text for p, _ in results]
    daemon.wait_no_requests()


def stream_and_kill(daemon: Daemon, drafter: str, pids: list[int]) -> list[str]:
    """PROMPTS streamed at once (odd ones decoding plainly, the others with `drafter`); `pids` SIGKILLed as soon as
    a plain-decoding request has streamed text. Returns each completion's text, with the stream's [DONE] checked."""
    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            async def one(i: int, started: asyncio.Event) -> str:
                body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                        "spind": {"drafter": "none" if i % 2 else drafter}}
                async with s.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    events = []
                    async for raw in resp.content:
                        if raw.startswith(b"data: {") and b'"text":""' not in raw:
                            started.set()
                        events.append(raw.decode())
                    return "".join(events)

            flags = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(one(i, f)) for i, f in enumerate(flags)]
            await asyncio.wait_for(flags[1].wait(), 120)  # a plain-decoding request is under way
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 600)
    texts = []
    for raw in run(check()):
        events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
    return texts


def test_worker_sigkill_mid_generation_changes_nothing(daemon: Daemon, refs: dict[str, Reference]):
    before = daemon.worker_pids()
    assert stream_and_kill(daemon, "int8", list(before.values())) == [refs[p].text for p in PROMPTS]
    with SpindClient(daemon.zmq_address, timeout_s=300) as c:  # uses (and so restarts) every worker
        assert c.generate(PROMPTS[0], max_tokens=MAX_TOKENS, drafter="int8") == refs[PROMPTS[0]].text
    after = daemon.state()["workers"]
    assert all(w["alive"] and w["restarts"] >= 1 and w["pid"] != before[w["name"]] for w in after), after


def test_a_killed_tensor_parallel_rank_restarts_the_group_and_changes_nothing(daemon: Daemon,
                                                                              refs: dict[str, Reference]):
    if not target_ranks(daemon):
        pytest.skip("the target is one process in this layout")
    assert target_ranks(daemon) == ["cpu", "cpu"]
    target_pid = daemon.worker_pids()["target"]
    (rank1,) = child_pids(target_pid)
    restarts = next(w["restarts"] for w in daemon.state()["workers"] if w["name"] == "target")
    # rank 1 only: rank 0, the worker the coordinator talks to, lives on until its next collective finds it gone
    assert stream_and_kill(daemon, "ngram", [rank1]) == [refs[p].text for p in PROMPTS]
    (target,) = [w for w in daemon.state()["workers"] if w["name"] == "target"]
    assert target["alive"] and target["restarts"] == restarts + 1 and target["pid"] != target_pid
    (new_rank1,) = child_pids(target["pid"])
    assert new_rank1 != rank1 and not os.path.exists(f"/proc/{target_pid}")


def test_fuzzed_http_bodies_get_errors_and_the_daemon_keeps_serving(daemon: Daemon, refs: dict[str, Reference]):
    cases = malformed_http_bodies(random.Random(0))
    assert len(cases) >= 200

    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            for path, body in cases:
                status, out = await post(s, path, body)
                assert status in (400, 404, 413), (path, body[:200], status, out)
                assert set(out["error"]) == {"message", "type", "param", "code"}
                assert "Traceback" not in out["error"]["message"]
            status, out = await post(s, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                            "temperature": 0})
            assert status == 200 and out["choices"][0]["text"] == refs[PROMPTS[0]].text
    run(check())
    daemon.wait_no_requests()
    assert "Traceback" not in daemon.log.read_text()


def malformed_http_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """Bodies that are each wrong in one way, for both endpoints: bad fields, bad JSON, truncations, noise."""
    bad_fields = {
        "model": [1, "nope", [], {}], "max_tokens": [0, -1, "1", 1.5, True, 10**9], "temperature": ["x", -1, 1e9, []],
        "top_p": [0, 2, "x", -0.5], "top_k": [1.5, "x", -2], "seed": ["x", 1.5, 2**70], "n": [129, 0, "1"],
        "stop": [1, [1], [""], ["a"] * 20, {"a": 1}], "stream": ["yes", 1], "stream_options": [{"include_usage": 1}],
        "spind": ["x", {"drafter": "nope"}, {"drafter": 1}, {"k": -1}, {"k": "2"}, {"k": 100}, {"z": 1}],
        "logprobs": [21, "x", -1], "top_logprobs": [2, 21], "echo": [True], "best_of": [2], "presence_penalty": [1.0],
        "logit_bias": [{"x": 5}, {"1": 500}, {"1": "a"}, [1], {"99999999": 1}, {"-1": 1}, {"1": True}]}
    bad_inputs = {"/v1/completions": ("prompt", ["", [], 5, [1.5], [-1], ["a", "b"], {"x": 1}, True, [10**12],
                                                 list(range(1, 1100))]),
                  "/v1/chat/completions": ("messages", [
                      [], "hi", [{"role": "user"}], [{"content": "x"}], [1], [{"role": "tool", "content": "x"}],
                      [{"role": 1, "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]])}
    cases = []
    for path, (field, bad_values) in bad_inputs.items():
        valid = {field: PROMPTS[0] if field == "prompt" else CHAT, "max_tokens": 4}
        cases += [(path, json.dumps({**valid, field: v}).encode()) for v in bad_values]
        cases += [(path, json.dumps({**valid, name: v}).encode()) for name, vs in bad_fields.items() for v in vs]
        whole = json.dumps({**valid, "temperature": 0, "stop": ["\n"], "spind": {"drafter": "ngram"}}).encode()
        cases += [(path, whole[:rng.randrange(len(whole))]) for _ in range(15)]
        cases += [(path, b) for b in (b"", b"null", b"[]", b"42", b'"s"', b"[" * 50_000, b"{" * 10, b"\xff\xfe{}",
                                      b'{"prompt": NaN}', b"x" * (1 << 20 | 1))]
        for _ in range(40):
            noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            try:
                json.loads(noise)
            except ValueError:
                cases.append((path, noise))
    return cases


def test_fuzzed_zmq_frames_get_errors_and_the_daemon_keeps_serving(daemon: Daemon, refs: dict[str, Reference]):
    frames = malformed_zmq_frames(random.Random(1))
    assert len(frames) >= 200
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.zmq_address)
    try:
        for parts in frames:
            sock.send_multipart(parts)
            assert sock.poll(30_000), parts
            reply = P.decode(sock.recv_multipart()[-1], P.ClientOut)
            assert isinstance(reply, P.ClientError) and reply.status in (400, 413), (parts, reply)
            assert not sock.poll(0)  # exactly one answer per frame
        sock.send(b"x" * (2 << 20))  # over the frame limit: ZeroMQ drops this connection, the daemon lives on
    finally:
        sock.close(0)
        ctx.term()
    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        assert c.generate(PROMPTS[0], max_tokens=MAX_TOKENS) == refs[PROMPTS[0]].text
    daemon.wait_no_requests()
    assert "Traceback" not in daemon.log.read_text()


def malformed_zmq_frames(rng: random.Random) -> list[list[bytes]]:
    valid = make_request(PROMPTS[0], max_tokens=4, drafter="ngram")
    whole = P.encode(valid)
    version, fields = msgspec.msgpack.decode(whole)
    pack = msgspec.msgpack.encode
    frames: list[bytes] = [b"", whole[:1], pack([]), pack({"a": 1}), pack([version]), pack([version + 1, fields]),
                           pack([version, {**fields, "type": "nope"}]), pack([version, []]),
                           pack([version, {**fields, "extra": 1}]), P.encode(P.Ping(1)), P.encode(P.Shutdown(1)),
                           P.encode(P.FreeRequests(1, ["x"]))]
    frames += [whole[:rng.randrange(1, len(whole))] for _ in range(60)]
    frames += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(100)]
    wrong_types = {"req_id": [1, None, b"x", ""], "params": [1, "x", {"max_tokens": "4"}, {"temperature": "hot"},
                                                             {"stop": "x"}, {"seed": 1.5}, {"bogus": 1}],
                   "prompt": [1, ["x"]], "prompt_ids": ["x", [1.5], [None]], "messages": ["x", [1], [{"role": 1}]],
                   "drafter": [1, None], "k": ["2", 1.5], "stream": [1, "yes"]}
    for name, values in wrong_types.items():
        for v in values:
            if name == "params" and isinstance(v, dict):
                v = {**fields["params"], **v}
            frames.append(pack([version, {**fields, name: v}]))

    def variant(**changes) -> bytes:
        return P.encode(msgspec.structs.replace(make_request(PROMPTS[0], max_tokens=4), **changes))

    frames += [variant(drafter="nope"), variant(k=99), variant(prompt=""), variant(prompt=None),
               variant(prompt_ids=[1, 2]), variant(prompt=None, prompt_ids=[]),
               variant(prompt=None, prompt_ids=list(range(1, 1100))), variant(prompt=None, messages=[]),
               variant(prompt=None, messages=[P.ChatMessage("tool", "x")]),
               variant(params=SamplingParams(max_tokens=0)), variant(params=SamplingParams(temperature=-1.0)),
               variant(params=SamplingParams(max_tokens=4, top_p=0.0)), variant(params=SamplingParams(top_k=-3)),
               variant(params=SamplingParams(stop=("",))), variant(params=SamplingParams(max_tokens=10**6)),
               variant(drafter="")]
    frames += [pack([version, {**fields, "k": -1}]), pack([version, {**fields, "prompt": None, "prompt_ids": [-5]}])]
    out = [[f] for f in frames]
    out += [[whole, whole], [b"", b"x"], [whole, b""], [b"a", b"b", b"c"]] * 3
    return out


def test_metrics_state_and_models(daemon: Daemon):
    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            async with s.get("/metrics") as resp:
                assert resp.status == 200 and resp.content_type == "text/plain"
                text = await resp.text()
            async with s.get("/v1/models") as resp:
                models = await resp.json()
        return text, models
    text, models = run(check())
    assert "# TYPE spind_generation_tokens_total counter" in text
    finished = [line for line in text.splitlines() if line.startswith('spind_requests_total{status="length"}')]
    assert finished and float(finished[0].split()[-1]) > 0
    assert models["data"][0]["id"] == "spind" and models["data"][0]["max_model_len"] == 1024
    state = daemon.state()
    assert {w["name"] for w in state["workers"]} == {"target", "draft"} and state["api"]["status"] == "ok"
    assert state["drafters"]["int8"]["drafted"] > 0


def test_reset_cache_forgets_the_answers_suffix_decoding_drafts_from(daemon: Daemon):
    """A finished request's sequence joins suffix decoding's shared cache, so the same prompt again is drafted from
    its answer; POST /v1/spind/reset_cache forgets it (what `spind bench serve` does between drafters' rows), and the
    output stays the same throughout."""
    body = {"prompt": PROMPTS[2], "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "spind": {"drafter": "suffix"}}

    async def check():
        async with aiohttp.ClientSession(daemon.url) as s:
            async def reset() -> None:
                async with s.post("/v1/spind/reset_cache") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "ok"

            async def accepted() -> tuple[str, float]:
                status, out = await post(s, "/v1/completions", body)
                assert status == 200, out
                await asyncio.sleep(0.5)  # the worker takes a finished sequence into the cache between ops
                return out["choices"][0]["text"], out["spind"]["mean_accepted_length"]

            await reset()  # earlier tests sent this prompt too
            cold = await accepted()
            warm = await accepted()
            await reset()
            again = await accepted()
            async with s.get("/v1/spind/reset_cache") as resp:
                assert resp.status == 405
            return cold, warm, again

    (cold_text, cold), (warm_text, warm), (again_text, again) = run(check())
    assert cold_text == warm_text == again_text
    assert warm > cold + 1.0 and again < warm - 1.0, (cold, warm, again)


def test_client_disconnect_frees_its_request(daemon: Daemon):
    async def http_disconnect() -> str:
        async with aiohttp.ClientSession(daemon.url) as s:
            body = {"prompt": PROMPTS[2], "max_tokens": 512, "ignore_eos": True, "stream": True,
                    "spind": {"drafter": "none"}}
            resp = await s.post("/v1/completions", json=body)
            async for raw in resp.content:
                if raw.startswith(b"data: {"):
                    req_id = json.loads(raw[len(b"data: "):])["id"]
                    break
            assert req_id in [r["req_id"] for r in daemon.state()["requests"]]
            resp.close()  # drop the connection mid-stream
            return req_id
    req_id = run(http_disconnect())
    state = daemon.wait_no_requests(timeout_s=30)
    assert req_id not in [r["req_id"] for r in state["requests"]]

    with SpindClient(daemon.zmq_address, timeout_s=120) as c:
        pieces = c.stream(PROMPTS[2], max_tokens=512, ignore_eos=True, drafter="none")
        assert next(pieces)
        assert len(daemon.state()["requests"]) == 1
        pieces.close()  # sends ClientAbort
        daemon.wait_no_requests(timeout_s=30)


def test_status_cli_reports_the_running_daemon(daemon: Daemon):
    out = subprocess.run([sys.executable, "-m", "spind.cli", "status", "--config", str(daemon.config)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"pid {daemon.proc.pid}" in out.stdout and "worker target: alive" in out.stdout
    assert "selection: fixed:int8" in out.stdout
    if target_ranks(daemon):
        assert "cpu + cpu (tensor parallel)" in out.stdout


def _detach(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spind.cli", "start", "--detach", "--timeout", "120", *args],
                          capture_output=True, text=True, timeout=300)


def test_detach_reports_the_daemons_own_error_when_the_run_dir_is_taken(daemon: Daemon):
    """The new daemon exits at once (a daemon already uses the run dir); the old one still answers /health,
    and --detach must not take that answer for its own."""
    out = _detach("--config", str(daemon.config), "--port", str(free_port()), "--zmq-port", str(free_port()))
    assert out.returncode == 1, out
    assert f"a spind daemon (pid {daemon.proc.pid}) already uses run dir" in out.stderr
    assert "spind serving" not in out.stdout
    assert http_json(daemon.url + "/health")[1]["pid"] == daemon.proc.pid  # the old one serves on


def test_detach_reports_a_taken_port(daemon: Daemon, tmp_path):
    out = _detach("--config", str(daemon.config), "--run-dir", str(tmp_path / "run"), "--port", str(daemon.port),
                  "--zmq-port", str(free_port()))
    assert out.returncode == 1, out
    assert f"cannot serve HTTP on 127.0.0.1:{daemon.port}" in out.stderr


def test_sigterm_drains_in_flight_requests_then_exits_0(daemon: Daemon):
    # last in this module: it stops the module's shared daemon
    async def check() -> dict:
        async with aiohttp.ClientSession(daemon.url) as s:
            body = {"prompt": PROMPTS[0], "max_tokens": 48, "ignore_eos": True, "stream": True,
                    "spind": {"drafter": "none"}}
            async with s.post("/v1/completions", json=body) as resp:
                events = []
                async for raw in resp.content:
                    if raw.startswith(b"data: "):
                        events.append(raw[len(b"data: "):].strip().decode())
                        if len(events) == 1:
                            daemon.proc.send_signal(signal.SIGTERM)
                            await asyncio.sleep(0.5)
                            status, out = await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1})
                            assert status == 503 and out["error"]["code"] == "draining", out
                            async with s.get("/health") as health:
                                assert health.status == 503
            assert events[-1] == "[DONE]"
            return json.loads(events[-2])
    last = run(check())
    assert last["choices"][0]["finish_reason"] == "length"
    assert daemon.proc.wait(120) == 0
    assert not (daemon.run_dir / "spind.pid").exists()
    out = subprocess.run([sys.executable, "-m", "spind.cli", "status", "--config", str(daemon.config)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not running" in out.stdout
