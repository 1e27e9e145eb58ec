"""The shadow ledger (what the free drafters' shadow drafts would have been worth, per batch size) and the two
decisions LBSS takes from it: leaving out a free drafter another one dominates, and not selecting at all where
selecting costs more than speculation is worth. Scripted feedback, no clock, no model."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from spind.config import SelectionConfig
from spind.coordinator.selection import lbss
from spind.coordinator.selection.ledger import ShadowLedger, Verdict
from spind.coordinator.selection.lbss import LBSSSelector, bucket_of
from spind.coordinator.selection.protocol import PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback
from spind.draft_cut import CutRule

C0, C_REQ, C_TOK = 0.004, 0.0005, 0.002  # a CPU-like verify: 2 ms per token carried


def cpu_verify(batch: int, tokens: int) -> float:
    return C0 + C_REQ * batch + C_TOK * tokens


def profile_points() -> list[tuple[int, int, float]]:
    return [(b, t, cpu_verify(b, t)) for b in (1, 2, 4, 8, 16) for t in (b, 5 * b)]


def info(req_id: str, n_out: int) -> RequestInfo:
    return RequestInfo(req_id=req_id, requested="auto", requested_k=None, current=None, num_prompt_tokens=40,
                       num_output_tokens=n_out)


def flat(rule, cost):
    """A Pricing: every drafter cut by `rule` (None: never cut), each draft token costing `cost` tokens."""
    return lambda j: (rule, (cost,))


# a calibration curve over 20 bins: a token rated 0.5 or more survives, one rated less never does
SURE_ABOVE_HALF = (0.0,) * 10 + (1.0,) * 10


def test_drafts_valued_at_the_prices_asked_cut_by_the_rule():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    led = ShadowLedger(["ngram", "suffix"], window=1000, evidence=10, margin=0.15, max_len=4)
    for _ in range(9):
        led.add(0, 4, 1, (0.9, 0.3, 0.3, 0.3))  # n-gram: its first token survives, rated high; the rest rated low
        led.add(1, 4, 4, None)  # suffix: accepted whole, unrated
    cheap = flat(None, 0.25)  # batch-1-like: a draft token costs a quarter of a token
    assert led.verdict(cheap) == Verdict((None, None), None, frozenset())
    led.add(0, 4, 1, (0.9, 0.3, 0.3, 0.3))
    assert led.verdict(cheap).best is None  # suffix still below the evidence: it might pay
    led.add(1, 4, 4, None)
    v = led.verdict(cheap)
    assert v.rates == pytest.approx((1 - 4 * 0.25, 4 - 4 * 0.25)) and v.best == pytest.approx(3.0)
    assert v.dominated == {"ngram"}  # 0.0 < 0.85 x 3.0
    assert led.verdict(cheap, limit=2).rates == pytest.approx((1 - 2 * 0.25, 2 - 2 * 0.25))  # at most 2 a draft
    cut = led.verdict(flat(CutRule(SURE_ABOVE_HALF, (0.25,)), 0.25))  # n-gram's draft is cut after its first token
    assert cut.rates == pytest.approx((0.75, 3.0))  # (an unrated token is read surest)
    dear = led.verdict(flat(CutRule(SURE_ABOVE_HALF, (1.2,)), 1.2))  # where a draft token costs more than a token
    assert dear.rates == pytest.approx((0.0, 0.0)) and dear.best == 0.0  # no prefix pays: every draft cut away
    assert dear.dominated == frozenset()  # nothing pays: no judge
    shaped = led.verdict(lambda j: (None, (0.1, 0.2, 0.5)))  # a price per position, the last one holding
    assert shaped.rates[1] == pytest.approx(4 - (0.1 + 0.2 + 0.5 + 0.5))
    empty = ShadowLedger(["ngram"], evidence=1)
    empty.add(0, 0, 0, ())
    assert empty.verdict(cheap).rates == (0.0,)  # a proposal of nothing is worth nothing
    weighed = ShadowLedger(["ngram"], evidence=1)
    weighed.add(0, 4, 4, slots=1.0)  # a draft accepted whole: the drafter's own slot there would take all of it
    weighed.add(0, 4, 0, slots=3.0)  # one that fails where its own slots would have run 3 times, all failing
    assert weighed.verdict(cheap).rates[0] == pytest.approx((3.0 * 1 + (-1.0) * 3) / 4, abs=0.01)
    recent = ShadowLedger(["ngram"], window=4, evidence=1)
    for _ in range(50):
        recent.add(0, 4, 4)
    for _ in range(20):
        recent.add(0, 4, 0)
    assert recent.verdict(cheap).rates[0] == pytest.approx(-1.0)  # the latest window of drafts weighs
    with pytest.raises(ValueError):
        ShadowLedger(["ngram"], margin=1.0)


def test_the_ledger_cuts_each_draft_where_its_worker_would():
    """The ledger's cut (numpy over its drafts) keeps, draft by draft, what `CutRule.kept` keeps on the worker: so
    it values a drafter as its slots would run it. Random ratings (non-increasing), curves and prices, a first
    position dearer than the rest."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        curve = tuple(np.sort(rng.uniform(0, 1, 20)))
        prices = (float(rng.uniform(0.1, 1.2)), float(rng.uniform(0.0, 0.4)))
        limit = int(rng.integers(1, 9))
        led = ShadowLedger(["suffix"], window=64, evidence=1, max_len=8)
        drafts = []
        for _ in range(30):
            n = int(rng.integers(0, 9))
            rating = tuple(np.sort(rng.uniform(0, 1, n))[::-1])
            accepted = int(rng.integers(0, n + 1))
            led.add(0, n, accepted, rating)
            drafts.append((rating, accepted))
        rule = CutRule(curve, prices)
        costs = (0.3, 0.1)
        got = led.worth(0, rule, costs, limit)
        weights = (1 - 1 / 64) ** np.arange(len(drafts))[::-1]
        values = []
        for rating, accepted in drafts:
            kept = rule.kept(rating, limit)
            values.append(min(accepted, kept) - sum(costs[min(t, 1)] for t in range(kept)))
        assert got == pytest.approx(float(np.dot(weights, values) / weights.sum())), trial


