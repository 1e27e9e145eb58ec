"""Drafter descriptions and cost probes."""

from __future__ import annotations

from spind.config import SpindConfig


def describe_drafters(cfg: SpindConfig, measure: bool = False) -> list[dict]:
    """One row per configured drafter; with measure=True, each is loaded and its ms per draft token timed."""
    costs: dict[str, float | None] = {}
    if measure:
        costs = measure_draft_costs(cfg)
    return [{"name": d.name, "kind": d.kind, "variant": d.variant, "worker": d.worker,
             "ms_per_token": costs.get(d.name)} for d in cfg.drafters]


def measure_draft_costs(cfg: SpindConfig, k: int = 4, rounds: int = 3) -> dict[str, float | None]:
    from spind.drafters import DraftInput
    from spind.engine.offline import Runtime
    from spind.sampling import SamplingParams

    rt = Runtime.load(cfg)
    prompt = rt.tokenizer.apply_chat([{"role": "user", "content": "Tell me about the history of Rome."}])
    out: dict[str, float | None] = {}
    for name, drafter in rt.drafters.items():
        drafter.add_request("probe", SamplingParams())
        tokens = list(prompt)
        drafter.propose([DraftInput("probe", tokens, k)])  # warm-up and prefill
        drafter._ms_per_token = None
        for _ in range(rounds):
            d = drafter.propose([DraftInput("probe", tokens, k)])[0]
            tokens = tokens + (d.tokens[:1] or [tokens[-1]])
        drafter.free_request("probe")
        out[name] = drafter.ms_per_token
    return out
