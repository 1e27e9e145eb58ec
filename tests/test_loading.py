"""Loading checkpoints: which weight files are read (safetensors or torch .bin, single or sharded with an index, as
transformers picks them), the model materialised straight in its dtype (layer subsets, tied heads, a mismatched
checkpoint refused), and the peak memory of loading, measured in a fresh process: at most 1.2x the model's bytes in
the target dtype, where a whole-state-dict load of an fp32 file into bfloat16 peaks at ~4x."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spind.models.llama import load_llama
from spind.models.loader import ModelNotFoundError, resolve_model_dir, weight_files
from test_families import GQA2, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", GQA2, "safetensors", tmp_path_factory.mktemp("llama"))


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_weight_files_are_the_ones_transformers_reads(llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    shutil.copytree(llama, d)
    (d / "gguf-blocks.safetensors").write_bytes(b"")  # the GGUF cache's quantized blocks are not weights
    (d / "training_args.bin").write_bytes(b"")
    torch.save({}, d / "pytorch_model.bin")
    assert weight_files(d) == [d / "model.safetensors"]  # safetensors before .bin
    (d / "model.safetensors").unlink()
    assert weight_files(d) == [d / "pytorch_model.bin"] and resolve_model_dir(str(d), tmp_path) == d
    (d / "pytorch_model.bin").unlink()
    assert weight_files(d) == [] and not (d / "model.safetensors").exists()
    with pytest.raises(ModelNotFoundError, match="safetensors or pytorch_model"):
        resolve_model_dir(str(d), tmp_path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-00001-of-00002.safetensors, model-00002-of-00002"):
        weight_files(d)


def test_a_model_loads_straight_into_its_dtype(llama: Path) -> None:
    fp32, bf16 = load_llama(llama, "float32"), load_llama(llama, "bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16} and bf16.rope_cos.dtype == torch.float32
    for name, p in params(fp32).items():
        assert torch.equal(params(bf16)[name], p.to(torch.bfloat16)), name
    assert not any(p.requires_grad for p in bf16.parameters())


def test_layer_subsets_take_the_named_layers(llama: Path) -> None:
    full, sub = load_llama(llama, "float32"), load_llama(llama, "float32", layers=(1, 1, 0))
    assert sub.args.num_layers == 3
    for i, old in enumerate((1, 1, 0)):
        for name, p in sub.layers[i].named_parameters():
            assert torch.equal(p, full.layers[old].get_parameter(name)), (i, name)
    with pytest.raises(ValueError, match="out of range"):
        load_llama(llama, "float32", layers=(2,))


def test_a_self_draft_beside_its_target_shares_the_targets_weights(llama: Path, tmp_path: Path) -> None:
    """A `layers` self-draft on the target's worker is a view of the target's modules (no second copy of the weights),
    computing what the same subset loaded apart computes; elsewhere (or over a quantized target) it loads apart."""
    from spind.config import DrafterConfig
    from spind.models.llama import layer_subset
    from spind.models.runner import ForwardItem, ModelRunner
    from spind.worker.worker import shared_self_draft

    target = load_llama(llama, "float32")
    dc = DrafterConfig(name="half", kind="self", variant="layers", layers=(1,))
    shared = shared_self_draft(dc, target)
    assert shared is not None and shared.layers[0] is target.layers[1] and shared.lm_head is target.lm_head
    assert {p.data_ptr() for p in shared.parameters()} <= {p.data_ptr() for p in target.parameters()}
    apart = load_llama(llama, "float32", layers=(1,))
    prompt = list(range(3, 40))
    logits = []
    for model in (shared, apart):
        runner = ModelRunner(model, 8, 16, "packed")
        runner.add_request("r")
        logits.append(runner.forward([ForwardItem("r", prompt, 4)])[0])
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    assert shared_self_draft(dc, None) is None  # hosted on another worker: loaded there
    assert shared_self_draft(DrafterConfig(name="b", kind="self", variant="bf16"), target) is None
    target.quantized = "gguf-q16"  # a quantized target's layers run as one fused stack
    assert shared_self_draft(dc, target) is None
    with pytest.raises(ValueError, match="fused stack"):
        layer_subset(target, [1])


def test_tied_and_headless_checkpoints_share_the_embedding(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(llama / "model.safetensors"))
    config = json.loads((llama / "config.json").read_text())
    for name, tie in (("tied", True), ("headless", False)):  # headless: untied in config.json, no lm_head stored
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tie}))
        save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(d / "model.safetensors"))
        model = load_llama(d, "bfloat16")
        assert model.lm_head.weight is model.embed_tokens.weight, name


def test_a_checkpoint_that_does_not_fit_its_config_is_refused(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(llama / "model.safetensors"))
    for name, broken, error in (("short", {"model.layers.1.mlp.up_proj.weight": None}, "weight .* missing"),
                                ("shape", {"model.norm.weight": torch.ones(3)}, r"model.norm.weight has shape \(3,\)")):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(llama / "config.json", d / "config.json")
        save_file({k: broken.get(k, v) for k, v in state.items() if broken.get(k, v) is not None},
                  str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=error):
            load_llama(d, "float32")


PEAK_SCRIPT = """
import json, sys
from pathlib import Path
import safetensors.torch, torch
from spind.models.llama import load_llama

