"""Selection that prices the batch's verify: the verify-cost model, the marginal-gain choice (Dinkelbach over
the matching) and LBSS with them, all with scripted costs (no clock, no model)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from spind.config import SelectionConfig
from spind.coordinator.phases import VerifyOutcome
from spind.coordinator.profile import SystemProfile
from spind.coordinator.selection.arms import ArmSet
from spind.coordinator.selection.cost import STEP_WINDOW, VerifyCost
from spind.coordinator.selection.estimates import Calibration, worth_drafting
from spind.coordinator.selection.lbss import LBSSSelector
from spind.coordinator.selection.marginal import choose
from spind import protocol as P
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.draft_cut import CutRule
from spind.drafters.base import Draft, cut_at

C0, C_REQ, C_TOK = 0.004, 0.0005, 0.002  # a CPU-like verify: 2 ms per token carried


def cpu_verify(batch: int, tokens: int) -> float:
    return C0 + C_REQ * batch + C_TOK * tokens


def profile_points(max_batch: int = 16, k: int = 4) -> list[tuple[int, int, float]]:
    sizes = [1, 2, 4, 8, max_batch]
    return [(b, t, cpu_verify(b, t)) for b in sizes for t in (b, b * (k + 1))]


# ---- the cost model ----------------------------------------------------------------------------------------------

def test_cost_model_fits_the_profile_and_follows_the_machine():
    cost = VerifyCost()
    assert not cost.is_known and cost.predict(1, 1) is None and cost.seconds_per_token == 0
    cost.add_prior(profile_points())
    assert cost.seconds_per_token == pytest.approx(C_TOK, rel=1e-3)
    assert cost.predict(8, 40) == pytest.approx(cpu_verify(8, 40), rel=1e-3)
    for _ in range(400):  # the machine got twice as slow per token (other load): serving's forwards say so
        for b, t in ((4, 4), (4, 12), (4, 20)):
            cost.observe(b, t, C0 + C_REQ * b + 2 * C_TOK * t)
    assert cost.seconds_per_token == pytest.approx(2 * C_TOK, rel=0.15)


def test_cost_model_reads_a_flat_gpu_profile_as_flat():
    cost = VerifyCost()
    rng = np.random.default_rng(0)
    cost.add_prior([(b, t, 0.010 + rng.normal(0, 1e-5)) for b in (1, 2, 4, 8) for t in (b, 5 * b)])
    assert 0 <= cost.seconds_per_token < 1e-5
    line = cost.line
    assert line.c_req >= 0 and line.c0 == pytest.approx(0.010, abs=1e-4)


def test_cost_model_without_a_profile_learns_from_forwards_and_ignores_bad_ones():
    cost = VerifyCost()
    cost.observe(0, 0, 1.0)
    cost.observe(2, 2, float("nan"))
    assert not cost.is_known
    for b, t in ((1, 1), (1, 5), (2, 2), (2, 10), (4, 8)):
        cost.observe(b, t, cpu_verify(b, t))
    assert cost.seconds_per_token == pytest.approx(C_TOK, rel=0.05)


def test_each_batch_size_has_its_own_token_cost_the_profiles_chord_refined_by_its_forwards():
    """A CPU forward is convex in T: cheap extra tokens while it streams the weights, dear ones once it is
    compute-bound. One line over every B prices batch 1's drafts at the large forwards' rate; each B's line
    prices them at its own."""
    def convex(b: int, t: int) -> float:  # 1.2 ms per token at B = 1, 1.9 ms at B = 16
        slope = 0.0012 + 0.0007 * (b - 1) / 15
        return 0.005 + 0.0005 * b + slope * t
    cost = VerifyCost()
    cost.add_prior([(b, t, convex(b, t)) for b in (1, 2, 4, 8, 16) for t in (b, 5 * b)])
    assert cost.seconds_per_token_at(1) == pytest.approx(0.0012, rel=1e-3)
    assert cost.seconds_per_token_at(16) == pytest.approx(0.0019, rel=1e-3)
    assert cost.seconds_per_token_at(12) == pytest.approx(0.0012 + 0.0007 * 11 / 15, rel=1e-3)  # interpolated
    assert cost.seconds_per_token_at(32) == pytest.approx(0.0019, rel=1e-3)  # the nearest beyond the profile
    assert cost.seconds_per_token > cost.seconds_per_token_at(1) * 1.3  # what the one global line would charge
    assert cost.predict(1, 5) == pytest.approx(convex(1, 5), rel=1e-3)
    for _ in range(300):  # batch 1 got dearer per token (say, longer contexts): its forwards say so
        for t in (1, 3, 5, 9):
            cost.observe(1, t, 0.005 + 0.0024 * t)
    assert cost.seconds_per_token_at(1) == pytest.approx(0.0024, rel=0.1)
    assert cost.seconds_per_token_at(16) == pytest.approx(0.0019, rel=1e-3)  # no forward at 16: its chord
    assert cost.predict_cheaply(1, 9) == pytest.approx(0.005 + 0.0024 * 9, rel=0.1)
    described = cost.describe()["by_batch"]
    assert described["1"]["per_token_ms"] == pytest.approx(2.4, rel=0.1) and described["1"]["observations"] > 100


def test_the_line_fits_every_forward_at_batch_one_and_the_all_drafting_chord_past_it():
    """At batch 1 the line fits every forward (one request drafting 1..k); past it the profile's forwards with one
    request drafting are recorded but not priced from (the probe's forked context reads them cheap, and their T's near
    B would leave the slope to serving's noise): the chord from the plain to the all-drafting forward, as before."""
    plain, lone, every = {1: 0.006, 16: 0.022}, {16: 0.0296}, {1: 0.0096, 16: 0.080}
    points = ([(b, b, s) for b, s in plain.items()] + [(b, b + 4, s) for b, s in lone.items()]
              + [(b, 5 * b, s) for b, s in every.items()] + [(1, 3, 0.0075)])
    cost = VerifyCost()
    cost.add_prior(points)
    assert cost.seconds_per_token_at(16) == pytest.approx((0.080 - 0.022) / 64)
    assert cost.seconds_per_token_at(1) == pytest.approx(float(np.polyfit([1, 3, 5], [0.006, 0.0075, 0.0096], 1)[0]))
    without = VerifyCost()
    without.add_prior([p for p in points if p[1] != p[0] + 4])
    assert without.seconds_per_token_at(16) == cost.seconds_per_token_at(16)


def test_each_draft_position_is_priced_at_what_it_adds_to_the_forward():
    """Where the profile timed one request drafting every length 1..k, each position's price is its step of that
    curve: on a CPU whose second row rides along with the first, a request's first draft token is nearly free and
    its later ones dear, so a draft too unsure for the line's one price still drafts its first token, and a
    calibrated drafter's cut keeps a token at the first position that it cuts past it."""
    steps = {1: [0.0060, 0.0061, 0.0074, 0.0084, 0.0100]}  # T = 1 .. 5: +0.1, +1.3, +1.0, +1.6 ms
    points = [(1, t + 1, sec) for t, sec in enumerate(steps[1])] + [(4, 4, 0.008), (4, 20, 0.024)]
    cost = VerifyCost()
    cost.add_prior(points)
    # excess over the plain step (0.1, 1.4, 2.4, 4.0) ms at T = 2 .. 5: the first position 0.07 ms, each later 1.27
    assert cost.token_shape_at(1) == pytest.approx([x / 0.97 for x in (0.07, 1.27, 1.27, 1.27)], rel=1e-6)
    assert cost.token_shape_at(2) is None  # past batch 1 every position alike (the probe's steps mislead there)
    assert cost.seconds_per_token_at(1) == pytest.approx(0.00097)  # the steps' mean
    flat = VerifyCost()
    flat.add_prior([(1, 1, 0.006), (1, 5, 0.010)])
    assert flat.token_shape_at(1) is None  # only k's forward: every position alike
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["suffix"], 4, verify_points=points,
                       draft_s_per_token={"suffix": 0.0})
    cap = Capacity({"suffix": 16})
    sel.select([info("r", 0)], cap)
    prices = sel.describe()["token_prices"]["suffix"]
    assert len(prices) == 4 and prices[0] < 0.05 < 0.2 < prices[1] == prices[2] == prices[3]
    one_price = float(np.mean(prices))  # what every position cost without the shape (its mean is the line's slope)
    assert worth_drafting([0.1] * 4, one_price, 4) == 0 and worth_drafting([0.1] * 4, prices, 4) == 1
    for t in range(80):  # suffix calibrated by shadow drafts: its tokens rated 0.95, 0.5 and 0.2 survive always,
        arm = sel.select([info("r", t)], cap)[0]  # half the time and one time in 20
        accepted = 3 if t % 20 == 0 else 1 + t % 2
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=0.006, batch_size=1, batch_tokens=1, shadow=(("suffix", 3, accepted),),
                                  shadow_confidence=(("suffix", (0.95, 0.5, 0.2), accepted),))])
    assert sel.select([info("r", 80)], cap)[0].drafter == "suffix"
    rule = sel.cut_rule("r")
    assert rule.kept((0.2,)) == 1 and rule.kept((0.2,) * 4) == 1  # a 1-in-20 token pays only first
    assert rule.kept((0.95,) * 4) == 4


