"""Greedy speculative decoding is lossless, and requests stop where plain decoding would.

With an fp32 target, the committed tokens are the target's argmax whatever the drafter proposes, so
every drafter at every k must reproduce plain decoding token for token. The batch mixes prompts of
4 to ~290 tokens, so one slot carries prefill chunks, first tokens, decode rows and verify rows together.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

import pytest
import torch

from conftest import SMALL_DRAFTER_LAYERS, generate, make_requests, new_req_id
from spind.config import DrafterConfig
from spind.drafters.model import common_prefix
from spind.coordinator.interface import EngineError, EngineRequest
from spind.coordinator.transport.local import GenRequest, GenResult, LocalEngine
from spind.coordinator.request import Sequence
from spind.models.runner import ForwardItem
from spind.worker.target import VerifyItem
from spind.tokenizer import Tokenizer
from spind.params import Grammar, SamplingParams

KS = (1, 4, 8)
SHORT_REQUEST = 2  # index of the request whose max_tokens (3) ends it in the middle of a k >= 4 draft


def batch_params(num: int) -> list[SamplingParams]:
    """Greedy; max_tokens from 24 to 32 but one of 3; every other request ignores EOS."""
    return [SamplingParams(max_tokens=3 if i == SHORT_REQUEST else 24 + 4 * (i % 3), ignore_eos=i % 2 == 1)
            for i in range(num)]


@pytest.fixture(scope="module")
def plain(engine: LocalEngine, prompt_ids: list[list[int]]) -> list[GenResult]:
    return generate(engine, prompt_ids, None, 0, batch_params(len(prompt_ids)))


def lossless_errors(results: list[GenResult], plain: list[GenResult]) -> list[str]:
    """What differs between one drafter's outputs and plain decoding of the same prompts ([] = lossless)."""
    errors = []
    for got, want in zip(results, plain, strict=True):
        at = common_prefix(got.token_ids, want.token_ids)
        if got.token_ids != want.token_ids:
            errors.append(f"{got.drafter}: {got.req_id} diverges from plain decoding at output token {at}: "
                          f"{got.token_ids[at:at + 4]} vs {want.token_ids[at:at + 4]}")
        elif (got.text, got.finish_reason) != (want.text, want.finish_reason):
            errors.append(f"{got.drafter}: {got.req_id} same tokens, but text/finish_reason differ")
        if got.num_accepted > got.num_drafted or len(got.token_ids) > got.num_accepted + got.num_steps:
            errors.append(f"{got.drafter}: {got.req_id} inconsistent stats {got.to_json()}")
    # speculation really happened, or the comparison proves nothing
    if not sum(r.num_accepted for r in results):
        errors.append(f"{results[0].drafter}: no draft accepted ({sum(r.num_drafted for r in results)} drafted)")
    return errors


def test_plain_batch_is_varied(plain: list[GenResult], prompt_ids: list[list[int]]) -> None:
    lengths = sorted(map(len, prompt_ids))
    assert len(prompt_ids) >= 8 and lengths[0] < 10 and lengths[-1] > 250
    assert len(plain[SHORT_REQUEST].token_ids) == 3 and plain[SHORT_REQUEST].finish_reason == "length"
    assert all(len(r.token_ids) > 0 and r.num_drafted == 0 for r in plain)


@pytest.mark.parametrize("k", KS)
def test_greedy_speculation_is_lossless_for_every_drafter(engine: LocalEngine, prompt_ids: list[list[int]],
                                                          plain: list[GenResult], k: int) -> None:
    """Every configured drafter at once, in ONE batch: each drafts for its own copy of the prompts."""
    drafters = list(engine.drafters)
    assert drafters == [d.name for d in engine.cfg.drafters] and drafters
    params = batch_params(len(prompt_ids))
    requests = [r for name in drafters for r in make_requests(prompt_ids, name, k, params)]
    results = engine.generate(requests, max_batch=len(requests))
    n = len(prompt_ids)
    errors = [e for i in range(len(drafters)) for e in lossless_errors(results[i * n:(i + 1) * n], plain)]
    assert not errors, "\n".join(errors)