def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

try:
    open("/proc/self/clear_refs", "w").write("5")  # the peak so far (imports) := the current RSS
except OSError:
    pass
before = kib("VmRSS")
model = load_llama(Path(sys.argv[1]), "bfloat16")
print(json.dumps({"before": before * 1024, "peak": kib("VmHWM") * 1024,
                  "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmRSS / VmHWM from /proc")
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loading_peaks_at_the_model_size_in_its_dtype(fmt: str, tmp_path: Path) -> None:
    """A ~250 MB fp32 checkpoint loaded as bfloat16 (target: ~125 MB) in a fresh process; mapped file pages count."""
    from safetensors.torch import save_file

    hidden, inter, layers, vocab, kv = 768, 2048, 8, 4096, 256
    config = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4,
                  max_position_embeddings=256, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    state = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    file_bytes = sum(t.numel() * 4 for t in state.values())
    del state
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["bytes"] == file_bytes // 2
    growth = (m["peak"] - m["before"]) / m["bytes"]
    assert growth <= 1.2, f"loading grew RSS by {growth:.2f}x the model's bfloat16 bytes"


def test_the_gguf_cache_is_keyed_by_content_not_path(tmp_path: Path) -> None:
    """Two installs of the same GGUF (two checkouts, two virtualenvs) share one conversion; another file gets its
    own. The key reads the size and the first and last 4 MiB (the header names every tensor's type and offset)."""
    from spind.models.loader import _content_key, _gguf_to_cache

    blob = bytes(range(256)) * (40_000)  # ~10 MB: the sampled head and tail do not overlap
    a, b = tmp_path / "one" / "m.gguf", tmp_path / "two" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(blob)
    assert _content_key(a) == _content_key(b)
    head = bytearray(blob)
    head[100] ^= 1
    (tmp_path / "c.gguf").write_bytes(bytes(head))
    (tmp_path / "d.gguf").write_bytes(blob[:-1])
    assert len({_content_key(a), _content_key(tmp_path / "c.gguf"), _content_key(tmp_path / "d.gguf")}) == 3
    done = tmp_path / "cache" / "models" / f"m-{_content_key(a)}"
    done.mkdir(parents=True)
    (done / "complete").write_text("")
    assert _gguf_to_cache(b, tmp_path / "cache") == done  # b's copy is found where a's conversion went


def test_a_gguf_converts_once_into_weights_blocks_and_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    """One conversion writes everything a start reads (the fp32 copy, the quantized blocks, the tokenizer), in the
    same files a conversion made by any earlier path holds: no worker parses the GGUF again at load."""
    import gguf
    from safetensors import safe_open

    from spind.models.loader import BLOCKS_FILE, _gguf_to_cache, default_gguf_path
    from spind.tokenizer import Tokenizer

    out = _gguf_to_cache(default_gguf_path(), tmp_path)
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".jinja") == sorted(
        [BLOCKS_FILE, "complete", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    assert not list(tmp_path.glob("models/*.tmp*"))
    assert json.loads((out / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    reader = gguf.GGUFReader(str(default_gguf_path()))
    quantized = {t.name for t in reader.tensors if t.tensor_type.name in ("Q4_0", "Q4_1", "Q8_0")}
    with safe_open(str(out / BLOCKS_FILE), "pt") as f:
        assert len(list(f.keys())) == len(quantized) > 0
        assert set(f.metadata().values()) <= {"Q4_0", "Q4_1", "Q8_0"}
    text = "Converting a GGUF: naïve café ☕, 12345 tokens!"
    assert Tokenizer(out).encode_prompt(text) == Tokenizer(model_dir).encode_prompt(text)
