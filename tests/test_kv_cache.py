"""Paged KV cache: rollback correctness on the real model, and block accounting on a tiny pool."""

from __future__ import annotations

import pytest
import torch

from spind.coordinator.transport.local import LocalEngine
from spind.models.kv_cache import KVCache, KVCacheFullError
from spind.models.runner import ForwardItem, ModelRunner

BLOCK = 4


def _kv_rows(runner: ModelRunner, req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V of a request's written positions. # [layers, length, Hkv, D] each"""
    kv = runner.kv
    slots = kv.slots(req_id, 0, kv.length(req_id))
    return torch.stack([k[slots] for k in kv.k]), torch.stack([v[slots] for v in kv.v])


def test_rollback_then_reappend_equals_fresh_prefill(engine: LocalEngine, tokenizer) -> None:
    """A rejected draft that spilled into new blocks, rolled back, then a different continuation:
    the logits and every KV slot equal those of a request that never saw the rejected draft."""
    runner = ModelRunner(engine.target.runner.model, num_blocks=64, block_size=BLOCK)
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    rejected = tokenizer.encode(" it was bored and wanted to see what lay beyond")
    accepted = tokenizer.encode(" the dog")
    assert len(prompt) % BLOCK != 0 and len(rejected) > 2 * BLOCK  # the draft spans partial + whole blocks

    runner.add_request("rolled")
    runner.forward([ForwardItem("rolled", prompt)])
    free_before_draft = runner.kv.num_free_blocks
    runner.forward([ForwardItem("rolled", rejected)])
    runner.truncate("rolled", len(prompt))
    assert runner.kv.num_free_blocks == free_before_draft  # the draft's whole blocks came back
    rolled = runner.forward([ForwardItem("rolled", accepted, len(accepted))])[0]

    runner.add_request("fresh")
    runner.forward([ForwardItem("fresh", prompt)])  # the same forward shapes as "rolled" minus the draft
    fresh = runner.forward([ForwardItem("fresh", accepted, len(accepted))])[0]
    assert torch.equal(rolled, fresh)
    for a, b in zip(_kv_rows(runner, "rolled"), _kv_rows(runner, "fresh")):
        assert torch.equal(a, b)

    runner.add_request("oneshot")  # prompt + continuation in one prefill: other shapes, same numbers
    oneshot = runner.forward([ForwardItem("oneshot", prompt + accepted, len(accepted))])[0]
    torch.testing.assert_close(oneshot, rolled, atol=1e-4, rtol=1e-5)
    for a, b in zip(_kv_rows(runner, "rolled"), _kv_rows(runner, "oneshot")):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert runner.length("rolled") == runner.length("oneshot") == len(prompt) + len(accepted)


def _tiny(num_blocks: int = 4) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BLOCK,
                   dtype=torch.float32)


def test_can_allocate_counts_whole_blocks() -> None:
    kv = _tiny(num_blocks=4)
    assert kv.blocks_for(0) == 0 and kv.blocks_for(1) == 1 and kv.blocks_for(BLOCK) == 1
    assert kv.blocks_for(BLOCK + 1) == 2
    assert kv.can_allocate(4 * BLOCK) and not kv.can_allocate(4 * BLOCK + 1)


def test_reserve_truncate_free_return_blocks() -> None:
    kv = _tiny(num_blocks=4)
    kv.allocate("a")
    kv.reserve("a", 2 * BLOCK + 1)
    assert kv.num_free_blocks == 1 and len(kv.seqs["a"].block_table) == 3
    kv.seqs["a"].length = 2 * BLOCK + 1  # as a forward would record after writing
    kv.truncate("a", BLOCK)  # keeps exactly one block
    assert kv.num_free_blocks == 3 and kv.length("a") == BLOCK
    kv.truncate("a", BLOCK - 1)  # still inside block 0: nothing to free
    assert kv.num_free_blocks == 3
    kv.free("a")
    assert kv.num_free_blocks == 4 and not kv.has("a")
    kv.free("a")  # idempotent
    assert kv.num_free_blocks == 4


def test_reserve_past_capacity_raises_and_allocates_nothing() -> None:
    kv = _tiny(num_blocks=2)
    kv.allocate("a")
    with pytest.raises(KVCacheFullError, match="need 3 blocks, 2 free"):
        kv.reserve("a", 2 * BLOCK + 1)
    assert kv.num_free_blocks == 2 and kv.seqs["a"].block_table == []


