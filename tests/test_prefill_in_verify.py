"""A slot's prefill chunks riding in its verify's forward (`TargetVerifier.prefill_and_verify`, `Verify.prefill`): the
real default target computes what a prefill op then a verify op compute, bit for bit, reuses the prefix cache as the
prefill op would, and a verify that fails leaves its chunks unwritten."""

from __future__ import annotations

import pytest
import torch

from conftest import new_req_id
from spind.coordinator.transport.local import LocalEngine
from spind.models.runner import ForwardItem
from spind.params import SamplingParams
from spind.worker.target import RequestFailed, TargetVerifier, VerifyItem

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture
def target(engine: LocalEngine) -> TargetVerifier:
    t = engine.target
    t.reset_prefix_cache()
    yield t
    t.reset_prefix_cache()


def _requests(target: TargetVerifier, prompts: list[list[int]], tag: str) -> dict[str, str]:
    """d: prompt 0 prefilled, decoding; b: prompt 1, about to prefill its first half; c: prompt 2, about to prefill
    all of it and verify its first token. Returns their req_ids."""
    ids = {name: new_req_id(f"{tag}-{name}") for name in "dbc"}
    for name, prompt in zip("dbc", prompts):
        target.add_request(ids[name], prompt, GREEDY)
    target.prefill([(ids["d"], len(prompts[0]) - 1)])
    return ids


def _next_logits(target: TargetVerifier, req_ids: list[str]) -> list[torch.Tensor]:
    """Each request's logits for its pending tokens (its KV as it is, rolled back after)."""
    runner = target.runner
    lengths = {r: runner.length(r) for r in req_ids}
    out = runner.forward([ForwardItem(r, list(target.pending[r]), 1) for r in req_ids])
    for r, n in lengths.items():
        runner.truncate(r, n)
    return out


