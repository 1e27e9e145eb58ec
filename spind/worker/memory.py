"""How many KV blocks a worker's models get ([runtime].kv_num_blocks; 0 = auto).

Every model a worker hosts (the target, each model drafter) gets a pool of the same number of blocks: a request
holds as many blocks in each model it runs on, so equal pools fill together. "auto":
- on CPU, as many as max_batch_size requests of max_model_len tokens fill (`max_kv_blocks`): 2048 for the shipped
  config, as before (CPU pools commit pages only as blocks get used);
- on CUDA, vLLM's rule: after the models are loaded and one forward of the largest batch has run (its peak
  activations measured by torch's allocator), what is left of gpu_memory_utilization of the device's memory,
  split evenly between the workers on that device, in blocks of all the models' K and V together; never more than
  the CPU rule's number, which is all the requests can use.
"""

from __future__ import annotations

import logging

import torch

from spind.config import SpindConfig, canonical_device, is_cuda, max_kv_blocks
from spind.coordinator.placement import worker_names
from spind.models.llama import LlamaModel
from spind.models.runner import ForwardItem, ModelRunner

log = logging.getLogger(__name__)

# Device memory torch's allocator never sees: the CUDA context, cuBLAS / cuDNN handles, Triton's modules. Measured
# at 0.5-0.7 GiB on H100s; rounded up, as the 1 - gpu_memory_utilization left over is other processes' to use.
NON_TORCH_BYTES = 1 << 30
GiB = float(1 << 30)


def kv_block_bytes(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of one KV block of `model` (K and V of every layer; spind/models/kv_cache.py's layout)."""
    a = model.args
    return 2 * len(model.layers) * block_size * a.num_kv_heads * a.head_dim * dtype.itemsize


def auto_num_blocks(total_bytes: int, used_bytes: int, utilization: float, block_bytes: int, max_blocks: int) -> int:
    """KV blocks in what `utilization` of a device's `total_bytes` leaves after `used_bytes` (weights, peak
    activations, the CUDA context), at `block_bytes` a block (every hosted model's), at most `max_blocks`."""
    budget = utilization * total_bytes - used_bytes
    blocks = int(budget // block_bytes) if budget > 0 else 0
    if blocks < 1:
        raise ValueError(f"no device memory left for the KV cache: the models and activations take "
                         f"{used_bytes / GiB:.2f} GiB of the {utilization * total_bytes / GiB:.2f} GiB this worker may "
                         f"use ({utilization:.3g} of {total_bytes / GiB:.1f} GiB); raise [runtime] "
                         f"gpu_memory_utilization, give the worker a GPU of its own, or set [runtime] kv_num_blocks")
    return min(blocks, max_blocks)


def device_share(cfg: SpindConfig, name: str) -> float:
    """The part of a device's memory the worker `name` may fill: gpu_memory_utilization over the workers on it."""
    mine = canonical_device(cfg.worker(name).device)
    sharing = sum(canonical_device(cfg.worker(w).device) == mine for w in worker_names(cfg))
    return cfg.runtime.gpu_memory_utilization / sharing


def memory_baseline(device: str) -> int:
    """Device bytes this process holds before a worker loads anything (call it first; 0 on CPU): the in-process pool
    loads several workers into one process, one after the other, and each must count only its own."""
    if not is_cuda(device):
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def num_kv_blocks(cfg: SpindConfig, name: str, device: str, models: list[tuple[LlamaModel, torch.dtype]],
                  max_model_len: int, baseline: int = 0) -> int:
    """The block count of every KV pool on worker `name` (on `device`), whose models (with their KV dtypes) are
    loaded and have no cache yet; `baseline`: memory_baseline() before they were."""
    r = cfg.runtime
    if r.kv_num_blocks:
        return r.kv_num_blocks
    cap = max_kv_blocks(cfg, max_model_len)
    if not is_cuda(device) or not models:
        return cap
    dev = torch.device(device)
    tokens = max(r.max_prefill_tokens, r.max_batch_size * (max((cfg.speculation.k, *cfg.selection.k_set)) + 1))
    for model, _ in models:
        _peak_forward(model, min(tokens, max_model_len), r.kv_block_size, r.attention)
    total = torch.cuda.get_device_properties(dev).total_memory
    used = torch.cuda.max_memory_reserved(dev) - baseline + NON_TORCH_BYTES
    block_bytes = sum(kv_block_bytes(m, r.kv_block_size, dtype) for m, dtype in models)
    blocks = auto_num_blocks(total, used, device_share(cfg, name), block_bytes, cap)
    log.info("worker %s: %d KV blocks per model (%.2f GiB) on %s; models and activations take %.2f GiB", name, blocks,
             blocks * block_bytes / GiB, device, used / GiB)
    return blocks


def _peak_forward(model: LlamaModel, num_tokens: int, block_size: int, attention: str) -> None:
    """One forward of the largest batch of tokens a slot sends, every row's logits (a verify's), over a throw-away
    cache just big enough: torch's allocator then holds the peak of the activations in max_memory_reserved. Its
    context is short: what attention gathers per layer over long contexts (torch backends), and CUDA graphs' pools,
    come out of the 1 - gpu_memory_utilization left over."""
    runner = ModelRunner(model, -(-num_tokens // block_size), block_size, attention, max_batch=1,
                         max_tokens=num_tokens)
    runner.add_request("\x00memory")
    tokens = [i % model.args.vocab_size for i in range(num_tokens)]
    runner.forward([ForwardItem("\x00memory", tokens, num_tokens)])
    torch.cuda.synchronize(model.device)