# Prompts of 4, ~50, ~120 and ~290 tokens (one cut at 3 tokens) for the two drafters built here, each of
# which costs about as much per draft token as the target itself.
EXTRA_DRAFTER_PROMPTS = [0, SHORT_REQUEST, 5, 8]


def _check_extra_drafter(engine: LocalEngine, dc: DrafterConfig, prompt_ids: list[list[int]],
                         plain: list[GenResult]) -> dict:
    """A fresh engine with only this drafter (the shared one is left as it was): lossless on a few prompts.
    Returns what the drafter's model looks like."""
    rt = LocalEngine.load(dataclasses.replace(engine.cfg, drafters=(dc,)))
    try:
        prompts = [prompt_ids[i] for i in EXTRA_DRAFTER_PROMPTS]
        params = [batch_params(len(prompt_ids))[i] for i in EXTRA_DRAFTER_PROMPTS]
        errors = lossless_errors(generate(rt, prompts, dc.name, 4, params), [plain[i] for i in EXTRA_DRAFTER_PROMPTS])
        assert not errors, "\n".join(errors)
        drafter = rt.drafter(dc.name)
        return {"kind": drafter.kind, "num_layers": len(drafter.runner.model.layers)}
    finally:
        rt.close()


def test_layer_subset_self_draft_is_lossless(engine: LocalEngine, model_dir: Path, prompt_ids: list[list[int]],
                                             plain: list[GenResult]) -> None:
    layers = tuple(i for i in range(30) if i not in (14, 15, 16))
    dc = DrafterConfig(name="layers", kind="self", variant="layers", layers=layers)
    assert _check_extra_drafter(engine, dc, prompt_ids, plain)["num_layers"] == 27


def test_separate_model_drafter_is_lossless(engine: LocalEngine, model_dir: Path, small_drafter_dir: Path,
                                            prompt_ids: list[list[int]], plain: list[GenResult]) -> None:
    dc = DrafterConfig(name="small", kind="model", path=str(small_drafter_dir))
    assert _check_extra_drafter(engine, dc, prompt_ids, plain) == {"kind": "model", "num_layers": SMALL_DRAFTER_LAYERS}


# ---- stop rules: Sequence.append on exact token lists -------------------------------------------------

EOS = 2


def _sequence(max_tokens: int = 32, max_model_len: int = 64, ignore_eos: bool = False) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence("s", [10, 11, 12], params, frozenset({EOS}), max_model_len, None)


def test_eos_mid_draft_ends_the_output() -> None:
    seq = _sequence()
    assert seq.append([5, 6, EOS, 7]) == [5, 6]
    assert seq.output_ids == [5, 6] and seq.finish_reason == "stop"


def test_ignore_eos_keeps_going() -> None:
    seq = _sequence(ignore_eos=True)
    assert seq.append([5, EOS, 7]) == [5, EOS, 7] and not seq.is_finished


def test_max_tokens_mid_draft() -> None:
    seq = _sequence(max_tokens=4)
    seq.append([5])
    assert seq.max_draft(8) == 2  # 3 tokens left: 2 drafts + the bonus
    assert seq.append([6, 7, 8, 9]) == [6, 7, 8]
    assert seq.output_ids == [5, 6, 7, 8] and seq.finish_reason == "length"


def test_context_limit_mid_draft() -> None:
    seq = _sequence(max_model_len=5)  # 3 prompt tokens: room for 2
    assert seq.max_draft(8) == 2
    assert seq.append([5, 6, 7]) == [5, 6] and seq.finish_reason == "length"


def test_stop_string_cuts_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is Paris. It is big.")
    seq = Sequence("s", [1], SamplingParams(stop=("Paris", "never")), frozenset({EOS}), 64, tokenizer)
    seq.append(ids)
    assert seq.text == "The capital of France is " and seq.finish_reason == "stop"


# ---- stop rules end to end: speculative output stops where plain decoding does ----------------------

@pytest.fixture(scope="module")
def capital_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat([{"role": "user", "content": "What is the capital of France?"}])


def _plain_and_speculative(engine: LocalEngine, prompt: list[int], params: SamplingParams) -> list[GenResult]:
    return engine.generate([GenRequest(new_req_id("plain"), prompt, params, None, 0),
                             GenRequest(new_req_id("int8"), prompt, params, "int8", 8)])