def test_drafts_read_in_between_or_only_at_the_end_value_alike():
    """Drafts are kept as added and written into the ledger's arrays when it is next read: two drafters' drafts,
    interleaved and past the window (the oldest overwritten), value the same read after every few adds as read
    once at the end, and the count of drafts seen is exact throughout."""
    rng = np.random.default_rng(5)
    rule, costs = CutRule(tuple(np.linspace(0.05, 0.95, 20)), (0.4, 0.1)), (0.3, 0.1)
    often, once = (ShadowLedger(["ngram", "suffix"], window=16, evidence=4, max_len=8) for _ in range(2))
    for i in range(100):
        j, n = int(rng.integers(0, 2)), int(rng.integers(0, 9))
        rating = None if j == 0 else tuple(np.sort(rng.uniform(0, 1, n))[::-1])
        args = (j, n, int(rng.integers(0, n + 1)), rating, float(rng.choice([1.0, 0.5])))
        often.add(*args)
        once.add(*args)
        assert often.seen(j) == once.seen(j)
        if i % 7 == 0:
            often.worth(0, None, costs)
            often.worth(1, rule, costs, 4)
    for j, r in ((0, None), (1, rule)):
        assert often.worth(j, r, costs, 4) == pytest.approx(once.worth(j, r, costs, 4))


def shadow_feedback(req_id: str, arm, batch: int, worth: dict[str, int], select_s: float = 0.0) -> SlotFeedback:
    """A plain-decoded slot of `batch` requests whose shadow drafts (4 tokens each, all rated 0.95) had worth[d]
    tokens accepted per drafter."""
    return SlotFeedback(req_id=req_id, arm=arm, num_drafted=0, num_accepted=0, num_committed=1, draft_s=0.0,
                        verify_s=cpu_verify(batch, batch), batch_size=batch, batch_tokens=batch,
                        shadow=tuple((d, 4, a) for d, a in worth.items()),
                        shadow_confidence=tuple((d, (0.95,) * 4, a) for d, a in worth.items()), select_s=select_s)


