"""The selection policies one call at a time: the matching against brute force, Algorithm 2's chunks and
capacities, requests joining and leaving, bypass, hints, describe(), the baselines and build_selector."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from spind.coordinator.selection.arms import ArmSet, free_capacity, random_drop
from spind.coordinator.selection.lbss import EXPLOIT, EXPLORE, LBSSSelector, SelectionConfig
from spind.coordinator.selection.baselines import (EpsilonGreedySelector, FixedSelector, GreedyLengthSelector,
                                         OracleSelector, RandomSelector, build_selector)
from spind.coordinator.selection.matching import assignment_value, max_weight_assignment
from spind.coordinator.selection.protocol import AUTO, PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.policy import Policy

DRAFTERS = ("ngram", "int8")


def info(req_id: str, requested: str = AUTO, *, current: Arm | None = None, prompt: int = 100,
         output: int = 0, repetition: float = 0.0, k: int | None = None) -> RequestInfo:
    return RequestInfo(req_id=req_id, requested=requested, requested_k=k, current=current, num_prompt_tokens=prompt,
                       num_output_tokens=output, prompt_repetition=repetition)


def feedback(req_id: str, arm: Arm, goodput: float, accepted: int | None = None) -> SlotFeedback:
    """One slot of `arm` worth `goodput` tokens/s: (accepted + 1) tokens in (accepted + 1) / goodput s."""
    accepted = arm.k // 2 if accepted is None else accepted
    return SlotFeedback(req_id=req_id, arm=arm, num_drafted=arm.k, num_accepted=accepted, num_committed=accepted + 1,
                        draft_s=0.0, verify_s=(accepted + 1) / goodput)


def used_per_drafter(arms: list[Arm]) -> dict[str, int]:
    used: dict[str, int] = {}
    for a in arms:
        if a.drafter is not None:
            used[a.drafter] = used.get(a.drafter, 0) + 1
    return used


def run_slot(sel, reqs: list[RequestInfo], capacity: Capacity, goodput=lambda r, a: 10.0 + a.k) -> list[Arm]:
    """select + observe; the next slot's RequestInfo carries the arm as `current`."""
    arms = sel.select(reqs, capacity)
    assert all(used <= capacity.of(d) for d, used in used_per_drafter(arms).items())
    sel.observe([feedback(r.req_id, a, goodput(r, a)) for r, a in zip(reqs, arms)])
    reqs[:] = [info(r.req_id, r.requested, current=a, prompt=r.num_prompt_tokens, output=r.num_output_tokens + 1,
                    repetition=r.prompt_repetition, k=r.requested_k) for r, a in zip(reqs, arms)]
    return arms


# -- matching -----------------------------------------------------------------------------------------------------


def brute_force(weights: np.ndarray, arm_set: ArmSet, free: dict) -> float:
    best = -np.inf
    for arms in itertools.product(range(len(arm_set)), repeat=weights.shape[0]):
        used = np.bincount(arm_set.drafter_of[list(arms)] + 1, minlength=len(arm_set.drafters) + 1)[1:]
        if all(free[d] is None or used[j] <= free[d] for j, d in enumerate(arm_set.drafters)):
            best = max(best, assignment_value(weights, np.array(arms)))
    return best


def test_matching_equals_brute_force_and_respects_capacity():
    rng = np.random.default_rng(0)
    arm_set = ArmSet(("a", "b"), (2, 4))  # 5 arms
    for _ in range(60):
        n = int(rng.integers(1, 6))
        weights = rng.uniform(0, 10, (n, len(arm_set)))
        free = {None: None, "a": int(rng.integers(0, 3)), "b": int(rng.integers(0, 4))}
        arms = max_weight_assignment(weights, arm_set, free)
        used = used_per_drafter([arm_set.arms[a] for a in arms])
        assert all(used.get(d, 0) <= free[d] for d in ("a", "b"))
        assert assignment_value(weights, arms) == pytest.approx(brute_force(weights, arm_set, free))
    # one request (batch 1, a lone newcomer) is answered without the assignment solver: its best arm on a drafter
    # with room (a drafter absent from `free` has none), the first of equal ones
    for _ in range(200):
        weights = rng.integers(0, 4, (1, len(arm_set))).astype(float)
        free = {d: int(rng.integers(0, 2)) for d in ("a", "b") if rng.random() < 0.8}
        arms = max_weight_assignment(weights, arm_set, free)
        allowed = [0] + [a for a in range(1, len(arm_set)) if free.get(arm_set.arms[a].drafter, 0) > 0]
        assert arms[0] == max(allowed, key=lambda a: (weights[0, a], -a))
        every = {None: None, "a": free.get("a", 0), "b": free.get("b", 0)}
        assert assignment_value(weights, arms) == pytest.approx(brute_force(weights, arm_set, every))


