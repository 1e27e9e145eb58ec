"""Goodput estimates g~_ij per request and arm: the request's own slots, shrunk towards a prior.

Every slot's feedback updates the request's counts and its context's in the population (bypassing requests
feed the population only):
- per drafter: drafts accepted, rejections (slots whose drafts were not all accepted), and slots with and
  without a proposal (prompt lookup drafts nothing when no n-gram matches);
- per arm: summed reward and slots; for the population also the seconds of a slot on the arm with and
  without a proposal, and the drafts per proposal.

The prior of arm (j, k) is the standard expectation of speculative decoding (Leviathan et al., 2023),

    g^_ij = h_ij * (1 - p_ij^(d+1)) / (1 - p_ij) / s_hit(j, k)  +  (1 - h_ij) / s_miss(j, k),

with p_ij the request's per-token acceptance on drafter j (accepted / (accepted + rejections), the MLE of a
geometric run cut off at d) and h_ij its proposal rate, both shrunk towards its context's with n0 pseudo-
trials; d the population's drafts per proposal on the arm (<= k); s_hit, s_miss the population's mean slot
seconds on the arm with and without a proposal. Plain decoding: 1 / s(plain). So the request's acceptance
on a drafter, learned at any k, predicts every k of that drafter: a request that accepts more wants longer
drafts. The estimate is its own mean reward shrunk towards the prior, g~_ij = (S_ij + n0 g^_ij) / (N_ij + n0),
so its own observations take over as they accumulate; n0 = 0 is the paper's plain average (nan: never run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from spind.coordinator.selection.arms import PLAIN_INDEX, ArmSet
from spind.coordinator.selection.features import NUM_CONTEXTS
from spind.coordinator.selection.protocol import SlotFeedback

CONTEXT_STRENGTH = 8.0  # pseudo-trials of the overall rate in a context's rates


@dataclass
class Counts:
    """Acceptance counts per drafter (`[..., D]`) and reward per arm (`[..., A]`); one request, or one row
    per context."""

    accepted: np.ndarray
    rejected: np.ndarray
    proposed: np.ndarray  # slots with at least one draft
    empty: np.ndarray  # slots on the drafter that drafted nothing
    reward: np.ndarray
    slots: np.ndarray
    tokens: np.ndarray  # tokens committed on the arm (the reward's numerator)

    @classmethod
    def zeros(cls, lead: tuple[int, ...], num_drafters: int, num_arms: int) -> Counts:
        d, a = (*lead, num_drafters), (*lead, num_arms)
        return cls(np.zeros(d), np.zeros(d), np.zeros(d), np.zeros(d), np.zeros(a), np.zeros(a), np.zeros(a))

    def add(self, row: tuple, j: int | None, a: int | None, fb: SlotFeedback, reward: float) -> None:
        """Count one slot; row indexes the leading dimensions (() for a request). Its draft's acceptance only if it
        does not reach the selector as a shadow draft too (fb.shadowed: that one has every position)."""
        if j is not None and not fb.shadowed:
            self.add_acceptance(row, j, fb.num_drafted, fb.num_accepted)
        if a is not None:
            self.reward[(*row, a)] += reward
            self.tokens[(*row, a)] += fb.num_committed
            self.slots[(*row, a)] += 1

    def add_acceptance(self, row: tuple, j: int, num_drafted: int, num_accepted: int) -> None:
        """One draft of drafter j: accepted tokens, a rejection if not all were, or an empty proposal."""
        if num_drafted > 0:
            self.accepted[(*row, j)] += num_accepted
            self.rejected[(*row, j)] += num_accepted < num_drafted
            self.proposed[(*row, j)] += 1
        else:
            self.empty[(*row, j)] += 1

    def scale(self, row: tuple, j: int | None, a: int | None, window: int) -> None:
        """Keep at most `window` slots per (row, drafter) and (row, arm), the means unchanged."""
        if j is not None:
            n = self.proposed[(*row, j)] + self.empty[(*row, j)]
            if n > window:
                for x in (self.accepted, self.rejected, self.proposed, self.empty):
                    x[(*row, j)] *= window / n
        if a is not None and self.slots[(*row, a)] > window:
            self.reward[(*row, a)] *= window / self.slots[(*row, a)]
            self.tokens[(*row, a)] *= window / self.slots[(*row, a)]
            self.slots[(*row, a)] = window


class Positions:
    """Per key (a drafter, or a context and a drafter) and draft position t = 1..K: drafts that reached t (their
    first t - 1 tokens accepted) and those whose t-th token was accepted too. survived / reached is the chance
    that token t survives once the ones before it did: copying drafters (n-gram, suffix) miss mostly on their first
    token and then copy on, which a single per-token rate (a geometric run) cannot say. `decay` < 1 forgets old
    drafts at each new one of the key (a request's recent drafts: copying comes in runs). Plain float lists: it
    is updated for every request on every slot, where numpy's per-call overhead is the cost."""

    def __init__(self, num_positions: int, decay: float = 1.0) -> None:
        self.num_positions, self.decay = num_positions, decay
        self.rows: dict[object, tuple[list[float], list[float]]] = {}  # key -> (reached, survived)

    def add(self, key: object, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = ([0.0] * self.num_positions, [0.0] * self.num_positions)
        reached, survived = row
        if self.decay < 1.0:
            d = self.decay
            for t in range(self.num_positions):
                reached[t] *= d
                survived[t] *= d
        for t in range(min(num_drafted, num_accepted + 1, self.num_positions)):
            reached[t] += 1.0
        for t in range(min(num_accepted, self.num_positions)):
            survived[t] += 1.0

    def cap(self, key: object, window: int) -> None:
        """At most `window` drafts for the key, the rates unchanged."""
        row = self.rows.get(key)
        if row is not None and row[0][0] > window:
            scale = window / row[0][0]
            for x in row:
                x[:] = [v * scale for v in x]


class Calibration:
    """Per drafter that rates its own draft tokens (`Draft.confidence`: its estimate that the draft's first t tokens
    all survive), how often they did, by that confidence: its draft tokens in `bins` equal bins of [0, 1], each
    with the tokens that reached it in a decided draft and those whose whole prefix survived. A bin's rate is
    shrunk towards the bin's middle (the drafter taken at its word) with `prior` pseudo-tokens, then made
    non-decreasing in the confidence (pool adjacent violators): a token the drafter is surer of is never worth
    less. A bin no token fell in reads the nearest one below it that had some (below them all, its middle, capped at the
    lowest one seen): a confidence never seen is not trusted beyond what was. The curve, with each draft position's
    price, is how the drafter's worker cuts the draft itself (`spind.draft_cut.CutRule`): unlike a request's recent
    survival, the confidence says which of this slot's tokens will survive. A drafter's counts halve when they pass
    `window` tokens, so the curve follows the workload. The curve is solved again once the tokens added since it was
    solved reach 1/`refresh` of the drafter's total (every draft while few are known; every ~10 shadow drafts over a
    full window): one draft moves a curve over thousands of tokens by less than its noise, and solving it after every
    draft (the pooling, in Python) was the selector's largest cost at batch 1, where it is read three times a slot."""

    def __init__(self, num_drafters: int, bins: int = 20, prior: float = 2.0, window: float = 4096.0,
                 min_tokens: float = 64.0, refresh: int = 32) -> None:
        self.bins, self.prior, self.window, self.min_tokens, self.refresh = bins, prior, window, min_tokens, refresh
        self.reached = [[0.0] * bins for _ in range(num_drafters)]
        self.survived = [[0.0] * bins for _ in range(num_drafters)]
        self.total = [0.0] * num_drafters
        self._pending = [0] * num_drafters  # tokens added since drafter j's curve was solved
        self._curves: dict[int, list[float]] = {}

    def add(self, j: int, confidence: Sequence[float], num_accepted: int) -> None:
        """A decided draft of drafter j: its tokens' confidences and how many of them were accepted."""
        if not confidence:
            return
        reached, survived = self.reached[j], self.survived[j]
        top = self.bins - 1
        for t, c in enumerate(confidence):
            b = min(top, max(0, int(c * self.bins)))
            reached[b] += 1.0
            if t < num_accepted:
                survived[b] += 1.0
        self.total[j] += len(confidence)
        if self.total[j] > self.window:
            for row in (reached, survived):
                row[:] = [v * 0.5 for v in row]
            self.total[j] *= 0.5
        self._pending[j] += len(confidence)
        if self._pending[j] * self.refresh >= self.total[j]:
            self._curves.pop(j, None)

    def known(self, j: int) -> bool:
        return self.total[j] >= self.min_tokens

    def curve(self, j: int) -> list[float]:
        """[bins] the chance that a token of that confidence survives with its prefix, non-decreasing."""
        c = self._curves.get(j)
        if c is None:
            seen = [b for b, r in enumerate(self.reached[j]) if r > 0]
            pooled = _non_decreasing([(self.survived[j][b] + self.prior * (b + 0.5) / self.bins,
                                       self.reached[j][b] + self.prior) for b in seen])
            c, i = [], 0  # a bin no token fell in reads the nearest one below that had some; below them all, the
            for b in range(self.bins):  # drafter at its word, never above the lowest one seen
                while i + 1 < len(seen) and seen[i + 1] <= b:
                    i += 1
                word = (b + 0.5) / self.bins
                c.append(word if not seen else min(word, pooled[0]) if b < seen[0] else pooled[i])
            self._curves[j] = c
            self._pending[j] = 0
        return c

    def describe(self, j: int) -> list[float] | None:
        return [round(q, 3) for q in self.curve(j)] if self.known(j) else None


def _non_decreasing(rates: Sequence[tuple[float, float]]) -> list[float]:
    """Weighted (numerator, weight) rates -> the closest non-decreasing sequence of ratios (pool adjacent
    violators, weights the bins' tokens)."""
    blocks: list[list[float]] = []  # [numerator, weight, bins pooled]
    for num, w in rates:
        blocks.append([num, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            num2, w2, n2 = blocks.pop()
            blocks[-1][0] += num2
            blocks[-1][1] += w2
            blocks[-1][2] += n2
    out: list[float] = []
    for num, w, n in blocks:
        out.extend([num / w] * int(n))
    return out


def worth_drafting(survival: Sequence[float], price_tokens: float | Sequence[float], k: int) -> int:
    """Draft tokens worth verifying, given [K] the conditional survival per position (nan = unknown: 0). The t-th
    token adds the chance that the first t all survive (it commits only if every one before it did) and costs
    `price_tokens` (its share of the slot's seconds, in tokens at the batch's rate; one price, or one per position,
    the last holding past them), so keep the prefix, up to k, whose tokens add the most beyond their prices (the
    longest of equals): with one price, the longest whose last token still pays, as the chance only falls. Past K
    positions the last one's rate holds."""
    prices = (price_tokens,) if isinstance(price_tokens, (int, float)) else price_tokens
    alive, gain, best, most = 1.0, 0.0, 0, 0.0
    last, last_price = len(survival) - 1, len(prices) - 1
    for t in range(k):
        q = survival[min(t, last)]
        alive *= 0.0 if q != q else q  # nan: unknown, not worth a token
        if alive <= 0.0:
            break
        gain += alive - prices[min(t, last_price)]
        if gain >= most:
            best, most = t + 1, gain
    return best


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, nan where den is 0."""
    return np.divide(num, den, out=np.full(np.shape(num), np.nan), where=den > 0)


def _shrink(num: np.ndarray, den: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """(num + strength * prior) / (den + strength); num / den where prior is nan; nan where both unknown."""
    known = ~np.isnan(prior)
    return np.where(known, (num + strength * np.where(known, prior, 0)) / (den + strength), _ratio(num, den))


@dataclass
class PopulationStats:
    """Everyone's counts, per context, plus the per-arm slot seconds."""

    arm_set: ArmSet
    window: int
    counts: Counts = field(init=False)

    def __post_init__(self) -> None:
        num_arms, num_drafters = len(self.arm_set), len(self.arm_set.drafters)
        self.counts = Counts.zeros((NUM_CONTEXTS,), num_drafters, num_arms)
        self.hit_s, self.hit_n, self.drafts = np.zeros(num_arms), np.zeros(num_arms), np.zeros(num_arms)  # [A]
        self.miss_s, self.miss_n = np.zeros(num_arms), np.zeros(num_arms)  # [A]
        self.draft_s, self.draft_tokens = np.zeros(num_drafters), np.zeros(num_drafters)  # [D] timed drafts
        self.positions = Positions(max(self.arm_set.k_set))  # keyed (context, drafter)
        self._rates: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # context -> rates(), until the next add
        self._survival: dict[tuple, list[float]] = {}  # survival() and acceptance() per context and drafter, until an
        #                                                add

    def add(self, context: int, j: int | None, a: int | None, fb: SlotFeedback, reward: float) -> None:
        self._rates.clear()
        self._survival.clear()
        self.counts.add((context,), j, a, fb, reward)
        self.counts.scale((context,), j, a, self.window)
        if j is not None and not fb.shadowed:
            self._add_positions(context, j, fb.num_drafted, fb.num_accepted)
        if j is not None and fb.num_drafted > 0:
            self.draft_s[j] += fb.draft_s
            self.draft_tokens[j] += fb.num_drafted
            if self.draft_tokens[j] > self.window * 8:
                self.draft_s[j] *= self.window * 8 / self.draft_tokens[j]
                self.draft_tokens[j] = self.window * 8
        if a is None:
            return
        seconds = fb.draft_s + fb.verify_s
        if fb.num_drafted > 0:
            self.hit_s[a] += seconds
            self.drafts[a] += fb.num_drafted
            self.hit_n[a] += 1
        else:
            self.miss_s[a] += seconds
            self.miss_n[a] += 1
        for total, sums in ((self.hit_n, (self.hit_s, self.drafts)), (self.miss_n, (self.miss_s,))):
            if total[a] > self.window:
                for x in sums:
                    x[a] *= self.window / total[a]
                total[a] = self.window

    def add_acceptance(self, context: int, j: int, num_drafted: int, num_accepted: int) -> None:
        """Acceptance evidence without a slot (a counterfactual draft the request did not run)."""
        self._rates.clear()
        self._survival.clear()
        self.counts.add_acceptance((context,), j, num_drafted, num_accepted)
        self.counts.scale((context,), j, None, self.window)
        self._add_positions(context, j, num_drafted, num_accepted)

    def _add_positions(self, context: int, j: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted > 0:
            self._survival.clear()
            self.positions.add((context, j), num_drafted, num_accepted)
            self.positions.cap((context, j), self.window)

    def rates(self, context: int) -> tuple[np.ndarray, np.ndarray]:
        """[D] acceptance and proposal rate of the context, shrunk towards everyone's; nan = unknown."""
        if context in self._rates:
            return self._rates[context]
        c = self.counts
        overall_p = _ratio(c.accepted.sum(0), c.accepted.sum(0) + c.rejected.sum(0))
        overall_h = _ratio(c.proposed.sum(0), c.proposed.sum(0) + c.empty.sum(0))
        p = _shrink(c.accepted[context], c.accepted[context] + c.rejected[context], overall_p, CONTEXT_STRENGTH)
        h = _shrink(c.proposed[context], c.proposed[context] + c.empty[context], overall_h, CONTEXT_STRENGTH)
        self._rates[context] = p, h
        return p, h

    def acceptance(self, context: int, j: int) -> float:
        """rates(context)[0][j] in plain floats (nan = unknown), cached until the next add: read per request and
        slot."""
        key = (context, j, "p")
        if key not in self._survival:
            c = self.counts
            acc, rej = c.accepted[:, j], c.rejected[:, j]
            total_acc, total = float(acc.sum()), float(acc.sum() + rej.sum())
            overall = total_acc / total if total > 0 else float("nan")
            a, n = float(acc[context]), float(acc[context] + rej[context])
            if overall == overall:
                p = (a + CONTEXT_STRENGTH * overall) / (n + CONTEXT_STRENGTH)
            else:
                p = a / n if n > 0 else float("nan")
            self._survival[key] = [p]
        return self._survival[key][0]

    def survival(self, context: int, j: int) -> list[float]:
        """[K] the context's chance on drafter j that draft position t survives once the ones before it did, shrunk
        towards everyone's; nan = unknown."""
        key = (context, j)
        if key not in self._survival:
            k = self.positions.num_positions
            reached, survived = [0.0] * k, [0.0] * k
            for (_, dj), (r, s) in self.positions.rows.items():
                if dj == j:
                    reached = [a + b for a, b in zip(reached, r)]
                    survived = [a + b for a, b in zip(survived, s)]
            own = self.positions.rows.get(key, ([0.0] * k, [0.0] * k))
            out = []
            for r, s, r_all, s_all in zip(*own, reached, survived):
                if r_all > 0:
                    out.append((s + CONTEXT_STRENGTH * s_all / r_all) / (r + CONTEXT_STRENGTH))
                else:
                    out.append(float("nan"))
            self._survival[key] = out
        return self._survival[key]

    def mean_reward(self) -> np.ndarray:
        """[A] everyone's mean reward per arm; nan = never run."""
        return _ratio(self.counts.reward.sum(0), self.counts.slots.sum(0))

    def evidence(self) -> np.ndarray:
        """[D] slots everyone ran on each drafter, over every context (acceptance evidence, shadow drafts
        included)."""
        c = self.counts
        return c.proposed.sum(0) + c.empty.sum(0)

    def draft_s_per_token(self) -> np.ndarray:
        """[D] seconds a drafter's propose took per token it drafted (its whole batch's call, charged to each
        request it drafted for: an upper bound at batch > 1); nan = never timed."""
        return _ratio(self.draft_s, self.draft_tokens)

    def drafts_per_proposal(self) -> np.ndarray:
        """[A] tokens drafted when the arm proposes at all (<= k: near max_tokens, or a short n-gram match)."""
        k = np.array([arm.k for arm in self.arm_set.arms], dtype=float)
        return np.where(self.hit_n > 0, _ratio(self.drafts, self.hit_n), k)

    def model_tokens(self, p: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[A] expected tokens committed and [A] tokens drafted per slot, for a request with acceptance p and
        proposal rate h per drafter ([D]): h * (1 - p^(d+1)) / (1 - p) + (1 - h), and h * d; plain decoding
        commits one token and drafts none. nan where the drafter's p or h is unknown."""
        committed, drafted = np.ones(len(self.arm_set)), np.zeros(len(self.arm_set))
        spec = self.arm_set.drafter_of >= 0
        ha = h[self.arm_set.drafter_of[spec]]
        committed[spec] = ha * self._tokens_if_proposed(p) + (1 - ha)
        drafted[spec] = ha * self.drafts_per_proposal()[spec]
        return committed, drafted

    def model_goodput(self, p: np.ndarray, h: np.ndarray) -> np.ndarray:
        """[A] g^ per arm for a request with acceptance p and proposal rate h per drafter ([D])."""
        s_hit, s_miss = _ratio(self.hit_s, self.hit_n), _ratio(self.miss_s, self.miss_n)
        g = np.full(len(self.arm_set), 1 / s_miss[PLAIN_INDEX])  # plain decoding: one token a slot
        s_miss = np.where(np.isnan(s_miss), s_miss[PLAIN_INDEX], s_miss)  # a miss verifies one token, as plain
        spec = self.arm_set.drafter_of >= 0  # [A] the drafters' arms
        ha = h[self.arm_set.drafter_of[spec]]
        tokens = self._tokens_if_proposed(p)
        with np.errstate(invalid="ignore", divide="ignore"):
            g[spec] = ha * tokens / s_hit[spec] + np.where(ha < 1, (1 - ha) / s_miss[spec], 0.0)
        return g

    def _tokens_if_proposed(self, p: np.ndarray) -> np.ndarray:
        """[A_spec] E[committed | the arm proposed] for the drafters' arms: (1 - p^(d+1)) / (1 - p), d the drafts
        per proposal."""
        spec = self.arm_set.drafter_of >= 0
        pa, n = p[self.arm_set.drafter_of[spec]], self.drafts_per_proposal()[spec]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(pa < 1, (1 - pa ** (n + 1)) / (1 - pa), n + 1)


def _prior_weight(own: Counts, population: PopulationStats, n0: float) -> np.ndarray:
    """[A] pseudo-slots of the model's prediction against the request's own mean on each arm: n0, plus the shadow
    drafts of the arm's drafter the request was checked against while it ran something else. The model reads
    the request's acceptance from those too, while its mean on an arm counts only the slots it ran there, which
    may be few and from another part of the output (prompt lookup finds nothing to copy early in one answer and
    copies whole lines later): so a few unlucky slots cannot keep a request off a drafter that its shadow drafts
    show would pay, and the slots it ran weigh as much as the shadows it saw."""
    d = population.arm_set.drafter_of
    ran = np.zeros(len(own.proposed))
    np.add.at(ran, d[d >= 0], own.slots[d >= 0])  # [D] slots it ran on each drafter
    shadows = np.maximum(own.proposed + own.empty - ran, 0.0)  # [D] acceptance evidence from the others
    return n0 + np.append(shadows, 0.0)[d]  # index -1 (plain decoding) reads the 0


def estimate(own: Counts, context: int, population: PopulationStats, n0: float) -> np.ndarray:
    """[A] g~ of one request per arm; nan = unknown."""
    own_mean = _ratio(own.reward, own.slots)
    if n0 == 0:
        return own_mean
    prior = population.model_goodput(*request_rates(own, context, population, n0))
    w = _prior_weight(own, population, n0)
    return np.where(np.isnan(prior), own_mean, (own.reward + w * np.where(np.isnan(prior), 0, prior))
                    / (own.slots + w))


def request_rates(own: Counts, context: int, population: PopulationStats, n0: float) -> tuple[np.ndarray, np.ndarray]:
    """[D] the request's acceptance and proposal rate per drafter, shrunk towards its context's with n0."""
    p_ctx, h_ctx = population.rates(context)
    return (_shrink(own.accepted, own.accepted + own.rejected, p_ctx, n0),
            _shrink(own.proposed, own.proposed + own.empty, h_ctx, n0))


def survival_of(own: Positions, counts: Counts, context: int, population: PopulationStats, n0: float,
                j: int, strength: float) -> list[float]:
    """[K] one request's chance on drafter j that draft position t survives once the ones before it did: its own
    recent drafts (real and shadow) shrunk with `strength` pseudo-drafts towards its context's curve scaled by
    how the request's acceptance (shrunk with n0) compares with its context's (so positions its drafts have not
    reached lately, e.g. past a cut, are read from its own rate, not from other requests of its context); nan =
    unknown. Plain floats: it runs per request and slot."""
    p_ctx = population.acceptance(context, j)
    ratio = 1.0
    if p_ctx > 0:  # the request's own acceptance, shrunk as request_rates does, against its context's
        acc, rej = float(counts.accepted[j]), float(counts.rejected[j])
        ratio = (acc + n0 * p_ctx) / (acc + rej + n0) / p_ctx if acc + rej + n0 > 0 else 1.0
    prior = population.survival(context, j)
    reached, survived = own.rows.get(j) or ([0.0] * len(prior), [0.0] * len(prior))
    out = []
    for r, s, q in zip(reached, survived, prior):
        if q != q:  # nan: no prior; the request's own rate, if any
            out.append(s / r if r > 0 else float("nan"))
        else:
            out.append((s + strength * min(1.0, q * ratio)) / (r + strength) if r + strength > 0
                       else min(1.0, q * ratio))
    return out


def estimate_tokens(own: Counts, context: int, population: PopulationStats,
                    n0: float) -> tuple[np.ndarray, np.ndarray]:
    """[A] expected tokens one request commits per slot on each arm (its own mean shrunk towards the model of its
    shrunk acceptance, as `estimate` does for goodput), and [A] the tokens it would draft there; nan = unknown."""
    prior, drafted = population.model_tokens(*request_rates(own, context, population, n0))
    own_mean = _ratio(own.tokens, own.slots)
    if n0 == 0:
        return np.where(np.isnan(own_mean), prior, own_mean), drafted
    known = ~np.isnan(prior)
    w = _prior_weight(own, population, n0)
    committed = np.where(known, (own.tokens + w * np.where(known, prior, 0)) / (own.slots + w), own_mean)
    return committed, drafted