def test_batch_1s_position_prices_follow_the_forwards_served_not_only_the_profiles_probe():
    """The profile's probe read a nearly free first draft token (+0.1 ms) where serving's forwards add 1.6 ms for it
    and 1.2 ms for each later one: after serving's forwards each position is priced at what it adds there, and a
    draft too unsure for what its first token really costs is no longer drafted. What a position adds is read
    between consecutive forwards, so a host that slows while only some draft lengths run moves no step, and a
    forward the host preempted moves them little."""
    profile = [0.0060, 0.0061, 0.0074, 0.0084, 0.0100]  # T = 1 .. 5: +0.1, +1.3, +1.0, +1.6 ms
    served = [0.0070, 0.0086, 0.0098, 0.0110, 0.0122]  # +1.6, +1.2, +1.2, +1.2 ms
    cost = VerifyCost()
    cost.add_prior([(1, t + 1, sec) for t, sec in enumerate(profile)])
    before = [cost.seconds_per_token_at(1) * x / profile[0] for x in cost.token_shape_at(1)]  # in plain steps
    cost.observe(1, 1, 0.0070)  # one pair of forwards (+2 ms for the first draft token) does not outweigh the
    cost.observe(1, 2, 0.0090)  # profile's 2
    assert cost.seconds_per_token_at(1) * cost.token_shape_at(1)[0] < 0.0001  # the first position still ~0.07 ms
    for _ in range(STEP_WINDOW):
        for t, sec in enumerate(served, 1):
            cost.observe(1, t, sec)
    after = cost.token_shape_at(1)
    assert after == pytest.approx([x / 1.3 for x in (1.6, 1.2, 1.2, 1.2)], rel=1e-6)  # the profile's forgotten
    assert cost.seconds_per_token_at(1) == pytest.approx(0.0013)  # the steps' mean
    assert cost.describe()["batch1_position_ms"] == pytest.approx([1.6, 1.2, 1.2, 1.2])  # as /v1/spind/state shows
    priced = [cost.seconds_per_token_at(1) * x / served[0] for x in after]  # in plain steps
    assert worth_drafting([0.2] * 4, before, 4) == 1
    assert worth_drafting([0.2] * 4, priced, 4) == 0  # a first token surviving 1 in 5 pays less than it costs
    for _ in range(STEP_WINDOW):  # the host slows by 0.7 ms a forward while requests draft 2 tokens or none
        cost.observe(1, 1, served[0] + 0.0007)
        cost.observe(1, 3, served[2] + 0.0007)
    assert cost.token_shape_at(1) == pytest.approx(after, rel=1e-6)
    for _ in range(4):  # preempted: 2x its forward
        cost.observe(1, 4, 2 * served[3])
    assert cost.token_shape_at(1) == pytest.approx(after, rel=0.05)
    for _ in range(STEP_WINDOW):  # between batch 1's forwards others ran: no pair spans them
        cost.observe(1, 1, served[0] - 0.003)
        cost.observe(4, 8, 0.02)
        cost.observe(1, 5, served[4])
        cost.observe(2, 4, 0.02)
    assert cost.token_shape_at(1) == pytest.approx(after, rel=0.05)
    assert cost.token_shape_at(4) is None  # past batch 1 every position alike, whatever was served