def test_matching_unlimited_drafter_takes_everyone():
    arm_set = ArmSet(("a",), (4,))
    weights = np.array([[1.0, 5.0]] * 7)
    assert (max_weight_assignment(weights, arm_set, {None: None, "a": None}) == 1).all()
    assert (max_weight_assignment(weights, arm_set, {None: None, "a": 3}) == 1).sum() == 3


def test_random_drop_keeps_b_j_and_is_fair():
    arm_set = ArmSet(("a",), (4,))
    rng = np.random.default_rng(1)
    kept = np.zeros(6)
    for _ in range(300):
        out = random_drop({f"r{i}": 1 for i in range(6)}, arm_set, {None: None, "a": 2}, rng)
        assert sum(a == 1 for a in out.values()) == 2
        kept += [out[f"r{i}"] == 1 for i in range(6)]
    assert ((kept / 300) > 0.2).all() and ((kept / 300) < 0.47).all()  # each kept ~1/3 of the time


# -- LBSS: stages, chunks, capacities ----------------------------------------------------------------------------


def test_exploration_keeps_arms_for_whole_chunks_and_respects_capacity():
    cfg = SelectionConfig(alpha=8, beta=4, max_epoch=2, seed=3)
    sel = LBSSSelector(cfg, DRAFTERS, default_k=4)
    reqs = [info(f"r{i}") for i in range(10)]
    capacity = Capacity({"ngram": 16, "int8": 2})
    seen: dict[str, set[Arm]] = {r.req_id: set() for r in reqs}
    for epoch in range(1, 6):
        chunks = []
        for slot in range(cfg.alpha):
            arms = run_slot(sel, reqs, capacity)
            assert (sel.epoch, sel.stage) == (epoch, EXPLORE)
            assert used_per_drafter(arms).get("int8", 0) <= 2
            if slot % cfg.beta == 0:
                chunks.append(arms)
            else:
                assert arms == chunks[-1]  # the chunk's arm, kept
            for r, a in zip(reqs, arms):
                seen[r.req_id].add(a)
        assert chunks[0] != chunks[1]  # a new draw per chunk
        for _ in range(2 ** min(epoch, cfg.max_epoch)):
            run_slot(sel, reqs, capacity)
            assert sel.stage == EXPLOIT
    assert all(len(arms) >= 2 for arms in seen.values())  # random: every request tried several arms
    assert set().union(*seen.values()) == set(sel.arm_set.arms)


def test_exploitation_picks_each_requests_best_arm_within_capacity():
    cfg = SelectionConfig(alpha=24, beta=2, max_epoch=3, prior_strength=0, switch_weight=0, seed=0)
    sel = LBSSSelector(cfg, DRAFTERS, default_k=4)
    best = {"r0": Arm("ngram", 8), "r1": Arm("int8", 2), "r2": Arm("int8", 2), "r3": PLAIN_ARM}
    reqs = [info(r) for r in best]
    capacity = Capacity({"ngram": 4, "int8": 1})  # r1 and r2 both want int8: one must settle for its second
    goodput = lambda r, a: 30.0 if a == best[r.req_id] else (20.0 if a.drafter is None else 10.0)  # noqa: E731
    for _ in range(cfg.alpha):
        run_slot(sel, reqs, capacity, goodput)
    arms = run_slot(sel, reqs, capacity, goodput)
    assert sel.stage == EXPLOIT
    assert arms[0] == best["r0"] and arms[3] == PLAIN_ARM
    assert {arms[1], arms[2]} == {Arm("int8", 2), PLAIN_ARM}  # plain pays 20, the rest 10


def test_requests_join_mid_chunk_and_mid_exploitation_without_disturbing_others():
    cfg = SelectionConfig(alpha=8, beta=4, max_epoch=3, seed=5)
    sel = LBSSSelector(cfg, DRAFTERS, default_k=4)
    capacity = Capacity({"ngram": 8, "int8": 8})
    reqs = [info("a"), info("b")]
    first = run_slot(sel, reqs, capacity)
    reqs.append(info("late"))  # slot 1 of a 4-slot chunk
    arms = run_slot(sel, reqs, capacity)
    assert arms[:2] == first
    late_arm = arms[2]
    for _ in range(2):
        assert run_slot(sel, reqs, capacity)[2] == late_arm  # kept to the chunk's end
    while sel.stage != EXPLOIT or sel.slot_in_stage == 0:
        before = run_slot(sel, reqs, capacity)
    reqs.append(info("later"))
    after = run_slot(sel, reqs, capacity)
    assert after[:3] == before and len(after) == 4
    sel.remove("a")
    assert "a" not in sel.describe()["requests"] and len(sel.describe()["requests"]) == 3


