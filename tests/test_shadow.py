"""Counterfactual drafts of the free drafters: the incremental n-gram index equals a direct search, shadow drafts
are decided exactly by the committed tokens, the target's worker drafts them with the verify, and LBSS learns a
request's acceptance from them without running the drafter."""

from __future__ import annotations

import random

import numpy as np

from spind.config import SelectionConfig
from spind.coordinator.selection.lbss import LBSSSelector
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.coordinator.selection.shadow import SHADOW_K, Decided, ShadowDrafts, is_shadow_turn
from spind.draft_cut import CutRule
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


def test_shadow_turns_come_to_one_request_a_slot_in_turn():
    for batch in (1, 2, 3, 4, 16):
        turns = [[is_shadow_turn(count, i, batch) for i in range(batch)] for count in range(1, 49)]
        period = batch
        for i in range(batch):  # each request in turn, every period-th slot (at batch 1 every slot)
            mine = [count for count, row in enumerate(turns) if row[i]]
            assert len(mine) == 48 // period and all(b - a == period for a, b in zip(mine, mine[1:]))
        assert all(sum(row) <= 1 for row in turns)  # one request's shadow drafts a slot at most
        assert sum(map(sum, turns)) == 48 // period * batch


def test_shadow_drafts_are_decided_by_the_committed_tokens():
    shadows = ShadowDrafts()
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    shadows.add("r", len(prompt), {"ng": [4, 5, 9, 1], "sfx": [4, 5]},  # what the worker drafted after the prompt
                {"sfx": [0.9, 0.6]})  # with suffix's confidence per token
    assert shadows.resolve("r", prompt + [4]) == []  # one token matched, the rest undecided
    assert sorted(shadows.resolve("r", prompt + [4, 5, 7])) == [Decided("ng", 4, 2),
                                                                Decided("sfx", 2, 2, (0.9, 0.6))]  # a mismatch; all
    shadows.add("r", len(prompt) + 3, {"ng": []})  # nothing to propose: decided at once, as an empty proposal
    assert shadows.resolve("r", prompt + [4, 5, 7]) == [Decided("ng", 0, 0)]
    shadows.add("r", len(prompt) + 3, {})  # the request ran n-gram itself: no shadow
    assert shadows.resolve("r", prompt + [4, 5, 7, 8]) == []
    shadows.add("r", len(prompt) + 4, {"ng": [1, 2, 3]}, {"ng": [0.5, 0.4, 0.3]})
    assert shadows.resolve("r", prompt + [4, 5, 7, 8, 1, 2], is_final=True) == [Decided("ng", 2, 2, (0.5, 0.4))]
    shadows.add("r", 0, {"ng": [1]})  # ^ cut short: the decided tokens' confidences
    shadows.remove("r")
    assert shadows.resolve("r", prompt) == []
    shadows.add("r", len(prompt), {"ng": [4]}, slot=(3, "sfx"))  # drafted at a slot that ran suffix, 3 tokens
    assert shadows.resolve("r", prompt + [4]) == [Decided("ng", 1, 1, (), (3, "sfx"))]


