"""Learning-based SSM selection (LBSS, paper §V, Algorithms 1 and 2), made fit for serving.

The paper's algorithm, per epoch k = 1, 2, ...:
- exploration: alpha slots in chunks of beta; at each chunk's start every request draws an SSM uniformly at
  random (then a k: `ArmSet.draw`) and keeps it for the chunk; where more requests drew drafter j than its
  B_j, B_j of them are kept at random and the others decode plainly (Algorithm 2);
- exploitation: 2^k slots on a maximum-weight matching of requests to drafter replicas (`matching.py`) with
  weights g~_ij, the estimated goodput of request i on arm j.

What a serving system adds (the paper assumes one fixed set of requests):
- requests come and go: one arriving mid-stage joins it (a random arm for the rest of the exploration chunk,
  or a matching of the newcomers into the capacity left during exploitation); a finished one is removed;
- a new request starts from a prior built from the population's slots in its context (prompt length and
  repetition, `features.py`) and worth `prior_strength` observations, so its own observations take over
  as they accumulate (`estimates.py`: the request's acceptance on a drafter, learned at any k, predicts
  every k of it);
- exploitation lasts 2^min(k, max_epoch) slots: requests live tens to hundreds of slots, so epochs must
  keep coming round for the newer ones to be explored (max_epoch = 0 keeps the paper's unbounded 2^k, whose
  O(log T) regret holds for a fixed set of requests; with a cap, exploration recurs at a fixed rate);
- arms are (drafter, k) pairs plus plain decoding, so the draft length adapts too and speculation can be
  turned off for a request where it does not pay;
- with explore_margin > 0, a request stops drawing, in exploration, the arms it has itself shown to be
  clearly worse than its best (its own slots on that drafter, never the prior alone), so exploration costs
  less as it learns. explore_margin = 0, prior_strength = 0 and max_epoch = 0 give the paper's algorithm.

Reward r_ij(t) = num_committed / (draft_s + verify_s), tokens committed (bonus included) per second of the
slot. Switching cost: moving request i to a drafter other than its current one costs c_ij seconds of KV
catch-up, predicted as (tokens that drafter has not seen) x (seconds per caught-up token, learned per drafter
from the feedback's switch_s, so KV precomputed by the workers lowers it). In the matching, a switch is
charged the goodput it loses over the rest of the stage: lambda * g~_ij * c_ij / (remaining slots * slot
seconds); lambda = 1 prices it at cost, larger values damp switching further.

The k set: (2, 4, 8) by default. Goodput is flat near its best k (the expected accepted run saturates at
1/(1-p) while draft cost grows linearly in k), so a factor-2 grid loses little: in the simulator's three
workloads the oracle restricted to {2, 4, 8} is within 0.6% of the oracle over k in 1..8. 2 serves drafters
whose cost per token is a large share of a target step (the int8 self-draft on CPU), 4 is the usual
default, 8 serves near-free drafters on text that repeats (prompt lookup copies long runs) and strong
drafters on GPUs, where verifying more tokens costs little. Every k added is one more arm per drafter;
exploration draws the drafter first, so it is not explored less for it, but the matching has more to
tell apart.

Batch pricing (`batch_pricing`, on by default; the paper's weights where it is off or nothing is known of the
verify's cost). The slot's requests share one verify forward whose seconds grow with the tokens it carries
(`cost.py`), so a request's drafts slow everyone's slot, which per-request goodputs never charge it for. The
exploitation matching then maximises the batch's expected tokens per second instead (`marginal.py`): each
request's weight on an arm is its expected committed tokens less the batch's price (tokens per second) x the
seconds its drafts add, re-priced until the assignment settles. Plain decoding weighs exactly 1, so a request
speculates only where that pays the whole batch. Exploration skips, besides the arms a request itself showed to
lose, those the population showed to lose at that price (EVIDENCE_SLOTS), so a loaded server does not
keep paying to re-learn them. The g~ estimates stay what describe() reports and what precompute hints follow.
Where no draft token can pay at the batch's size (`nothing_pays`: a CPU's verify past a few requests), every request
decodes plainly; a slot of the same requests again then skips the selection (`_still_plain`: nothing would change
but the slot counters) until a forward makes drafting pay, and only every PLAIN_SAMPLE-th such slot's plain rewards
are counted (the cost model learns from every forward).

Each slot's drafts cut to what pays (with batch pricing, in both stages). The matching fixes a request's arm for a
stage, but whether its next draft tokens pay changes from slot to slot: prompt lookup copies a passage for a
few slots, then finds nothing worth copying. So every slot the request's draft is cut to the positions t whose
chance of surviving (the first t drafts all accepted: `Positions`, per draft position, from the request's
recent drafts, shrunk towards its context's) is at least what the token costs: the seconds it adds to the slot
(the batch size's verify cost per token, and the drafter's) at plain decoding's tokens per second for this
batch. Each token kept then adds more than plain decoding makes in its time, so the slot's expected goodput is
never below plain decoding's; a draft cut to nothing is a plain slot. At batch 1, where the profile timed the
request's drafts at every length, the verify's cost per token is shaped by position (`_prices_of_tokens`): a CPU
forward goes in row tiles, so the first draft token may ride along nearly free while later ones cost more than the
mean, and the cut keeps the prefix whose tokens add the most beyond their prices. The matching's weights are the arms'
values under the cut (`_under_cut`): an arm whose drafts would all be cut is worth exactly plain decoding, and
between equal gains the request stays on the drafter (TIE_BREAK), where it drafts as soon as its text pays.

Where a drafter rates its own tokens (`Draft.confidence`: n-gram lookup by its match's length, suffix decoding by
its counts), the cut reads this slot's draft instead of the request's history: the shadow drafts bring the
ratings back with their outcomes, `Calibration` turns a rating into the chance the token survives, and the
request's verify carries how its draft is cut (`cut_rule` -> `VerifyItem.cut_values`, `cut_prices`; `CutRule`): each
token is worth the chance its confidence says it survives, less its position's price, and the target's worker keeps
the draft's prefix of greatest worth. A first token dearer than the rest (a CPU forward's second row) is drafted where
the run behind it pays for it. A copy run is then drafted from its first slot and dropped at its first
doubtful token, which a decaying history can only follow a few slots late. Such a drafter's arms are valued at
that cut on the request's latest rated drafts (`_under_rule`).

Config: the `[selection]` section of config.toml (`spind.config.SelectionConfig`, defaults documented there).

Beyond the paper, free drafters teach without being explored: under greedy decoding the target's worker drafts,
with each verify, what every free drafter beside it (n-gram lookup, suffix decoding) would have proposed, the
request's own drafter included (its draft may have been cut short), and the coordinator checks those
counterfactual drafts against what is then committed (`spind.coordinator.selection.shadow`) and reports them in
`SlotFeedback.shadow`: acceptance evidence per position for that request and its context (never reward), on
every slot. A real draft whose drafter also drafted a shadow (`SlotFeedback.shadowed`) leaves its acceptance to
the shadow, which has all of its positions.

What the shadow drafts were worth (`ledger.py`). Every free drafter drafts its shadow drafts on the same slots, so
their worth can be compared on the same text: the population's latest DOMINANCE_WINDOW decided shadow drafts per
drafter are kept with their tokens' ratings, and at each price reading valued at this batch size's prices as its
slots would run them (cut by the drafter's rule of now, `_pricing_at`): the tokens each would add less what the
tokens it would draft cost (an empty proposal: 0), averaged. What survives does not depend on the batch size, so
drafts seen at any load value the drafters at the current one. Three decisions follow, once every drafter has
DOMINANCE_EVIDENCE drafts:
- a free drafter worth less than (1 - DOMINANCE_MARGIN) x the best one is dominated: neither exploited nor explored
  for requests selection decides, until the ledger says otherwise (its shadow drafts go on). A request's handful of
  rated drafts is too few to tell two copying drafters apart, so a matching over them took the weaker one about as
  often as the stronger: replaying selection on recorded greedy outputs at batch 1 (Zen 4 costs), n-gram lookup ran
  35-55% of the drafted slots beside suffix decoding, which it trails by 15-30% there;
- where even the best drafter's drafts are worth less to the batch than what selecting costs (the selector's calls
  and the shadow drafts, measured: `SlotFeedback.select_s`), selection is idle (`_idle`, past batch 1): plain
  decoding with no selection, as where nothing pays, and a shadow draft every IDLE_SHADOW turns to notice when that
  changes;
- where every free drafter but one is dominated and that one rates its own tokens (calibrated), selection is
  settled on it (`_settle`): its cut decides each slot on the draft itself, so the stages' matching and
  exploration, which could only choose among its k's and plain decoding, are skipped (each request runs it at the
  default k), and only every SETTLED_SHADOW-th shadow turn is granted, which keeps the ledger current.
Where a model drafter is selectable the ledger cannot value it, and neither decision is taken over it.

All of this decides by predictions. Whether they made serving faster is measured outside the selector: lockstep slots
at batch 2 and more run in pairs of windows, one as this selector chooses and one plain and unselected, and where its
windows make fewer tokens per second the slots there run plain (`regime.py`, `SlotPhases.regime_of`); `plain_seconds`
gives that trial its yardstick.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spind.config import SelectionConfig
from spind.coordinator.selection.arms import (PLAIN_INDEX, ArmSet, free_capacity, random_drop, split_bypass, take,
                                    with_requested_k)
from spind.coordinator.selection.cost import VerifyCost
from spind.coordinator.selection.estimates import (Calibration, Counts, PopulationStats, Positions, estimate,
                                                   estimate_tokens, request_rates, survival_of, worth_drafting)
from spind.coordinator.selection.features import context_name, context_of
from spind.coordinator.selection.ledger import UNKNOWN, Pricing, ShadowLedger, Verdict
from spind.coordinator.selection.marginal import choose
from spind.coordinator.selection.matching import max_weight_assignment
from spind.coordinator.selection.protocol import (AUTO, PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback,
                                                  fit_capacity)
from spind.coordinator.selection.shadow import SHADOW_K
from spind.draft_cut import CutRule

UNKNOWN_WEIGHT = -1e6  # matching weight of an arm nobody has run: exploit only what was observed
EVIDENCE_SLOTS = 16  # everyone's slots on a drafter before the estimates alone may rule its arms out
# A request's survival per draft position is its recent drafts' (real and shadow; copying comes in runs, and its
# drafts should stop within a few slots of the copying), each draft's weight decaying by RECENT_DECAY at the next
# one (~2.5 drafts in all), against POSITION_PRIOR pseudo-drafts of its context's curve
RECENT_DECAY = 0.6
RATED_DRAFTS = 6  # a request's latest rated drafts per drafter that value its arms under its cut (`_under_rule`)
SHADOW_BACKOFF_MAX = 8  # shadow drafts that keep finding nothing that pays: every 2nd, 4th, then 8th turn
QUIET_DRAFTS = 2  # ... and those that, cut to nothing by its rule, make its next slot plain in a batch (no draft
#                   drawn up to be cut to nothing: at batch 4 on alpaca that drafting cost spin ~10% of none). Not
#                   alone: at batch 1 its shadow drafts keep the drafter's state current, a draft costs a lookup, and
#                   a copy run is caught on its first slot (replayed: the rule cost batch-1 selection 1-2.5%)
POSITION_PRIOR = 1.0
TIE_BREAK = 1e-6  # tokens: between equal gains a drafter, not plain decoding: drafts cut to nothing cost nothing,
#                   and on the drafter the request drafts in the stage's later slots where its text starts to pay
PLAIN_SAMPLE = 8  # while no draft token can pay, plain rewards are learned on slots the slot count divides (`observe`)
DOMINANCE_WINDOW = 512  # shadow drafts per drafter the dominance ledger weighs (exponential decay)
DOMINANCE_EVIDENCE = 64  # ... that both drafters need before one may rule the other out
DOMINANCE_MARGIN = 0.05  # ... where it is worth less than (1 - this) x the best one's. Not explore_margin (0.15, a
#                         request's own handful of slots): the ledger weighs the population's latest drafts of both
#                         drafters on the same slots' text. At 0.15 n-gram lookup, trailing suffix decoding by 18% on
#                         gsm8k (`bench e2e`, batch 1, 2-core Xeon), stayed above the bar long enough to run 29% of
#                         one run's slots (3-8% in others), though `fixed:` runs find suffix decoding the better one on
#                         every workload of the shared datasets
IDLE_SHADOW = 8  # while selecting does not pay (`_idle`): every IDLE_SHADOW-th shadow turn is granted
IDLE_MIN_BATCH = 2  # the least batch selection idles at. At batch 1 idling saves a slot's selecting (~0.1 ms of a
#                    ~3.5 ms slot) but thins the shadow drafts to one in IDLE_SHADOW, so the ledger takes hundreds of
#                    slots to see the text turn: `bench e2e` (alpaca, batch 1, 2-core EPYC) ran 13-33 of 96 requests
#                    wholly plain where `fixed:suffix` took ~20% fewer steps on some of them; never idling there, side
#                    by side, `spin` read 0.952 / 0.960 of `fixed:suffix` against 0.943 / 0.939 (two runs), and
#                    gsm8k 0.973 against 0.964, mtbench 0.979 against 0.967 and 0.992 (runs of 48 requests x 2)
SETTLED_SHADOW = 16  # while settled on one drafter (`_settle`): every SETTLED_SHADOW-th shadow turn is granted
SETTLED_SAMPLE = 4  # ... and the matching's estimates (the population's, each request's counts and survival) learn
#                    from every SETTLED_SAMPLE-th slot only: nothing settled reads them (the cut, the calibration
#                    and the ledger decide, and learn from every slot), and they are what the matching starts from
#                    when selection unsettles, where a quarter of the evidence still fills their windows. Learning
#                    them was ~30% of a settled slot's selecting (batch 1, gsm8k), run cold after each forward
OVERHEAD_WINDOW = 33  # fully selected slots whose selecting seconds overhead_s is the median of (per batch size: a
#                      slow first matching, or a slot the OS preempted, must not idle selection for long)
FIT_HISTORY = 64  # verify forwards whose predicted and measured seconds describe() keeps
REPRICE_FORWARDS = 8  # verify forwards the cost model learns from before the prices are read again (`_price_plain`;
#                       at once where the batch size changes): they move little from one forward to the next (the
#                       cost model's window is 500 forwards), and reading them (the verify line, the drafters'
#                       seconds per token, the ledger) cost ~30 us a slot, run cold after each forward
REPRICE_SETTLED = 32  # ... while settled (`_settle`): a reading's ledger verdict, ~0.3 ms run cold at batch 1, was
#                      a third of a settled slot's selecting at every 8th; settled is hysteresis already (another
#                      drafter must dominate the settled one), which 32 forwards more delay by well under a request
EXPLORE, EXPLOIT = "explore", "exploit"
NUM_BUCKETS = 6  # batch-size buckets the overhead of selecting is kept per (`bucket_of`)


def bucket_of(batch_size: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, 17 and more -> 5."""
    return min(NUM_BUCKETS - 1, (max(1, batch_size) - 1).bit_length())


