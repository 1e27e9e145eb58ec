"""The quantized target (`[model].dtype = "gguf"`): the GGUF's own 4-bit blocks, batch-invariant, lossless.

On the real default model (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding / lm_head), with prompts
carried here so the tests run from a plain clone:
- its logits match the dequantized fp32 model within LOGIT_ATOL (fp32 rounding: measured ~1.5e-4, where the
  fp32 model's own reorderings give ~7e-5), with the same argmax everywhere;
- batch invariance, bit for bit: a position's logits are the same from a 1-row decode step, a (k+1)-row
  verify, a prefill with the draft riding along, and a verify batched with other requests' prefills and decodes;
- greedy speculative output equals plain decoding of the same target for every drafter and k;
- without the kernels (no compiler, no AVX2) the dtype still loads, runs the dequantized weights, and says why.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from conftest import new_req_id
from spind.config import ConfigError, DrafterConfig, SpindConfig, from_dict, load_config
from spind.drafters.model import common_prefix
from spind.coordinator.transport.local import GenRequest, GenResult, LocalEngine
from spind.kernels import cpu_ext
from spind.models.llama import LlamaModel, load_llama
from spind.models.runner import ForwardItem, ModelRunner
from spind.params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_ext.supported_isas(), reason="the gguf target's kernels need AVX2 or AVX-512")

LOGIT_ATOL = 1e-3
KS = (1, 4, 8)
PASSAGE = ("The lighthouse stood at the end of the long stone pier, and every evening the keeper climbed its ninety "
           "steps to light the lamp. Ships that passed in the night saw the beam sweep across the water, and the "
           "sailors knew that the rocks were near and the harbour was close. In winter the storms came from the "
           "north, and the waves broke over the pier so that the keeper had to wait for the tide before he could "
           "cross. He kept a log of every ship he saw, and of the weather, and of the birds that rested on the "
           "gallery when the wind was too strong for them to fly.")
CHATS = ["Write a short poem about the sea.",
         "Explain how a hash map works, with a small example in Python.",
         f"Repeat the following passage word for word.\n\n{PASSAGE}"]
COMPLETION = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
EXTRA_DRAFTERS = (DrafterConfig(name="q4-vocab", kind="self", variant="gguf", vocab=8192),
                  DrafterConfig(name="q4-layers", kind="self", variant="gguf", layers=tuple(range(24))))


@pytest.fixture(scope="module")
def gguf_cfg() -> SpindConfig:
    cfg = load_config(overrides={"model": {"dtype": "gguf"}, "runtime": {"attention": "invariant",
                                                                        "kv_num_blocks": 512}})
    known = {d.name for d in cfg.drafters}
    return dataclasses.replace(cfg, drafters=cfg.drafters + tuple(d for d in EXTRA_DRAFTERS if d.name not in known))


@pytest.fixture(scope="module")
def gguf_runtime(gguf_cfg: SpindConfig):
    """The gguf target with every configured drafter and two gguf self-drafts (trimmed vocabulary, 24 layers)."""
    engine = LocalEngine.load(gguf_cfg)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(gguf_runtime: LocalEngine) -> list[list[int]]:
    tok = gguf_runtime.tokenizer
    return [tok.apply_chat([{"role": "user", "content": c}]) for c in CHATS] + [tok.encode(COMPLETION)]


@pytest.fixture(scope="module")
def gguf_model(gguf_runtime: LocalEngine) -> LlamaModel:
    return gguf_runtime.target.runner.model


def prefill_logits(model: LlamaModel, ids: list[int], attention: str, kv_cache_dtype: str = "auto") -> torch.Tensor:
    runner = ModelRunner(model, 64, 16, attention, kv_cache_dtype=kv_cache_dtype)
    runner.add_request("p")
    return runner.forward([ForwardItem("p", ids, len(ids))])[0]


def test_config_accepts_the_quantized_dtypes() -> None:
    for dtype in ("gguf", "gguf-q16", "gguf-q8", "int4", "int8"):
        assert load_config(overrides={"model": {"dtype": dtype}}).model.dtype == dtype
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_config(overrides={"model": {"dtype": "int3"}})
    with pytest.raises(ConfigError, match="only a 'gguf\\*' self-draft trims it"):
        from_dict({"drafters": [{"name": "x", "kind": "self", "variant": "bf16", "vocab": 100}]})


def test_gguf_logits_match_the_dequantized_model(gguf_model: LlamaModel, model_dir: Path,
                                                 prompts: list[list[int]]) -> None:
    reference = load_llama(model_dir, "float32")
    for ids in prompts:
        got = prefill_logits(gguf_model, ids, "invariant", "float32")  # the weights' error alone, not the fp16 cache's
        want = prefill_logits(reference, ids, "packed")
        assert (got - want).abs().max() < LOGIT_ATOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])  # auto: fp16 where the row kernel reads it
def test_gguf_forward_is_batch_invariant(gguf_model: LlamaModel, prompts: list[list[int]], kv_cache_dtype: str) -> None:
    runner = ModelRunner(gguf_model, 256, 16, "invariant", kv_cache_dtype=kv_cache_dtype)
    prompt, other, draft = prompts[0], prompts[1], [1, 504, 3406, 30, 5355]

    def fresh(req_id: str, tokens: list[int]) -> None:
        runner.add_request(req_id)
        runner.forward([ForwardItem(req_id, tokens)])

    fresh("decode", prompt)  # the reference: one 1-row decode step per draft token
    decoded = torch.cat([runner.forward([ForwardItem("decode", [t])])[0] for t in draft])
    fresh("verify", prompt)  # one (k+1)-row verify
    verified = runner.forward([ForwardItem("verify", draft, len(draft))])[0]
    runner.add_request("ride")  # the draft riding along with the prefill
    ridden = runner.forward([ForwardItem("ride", prompt + draft, len(draft))])[0]
    fresh("mixed", prompt)  # a verify batched with another request's prefill and a third one's decode step
    fresh("neighbour", other)
    runner.add_request("newcomer")
    mixed = runner.forward([ForwardItem("newcomer", other[:40], 3), ForwardItem("mixed", draft, len(draft)),
                            ForwardItem("neighbour", [draft[0]])])[1]
    for name, rows in (("verify", verified), ("prefill + draft", ridden), ("mixed batch", mixed)):
        assert torch.equal(rows, decoded), f"{name}: rows differ from 1-row decode steps"
    # after a rejected draft is rolled back, the next step sees the same cache as plain decoding
    runner.truncate("verify", len(prompt) + 2)
    after_rollback = runner.forward([ForwardItem("verify", draft[2:3])])[0]
    assert torch.equal(after_rollback, decoded[2:3])


def speculation_errors(results: list[GenResult], plain: list[GenResult]) -> list[str]:
    errors = []
    for got, want in zip(results, plain, strict=True):
        if got.token_ids != want.token_ids:
            at = common_prefix(got.token_ids, want.token_ids)
            errors.append(f"{got.drafter}: {got.req_id} diverges from plain decoding at output token {at}")
    if not sum(r.num_accepted for r in results):
        errors.append(f"{results[0].drafter}: no draft accepted, so the comparison proves nothing")
    return errors


@pytest.fixture(scope="module")
def plain(gguf_runtime: LocalEngine, prompts: list[list[int]]) -> list[GenResult]:
    return gguf_runtime.generate([GenRequest(new_req_id("plain"), ids, params(i), None)
                                  for i, ids in enumerate(prompts)])


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=20 + 4 * i, ignore_eos=i % 2 == 1)


@pytest.mark.parametrize("k", KS)
def test_greedy_speculation_equals_plain_decoding(gguf_runtime: LocalEngine, prompts: list[list[int]],
                                                  plain: list[GenResult], k: int) -> None:
    """Every drafter at once, in one batch, each drafting for its own copy of the prompts."""
    names = list(gguf_runtime.drafters)
    assert {d.name for d in EXTRA_DRAFTERS} <= set(names)
    requests = [GenRequest(new_req_id(name), ids, params(i), name, k) for name in names
                for i, ids in enumerate(prompts)]
    results = gguf_runtime.generate(requests, max_batch=len(requests))
    n = len(prompts)
    errors = [e for j in range(len(names)) for e in speculation_errors(results[j * n:(j + 1) * n], plain)]
    assert not errors, "\n".join(errors)


def test_gguf_dtype_falls_back_to_torch_without_the_kernels(model_dir: Path, prompts: list[list[int]],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_ext, "supported_isas", lambda: [])
    monkeypatch.setattr(cpu_ext, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="spind.kernels.cpu_ext"):
        model = load_llama(model_dir, "gguf")
    assert "spind CPU kernels unavailable" in caplog.text and "neither AVX-512 VNNI nor AVX2" in caplog.text
    assert not model.layers[0].mlp.down_proj.has_kernel
    reference = load_llama(model_dir, "float32")
    got = prefill_logits(model, prompts[3], "invariant")  # the backend runs `packed` without the kernels
    assert (got - prefill_logits(reference, prompts[3], "packed")).abs().max() < LOGIT_ATOL