def test_batch_1s_first_position_is_not_charged_the_hosts_drift_while_no_request_decodes_plainly():
    """Where every request drafts, a plain forward is rare: a host that slows meanwhile (this VM drifts by 10% within a
    minute) must not read as a dearer first draft token, or selection drafts less than pays. Consecutive forwards
    of distinct draft lengths read only the later positions then; the first keeps what the plain forwards read."""
    served = [0.0070, 0.0086, 0.0098, 0.0110, 0.0122]  # T = 1 .. 5: +1.6, +1.2, +1.2, +1.2 ms
    cost = VerifyCost()
    cost.add_prior([(1, t + 1, sec) for t, sec in enumerate(served)])
    for _ in range(STEP_WINDOW):
        cost.observe(1, 1, served[0])
        cost.observe(1, 2, served[1])
    for _ in range(2 * STEP_WINDOW):  # then the host slows by 1 ms a forward, and every request drafts 1 .. 4 tokens
        for t in (2, 3, 4, 5):
            cost.observe(1, t, served[t - 1] + 0.001)
    assert cost.describe()["batch1_position_ms"] == pytest.approx([1.6, 1.2, 1.2, 1.2], rel=1e-6)


def test_a_batch_size_without_a_profile_learns_its_slope_from_two_token_counts():
    cost = VerifyCost()
    for _ in range(5):
        cost.observe(3, 3, cpu_verify(3, 3))
    assert cost.predict_cheaply(3, 3) is None or cost.seconds_per_token_at(3) == cost.seconds_per_token
    for _ in range(5):
        cost.observe(3, 15, cpu_verify(3, 15))
    assert cost.seconds_per_token_at(3) == pytest.approx(C_TOK, rel=1e-6)
    assert cost.predict(3, 9) == pytest.approx(cpu_verify(3, 9), rel=1e-6)


# ---- the choice --------------------------------------------------------------------------------------------------

ARMS = ArmSet(["ngram", "int8"], (2, 4, 8))
ROOM = {None: None, "ngram": None, "int8": 16}


def scripted(committed_by_drafter: list[dict[str, float]], draft_s_per_token: dict[str, float]):
    """[n, A] committed and cost_s for requests whose drafts are all proposed, with per-token acceptance p per
    drafter (expected tokens (1 - p^(k+1)) / (1 - p)), costing C_TOK per verified token plus the drafter's."""
    n = len(committed_by_drafter)
    committed, cost = np.ones((n, len(ARMS))), np.zeros((n, len(ARMS)))
    for i, per_drafter in enumerate(committed_by_drafter):
        for a, arm in enumerate(ARMS.arms):
            if arm.drafter is None:
                continue
            p = per_drafter[arm.drafter]
            committed[i, a] = (1 - p ** (arm.k + 1)) / (1 - p)
            cost[i, a] = arm.k * (C_TOK + draft_s_per_token[arm.drafter])
    return committed, cost


def test_a_batch_where_no_drafts_pay_gets_none():
    committed, cost = scripted([{"ngram": 0.1, "int8": 0.2}] * 8, {"ngram": 0.0, "int8": 0.003})
    got = choose(committed, cost, np.zeros_like(cost), ARMS, ROOM, base_s=cpu_verify(8, 8))
    assert (got.arms == 0).all()
    assert got.price == pytest.approx(8 / cpu_verify(8, 8))


def test_a_batch_where_one_requests_drafts_pay_gets_exactly_that_one():
    reqs = [{"ngram": 0.1, "int8": 0.2}] * 7 + [{"ngram": 0.95, "int8": 0.2}]  # the last one copies its prompt
    committed, cost = scripted(reqs, {"ngram": 0.0, "int8": 0.003})
    got = choose(committed, cost, np.zeros_like(cost), ARMS, ROOM, base_s=cpu_verify(8, 8))
    assert (got.arms[:7] == 0).all()
    assert ARMS.arms[got.arms[7]].drafter == "ngram"
    base_rate = 8 / cpu_verify(8, 8)
    assert got.price > base_rate  # the batch is faster than plain decoding


def test_per_request_goodput_would_speculate_where_the_batch_loses():
    """The failure this fixes: each request alone gains from ngram@2 (1.75 tokens for 1.6x the seconds at batch
    1), but at batch 8 every token it adds slows all eight."""
    committed, cost = scripted([{"ngram": 0.5, "int8": 0.0}] * 8, {"ngram": 0.0, "int8": 0.01})
    a = ARMS.index[Arm("ngram", 2)]
    alone = committed[0, a] / (cpu_verify(1, 1) + cost[0, a])
    assert alone > 1 / cpu_verify(1, 1)  # pays at batch 1 ...
    assert (choose(committed[:1], cost[:1], np.zeros((1, len(ARMS))), ARMS, ROOM,
                   base_s=cpu_verify(1, 1)).arms == a).all()
    got = choose(committed, cost, np.zeros_like(cost), ARMS, ROOM, base_s=cpu_verify(8, 8))
    assert (got.arms == 0).all()  # ... not at batch 8


def test_the_choice_is_the_best_assignment_by_brute_force():
    rng = np.random.default_rng(3)
    small = ArmSet(["ngram"], (2, 8))
    for _ in range(30):
        n = 3
        committed = np.ones((n, 3))
        committed[:, 1:] = 1 + rng.uniform(0, 4, (n, 2))
        cost = np.zeros((n, 3))
        cost[:, 1] = 2 * C_TOK * rng.uniform(0.5, 3)
        cost[:, 2] = 8 * C_TOK * rng.uniform(0.5, 3)
        base = cpu_verify(n, n)
        got = choose(committed, cost, np.zeros_like(cost), small, {None: None, "ngram": None}, base_s=base)
        best = max(np.ndindex(*(3,) * n), key=lambda arms: sum(committed[i, a] for i, a in enumerate(arms))
                   / (base + sum(cost[i, a] for i, a in enumerate(arms))))
        ratio = lambda arms: (sum(committed[i, a] for i, a in enumerate(arms))  # noqa: E731
                              / (base + sum(cost[i, a] for i, a in enumerate(arms))))
        assert ratio(got.arms) == pytest.approx(ratio(best), rel=1e-9)


def test_without_a_slot_cost_the_choice_is_plain_decoding():
    committed, cost = scripted([{"ngram": 0.9, "int8": 0.9}] * 3, {"ngram": 0.0, "int8": 0.001})
    got = choose(committed, cost, np.zeros_like(cost), ARMS, ROOM, base_s=0.0)
    assert (got.arms == 0).all() and got.price == 0