def test_capacity_that_shrinks_mid_stage_is_respected():
    sel = LBSSSelector(SelectionConfig(alpha=4, beta=4, seed=2), DRAFTERS, default_k=4)
    reqs = [info(f"r{i}") for i in range(6)]
    for slot in range(40):
        capacity = Capacity({"ngram": 6, "int8": 6}) if slot % 7 < 4 else Capacity({"ngram": 1})
        run_slot(sel, reqs, capacity)  # asserts B_j every slot; int8 absent = unavailable


def test_bypass_is_not_selected_but_uses_capacity_and_teaches_the_population():
    sel = LBSSSelector(SelectionConfig(alpha=0, seed=0), DRAFTERS, default_k=4)
    reqs = [info("named", "int8"), info("plain", "none"), info("k0", k=0), info("auto")]
    arms = run_slot(sel, reqs, Capacity({"ngram": 0, "int8": 1}))
    assert arms[:3] == [Arm("int8", 4), PLAIN_ARM, PLAIN_ARM] and arms[3] == PLAIN_ARM  # int8 taken, ngram off
    assert sel.population.counts.slots.sum() == 4
    d = sel.describe()
    assert d["requests"]["named"]["bypass"] and not d["requests"]["named"]["observations"]
    assert d["requests"]["auto"]["observations"] == {"none": 1}


def test_precompute_hint_names_the_next_chunks_drafter_then_the_best_other():
    cfg = SelectionConfig(alpha=12, beta=4, max_epoch=2, seed=7)
    sel = LBSSSelector(cfg, DRAFTERS, default_k=4)
    reqs = [info(f"r{i}") for i in range(8)]
    capacity = Capacity({"ngram": 8, "int8": 8})
    arms = run_slot(sel, reqs, capacity)
    hints = {r.req_id: sel.precompute_hint(r.req_id) for r in reqs}
    for _ in range(cfg.beta - 1):
        arms = run_slot(sel, reqs, capacity)
    next_arms = run_slot(sel, reqs, capacity)  # the second chunk: the pre-drawn arms
    for r, now, then in zip(reqs, arms, next_arms):
        if then.drafter != now.drafter:
            assert hints[r.req_id] == then.drafter
        else:
            assert hints[r.req_id] is None
    while sel.stage != EXPLOIT:
        arms = run_slot(sel, reqs, capacity, goodput=lambda r, a: 50.0 if a.drafter == "int8" else 10.0)
    for r, arm in zip(reqs, arms):
        assert sel.precompute_hint(r.req_id) != arm.drafter
    # where no drafter has KV to precompute (free drafters only), there is no hint
    free = LBSSSelector(cfg, DRAFTERS, default_k=4, kv_drafters=())
    for _ in range(2 * cfg.alpha):
        run_slot(free, reqs, capacity)
    assert not free.has_hints and all(free.precompute_hint(r.req_id) is None for r in reqs)


def test_describe_is_json_and_counts_switches():
    sel = LBSSSelector(SelectionConfig(seed=1), DRAFTERS, default_k=4)
    reqs = [info(f"r{i}", repetition=0.5) for i in range(5)]
    for _ in range(30):
        run_slot(sel, reqs, Capacity({"ngram": 4, "int8": 4}))
    d = json.loads(json.dumps(sel.describe()))
    assert {"epoch", "stage", "slot_in_stage", "stage_slots", "assignment", "capacity", "requests",
            "num_switches", "num_slots", "switch_s"} <= set(d)
    assert d["num_slots"] == 30 and d["num_switches"] > 0
    assert sum(d["assignment"].values()) == 5 and d["capacity"] == {"ngram": 4, "int8": 4}
    assert set(d["requests"]["r0"]["estimate"]) == set(d["arms"])


def test_requested_k_is_honoured_for_auto_requests():
    sel = LBSSSelector(SelectionConfig(alpha=4, seed=0), DRAFTERS, default_k=4)
    reqs = [info(f"r{i}", k=3) for i in range(6)]
    arms = sel.select(reqs, Capacity({"ngram": 8, "int8": 8}))
    assert all(a.k == 3 or a == PLAIN_ARM for a in arms) and any(a.k == 3 for a in arms)