def test_slots_follow_the_block_table() -> None:
    kv = _tiny(num_blocks=4)
    kv.allocate("a")
    kv.allocate("b")
    kv.reserve("a", BLOCK)  # block 0
    kv.reserve("b", BLOCK)  # block 1
    kv.reserve("a", BLOCK + 2)  # block 2: a's positions 4, 5 live there
    assert kv.slots("a", 0, BLOCK + 2).tolist() == [0, 1, 2, 3, 2 * BLOCK, 2 * BLOCK + 1]
    assert kv.slots("b", 1, 3).tolist() == [BLOCK + 1, BLOCK + 2]


def test_lifecycle_errors() -> None:
    kv = _tiny()
    kv.allocate("a")
    with pytest.raises(KeyError, match="already has KV"):
        kv.allocate("a")
    with pytest.raises(ValueError, match="truncate to 1 > length 0"):
        kv.truncate("a", 1)


def test_fork_shares_blocks_until_one_writes_and_frees_them_with_their_last_holder() -> None:
    kv = _tiny(num_blocks=6)
    kv.allocate("a")
    kv.reserve("a", BLOCK + 2)  # one whole block and a partial one
    kv.commit("a", BLOCK + 2)
    kv.k[0][:] = torch.arange(kv.k[0].numel(), dtype=torch.float32).view_as(kv.k[0])
    kv.fork("a", "b")
    assert kv.seqs["b"].block_table == kv.seqs["a"].block_table and kv.length("b") == BLOCK + 2
    assert kv.num_free_blocks == 4 and kv.num_shared_blocks("b") == 2
    assert torch.equal(kv.slots("b", 0, BLOCK + 2), kv.slots("a", 0, BLOCK + 2))
    before = kv.k[0][kv.slots("a", 0, BLOCK + 2)].clone()

    kv.reserve("b", BLOCK + 3)  # b writes position BLOCK + 2, in the shared partial block: b gets a copy
    kv.make_writable("b", BLOCK + 2, BLOCK + 3)
    assert kv.seqs["b"].block_table[0] == kv.seqs["a"].block_table[0]  # the whole block stays shared
    assert kv.seqs["b"].block_table[1] != kv.seqs["a"].block_table[1] and kv.num_free_blocks == 3
    assert torch.equal(kv.k[0][kv.slots("b", 0, BLOCK + 2)], before)  # the copy holds a's KV
    kv.k[0][kv.slots("b", BLOCK + 2, BLOCK + 3)] = -1.0
    assert torch.equal(kv.k[0][kv.slots("a", 0, BLOCK + 2)], before)  # a never sees b's write
    kv.make_writable("a", BLOCK + 2, BLOCK + 3)  # a's partial block is its own again: written in place
    assert kv.num_free_blocks == 3

    kv.free("a")  # the shared block stays for b
    assert kv.num_free_blocks == 4 and kv.num_shared_blocks("b") == 0
    kv.truncate("b", 0)
    assert kv.num_free_blocks == 6


def test_copy_on_write_needs_a_free_block() -> None:
    kv = _tiny(num_blocks=1)
    kv.allocate("a")
    kv.reserve("a", 2)
    kv.commit("a", 2)
    kv.fork("a", "b")
    with pytest.raises(KVCacheFullError, match="no block free"):
        kv.make_writable("b", 2, 3)


def test_runner_refuses_forward_past_the_pool(engine: LocalEngine) -> None:
    runner = ModelRunner(engine.target.runner.model, num_blocks=2, block_size=BLOCK)
    runner.add_request("a")
    assert not runner.can_append(2 * BLOCK + 1)
    with pytest.raises(KVCacheFullError):
        runner.forward([ForwardItem("a", list(range(1, 2 * BLOCK + 2)))])
    assert runner.length("a") == 0


def test_runner_refuses_forward_past_the_context_limit(engine: LocalEngine) -> None:
    runner = ModelRunner(engine.target.runner.model, num_blocks=8, block_size=BLOCK, max_model_len=16)
    runner.add_request("a")
    with pytest.raises(ValueError, match="exceed the context limit 16"):
        runner.forward([ForwardItem("a", list(range(1, 18)))])