def test_the_choice_respects_capacity_and_never_picks_unknown_arms():
    committed, cost = scripted([{"ngram": 0.0, "int8": 0.9}] * 4, {"ngram": 0.0, "int8": 0.0001})
    committed[:, ARMS.index[Arm("int8", 8)]] = np.nan  # never observed
    got = choose(committed, cost, np.zeros_like(cost), ARMS, {None: None, "ngram": None, "int8": 2},
                 base_s=cpu_verify(4, 4))
    names = [ARMS.arms[a] for a in got.arms]
    assert sum(a.drafter == "int8" for a in names) == 2 and Arm("int8", 8) not in names


# ---- LBSS with pricing -------------------------------------------------------------------------------------------

def info(req_id: str, n_out: int = 0, prompt_tokens: int = 40) -> RequestInfo:
    return RequestInfo(req_id=req_id, requested="auto", requested_k=None, current=None,
                       num_prompt_tokens=prompt_tokens, num_output_tokens=n_out)


def run_slots(sel: LBSSSelector, p_accept: dict[str, float], num_slots: int, rng: np.random.Generator,
              batch_pricing_feedback: bool = True, lifetime: int = 0, drafter: str = "ngram",
              prompt_tokens: dict[str, int] | None = None) -> list[list[Arm]]:
    """Drive the selector with scripted outcomes, as the coordinator does: request r accepts each draft token of
    the drafter with p_accept[r]; one verify forward for all costs cpu_verify(B, T); for n-gram lookup, requests
    not on it get its counterfactual (shadow) draft of 8. With a lifetime, each request is replaced by a new
    one (same p) after that many slots."""
    history = []
    for t in range(num_slots):
        generation = t // lifetime if lifetime else 0
        if lifetime and t and t % lifetime == 0:
            for r in p_accept:
                sel.remove(f"{r}-{generation - 1}")
        names = [f"{r}-{generation}" for r in p_accept]
        arms = sel.select([info(n, t % lifetime if lifetime else t, (prompt_tokens or {}).get(r, 40))
                           for n, r in zip(names, p_accept)], Capacity({drafter: 16}))
        history.append(arms)
        feedback, tokens = [], 0
        for n, r, arm in zip(names, p_accept, arms):
            runs = [int(rng.geometric(1 - p_accept[r])) - 1 for _ in range(2)]  # accepted before a rejection
            accepted = min(runs[0], arm.k)
            shadow = () if arm.drafter or drafter != "ngram" else (("ngram", 8, min(runs[1], 8)),)
            tokens += arm.k + 1
            feedback.append((n, arm, accepted, shadow))
        verify_s = cpu_verify(len(arms), tokens)
        sel.observe([SlotFeedback(req_id=n, arm=arm, num_drafted=arm.k, num_accepted=a, num_committed=a + 1,
                                  draft_s=0.0, verify_s=verify_s, batch_size=len(arms),
                                  batch_tokens=tokens if batch_pricing_feedback else 0, shadow=shadow)
                     for n, arm, a, shadow in feedback])
    return history


def test_lbss_with_pricing_decodes_a_batch_plainly_where_drafts_do_not_pay():
    cfg = SelectionConfig(seed=0)
    sel = LBSSSelector(cfg, ["ngram"], 4, verify_points=profile_points())
    assert sel.prices_batch
    p = {f"r{i}": 0.3 for i in range(8)}
    history = run_slots(sel, p, 200, np.random.default_rng(0))
    late = [arm for arms in history[100:] for arm in arms]
    assert sum(arm == PLAIN_ARM for arm in late) / len(late) > 0.9
    state = msgspec.json.decode(msgspec.json.encode(sel.describe()))  # what /v1/spind/state sends
    assert state["batch_pricing"] and state["price"] > 0 and state["verify_cost"]["per_token_ms"] > 0
    assert state["verify_fit"] and all(len(x) == 2 for x in state["verify_fit"])
    assert any("marginal" in r for r in state["requests"].values())


def test_lbss_with_pricing_speculates_for_the_one_request_that_pays():
    cfg = SelectionConfig(seed=0)
    sel = LBSSSelector(cfg, ["ngram"], 4, verify_points=profile_points())
    p = {f"r{i}": 0.3 for i in range(7)} | {"copy": 0.97}
    history = run_slots(sel, p, 200, np.random.default_rng(1))
    late = history[100:]
    copy_arms = [arms[7] for arms in late]
    others = [arm for arms in late for arm in arms[:7]]
    assert sum(a.drafter == "ngram" for a in copy_arms) / len(copy_arms) > 0.8
    assert sum(arm == PLAIN_ARM for arm in others) / len(others) > 0.85


def test_a_draft_keeps_the_positions_whose_survival_pays_for_their_verify():
    assert worth_drafting([0.9, 0.9, 0.5, 0.5], 0.5, 8) == 2  # 0.9, 0.81 pay; 0.405 does not
    assert worth_drafting([0.9, 0.9, 0.5, 0.5], 0.5, 1) == 1  # never past the arm's k
    assert worth_drafting([0.9, 0.9], 1.0, 8) == 0  # a token that costs a whole token never pays
    assert worth_drafting([float("nan")] * 4, 0.1, 4) == 0  # unknown: nothing drafted
    assert worth_drafting([0.99, 0.99], 0.5, 8) == 8  # past the positions counted, the last rate holds