def test_a_drafter_drafts_again_once_its_last_draft_is_decided_and_then_stands_at_its_own_slot():
    """Pacing at batch 1: a drafter is due for a request while none of its shadow drafts is undecided, and a draft
    drafted at the tokens its drafter's last one was decided at stands at its drafter's own slot (the ledger weighs it
    as one); drafted anywhere else, or past batch 1, it stands at the slot it was drafted at."""
    shadows = ShadowDrafts()
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    one = {"every_slot": True}
    assert shadows.due("r", ["ng", "sfx"], **one) == ["ng", "sfx"]
    shadows.add("r", 9, {"ng": [4, 5, 9, 1], "sfx": [4, 7]}, slot=(1, ""), **one)  # a plain slot: 1 token
    assert shadows.due("r", ["ng", "sfx"], **one) == []
    assert shadows.due("r", ["ng", "sfx"]) == ["ng", "sfx"]  # past batch 1 every turn drafts both
    assert shadows.resolve("r", prompt + [4]) == []  # both undecided
    assert shadows.resolve("r", prompt + [4, 5]) == [Decided("sfx", 2, 1, (), (1, ""))]  # its first token, then not
    assert shadows.due("r", ["ng", "sfx"], **one) == ["sfx"]  # n-gram's still undecided: not drafted again
    shadows.add("r", 11, {"sfx": [9]}, slot=(2, "ng"), **one)  # where suffix's last draft was decided: paced, at a
    decided = shadows.resolve("r", prompt + [4, 5, 9, 1])     # slot that ran n-gram
    assert sorted(decided) == [Decided("ng", 4, 4, (), (1, "")), Decided("sfx", 1, 1, (), (2, "sfx"))]
    shadows.add("r", 14, {"ng": [2], "sfx": [2]}, slot=(1, ""), **one)  # a token past where both were decided: fresh
    assert sorted(shadows.resolve("r", prompt + [4, 5, 9, 1, 7, 2])) == [Decided("ng", 1, 1, (), (1, "")),
                                                                       Decided("sfx", 1, 1, (), (1, ""))]
    shadows.add("r", 15, {"ng": [3]}, slot=(1, ""))  # where n-gram's last was decided, but past batch 1: not paced
    assert shadows.resolve("r", prompt + [4, 5, 9, 1, 7, 2, 3]) == [Decided("ng", 1, 1, (), (1, ""))]
    shadows.remove("r")
    shadows.add("r", 16, {"ng": [4]}, slot=(1, ""), **one)  # a removed request starts over: nothing paced
    assert shadows.resolve("r", prompt + [4, 5, 9, 1, 7, 2, 3, 4]) == [Decided("ng", 1, 1, (), (1, ""))]


def test_a_turn_chosen_ahead_of_the_slot_in_flight_asks_every_drafter_and_keeps_the_paced_drafts():
    """The lockstep's follow-on selects the next slot before the slot in flight commits, so which drafters' last
    drafts that slot decides is not known yet: every drafter is asked (`due(ahead=True)`), and at batch 1 a draft of a
    drafter whose last draft is still undecided when it comes back is dropped (`add` returns the drafters kept), while
    one whose last draft the slot in flight decided stands at its drafter's own slot, as a paced one does."""
    shadows = ShadowDrafts()
    prompt = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    one = {"every_slot": True}
    assert shadows.add("r", 9, {"ng": [4, 5, 9, 1], "sfx": [4, 7]}, slot=(1, ""), **one) == {"ng", "sfx"}
    assert shadows.due("r", ["ng", "sfx"], **one) == []  # both undecided: paced, neither drafts again
    assert shadows.due("r", ["ng", "sfx"], ahead=True, **one) == ["ng", "sfx"]  # the slot in flight may decide them
    assert shadows.resolve("r", prompt + [4, 5]) == [Decided("sfx", 2, 1, (), (1, ""))]  # the slot in flight commits
    kept = shadows.add("r", 11, {"ng": [9, 1], "sfx": [9]}, slot=(2, "sfx"), **one)  # the follow-on's drafts
    assert kept == {"sfx"}  # n-gram's last draft is still undecided: its new one is dropped
    decided = shadows.resolve("r", prompt + [4, 5, 9, 1])
    assert sorted(decided) == [Decided("ng", 4, 4, (), (1, "")), Decided("sfx", 1, 1, (), (2, "sfx"))]  # paced
    assert shadows.add("r", 13, {"ng": [2]}, slot=(1, "")) == {"ng"}  # past batch 1 nothing is dropped


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