def test_a_prior_picks_a_new_requests_arm_on_its_features():
    """Once the population has seen that repetitive prompts do well with n-gram lookup and the others with
    int8, a new request arriving mid-exploitation is matched on its features; without a prior it has no
    estimate at all and decodes plainly."""
    # (drafter asked for, prompt repetition, tokens/s, drafts accepted of 4) of the bypassing warm-up requests
    warm_up = [("ngram", 0.6, 40.0, 3), ("int8", 0.6, 20.0, 2), ("ngram", 0.0, 12.0, 0), ("int8", 0.0, 25.0, 3),
               ("none", 0.2, 16.0, 0)]
    capacity = Capacity({"ngram": 8, "int8": 8})
    for prior_strength, expected in ((4.0, ["ngram", "int8"]), (0.0, [None, None])):
        sel = LBSSSelector(SelectionConfig(alpha=0, prior_strength=prior_strength), DRAFTERS, default_k=4)
        for t in range(40):
            reqs = [info(f"w{t}-{i}", name, repetition=rep) for i, (name, rep, _, _) in enumerate(warm_up)]
            arms = sel.select(reqs, capacity)
            sel.observe([feedback(r.req_id, a, g, acc) for r, a, (_, _, g, acc) in zip(reqs, arms, warm_up)])
            for r in reqs:
                sel.remove(r.req_id)
        arms = sel.select([info("new-rep", repetition=0.6), info("new-chat", repetition=0.0)], capacity)
        assert sel.stage == EXPLOIT
        assert [a.drafter for a in arms] == expected


def test_switching_cost_keeps_a_request_on_its_drafter_when_the_gain_does_not_pay_for_the_kv_catch_up():
    """Bypassing requests teach the population that drafter b becomes better than a (20 against 12 tokens/s)
    and that KV catch-up costs 1 ms a token. A request on a would gain ~2 tokens/s by its estimates moving
    to b, for ~0.13 s of catch-up in a 2-slot stage of 0.25 s slots: priced at cost (lambda = 1) it stays,
    at lambda = 0 it moves."""
    capacity = Capacity({"a": 8, "b": 8})
    for switch_weight, expected in ((1.0, {"a"}), (0.0, {"a", "b"})):
        sel = LBSSSelector(SelectionConfig(alpha=0, max_epoch=1, switch_weight=switch_weight), ("a", "b"), 4)
        drafters_of_r0: list[str | None] = []
        for t in range(40):
            reqs = [info(f"ta{t}", "a"), info(f"tb{t}", "b")] + ([info("r0", output=t)] if t >= 3 else [])
            arms = sel.select(reqs, capacity)
            fb = []
            for r, arm in zip(reqs, arms):
                is_new_drafter = r.req_id != "r0" or not drafters_of_r0 or drafters_of_r0[-1] != arm.drafter
                catch_up = 0.001 * (r.num_prompt_tokens + r.num_output_tokens) if is_new_drafter else 0.0
                seconds = 0.25 if arm.drafter == "a" else (0.3 if t < 10 else 0.15)  # 3 tokens a slot
                fb.append(SlotFeedback(req_id=r.req_id, arm=arm, num_drafted=4, num_accepted=2, num_committed=3,
                                       draft_s=0.0, verify_s=seconds, switch_s=catch_up))
                if r.req_id == "r0":
                    drafters_of_r0.append(arm.drafter)
            sel.observe(fb)
            sel.remove(f"ta{t}")
            sel.remove(f"tb{t}")
        assert drafters_of_r0[0] == "a" and set(drafters_of_r0) == expected
        assert sel.describe()["switch_s_per_token"]["b"] == pytest.approx(0.001)


def test_lbss_without_drafters_decodes_plainly():
    sel = LBSSSelector(SelectionConfig(), (), default_k=4)
    reqs = [info(f"r{i}") for i in range(3)]
    for _ in range(20):
        assert run_slot(sel, reqs, Capacity()) == [PLAIN_ARM] * 3
    assert sel.precompute_hint("r0") is None


# -- baselines and build_selector -------------------------------------------------------------------------------


def test_greedy_length_gives_shorter_prompts_cheaper_drafters_and_never_switches():
    sel = GreedyLengthSelector({"big": 0.05, "tiny": 0.001, "mid": 0.02}, k=4)
    reqs = [info(f"r{i}", prompt=p) for i, p in enumerate([10, 500, 100, 20, 300, 60])]
    arms = sel.select(reqs, Capacity({"big": 9, "tiny": 9, "mid": 9}))
    by_length = [a.drafter for _, a in sorted(zip([r.num_prompt_tokens for r in reqs], arms))]
    assert by_length == ["tiny", "tiny", "mid", "mid", "big", "big"]
    assert sel.select(reqs, Capacity({"big": 9, "tiny": 9, "mid": 9})) == arms