@dataclass
class _Request:
    context: int
    is_bypass: bool
    counts: Counts  # its own slots: acceptance per drafter, reward per arm
    positions: Positions  # its recent drafts' survival per drafter and position (real and shadow)
    kv_len: np.ndarray  # [D] context length when it last ran on each drafter (0: never)
    num_tokens: int = 0  # prompt + output tokens at the last select
    current: Arm | None = None  # the arm it was given last slot
    chunk_arm: int | None = None  # exploration: this chunk's arm
    next_arm: int | None = None  # exploration: the next chunk's pre-drawn arm
    catchup_tokens: int = 0  # tokens its drafter had to catch up this slot (a switch), for the cost rate
    slot_s: float = 0.0  # summed seconds of its slots
    num_slots: int = 0
    marginal: np.ndarray | None = None  # [A] its marginal gains (tokens) at the last matching that priced it
    expected: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    #         _expected() of this slot (the key says which): cleared at each observe
    rated: dict[int, deque[tuple[tuple[float, ...], int]]] = dataclasses.field(default_factory=dict)
    #      per drafter that rates its tokens, its latest decided shadow drafts: (confidences, accepted), newest last
    quiet_shadows: int = 0  # its latest shadow drafts in a row that every drafter's cut would have cut to nothing
    shadow_skips: int = 0  # its shadow turns passed over since its last shadow drafts (`wants_shadow`)


