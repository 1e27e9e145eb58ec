"""Counterfactual n-gram drafts: the incremental index equals a direct search, shadow drafts are decided
exactly by the committed tokens, and LBSS learns a request's n-gram acceptance from them without running it."""

from __future__ import annotations

import random

import numpy as np

from spind.config import SelectionConfig
from spind.coordinator.selection.lbss import LBSSSelector
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.coordinator.selection.shadow import ShadowDrafts
from spind.ngram_index import NgramIndex


def direct_lookup(tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The definition, searched from scratch: tokens after the latest earlier match of the longest suffix."""
    seq = np.asarray(tokens)
    for n in range(min(ngram_max, len(seq) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


def test_incremental_index_equals_the_direct_search_at_every_length():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(rng.choice([3, 10, 50])) for _ in range(rng.randint(1, 80))]
        index = NgramIndex(3, 1)
        for i, tok in enumerate(tokens):
            index.extend([tok])
            for k in (1, 4, 8):
                assert index.lookup(k) == direct_lookup(tokens[:i + 1], k, 3, 1)


def test_shadow_drafts_are_decided_by_the_committed_tokens():
    shadows = ShadowDrafts({"ng": (3, 1)}, k=4)
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # the suffix 1 2 3 occurred before, followed by 4 5 9 1
    shadows.draft("r", prompt)
    assert shadows.resolve("r", prompt + [4]) == []  # one token matched, three undecided
    assert shadows.resolve("r", prompt + [4, 5, 7]) == [("ng", 4, 2)]  # mismatch at the third
    shadows.draft("r", prompt + [4, 5, 7])  # nothing earlier matches "7": an empty proposal
    assert shadows.resolve("r", prompt + [4, 5, 7, 8]) == [("ng", 0, 0)]
    shadows.draft("r", prompt + [4, 5, 7, 8], exclude="ng")  # the request runs n-gram itself: no shadow
    assert shadows.resolve("r", prompt + [4, 5, 7, 8, 1]) == []
    shadows.draft("r", prompt + [4, 5, 7, 8, 1])
    assert shadows.resolve("r", prompt + [4, 5, 7, 8, 1, 2], is_final=True) == [("ng", 1, 1)]  # cut short
    shadows.remove("r")
    assert shadows.resolve("r", prompt) == []


def test_lbss_learns_a_requests_ngram_acceptance_from_shadows_alone():
    """Two requests that never ran n-gram: the one whose shadows were all accepted is estimated far above the
    one whose shadows all failed."""
    sel = LBSSSelector(SelectionConfig(alpha=1, beta=1, prior_strength=4.0, seed=0), ["ng", "m"], 4)

    def req(req_id: str, requested: str, k: int | None) -> RequestInfo:
        return RequestInfo(req_id=req_id, requested=requested, requested_k=k, current=None, num_prompt_tokens=100,
                           num_output_tokens=0)

    def fb(req_id: str, arm: Arm, drafted: int, accepted: int, draft_s: float,
           shadow: tuple[tuple[str, int, int], ...] = ()) -> SlotFeedback:
        return SlotFeedback(req_id=req_id, arm=arm, num_drafted=drafted, num_accepted=accepted,
                            num_committed=accepted + 1, draft_s=draft_s, verify_s=0.1, shadow=shadow)

    reqs = [req(r, "auto", None) for r in ("copy", "chat")]
    reqs.append(req("other", "ng", 8))  # names n-gram: the population learns its timing
    cap = Capacity({"ng": 8, "m": 8})
    for slot in range(6):  # both run the model drafter; shadows say n-gram fits one and not the other
        sel.select(reqs, cap)
        sel.observe([fb("copy", Arm("m", 4), 4, 4, 0.2, shadow=(("ng", 8, 8),)),
                     fb("chat", Arm("m", 4), 4, 4, 0.2, shadow=(("ng", 8, 0),)),
                     fb("other", Arm("ng", 8), 8, 2, 0.0)])  # timing of the n-gram arm
    g = {r: v["estimate"] for r, v in sel.describe()["requests"].items()}
    assert g["copy"]["ng@8"] > 3 * g["chat"]["ng@8"] > 0
    assert g["copy"]["ng@8"] > g["copy"]["m@4"]  # free and always accepted beats its own model drafter
    assert PLAIN_ARM.name in g["copy"]


def test_shadow_evidence_outweighs_a_few_unlucky_slots_on_the_arm():
    """A request that ran n-gram for a few slots early, where it found nothing to copy, then decoded plainly while
    its shadow drafts were accepted on every slot: its expected tokens on n-gram follow the shadows (the model of
    its own acceptance), not the mean of those first slots."""
    sel = LBSSSelector(SelectionConfig(alpha=1, beta=1, prior_strength=4.0, seed=0), ["ng"], 4)
    req = RequestInfo(req_id="r", requested="auto", requested_k=None, current=None, num_prompt_tokens=100,
                      num_output_tokens=0)
    cap = Capacity({"ng": 8})

    def fb(arm: Arm, drafted: int, accepted: int, shadow=()) -> SlotFeedback:
        return SlotFeedback(req_id="r", arm=arm, num_drafted=drafted, num_accepted=accepted,
                            num_committed=accepted + 1, draft_s=0.0, verify_s=0.01, shadow=shadow)

    sel.select([req], cap)
    for _ in range(4):  # unlucky: n-gram drafted nothing, or drafted wrong
        sel.observe([fb(Arm("ng", 4), 0, 0)])
    for _ in range(40):  # plain slots whose shadow drafts were all accepted
        sel.observe([fb(Arm(None, 0), 0, 0, shadow=(("ng", 4, 4),))])
    tokens = sel.describe()["requests"]["r"]["tokens"]
    assert tokens["ng@4"] > 3.0 and tokens["none"] == 1.0  # its own mean on the arm is 1 token; the shadows say ~5