def test_each_slot_drafts_only_what_pays_now_and_follows_the_text():
    """One request on n-gram at batch 1 whose text copies, then stops copying, then copies again (its shadow
    drafts, as the coordinator has the target's worker draft them every slot, say so): its drafts are cut to
    plain decoding within a few slots of the copying stopping, and come back within a few slots of it resuming,
    while the stage's matching keeps it on n-gram."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5})
    copying = [True] * 40 + [False] * 40 + [True] * 40
    arms = []
    for t, copies in enumerate(copying):
        arm = sel.select([info("r", t)], Capacity({"ngram": 16}))[0]
        arms.append(arm)
        drafted = arm.k if arm.drafter else 0
        accepted = drafted if copies else 0
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=drafted, num_accepted=accepted,
                                  num_committed=accepted + 1, draft_s=0.0, verify_s=cpu_verify(1, drafted + 1),
                                  batch_size=1, batch_tokens=drafted + 1, shadow=(("ngram", 8, 8 if copies else 0),),
                                  shadowed=arm.drafter == "ngram")])
    assert all(a.drafter == "ngram" and a.k >= 2 for a in arms[20:40]), arms[20:40]
    assert all(a == PLAIN_ARM for a in arms[46:80]), arms[40:80]
    assert all(a.drafter == "ngram" for a in arms[86:120]), arms[80:120]
    assert sel.describe()["requests"]["r"]["arm"].startswith("ngram")  # the stage's arm: the matching's choice


def calibrated(cal: Calibration, j: int = 0, n: int = 100) -> None:
    """Two-token drafts: the first rated 0.95 survives 9 times in 10, the second rated 0.35 once in 10 (with it)."""
    for i in range(n):
        cal.add(j, [0.95, 0.35], 0 if i % 10 == 0 else 2 if i % 10 == 1 else 1)


def test_calibration_turns_a_drafters_confidence_into_the_chance_its_token_survives():
    cal = Calibration(1, bins=10, min_tokens=50)
    assert not cal.known(0) and cal.describe(0) is None
    calibrated(cal)
    assert cal.known(0)
    curve = cal.curve(0)
    assert curve[9] == pytest.approx((90 + 2 * 0.95) / 102) and curve[3] == pytest.approx((10 + 2 * 0.35) / 102)
    assert curve[4:9] == [curve[3]] * 5  # bins with no tokens: the one below
    assert curve[:3] == [0.05, curve[3], curve[3]]  # below every bin seen: the bin's middle, at most the lowest seen
    assert all(a <= b for a, b in zip(curve, curve[1:]))
    rule = CutRule(tuple(curve), (0.5,))
    assert rule.kept((0.95, 0.35)) == 1 and rule.pays(4)  # the 0.95 tokens pay half a token; the 0.35 ones do not
    assert CutRule(tuple(curve), (0.05,)).kept((0.95, 0.35)) == 2  # a cheap token: both pay
    assert not CutRule(tuple(curve), (0.95,)).pays(4)  # dearer than any token's chance: none pays
    # a bin that did worse than a less confident one is pooled with it: a surer token is never worth less
    worse = Calibration(1, bins=10, min_tokens=1)
    for i in range(100):
        worse.add(0, [0.85], int(i % 10 < 8))
        worse.add(0, [0.95], int(i % 10 < 6))
    assert worse.curve(0)[8] == worse.curve(0)[9] == pytest.approx(0.7, abs=0.01)
    # counts halve past the window: the curve follows the workload
    small = Calibration(1, bins=10, window=100)
    calibrated(small, n=200)
    assert small.total[0] <= 100
    # the curve is solved again once the tokens added since reach 1/refresh of the drafter's, not at every draft
    lazy = Calibration(1, bins=10, min_tokens=1, refresh=4)
    calibrated(lazy, n=40)  # 80 tokens
    solved = lazy.curve(0)
    for _ in range(13):  # 26 tokens: under a quarter of the 106
        lazy.add(0, [0.95, 0.35], 0)
    assert lazy.curve(0) is solved
    lazy.add(0, [0.95, 0.35], 0)  # 28 of 108
    assert lazy.curve(0) is not solved and lazy.curve(0)[9] < solved[9]  # the misses are in


def test_a_draft_is_cut_to_its_prefix_of_greatest_worth_not_at_its_first_token_below_a_floor():
    """Each kept token adds the chance its rating says it survives with its prefix, less its position's price. Where
    the first position costs more than the rest (a CPU forward's second row: 0.5 ms against 0.1-0.6 for each
    later one at batch 1), a first token that does not pay alone is kept for the run behind it that pays for it; a
    run too unsure for even the cheap positions is not; of equal worths the shortest prefix. Past the prices' end
    the last one holds; a token past `limit` is never kept."""
    values = tuple((b + 0.5) / 20 for b in range(20))  # a token is worth its rating (the bin's middle)
    dear_first = CutRule(values, (0.7, 0.1))
    assert dear_first.kept((0.625,)) == 0  # alone: 0.625 < 0.7
    assert dear_first.kept((0.625, 0.575, 0.525, 0.475)) == 4  # -0.075 + 0.475 + 0.425 + 0.375: the run pays
    assert dear_first.kept((0.625, 0.575, 0.525, 0.475), limit=2) == 2
    assert dear_first.kept((0.625, 0.125, 0.075)) == 0  # the run behind it too unsure: -0.075 + 0.025 - 0.025
    assert dear_first.kept((0.975, 0.075, 0.025)) == 1  # past the first, tokens worth less than 0.1 are cut
    assert CutRule(values, (0.525,)).kept((0.525, 0.525)) == 0  # worth exactly its price: nothing gained, not kept
    assert not CutRule(values, (1.0,)).pays(4) and dear_first.pays(1)
    draft = Draft([5, 6, 7, 8], confidence=[0.625, 0.575, 0.075, 0.025])
    assert cut_at(draft, dear_first).tokens == [5, 6] and cut_at(draft, None) is draft
    assert cut_at(Draft([5, 6]), dear_first).tokens == [5, 6]  # a drafter that rates nothing: not cut


def test_lbss_cuts_a_calibrated_drafters_draft_by_its_tokens_ratings():
    """Once suffix's confidences are calibrated by shadow drafts, a request on it keeps its k and gets the rule its
    worker cuts the draft by (the request's own recent survival no longer cuts it); where no token's chance pays
    its price, the request decodes plainly."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"suffix": 1e-5})
    cap = Capacity({"suffix": 16})
    for t in range(60):  # every real draft fails, the shadows say which tokens suffix was right about
        arm = sel.select([info("r", t)], cap)[0]
        drafted = arm.k if arm.drafter else 0
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=drafted, num_accepted=0, num_committed=1,
                                  draft_s=0.0, verify_s=cpu_verify(1, drafted + 1), batch_size=1,
                                  batch_tokens=drafted + 1, shadow=(("suffix", 2, 1 if t % 10 else 0),),
                                  shadow_confidence=(("suffix", (0.95, 0.35), 1 if t % 10 else 0),))])
    assert sel.calibration.known(0)
    arm = sel.select([info("r", 60)], cap)[0]
    assert arm.drafter == "suffix" and arm.k >= 2  # not cut by its history: the draft is, on the worker
    rule = sel.cut_rule("r")
    assert rule.kept((0.95, 0.35)) == 1 and rule.kept((0.35,)) == 0  # 9 in 10 of the first pay, none of the second
    assert sel.cut_rule("other") is None
    state = msgspec.json.decode(msgspec.json.encode(sel.describe()))  # what /v1/spind/state sends
    assert state["cuts"] == {"r": pytest.approx(list(rule.prices), abs=1e-4)}
    assert len(state["calibration"]["suffix"]) == sel.calibration.bins
    # its text stops giving suffix anything sure: its latest two drafts had no prefix that pays. Alone (batch 1)
    # it still drafts, and its worker cuts the draft: its shadow drafts keep its suffix trie current, so
    # a draft costs a lookup, and a copy run is caught on its first slot (replayed, the rule below cost batch-1
    # selection 1-2%). In a batch the next slot is plain without a draft drawn up to be cut to nothing
    for t in (61, 62):
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=cpu_verify(1, 1), batch_size=1, batch_tokens=1,
                                  shadow=(("suffix", 2, 0),), shadow_confidence=(("suffix", (0.15, 0.05), 0),))])
        arm = sel.select([info("r", t)], cap)[0]
    assert arm.drafter == "suffix" and sel.cut_rule("r").kept((0.35,)) == 0
    arms = sel.select([info("r", 63), info("q", 0)], cap)
    assert arms[0] == PLAIN_ARM and sel.cut_rule("r") is None
    sel.remove("q")
    # the same drafter where even its surest tokens fail: nothing pays, plain decoding
    for t in range(61, 200):
        arm = sel.select([info("r", t)], cap)[0]
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=cpu_verify(1, 1), batch_size=1, batch_tokens=1,
                                  shadow=(("suffix", 2, 0),), shadow_confidence=(("suffix", (0.95, 0.35), 0),))])
    assert sel.select([info("r", 200)], cap)[0] == PLAIN_ARM and sel.cut_rule("r") is None


