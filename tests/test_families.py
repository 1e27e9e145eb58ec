"""Tiny random checkpoints of each LLaMA family spind serves (LLaMA, Qwen2 with q/k/v biases, Mistral), made here
with transformers and saved to a temporary folder: spind's forward at fp32 through the `invariant` row-attention
kernel (both builds where the CPU runs them) against transformers' own, prefill then decode steps, over head dims
of 16 to 128 and GQA groups of 1 to 4. Mistral's sliding window is set wider than the context here (spind does not
implement it yet: a checkpoint whose window binds is issue 22's work)."""

from __future__ import annotations

import pytest
import torch

from spind.kernels import cpu_ext
from spind.models.llama import load_llama
from spind.models.runner import ForwardItem, ModelRunner

ATOL = 2e-4  # fp32 against fp32: different summation orders on logits of magnitude ~1

FAMILIES = {
    "llama-hd16-gqa2": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-hd32-gqa4": ("qwen2", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1)),
    "mistral-hd64-mha": ("mistral", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                         sliding_window=4096)),
    "llama-hd128-gqa2": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)),
}


def make_checkpoint(family: str, extra: dict, path) -> None:
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[family]
    cfg = cfg_cls(vocab_size=256, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
                  tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> folder, made once per module on first use"""
    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            make_checkpoint(*FAMILIES[name], made[name])
        return made[name]

    return get


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_checkpoints_match_transformers(name: str, isa: str, checkpoints, monkeypatch) -> None:
    if isa not in cpu_ext.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    import transformers

    monkeypatch.setenv(cpu_ext.ISA_ENV, isa)
    path = checkpoints(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_llama(path, "float32")
    runner = ModelRunner(ours, 16, 16, "invariant")
    assert runner.attn.ops is not None, "the row-attention kernel serves this head dim"
    runner.add_request("r")
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    got = runner.forward([ForwardItem("r", prompt, len(prompt))])[0]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    torch.testing.assert_close(got, out.logits[0], atol=ATOL, rtol=0)
    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    for _ in range(3):
        got = runner.forward([ForwardItem("r", [token])])[0][0]
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(got, out.logits[0, -1], atol=ATOL, rtol=0)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_a_head_dim_the_kernel_cannot_take_falls_back_to_packed_attention(caplog) -> None:
    if not cpu_ext.available():
        pytest.skip("spind's CPU kernels need AVX2 or AVX-512 VNNI")
    from spind.kernels.row_attention import RowInvariantAttention

    assert cpu_ext.row_attention_supports(64) and not cpu_ext.row_attention_supports(12)
    with caplog.at_level("WARNING"):
        backend = RowInvariantAttention(4, 2, 12, "cpu")
    assert backend.ops is None and "head dim 12" in caplog.text