def test_the_targets_worker_drafts_shadow_drafts_from_the_tokens_the_verify_starts_from(tmp_path):
    """A verify that asks for shadows returns what each free drafter would have drafted before the verify's tokens
    (the same as it would have proposed for real), and the inline drafter's first use reports its catch-up."""
    from spind import protocol as P
    from spind.config import from_dict
    from spind.drafters.base import DraftInput
    from spind.drafters.ngram import NgramDrafter
    from spind.drafters.suffix import SuffixDrafter
    from spind.worker.worker import Worker
    from tiny_model import write_tiny_checkpoint

    tiny_dir = write_tiny_checkpoint(tmp_path / "tiny")
    cfg = from_dict({
        "model": {"target": str(tiny_dir), "max_model_len": 64, "cache_dir": str(tmp_path)},
        "runtime": {"attention": "packed", "kv_block_size": 16, "kv_num_blocks": 0, "max_batch_size": 3,
                    "profile": "off"},
        "drafters": [{"name": "ngram", "kind": "ngram", "worker": "target"},
                     {"name": "suffix", "kind": "suffix", "worker": "target"}],
        "workers": [{"name": "target", "device": "cpu"}]})
    w = Worker("target", cfg)
    w.ready(1)
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5, 7, 9, 3, 5]  # repeats: both drafters have something to propose
    for req_id in ("a", "b", "c"):
        assert not isinstance(w.answer(P.AddRequest(1, req_id, prompt, P.SamplingParams(max_tokens=8), True)),
                              P.ErrorReply)
    w.answer(P.Prefill(2, [P.PrefillItem(r, len(prompt) - 1) for r in ("a", "b", "c")]))
    reply = w.answer(P.Verify(3, 1, [P.VerifyItem("a", [], inline_drafter="suffix", k=2, shadow=["ngram"],
                                                  shadow_k=SHADOW_K),
                                     P.VerifyItem("b", [], shadow=["ngram", "suffix"], shadow_k=SHADOW_K)]))
    assert not isinstance(reply, P.ErrorReply), reply
    a, b = reply.results
    expect_ngram = NgramDrafter("x").propose([DraftInput("x", prompt, SHADOW_K)])[0].tokens
    fresh = SuffixDrafter("y")
    fresh.add_request("y", None)
    expect_suffix = fresh.propose([DraftInput("y", prompt, SHADOW_K)])[0].tokens
    assert expect_ngram and expect_suffix
    assert a.shadow == {"ngram": expect_ngram} and b.shadow == {"ngram": expect_ngram, "suffix": expect_suffix}
    assert a.num_drafted == 2 and 0 < a.switch_s <= a.draft_s  # suffix's first use caught the prompt up
    assert 0 < reply.shadow_s < reply.verify_s + 1.0  # what the shadow drafts took, for selection to weigh
    assert b.num_drafted == 0 and b.switch_s == 0.0
    # each rates its tokens
    sure = fresh.propose([DraftInput("y", prompt, SHADOW_K)])[0].confidence
    copied = NgramDrafter("x").propose([DraftInput("x", prompt, SHADOW_K)])[0].confidence
    assert copied == [0.75 ** t for t in range(1, len(expect_ngram) + 1)]  # a 3-gram matched
    assert b.shadow_confidence == {"ngram": copied, "suffix": sure} and a.shadow_confidence == {"ngram": copied}
    # the second slot: the suffix trie of "a" grew by what it committed, within one slot's tokens: no catch-up
    reply = w.answer(P.Verify(4, 2, [P.VerifyItem("a", [], inline_drafter="suffix", k=2)]))
    assert reply.results[0].switch_s == 0.0 and reply.results[0].shadow == {} and reply.shadow_s < 1e-3
    # the cut selection sends keeps the inline draft's prefix of greatest worth, on the worker: each token worth its
    # rating here (the bin's middle), at a price between the first token's worth and the last one's
    whole = fresh.propose([DraftInput("y", prompt, 4)])[0]
    assert len(whole.tokens) == 4 and whole.confidence[0] > whole.confidence[-1]
    values = tuple((b + 0.5) / 20 for b in range(20))
    worth = [values[min(19, int(c * 20))] for c in whole.confidence]
    price = (worth[0] + worth[-1]) / 2
    rule = CutRule(values, (price,))
    assert 0 < rule.kept(whole.confidence) < 4
    reply = w.answer(P.Verify(5, 3, [P.VerifyItem("c", [], inline_drafter="suffix", k=4, cut_values=list(values),
                                                  cut_prices=[price])]))
    assert reply.results[0].num_drafted == rule.kept(whole.confidence)
    # a finished request's output, not its prompt (in its own trie), joins suffix decoding's shared cache
    output = w.mirrors["a"].tokens[len(prompt):]
    assert output and not isinstance(w.answer(P.FreeRequests(6, ["a"])), P.ErrorReply)
    assert list(w.drafters["suffix"].pending) == [("a", output)]