def test_eos_ends_speculative_output_like_plain(engine: LocalEngine, capital_prompt: list[int]) -> None:
    plain_res, spec = _plain_and_speculative(engine, capital_prompt, SamplingParams(max_tokens=32))
    assert plain_res.finish_reason == spec.finish_reason == "stop"
    assert spec.token_ids == plain_res.token_ids and EOS not in spec.token_ids
    assert len(spec.token_ids) < 32 and spec.num_steps < len(spec.token_ids)  # several tokens per step


def test_eos_inside_an_accepted_draft_ends_the_output(engine: LocalEngine, capital_prompt: list[int]) -> None:
    """The target accepts a draft through EOS and beyond; the sequence keeps only what precedes EOS."""
    plain_res = _plain_and_speculative(engine, capital_prompt, SamplingParams(max_tokens=32))[0]
    answer = plain_res.token_ids
    rid = new_req_id("eos")
    seq = Sequence(rid, capital_prompt + answer[:-2], SamplingParams(max_tokens=32), engine.tokenizer.eos_token_ids,
                   engine.max_model_len, engine.tokenizer)
    engine.target.add_request(rid, seq.token_ids, seq.params)
    try:
        out = engine.target.verify([VerifyItem(rid, answer[-2:] + [EOS, answer[0]])])[0]
    finally:
        engine.target.free_request(rid)
    assert out.num_accepted >= 3 and out.tokens[:3] == answer[-2:] + [EOS]  # EOS accepted mid-draft
    assert seq.append(out.tokens) == answer[-2:]
    assert seq.finish_reason == "stop" and seq.output_ids == answer[-2:]


def test_stop_string_mid_draft_cuts_the_text(engine: LocalEngine, capital_prompt: list[int]) -> None:
    plain_res, spec = _plain_and_speculative(engine, capital_prompt, SamplingParams(max_tokens=32, stop=("France",)))
    assert spec.text == plain_res.text == "The capital of "
    assert spec.finish_reason == plain_res.finish_reason == "stop"


def test_stop_string_mid_draft_keeps_the_tokens_plain_decoding_keeps(engine: LocalEngine,
                                                                     capital_prompt: list[int]) -> None:
    plain_res, spec = _plain_and_speculative(engine, capital_prompt, SamplingParams(max_tokens=32, stop=("France",)))
    assert spec.token_ids == plain_res.token_ids


def test_logit_bias_bans_a_token_and_speculation_stays_lossless(engine: LocalEngine, capital_prompt: list[int]) -> None:
    """OpenAI's logit_bias on the target's distribution: a -100 bias bans the plain output's second token, a +5
    one lifts another; every drafter (n-gram drafts ignore the bias, the self-drafts apply it) then gives exactly
    the biased plain output, in one batch."""
    unbiased = engine.generate([GenRequest(new_req_id("plain"), capital_prompt, SamplingParams(max_tokens=24),
                                           None, 0)])[0]
    banned = unbiased.token_ids[1]
    params = SamplingParams(max_tokens=24, logit_bias=((banned, -100.0), (13, 5.0))).validate()
    requests = [GenRequest(new_req_id("plain"), capital_prompt, params, None, 0),
                *(GenRequest(new_req_id(name), capital_prompt, params, name, 4) for name in engine.drafters)]
    plain_res, *spec = engine.generate(requests, max_batch=len(requests))
    assert banned not in plain_res.token_ids and plain_res.token_ids != unbiased.token_ids
    for name, res in zip(engine.drafters, spec):
        assert res.token_ids == plain_res.token_ids, name
    assert any(res.num_accepted > 0 for res in spec)  # the drafts were used, not all rejected


def test_a_model_drafter_keeps_only_the_bias_ids_it_can_score(engine: LocalEngine) -> None:
    """The bias only steers a drafter's drafts: ids past its logits (a drafter model with fewer rows than the
    target's) are dropped for it, not left to fail its batched argmax for every request it drafts for."""
    drafter = engine.drafter("int8")
    vocab = drafter.runner.model.args.vocab_size
    drafter.add_request("bias-trim", SamplingParams(logit_bias=((3, 1.0), (vocab + 5, 2.0))).validate())
    try:
        assert drafter.params["bias-trim"].logit_bias == ((3, 1.0),)
    finally:
        drafter.free_request("bias-trim")