# ---- the cache's dtype ([runtime].kv_cache_dtype) ---------------------------------------------------------------
def tiny_model(dtype: torch.dtype = torch.float32):
    from spind.models.layers import LlamaArgs
    from spind.models.llama import LlamaModel

    args = LlamaArgs(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=256, tie_word_embeddings=False,
                     attention_bias=False, bos_token_id=None, eos_token_ids=())
    torch.manual_seed(0)
    model = LlamaModel(args)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.to(dtype).eval()


def test_kv_dtype_auto_is_fp16_only_for_quantized_targets_where_the_cpu_kernel_reads_the_cache() -> None:
    from spind.kernels import cpu_ext
    from spind.models.runner import resolve_kv_dtype

    fp32, bf16, quantized = tiny_model(), tiny_model(torch.bfloat16), tiny_model()
    quantized.quantized = "gguf-q16"  # what quant.quantize_target marks: the policy reads only this
    kernel = cpu_ext.available() and cpu_ext.row_attention_supports(32)
    assert resolve_kv_dtype("auto", quantized, "invariant") == (torch.float16 if kernel else torch.float32)
    assert resolve_kv_dtype("auto", quantized, "packed") == torch.float32
    assert resolve_kv_dtype("auto", fp32, "invariant") == torch.float32  # a float model keeps reference numerics
    assert resolve_kv_dtype("auto", bf16, "invariant") == torch.bfloat16
    assert resolve_kv_dtype("float16", fp32, "packed") == torch.float16
    assert resolve_kv_dtype("float32", fp32, "invariant") == torch.float32
    with pytest.raises(ValueError, match="float32 models on CPU"):
        resolve_kv_dtype("float16", bf16, "packed")
    with pytest.raises(ValueError, match="needs a float32 model"):
        resolve_kv_dtype("float32", bf16, "packed")


@pytest.mark.parametrize("attention", ["invariant", "packed"])
def test_an_fp16_cache_serves_the_model_close_to_fp32(attention: str) -> None:
    """Written through the module path (an fp32 model's torch linears) and read by the row kernel or widened for
    `packed`; batch invariance on fp16 is the quantized target's test (test_quant_target.py)."""
    from spind.models.runner import ForwardItem, ModelRunner

    model = tiny_model()
    prompt, draft = [3, 9, 27, 17, 51, 1, 40, 22, 8, 13], [5, 60, 7]

    def verify(kv: str) -> tuple[torch.dtype, torch.Tensor]:
        runner = ModelRunner(model, 4, 16, attention, kv_cache_dtype=kv)
        runner.add_request("r")
        runner.forward([ForwardItem("r", prompt, 0)])
        return runner.kv.k[0].dtype, runner.forward([ForwardItem("r", draft, len(draft))])[0]

    (dtype16, rows16), (dtype32, rows32) = verify("float16"), verify("float32")
    assert (dtype16, dtype32) == (torch.float16, torch.float32)
    assert 0 < (rows16 - rows32).abs().max() < 1e-2 * rows32.abs().max()  # 11-bit K/V: close, not equal


# ---- prefix caching ---------------------------------------------------------------------------------------------
def _cached(num_blocks: int = 6) -> KVCache:
    kv = _tiny(num_blocks)
    kv.prefix_caching = True
    return kv


def _prefilled(kv: KVCache, req_id: str, tokens: list[int]) -> int:
    """What a target's prefill does: reuse what it can, write the rest, publish it all. Returns the reused count."""
    kv.allocate(req_id)
    reused = kv.reuse_prefix(req_id, tokens)
    kv.reserve(req_id, len(tokens))
    kv.make_writable(req_id, reused, len(tokens))
    kv.commit(req_id, len(tokens) - reused)
    kv.publish(req_id, tokens)
    return reused


def test_a_prompt_reuses_the_whole_blocks_of_its_longest_published_prefix() -> None:
    kv = _cached()
    a = list(range(1, 3 * BLOCK + 2))  # 3 whole blocks and a partial one
    assert _prefilled(kv, "a", a) == 0 and kv.num_cached_blocks == 3  # the partial block is not published
    b = a[:2 * BLOCK] + [99] * (BLOCK + 1)  # the first 2 blocks equal, then it differs
    assert _prefilled(kv, "b", b) == 2 * BLOCK
    assert kv.seqs["b"].block_table[:2] == kv.seqs["a"].block_table[:2]
    assert kv.seqs["b"].block_table[2] != kv.seqs["a"].block_table[2] and kv.num_shared_blocks("b") == 2
    # a block's content is its whole chain: the same tokens after a different first block match nothing
    kv.allocate("c")
    assert kv.reuse_prefix("c", [99] * BLOCK + a[BLOCK:2 * BLOCK] + [5]) == 0
    # never the last token: a prompt of exactly the cached blocks reuses all but the block holding it
    kv.allocate("d")
    assert kv.reuse_prefix("d", a[:2 * BLOCK]) == BLOCK
    with pytest.raises(ValueError, match="already has KV"):
        kv.reuse_prefix("d", a)