def test_epsilon_greedy_exploits_with_probability_epsilon_as_the_paper_words_it():
    arm_set = ArmSet(DRAFTERS, (2, 4))
    sel = EpsilonGreedySelector(arm_set, epsilon=0.2, seed=0, default_k=4)
    reqs = [info(f"r{i}") for i in range(4)]
    num_all_best = 0
    for _ in range(500):
        is_best_known = sel.counts[arm_set.index[Arm("ngram", 4)]] > 0
        arms = run_slot(sel, reqs, Capacity({"ngram": 4, "int8": 4}),
                        goodput=lambda r, a: 40.0 if a == Arm("ngram", 4) else 10.0)
        num_all_best += sel.is_exploiting
        if sel.is_exploiting and is_best_known:
            assert all(a == Arm("ngram", 4) for a in arms)
    assert 0.14 < num_all_best / 500 < 0.26
    assert isinstance(RandomSelector(arm_set, 0, 4), EpsilonGreedySelector)


def test_oracle_runs_the_best_feasible_arms():
    arm_set = ArmSet(DRAFTERS, (4,))
    table = {"r0": {Arm("int8", 4): 30.0, PLAIN_ARM: 10.0, Arm("ngram", 4): 5.0},
             "r1": {Arm("int8", 4): 20.0, PLAIN_ARM: 15.0, Arm("ngram", 4): 5.0}}
    sel = OracleSelector(arm_set, table.__getitem__, default_k=4)
    reqs = [info("r0"), info("r1")]
    assert sel.select(reqs, Capacity({"ngram": 2, "int8": 2})) == [Arm("int8", 4)] * 2
    assert sel.select(reqs, Capacity({"ngram": 2, "int8": 1})) == [Arm("int8", 4), PLAIN_ARM]  # 30+15 > 10+20


def test_build_selector_parses_names_and_rejects_bad_ones():
    cfg = SelectionConfig()
    costs = {"ngram": 1e-4, "int8": 0.035}
    assert build_selector("lbss", cfg, DRAFTERS, 4).policy == "lbss"
    fixed = build_selector("fixed:int8@2", cfg, DRAFTERS, 4)
    assert isinstance(fixed, FixedSelector) and fixed.policy == "fixed:int8@2"
    assert fixed.select([info("r")], Capacity({"int8": 1})) == [Arm("int8", 2)]
    assert build_selector("fixed:ngram", cfg, DRAFTERS, 4).select([info("r")], Capacity({"ngram": 1})) == \
        [Arm("ngram", 4)]
    assert build_selector("none", cfg, DRAFTERS, 4).select([info("r")], Capacity({"ngram": 1})) == [PLAIN_ARM]
    assert build_selector("greedy-length", cfg, DRAFTERS, 4, costs=costs).policy == "greedy-length"
    assert build_selector("epsilon-greedy", cfg, DRAFTERS, 4).policy == "epsilon-greedy"
    assert build_selector("random", cfg, DRAFTERS, 4).policy == "random"
    assert build_selector("oracle", cfg, DRAFTERS, 4, oracle=lambda r: {}).policy == "oracle"
    assert build_selector(Policy("fixed", "ngram", 2), cfg, DRAFTERS, 4).policy == "fixed:ngram@2"  # parsed already
    for bad, match in (("fixed:bf16", "unknown drafter"), ("fixed:int8@0", "k must be"), ("greedy", "is not one of"),
                       ("greedy-length", "cost per draft token"), ("oracle", "evaluation only")):
        with pytest.raises(ValueError, match=match):
            build_selector(bad, cfg, DRAFTERS, 4)


def test_selection_config_validates():
    assert SelectionConfig(k_set=[2, 4]).k_set == (2, 4)  # a TOML list becomes a tuple
    for bad in (dict(policy="best"), dict(alpha=-1), dict(beta=0), dict(k_set=()), dict(k_set=(2, 2)),
                dict(k_set=(0,)), dict(switch_weight=-1.0), dict(prior_strength=-1.0), dict(max_epoch=-1),
                dict(population_window=0), dict(epsilon=1.5)):
        with pytest.raises(ValueError):
            SelectionConfig(**bad)


def test_free_capacity_subtracts_bypassing_requests():
    free = free_capacity(Capacity({"a": 2}), ("a", "b"), [Arm("a", 4), PLAIN_ARM])
    assert free == {None: None, "a": 1, "b": 0}
