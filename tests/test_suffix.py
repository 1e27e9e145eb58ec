"""Suffix decoding (spind/drafters/suffix.py): the tries' counts, what a match drafts and how far, the shared
cache's eviction, and exactness through the engine. Pure CPU unit tests but the last (the tiny random model)."""

from __future__ import annotations

import random

import pytest

from spind.config import ConfigError, from_dict
from spind.drafters.base import DraftInput
from spind.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTrie
from spind.params import SamplingParams


def propose(drafter: SuffixDrafter, rid: str, tokens: list[int], k: int = 8) -> list[int]:
    if rid not in drafter.local:
        drafter.add_request(rid, SamplingParams())
    return drafter.propose([DraftInput(rid, tokens, k)])[0].tokens


def test_counts_and_continuations():
    trie = SuffixTrie(3)
    trie.insert([1, 2, 3, 1, 2, 4])
    n12 = trie.child(trie.child(0, 1), 2)
    assert trie.count[n12] == 2 and trie.succ[n12] == 2  # "1 2" occurred twice, followed by 3 and by 4
    assert trie.count[trie.child(n12, 3)] == trie.count[trie.child(n12, 4)] == 1
    assert trie.match([9, 1, 2]) == n12 and trie.match([7, 7]) == 0
    assert trie.count[0] == 6 and max(trie.depth) == 3  # nothing deeper than max_depth


def test_the_most_frequent_continuation_is_drafted_while_it_is_likely():
    trie = SuffixTrie(8)
    trie.insert([5, 6, 7, 8] * 3 + [5, 6, 9])
    node = trie.match([5, 6])
    tokens, score, confidence = trie.speculate(node, [5, 6], 8, factor=4.0, min_prob=0.1)
    # after "5 6": 7 three times in four (p 0.75), then 8, 5, 6 every time (the running product stays 0.75), then
    # "5 6 7 8 5 6" went on with 7 twice in three (0.5), ...
    assert tokens[:5] == [7, 8, 5, 6, 7]
    assert score == pytest.approx(4 * 0.75 + 0.5 + sum(0.5 * p for p in (1.0, 1.0, 1.0)[: len(tokens) - 5]))
    # the confidence counts one unseen continuation of weight 1 / depth: "5 6" (depth 2) went on 3 times in 4 + 0.5,
    # then "5 6 7" (3) went on with 8 three times in 3 + 1/3, ...
    assert confidence[:2] == pytest.approx([3 / 4.5, 3 / 4.5 * 3 / (3 + 1 / 3)]) and len(confidence) == len(tokens)
    assert all(a >= b for a, b in zip(confidence, confidence[1:])) and confidence[0] < 0.75
    # an ambiguous continuation stops the draft
    tokens, _, _ = trie.speculate(node, [5, 6], 8, factor=4.0, min_prob=0.8)
    assert tokens == []


def test_the_draft_length_follows_the_match_length():
    trie = SuffixTrie(16)
    text = list(range(100, 140))
    trie.insert(text)
    trie.insert([1])  # separate
    short = trie.speculate(trie.match([105]), [105], 16, factor=1.0, min_prob=0.0)[0]
    longer = trie.speculate(trie.match(text[:6]), text[:6], 16, factor=1.0, min_prob=0.0)[0]
    assert short == [106] and longer == text[6:12]


def test_a_walk_past_max_depth_continues_from_a_shorter_suffix():
    trie = SuffixTrie(4)
    text = list(range(200, 230))
    trie.insert(text)
    tokens, _, _ = trie.speculate(trie.match(text[:4]), text[:4], 12, factor=8.0, min_prob=0.0)
    assert tokens == text[4:16]


def paths(t: SuffixTrie) -> dict:
    """Every node as its token path -> (count, succ): two tries with equal paths hold the same counts."""
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        out[path] = (t.count[node], t.succ[node])
        for tok, kid in (t.children[node] or {}).items():
            stack.append((kid, path + (tok,)))
    return out


def test_remove_undoes_insert_exactly():
    rng = random.Random(0)
    a = [rng.randrange(6) for _ in range(300)]
    b = [rng.randrange(6) for _ in range(200)]
    ref = SuffixTrie(5)
    ref.insert(a)
    trie = SuffixTrie(5)
    trie.insert(a)
    trie.insert(b)
    trie.remove(b)

    assert paths(trie) == paths(ref) and trie.num_nodes == ref.num_nodes
    with pytest.raises(ValueError, match="not inserted"):
        SuffixTrie(3).remove([1, 2])


def test_the_shared_cache_evicts_the_oldest_past_its_budget():
    cache = SuffixCache(8, max_bytes=0)
    cache.add("a", [1, 2, 3])
    assert not cache.entries  # a zero budget keeps nothing
    cache = SuffixCache(8, max_bytes=10 ** 9)
    for i in range(5):
        cache.add(f"r{i}", list(range(i * 100, i * 100 + 50)))
    one = cache.approx_bytes // 5
    cache.max_bytes = 3 * one + one // 2
    cache.add("r5", list(range(500, 550)))
    assert list(cache.entries) == ["r3", "r4", "r5"] and cache.approx_bytes <= cache.max_bytes


def test_the_shared_cache_takes_a_sequence_in_parts_as_it_would_whole():
    text = [5, 1, 2, 3, 1, 2, 4, 1, 2, 3] * 7
    whole, parts = SuffixCache(6, max_bytes=10 ** 9), SuffixCache(6, max_bytes=10 ** 9)
    whole.add("a", text)
    steps = []
    while True:
        inserted, done = parts.add_part("a", text, 16)
        steps.append(inserted)
        if done:
            break
    assert steps == [16, 16, 16, 16, 6] and list(parts.entries) == ["a"]
    assert paths(parts.trie) == paths(whole.trie)
    # a sequence left half inserted is taken back when another one begins: the trie holds whole ones only
    other = [9, 8, 7, 9, 8]
    half = SuffixCache(6, max_bytes=10 ** 9)
    assert half.add_part("a", text, 20) == (20, False)
    half.add("b", other)
    ref = SuffixCache(6, max_bytes=10 ** 9)
    ref.add("b", other)
    assert paths(half.trie) == paths(ref.trie) and list(half.entries) == ["b"]


