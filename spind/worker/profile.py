"""What a worker's models cost, measured on the worker itself (at start-up, or cached by the coordinator):
- each hosted drafter: median ms per draft token at batch 1 in steady state;
- the target: median ms of a verify forward at several batch sizes (k + 1 new tokens per request over a
  fixed context, or for one of the requests only), the throughput profile the pipeline's micro-batch heuristic and
  the selection's verify-cost model read.

Probes run on throw-away requests whose ids cannot clash with real ones, and are freed afterwards. Times come from
a DeviceClock (each drafter's own, the runner's device's), so a GPU's queued kernels are waited for.
"""

from __future__ import annotations

import statistics

from spind.drafters import Drafter, DraftInput
from spind.models.runner import ForwardItem, ModelRunner
from spind.params import SamplingParams
from spind.worker.device import DeviceClock

PROBE = "\x00profile"  # a request id no client can send (ReqId forbids nothing, but the prefix is reserved)


def probe_prompt(length: int, vocab: int) -> list[int]:
    """A deterministic, unrepetitive token sequence (n-gram lookup finds nothing to copy in it)."""
    return [(i * 7919 + 13) % (vocab - 2) + 1 for i in range(length)]


def time_draft_tokens(drafters: dict[str, Drafter], prompt: list[int], k: int,
                      rounds: int) -> dict[str, float | None]:
    """Median ms per drafted token at batch 1. Each round commits the drafter's first token, as an accepted
    draft would, and times one propose of k (None: the drafter never proposed anything)."""
    seqs = {name: list(prompt) for name in drafters}
    samples: dict[str, list[float]] = {name: [] for name in drafters}
    for name, drafter in drafters.items():
        drafter.add_request(PROBE, SamplingParams())
        # each round appends one token: a head's features cover them (its cost does not depend on which tokens)
        drafter.prepare_probe(PROBE, prompt + prompt[:rounds + 1])
        drafter.propose([DraftInput(PROBE, seqs[name], k)])  # prefill + warm-up, not timed
    try:
        for _ in range(rounds):
            for name, drafter in drafters.items():  # interleaved: every drafter sees the same machine load
                start = drafter.clock.now()
                tokens = drafter.propose([DraftInput(PROBE, seqs[name], k)])[0].tokens
                if tokens:
                    samples[name].append((drafter.clock.now() - start) * 1e3 / len(tokens))
                seqs[name].append(tokens[0] if tokens else prompt[len(seqs[name]) % len(prompt)])
    finally:
        for drafter in drafters.values():
            drafter.free_request(PROBE)
    return {name: statistics.median(s) if s else None for name, s in samples.items()}


def time_verify(runner: ModelRunner, batch_sizes: list[int], context: int, k: int, reps: int,
                clock: DeviceClock | None = None, drafting: int = 0) -> dict[int, float]:
    """Median ms of one forward of k + 1 new tokens for each of B requests holding `context` tokens of KV (for the first
    `drafting` of them where that is not 0, and one new token for the others), rolled back after each rep, for each B in
    batch_sizes. The context is prefilled once and shared by every probe request (forked KV blocks, as `n` completions
    share a prompt): prefilling each of them cost the first start ~2 s of a 16-request profile on a 2-core CPU, for the
    same numbers (attention reads the same amount of KV)."""
    clock = clock or DeviceClock(runner.model.device)
    vocab = runner.model.args.vocab_size
    ids = [f"{PROBE}-{i}" for i in range(max(batch_sizes, default=0))]
    prompt = probe_prompt(context, vocab)
    if not ids:
        return {}
    runner.add_request(ids[0])
    forked = ids[:1]
    try:
        runner.forward([ForwardItem(ids[0], prompt, 0)])
        for rid in ids[1:]:
            runner.fork(ids[0], rid)
            forked.append(rid)
        out = {}
        for b in batch_sizes:
            samples = []
            for _ in range(reps + 1):  # the first rep warms this shape up
                start = clock.now()
                runner.forward([ForwardItem(rid, prompt[:n], n) for i, rid in enumerate(ids[:b])
                                for n in [k + 1 if not drafting or i < drafting else 1]])
                samples.append((clock.now() - start) * 1e3)
                for rid in ids[:b]:
                    runner.truncate(rid, context)
            out[b] = statistics.median(samples[1:])
        return out
    finally:
        for rid in forked:
            runner.free_request(rid)