def test_without_prefix_caching_nothing_is_published_or_reused() -> None:
    kv = _tiny(num_blocks=6)
    a = list(range(1, 2 * BLOCK + 2))
    assert _prefilled(kv, "a", a) == 0 and kv.num_cached_blocks == 0
    assert _prefilled(kv, "b", a) == 0


def test_cached_blocks_count_as_free_and_are_evicted_least_recently_released_first() -> None:
    kv = _cached(num_blocks=4)
    a = list(range(1, 2 * BLOCK + 1))
    _prefilled(kv, "a", a)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2  # held by nobody, still cached
    kv.allocate("x")
    kv.reserve("x", 3 * BLOCK)  # takes the 2 free blocks, then evicts a's last block (released first)
    assert kv.num_cached_blocks == 1 and kv.num_free_blocks == 1  # the cached first block, still takeable
    kv.allocate("a2")
    assert kv.reuse_prefix("a2", a + [7]) == BLOCK  # the first block is still there
    kv.free("x")
    kv.free("a2")
    assert kv.num_free_blocks == 4


def test_a_copy_on_write_evicts_a_cached_block_when_no_block_is_free() -> None:
    kv = _cached(num_blocks=3)
    _prefilled(kv, "old", list(range(1, BLOCK + 2)))  # its whole first block is published
    kv.free("old")
    kv.allocate("a")
    kv.reserve("a", BLOCK + 2)  # the two free blocks; the cached one stays
    kv.commit("a", BLOCK + 2)
    kv.fork("a", "b")
    assert kv.num_free_blocks == kv.num_evictable_blocks == kv.num_cached_blocks == 1  # no block free but a cached one
    kv.make_writable("b", BLOCK + 2, BLOCK + 3)  # b writes into the partial block it shares: a copy of its own
    assert kv.seqs["b"].block_table[1] != kv.seqs["a"].block_table[1] and kv.num_cached_blocks == 0


def test_a_reused_block_is_copied_before_a_write_and_an_overwritten_one_leaves_the_cache() -> None:
    kv = _cached()
    a = list(range(1, 2 * BLOCK + 2))
    _prefilled(kv, "a", a)
    _prefilled(kv, "b", a)  # reuses both whole blocks
    kv.truncate("b", BLOCK)  # b rewrites its second block: a copy of its own, the cached one stays a's
    kv.reserve("b", 2 * BLOCK)
    kv.make_writable("b", BLOCK, 2 * BLOCK)
    assert kv.seqs["b"].block_table[1] != kv.seqs["a"].block_table[1] and kv.num_cached_blocks == 2
    kv.free("b")
    assert kv.num_cached_blocks == 2
    kv.truncate("a", 2)  # a alone holds its first block, cut inside it: rewriting it in place unpublishes it
    kv.reserve("a", 3)
    kv.make_writable("a", 2, 3)
    assert kv.num_cached_blocks == 1  # a's first block left the cache (its second, released, is still there)
    kv.allocate("c")
    assert kv.reuse_prefix("c", a) == 0  # the chain's head is gone: its second block, still cached, matches nothing


def test_reset_forgets_every_prefix_and_frees_what_no_sequence_holds() -> None:
    kv = _cached(num_blocks=4)
    a = list(range(1, 2 * BLOCK + 1))
    _prefilled(kv, "a", a)
    _prefilled(kv, "b", list(range(50, 50 + BLOCK + 1)))
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == kv.num_evictable_blocks == 0 and kv.num_free_blocks == 2
    kv.allocate("c")
    assert kv.reuse_prefix("c", a + [1]) == 0
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_evictable_blocks == kv.num_cached_blocks == 0  # b's went free