def test_a_drafter_a_few_per_cent_behind_on_the_same_text_is_left_out(monkeypatch):
    """The ledger weighs the population's drafts of both drafters on the same slots, so a drafter that trails the
    best one by 7% (n-gram's drafts fail whole one time in 20) is ruled out (lbss.DOMINANCE_MARGIN), not kept in the
    matching for a request's noise to pick; one 3.5% behind (one in 40) is kept."""
    monkeypatch.setattr(lbss, "DOMINANCE_EVIDENCE", 20)
    for ngram_every, dominated in ((20, {"ngram"}), (40, set())):  # n-gram's draft fails whole every so many
        sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                           draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
        cap = Capacity({"ngram": 16, "suffix": 16})
        for t in range(200):
            arm = sel.select([info("r", t)], cap)[0]
            ngram = 0 if t % ngram_every == 0 else 4
            sel.observe([shadow_feedback("r", arm, 1, {"suffix": 4, "ngram": ngram})])
        assert sel.dominated == dominated, ngram_every


def test_a_free_drafter_another_one_dominates_on_the_same_text_is_left_out(monkeypatch):
    """Shadow drafts of both free drafters, on the same slots: suffix's are accepted whole, n-gram's one time in
    four. Once both have the ledger's evidence, n-gram is neither explored nor exploited; where n-gram turns out the
    better one, suffix is left out instead."""
    monkeypatch.setattr(lbss, "DOMINANCE_EVIDENCE", 20)
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    used = []
    for t in range(200):
        arm = sel.select([info("r", t)], cap)[0]
        used.append(arm.drafter)
        sel.observe([shadow_feedback("r", arm, 1, {"suffix": 4, "ngram": 4 if t % 4 == 0 else 0})])
    assert sel.dominated == {"ngram"}
    assert "ngram" not in used[100:] and used[100:].count("suffix") > 90  # exploration slots included
    state = msgspec.json.decode(msgspec.json.encode(sel.describe()))
    assert state["dominated"] == ["ngram"] and state["ledger"]["1"]["suffix"] > state["ledger"]["1"]["ngram"]
    for t in range(200, 1500):  # the text changes: n-gram's drafts are the ones accepted now
        arm = sel.select([info("r", t)], cap)[0]
        used.append(arm.drafter)
        sel.observe([shadow_feedback("r", arm, 1, {"suffix": 0, "ngram": 4})])
    assert sel.dominated == {"suffix"} and "suffix" not in used[-50:]