def test_a_price_margin_drafts_only_tokens_worth_more_than_their_seconds():
    """A drafted token must be worth (1 + price_margin) x what plain decoding makes in the seconds it adds: a
    larger margin cuts drafts shorter on the worker, and one that no token's chance clears leaves the request decoding
    plainly (`nothing_pays` too)."""
    confidence = (0.95, 0.75, 0.55, 0.35)
    accepted = [4] * 4 + [3] * 5 + [2] * 5 + [1] * 5 + [0]  # each prefix survives 95, 70, 45, 20% of the time
    got = {}
    for margin in (0.0, 1.0, 2.0, 4.0):  # at batch 1 here a token's seconds are worth 0.31 tokens (margin 0)
        sel = LBSSSelector(SelectionConfig(seed=0, alpha=0, price_margin=margin), ["suffix"], 4,
                           verify_points=profile_points(), draft_s_per_token={"suffix": 1e-5})
        cap = Capacity({"suffix": 16})
        for t in range(100):
            arm = sel.select([info("r", t)], cap)[0]
            acc = accepted[t % len(accepted)]
            sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=0, num_accepted=0, num_committed=1,
                                      draft_s=0.0, verify_s=cpu_verify(1, 1), batch_size=1, batch_tokens=1,
                                      shadow=(("suffix", 4, acc),), shadow_confidence=(("suffix", confidence, acc),))])
        arm = sel.select([info("r", 100)], cap)[0]
        rule = sel.cut_rule("r")
        got[margin] = (arm.drafter, rule.kept(confidence) if rule else 0, sel.describe()["nothing_pays"])
    assert [got[m][0] for m in (0.0, 1.0, 2.0, 4.0)] == ["suffix", "suffix", "suffix", None]
    assert [got[m][1] for m in (0.0, 1.0, 2.0, 4.0)] == [3, 2, 1, 0]  # at 0.31, 0.62, 0.93 tokens a token
    assert got[4.0][2] and not got[2.0][2]
    with pytest.raises(ValueError, match="price_margin"):
        SelectionConfig(price_margin=-0.1)


def test_shadow_drafts_back_off_while_they_find_nothing_that_pays():
    """A request's shadow drafts cost lookups on the target's worker every turn; past batch 1 (here 2: a companion
    request that is never shadowed), while its latest ones would have been cut to nothing (its slots decode plainly), it
    is shadowed at every 2nd, then 4th, then 8th turn, and at every turn again once one has a token that pays. At
    batch 1 every turn (`LBSSSelector.wants_shadow`)."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"suffix": 1e-5})
    cap = Capacity({"suffix": 16})
    sure, unsure = (0.95, 0.35), (0.15, 0.05)

    def turn(t: int, confidence: tuple[float, ...], accepted: int) -> bool:
        """A slot whose select gives the request its shadow turn: whether it was shadowed."""
        arm, other = sel.select([info("r", t), info("c", t)], cap)
        shadowed = sel.wants_shadow("r")
        sel.observe([SlotFeedback(req_id="r", arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=cpu_verify(2, 2), batch_size=2, batch_tokens=2,
                                  shadow=(("suffix", 2, accepted),) if shadowed else (),
                                  shadow_confidence=(("suffix", confidence, accepted),) if shadowed else ()),
                     SlotFeedback(req_id="c", arm=other, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=cpu_verify(2, 2), batch_size=2, batch_tokens=2)])
        return shadowed

    assert all(turn(t, sure, 1 if t % 10 else 0) for t in range(60))  # calibrating: sure tokens pay, unsure not
    assert sel.calibration.known(0)
    quiet = [turn(t, unsure, 0) for t in range(60, 80)]
    assert quiet == [True, True, False, True, False, False, False, True] + [False] * 7 + [True] + [False] * 4
    # the latest shadows had nothing that pays; alone (batch 1), its draft is still drawn up and cut on the worker
    assert sel.select([info("r", 80)], cap)[0].drafter == "suffix" and sel.cut_rule("r").kept(unsure) == 0
    skipped = 0
    while not turn(81 + skipped, sure, 1):  # the next turn that shadows finds a token that pays again ...
        skipped += 1
    assert skipped == 3  # (the 8th turn after the last one shadowed)
    assert all(turn(t, sure, 1) for t in range(90, 100))  # ... and from then on every turn is shadowed
    assert sel.select([info("r", 100)], cap)[0].drafter == "suffix"


def test_between_calibrated_drafters_the_one_right_lately_is_chosen_and_misses_keep_a_drafter():
    """Both drafters rate their tokens alike and are calibrated alike over the population; this request's latest
    suffix drafts were accepted and its n-gram ones were not: the matching puts it on suffix. A request whose drafts
    on both all missed lately is valued as plain decoding on them, and stays on a drafter: the worker's cut
    decides each slot (no stage-long plain decoding on a run of misses)."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    rated = (0.95, 0.9, 0.85, 0.8)
    for t in range(40):  # the population: both drafters right 3 times in 4, on other requests
        for r in ("p1", "p2"):
            sel.select([info(r, t)], cap)
            ok = 4 if t % 4 else 0
            sel.observe([SlotFeedback(req_id=r, arm=PLAIN_ARM, num_drafted=0, num_accepted=0, num_committed=1,
                                      draft_s=0.0, verify_s=cpu_verify(1, 1), batch_size=1, batch_tokens=1,
                                      shadow=(("ngram", 4, ok), ("suffix", 4, ok)),
                                      shadow_confidence=(("ngram", rated, ok), ("suffix", rated, ok)))])
    for r in ("p1", "p2"):
        sel.remove(r)
    assert sel.calibration.known(0) and sel.calibration.known(1)
    for t in range(8):  # "r": suffix right, n-gram wrong; "m": both wrong
        arms = sel.select([info("r", t), info("m", t)], cap)
        sel.observe([SlotFeedback(req_id=n, arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=cpu_verify(2, 2), batch_size=2, batch_tokens=2,
                                  shadow=(("ngram", 4, 0), ("suffix", 4, 4 if n == "r" else 0)),
                                  shadow_confidence=(("ngram", rated, 0), ("suffix", rated, 4 if n == "r" else 0)))
                     for n, arm in zip(("r", "m"), arms)])
    sel.stage_slots = sel.slot_in_stage  # a new stage: a fresh matching
    r, m = sel.select([info("r", 9), info("m", 9)], cap)
    assert r.drafter == "suffix" and sel.cut_rule("r") is not None
    assert m.drafter is not None  # on a drafter, valued as plain: the cut decides each slot


