"""Every torch attention mode through the real model (SmolLM2-135M, fp32): the same greedy output under
batched speculative verification with ragged drafts as plain greedy decoding (logits of every mode at a
mixed step: tests/test_models.py).

Runs through `ModelRunner`/`ForwardItem` only (the runner's public surface), with prompts of its own.
"""

from __future__ import annotations

import pytest

from spind.coordinator.transport.local import LocalEngine
from spind.kernels.attention import TORCH_BACKENDS
from spind.models.runner import ForwardItem, ModelRunner
from spind.tokenizer import Tokenizer

PARAGRAPH = ("The committee met on Tuesday to review the budget. The budget covers roads, schools and parks, "
             "and the committee asked for a second review of the parks budget before the vote. ")
PROMPTS = ["Hi", "List three prime numbers.", "Repeat this text exactly:\n\n" + PARAGRAPH * 6]
NUM_STEPS, K = 10, 4


def propose(seq: list[int], k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the previous occurrence of the last two tokens (maybe none),
    so requests bring drafts of different lengths, some right, some wrong."""
    for i in range(len(seq) - 3, 0, -1):
        if seq[i - 1:i + 1] == seq[-2:]:
            return seq[i + 1:i + 1 + k]
    return []


def speculative_greedy(runner: ModelRunner, prompts: list[list[int]], k: int, num_steps: int,
                       tag: str) -> list[list[int]]:
    """Batched greedy decoding; each step verifies every request's drafts in one forward and rolls back
    the rejected ones. k = 0 is plain greedy decoding."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid in rids:
        runner.add_request(rid)
    try:
        logits = runner.forward([ForwardItem(rid, ids) for rid, ids in zip(rids, prompts)])
        seqs = [list(ids) + [int(lg[-1].argmax())] for ids, lg in zip(prompts, logits)]
        for _ in range(num_steps):
            drafts = [propose(seq, k) if k else [] for seq in seqs]
            items = [ForwardItem(rid, [seq[-1], *d], len(d) + 1) for rid, seq, d in zip(rids, seqs, drafts)]
            for rid, seq, draft, lg in zip(rids, seqs, drafts, runner.forward(items)):
                picks = lg.argmax(-1).tolist()  # [len(draft) + 1]
                accepted = 0
                while accepted < len(draft) and picks[accepted] == draft[accepted]:
                    accepted += 1
                runner.truncate(rid, len(seq) + accepted)  # KV of the fed token and the accepted drafts
                seq.extend(draft[:accepted] + [picks[accepted]])
        return [seq[len(ids):] for seq, ids in zip(seqs, prompts)]
    finally:
        for rid in rids:
            runner.free_request(rid)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    ids = [tokenizer.apply_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len(ids[0]) < 40 < 200 < len(ids[-1])  # a short and a long context in one batch
    return ids


def test_every_mode_decodes_like_plain_greedy_under_ragged_verification(engine: LocalEngine,
                                                                        prompt_ids: list[list[int]]) -> None:
    model = engine.target.runner.model
    outputs = {mode: speculative_greedy(ModelRunner(model, 128, 16, mode), prompt_ids, K, NUM_STEPS, mode)
               for mode in TORCH_BACKENDS}
    longest = max(len(o) for out in outputs.values() for o in out)
    assert longest > 2 * NUM_STEPS  # drafts were accepted: steps verified several tokens per request
    plain = speculative_greedy(ModelRunner(model, 128, 16, "padded"), prompt_ids, 0, longest, "plain")
    for mode, out in outputs.items():
        assert out == [p[:len(o)] for p, o in zip(plain, out)], mode
