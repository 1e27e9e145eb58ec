"""Drafters: n-gram lookup, a model drafter's KV bookkeeping, how each kind is built, and the tokenizer check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear

from conftest import new_req_id, save_derived_checkpoint
from spind.config import DrafterConfig, SpindConfig
from spind.drafters import DraftInput, TokenizerMismatchError, build_drafter
from spind.drafters.model import ModelDrafter
from spind.drafters.ngram import NgramDrafter, lookup
from spind.coordinator.transport.local import GenRequest, LocalEngine
from spind.models.quant import Int8WeightOnlyLinear
from spind.models.runner import ForwardItem
from spind.tokenizer import Tokenizer
from spind.worker.sampling import SamplingParams, to_probs

# ---- n-gram lookup ---------------------------------------------------------------------------------


def test_ngram_prefers_the_longest_suffix_match() -> None:
    # suffix [1, 2, 3] occurs once (followed by 7); its shorter suffix [3] last occurred before 9
    tokens = [1, 2, 3, 7, 8, 3, 9, 5, 1, 2, 3]
    assert lookup(tokens, k=2, ngram_max=3, ngram_min=1) == [7, 8]
    assert lookup(tokens, k=2, ngram_max=1, ngram_min=1) == [9, 5]


def test_ngram_takes_the_most_recent_occurrence_and_stops_at_the_end() -> None:
    tokens = [4, 5, 6, 4, 5, 7, 4, 5]
    assert lookup(tokens, k=3, ngram_max=2, ngram_min=2) == [7, 4, 5]
    assert lookup(tokens, k=10, ngram_max=2, ngram_min=2) == [7, 4, 5]  # only what the sequence holds


def test_ngram_without_a_match_proposes_nothing() -> None:
    assert lookup([1, 2, 3, 4], k=4, ngram_max=3, ngram_min=1) == []
    assert lookup([1, 2, 1], k=4, ngram_max=3, ngram_min=2) == []  # a 1-gram match is below ngram_min
    assert lookup([5], k=4, ngram_max=3, ngram_min=1) == []


def test_ngram_drafter_is_a_point_mass_and_respects_k() -> None:
    drafter = NgramDrafter("ngram", ngram_max=3, ngram_min=1)
    drafts = drafter.propose([DraftInput("a", [1, 2, 3, 1, 2], 2), DraftInput("b", [1, 2, 3, 1, 2], 0)])
    assert drafts[0].tokens == [3, 1] and drafts[0].probs is None
    assert drafts[1].tokens == []
    assert drafter.ms_per_token is not None and drafter.describe()["kind"] == "ngram"


# ---- a model drafter's KV bookkeeping, with the fp32 target itself as the drafter -----------------------

@pytest.fixture(scope="module")
def target_as_drafter(engine: LocalEngine) -> ModelDrafter:
    """The fp32 target drafting for itself: its greedy drafts must be exactly the target's greedy output."""
    return ModelDrafter("self-fp32", "self", engine.target.runner.model, num_blocks=96, block_size=16)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat([{"role": "user", "content": "Name three rivers in Europe."}])


def _propose(drafter: ModelDrafter, req_id: str, tokens: list[int], k: int) -> list[int]:
    return drafter.propose([DraftInput(req_id, tokens, k)])[0].tokens


def test_self_draft_of_the_fp32_target_is_its_greedy_output(engine: LocalEngine, target_as_drafter: ModelDrafter,
                                                              chat_prompt: list[int]) -> None:
    rid = new_req_id("plain")
    plain = engine.generate([GenRequest(rid, chat_prompt, SamplingParams(max_tokens=6, ignore_eos=True))])[0]
    drafter, did = target_as_drafter, new_req_id("draft")
    drafter.add_request(did, SamplingParams())
    try:
        assert _propose(drafter, did, chat_prompt, 6) == plain.token_ids
        assert drafter.runner.length(did) == len(chat_prompt) + 5  # the last draft is never fed back
    finally:
        drafter.free_request(did)