def test_where_no_draft_token_could_pay_the_batch_decodes_plainly_without_shadows():
    """At batch 8 this machine's verify costs 3 ms per token carried, a plain slot 2 ms per request: a draft token
    sure to be accepted still costs more than the token it adds, so selection decodes plainly without exploring
    and asks for no shadow drafts; at batch 1 (1 ms per token, 4 ms a slot) drafts may pay again."""
    points = [(1, 1, 0.004), (1, 5, 0.008), (8, 8, 0.016), (8, 40, 0.112)]
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=4), ["ngram"], 4, verify_points=points,
                       draft_s_per_token={"ngram": 1e-5})
    cap = Capacity({"ngram": 16})
    for t in range(10):  # exploration slots included
        assert sel.select([info(f"r{i}", t) for i in range(8)], cap) == [PLAIN_ARM] * 8
        assert not any(sel.wants_shadow(f"r{i}") for i in range(8))
    assert sel.describe()["nothing_pays"]
    sel.select([info("r0", 10)], cap)
    assert sel.wants_shadow("r0") and not sel.describe()["nothing_pays"]


def test_settled_plain_slots_skip_the_selection_but_not_the_cost_model():
    """While no draft token can pay, a slot of the same requests again is plain without the full selection, and only
    every PLAIN_SAMPLE-th one's plain rewards are counted; a newcomer or a request naming its drafter takes the full
    path, and forwards that make drafting pay again end it within REPRICE_FORWARDS slots (the cost model learns from
    every forward)."""
    from spind.coordinator.selection.lbss import PLAIN_SAMPLE

    points = [(1, 1, 0.004), (1, 5, 0.008), (8, 8, 0.016), (8, 40, 0.112)]
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=4), ["ngram"], 4, verify_points=points,
                       draft_s_per_token={"ngram": 1e-5})
    cap = Capacity({"ngram": 16})
    reqs = [info(f"r{i}", 0) for i in range(8)]

    def plain_slot(t: int, seconds: float = 0.016, tokens: int = 8) -> list[Arm]:
        arms = sel.select([info(f"r{i}", t) for i in range(8)], cap)
        sel.observe([SlotFeedback(req_id=f"r{i}", arm=a, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                                  verify_s=seconds, batch_size=8, batch_tokens=tokens) for i, a in enumerate(arms)])
        return arms

    assert sel.select(reqs, cap) == [PLAIN_ARM] * 8 and sel.describe()["nothing_pays"]
    assert sel.describe()["settled_slots"] == 0  # the first slot of a batch: the full selection
    for t in range(1, 2 * PLAIN_SAMPLE + 1):
        assert plain_slot(t) == [PLAIN_ARM] * 8
    state = sel.describe()
    assert state["settled_slots"] == 2 * PLAIN_SAMPLE and state["num_slots"] == 2 * PLAIN_SAMPLE + 1
    counted = sel.population.counts.slots[..., 0].sum()  # plain slots counted in the population: 2 samples of 8
    assert counted == 2 * 8 and sel.observed_s == pytest.approx(2 * PLAIN_SAMPLE * 0.016)  # every slot's seconds
    # a newcomer and a request naming its drafter: the full path (the named one keeps its drafter)
    named = RequestInfo(req_id="r7", requested="ngram", requested_k=None, current=None, num_prompt_tokens=40,
                        num_output_tokens=0)
    assert sel.select([*reqs[:7], named], cap)[7] == Arm("ngram", 4)
    assert sel.select([*reqs[:7], info("r8", 0)], cap) == [PLAIN_ARM] * 8
    assert sel.describe()["settled_slots"] == 2 * PLAIN_SAMPLE
    # forwards at batch 8 that carry 40 tokens for the price of 8: drafting pays again, and the next slot says so
    for t in range(60):
        plain_slot(100 + t, seconds=0.0161, tokens=40 if t % 2 else 8)
        if not sel.describe()["nothing_pays"]:
            break
    assert not sel.describe()["nothing_pays"] and sel.wants_shadow("r0")