def test_a_request_drafts_from_its_own_text_and_from_finished_requests():
    d = SuffixDrafter("suffix", max_depth=16, cache_mb=8)
    answer = list(range(1000, 1030))
    # its own prompt: the answer quoted in the prompt is copied, as far as the match is long (5 tokens)
    assert propose(d, "a", [7, *answer, 8, *answer[:5]], 6) == answer[5:10]
    # nothing matches yet for a new text ...
    assert propose(d, "b", [9, 9, *answer[:5]][:3], 6) == []
    d.observe_finished("a", answer)  # its output (its prompt stays out of the shared cache)
    d.free_request("a")
    assert d.has_background_work and propose(d, "c0", [3, 4, *answer[:8]], 6) == []  # queued: not yet in the cache
    d.background_work(10)  # 10 of its 30 tokens: a chunk, not the whole sequence
    assert d.has_background_work and not d.cache.entries
    while d.has_background_work:
        d.background_work(10)
    assert list(d.cache.entries) == ["a"]
    # ... but a later request that starts the same answer gets it from the shared cache
    assert propose(d, "c", [3, 4, *answer[:8]], 6) == answer[8:14]


def test_a_replaced_assumed_token_rebuilds_the_requests_trie():
    d = SuffixDrafter("suffix", max_depth=8, cache_mb=0)
    text = [1, 2, 3, 4, 1, 2]
    assert propose(d, "r", text, 4) == [3, 4]
    # a draft-ahead assumed [3, 9] and the verify kept [5]: the sequence diverges from what the trie counted
    propose(d, "r", text + [3, 9], 4)
    assert propose(d, "r", text + [5, 1, 2], 4) == d.local["r"].trie.speculate(
        d.local["r"].deepest(), text + [5, 1, 2], 4, 1.0, 0.1)[0]
    assert d.local["r"].tokens == text + [5, 1, 2]


def test_a_requests_kept_shared_nodes_answer_as_a_match_from_scratch():
    """The shared trie's deepest continued suffix, followed token by token from the request's kept nodes, is what
    `match` finds from scratch: through the cache taking sequences in parts, evicting the oldest, and a request's
    assumed tokens replaced."""
    rng = random.Random(3)
    d = SuffixDrafter("suffix", max_depth=6, cache_mb=1)
    d.cache.max_bytes = 600 * 290  # room for two or three of the finished sequences below: the others are evicted
    text = [rng.randrange(12) for _ in range(60)]
    d.add_request("r", SamplingParams())
    seq, checked, most = [], 0, 0
    for step in range(400):
        seq = text[:1 + step % len(text)] if step % len(text) else text[:1]
        if step % 37 == 5:  # a finished sequence joins the cache (in parts: the trie changes between drafts)
            d.observe_finished(f"f{step}", [rng.randrange(12) for _ in range(40)] + seq[-8:])
        if d.has_background_work:
            d.background_work(16)
        tokens = seq + [rng.randrange(12)] if step % 11 == 3 else seq  # a draft-ahead's assumed token
        d.local["r"].sync(tokens)
        assert d._shared_node(d.local["r"], tokens) == d.cache.trie.match(tokens)
        checked += d.cache.trie.match(tokens) != 0
        most = max(most, len(d.cache.entries))
    assert checked > 50 and 2 <= most < 11  # matches were found; the cache held several, and evicted some


def test_config_checks_suffix_entries():
    cfg = from_dict({"drafters": [{"name": "s", "kind": "suffix", "worker": "target", "cache_mb": 16}]})
    assert cfg.drafter("s").cache_mb == 16
    with pytest.raises(ConfigError, match="max_depth >= 1"):
        from_dict({"drafters": [{"name": "s", "kind": "suffix", "max_depth": 0}]})


def test_suffix_drafts_through_the_engine_exactly_and_learns_across_requests(tmp_path):
    from tiny_model import write_tiny_checkpoint

    from spind.coordinator.transport.local import GenRequest, LocalEngine

    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    cfg = from_dict({
        "model": {"target": str(model_dir), "dtype": "float32", "max_model_len": 128, "cache_dir": str(tmp_path)},
        "runtime": {"attention": "packed", "kv_block_size": 16, "max_batch_size": 8, "profile": "off"},
        "speculation": {"k": 4}, "selection": {"policy": "lbss", "k_set": [2, 4]},
        "drafters": [{"name": "suffix", "kind": "suffix", "worker": "target"}],
        "workers": [{"name": "target", "device": "cpu"}]})
    prompts = [[3, 5, 7, 9, 3, 5, 7], [11, 13, 2, 8], [21, 22, 23, 24, 25, 26]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = LocalEngine.load(cfg)
    try:
        plain = engine.generate([GenRequest(f"p{i}", p, params) for i, p in enumerate(prompts)])
        for k in (1, 4, 8):  # the same prompts again: the cache holds plain decoding's answers now
            got = engine.generate([GenRequest(f"s{k}-{i}", p, params, "suffix", k) for i, p in enumerate(prompts)])
            assert [r.token_ids for r in got] == [r.token_ids for r in plain], k
            assert sum(r.num_accepted for r in got) >= 0.8 * sum(len(r.token_ids) - r.num_steps for r in got), k
    finally:
        engine.close()
