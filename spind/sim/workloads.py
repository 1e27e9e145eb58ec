"""Synthetic workloads: request classes whose best arm differs, on a machine described by its costs.

- `mixed`: four classes of difficulty (easy, medium, hard, chaotic) whose best arm is a small, medium or
  large drafter, or plain decoding; prompt length and repetition say nothing about the class.
- `cpu-smollm`: this repository's CPU machine (fp32 SmolLM2-135M target, 2 cores; measured numbers in the
  class docstrings): n-gram lookup wins on prompts that repeat a passage, the int8 self-draft on open chat
  at a small k, plain decoding on hard text.
- `gpu-paper`: the paper's setting, LLaMA-7B on a V100 with LLaMA-68M..1.4B drafters, each on its own GPU:
  cost and acceptance rise with size; Alpaca-like requests want larger drafters than ChatGPT-prompt-like
  ones (§II-B, §VII).

Per request, every drafter's acceptance is its class's, moved on the logit scale by the request's own
difficulty (shared by all its drafters) and a little independent noise, so requests of one class differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from spind.coordinator.selection.arms import ArmSet
from spind.coordinator.selection.protocol import AUTO
from spind.sim.workload import Workload, parametric_outcomes


@dataclass(frozen=True)
class DrafterCost:
    draft_s_per_token: float
    prefill_s_per_token: float = 0.0  # KV catch-up after a switch
    miss_s: float = 0.0  # a propose that finds nothing (prompt lookup without a match)


@dataclass(frozen=True)
class Machine:
    step_s: float  # one plain target step, batch 1
    verify_slope: float  # verify of k drafts = step_s * (1 + verify_slope * k)
    batch_slope: float  # seconds at batch b = seconds at batch 1 * (1 + batch_slope * (b - 1))
    drafters: Mapping[str, DrafterCost]
    capacity: Mapping[str, int]
    max_batch_size: int = 16
    time_jitter: float = 0.05


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    acceptance: Mapping[str, float]  # per drafter: per-token acceptance while drafting
    hit: Mapping[str, float] = field(default_factory=dict)  # per drafter: chance of proposing at all (default 1)
    prompt_tokens: tuple[float, float] = (100, 0.6)  # lognormal: median, sigma
    repetition: tuple[float, float] = (1.0, 20.0)  # beta(a, b)
    output_tokens: tuple[float, float] = (150, 0.5)  # lognormal: median, sigma


def generate(name: str, machine: Machine, classes: Sequence[RequestClass], num_requests: int, *,
             k_set: Sequence[int], arrival_rate: float | None, seed: int, difficulty_sigma: float = 0.4,
             noise_sigma: float = 0.15, num_tokens: int | None = None) -> Workload:
    """num_requests requests drawn from the classes; Poisson arrivals at arrival_rate per slot (None: all at
    slot 0); num_tokens overrides every request's output length (a very large one: requests never finish)."""
    rng = np.random.default_rng(seed)
    drafters = list(machine.drafters)
    shares = np.array([c.share for c in classes])
    klass = rng.choice(len(classes), size=num_requests, p=shares / shares.sum())
    logit = np.array([[_logit(c.acceptance[d]) for d in drafters] for c in classes])  # [C, D]
    shift = (rng.normal(0, difficulty_sigma, (num_requests, 1))  # [R, D]: the request's difficulty, plus noise
             + rng.normal(0, noise_sigma, (num_requests, len(drafters))))
    acceptance = 1 / (1 + np.exp(-(logit[klass] - shift)))  # [R, D]
    hit = np.array([[c.hit.get(d, 1.0) for d in drafters] for c in classes])[klass]
    costs = [machine.drafters[d] for d in drafters]
    arm_set = ArmSet(drafters, k_set)
    outcomes = parametric_outcomes(arm_set, acceptance, hit, np.array([c.draft_s_per_token for c in costs]),
                                   np.array([c.miss_s for c in costs]), machine.step_s, machine.verify_slope)

    def per_class(draw) -> np.ndarray:
        return np.array([draw(classes[c]) for c in klass])

    prompt = per_class(lambda c: rng.lognormal(np.log(c.prompt_tokens[0]), c.prompt_tokens[1])).astype(int) + 1
    repetition = per_class(lambda c: rng.beta(*c.repetition))
    output = (np.full(num_requests, num_tokens) if num_tokens is not None else
              per_class(lambda c: rng.lognormal(np.log(c.output_tokens[0]), c.output_tokens[1])).astype(int) + 1)
    arrival = (np.zeros(num_requests, dtype=int) if arrival_rate is None else
               np.floor(np.cumsum(rng.exponential(1 / arrival_rate, num_requests))).astype(int))
    return Workload(name=name, arm_set=arm_set, req_ids=[f"{name}-{i}" for i in range(num_requests)],
                    arrival_slot=arrival, num_tokens=output, num_prompt_tokens=prompt, prompt_repetition=repetition,
                    requested=[AUTO] * num_requests, labels=[classes[c].name for c in klass], outcomes=outcomes,
                    prefill_s_per_token=np.array([c.prefill_s_per_token for c in costs]),
                    capacity=dict(machine.capacity), max_batch_size=machine.max_batch_size,
                    batch_slope=machine.batch_slope, time_jitter=machine.time_jitter)