def test_no_selection_where_selecting_costs_more_than_the_drafts_are_worth():
    """Two requests (batch 2) whose shadow drafts are worth little, while a fully selected slot spends a lot of time
    selecting: once the ledger knows every drafter there, the requests decode plainly with no selection (as where
    nothing pays), and only every IDLE_SHADOW-th shadow turn is granted, which keeps the ledger current: when the
    drafts start to pay, selection comes back."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    reqs = ["a", "b"]
    t = 0

    def slot(worth: dict[str, int], select_s: float) -> tuple[list, bool]:
        nonlocal t
        arms = sel.select([info(r, t) for r in reqs], cap)
        shadowed = sel.wants_shadow(reqs[t % 2])  # one request's turn a slot, as the coordinator asks
        sel.observe([shadow_feedback(r, a, 2, worth if shadowed and r == reqs[t % 2] else {}, select_s / 2)
                     for r, a in zip(reqs, arms)])
        t += 1
        return arms, shadowed

    # a drafted token costs 0.56 tokens at batch 2 here: a sure one (accepted whole) gains ~0.44 a token, 1.75 a draft;
    # one in eight accepted drafts is worth ~0.2 a draft, against 2 ms of selecting at 222 tokens/s (0.44 tokens)
    while not sel.idle:
        slot({"ngram": 4 if t % 16 == 0 else 0, "suffix": 4 if t % 16 == 0 else 0}, 0.002)
        assert t < 2000
    arms, _ = slot({}, 0.0)
    assert arms == [PLAIN_ARM, PLAIN_ARM] and sel.describe()["nothing_pays"]
    granted = [slot({"ngram": 0, "suffix": 0}, 0.0)[1] for _ in range(4 * lbss.IDLE_SHADOW)]
    assert sum(granted) == 4  # every IDLE_SHADOW-th turn
    for _ in range(5000):  # the drafts pay now (the idle slots' own selecting cost nothing: they do not count)
        arms, _ = slot({"ngram": 4, "suffix": 4}, 0.002)
        if not sel.idle:
            break
    assert not sel.idle and not sel.describe()["nothing_pays"]
    assert any(a.drafter is not None for _ in range(20) for a in slot({"ngram": 4, "suffix": 4}, 0.002)[0])


def test_batch_1_never_idles_however_little_the_drafts_are_worth():
    """Alone in its slot a request keeps selection (its cut decides each slot) where the same drafts and selecting
    seconds idle a batch of 2 (IDLE_MIN_BATCH): idling thins the shadow drafts that tell when the text turns."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    for t in range(1500):
        arm = sel.select([info("a", t)], cap)[0]
        shadowed = sel.wants_shadow("a")
        worth = {"ngram": 4 if t % 16 == 0 else 0, "suffix": 4 if t % 16 == 0 else 0}
        sel.observe([shadow_feedback("a", arm, 1, worth if shadowed else {}, 0.002)])
        assert not sel.idle and shadowed, t
    assert sel.verdict.best is not None  # the ledger knew every drafter: it was the batch size that kept it on