@pytest.mark.parametrize("chunk", [5, 64])
def test_a_prompt_on_a_reused_prefix_computes_the_same_bits_as_one_prefilled_whole(engine: LocalEngine, tokenizer,
                                                                                  chunk: int) -> None:
    """The real target (its configured attention: the CPU kernels are batch-invariant): a second prompt sharing the
    first's opening takes its whole blocks from the cache, in chunks smaller than the cached part too, and its
    verify logits and KV equal those of a target without the cache. The coordinator's chunks still count every
    prompt token; `prefill` says how many it skipped."""
    from spind.params import SamplingParams
    from spind.worker.target import TargetVerifier

    model, attention = engine.target.runner.model, engine.target.runner.attention
    system = tokenizer.encode("You are a careful assistant. Answer in one short sentence and name your source. " * 2)
    a = system + tokenizer.encode(" What is the capital of France?")
    b = system + tokenizer.encode(" Name three prime numbers.")
    draft = tokenizer.encode(" Two, three")
    expected = len(system) // 16 * 16
    assert expected >= 32

    def run(prefix_caching: bool) -> tuple[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        target = TargetVerifier(ModelRunner(model, 32, 16, attention, prefix_caching=prefix_caching))
        target.add_request("a", a, SamplingParams())
        assert target.prefill([("a", len(a) - 1)]) == [0]
        target.add_request("b", b, SamplingParams())
        reused, left = 0, len(b) - 1
        while left:
            n = min(chunk, left)
            reused += sum(target.prefill([("b", n)]))
            left -= n
        assert target.num_pending("b") == 1
        logits = target.runner.forward([ForwardItem("b", [b[-1], *draft], 1 + len(draft))])[0]
        return reused, logits, _kv_rows(target.runner, "b")

    (reused, logits, kv), (plain_reused, plain_logits, plain_kv) = run(True), run(False)
    assert (reused, plain_reused) == (expected, 0)
    assert torch.equal(logits, plain_logits)
    for got, want in zip(kv, plain_kv):
        assert torch.equal(got, want)


def test_the_next_turn_of_a_chat_reuses_the_answer_its_request_generated(engine: LocalEngine, tokenizer) -> None:
    """A finished request publishes its whole committed sequence, the answer too: a prompt that goes on from it
    (the next turn) prefills only what is new, with the bits of a target without the cache."""
    from spind.params import SamplingParams
    from spind.worker.target import TargetVerifier, VerifyItem

    model, attention = engine.target.runner.model, engine.target.runner.attention
    first = tokenizer.encode("Write one sentence about the sea, then one about the mountains.")

    def run(prefix_caching: bool) -> tuple[int, list[int], torch.Tensor]:
        target = TargetVerifier(ModelRunner(model, 32, 16, attention, prefix_caching=prefix_caching))
        target.add_request("turn1", first, SamplingParams())
        target.prefill([("turn1", len(first) - 1)])
        answer: list[int] = []
        while len(answer) < 24:
            answer += target.verify([VerifyItem("turn1", [])])[0].tokens
        target.free_request("turn1")
        second = first + answer + tokenizer.encode(" Now a third about the sky.")
        target.add_request("turn2", second, SamplingParams())
        reused = sum(target.prefill([("turn2", len(second) - 1)]))
        logits = target.runner.forward([ForwardItem("turn2", [second[-1]], 1)])[0]
        return reused, answer, logits

    (reused, answer, logits), (plain_reused, plain_answer, plain_logits) = run(True), run(False)
    assert answer == plain_answer and plain_reused == 0
    assert reused == (len(first) + len(answer) - 1) // 16 * 16 > len(first)  # the answer's blocks too
    assert torch.equal(logits, plain_logits)


def test_requests_admitted_together_reuse_what_the_first_prefilled_in_an_earlier_slot() -> None:
    """The lookup is at a request's first prefill chunk, not when it is added: of prompts that arrive together, the
    ones whose prefill starts after the first one's publish its blocks reuse them; ones in the same forward do not."""
    from spind.params import SamplingParams
    from spind.worker.target import TargetVerifier

    system = list(range(1, 33))  # two 16-token blocks
    target = TargetVerifier(ModelRunner(tiny_model(), 32, 16, "packed", prefix_caching=True))
    for r, tail in (("a", [40, 41]), ("b", [42, 43, 44]), ("c", [45, 46])):
        target.add_request(r, system + tail, SamplingParams())
    assert target.prefill([("a", 33)]) == [0]  # the first slot: only a's chunk
    assert target.prefill([("b", 34), ("c", 33)]) == [32, 32]  # the next slot: both take a's two blocks
    assert target.runner.kv.num_shared_blocks("b") == 2
