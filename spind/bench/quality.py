"""Measures `spind bench decode` prints beside its timings: how close a target's outputs are to a reference target
(top-1 agreement, perplexity), the machine's memory bandwidth (a decode step's byte floor), and the time to first
token of a long prompt.

The quality text is AlpacaEval's reference outputs (instruction + answer, `alpaca_eval` in the shared datasets):
natural prose and code nobody tuned spind on, cut into windows of `window` tokens; every position of a window is
scored (its logits against the reference's argmax, and the next token's log-probability).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from spind.kernels import cpu_ext
from spind.models.llama import LlamaModel
from spind.models.runner import ForwardItem, ModelRunner

QUALITY_DATASET = "alpaca_eval/text_davinci_003_model_outputs.json"


def quality_windows(tokenizer, datasets_dir: Path, min_positions: int, window: int = 512) -> list[list[int]]:
    """Token windows of AlpacaEval's outputs covering at least `min_positions` scored positions."""
    path = datasets_dir / QUALITY_DATASET
    if not path.is_file():
        raise FileNotFoundError(f"quality text not found: {path} (the shared datasets' alpaca_eval)")
    records = json.loads(path.read_text())
    windows: list[list[int]] = []
    stream: list[int] = []
    for r in records:
        stream += tokenizer.encode(f"{r['instruction']}\n\n{r['output']}\n\n")
        while len(stream) >= window:
            windows.append(stream[:window])
            stream = stream[window:]
        if sum(len(w) - 1 for w in windows) >= min_positions:
            return windows
    raise ValueError(f"{path} has fewer than {min_positions} tokens")


@torch.inference_mode()
def window_logits(model: LlamaModel, window: list[int], attention: str, block_size: int,
                  kv_cache_dtype: str = "auto") -> torch.Tensor:
    """fp32 logits of every position of `window`, one prefill."""
    runner = ModelRunner(model, -(-len(window) // block_size), block_size, attention, kv_cache_dtype=kv_cache_dtype)
    runner.add_request("q")
    return runner.forward([ForwardItem("q", window, len(window))])[0]


def compare_quality(models: dict[str, LlamaModel], reference: str, windows: list[list[int]], attention: str,
                    block_size: int) -> dict[str, dict]:
    """Per target as served (its KV cache `auto`): positions scored, share of positions whose argmax equals the
    reference's, perplexity of the text (next-token), and that perplexity over the reference's. The reference runs
    with an fp32 KV cache, so a target's row also counts what its fp16 cache costs (the reference's own row too)."""
    nll = {name: 0.0 for name in models}
    agree = {name: 0 for name in models}
    positions, nll_exact = 0, 0.0
    for window in windows:
        targets = torch.tensor(window[1:])
        logits = {name: window_logits(m, window, attention, block_size)[:-1] for name, m in models.items()}
        exact = window_logits(models[reference], window, attention, block_size, "float32")[:-1]
        top1 = exact.argmax(-1)
        nll_exact += float(-torch.log_softmax(exact.double(), -1).gather(1, targets[:, None]).sum())
        for name, lg in logits.items():
            agree[name] += int((lg.argmax(-1) == top1).sum())
            nll[name] += float(-torch.log_softmax(lg.double(), -1).gather(1, targets[:, None]).sum())
        positions += len(window) - 1
    ppl = {name: math.exp(nll[name] / positions) for name in models}
    ppl_exact = math.exp(nll_exact / positions)
    return {name: {"positions": positions, "top1_agreement": agree[name] / positions, "perplexity": ppl[name],
                   "perplexity_ratio": ppl[name] / ppl_exact} for name in models}


def memory_bandwidth(megabytes: int = 512, rounds: int = 5) -> dict[str, float]:
    """GB/s at torch's current thread count: `memcpy` (bytes copied per second by a tensor copy), and `read` (a
    sum over a tensor on the same huge-page memory the packed weights use, when the kernels are built)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    source = cpu_ext.ops().huge_page_copy(src) if cpu_ext.available() else src
    nbytes = src.numel() * 4
    copy, read = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - start)
        start = time.perf_counter()
        source.sum()
        read.append(time.perf_counter() - start)
    return {"memcpy_gbps": nbytes / statistics.median(copy) / 1e9, "read_gbps": nbytes / statistics.median(read) / 1e9}


@torch.inference_mode()
def time_first_token(model: LlamaModel, prompt: list[int], attention: str, block_size: int, rounds: int = 3) -> float:
    """Median ms from a prompt to its first token's logits (one chunk-free prefill)."""
    times = []
    for _ in range(rounds):
        runner = ModelRunner(model, -(-(len(prompt) + 1) // block_size), block_size, attention)
        runner.add_request("ttft")
        start = time.perf_counter()
        runner.forward([ForwardItem("ttft", prompt, 1)])[0].argmax()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