# ---- logprobs: the target's own values, whatever drafted ------------------------------------------------------

LOGPROB_PROMPTS = [0, 3, 5]  # a short chat prompt, a longer one, a passage to copy (where drafts are accepted)


def _teacher_forced(engine: LocalEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's raw log-softmax at every output position, from one forward over prompt + output (no speculation,
    no decoding steps): what each output token's logprob must be. [len(output), V]"""
    runner, rid = engine.target.runner, new_req_id("teacher")
    runner.add_request(rid)
    try:
        logits = runner.forward([ForwardItem(rid, prompt + output[:-1], len(output))])[0]
    finally:
        runner.free_request(rid)
    return logits.double().log_softmax(-1)


def _check_logprobs(engine: LocalEngine, prompt: list[int], res: GenResult, num_top: int) -> None:
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids)
    ref = _teacher_forced(engine, prompt, res.token_ids)
    for j, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.chosen.token_id == tok and lp.chosen.token_bytes == engine.tokenizer.token_bytes(tok)
        assert lp.chosen.logprob == pytest.approx(float(ref[j, tok]), abs=1e-4), (res.drafter, j)
        assert len(lp.top) == num_top
        assert [a.logprob for a in lp.top] == pytest.approx(ref[j][[a.token_id for a in lp.top]].tolist(), abs=1e-4)
        assert lp.top[0].logprob == pytest.approx(float(ref[j].max()), abs=1e-4)  # best first
        assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:]))


def test_greedy_logprobs_equal_plain_decodings_under_every_drafter(engine: LocalEngine,
                                                                   prompt_ids: list[list[int]]) -> None:
    """Plain decoding and every drafter in one batch: the same tokens, the same logprobs (fp32 tolerance), and both
    equal to one teacher-forced forward of the output."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=4)
    prompts = [prompt_ids[i] for i in LOGPROB_PROMPTS]
    runs = [None, *engine.drafters]
    requests = [GenRequest(new_req_id(str(d)), p, params, d, 4) for d in runs for p in prompts]
    results = engine.generate(requests, max_batch=len(requests))
    n = len(prompts)
    plain_results = results[:n]
    for i, d in enumerate(runs):
        for prompt, res, plain_res in zip(prompts, results[i * n:(i + 1) * n], plain_results):
            assert res.token_ids == plain_res.token_ids, d
            for got, want in zip(res.logprobs, plain_res.logprobs):
                assert got.chosen.logprob == pytest.approx(want.chosen.logprob, abs=1e-4), d
                assert [a.token_id for a in got.top] == [a.token_id for a in want.top], d
            _check_logprobs(engine, prompt, res, 4)
    assert sum(r.num_accepted for r in results[n:]) > 0


def test_sampled_logprobs_are_the_targets_under_every_drafter(engine: LocalEngine,
                                                              prompt_ids: list[list[int]]) -> None:
    """Sampled (with logit_bias, temperature and top-p, which the logprobs do not include): each drafter's
    output differs, and each token's logprob is the target's raw value at its position."""
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=2,
                            logit_bias=((13, 2.0),)).validate()
    prompt = prompt_ids[5]
    runs = [None, *engine.drafters]
    results = engine.generate([GenRequest(new_req_id(str(d)), prompt, params, d, 4) for d in runs],
                              max_batch=len(runs))
    for res in results:
        _check_logprobs(engine, prompt, res, 2)
    assert sum(r.num_accepted for r in results) > 0


def test_no_logprobs_unless_asked(engine: LocalEngine, capital_prompt: list[int]) -> None:
    res = engine.generate([GenRequest(new_req_id("plain"), capital_prompt, SamplingParams(max_tokens=4), "ngram", 4),
                           GenRequest(new_req_id("plain"), capital_prompt, SamplingParams(max_tokens=4, logprobs=0),
                                      None, 0)])
    assert res[0].logprobs is None
    assert [lp.top for lp in res[1].logprobs] == [[]] * 4


# ---- n > 1: completions of one prompt share its prefilled KV ----------------------------------------------------

def _generate_n(engine: LocalEngine, prompt: list[int], params: SamplingParams, n: int, drafter: str = "none",
                k: int | None = None) -> list[GenResult]:
    """One request of n completions through the coordinator: each choice's tokens, logprobs and finish reason."""
    async def run() -> list[GenResult]:
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        reasons: list[str] = [""] * n
        async for d in engine.coordinator.generate(EngineRequest(new_req_id("n"), prompt, params, drafter, k, n)):
            tokens[d.index] += d.token_ids
            logprobs[d.index] += d.logprobs or []
            reasons[d.index] = d.finish_reason or reasons[d.index]
        return [GenResult(req_id=str(i), text="", token_ids=t, finish_reason=r, drafter=drafter,
                          num_prompt_tokens=len(prompt), num_steps=0, num_drafted=0, num_accepted=0, elapsed_s=0.0,
                          logprobs=lp if params.logprobs is not None else None)
                for i, (t, lp, r) in enumerate(zip(tokens, logprobs, reasons))]
    return engine.loop.run_until_complete(run())