def _run(target: TargetVerifier, prompts: list[list[int]], fused: bool, tag: str):
    ids = _requests(target, prompts, tag)
    d, b, c = ids["d"], ids["b"], ids["c"]
    chunks = [(b, len(prompts[1]) // 2), (c, len(prompts[2]) - 1)]
    items = [VerifyItem(d, prompts[0][:3]), VerifyItem(c, [])]
    try:
        if fused:
            reused, outs = target.prefill_and_verify(chunks, items)
        else:
            reused, outs = target.prefill(chunks), target.verify(items)
        assert [target.runner.length(r) for r in (b, c)] == [chunks[0][1], len(prompts[2]) + len(outs[1].tokens) - 1]
        return reused, [(o.num_accepted, o.tokens) for o in outs], _next_logits(target, [d, b, c])
    finally:
        for r in ids.values():
            target.free_request(r)
        target.reset_prefix_cache()


def test_prefill_chunks_in_a_verify_compute_what_the_two_ops_compute(target: TargetVerifier,
                                                                      prompt_ids: list[list[int]]) -> None:
    prompts = [prompt_ids[0], prompt_ids[4], prompt_ids[2]]
    apart = _run(target, prompts, fused=False, tag="apart")
    fused = _run(target, prompts, fused=True, tag="fused")
    assert fused[0] == apart[0] == [0, 0]
    assert fused[1] == apart[1]
    assert all(torch.equal(x, y) for x, y in zip(fused[2], apart[2]))  # the KV each wrote, read by the next step


def test_prefill_chunks_in_a_verify_reuse_the_prefix_cache_as_a_prefill_op(target: TargetVerifier,
                                                                            prompt_ids: list[list[int]]) -> None:
    """A prompt another request prefilled: its first chunk takes the cached blocks, and computes only the rest."""
    prompt = prompt_ids[4]
    results = []
    for fused in (False, True):
        first = new_req_id("publisher")
        target.add_request(first, prompt, GREEDY)
        target.prefill([(first, len(prompt) - 1)])
        target.free_request(first)  # publishes its KV's full blocks
        d, again = new_req_id("d"), new_req_id("again")
        target.add_request(d, prompt_ids[0], GREEDY)
        target.prefill([(d, len(prompt_ids[0]) - 1)])
        target.add_request(again, prompt, GREEDY)
        chunks, items = [(again, len(prompt) - 1)], [VerifyItem(d, []), VerifyItem(again, [])]
        try:
            if fused:
                reused, outs = target.prefill_and_verify(chunks, items)
            else:
                reused, outs = target.prefill(chunks), target.verify(items)
            results.append((reused, [o.tokens for o in outs], _next_logits(target, [d, again])))
        finally:
            target.free_request(d)
            target.free_request(again)
            target.reset_prefix_cache()
    (reused_apart, tokens_apart, logits_apart), (reused_fused, tokens_fused, logits_fused) = results
    assert reused_fused == reused_apart and reused_apart[0] >= 16  # whole blocks of the prompt came from the cache
    assert tokens_fused == tokens_apart
    assert all(torch.equal(x, y) for x, y in zip(logits_fused, logits_apart))


def test_a_verify_that_fails_leaves_its_prefill_chunks_unwritten(target: TargetVerifier,
                                                                   prompt_ids: list[list[int]]) -> None:
    prompts = [prompt_ids[0], prompt_ids[4], prompt_ids[2]]
    ids = _requests(target, prompts, "failing")
    d, b, c = ids["d"], ids["b"], ids["c"]
    bad = new_req_id("bad")
    target.add_request(bad, prompt_ids[1], SamplingParams(temperature=1.0, max_tokens=8))
    target.prefill([(bad, len(prompt_ids[1]) - 1)])
    before = {r: (target.runner.length(r), list(target.pending[r])) for r in (d, b, c, bad)}
    chunks = [(b, len(prompts[1]) // 2), (c, len(prompts[2]) - 1)]
    wrong_q = torch.full((2, 7), 1 / 7)  # proposal rows of another vocabulary: this request's data fails
    try:
        with pytest.raises(RequestFailed) as failed:
            target.prefill_and_verify(chunks, [VerifyItem(d, []), VerifyItem(c, []),
                                               VerifyItem(bad, [5, 6], wrong_q)])
        assert failed.value.req_ids == [bad]
        assert {r: (target.runner.length(r), list(target.pending[r])) for r in before} == before
        assert b not in target.reused and c not in target.reused
        # the same ops without the culprit then run as they would have (the prefix cache looked up anew)
        reused, outs = target.prefill_and_verify(chunks, [VerifyItem(d, []), VerifyItem(c, [])])
        assert target.runner.length(b) == chunks[0][1] and target.runner.length(c) == len(prompts[2])
        assert len(outs) == 2 and target.reused[b] == 0 and target.pending[b] == prompts[1][chunks[0][1]:]
    finally:
        for r in (*ids.values(), bad):
            target.free_request(r)


def test_a_chunk_that_does_not_complete_a_verified_prompt_is_refused(target: TargetVerifier,
                                                                      prompt_ids: list[list[int]]) -> None:
    c = new_req_id("c")
    target.add_request(c, prompt_ids[2], GREEDY)
    try:
        with pytest.raises(ValueError, match="does not complete its prompt"):
            target.prefill_and_verify([(c, 3)], [VerifyItem(c, [])])
        assert target.runner.length(c) == 0 and target.pending[c] == prompt_ids[2]
    finally:
        target.free_request(c)


def test_a_worker_answers_a_verify_with_prefill_chunks_as_the_two_ops(cfg, prompt_ids: list[list[int]]) -> None:
    """Through the worker's protocol: the same results and reuse as a Prefill op then a Verify op, and its busy time
    split into a prefill part and a verify part (the verify's seconds are the latter)."""
    from spind import protocol as P
    from spind.worker.worker import Worker

    w = Worker("target", cfg)
    greedy = P.SamplingParams(temperature=0.0, max_tokens=16)
    replies = {}
    for tag, fused in (("apart", False), ("fused", True)):
        d, b = f"{tag}-d", f"{tag}-b"
        w.answer(P.AddRequest(1, d, prompt_ids[0], greedy, True))
        w.answer(P.AddRequest(2, b, prompt_ids[2], greedy, True))
        chunks = [P.PrefillItem(d, len(prompt_ids[0]) - 1), P.PrefillItem(b, len(prompt_ids[2]) - 1)]
        items = [P.VerifyItem(d, [], inline_drafter="ngram", k=3), P.VerifyItem(b, [])]
        if fused:
            reply = w.answer(P.Verify(3, 1, items, prefill=chunks))
        else:
            pre = w.answer(P.Prefill(3, chunks))
            assert isinstance(pre, P.Prefilled), pre
            reply = w.answer(P.Verify(4, 1, items))
            reply.reused = pre.reused
        assert isinstance(reply, P.Verified), reply
        replies[tag] = reply
        w.answer(P.FreeRequests(5, [d, b]))
        w.answer(P.ForgetFinished(6))
    apart, fused = replies["apart"], replies["fused"]
    assert [(r.num_accepted, r.tokens) for r in fused.results] == [(r.num_accepted, r.tokens) for r in apart.results]
    assert fused.reused == apart.reused
    (pre, ver), = [fused.busy[i:i + 2] for i in range(len(fused.busy) - 1) if fused.busy[i].kind == "prefill"]
    assert ver.kind == "verify" and pre.end == ver.start and pre.start < pre.end < ver.end
    assert fused.verify_s == pytest.approx(ver.end - ver.start)
