"""The paper's LLaMA setups in configs/ load and validate (CPU: no model is read), and describe what the paper ran:
a LLaMA target on CUDA at the checkpoint's dtype with the five LLaMA SSMs, CUDA graphs over Triton attention."""

from __future__ import annotations

from pathlib import Path

import pytest

from spind.config import TARGET_WORKER, is_cuda, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
PAPER_SSMS = {"llama-68m", "llama-265m", "llama-616m", "llama-1.1b", "llama-1.4b"}


def test_the_paper_setups_are_there() -> None:
    assert {p.stem for p in CONFIGS} >= {"llama-7b", "llama-7b-1gpu", "llama-13b", "llama-30b"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_paper_config_validates_for_the_gpu(path: Path) -> None:
    cfg = load_config(path)
    assert is_cuda(cfg.worker(TARGET_WORKER).device) and cfg.model.dtype == "auto"
    assert cfg.runtime.cuda_graphs and cfg.runtime.attention.startswith("triton-")
    assert cfg.runtime.kv_num_blocks == 0  # sized from free device memory
    models = {d.name for d in cfg.drafters if d.kind == "model"}
    assert models == PAPER_SSMS
    devices = {cfg.worker(d.worker).device for d in cfg.drafters if d.kind == "model"}
    assert all(is_cuda(d) for d in devices)
    if "1gpu" not in path.stem:  # the paper's deployment: each SSM on its own GPU, none beside the target
        assert len(devices) == len(PAPER_SSMS) and cfg.worker(TARGET_WORKER).device not in devices
