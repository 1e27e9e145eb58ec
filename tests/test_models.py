"""Our LLaMA forward and GGUF loader against transformers' own, and the attention modes against each other at
model level (kernel-level parity of every mode: tests/test_kernels*.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from spind.kernels.attention import TORCH_BACKENDS
from spind.config import SpindConfig
from spind.models.loader import default_gguf_path
from spind.models.runner import ForwardItem, ModelRunner
from spind.tokenizer import Tokenizer
from conftest import new_req_id

FP32_LOGITS_ATOL = 1e-3  # observed ~1e-4 on logits of magnitude ~40


@pytest.fixture(scope="module")
def gguf_model(model_dir: Path):
    """The GGUF's blocks with fp32-precision activations (`gguf`): our forward at fp32 precision, the one to hold
    against transformers' fp32 forward. The default `gguf-q16` rounds every GEMM's activations to 15 bits (its
    closeness to this one: tests/test_int_gemm.py and `spind bench decode`'s quality table)."""
    from spind.models.llama import load_llama

    return load_llama(model_dir, "gguf")
DECODE_STEPS = 4
MODES = (*TORCH_BACKENDS, "invariant")  # every mode that runs on this CPU without Triton


def test_logits_match_transformers(gguf_model, cfg: SpindConfig, model_dir: Path, tokenizer: Tokenizer) -> None:
    """Prefill, then greedy decode steps through our paged KV cache vs HF's DynamicCache, both fp32."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    prompt = tokenizer.apply_chat([{"role": "user", "content": "Explain how a hash map works, briefly."}])
    # an fp32 cache: this holds the forward against transformers (the fp16 cache's rounding: test_kv_cache.py)
    runner = ModelRunner(gguf_model, 64, cfg.runtime.kv_block_size, cfg.runtime.attention, kv_cache_dtype="float32")
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


def test_attention_modes_agree_at_model_level(gguf_model, cfg: SpindConfig, prompt_ids: list[list[int]]) -> None:
    """Model level: one prefill of prompts from 4 to ~290 tokens, then a step mixing decode and verify rows."""
    model = gguf_model
    runners = {name: ModelRunner(model, 128, cfg.runtime.kv_block_size, name, kv_cache_dtype="float32")
               for name in MODES}
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
    assert min(lengths) < 10 and max(lengths) > 250 and len(draft_lens) == len(prompt_ids)
    padded = prefill_logits["padded"] + step_logits["padded"]
    for name in MODES:
        for a, b in zip(padded, prefill_logits[name] + step_logits[name], strict=True):
            # 3e-4: the default (gguf) target rounds activations to 23-bit digits, which turns the backends' ~1e-6
            # differences into up to ~1.4e-4 on logits of magnitude ~40 (the fp32 target stays under 1e-4)
            torch.testing.assert_close(b, a, atol=3e-4, rtol=1e-5)