class LBSSSelector:
    """Implements the Selector protocol (`selector.py`); pure: no I/O, no clock, seeded randomness."""

    policy = "lbss"

    def __init__(self, cfg: SelectionConfig, drafters: Sequence[str], default_k: int, *,
                 verify_points: Sequence[tuple[int, int, float]] = (),
                 draft_s_per_token: dict[str, float] | None = None,
                 kv_drafters: Sequence[str] | None = None) -> None:
        """verify_points: measured (B, T, seconds) verify forwards (the start-up profile), the cost model's prior;
        draft_s_per_token: each drafter's measured seconds per draft token, until its own drafts are timed;
        kv_drafters: those whose KV a precompute hint can warm (model drafters; None: all): with none, no hints."""
        self.cfg = cfg
        self.has_hints = bool(set(drafters if kv_drafters is None else kv_drafters) & set(drafters))
        self.default_k = default_k
        self.arm_set = ArmSet(drafters, cfg.k_set)
        self.population = PopulationStats(self.arm_set, cfg.population_window)
        self.cost = VerifyCost()
        self.cost.add_prior(verify_points)
        known = draft_s_per_token or {}
        self._draft_prior = np.array([known.get(d, np.nan) for d in self.arm_set.drafters], dtype=float)  # [D]
        self._delta: np.ndarray | None = None  # _draft_s_per_token(), until the next _price_plain
        self._position_prices: dict[int, tuple[float, ...]] = {}  # _prices_of_tokens(j), until the next _price_plain
        self._rules_at: dict[int, tuple[list[float], CutRule]] = {}  # _cut_rule(j) and the curve it read
        self.price = 0.0  # G: the batch's expected tokens per second at the last priced matching
        self._fit: deque[tuple[float, float]] = deque(maxlen=FIT_HISTORY)  # (predicted, measured) verify seconds
        self.rng = np.random.default_rng(cfg.seed)
        self.epoch, self.stage, self.slot_in_stage, self.stage_slots = 1, EXPLORE, 0, cfg.alpha
        self._reqs: dict[str, _Request] = {}
        self._assigned: dict[str, int] = {}  # exploitation: req_id -> arm index for this stage
        self._hints: dict[str, str | None] = {}  # exploitation: cached precompute hints for this stage
        num_drafters = len(self.arm_set.drafters)
        self._switch_s = np.zeros(num_drafters)  # [D] observed catch-up seconds after switches
        self._switch_tokens = np.zeros(num_drafters)  # [D] tokens those catch-ups were predicted to cover
        self._slot_s_sum, self._slot_s_num = 0.0, 0  # population's mean slot seconds
        self.num_slots = self.num_switches = 0
        self.observed_s = self.switch_s_total = 0.0
        self._capacity: dict[str, int] = {}
        self._batch_size = 1  # requests in the last slot selected
        self._plain_price = 0.0  # that slot's tokens per second with every request plain: what cuts drafts
        self.cut_slots = {"shorter": 0, "plain": 0}  # request slots whose draft the cut shortened, or removed
        self.nothing_pays = False  # at the last slot's batch size no draft token could pay, even one sure to survive
        self._plain_ids: tuple[str, ...] | None = None  # the requests of the last slot selected all plain for that
        self._cost_seen = 0  # verify forwards the cost model has observed
        self._priced_at = -REPRICE_FORWARDS  # ... when the prices were last read (`_price_plain`)
        self._priced_batch = 0  # ... at this batch size
        self.settled_slots = 0  # slots selected by `_still_plain`
        self._shadowed: set[int] = set()  # drafters whose acceptance shadow drafts have taught
        self.calibration = Calibration(num_drafters)  # drafters' own confidence per token, against what survived
        self._cuts: dict[str, CutRule] = {}  # this slot's cut of the requests whose drafter rates its tokens
        # the free drafters' shadow drafts, valued at a batch size's prices as its slots would run them (`ledger.py`)
        self.ledger = ShadowLedger(self.arm_set.drafters, DOMINANCE_WINDOW, DOMINANCE_EVIDENCE, DOMINANCE_MARGIN,
                                   SHADOW_K)
        self.verdict: Verdict = UNKNOWN  # ... read at the last price reading's batch size
        self._verdicts: dict[int, tuple[int, Verdict]] = {}  # batch size -> (_cost_seen when read, its verdict)
        self.dominated: frozenset[str] = frozenset()  # free drafters another one dominates at the last slot's size
        # per batch-size bucket: the latest fully selected slots' seconds selecting (SlotFeedback.select_s)
        self._overhead: list[deque[float]] = [deque(maxlen=OVERHEAD_WINDOW) for _ in range(NUM_BUCKETS)]
        self._overhead_median = [0.0] * NUM_BUCKETS
        self.idle = False  # selecting would cost more than it is worth at the last slot's batch size (`_nothing_pays`)
        self._idle_shadows = 0  # wants_shadow calls while idle: every IDLE_SHADOW-th is granted
        self.settled_on: str | None = None  # the one drafter left to choose at the last slot's batch size (`_settle`)
        self.settled_on_slots = 0  # slots selected so
        self._settled_shadows = 0  # wants_shadow calls while settled: every SETTLED_SHADOW-th is granted

    def wants_shadow(self, req_id: str) -> bool:
        """Shadow drafts teach acceptance and calibration, and tell a request that decodes plainly when its drafter
        would pay again (`_cut`); none where no draft could pay anyway (the lookups are saved). At batch 1 every turn
        (every slot) where drafts may pay: there a drafter's shadow drafts follow its own slots (`ShadowDrafts`: paced),
        which a turn skipped breaks; the thinning below, applied there, left the ledger on the drafter that ran first
        (replayed, one draw of gsm8k at a CPU's cheap draft tokens: 0.94x `fixed:suffix` settled on n-gram lookup, 0.98x
        with every turn). Past batch 1, a request whose latest QUIET_DRAFTS or more shadow drafts its drafters' cuts
        would have cut to nothing is shadowed at every 2nd, then 4th, then SHADOW_BACKOFF_MAX-th of its turns, and at
        every turn again once one has: on a CPU at batch 4 and more, where nearly every slot decodes plainly, they took
        ~2% of the target worker's time, and the selection's overhead is what `auto` loses to plain decoding there."""
        if self.nothing_pays:
            if not self.idle:
                return False
            self._idle_shadows += 1  # idle: what the drafts would be worth must still be learned, at a small cost
            return self._idle_shadows % IDLE_SHADOW == 0
        if self._batch_size == 1:
            return True
        if self.settled_on is not None:  # the ledger and the calibration are everyone's: a few shadow drafts keep them
            self._settled_shadows += 1
            return self._settled_shadows % SETTLED_SHADOW == 0
        st = self._reqs.get(req_id)
        if st is None or st.quiet_shadows < QUIET_DRAFTS:
            return True
        interval = min(SHADOW_BACKOFF_MAX, 2 ** (st.quiet_shadows - QUIET_DRAFTS + 1))
        st.shadow_skips += 1
        if st.shadow_skips < interval:
            return False
        st.shadow_skips = 0
        return True

    def _nothing_pays(self) -> bool:
        """Whether, at this batch size, every drafter's draft token costs the batch at least a token (the seconds it
        adds, verify and drafting, at plain decoding's tokens per second), so none can pay even if it is sure to be
        accepted: a CPU's verify past a few requests. Selection then decodes plainly, without exploring, cutting
        or shadow drafts."""
        if self._plain_price <= 0:
            return False
        known = [x for x in self._draft_s_per_token().tolist() if x == x]
        cheapest = min(known) if known else 0.0
        return self._token_price(self.cost.seconds_per_token_at(self._batch_size) + cheapest) >= 1.0

    # -- the protocol --------------------------------------------------------------------------------------

    def select(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        self._advance_stage()
        if self._still_plain(reqs):
            self._capacity = {d: capacity.of(d) for d in self.arm_set.drafters}
            self._cuts.clear()
            self.slot_in_stage += 1
            self.num_slots += 1
            self.settled_slots += 1
            return [PLAIN_ARM] * len(reqs)
        self._batch_size = max(1, len(reqs))
        if self._stale_prices():
            self._price_plain()
        self._capacity = {d: capacity.of(d) for d in self.arm_set.drafters}
        if self.settled_on is not None and all(r.requested == AUTO and r.requested_k is None for r in reqs):
            return self._select_settled(reqs, capacity)
        bypass = split_bypass(reqs, self.default_k)
        free = free_capacity(capacity, self.arm_set.drafters, [a for a in bypass if a is not None])
        for d in self.dominated:  # neither exploited nor explored: another free drafter does better on the same text
            free[d] = 0
        auto = [r for r, b in zip(reqs, bypass) if b is None]
        for r, b in zip(reqs, bypass):
            self._track(r, is_bypass=b is not None)
        if self.nothing_pays:
            choice = dict.fromkeys((r.req_id for r in auto), PLAIN_INDEX)
        elif self.stage == EXPLORE:
            choice = self._explore(auto, free)
        else:
            fixed = [(self._reqs[r.req_id], b) for r, b in zip(reqs, bypass) if b is not None]
            choice = self._exploit(auto, free, fixed)
        arms = [b if b is not None else with_requested_k(self.arm_set.arms[choice[r.req_id]], r)
                for r, b in zip(reqs, bypass)]
        arms = fit_capacity(arms, capacity)
        for r, arm in zip(reqs, arms):
            self._record(self._reqs[r.req_id], arm)
        # each slot's drafts cut to what pays now; the stage's arm stays the request's. Exploration runs the arm it
        # drew, to learn it, but for drafters whose acceptance shadow drafts teach (there it learns nothing more)
        exploring = self.stage == EXPLORE
        self._cuts.clear()
        cut = []
        for r, b, arm in zip(reqs, bypass, arms):
            if b is None and r.requested_k is None:
                arm, rule = self._cut(self._reqs[r.req_id], arm, exploring)
                if rule is not None:
                    self._cuts[r.req_id] = rule
            cut.append(arm)
        for before, after in zip(arms, cut):
            if after != before:
                self.cut_slots["plain" if after.drafter is None else "shorter"] += 1
        arms = cut
        self.slot_in_stage += 1
        self.num_slots += 1
        self._plain_ids = tuple(r.req_id for r in reqs) if self.nothing_pays and all(
            r.requested == AUTO for r in reqs) else None
        return arms

    def _stale_prices(self) -> bool:
        """Whether the prices must be read again: the batch size changed, or REPRICE_FORWARDS forwards were learned
        (REPRICE_SETTLED while settled)."""
        return self._batch_size != self._priced_batch or self._cost_seen - self._priced_at >= self._reprice_every()

    def _reprice_every(self) -> int:
        return REPRICE_FORWARDS if self.settled_on is None else REPRICE_SETTLED

    def _price_plain(self) -> None:
        """Plain decoding's tokens per second at this batch size, whether any draft token could beat it, whether
        selecting is worth its own cost, and which free drafters are dominated at this batch size; each drafter's
        seconds per draft token and price of a draft token are solved again at their next reading. The ledger's
        verdict (~0.3 ms run cold: the reading's dearest part) is kept per batch size for as long as a reading is
        (`_reprice_every`): a closed loop's batch goes 4, 3, 4 as requests end and the next ones join, and each change
        read it afresh, every ~10th slot at batch 4."""
        self._delta = None
        self._position_prices.clear()
        self._rules_at.clear()
        self._plain_price = self._plain_price_at(self._batch_size)
        kept = self._verdicts.get(self._batch_size)
        if kept is not None and self._cost_seen - kept[0] < self._reprice_every():
            self.verdict = kept[1]
        else:
            pricing = self._pricing_at(self._batch_size)
            self.verdict = self.ledger.verdict(pricing, self.default_k) if pricing is not None else UNKNOWN
            self._verdicts[self._batch_size] = (self._cost_seen, self.verdict)
        self.idle = self._idle()
        self.nothing_pays = self.idle or self._nothing_pays()
        self.dominated = self.verdict.dominated
        self.settled_on = self._settle()
        self._priced_at, self._priced_batch = self._cost_seen, self._batch_size

    def _settle(self) -> str | None:
        """The drafter selection is settled on at this batch size, or None: where drafts may pay, every free drafter
        but one is dominated (the ledger; never while a model drafter is selectable: the ledger cannot value it), and
        that one rates its own tokens, calibrated. The matching then has one family of arms left, and its cut
        (`CutRule`) already decides each slot, on the draft itself, whether and how far it drafts (`_cut`): LBSS's
        stages, exploration and matching would only choose among that drafter's k's and plain decoding, at ~60 us a slot
        (with its feedback's ~45 us: ~2% of a batch-1 slot of the default model on a 2-core CPU, where suffix decoding
        at a fixed k beat `spin` by 3-6% through `bench e2e`). Settled, each request runs the drafter at the default k
        (what `fixed:` runs) and its cut; the shadow drafts go on, fewer (SETTLED_SHADOW), so the ledger sees
        another drafter catch up and the next price reading (every REPRICE_SETTLED forwards) unsettles it.

        Settled, it stays so while no other drafter dominates its drafter (hysteresis): where two drafters' drafts are
        worth about the same (within DOMINANCE_MARGIN), the ledger's noise would otherwise settle and unsettle it by
        turns, and each unsettled stretch pays the full selection for a choice worth a few per cent at most."""
        if self.nothing_pays or self.has_hints:
            return None
        left = [d for d in self.arm_set.drafters if d not in self.dominated]
        if len(left) == 1 and self.dominated:
            choice = left[0]
        elif self.settled_on in left and self.verdict.best is not None and self.verdict.best > 0.0:
            choice = self.settled_on
        else:
            return None
        j = self.arm_set.drafter_index[choice]
        return choice if self.calibration.known(j) and j in self._shadowed else None

    def _select_settled(self, reqs: Sequence[RequestInfo], capacity: Capacity) -> list[Arm]:
        """Every request on the settled drafter at the default k, cut by its rule (`_settle`)."""
        arms = fit_capacity([Arm(self.settled_on, self.default_k)] * len(reqs), capacity)
        self._cuts.clear()
        out = []
        for r, arm in zip(reqs, arms):
            self._track(r, is_bypass=False)
            st = self._reqs[r.req_id]
            self._record(st, arm)
            cut, rule = self._cut(st, arm)
            if rule is not None:
                self._cuts[r.req_id] = rule
            if cut != arm:
                self.cut_slots["plain" if cut.drafter is None else "shorter"] += 1
            out.append(cut)
        self._assigned.clear()  # the next matching, when the selection unsettles, starts afresh
        self.slot_in_stage += 1
        self.num_slots += 1
        self.settled_on_slots += 1
        self._plain_ids = None
        return out

    def _idle(self) -> bool:
        """Whether selecting costs the slot more than speculation is worth at this batch size: what the best drafter's
        shadow drafts would be worth a request at this size's prices (the ledger: known only when every drafter is a
        free one with evidence; a model drafter cannot be valued so, and keeps selection on), for each of the batch's
        requests, against the seconds a fully selected slot spends selecting (`overhead_s`: the selector's calls and
        the shadow drafts; unknown until a slot of this size was) at plain decoding's tokens per second. Then every
        request decodes plainly with no selection, as where nothing pays, but one shadow draft every IDLE_SHADOW turns
        keeps the ledger current: where the text starts to repeat, selection comes back. On a 2-core CPU at batch 4
        that cost was ~0.3 ms of a ~7 ms slot (4%), and on chat and math text the drafts that paid at that batch size
        won back less (replayed selection). Not on the population's mean alone: where one request's drafts pay and
        the others' do not, selection drafts for that one (`_cut`), worth the selecting however low the mean. Never
        at batch 1 (IDLE_MIN_BATCH)."""
        overhead_s = self.overhead_s(self._batch_size)
        best = self.verdict.best
        if self._batch_size < IDLE_MIN_BATCH or self._plain_price <= 0 or overhead_s <= 0 or best is None:
            return False
        return self._batch_size * max(best, 0.0) < self._plain_price * overhead_s

    def plain_seconds(self, batch_size: int) -> float | None:
        """A plain forward's seconds at this batch size, as the cost model predicts it (None: nothing known yet)."""
        return self.verify_seconds(batch_size, batch_size)

    def verify_seconds(self, batch_size: int, tokens: int) -> float | None:
        """A verify forward's seconds for this many requests and tokens, as the cost model predicts it (None: nothing
        known yet): what a verify that shared its forward with prefill chunks would have cost alone."""
        return self.cost.predict_cheaply(batch_size, tokens)

    def overhead_s(self, batch_size: int) -> float:
        """What a fully selected slot of this batch size spends selecting: the median of its latest (seconds; 0 until
        measured)."""
        return self._overhead_median[bucket_of(batch_size)]

    def _still_plain(self, reqs: Sequence[RequestInfo]) -> bool:
        """Whether this slot is the last one again while no draft token can pay: the same requests, every one left to
        selection (so all of them decode plainly, whatever the stage), and the prices (read again every
        REPRICE_FORWARDS forwards) still say no draft can pay. The full selection would then return every request plain
        and change nothing but the slot counters (a request's arm, switch count and KV bookkeeping stay as they are):
        at batch 4 and more on a CPU, where this is nearly every slot, it cost the coordinator ~0.1 ms a slot, run cold
        after each forward."""
        if self._plain_ids is None or len(reqs) != len(self._plain_ids) or any(
                r.req_id != i or r.requested != AUTO for r, i in zip(reqs, self._plain_ids)):
            return False
        if self._stale_prices():
            self._price_plain()
        return self.nothing_pays

    def observe(self, feedback: Sequence[SlotFeedback]) -> None:
        self._observe_cost(feedback)
        # a plain slot while no draft token can pay teaches only plain decoding's reward, which nothing weighs while
        # everyone decodes plainly (batch pricing values plain decoding at one token): every PLAIN_SAMPLE-th such
        # slot is still learned from, so describe()'s estimates stay alive; the others count their seconds only
        learn = not (self.nothing_pays and self.num_slots % PLAIN_SAMPLE
                     and all(fb.arm == PLAIN_ARM and not fb.shadow and not fb.switch_s for fb in feedback))
        if learn:
            for st in self._reqs.values():
                st.expected.clear()
        estimates = learn and (self.settled_on is None or self.num_slots % SETTLED_SAMPLE == 0)
        slot_s = 0.0
        selecting_s = sum(fb.select_s for fb in feedback)
        if selecting_s > 0 and not self.nothing_pays and self.settled_on is None:  # what a fully selected slot
            # spends selecting (`_idle`): a settled one's is less, so the median stays an upper bound
            b = bucket_of(feedback[0].batch_size)
            self._overhead[b].append(selecting_s)
            self._overhead_median[b] = statistics.median(self._overhead[b])
        for fb in feedback:
            st = self._reqs.get(fb.req_id)
            seconds = fb.draft_s + fb.verify_s
            slot_s = max(slot_s, seconds + fb.switch_s)
            self.switch_s_total += fb.switch_s
            if st is None or seconds <= 0:
                continue
            j = self.arm_set.drafter_index.get(fb.arm.drafter)
            if estimates:
                reward = fb.num_committed / seconds
                a = self.arm_set.index.get(fb.arm)
                self.population.add(st.context, j, a, fb, reward)
                if not st.is_bypass:
                    st.counts.add((), j, a, fb, reward)
                    if j is not None and not fb.shadowed:
                        st.positions.add(j, fb.num_drafted, fb.num_accepted)
            st.slot_s += seconds
            st.num_slots += 1
            self._slot_s_sum += seconds
            self._slot_s_num += 1
            if st.catchup_tokens and j is not None:
                self._switch_s[j] += fb.switch_s
                self._switch_tokens[j] += st.catchup_tokens
            st.catchup_tokens = 0
            if learn:
                self._observe_shadow(st, fb, estimates)
        self.observed_s += slot_s

    def _observe_cost(self, feedback: Sequence[SlotFeedback]) -> None:
        """The verify forward the feedback's requests shared: its shape and seconds refine the cost model (only
        when it was one forward whose tokens are known: batch_tokens > 0). Settled, every SETTLED_SAMPLE-th forward
        only (each is counted): nothing settled reads the model between two price readings (every REPRICE_SETTLED
        forwards), and a settled batch's forwards repeat a few shapes, so a quarter of them still fill its curves;
        the update and the fit were ~30 us of a batch-1 slot's ~110 us of learning (gsm8k, 2-core EPYC)."""
        if not feedback or feedback[0].batch_tokens <= 0:
            return
        if self.settled_on is not None and self._cost_seen % SETTLED_SAMPLE:
            self._cost_seen += 1
            return
        fb = feedback[0]
        predicted = self.cost.predict_cheaply(fb.batch_size, fb.batch_tokens)
        if predicted is not None:
            self._fit.append((predicted, fb.verify_s))
        self.cost.observe(fb.batch_size, fb.batch_tokens, fb.verify_s)
        self._cost_seen += 1

    def _observe_shadow(self, st: _Request, fb: SlotFeedback, estimates: bool = True) -> None:
        """Counterfactual drafts of free drafters teach acceptance (never rewards: no slot ran on them; the matching's
        estimates only where `estimates`: SETTLED_SAMPLE), the calibration, and what each would have been worth
        (`_ledger`)."""
        self._ledger(fb)
        for name, drafted, accepted in fb.shadow:
            j = self.arm_set.drafter_index.get(name)
            if j is None:
                continue
            self._shadowed.add(j)
            if not estimates:
                continue
            self.population.add_acceptance(st.context, j, drafted, accepted)
            if not st.is_bypass:
                st.counts.add_acceptance((), j, drafted, accepted)
                st.positions.add(j, drafted, accepted)
        quiet = bool(fb.shadow_confidence) and fb.batch_size > 1  # only the back-off past batch 1 reads it
        for name, confidence, accepted in fb.shadow_confidence:
            j = self.arm_set.drafter_index.get(name)
            if j is not None:
                self.calibration.add(j, confidence, accepted)
                if not st.is_bypass:
                    st.rated.setdefault(j, deque(maxlen=RATED_DRAFTS)).append((confidence, accepted))
                quiet = quiet and self._quiet(j, confidence)
        if fb.shadow_confidence:
            st.quiet_shadows = st.quiet_shadows + 1 if quiet else 0

    def _ledger(self, fb: SlotFeedback) -> None:
        """Each decided shadow draft into the ledger, with its tokens' ratings (valued at a price reading:
        `_pricing_at`), weighed by the drafter's own slots it stands for: the ledger values a drafter per slot *it*
        would run, but its shadow drafts come at the slots of whatever the request ran. A draft drafted at a slot
        that ran the same drafter, or paced (`ShadowDrafts`: where its drafter's own slot would start), is one of its
        own slots (weight 1). Elsewhere, a draft accepted to the default k is a copy run, which goes on past it: the
        drafter's own slot would take 1 + k tokens of it where the slot the draft was drafted at committed `advance`,
        so it stands for advance / (1 + k) own slots; any other draft stands for one (its own slots there advance
        about as the slots run do). Counted one a draft, a copy run
        shows at each of the slots another drafter spends on it: replayed on the outputs of `fixed:suffix` runs
        (alpaca, mtbench, gsm8k, humaneval; default model, k = 4), n-gram lookup's shadow drafts at suffix
        decoding's slots rated it 38% (alpaca), 24%, 29% and 26% above what its own slots accept, ahead of suffix
        decoding's worth everywhere, where its own slots accept 5-14% less for 1.3-1.8x the draft tokens; weighed
        so, +14%, +6%, +8% and +8%, below suffix decoding's worth everywhere once draft tokens are priced. Suffix
        decoding's drafts at n-gram lookup's slots read its own slots 18% to 2% low weighed so (-33% to -12% with
        every draft weighed as a copy run, advance / (1 + accepted): suffix decoding's acceptance does not come in
        runs). Weighed so, the drafter that ran was still read 1-15% ahead of the other against its reading while the
        other ran (shadow drafts at every 2nd slot of batch 1); paced, by less (`ShadowDrafts` gives the figures)."""
        rated: dict[str, list[tuple[float, ...]]] = {}  # in fb.shadow's order, per drafter
        for name, confidence, _ in fb.shadow_confidence:
            rated.setdefault(name, []).append(confidence)
        slots = fb.shadow_slot or ((0, ""),) * len(fb.shadow)  # not known: one own slot each
        k = self.default_k
        for (name, drafted, accepted), (advance, ran) in zip(fb.shadow, slots):
            j = self.arm_set.drafter_index.get(name)
            if j is None:
                continue
            weight = advance / (1.0 + k) if advance and ran != name and accepted >= k else 1.0
            self.ledger.add(j, drafted, accepted, rated[name].pop(0) if rated.get(name) else None, weight)

    def _plain_price_at(self, batch_size: int) -> float:
        """Plain decoding's tokens per second at this batch size (the cost model's); 0 where not priced."""
        plain_s = self.cost.predict(batch_size, batch_size) if self.prices_batch else None
        return batch_size / plain_s if plain_s else 0.0

    def _pricing_at(self, batch_size: int) -> Pricing | None:
        """How the ledger values a drafter's shadow drafts at this batch size (`ledger.Pricing`): the cut its slots
        would run them by (where the drafter is calibrated: `CutRule`, at the prices with the margin) and what each
        position's token costs the batch in tokens (without it: the cut keeps the tokens worth the margin, which cost
        what they cost), as the slots of this size cut and price them (`_prices_of_tokens`); None where nothing is
        priced. The ledger reads no further than the default k (`verdict`'s limit): what a settled drafter runs
        (`_select_settled`), and the draft lengths the profile priced (past them the last position's price holds, below
        what a CPU's longer forwards cost)."""
        plain_price = self._plain_price_at(batch_size)
        if plain_price <= 0:
            return None
        margin = 1.0 + self.cfg.price_margin

        def pricing(j: int) -> tuple[CutRule | None, tuple[float, ...]]:
            costs = tuple(plain_price * s for s in self._token_seconds(j, batch_size))
            if not self.calibration.known(j):
                return None, costs
            return CutRule(tuple(self.calibration.curve(j)), tuple(margin * c for c in costs)), costs
        return pricing

    def _quiet(self, j: int, confidence: Sequence[float]) -> bool:
        """Drafter j's draft with these confidences had no token that pays at the last slot's price (it would have
        been cut to nothing); False where j is not calibrated yet or no price is known."""
        if self._plain_price <= 0 or not self.calibration.known(j):
            return False
        return self._cut_rule(j).kept(confidence) == 0

    def remove(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._assigned.pop(req_id, None)
        self._hints.pop(req_id, None)

    def precompute_hint(self, req_id: str) -> str | None:
        st = self._reqs.get(req_id)
        if st is None or st.is_bypass or self.nothing_pays or not self.has_hints:  # no draft pays at this load, or
            return None  # no drafter has KV: none worth precomputing
        current = st.current.drafter if st.current is not None else None
        if self.stage == EXPLORE and st.next_arm is not None:
            drafter = self.arm_set.arms[st.next_arm].drafter
            return drafter if drafter != current else None
        if req_id not in self._hints:  # set by the matching; else the last exploration chunk's
            self._hints[req_id] = self._best_other_drafter(self.estimate(st), current)
        return self._hints[req_id]

    def describe(self) -> dict:
        """JSON-able state for /v1/spind/state (every float rounded; null = unknown): policy; epoch (k); stage
        ("explore" | "exploit"); slot_in_stage (slots of the stage selected so far) of stage_slots; chunk_slots (beta);
        arms (names, plain decoding "none" first); capacity {drafter: B_j at the last slot}; assignment {arm: requests
        on it at the last slot}; requests {req_id: {arm, bypass, context, estimate {arm: g~ tokens/s}, tokens {arm:
        expected tokens committed per slot}, observations {arm: own slots}}} for every request not yet removed, so
        bounded by the running ones; population {arm: everyone's mean reward}; switch_s_per_token {drafter: learned KV
        catch-up seconds per token}; num_slots; num_switches (drafter changes); observed_s (summed slot seconds, from
        the feedback); switches_per_minute; switch_s (summed KV catch-up seconds fed back); batch_pricing (arms chosen
        for the batch's goodput, `marginal.py`); price (its tokens per second at the last priced matching); plain_price
        (the last slot's tokens per second with every request plain: what a draft token must beat); cut_slots {shorter,
        plain} (request slots whose draft the cut shortened, or removed: `_cut`); nothing_pays (at the last slot's batch
        size no draft token could pay: everyone decoded plainly); settled_slots (slots selected all plain without the
        full selection while nothing paid: `_still_plain`); settled_on (the one drafter left at the last slot's batch
        size, run without the matching: `_settle`; null where none) and settled_on_slots (slots so selected);
        verify_cost (the fitted verify seconds per forward, per request and per token, `cost.py`); verify_fit
        ([predicted, measured] ms of the last verify forwards); token_prices {drafter: what its token at each draft
        position costs the batch at the last slot's size, in tokens: `_cut`}; calibration {drafter: [chance a token
        survives, by confidence bin], null until calibrated}; cuts {req_id: the prices (per position) its draft
        was cut at in the last slot}; ledger {batch size: {drafter: what its shadow drafts would be worth a request
        there, tokens a slot}} (`_describe_ledger`); dominated (free drafters left out at the last slot's batch size);
        idle (selecting did not pay for itself there: `_idle`); overhead_ms (what a fully selected slot of the last
        slot's batch size spends selecting); config (the SelectionConfig). A request priced in a matching also has
        marginal {arm: its marginal gain in tokens per slot}."""
        names = self.arm_set.names
        counts, requests = self._describe_requests()
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = self._switch_s / self._switch_tokens
        return {
            "policy": self.policy, "epoch": self.epoch, "stage": self.stage,
            "slot_in_stage": self.slot_in_stage, "stage_slots": self.stage_slots,
            "chunk_slots": self.cfg.beta, "arms": names, "capacity": self._capacity,
            "assignment": counts, "requests": requests,
            "population": _rounded(names, self.population.mean_reward()),
            "switch_s_per_token": _rounded(self.arm_set.drafters, rate, digits=6),
            "num_slots": self.num_slots, "num_switches": self.num_switches,
            "observed_s": round(self.observed_s, 3), "switch_s": round(self.switch_s_total, 3),
            "switches_per_minute": round(60 * self.num_switches / self.observed_s, 2) if self.observed_s else None,
            "batch_pricing": self.prices_batch, "price": round(float(self.price), 3),
            "plain_price": round(float(self._plain_price), 3), "cut_slots": dict(self.cut_slots),
            "nothing_pays": self.nothing_pays, "settled_slots": self.settled_slots,
            "settled_on": self.settled_on, "settled_on_slots": self.settled_on_slots,
            "verify_cost": self.cost.describe(),
            "verify_fit": [[round(p * 1e3, 3), round(m * 1e3, 3)] for p, m in self._fit],
            "token_prices": {d: [round(x, 4) for x in self._prices_of_tokens(j)] if self._plain_price > 0 else None
                             for j, d in enumerate(self.arm_set.drafters)},
            "calibration": {d: self.calibration.describe(j) for j, d in enumerate(self.arm_set.drafters)},
            "cuts": {r: [round(x, 4) for x in c.prices] for r, c in self._cuts.items()},
            "ledger": self._describe_ledger(), "dominated": sorted(self.dominated), "idle": self.idle,
            "overhead_ms": round(self.overhead_s(self._batch_size) * 1e3, 4),
            "config": dataclasses.asdict(self.cfg),
        }

    def _describe_ledger(self) -> dict[str, dict[str, float | None]]:
        """describe()'s ledger: {batch size: {drafter: what its shadow drafts would be worth a request there, tokens
        a slot; null below the evidence}} at 1, 2, 4, 8, 16 and the last slot's size, once any drafter has a draft."""
        if not any(self.ledger.seen(j) for j in range(len(self.arm_set.drafters))):
            return {}
        out = {}
        for b in sorted({1, 2, 4, 8, 16, self._batch_size}):
            pricing = self._pricing_at(b)
            if pricing is not None:
                rates = self.ledger.verdict(pricing, self.default_k).rates
                out[str(b)] = {d: None if x is None else round(x, 4) for d, x in zip(self.arm_set.drafters, rates)}
        return out

    def _describe_requests(self) -> tuple[dict[str, int], dict[str, dict]]:
        """describe()'s assignment and requests."""
        names = self.arm_set.names
        counts: dict[str, int] = {}
        requests = {}
        for req_id, st in self._reqs.items():
            arm = st.current.name if st.current is not None else None
            if arm is not None:
                counts[arm] = counts.get(arm, 0) + 1
            requests[req_id] = {"arm": arm, "bypass": st.is_bypass, "context": context_name(st.context),
                                "estimate": _rounded(names, self.estimate(st)),
                                "tokens": _rounded(names, self._expected(st)[0]),
                                "observations": {n: int(c) for n, c in zip(names, st.counts.slots) if c}}
            if st.marginal is not None:
                requests[req_id]["marginal"] = _rounded(names, np.where(st.marginal <= UNKNOWN_WEIGHT / 2, np.nan,
                                                                        st.marginal))
        return counts, requests

    # -- estimates -----------------------------------------------------------------------------------------

    def estimate(self, st: _Request) -> np.ndarray:
        """[A] g~ of the request per arm; nan = unknown."""
        return estimate(st.counts, st.context, self.population, self.cfg.prior_strength)

    def _weights(self, st: _Request, g: np.ndarray, remaining_slots: int) -> np.ndarray:
        """[A] matching weights from g~ ([A]): less lambda x the goodput a switch's KV catch-up loses over the
        rest of the stage."""
        w = np.where(np.isnan(g), UNKNOWN_WEIGHT, g)
        if np.isnan(g[PLAIN_INDEX]):
            w[PLAIN_INDEX] = 0.0  # nothing known: plain decoding, never slower than not speculating
        return w - self.cfg.switch_weight * self._switch_penalty(st, g, remaining_slots)

    def _switch_penalty(self, st: _Request, value: np.ndarray, remaining_slots: int) -> np.ndarray:
        """[A] what switching to each arm's drafter loses, in `value`'s units per slot: value x the share of the
        rest of the stage its KV catch-up (c_ij seconds) takes."""
        slot_s = st.slot_s / st.num_slots if st.num_slots else (
            self._slot_s_sum / self._slot_s_num if self._slot_s_num else 0.0)
        if self.cfg.switch_weight == 0 or slot_s == 0:
            return np.zeros(len(self.arm_set))
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(self._switch_tokens > 0, self._switch_s / self._switch_tokens, 0.0)  # [D]
        d = self.arm_set.drafter_of
        current = self.arm_set.drafter_index.get(st.current.drafter if st.current else None, -1)
        is_switch = (d >= 0) & (d != current)
        switch_s = np.zeros(len(self.arm_set))  # [A] c_ij
        switch_s[is_switch] = rate[d[is_switch]] * (st.num_tokens - st.kv_len[d[is_switch]])
        return np.where(is_switch & ~np.isnan(value), value, 0.0) * switch_s / (max(remaining_slots, 1) * slot_s)

    # -- pricing the batch's verify (marginal.py) ----------------------------------------------------------

    @property
    def prices_batch(self) -> bool:
        """Arms are chosen for the batch's goodput: configured, and the verify's cost is known (the profile, or
        verifies seen); else each request's own goodput (the paper's weights)."""
        return self.cfg.batch_pricing and self.cost.is_known

    def _expected(self, st: _Request, cut: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[A] tokens the request is expected to commit per slot, [A] tokens it drafts, and [A] the seconds its
        drafter takes for them (measured per drafted token; the profile's until the drafter was timed)."""
        key = (self.num_slots, self._plain_price, cut)
        if key in st.expected:  # nothing observed since, the same batch's price
            return st.expected[key]
        committed, drafted = estimate_tokens(st.counts, st.context, self.population, self.cfg.prior_strength)
        if cut and self._plain_price > 0:
            self._under_cut(st, committed, drafted)
        delta = self._draft_s_per_token()
        d = self.arm_set.drafter_of
        per_token = np.where(d >= 0, delta[np.maximum(d, 0)], 0.0)
        with np.errstate(invalid="ignore"):
            draft_s = np.where(drafted == 0, 0.0, drafted * per_token)
        st.expected[key] = (committed, drafted, draft_s)
        return committed, drafted, draft_s

    def _under_cut(self, st: _Request, committed: np.ndarray, drafted: np.ndarray) -> None:
        """committed, drafted ([A], in place): each arm's expected tokens as the slots will run it, its drafts cut
        at the batch's price (`_cut`) and read from the request's survival per position, where that is known:
        E[committed] = 1 + h * sum over kept positions t of P(the first t survive), h its proposal rate. An arm
        whose drafts are all cut is worth plain decoding's one token, never less. A drafter whose confidence is
        calibrated is valued under its cut, on the request's latest rated drafts (`_under_rule`)."""
        _, h = request_rates(st.counts, st.context, self.population, self.cfg.prior_strength)
        for j in range(len(self.arm_set.drafters)):
            if self.calibration.known(j) and st.rated.get(j):
                self._under_rule(st, j, committed, drafted)
                continue
            if np.isnan(h[j]):
                continue
            survival, tau = self._survival_and_price(st, j)
            if survival[0] != survival[0]:  # nothing known of its drafts' survival: the estimate as it is
                continue
            alive, total = 1.0, [0.0]  # total[t]: expected tokens of the first t positions (t <= K = max k)
            for q in survival:
                alive *= 0.0 if q != q else q
                total.append(total[-1] + alive)
            for a in np.flatnonzero(self.arm_set.drafter_of == j):
                kept = worth_drafting(survival, tau, self.arm_set.arms[a].k)
                committed[a] = 1.0 + h[j] * total[kept]
                drafted[a] = h[j] * kept

    def _under_rule(self, st: _Request, j: int, committed: np.ndarray, drafted: np.ndarray) -> None:
        """committed, drafted ([A], in place) for drafter j's arms as its worker will cut them by this slot's rule
        (`_cut_rule`), from the request's latest drafts on j (its shadow drafts: rated and decided), the newest
        weighing most (RECENT_DECAY), each cut by the rule and at k: the tokens they keep, and as committed the mean
        of what those tokens were worth by their confidence (the calibration) and what of them was accepted (the
        request's own text: between two drafters that both rate their tokens well, the one that was right lately).
        Every kept prefix pays its prices in expectation, so where that reads below plain decoding (a run of misses)
        the arm is valued as plain decoding: the matching keeps the request on the drafter (TIE_BREAK), and the
        cut decides slot by slot."""
        curve, bins = self.calibration.curve(j), self.calibration.bins
        rule = self._cut_rule(j)
        prices = rule.prices
        last = len(prices) - 1
        recent = st.rated[j]
        for a in np.flatnonzero(self.arm_set.drafter_of == j):
            k = self.arm_set.arms[a].k
            weight = kept = rated = accepted = cost = 0.0
            w = 1.0
            for confidence, acc in reversed(recent):
                n = rule.kept(confidence, k)
                for t in range(n):
                    rated += w * curve[min(bins - 1, int(confidence[t] * bins))]
                    cost += w * prices[min(t, last)]
                weight += w
                kept += w * n
                accepted += w * min(acc, n)
                w *= RECENT_DECAY
            tokens = (rated + accepted) / (2.0 * weight)
            if tokens < cost / weight:
                committed[a], drafted[a] = 1.0, 0.0
            else:
                committed[a], drafted[a] = 1.0 + tokens, kept / weight

    def _draft_s_per_token(self) -> np.ndarray:
        """[D] each drafter's seconds per draft token: measured, else the profile's; nan where neither is known.
        Read many times a slot; solved at the first reading after each `_price_plain`."""
        if self._delta is None:
            delta = self.population.draft_s_per_token()
            self._delta = np.where(np.isnan(delta), self._draft_prior, delta)
        return self._delta

    def _cut(self, st: _Request, arm: Arm, exploring: bool = False) -> tuple[Arm, CutRule | None]:
        """The arm with its draft cut to the tokens worth verifying this slot, and the rule its drafter's worker cuts
        the draft by (None: none). Draft token t adds the chance that the request's first t drafts survive and costs
        the seconds it adds to the slot (`_survival_and_price`). Where the drafter rates its own tokens and that rating
        is calibrated (`Calibration`), the chance is read from each token's confidence, on the draft itself: the arm
        keeps its k and the worker keeps the draft's prefix of greatest worth (`CutRule`; where even a draft rated
        surest throughout would not pay: a plain slot); in a batch of more than one, where the request's latest
        QUIET_DRAFTS shadow drafts on it would have been cut to nothing, the slot is plain without drafting. Else it is
        read from the request's recent drafts on that drafter, real and shadow, shrunk towards its context's
        (`survival_of`), which cuts k. A request whose drafter's next token does not pay decodes plainly this slot: the
        matching picked its arm for the stage, the cut follows the text (copying comes in runs). Not where nothing is
        known of the drafter's survival yet, nor an exploring arm of a drafter without shadow drafts: exploration is how
        those are learned."""
        j = self.arm_set.drafter_index.get(arm.drafter)
        if j is None or self._plain_price <= 0 or exploring and j not in self._shadowed:
            return arm, None
        if self.calibration.known(j):
            rule = self._cut_rule(j)
            if not rule.pays(arm.k):
                return PLAIN_ARM, None  # no token pays: no draft to make
            lately = [c for c, _ in list(st.rated.get(j, ()))[-QUIET_DRAFTS:]] if self._batch_size > 1 else ()
            if len(lately) == QUIET_DRAFTS and all(rule.kept(c, arm.k) == 0 for c in lately):
                return PLAIN_ARM, None  # none of its latest drafts had a prefix that pays: no draft to make
            return arm, rule
        survival, prices = self._survival_and_price(st, j)
        if survival[0] != survival[0]:
            return arm, None
        k = worth_drafting(survival, prices, arm.k)
        return (arm if k == arm.k else PLAIN_ARM if k == 0 else Arm(arm.drafter, k)), None

    def _cut_rule(self, j: int) -> CutRule:
        """How calibrated drafter j's drafts are cut at this slot's prices (`CutRule`: its calibration curve, the
        prices of its draft positions). Read every slot: kept until the next `_price_plain` or the next solve of j's
        calibration curve (`Calibration.curve` returns the same list until then)."""
        curve = self.calibration.curve(j)
        kept = self._rules_at.get(j)
        if kept is not None and kept[0] is curve:
            return kept[1]
        rule = CutRule(tuple(curve), self._prices_of_tokens(j))
        self._rules_at[j] = (curve, rule)
        return rule

    def cut_rule(self, req_id: str) -> CutRule | None:
        """How its drafter's draft is cut this slot (`_cut`); None: not cut."""
        return self._cuts.get(req_id)

    def _survival_and_price(self, st: _Request, j: int) -> tuple[list[float], tuple[float, ...]]:
        """The request's survival per draft position on drafter j, and what each draft position costs the batch in
        tokens (`_prices_of_tokens`): the seconds it adds (verify at this batch size, and drafting) at plain decoding's
        rate for this batch. Each token kept then adds more tokens than plain decoding would make in the time it takes,
        so the slot's expected goodput is never below plain decoding's (the matching's price, the optimum's goodput, is
        higher; it was set at the stage's start, for the batch of then)."""
        survival = survival_of(st.positions, st.counts, st.context, self.population, self.cfg.prior_strength, j,
                               POSITION_PRIOR)
        return survival, self._prices_of_tokens(j)

    def _prices_of_tokens(self, j: int) -> tuple[float, ...]:
        """What drafter j's token at each draft position costs the batch, in tokens: the seconds it adds
        (`_token_seconds`: the verify's shaped by position where the profile timed a request's drafts at every length,
        as a CPU forward goes in row tiles: the default model's second row rode along with the first at batch 1 while
        its fifth cost 1.6 ms) at plain decoding's rate for this batch, with the margin (`_token_price`). Read several
        times a slot: kept until the next `_price_plain`."""
        prices = self._position_prices.get(j)
        if prices is None:
            prices = tuple(self._token_price(s) for s in self._token_seconds(j, self._batch_size))
            self._position_prices[j] = prices
        return prices

    def _token_seconds(self, j: int, batch_size: int) -> tuple[float, ...]:
        """The seconds drafter j's token at each draft position adds to a slot of this batch size: verify (shaped by
        position where the profile timed a request's drafts at every length, `VerifyCost.token_shape_at`; one for
        every position where it did not) and drafting."""
        delta = float(self._draft_s_per_token()[j])
        delta = 0.0 if delta != delta else delta
        per_token = self.cost.seconds_per_token_at(batch_size)
        shape = self.cost.token_shape_at(batch_size)
        return (per_token + delta,) if shape is None else tuple(per_token * x + delta for x in shape)

    def _token_price(self, seconds: float) -> float:
        """What a draft token that adds these seconds to the slot must be worth, in tokens: what plain decoding makes
        in them at this batch's rate, plus `price_margin` of it (break-even is a loss once the errors of the cost
        model and the calibration, and the per-token costs neither counts, are in)."""
        return (1.0 + self.cfg.price_margin) * self._plain_price * seconds

    def _marginal(self, st: _Request, price: float, cut: bool = True) -> np.ndarray:
        """[A] the request's marginal gain per arm at a price (tokens per second of slot): expected tokens less
        price x the seconds its drafts add to the slot (verify and draft, at the last slot's batch size); plain
        decoding's is 1. cut: each arm as the slots run it, its drafts cut to what pays (`_under_cut`); else as
        drawn, all k of it."""
        committed, drafted, draft_s = self._expected(st, cut)
        return committed - price * (drafted * self.cost.seconds_per_token_at(self._batch_size) + draft_s)

    def _base(self, others: Sequence[tuple[_Request, Arm]], num_new: int) -> tuple[float, float]:
        """The slot's predicted seconds with `num_new` requests plain and `others` on their arms, and the tokens
        the others are expected to commit."""
        tokens, draft_s, committed = float(num_new + len(others)), 0.0, 0.0
        for st, arm in others:
            a = self.arm_set.index.get(arm)
            if a is None:  # outside the arm set (a named drafter, its own k): k more tokens, one committed
                tokens, committed = tokens + arm.k, committed + 1.0
                continue
            c, d, s = (x[a] for x in self._expected(st))
            known = not (np.isnan(c) or np.isnan(d) or np.isnan(s))
            tokens += d if known else arm.k
            draft_s += s if known else 0.0
            committed += c if known else 1.0
        return self.cost.predict(num_new + len(others), tokens) + draft_s, committed

    def _priced_matching(self, states: list[_Request], others: Sequence[tuple[_Request, Arm]],
                         room: dict[str | None, int | None], remaining_slots: int) -> np.ndarray:
        """[n] arms for `states` maximising the batch's goodput with `others` as they are (marginal.choose)."""
        rows = [self._expected(st) for st in states]
        committed = np.stack([c for c, _, _ in rows])
        per_token = self.cost.seconds_per_token_at(len(states) + len(others))
        cost_s = np.stack([d * per_token + s for _, d, s in rows])
        adjust = -self.cfg.switch_weight * np.stack(
            [self._switch_penalty(st, c, remaining_slots) for st, c in zip(states, committed)])
        adjust += TIE_BREAK * (self.arm_set.drafter_of >= 0)
        base_s, base_tokens = self._base(others, len(states))
        choice = choose(committed, cost_s, adjust, self.arm_set, room, base_s, base_tokens, UNKNOWN_WEIGHT)
        self.price = choice.price
        for st, w in zip(states, choice.weights):
            st.marginal = w
        return choice.arms

    def _best_other_drafter(self, g: np.ndarray, current: str | None) -> str | None:
        """The drafter, other than `current`, of the arm with the highest g~ ([A]); None if none is known."""
        d = self.arm_set.drafter_of
        other = (d >= 0) & (d != self.arm_set.drafter_index.get(current, -1)) & ~np.isnan(g)
        if not other.any():
            return None
        return self.arm_set.drafters[d[np.flatnonzero(other)[np.argmax(g[other])]]]

    # -- stages --------------------------------------------------------------------------------------------

    def _advance_stage(self) -> None:
        while self.slot_in_stage >= self.stage_slots:
            if self.stage == EXPLORE:
                self.stage = EXPLOIT
                self.stage_slots = 2 ** (min(self.epoch, self.cfg.max_epoch) if self.cfg.max_epoch else self.epoch)
            else:
                self.epoch += 1
                self.stage, self.stage_slots = EXPLORE, self.cfg.alpha
            self.slot_in_stage = 0
            self._assigned.clear()
            self._hints.clear()

    def _explore(self, auto: list[RequestInfo], free: dict[str | None, int | None]) -> dict[str, int]:
        """Algorithm 2: a random arm per request per chunk, B_j kept by random drop. A request joining
        mid-chunk draws from the room the chunk's requests left."""
        is_chunk_start = self.slot_in_stage % self.cfg.beta == 0
        has_next_chunk = (self.slot_in_stage // self.cfg.beta + 1) * self.cfg.beta < self.stage_slots
        available = self.arm_set.available(free)
        kept, new = {}, {}
        for r in auto:
            st = self._reqs[r.req_id]
            if not is_chunk_start and st.chunk_arm is not None:
                kept[r.req_id] = st.chunk_arm
            else:
                pre = st.next_arm if is_chunk_start else None
                if not any(pre in arms for arms in available):
                    pre = self.arm_set.draw(self._worth_exploring(st, available), self.rng)
                new[r.req_id] = pre
        kept = random_drop(kept, self.arm_set, free, self.rng)  # bites only when capacity shrank mid-chunk
        room = dict(free)
        for a in kept.values():
            take(room, self.arm_set.arms[a])
        new = random_drop(new, self.arm_set, room, self.rng)
        for req_id, a in new.items():
            st = self._reqs[req_id]
            st.chunk_arm = a
            if is_chunk_start and has_next_chunk:
                st.next_arm = self.arm_set.draw(self._worth_exploring(st, available), self.rng)
            elif is_chunk_start:
                st.next_arm = None
        return kept | new

    def _worth_exploring(self, st: _Request, available: list[list[int]]) -> list[list[int]]:
        """The available arms (per drafter) the request draws from: all of them (the paper), or with an
        explore_margin, not those shown to be clearly worse: below (1 - margin) x its best. Without batch
        pricing the measure is g~ and only arms of a drafter the request has itself run may go (the prior
        alone never rules an arm out); with it, the request's marginal gain at the batch's last price, and a
        drafter the population has run EVIDENCE_SLOTS slots counts as shown too: exploration is not paid where
        the population already shows an arm loses at the current load. The slots are counted over every context,
        as the context's rates are shrunk towards everyone's: a context with little evidence of its own reads
        everyone's, and waiting for 16 slots in each context kept a model drafter explored a few per cent of the
        time on the batch's slots for hundreds of requests (on an H200 with a draft model beside the target,
        1-2% of slots on it cost the batch 20%: each one splits the verify pass and catches up its KV)."""
        if self.cfg.explore_margin == 0:
            return available
        tried = np.append(st.counts.slots[PLAIN_INDEX] > 0, st.counts.proposed + st.counts.empty > 0)  # [1 + D]
        if self.prices_batch and self.price > 0:  # marginal gains at the batch's last price; the population's
            g = self._marginal(st, self.price, cut=False)  # evidence in its context may rule an arm out too
            tried |= np.append(True, self.population.evidence() >= EVIDENCE_SLOTS)  # pooled: as the rates are
        else:
            g = self.estimate(st)
        if np.isnan(g).all():
            return available
        is_worse = tried[self.arm_set.drafter_of + 1] & (g < (1 - self.cfg.explore_margin) * np.nanmax(g))  # [A]
        kept = [[a for a in arms if not is_worse[a]] for arms in available]
        return [arms for arms in kept if arms] or available

    def _exploit(self, auto: list[RequestInfo], free: dict[str | None, int | None],
                 bypass: Sequence[tuple[_Request, Arm]] = ()) -> dict[str, int]:
        """The stage's matching, made at its first slot; newcomers are matched into the room left (priced with
        the batch's other requests as they are: those already matched and the `bypass` ones). A capacity that
        shrank below the assignment forces a full re-matching."""
        for r in auto:
            self._reqs[r.req_id].next_arm = None
        room = dict(free)
        for r in auto:
            if r.req_id in self._assigned:
                take(room, self.arm_set.arms[self._assigned[r.req_id]])
        if any(v is not None and v < 0 for v in room.values()):
            self._assigned.clear()
            room = dict(free)
        newcomers = [r for r in auto if r.req_id not in self._assigned]
        if newcomers:
            remaining = self.stage_slots - self.slot_in_stage
            states = [self._reqs[r.req_id] for r in newcomers]
            # the estimates name each request's best other drafter (its precompute hint), and price the matching
            # without batch pricing
            estimates = [self.estimate(st) if self.has_hints or not self.prices_batch else None for st in states]
            if self.prices_batch:
                others = [*bypass, *((self._reqs[r.req_id], self.arm_set.arms[self._assigned[r.req_id]])
                                     for r in auto if r.req_id in self._assigned)]
                chosen = self._priced_matching(states, others, room, remaining)
            else:
                weights = np.stack([self._weights(st, g, remaining) for st, g in zip(states, estimates)])  # [n, A]
                chosen = max_weight_assignment(weights, self.arm_set, room)
            for r, g, a in zip(newcomers, estimates, chosen):
                self._assigned[r.req_id] = int(a)
                if g is not None:
                    self._hints[r.req_id] = self._best_other_drafter(g, self.arm_set.arms[a].drafter)
        return {r.req_id: self._assigned[r.req_id] for r in auto}

    # -- bookkeeping ---------------------------------------------------------------------------------------

    def _track(self, r: RequestInfo, is_bypass: bool) -> None:
        st = self._reqs.get(r.req_id)
        if st is None:
            num_drafters = len(self.arm_set.drafters)
            st = self._reqs[r.req_id] = _Request(context_of(r.num_prompt_tokens, r.prompt_repetition), is_bypass,
                                                 Counts.zeros((), num_drafters, len(self.arm_set)),
                                                 Positions(max(self.arm_set.k_set), RECENT_DECAY),
                                                 np.zeros(num_drafters, dtype=np.int64))
        st.is_bypass = is_bypass
        st.num_tokens = r.num_prompt_tokens + r.num_output_tokens

    def _record(self, st: _Request, arm: Arm) -> None:
        """Count a drafter switch; note the tokens the new drafter must catch up (its KV lags)."""
        previous = st.current.drafter if st.current is not None else None
        if st.current is not None and arm.drafter != previous:
            self.num_switches += 1
        j = self.arm_set.drafter_index.get(arm.drafter)
        if j is not None:
            st.catchup_tokens = st.num_tokens - int(st.kv_len[j]) if arm.drafter != previous else 0
            st.kv_len[j] = st.num_tokens
        st.current = arm


def _rounded(names: Sequence[str], values: np.ndarray, digits: int = 3) -> dict[str, float | None]:
    return {n: None if np.isnan(v) else round(float(v), digits) for n, v in zip(names, values)}