def test_a_model_drafter_keeps_selection_on():
    """The ledger values only free drafters (shadow drafts); with a model drafter in the arm set, nothing says it would
    not pay, so selection never goes idle however little the free ones are worth."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=0), ["ngram", "int8"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "int8": 1e-3})
    cap = Capacity({"ngram": 16, "int8": 16})
    for t in range(300):
        arm = sel.select([info("r", t)], cap)[0]
        sel.observe([shadow_feedback("r", arm, 1, {"ngram": 0}, select_s=0.01)])
    assert sel.verdict.best is None and not sel.idle


def settling_selector(monkeypatch) -> tuple[LBSSSelector, Capacity]:
    """LBSS over n-gram lookup and suffix decoding (no KV drafters), deciding from 20 drafts and repricing at every
    forward, with room for both."""
    monkeypatch.setattr(lbss, "DOMINANCE_EVIDENCE", 20)
    monkeypatch.setattr(lbss, "REPRICE_FORWARDS", 1)
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5}, kv_drafters=())
    return sel, Capacity({"ngram": 16, "suffix": 16})


def settle(sel: LBSSSelector, cap: Capacity) -> int:
    """Slots of one request until selection settles (suffix's drafts accepted whole, n-gram's one time in four);
    returns the slots run."""
    t = 0
    while sel.settled_on is None:
        arm = sel.select([info("r", t)], cap)[0]
        sel.observe([shadow_feedback("r", arm, 1, {"suffix": 4, "ngram": 4 if t % 4 == 0 else 0})])
        t += 1
        assert t < 500
    return t


def test_with_one_calibrated_drafter_left_selection_settles_on_it_without_the_matching(monkeypatch):
    """Once the ledger leaves suffix decoding alone (n-gram dominated) and its confidence is calibrated, the stages'
    exploration and matching could only choose among its k's and plain decoding, which its cut already
    decides slot by slot: every request runs it at the default k with its cut, no matching is drawn up, and past
    batch 1 only every SETTLED_SHADOW-th shadow turn is granted. A request that names its drafter, a model drafter in
    the arm set, or n-gram catching up on the text unsettles it."""
    sel, cap = settling_selector(monkeypatch)
    t = settle(sel, cap)
    assert sel.settled_on == "suffix" and sel.dominated == {"ngram"}

    def no_matching(*_):
        raise AssertionError("settled: no matching, no exploration")
    monkeypatch.setattr(sel, "_exploit", no_matching)
    monkeypatch.setattr(sel, "_explore", no_matching)
    granted = []
    for _ in range(4 * lbss.SETTLED_SHADOW):
        arms = sel.select([info("r", t)], cap)
        assert arms == [Arm("suffix", 4)] and sel.cut_rule("r").kept((0.95,) * 4) == 4
        granted.append(sel.wants_shadow("r"))
        sel.observe([shadow_feedback("r", arms[0], 1, {"suffix": 4, "ngram": 1})])
        t += 1
    assert all(granted)  # batch 1: every turn (its shadow drafts follow each drafter's own slots: `ShadowDrafts`)
    granted = []
    for _ in range(4 * lbss.SETTLED_SHADOW):  # past batch 1: every SETTLED_SHADOW-th turn
        arms = sel.select([info("r", t), info("s", t)], cap)
        assert arms == [Arm("suffix", 4)] * 2
        granted.append(sel.wants_shadow("r"))
        sel.observe([shadow_feedback(r, a, 2, {"suffix": 4, "ngram": 1}) for r, a in zip("rs", arms)])
        t += 1
    assert sum(granted) == 4
    sel.remove("s")
    state = msgspec.json.decode(msgspec.json.encode(sel.describe()))
    assert state["settled_on"] == "suffix" and state["settled_on_slots"] >= 4 * lbss.SETTLED_SHADOW
    named = RequestInfo(req_id="n", requested="ngram", requested_k=2, current=None, num_prompt_tokens=40,
                        num_output_tokens=0)
    with pytest.raises(AssertionError, match="settled"):  # a request that names its drafter: the full selection
        sel.select([named], cap)
    sel.remove("n")
    monkeypatch.undo()
    for _ in range(2000):  # the text changes: n-gram's drafts are the ones accepted now
        arm = sel.select([info("r", t)], cap)[0]
        sel.observe([shadow_feedback("r", arm, 1, {"suffix": 0, "ngram": 4})])
        t += 1
        if sel.settled_on == "ngram":
            break
    assert sel.settled_on == "ngram" and sel.select([info("r", t)], cap)[0] == Arm("ngram", 4)
    costs = {"ngram": 1e-5, "suffix": 1e-5, "int8": 1e-3}
    model = LBSSSelector(SelectionConfig(seed=0, alpha=2), list(costs), 4, verify_points=profile_points(),
                         draft_s_per_token=costs)
    for t in range(300):
        arm = model.select([info("r", t)], Capacity({"ngram": 16, "suffix": 16, "int8": 16}))[0]
        model.observe([shadow_feedback("r", arm, 1, {"suffix": 4, "ngram": 0})])
    assert model.settled_on is None  # the ledger cannot value a model drafter: nothing is settled


def test_settled_selection_learns_the_matchings_estimates_from_a_sample_of_its_slots_and_reprices_less_often(
        monkeypatch):
    """Settled, nothing reads the matching's estimates (the population's, the request's counts): they learn from
    every SETTLED_SAMPLE-th slot, what the matching starts from when selection unsettles, while the calibration and
    the ledger, which decide each settled slot and whether it stays settled, learn from every one; the cost model
    learns from every SETTLED_SAMPLE-th forward, and the prices are read every REPRICE_SETTLED forwards, all of them
    counted (here every forward while not settled)."""
    sel, cap = settling_selector(monkeypatch)
    t = settle(sel, cap)
    readings = []  # the slots a price reading read the ledger at
    verdict = sel.ledger.verdict
    monkeypatch.setattr(sel.ledger, "verdict", lambda *a: (readings.append(t), verdict(*a))[1])
    forwards = []
    observe = sel.cost.observe
    monkeypatch.setattr(sel.cost, "observe", lambda *a: (forwards.append(a), observe(*a))[1])
    slots, tokens = sel.population.counts.slots.sum(), list(sel.calibration.total)
    drafts = [sel.ledger.seen(j) for j in range(2)]
    n = 4 * lbss.REPRICE_SETTLED
    for _ in range(n):
        arms = sel.select([info("r", t)], cap)
        assert arms == [Arm("suffix", 4)] and sel.settled_on == "suffix"
        sel.observe([shadow_feedback("r", arms[0], 1, {"suffix": 4, "ngram": 1})])
        t += 1
    assert sel.population.counts.slots.sum() - slots == n // lbss.SETTLED_SAMPLE
    assert [a - b for a, b in zip(sel.calibration.total, tokens)] == [4 * n, 4 * n]
    assert [sel.ledger.seen(j) - d for j, d in enumerate(drafts)] == [n, n]
    assert len(readings) == 4 and readings[1] - readings[0] == lbss.REPRICE_SETTLED
    assert len(forwards) == n // lbss.SETTLED_SAMPLE


def test_a_batch_going_back_and_forth_between_two_sizes_reads_the_ledger_once_per_size_and_reading(monkeypatch):
    """A closed loop's batch goes 4, 3, 4 as requests end and the next ones join: each size keeps its ledger verdict
    for as long as a price reading lasts (REPRICE_FORWARDS forwards), rather than reading it (its dearest part) at
    every change of size."""
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    for t in range(40):  # evidence for both drafters, so that the verdict is read
        arms = sel.select([info("a", t), info("b", t)], cap)
        sel.observe([shadow_feedback(r, arm, 2, {"suffix": 4, "ngram": 2}) for r, arm in zip("ab", arms)])
    readings = []
    verdict = sel.ledger.verdict
    monkeypatch.setattr(sel.ledger, "verdict", lambda *a: (readings.append(1), verdict(*a))[1])
    n = 4 * lbss.REPRICE_FORWARDS
    for t in range(40, 40 + n):
        batch = ["a", "b"] if t % 2 else ["a"]
        arms = sel.select([info(r, t) for r in batch], cap)
        sel.observe([shadow_feedback(r, arm, len(batch), {"suffix": 4, "ngram": 2}) for r, arm in zip(batch, arms)])
    assert 2 * n // lbss.REPRICE_FORWARDS - 2 <= len(readings) <= 2 * n // lbss.REPRICE_FORWARDS + 2 < n


def test_drafts_seen_at_one_load_value_the_drafters_at_another(monkeypatch):
    """The ledger keeps the drafts, not their worth at one batch size: learned at batch 2, where drafts that survive
    whole three times in five pay (a draft token costs ~0.44 tokens there), it says, when the load grows to 16
    requests (~0.73 tokens a draft token), that the same drafts do not pay there (its cut leaves nothing of them):
    selection is idle there as soon as a slot of that size has timed its selecting, with no shadow draft seen at it
    (kept per batch size, the ledger knew nothing at 16 until 20 more were)."""
    monkeypatch.setattr(lbss, "DOMINANCE_EVIDENCE", 20)
    monkeypatch.setattr(lbss, "REPRICE_FORWARDS", 1)
    sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                       draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
    cap = Capacity({"ngram": 16, "suffix": 16})
    pair = ["a", "b"]
    for t in range(400):
        arms = sel.select([info(r, t) for r in pair], cap)
        accepted = 4 if t % 5 < 3 else 0
        sel.observe([shadow_feedback(r, a, 2, {"ngram": accepted, "suffix": accepted} if r == pair[t % 2] else {},
                                     select_s=0.001) for r, a in zip(pair, arms)])
    assert sel.verdict.best > 0 and not sel.idle
    crowd = [f"r{i}" for i in range(16)]
    idle_at = None
    for t in range(4):
        arms = sel.select([info(r, t) for r in crowd], cap)
        if sel.idle and idle_at is None:
            idle_at = t
        sel.observe([shadow_feedback(r, a, 16, {}, select_s=0.0002) for r, a in zip(crowd, arms)])
    assert idle_at == 1 and sel.verdict.best <= 0 and arms == [PLAIN_ARM] * 16
    ledger = sel.describe()["ledger"]
    assert ledger["2"]["suffix"] > 0 >= ledger["16"]["suffix"]


def copy_text_acceptance(p: int) -> int:
    """n-gram lookup's shadow draft after p tokens of a text that repeats, every 64 tokens, a run of 24 it can copy:
    inside the run its draft matches what is left of it (at most 8 tokens); elsewhere it proposes nothing."""
    left = 24 - p % 64
    return min(8, left) if left > 0 else 0


def test_a_copy_run_counts_once_for_the_drafter_that_would_copy_it_whole(monkeypatch):
    """A request that runs suffix decoding (it names it: one token a slot, always accepted), with shadow drafts on
    every slot, over a text that has a copy run of 24 tokens every 64: n-gram lookup would take a run in about five
    of its own slots (4 tokens each at k = 4) and propose nothing elsewhere. On its own slots suffix decoding is
    worth more (~0.69 tokens a slot against n-gram's ~0.3), but a run shows in a shadow draft at each of the 12
    slots suffix decoding spends on it: counted one a draft (what the slots did unknown), n-gram lookup rates above
    suffix decoding, which is left out. Weighed by the own slots each draft stands for (`LBSSSelector._ledger`: a
    draft accepted to k, at a slot that committed 2 tokens, 2 / 5 of one), n-gram lookup is the one left out."""
    monkeypatch.setattr(lbss, "DOMINANCE_EVIDENCE", 20)
    named = RequestInfo(req_id="r", requested="suffix", requested_k=1, current=None, num_prompt_tokens=40,
                        num_output_tokens=0)
    for with_slots, dominated in ((True, {"ngram"}), (False, {"suffix"})):
        sel = LBSSSelector(SelectionConfig(seed=0, alpha=2), ["ngram", "suffix"], 4, verify_points=profile_points(),
                           draft_s_per_token={"ngram": 1e-5, "suffix": 1e-5})
        cap = Capacity({"ngram": 16, "suffix": 16})
        p = 0
        for _ in range(640):
            arm = sel.select([dataclasses.replace(named, num_output_tokens=p)], cap)[0]
            assert arm == Arm("suffix", 1)
            ngram = copy_text_acceptance(p)
            sel.observe([SlotFeedback(
                req_id="r", arm=arm, num_drafted=1, num_accepted=1, num_committed=2, draft_s=0.0,
                verify_s=cpu_verify(1, 2), batch_size=1, batch_tokens=2,
                shadow=(("ngram", 8 if ngram else 0, ngram), ("suffix", 1, 1)),
                shadow_slot=((2, "suffix"), (2, "suffix")) if with_slots else ())])
            p += 2
        rates = dict(zip(["ngram", "suffix"], sel.verdict.rates))
        assert sel.dominated == dominated, (with_slots, rates)
        if with_slots:
            assert rates["ngram"] < 0.8 * rates["suffix"]


def test_settled_selection_stays_until_another_drafter_dominates_its_own(monkeypatch):
    """Settled on suffix decoding, it stays there while n-gram lookup's shadow drafts are worth about as much (a
    few per cent more: within DOMINANCE_MARGIN, the ledger's noise between two drafters that do alike), with no
    stretch of full selection in between; once suffix decoding's drafts fall clearly behind, it settles on n-gram."""
    sel, cap = settling_selector(monkeypatch)
    t = 0

    def run(slots: int, worth) -> list:
        nonlocal t
        settled = []
        for _ in range(slots):
            arm = sel.select([info("r", t)], cap)[0]
            sel.observe([shadow_feedback("r", arm, 1, worth(t))])
            settled.append(sel.settled_on)
            t += 1
        return settled

    run(300, lambda t: {"suffix": 4, "ngram": 4 if t % 4 == 0 else 0})
    assert sel.settled_on == "suffix"
    close = run(3000, lambda t: {"suffix": 0 if t % 60 == 0 else 4, "ngram": 4})  # n-gram ~2% ahead: within margin
    v = dict(zip(["ngram", "suffix"], sel.verdict.rates))
    assert v["suffix"] < v["ngram"] < v["suffix"] / (1 - lbss.DOMINANCE_MARGIN)
    assert close == ["suffix"] * len(close)  # never unsettled
    run(3000, lambda t: {"suffix": 4 if t % 4 == 0 else 0, "ngram": 4})
    assert sel.settled_on == "ngram"