def test_prices_are_read_again_every_few_forwards_and_at_once_for_a_new_batch_size():
    """What a plain slot makes per second (the price every draft token is held to) is read from the cost model again
    after REPRICE_FORWARDS forwards, not after each one; a slot of another batch size reads its own at once."""
    from spind.coordinator.selection.lbss import REPRICE_FORWARDS

    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5})
    cap = Capacity({"ngram": 16})
    sel.select([info("r0", 0)], cap)
    first = sel.describe()["plain_price"]
    assert first == pytest.approx(1 / cpu_verify(1, 1), rel=0.01)
    prices = []
    for t in range(REPRICE_FORWARDS):  # the machine slowed down: each 1-token forward takes twice the profile's
        sel.observe([SlotFeedback(req_id="r0", arm=PLAIN_ARM, num_drafted=0, num_accepted=0, num_committed=1,
                                  draft_s=0.0, verify_s=2 * cpu_verify(1, 1), batch_size=1, batch_tokens=1)])
        sel.select([info("r0", t + 1)], cap)
        prices.append(sel.describe()["plain_price"])
    assert prices[:-1] == [first] * (REPRICE_FORWARDS - 1) and prices[-1] < first
    sel.select([info("r0", 9), info("r1", 0)], cap)
    assert sel.describe()["plain_price"] == pytest.approx(2 / sel.cost.predict(2, 2), rel=1e-3)


def test_without_batch_pricing_lbss_speculates_on_the_same_batch():
    """The control: the paper's per-request weights speculate where pricing does not (so the test above tests
    the pricing, not the workload)."""
    sel = LBSSSelector(SelectionConfig(seed=0, batch_pricing=False), ["ngram"], 4, verify_points=profile_points())
    assert not sel.prices_batch
    p = {f"r{i}": 0.3 for i in range(8)}
    history = run_slots(sel, p, 200, np.random.default_rng(0))
    late = [arm for arms in history[100:] for arm in arms]
    assert sum(arm != PLAIN_ARM for arm in late) / len(late) > 0.5


def test_exploration_skips_arms_the_population_shows_to_lose_at_this_load():
    """Requests come and go (20 slots each); a newcomer whose drafts are mostly rejected draws, in exploration, no
    arm of the (model) drafter that its context's requests already showed to lose at batch 8. The paper's
    exploration keeps paying for them: each newcomer tries them until its own slots rule them out. (n-gram
    lookup needs no such rule: its shadow drafts teach every greedy request its acceptance for free.)"""
    p = {f"r{i}": 0.05 for i in range(8)}
    share = {}
    for pricing in (True, False):
        sel = LBSSSelector(SelectionConfig(seed=0, alpha=4, batch_pricing=pricing), ["int8"], 4,
                           verify_points=profile_points(), draft_s_per_token={"int8": 0.001})
        history = run_slots(sel, p, 400, np.random.default_rng(2), lifetime=20, drafter="int8")
        late = [arm for arms in history[200:] for arm in arms]
        share[pricing] = sum(arm.drafter is not None for arm in late) / len(late)
    assert share[True] < 0.01 < share[False], share


def test_exploration_skips_a_losing_drafter_on_evidence_pooled_over_contexts():
    """The same, with requests spread over four prompt-length contexts: a context's estimate is shrunk towards
    everyone's, so the evidence that rules a drafter out is everyone's too, not 16 slots in each context (which
    a drafter explored a few per cent of the time takes hundreds of requests to gather)."""
    p = {f"r{i}": 0.05 for i in range(8)}
    lengths = {f"r{i}": (40, 100, 300, 1500)[i % 4] for i in range(8)}
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=4), ["int8"], 4, verify_points=profile_points(),
                       draft_s_per_token={"int8": 0.001})
    history = run_slots(sel, p, 240, np.random.default_rng(2), lifetime=20, drafter="int8", prompt_tokens=lengths)
    late = [arm for arms in history[80:] for arm in arms]
    assert sum(arm.drafter is not None for arm in late) / len(late) < 0.01


def test_simulator_feedback_without_batch_tokens_keeps_the_papers_weights():
    sel = LBSSSelector(SelectionConfig(seed=0), ["ngram"], 4)
    run_slots(sel, {"a": 0.5, "b": 0.5}, 20, np.random.default_rng(0), batch_pricing_feedback=False)
    assert not sel.prices_batch and sel.describe()["verify_cost"] is None


# ---- where the numbers come from ---------------------------------------------------------------------------------

def test_profile_gives_verify_points_with_and_without_drafts_and_round_trips():
    prof = SystemProfile(4, {"int8": 3.0}, {1: 10.0, 8: 40.0}, 1.0, 6.0, {1: 6.0, 8: 12.0})
    again = SystemProfile.from_json(prof.to_json())
    assert again == prof
    assert sorted(again.verify_points()) == [(1, 1, 0.006), (1, 5, 0.010), (8, 8, 0.012), (8, 40, 0.040)]
    old = prof.to_json()
    del old["decode_batch_ms"], old["lone_verify_ms"]  # a profile cached before those points: still read
    assert SystemProfile.from_json(old).decode_batch_ms == {} == SystemProfile.from_json(old).lone_verify_ms
    lone = SystemProfile(4, {}, {1: 10.0, 8: 40.0}, 1.0, 6.0, {1: 6.0, 8: 12.0}, {8: [13.0, 14.0, 15.0, 16.0]})
    assert SystemProfile.from_json(lone.to_json()) == lone
    assert {(8, 9, 0.013), (8, 12, 0.016)} <= set(lone.verify_points())  # one request drafting 1 .. k
    slow = SystemProfile(4, {}, {1: 10.0, 8: 40.0}, 1.0, 6.0, {1: 6.0, 8: 12.0}, {8: [13.0, 14.0, 15.0, 120.0]})
    assert "8 requests and 12 tokens took 120.0 ms" in slow.implausible()  # slower than its 12 tokens one by one


def test_a_verify_outcome_reports_its_forwards_tokens_unless_it_was_split():
    results = [P.VerifyResult(req_id="a", tokens=[1, 2], num_drafted=4, num_accepted=1),
               P.VerifyResult(req_id="b", tokens=[3], num_drafted=0, num_accepted=0)]
    assert VerifyOutcome([], results, 0.01).num_tokens == 6
    assert VerifyOutcome([], results, 0.01, num_forwards=2).num_tokens == 0
    assert VerifyOutcome([], results, 0.01, on_share=True).num_tokens == 0  # on fewer threads than it is priced at