def _free_target_blocks(engine: LocalEngine) -> int:
    """Once the target worker has done what it was sent (its ops run in order): its free KV blocks."""
    stats = engine.loop.run_until_complete(engine.coordinator.worker_stats("target"))
    return stats.kv["target"].num_free_blocks


def _shared_tokens(engine: LocalEngine) -> float:
    return engine.coordinator.phases.metrics.shared_prompt_tokens._value.get()


def test_greedy_n_gives_n_copies_of_plain_decoding_from_one_prefill(engine: LocalEngine,
                                                                     prompt_ids: list[list[int]]) -> None:
    prompt = prompt_ids[5]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain_res = engine.generate([GenRequest(new_req_id("plain"), prompt, params, None, 0)])[0]
    free = _free_target_blocks(engine)
    for drafter in ("none", "ngram"):
        shared = _shared_tokens(engine)
        choices = _generate_n(engine, prompt, params, 4, drafter, 4)
        assert [c.token_ids for c in choices] == [plain_res.token_ids] * 4, drafter
        assert _shared_tokens(engine) - shared == 3 * (len(prompt) - 1)  # three choices never prefilled it
    assert _free_target_blocks(engine) == free  # every shared block went back


def test_sampled_n_choices_differ_are_seeded_and_each_is_the_targets(engine: LocalEngine,
                                                                      prompt_ids: list[list[int]]) -> None:
    """Copy on write keeps each choice's KV its own: every choice's logprobs equal a teacher-forced forward of its
    own output. Seeded: the same choices again, and choice 0 is the n = 1 output (with the same drafter: speculative
    sampling is exact in distribution, but which random draws it consumes depends on the drafts)."""
    prompt = prompt_ids[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=1)
    choices = _generate_n(engine, prompt, params, 4, "int8", 3)
    assert len({tuple(c.token_ids) for c in choices}) >= 3
    for c in choices:
        _check_logprobs(engine, prompt, c, 1)
    again = _generate_n(engine, prompt, params, 4, "int8", 3)
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]
    single = engine.generate([GenRequest(new_req_id("one"), prompt, params, "int8", 3)])[0]
    assert single.token_ids == choices[0].token_ids


def test_n_is_checked(engine: LocalEngine, capital_prompt: list[int]) -> None:
    for n in (0, 129, 1.5):
        with pytest.raises(EngineError, match=r"n must be an integer in \[1, 128\]"):
            engine.coordinator.generate(EngineRequest(new_req_id("n"), capital_prompt, SamplingParams(), n=n))


# ---- structured output: a grammar on the target's distribution, drafts cut where it refuses them --------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def extract_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat([{"role": "user", "content": "Reply in JSON with name, age and city: John Smith is 42 "
                                                             "and lives in Paris, where he moved in 2010."}])


