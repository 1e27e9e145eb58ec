"""Our LLaMA forward and GGUF loader against transformers' own, and the attention backends against each other."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels.attention import AttentionBatch, get_backend
from spind.config import SpindConfig
from spind.engine.offline import Runtime
from spind.models.loader import default_gguf_path
from spind.models.runner import ForwardItem, ModelRunner
from spind.models.tokenizer import Tokenizer
from conftest import new_req_id

FP32_LOGITS_ATOL = 1e-3  # observed ~1e-4 on logits of magnitude ~40
DECODE_STEPS = 4


def test_logits_match_transformers(runtime: Runtime, model_dir: Path, tokenizer: Tokenizer) -> None:
    """Prefill, then greedy decode steps through our paged KV cache vs HF's DynamicCache, both fp32."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    prompt = tokenizer.apply_chat([{"role": "user", "content": "Explain how a hash map works, briefly."}])
    runner = runtime.target.runner
    rid = new_req_id("parity")
    runner.add_request(rid)
    try:
        ours = runner.forward([ForwardItem(rid, prompt, num_logits=len(prompt))])[0]  # [len(prompt), V]
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
        assert (ours - out.logits[0]).abs().max().item() < FP32_LOGITS_ATOL
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(DECODE_STEPS):
            ours = runner.forward([ForwardItem(rid, [token])])[0][0]
            with torch.no_grad():
                out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            theirs = out.logits[0, -1]
            assert (ours - theirs).abs().max().item() < FP32_LOGITS_ATOL
            assert int(ours.argmax()) == int(theirs.argmax())
            past, token = out.past_key_values, int(theirs.argmax())
    finally:
        runner.free_request(rid)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers' GGUF loader needs accelerate (pip install accelerate)")
def test_gguf_dequantization_matches_transformers(model_dir: Path) -> None:
    """Our dequantized + q/k-unpermuted weights (the safetensors cache) equal transformers' GGUF loader's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32).state_dict()
    ours = load_file(str(model_dir / "model.safetensors"))
    assert set(ours) <= set(theirs)
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied to the embedding: our cache stores it once
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def _attention_inputs(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int,
                      head_dim: int) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q and caches; each request's slots are scattered over the pool (a shuffled block layout)."""
    gen = torch.Generator().manual_seed(0)
    num_slots = sum(ctx_lens) + 64
    perm = torch.randperm(num_slots, generator=gen)
    read, write, offset = [], [], 0
    for q, c in zip(q_lens, ctx_lens):
        slots = perm[offset:offset + c]
        read.append(slots)
        write.append(slots[c - q:])
        offset += c
    batch = AttentionBatch(q_lens=q_lens, ctx_lens=ctx_lens, write_slots=torch.cat(write), read_slots=read)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    return batch, q, k, v


def test_attention_backends_agree_on_random_inputs() -> None:
    """Kernel level: decode rows, verify rows and a prefill, contexts from 1 to 700 tokens, GQA 9:3."""
    q_lens, ctx_lens = [1, 5, 1, 9, 64], [1, 40, 700, 9, 300]
    batch, q, k, v = _attention_inputs(q_lens, ctx_lens, num_heads=9, num_kv_heads=3, head_dim=64)
    packed = get_backend("packed")(batch, "cpu")(q, k, v, 0.125)
    padded = get_backend("padded")(batch, "cpu")(q, k, v, 0.125)
    assert packed.shape == q.shape
    torch.testing.assert_close(padded, packed, atol=1e-5, rtol=1e-5)


def test_attention_backend_registry_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="packed"):
        get_backend("flash")


def test_packed_and_padded_models_agree(runtime: Runtime, cfg: SpindConfig, prompt_ids: list[list[int]]) -> None:
    """Model level: one prefill of prompts from 4 to ~500 tokens, then a step mixing decode and verify rows."""
    model = runtime.target.runner.model
    runners = {name: ModelRunner(model, 128, cfg.runtime.kv_block_size, name) for name in ("packed", "padded")}
    prefill_logits: dict[str, list[torch.Tensor]] = {}
    step_logits: dict[str, list[torch.Tensor]] = {}
    draft_lens = [0, 4, 8, 1, 0, 2, 7, 3, 5]
    for name, runner in runners.items():
        rids = [f"{name}-{i}" for i in range(len(prompt_ids))]
        for rid in rids:
            runner.add_request(rid)
        prefill_logits[name] = runner.forward([ForwardItem(r, ids, 2) for r, ids in zip(rids, prompt_ids)])
        steps = [ForwardItem(r, ids[:n + 1], n + 1) for r, ids, n in zip(rids, prompt_ids, draft_lens)]
        step_logits[name] = runner.forward(steps)
    lengths = [len(ids) for ids in prompt_ids]
    assert min(lengths) < 10 and max(lengths) > 400 and len(draft_lens) == len(prompt_ids)
    packed = prefill_logits["packed"] + step_logits["packed"]
    for a, b in zip(packed, prefill_logits["padded"] + step_logits["padded"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)