def _logit(p: float) -> float:
    return float(np.log(p / (1 - p)))


MIXED = Machine(step_s=0.030, verify_slope=0.05, batch_slope=0.04, drafters={
    "small": DrafterCost(0.002, 2e-5), "medium": DrafterCost(0.006, 6e-5), "large": DrafterCost(0.012, 1.2e-4)},
    capacity={"small": 16, "medium": 8, "large": 4})
MIXED_CLASSES = (
    RequestClass("easy", 0.25, {"small": 0.88, "medium": 0.9, "large": 0.92}),
    RequestClass("medium", 0.25, {"small": 0.45, "medium": 0.88, "large": 0.9}),
    RequestClass("hard", 0.25, {"small": 0.25, "medium": 0.5, "large": 0.9}),
    RequestClass("chaotic", 0.25, {"small": 0.08, "medium": 0.12, "large": 0.2}),
)

# Measured here, fp32 SmolLM2-135M target on 2 CPU cores, batch 1: a plain step 56-69 ms; a 5-token verify
# 1.5-1.7 steps; draft cost per token: ngram 0.06 ms, int8 35 ms, dyn8 25 ms, bf16 56 ms; acceptance: ngram
# 0.14 on open chat and 0.38 on passages to repeat, int8 0.93, dyn8 0.57, bf16 0.97.
CPU_SMOLLM = Machine(step_s=0.062, verify_slope=0.15, batch_slope=0.07, drafters={
    "ngram": DrafterCost(6e-5, 0.0, 1e-4), "int8": DrafterCost(0.035, 0.0015),
    "dyn8": DrafterCost(0.025, 0.0012), "bf16": DrafterCost(0.056, 0.0025)},
    capacity={"ngram": 16, "int8": 16, "dyn8": 16, "bf16": 16})
CPU_SMOLLM_CLASSES = (
    RequestClass("chat", 0.5, {"ngram": 0.35, "int8": 0.93, "dyn8": 0.6, "bf16": 0.97}, {"ngram": 0.3},
                 prompt_tokens=(60, 0.6), repetition=(1, 20), output_tokens=(150, 0.5)),
    RequestClass("passage", 0.3, {"ngram": 0.8, "int8": 0.95, "dyn8": 0.65, "bf16": 0.98}, {"ngram": 0.6},
                 prompt_tokens=(500, 0.4), repetition=(6, 8), output_tokens=(200, 0.4)),
    RequestClass("hard", 0.2, {"ngram": 0.4, "int8": 0.8, "dyn8": 0.45, "bf16": 0.9}, {"ngram": 0.35},
                 prompt_tokens=(150, 0.6), repetition=(2, 12), output_tokens=(150, 0.5)),
)

# LLaMA-7B fp16 on a V100: ~25 ms a step, verify nearly flat in k; drafters on their own GPUs.
GPU_PAPER = Machine(step_s=0.025, verify_slope=0.02, batch_slope=0.03, drafters={
    "llama-68m": DrafterCost(0.0015, 2e-6), "llama-265m": DrafterCost(0.003, 5e-6),
    "llama-616m": DrafterCost(0.005, 1e-5), "llama-1.1b": DrafterCost(0.008, 2e-5),
    "llama-1.4b": DrafterCost(0.011, 3e-5)},
    capacity={d: 8 for d in ("llama-68m", "llama-265m", "llama-616m", "llama-1.1b", "llama-1.4b")}, max_batch_size=8)
_SIZE_LOGIT = {"llama-68m": 0.0, "llama-265m": 1.0, "llama-616m": 1.6, "llama-1.1b": 2.4, "llama-1.4b": 2.5}
GPU_PAPER_CLASSES = tuple(
    RequestClass(name, share, {d: float(1 / (1 + np.exp(-(q - difficulty)))) for d, q in _SIZE_LOGIT.items()},
                 prompt_tokens=(length, 0.7), output_tokens=(200, 0.5))
    for name, share, difficulty, length in (("alpaca", 1 / 3, 1.4, 40), ("cp", 1 / 3, -0.8, 80),
                                            ("cip", 1 / 3, 0.3, 30)))

WORKLOADS = {"mixed": (MIXED, MIXED_CLASSES), "cpu-smollm": (CPU_SMOLLM, CPU_SMOLLM_CLASSES),
             "gpu-paper": (GPU_PAPER, GPU_PAPER_CLASSES)}
# requests per slot that keep each machine busy, about half its batch limit, without a growing queue
ARRIVAL_RATE = {"mixed": 0.15, "cpu-smollm": 0.08, "gpu-paper": 0.08}


def build_workload(name: str, num_requests: int, *, k_set: Sequence[int], arrival_rate: float | None,
                   seed: int = 0, num_tokens: int | None = None) -> Workload:
    """A named workload (see `generate`); ARRIVAL_RATE holds a busy but stable rate for each."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    machine, classes = WORKLOADS[name]
    return generate(name, machine, classes, num_requests, k_set=k_set, arrival_rate=arrival_rate, seed=seed,
                    num_tokens=num_tokens)
