"""Config: the embedded default loads; every bad value is a ConfigError that names the section and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from spind.config import (DEFAULT_CONFIG_PATH, ConfigError, SpindConfig, checkpoint_dtype, from_dict, load_config,
                          max_kv_blocks, resolve_dtype, with_section_values)

NGRAM = {"name": "ng", "kind": "ngram"}


def test_embedded_default_loads() -> None:
    cfg = load_config()
    assert [d.name for d in cfg.drafters] == ["ngram", "suffix", "int8", "dyn8", "bf16"]
    assert cfg.model.dtype == "auto" and cfg.runtime.attention == "invariant"
    assert cfg.runtime.kv_num_blocks == 0 and max_kv_blocks(cfg) == 2048  # "auto" on CPU: the 2048 it shipped with
    assert cfg.selection.policy == "lbss" and cfg.selection.k_set == (2, 4, 8)
    assert cfg.drafter("int8").variant == "int8-weight-only"
    assert cfg.worker("target").device == "cpu" and cfg.worker("unlisted").name == "unlisted"


def test_the_default_head_is_left_out_for_another_target(caplog: pytest.LogCaptureFixture) -> None:
    """path = "default" is the default model's head: with another target the config serves the other drafters and
    says why the head is gone; with the default target, or with a head of its own path, it stays."""
    head = {"name": "eagle", "kind": "eagle", "path": "default", "worker": "target"}
    other = from_dict({"model": {"target": "/models/llama-7b"}, "drafters": [NGRAM, head]})
    assert [d.name for d in other.drafters] == ["ng"]
    assert "draft head of the embedded default model" in caplog.text and "/models/llama-7b" in caplog.text
    assert [d.name for d in from_dict({"drafters": [NGRAM, head]}).drafters] == ["ng", "eagle"]
    own = from_dict({"model": {"target": "/models/llama-7b"},
                     "drafters": [{**head, "name": "head", "path": "/heads/llama-7b"}]})
    assert [d.name for d in own.drafters] == ["head"]


def test_overrides_apply_and_none_leaves_the_value() -> None:
    cfg = load_config(overrides={"model": {"dtype": "bfloat16", "target": None}, "runtime": {"kv_num_blocks": 8}})
    assert cfg.model.dtype == "bfloat16" and cfg.model.target == "default" and cfg.runtime.kv_num_blocks == 8


def test_section_values_are_checked_as_the_files_are() -> None:
    cfg = load_config()
    assert with_section_values(cfg, "selection", {}) == cfg
    other = with_section_values(cfg, "selection", {"price_margin": 0.1, "k_set": [2, 4]})
    assert (other.selection.price_margin, other.selection.k_set, other.runtime) == (0.1, (2, 4), cfg.runtime)
    for section, values, why in (("selection", {"price_margin": "x"}, "must be float"),
                                 ("selection", {"nope": 1}, "unknown key"), ("nosec", {}, "no section"),
                                 ("selection", {"price_margin": -1.0}, "price_margin must be >= 0")):
        with pytest.raises(ConfigError, match=why):
            with_section_values(cfg, section, values)


def test_unknown_drafter_lists_the_configured_ones() -> None:
    with pytest.raises(ConfigError, match="unknown drafter 'fast'; configured drafters: ngram, suffix, int8, dyn8, bf16"):
        load_config().drafter("fast")


def test_frozen() -> None:
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.model.dtype = "float16"  # type: ignore[misc]


BAD_CONFIGS = [
    ({"model": {"dtype": "int3"}}, r"\[model\] dtype must be one of"),
    ({"model": {"dtype": 5}}, r"\[model\] dtype must be str, got 5"),
    ({"model": {"max_model_len": 8}}, r"\[model\] max_model_len must be >= 16"),
    ({"model": {"colour": "red"}}, r"\[model\] unknown key\(s\): colour"),
    ({"runtime": {"attention": "flash"}}, r"\[runtime\] attention must be one of"),
    ({"runtime": {"kv_block_size": 0}}, r"\[runtime\] kv_block_size, max_batch_size must be >= 1"),
    ({"runtime": {"kv_num_blocks": -1}}, r"kv_num_blocks >= 0 \(0: auto\)"),
    ({"runtime": {"gpu_memory_utilization": 0.0}}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"runtime": {"gpu_memory_utilization": 1.5}}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"runtime": {"threads": -1}}, r"threads >= 0"),
    ({"speculation": {"k": 33}}, r"\[speculation\] k must be in 0..32"),
    ({"speculation": {"k": 4.0}}, r"\[speculation\] k must be int, got 4.0"),
    ({"selection": {"policy": "fixed:fast"}}, r"\[selection\] policy 'fixed:fast' names no configured drafter"),
    ({"selection": {"policy": "oracle"}}, r"\[selection\] policy 'oracle' is evaluation only"),
    ({"selection": {"policy": "best"}}, r"\[selection\] policy 'best' is not one of"),
    ({"selection": {"policy": "fixed:ngram@0"}}, r"\[selection\] policy 'fixed:ngram@0': k must be an integer >= 1"),
    ({"selection": {"policy": "fixed:"}}, r"\[selection\] policy 'fixed:' needs a drafter name"),
    ({"selection": {"k_set": [4, 4]}}, r"\[selection\] k_set must be distinct"),
    ({"selection": {"alpha": -1}}, r"\[selection\] need alpha >= 0"),
    ({"runtime": {"profile": "sometimes"}}, r"\[runtime\] profile must be auto, measure or off"),
    ({"drafters": [NGRAM, NGRAM]}, r"name 'ng' is duplicated or reserved"),
    ({"drafters": [{"name": "none", "kind": "ngram"}]}, r"'none' is .*reserved"),
    ({"drafters": [{"name": "x", "kind": "rnn"}]}, r"x: kind must be one of"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "int3"}]},
     r"x: variant must be one of"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers"}]},
     r"x: variant 'layers' needs layers = \[...\]"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers", "layers": 3}]},
     r"layers must be a list"),
    ({"drafters": [{"name": "x", "kind": "model"}]}, r"x: kind 'model' needs path"),
    ({"drafters": [{**NGRAM, "ngram_min": 3, "ngram_max": 2}]},
     r"ng: need 1 <= ngram_min <= ngram_max"),
    ({"drafters": [{"name": "x"}]}, r"\[drafters\] .*missing .*'kind'"),
    ({"workers": [{"device": "cpu"}]}, r"\[workers\] .*missing .*'name'"),
    ({"gpu": {}}, r"unknown top-level section\(s\): gpu"),
    ({"server": {"watchdog_s": -1}}, r"\[server\] watchdog_s must be >= 0 \(0: off\)"),
]


@pytest.mark.parametrize("raw, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_values_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


# Values the loader lets through today or reports confusingly; the fix is proposed to the lead.
LOOSE_CONFIGS = [
    ({"drafters": [{"name": 5, "kind": "ngram"}]}, r"name must be str"),
    ({"model": "default"}, r"\[model\] must be a table"),
    ({"drafters": {"name": "ng", "kind": "ngram"}}, r"drafters.* must be an array"),
    ({"drafters": [{"name": "x", "kind": "self", "variant": "layers", "layers": [0, -1]}]}, r"x: layers must be"),
    ({"speculation": {"k": True}}, r"k must be int"),
]


@pytest.mark.parametrize("raw, message", LOOSE_CONFIGS, ids=[m for _, m in LOOSE_CONFIGS])
def test_loosely_checked_values_are_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndtype = 1")
    with pytest.raises(ConfigError, match=str(bad)):
        load_config(bad)


def test_a_written_config_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(DEFAULT_CONFIG_PATH.read_text().replace("k = 4", "k = 7"))
    cfg: SpindConfig = load_config(path)
    assert cfg.speculation.k == 7 and cfg == load_config(overrides={"speculation": {"k": 7}})


# ---- what runs where: refused at load, naming the fix --------------------------------------------------------------
def on(device: str, **sections) -> dict:
    """A config whose target worker and "draft" worker are on `device`."""
    return {"workers": [{"name": "target", "device": device}, {"name": "draft", "device": device}], **sections}


GPU = {"runtime": {"attention": "packed"}}
DEVICE_REFUSALS = [
    ({"workers": [{"name": "target", "device": "gpu0"}]}, r"\[\[workers\]\] target: device must be \"cpu\", \"cuda\""),
    (on("cuda", model={"dtype": "gguf-q16"}, **GPU),
     r"\[model\] dtype 'gguf-q16' runs on CPU only .* target worker is on cuda: use dtype = \"auto\""),
    (on("cuda:1", model={"dtype": "int4"}, **GPU), r"dtype 'int4' runs on CPU only"),
    (on("cuda:0", runtime={"attention": "invariant"}),
     r"attention \"invariant\" is spind's batch-invariant CPU kernel.* use attention = \"triton-packed\" with cuda_graphs = true"),
    ({"runtime": {"cuda_graphs": True, "attention": "triton-packed"}},
     r"cuda_graphs = true needs the target worker on a CUDA device \(it is on cpu\)"),
    (on("cuda", runtime={"cuda_graphs": True, "attention": "packed"}),
     r"cuda_graphs = true needs an attention mode a CUDA graph can capture"),
    (on("cuda", drafters=[{"name": "dyn8", "kind": "self", "variant": "int8-dynamic", "worker": "draft"}], **GPU),
     r"dyn8: variant 'int8-dynamic' cannot run on worker 'draft' \(cuda\).* use variant = \"int8-weight-only\""),
    (on("cuda", drafters=[{"name": "q", "kind": "self", "variant": "gguf-q16", "worker": "draft"}], **GPU),
     r"q: variant 'gguf-q16' .*spind's GGUF kernels run on CPU only; use variant = \"bf16\""),
    ({"model": {"dtype": "gguf-q16"}, "workers": [{"name": "draft", "device": "cuda"}],
      "drafters": [{"name": "l", "kind": "self", "variant": "layers", "layers": [0, 1], "worker": "draft"}]},
     r"l loads at \[model\] dtype 'gguf-q16', which runs on CPU only, on worker 'draft' \(cuda\)"),
]


@pytest.mark.parametrize("raw, message", DEVICE_REFUSALS, ids=[m for _, m in DEVICE_REFUSALS])
def test_what_cannot_run_on_its_device_is_refused_at_load(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


def test_a_gpu_config_loads(tmp_path: Path) -> None:
    """The shipped config on GPUs: "auto" dtype follows the device, and only the CPU-only drafter must move."""
    text = (DEFAULT_CONFIG_PATH.read_text().replace('device = "cpu"', 'device = "cuda"')
            .replace('attention = "invariant"', 'attention = "packed"'))
    (tmp_path / "gpu.toml").write_text(text)
    with pytest.raises(ConfigError, match="dyn8: variant 'int8-dynamic' cannot run on worker 'draft'"):
        load_config(tmp_path / "gpu.toml")
    (tmp_path / "gpu.toml").write_text(text.replace('variant = "int8-dynamic"', 'variant = "bf16"'))
    cfg = load_config(tmp_path / "gpu.toml")  # int8-weight-only stays: torch's int8 weight-only GEMM runs on CUDA
    assert cfg.worker("draft").device == "cuda" and cfg.drafter("int8").variant == "int8-weight-only"
    # a CPU-only drafter may still serve a GPU target from a CPU worker
    from_dict(on("cuda", drafters=[{"name": "d", "kind": "self", "variant": "int8-dynamic", "worker": "cpu"}],
                 **GPU))


def checkpoint(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(__import__("json").dumps(config))
    return path


def test_auto_dtype_follows_the_device_and_the_checkpoint(tmp_path: Path) -> None:
    gpu = from_dict(on("cuda:0", model={"dtype": "auto"}, **GPU))
    cpu = load_config()
    bf16 = checkpoint(tmp_path / "bf16", torch_dtype="bfloat16")
    fp16 = checkpoint(tmp_path / "fp16", dtype="float16")  # transformers 5 writes `dtype`
    fp32 = checkpoint(tmp_path / "fp32", torch_dtype="float32")
    gguf = checkpoint(tmp_path / "gguf", torch_dtype="float32")  # a GGUF's fp32 copy, as the loader caches it
    (gguf / "complete").write_text("/models/model.Q4_1.gguf")
    assert checkpoint_dtype(fp16) == "float16" and checkpoint_dtype(tmp_path) is None
    assert [resolve_dtype(gpu, d) for d in (bf16, fp16, fp32, gguf)] == ["bfloat16", "float16", "bfloat16", "bfloat16"]
    assert resolve_dtype(gpu, bf16, bf16_supported=False) == "float16"  # a pre-Ampere GPU
    assert [resolve_dtype(cpu, d) for d in (bf16, fp32, gguf)] == ["float32", "float32", "gguf-q16"]
    assert resolve_dtype(gpu, bf16, device="cpu") == "float32"  # a CPU drafter worker beside a GPU target
    explicit = load_config(overrides={"model": {"dtype": "float16"}})
    assert resolve_dtype(explicit, gguf) == "float16"


def test_max_kv_blocks_holds_max_batch_size_requests_of_max_model_len() -> None:
    cfg = from_dict({"model": {"max_model_len": 1000}, "runtime": {"kv_block_size": 16, "max_batch_size": 3}})
    assert max_kv_blocks(cfg) == 63 * 3 and max_kv_blocks(cfg, 16) == 3