def _plain_under_grammar(engine: LocalEngine, prompt: list[int], grammar: Grammar, max_tokens: int) -> list[int]:
    """Greedy decoding one token per forward, each the argmax of the target's logits masked by a fresh llguidance
    matcher: the reference, built apart from the verifier's code."""
    import llguidance

    from spind.grammar import to_llguidance

    tok = engine.tokenizer
    vocab = engine.target.runner.model.args.vocab_size
    lltok = llguidance.LLTokenizer(engine.tokenizer.tk.to_str(), n_vocab=vocab, eos_token=sorted(tok.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, to_llguidance(grammar), log_level=0)
    runner, rid, out = engine.target.runner, new_req_id("ref"), []
    runner.add_request(rid)
    try:
        step = prompt
        for _ in range(max_tokens):
            logits = runner.forward([ForwardItem(rid, step, 1)])[0][0]
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab].astype(bool))
            allowed[[i for i in range(vocab) if lltok.is_special_token(i) and i not in tok.eos_token_ids]] = False
            nxt = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            if nxt in tok.eos_token_ids:
                break
            assert matcher.consume_token(nxt)
            out.append(nxt)
            step = [nxt]
    finally:
        runner.free_request(rid)
    return out


def test_greedy_json_schema_output_is_plain_decoding_under_the_grammar_for_every_drafter(
        engine: LocalEngine, extract_prompt: list[int]) -> None:
    grammar = Grammar("json_schema", json.dumps(PERSON))
    want = _plain_under_grammar(engine, extract_prompt, grammar, 64)
    params = SamplingParams(max_tokens=64, grammar=grammar).validate()
    runs = [None, *engine.drafters]
    results = engine.generate([GenRequest(new_req_id(str(d)), extract_prompt, params, d, 4) for d in runs],
                              max_batch=len(runs))
    for d, res in zip(runs, results):
        assert res.token_ids == want, d
        assert res.finish_reason == "stop" and json.loads(res.text).keys() == PERSON["properties"].keys(), res.text
    assert sum(r.num_accepted for r in results) > 0


def test_sampled_json_schema_outputs_all_validate(engine: LocalEngine, extract_prompt: list[int]) -> None:
    import jsonschema

    grammar = Grammar("json_schema", json.dumps(PERSON))
    requests = [GenRequest(new_req_id(str(d)), extract_prompt,
                           SamplingParams(max_tokens=96, temperature=1.2, seed=i, grammar=grammar).validate(), d, 3)
                for i, d in enumerate([None, *engine.drafters] * 3)]
    for res in engine.generate(requests, max_batch=len(requests)):
        assert res.finish_reason == "stop", res.text
        jsonschema.validate(json.loads(res.text), PERSON)


def test_a_regex_and_a_gbnf_grammar_shape_the_output(engine: LocalEngine, extract_prompt: list[int]) -> None:
    regex = SamplingParams(max_tokens=24, grammar=Grammar("regex", r"(yes|no), [0-9]{2}")).validate()
    gbnf = SamplingParams(max_tokens=24, grammar=Grammar("grammar", 'root ::= "age=" [0-9]+ ";"')).validate()
    out = engine.generate([GenRequest(new_req_id("re"), extract_prompt, regex, "ngram", 4),
                           GenRequest(new_req_id("gbnf"), extract_prompt, gbnf, "int8", 4)])
    assert re.fullmatch(r"(yes|no), [0-9]{2}", out[0].text) and out[0].finish_reason == "stop"
    assert re.fullmatch(r"age=[0-9]+;", out[1].text) and out[1].finish_reason == "stop"


def test_a_re_prefilled_request_resumes_its_grammar_where_it_was(engine: LocalEngine,
                                                                 extract_prompt: list[int]) -> None:
    """After a worker restart the target re-adds a request from its committed sequence: the grammar is advanced past
    the output so far (AddRequest.num_output), so the continuation is the one it would have had."""
    grammar = Grammar("json_schema", json.dumps(PERSON))
    params = SamplingParams(max_tokens=64, grammar=grammar).validate()
    want = engine.generate([GenRequest(new_req_id("whole"), extract_prompt, params, None, 0)])[0].token_ids
    target, rid, done = engine.target, new_req_id("resumed"), want[:9]
    target.add_request(rid, extract_prompt + done, params, num_output=len(done))
    try:
        target.prefill([(rid, len(extract_prompt) + len(done) - 1)])
        while len(done) < len(want) + 1:
            done += target.verify([VerifyItem(rid, [])])[0].tokens
    finally:
        target.free_request(rid)
    assert done[:len(want)] == want and done[len(want)] in engine.tokenizer.eos_token_ids