def test_model_drafter_rolls_back_to_the_common_prefix(target_as_drafter: ModelDrafter,
                                                       chat_prompt: list[int]) -> None:
    """After a partial acceptance and a recovered token, drafts equal those of a fresh request."""
    drafter, rolled, fresh = target_as_drafter, new_req_id("rolled"), new_req_id("fresh")
    free_blocks = drafter.runner.kv.num_free_blocks
    for rid in (rolled, fresh):
        drafter.add_request(rid, SamplingParams())
    try:
        first = _propose(drafter, rolled, chat_prompt, 4)
        recovered = (first[2] + 1) % drafter.runner.model.args.vocab_size  # the target rejected draft 2
        committed = chat_prompt + first[:2] + [recovered]
        assert _propose(drafter, rolled, committed, 4) == _propose(drafter, fresh, committed, 4)
        assert drafter.synced[rolled] == drafter.synced[fresh]
    finally:
        for rid in (rolled, fresh):
            drafter.free_request(rid)
    assert drafter.runner.kv.num_free_blocks == free_blocks


def test_model_drafter_batch_equals_one_by_one(target_as_drafter: ModelDrafter, prompt_ids: list[list[int]]) -> None:
    drafter = target_as_drafter
    prompts = [prompt_ids[0], prompt_ids[4], prompt_ids[6]]  # 4, ~55 and ~95 tokens
    batch_ids, single_ids = [new_req_id("b") for _ in prompts], [new_req_id("s") for _ in prompts]
    for rid in batch_ids + single_ids:
        drafter.add_request(rid, SamplingParams())
    try:
        together = drafter.propose([DraftInput(r, p, 3) for r, p in zip(batch_ids, prompts)])
        alone = [_propose(drafter, r, p, 3) for r, p in zip(single_ids, prompts)]
    finally:
        for rid in batch_ids + single_ids:
            drafter.free_request(rid)
    assert [d.tokens for d in together] == alone


def test_model_drafter_never_drafts_past_the_context_limit(engine: LocalEngine, chat_prompt: list[int]) -> None:
    drafter = ModelDrafter("short", "self", engine.target.runner.model, num_blocks=16, block_size=16,
                           max_model_len=len(chat_prompt) + 2)
    drafter.add_request("a", SamplingParams())
    assert len(_propose(drafter, "a", chat_prompt, 8)) == 2
    assert _propose(drafter, "a", chat_prompt + [5, 6], 8) == []


def test_sampled_drafts_carry_their_distributions(engine: LocalEngine, chat_prompt: list[int]) -> None:
    """q rows are the drafter's own to_probs (temperature, top-k), and each drafted token is in its support."""
    drafter, params = engine.drafters["bf16"], SamplingParams(temperature=0.9, top_k=20, seed=3)
    rid, probe = new_req_id("sampled"), new_req_id("logits")
    drafter.add_request(rid, params)
    drafter.runner.add_request(probe)
    try:
        draft = drafter.propose([DraftInput(rid, chat_prompt, 4)])[0]
        first_row = drafter.runner.forward([ForwardItem(probe, chat_prompt)])[0]  # same forward as draft 0's
    finally:
        drafter.free_request(rid)
        drafter.runner.free_request(probe)
    assert draft.probs is not None and draft.probs.shape == (4, engine.tokenizer.vocab_size)
    torch.testing.assert_close(draft.probs[0], to_probs(first_row, params)[0])
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))


# ---- building each kind ------------------------------------------------------------------------------

