"""The transformers systems of `spind bench e2e`: what a user would otherwise run with the same weights.

- `hf-plain`: `model.generate`, greedy or sampled; the closed loop's batch is a static batch (left padded);
- `hf-assisted:NAME`: assisted generation (`assistant_model=`) with the configured drafter NAME as the assistant,
  where transformers can load it: a separate model directory, or the bf16 copy of the target. spind's own
  quantized and layer-subset self-drafts have no transformers equivalent: refused, not approximated;
- `hf-prompt-lookup`: `prompt_lookup_num_tokens=k`, transformers' n-gram drafter.
Assisted generation and prompt lookup take one request at a time (a transformers limit), whatever the batch.
"""

from __future__ import annotations

import os
import time

from spind.bench.e2e_records import E2ESettings, RefusedSystem, RequestRecord, SystemSpec
from spind.bench.report import Progress
from spind.config import SpindConfig


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives (put() sees the prompt first)."""

    def __init__(self) -> None:
        self.calls, self.at = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _assistant(cfg: SpindConfig, name: str, target_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from spind.models.loader import resolve_model_dir

    dc = cfg.drafter(name)
    if dc.kind == "model":
        return AutoModelForCausalLM.from_pretrained(resolve_model_dir(dc.path, cfg.cache_path), local_files_only=True)
    if dc.kind == "self" and dc.variant == "bf16":
        return AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.bfloat16, local_files_only=True)
    hint = "use hf-prompt-lookup, transformers' n-gram drafter" if dc.kind == "ngram" else \
        f"spind's {dc.variant} self-draft has no transformers equivalent"
    raise RefusedSystem(f"hf-assisted:{name}: transformers cannot load drafter {name!r} as an assistant model ({hint})")


def run_hf(cfg: SpindConfig, spec: SystemSpec, prompts: list[list[int]], categories: list[str], s: E2ESettings,
           progress: Progress) -> tuple[list[RequestRecord], float]:
    if s.rate is not None:
        raise RefusedSystem(f"{spec.name}: transformers' generate is no server; it runs the closed loop only")
    import torch
    from transformers import AutoModelForCausalLM

    from spind.models.llama import DTYPES
    from spind.models.loader import resolve_model_dir
    from spind.tokenizer import Tokenizer

    target_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
    eos = sorted(Tokenizer(target_dir).eos_token_ids)
    torch.set_num_threads(os.cpu_count() or 1)  # what a user gets: every core
    # transformers has no 4/8-bit CPU kernels of ours: a quantized target runs there as the fp32 weights it
    # dequantizes to (what transformers itself does when it loads a GGUF)
    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=DTYPES.get(cfg.model.dtype, torch.float32),
                                                 local_files_only=True).eval()
    kwargs = {"max_new_tokens": s.max_tokens, "do_sample": s.temperature > 0, "eos_token_id": eos,
              "pad_token_id": eos[0]}
    if s.temperature > 0:
        kwargs.update(temperature=s.temperature, top_p=1.0, top_k=0)
    batch = s.batch_size
    if spec.name.startswith("hf-assisted:"):
        kwargs["assistant_model"] = _assistant(cfg, spec.hf_drafter, target_dir)
        batch = 1
    elif spec.name == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = s.k
        batch = 1
    records = [RequestRecord(i, categories[i], len(p)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        group = list(range(lo, min(lo + batch, len(prompts))))
        width = max(len(prompts[i]) for i in group)  # left padding, as transformers wants for generation
        ids = torch.tensor([[eos[0]] * (width - len(prompts[i])) + prompts[i] for i in group])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in group])
        streamer = _FirstToken() if batch == 1 else None
        t0 = time.perf_counter()
        if s.temperature > 0:
            torch.manual_seed(s.seed + lo)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, streamer=streamer, **kwargs)
        elapsed = time.perf_counter() - t0
        for row, i in zip(out[:, width:].tolist(), group):
            rec = records[i]
            cut = next((j for j, t in enumerate(row) if t in eos), len(row))
            rec.token_ids = row[:cut]  # no EOS and nothing after it, as spind reports
            rec.finish_reason = "stop" if cut < len(row) else "length"
            rec.arrival_s, rec.latency_s = t0 - start, elapsed
            rec.ttft_s = (streamer.at - t0) if streamer is not None and streamer.at else None
            progress.step(f"{spec.name} #{i}: {len(rec.token_ids)} tokens in {elapsed:.1f}s")
    return records, time.perf_counter() - start
