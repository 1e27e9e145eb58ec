"""Tiny random checkpoints of each LLaMA family spind serves, made here with transformers and saved to a temporary
folder: spind's forward at fp32 through the `invariant` row-attention kernel (both builds where the CPU runs them)
against transformers' own, prefill then decode steps, over head dims of 16 to 128 and GQA groups of 1 to 4.

The families: LLaMA (2-style MHA, GQA), LLaMA-3.1's `llama3` RoPE scaling and `linear` scaling (transformers 5's
`rope_parameters`), Qwen2 (q/k/v biases; a window its config turns off), Mistral (a window wider than the context,
and one that binds: spind serves up to the window, where it never binds, and refuses beyond), each weight format
(safetensors single and sharded with an index, torch .bin single and sharded). Then greedy speculative decoding with
a .bin model drafter over a LLaMA-3.1-RoPE target through the real coordinator: token for token plain decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spind.kernels import cpu_ext
from spind.models.llama import load_llama
from spind.models.runner import ForwardItem, ModelRunner

ATOL = 2e-4  # fp32 against fp32: different summation orders on logits of magnitude ~1
VOCAB = 256
PROMPT, DECODE_STEPS = 37, 3
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                # 64, not 8192: wavelengths of this head dim fall in all three bands (kept, smoothed, divided)
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
GQA2 = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)

# name -> (family, config, how it is saved: "safetensors" | "sharded" | "bin" | "sharded-bin")
FAMILIES = {
    "llama-hd16-gqa2": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), "safetensors"),
    "qwen2-hd32-gqa4": ("qwen2", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1), "safetensors"),
    "mistral-hd64-mha": ("mistral", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                         sliding_window=4096), "safetensors"),
    "llama-hd128-gqa2": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1), "safetensors"),
    "llama2-hd32-mha": ("llama", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                                      rms_norm_eps=1e-5), "safetensors"),
    "llama31-rope": ("llama", dict(**GQA2, rope_parameters=LLAMA31_ROPE), "safetensors"),
    "llama-rope-linear": ("llama", dict(**GQA2, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 10000.0}), "safetensors"),
    "mistral-window16": ("mistral", dict(**GQA2, sliding_window=16), "safetensors"),
    "qwen2-window-off": ("qwen2", dict(**GQA2, use_sliding_window=False, sliding_window=16, max_window_layers=0),
                         "safetensors"),
    "llama-sharded": ("llama", GQA2, "sharded"),
    "llama-bin": ("llama", GQA2, "bin"),
    "llama-sharded-bin": ("llama", GQA2, "sharded-bin"),
}


def make_checkpoint(family: str, extra: dict, fmt: str, path: Path, seed: int = 0, std: float | None = None,
                    **config) -> Path:
    """A random checkpoint as transformers writes it (.bin: as its older versions did; transformers 5 writes only
    safetensors). `std`: a wider init than the default, for a random model whose argmax depends on its context."""
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[family]
    cfg = cfg_cls(**{"vocab_size": VOCAB, "intermediate_size": 96, "num_hidden_layers": 2,
                     "max_position_embeddings": 256, "tie_word_embeddings": False, **extra, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, std)
    if fmt in ("safetensors", "sharded"):
        model.save_pretrained(path, max_shard_size="100KB" if fmt == "sharded" else "50GB")
        assert (path / "model.safetensors.index.json").is_file() == (fmt == "sharded")
        return path
    model.config.save_pretrained(path)
    state = model.state_dict()
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
        return path
    names = list(state)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({n: state[n] for n in shard}, path / file)
        weight_map.update(dict.fromkeys(shard, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over the checkpoint's vocabulary: enough for the coordinator to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> folder, made once per module on first use"""
    made: dict = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_checkpoint(*FAMILIES[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


def hf_model(path: Path, **overrides):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_checkpoints_match_transformers(name: str, isa: str, checkpoints, monkeypatch) -> None:
    if isa not in cpu_ext.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    monkeypatch.setenv(cpu_ext.ISA_ENV, isa)
    path = checkpoints(name)
    hf = hf_model(path)
    ours = load_llama(path, "float32")
    runner = ModelRunner(ours, 16, 16, "invariant")
    assert runner.attn.ops is not None, "the row-attention kernel serves this head dim"
    runner.add_request("r")
    n = min(PROMPT, runner.max_model_len - DECODE_STEPS)  # a binding window: up to the limit, no further
    prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    got = runner.forward([ForwardItem("r", prompt, len(prompt))])[0]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    torch.testing.assert_close(got, out.logits[0], atol=ATOL, rtol=0)
    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    for _ in range(DECODE_STEPS):
        got = runner.forward([ForwardItem("r", [token])])[0][0]
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(got, out.logits[0, -1], atol=ATOL, rtol=0)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_rope_scaling_is_parsed_in_both_config_formats(checkpoints, tmp_path: Path) -> None:
    """transformers 5 writes `rope_parameters`; older checkpoints carry `rope_scaling` (key "type" or "rope_type")
    beside a top-level rope_theta. Both give the same model, to spind as to transformers."""
    import transformers

    from spind.models.layers import LlamaArgs

    new = json.loads((checkpoints("llama31-rope") / "config.json").read_text())
    args = LlamaArgs.from_hf(new)
    assert args.rope_scaling is not None and args.rope_scaling.rope_type == "llama3" and args.rope_theta == 500000.0
    scaling = {k: v for k, v in new["rope_parameters"].items() if k not in ("rope_theta", "rope_type")}
    for key in ("type", "rope_type"):
        old = {k: v for k, v in new.items() if k != "rope_parameters"}
        old.update(rope_theta=500000.0, rope_scaling={key: "llama3", **scaling})
        assert LlamaArgs.from_hf(old) == args
        (tmp_path / "config.json").write_text(json.dumps(old))
        theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
        assert {k: v for k, v in theirs.items() if k != "type"} == new["rope_parameters"]


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_rope_types_spind_does_not_compute_are_refused(rope_type: str, checkpoints) -> None:
    from spind.models.layers import LlamaArgs

    cfg = json.loads((checkpoints("llama31-rope") / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not served by spind"):
            LlamaArgs.from_hf({**cfg, key: {"rope_type": rope_type, "factor": 4.0}})


def test_a_binding_window_limits_the_context_to_where_it_never_binds(checkpoints, caplog) -> None:
    """transformers' window W: a query at position i attends keys (i - W, i]. Up to W tokens that is every earlier
    key (same logits as no window at all); token W + 1 is the first it changes. So W tokens are served, exactly."""
    path = checkpoints("mistral-window16")
    with caplog.at_level("WARNING"):
        model = load_llama(path, "float32")
    assert (model.args.sliding_window, model.args.max_position) == (16, 16) and "at most 16 tokens" in caplog.text
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed, full = hf_model(path)(ids).logits[0], hf_model(path, sliding_window=None)(ids).logits[0]
    torch.testing.assert_close(windowed[:16], full[:16], atol=1e-5, rtol=0)
    assert (windowed[16] - full[16]).abs().max() > 1e-3, "the window binds from the 17th token on"

    runner = ModelRunner(model, 16, 16, "invariant", max_model_len=2048)
    assert runner.max_model_len == 16
    runner.add_request("r")
    runner.forward([ForwardItem("r", ids[0, :16].tolist(), 1)])
    with pytest.raises(ValueError, match="exceed the context limit 16"):
        runner.forward([ForwardItem("r", [1])])


def test_windows_that_never_bind_serve_the_whole_context(checkpoints) -> None:
    from spind.models.layers import LlamaArgs

    for name in ("mistral-hd64-mha", "qwen2-window-off"):  # wider than max_position_embeddings; turned off
        args = LlamaArgs.from_hf(json.loads((checkpoints(name) / "config.json").read_text()))
        assert (args.sliding_window, args.max_position) == (None, 256), name
    qwen2 = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256, use_sliding_window=True, sliding_window=16)
    # older Qwen2 configs: layers from max_window_layers on slide; transformers 5 writes layer_types
    assert LlamaArgs.from_hf({**qwen2, "max_window_layers": 2}).sliding_window is None
    assert LlamaArgs.from_hf({**qwen2, "max_window_layers": 1}).max_position == 16
    assert LlamaArgs.from_hf({**qwen2, "layer_types": ["full_attention"] * 2}).sliding_window is None
    assert LlamaArgs.from_hf({**qwen2, "layer_types": ["full_attention", "sliding_attention"]}).max_position == 16


def engine_config(target: Path, drafters: list[dict] = (), max_model_len: int = 256):
    from spind.config import from_dict

    return from_dict({
        "model": {"target": str(target), "dtype": "float32", "max_model_len": max_model_len},
        "runtime": {"attention": "invariant", "kv_num_blocks": 64, "max_batch_size": 4, "profile": "off",
                    "pipeline": False},
        "drafters": list(drafters), "workers": [{"name": "target", "device": "cpu"}],
    })


def test_the_engine_refuses_what_a_binding_window_cannot_serve(checkpoints) -> None:
    from spind.coordinator.interface import EngineError
    from spind.coordinator.transport.local import GenRequest, LocalEngine
    from spind.params import SamplingParams

    path = checkpoints("mistral-window16")
    write_tokenizer(path)
    engine = LocalEngine.load(engine_config(path))
    try:
        assert engine.max_model_len == 16
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        res = engine.generate([GenRequest("fits", list(range(3, 13)), params)])[0]
        assert len(res.token_ids) == 6 and res.finish_reason == "length"  # stops at 16 tokens, served exactly
        with pytest.raises(EngineError, match="the context limit is 16"):
            engine.generate([GenRequest("long", list(range(3, 19)), params)])
    finally:
        engine.close()


def test_greedy_speculation_with_a_bin_drafter_over_a_llama31_target_is_plain_decoding(tmp_path: Path) -> None:
    """The drafter is the target's weights plus noise, saved as pytorch_model.bin: close enough that some drafts are
    accepted and some rejected (an independent random model would agree with the target on nothing)."""
    from spind.coordinator.transport.local import GenRequest, LocalEngine
    from spind.params import SamplingParams

    target = make_checkpoint("llama", dict(**GQA2, rope_parameters=LLAMA31_ROPE), "safetensors", tmp_path / "target",
                             std=0.1)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    shutil.copy(target / "config.json", drafter / "config.json")
    gen = torch.Generator().manual_seed(5)
    torch.save({n: w + 0.003 * torch.randn(w.shape, generator=gen) for n, w in hf_model(target).state_dict().items()},
               drafter / "pytorch_model.bin")
    for path in (target, drafter):
        write_tokenizer(path)
    engine = LocalEngine.load(engine_config(target, [{"name": "bin", "kind": "model", "path": str(drafter),
                                                       "worker": "target"}]))
    try:
        assert engine.target.runner.model.args.rope_scaling.rope_type == "llama3"
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 90)]
        params = SamplingParams(max_tokens=40, ignore_eos=True)

        def run(name: str | None, k: int | None) -> list:
            return engine.generate([GenRequest(f"{name}{k}-{i}", p, params, name, k) for i, p in enumerate(prompts)])

        plain = [r.token_ids for r in run(None, None)]
        for k in (2, 5):
            results = run("bin", k)
            assert [r.token_ids for r in results] == plain, f"bin@{k} is not plain decoding"
            accepted, drafted = sum(r.num_accepted for r in results), sum(r.num_drafted for r in results)
            assert 0 < accepted < drafted, f"{accepted} of {drafted} drafts accepted: the comparison proves little"
    finally:
        engine.close()


def test_a_head_dim_the_kernel_cannot_take_falls_back_to_packed_attention(caplog) -> None:
    if not cpu_ext.available():
        pytest.skip("spind's CPU kernels need AVX2 or AVX-512 VNNI")
    from spind.kernels.row_attention import RowInvariantAttention

    assert cpu_ext.row_attention_supports(64) and not cpu_ext.row_attention_supports(12)
    with caplog.at_level("WARNING"):
        backend = RowInvariantAttention(4, 2, 12, "cpu")
    assert backend.ops is None and "head dim 12" in caplog.text