def test_configured_drafters_are_built_as_configured(engine: LocalEngine) -> None:
    kinds = {name: d.kind for name, d in engine.drafters.items()}
    assert kinds == {d.name: d.kind for d in engine.cfg.drafters}
    int8, dyn8, bf16 = (engine.drafters[n].runner.model for n in ("int8", "dyn8", "bf16"))
    assert isinstance(int8.layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    assert isinstance(int8.lm_head, Int8WeightOnlyLinear)
    assert not any(type(m) is nn.Linear for m in dyn8.modules())
    assert isinstance(dyn8.lm_head, DynamicQuantLinear)
    assert bf16.dtype == torch.bfloat16 and engine.target.runner.model.dtype == torch.float32


def test_layer_subset_keeps_the_named_layers(engine: LocalEngine, cfg: SpindConfig, model_dir: Path) -> None:
    dc = DrafterConfig(name="l", kind="self", variant="layers", layers=(0, 29))
    model = build_drafter(dc, cfg, model_dir, engine.tokenizer).runner.model
    target = engine.target.runner.model
    assert len(model.layers) == 2
    kept, original = model.layers[1].mlp.down_proj.state_dict(), target.layers[29].mlp.down_proj.state_dict()
    assert kept.keys() == original.keys() and all(torch.equal(kept[k], original[k]) for k in kept)
    with pytest.raises(ValueError, match="out of range"):
        build_drafter(DrafterConfig(name="l", kind="self", variant="layers", layers=(30,)), cfg, model_dir,
                      engine.tokenizer)


# ---- a separate model must share the target's tokenizer ---------------------------------------------------

def test_drafter_with_another_vocabulary_size_is_refused(engine: LocalEngine, cfg: SpindConfig, model_dir: Path,
                                                         tmp_path: Path) -> None:
    path = save_derived_checkpoint(model_dir, tmp_path / "other-vocab", [0], vocab_size=49000)
    dc = DrafterConfig(name="other", kind="model", path=str(path))
    with pytest.raises(TokenizerMismatchError, match="'other': vocabulary size 49000 != target's 49152"):
        build_drafter(dc, cfg, model_dir, engine.tokenizer)


def _checkpoint_with_renumbered_tokens(model_dir: Path, dst: Path, renumber) -> Path:
    """A 1-layer drafter whose tokenizer.json maps tokens to ids through `renumber(token_id) -> id`."""
    path = save_derived_checkpoint(model_dir, dst, [0])
    tok_file = path / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    tok["model"]["vocab"] = {t: renumber(i) for t, i in tok["model"]["vocab"].items()}
    tok_file.write_text(json.dumps(tok))
    return path


def test_drafter_with_another_tokenizer_of_the_same_size_is_refused(engine: LocalEngine, cfg: SpindConfig, model_dir: Path,
                                                                    tmp_path: Path) -> None:
    num_special, top = 17, engine.tokenizer.vocab_size - 1  # ids 0..16 are the added special tokens
    # reverse the ids of every ordinary token: same size, same merges, a different meaning for each id
    path = _checkpoint_with_renumbered_tokens(model_dir, tmp_path / "reversed",
                                              lambda i: i if i < num_special else top + num_special - i)
    assert Tokenizer(path).vocab_size == engine.tokenizer.vocab_size
    dc = DrafterConfig(name="other", kind="model", path=str(path))
    with pytest.raises(TokenizerMismatchError, match="'other': its tokenizer differs from the target's"):
        build_drafter(dc, cfg, model_dir, engine.tokenizer)


def test_drafter_whose_tokenizer_swaps_two_ids_is_refused(engine: LocalEngine, cfg: SpindConfig, model_dir: Path,
                                                          tmp_path: Path) -> None:
    swap = {1001: 1002, 1002: 1001}
    path = _checkpoint_with_renumbered_tokens(model_dir, tmp_path / "swapped", lambda i: swap.get(i, i))
    dc = DrafterConfig(name="other", kind="model", path=str(path))
    with pytest.raises(TokenizerMismatchError):
        build_drafter(dc, cfg, model_dir, engine.tokenizer)


def test_separate_model_with_the_same_tokenizer_is_accepted(engine: LocalEngine, cfg: SpindConfig, model_dir: Path,
                                                            tmp_path: Path) -> None:
    path = save_derived_checkpoint(model_dir, tmp_path / "same", [0])
    drafter = build_drafter(DrafterConfig(name="same", kind="model", path=str(path)), cfg, model_dir,
                            engine.tokenizer)
    assert drafter.kind == "model" and len(drafter.runner.model.layers) == 1
