"""What a verify forward costs: seconds as a function of the requests (B) and the tokens (T) it carries.

    verify_s(B, T) = c0 + c_req * B + c_tok * T

On a CPU the forward is compute-bound and c_tok dominates: one request's drafts lengthen every request's slot.
On a GPU the forward is flat until its GEMMs saturate and c_tok is near zero at small T. A line in (B, T) is
what the selection needs (the marginal seconds of one more verified token, c_tok, and of the batch), and it is
measured, not assumed:
- the start-up profile (`spind.coordinator.profile`) times the target at several batch sizes both with
  k + 1 tokens per request and with one; their least-squares line is the prior;
- every verify the coordinator runs adds its (B, T, seconds), forgotten over `window` forwards, so the model
  follows the machine (other load, thermal state, longer contexts than the profile's).

The fit is ridge regression towards the prior line (a Gaussian prior worth `prior_weight` forwards of the
profile's shapes): where serving varies T the forwards decide, and along what it does not vary (every request
plain: T = B) the profile fills in, so the fit never has to guess c_tok from collinear data. Slopes are kept
non-negative (noise on a flat GPU curve reads flat). Until anything was seen the model knows nothing
(`is_known` is false) and selection does not price the batch (the paper's per-request weights).

One line over every batch size is not what a batch's choice needs, though: the forward is not linear in T. At
a few tokens it streams the weights and an extra token rides along; at many it is compute-bound. Measured on the
default model (AMD Zen 4, 2 threads): 1.2 ms per verified token at B = 1 (T = 1 .. 5) but 1.9 ms at B = 16 (T =
16 .. 80), so the global line, pulled by the large forwards, priced batch 1's drafts 45% too dear. So each batch
size B also has its own line in T, `verify_s = a_B + b_B T` (`LocalLine`): its prior is the profile's chord at
that B (the 1-token and the (k+1)-token forward; between profiled sizes the neighbours' lines interpolated),
refined by the forwards served at that B. `seconds_per_token_at(B)` (b_B) is what prices a request's drafts in a
batch of B, and `predict` uses the B's line where there is one. Serving at one B sweeps T over that B's range
only, which is exactly the range that B's choice is made over. The profile also times each B with one request
drafting every length 1..k (T = B + 1 .. B + k). At batch 1 the prior is the line through those forwards, and their
steps say how its slope divides over the draft positions (`token_shape_at`, `StepCurve`, refined by the forwards
served at batch 1 as the line is): selection prices each position at its share there (a CPU's second row rides along
with the first). Past batch 1 they are recorded but not priced from (`_chords` says why).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

RIDGE = 1e-6  # without a prior: a pull of the slopes towards 0, relative to the data's scale
STEP_WINDOW = 64  # batch 1's latest differences between consecutive forwards, per pair of token counts (`StepCurve`)


@dataclass(frozen=True)
class CostLine:
    """A fitted verify_s(B, T) = c0 + c_req * B + c_tok * T (seconds)."""

    c0: float
    c_req: float
    c_tok: float

    def __call__(self, batch: float, tokens: float) -> float:
        return max(0.0, self.c0 + self.c_req * batch + self.c_tok * tokens)


class LocalLine:
    """verify_s = a + b T at one batch size: ridge regression on (1, T) towards a prior line worth `weight`
    forwards at the prior's own T's, observations forgotten over `window` forwards; b >= 0. Plain floats: it is
    updated on every verify forward, and a 2x2 solve in numpy costs more than the arithmetic."""

    def __init__(self, prior: tuple[float, float] | None, prior_t: tuple[float, ...], weight: float,
                 window: int) -> None:
        self.prior = prior
        t = prior_t or (1.0,)
        self._p1, self._pt = weight, weight * sum(x * x for x in t) / len(t)  # precision on a, on b
        self._decay = 1.0 - 1.0 / window
        self.n = self._st = self._stt = self._sy = self._sty = 0.0  # decayed sums of 1, T, T^2, y, T y
        self._fit: tuple[float, float] | None = prior

    def observe(self, tokens: float, seconds: float) -> None:
        d, t = self._decay, float(tokens)
        self.n, self._st, self._stt = d * self.n + 1.0, d * self._st + t, d * self._stt + t * t
        self._sy, self._sty = d * self._sy + seconds, d * self._sty + t * seconds
        self._fit = None

    @property
    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None with no prior and under 2 distinct T's seen."""
        if self._fit is None:
            x11, x12, x22, y1, y2 = self.n, self._st, self._stt, self._sy, self._sty
            if self.prior is not None:
                x11, x22 = x11 + self._p1, x22 + self._pt
                y1, y2 = y1 + self._p1 * self.prior[0], y2 + self._pt * self.prior[1]
            det = x11 * x22 - x12 * x12
            if det <= 1e-12 * max(x11 + x22, 1e-30) ** 2:
                return None  # one T only, no prior: no slope to read
            a, b = (x22 * y1 - x12 * y2) / det, (x11 * y2 - x12 * y1) / det
            if b < 0:  # flat: the best constant
                a, b = y1 / x11, 0.0
            self._fit = (a, b)
        return self._fit


class VerifyCost:
    """Online ridge regression of verify seconds on (1, B, T) towards the profile's line, and a line in T per batch
    size (`LocalLine`); see the module doc."""

    def __init__(self, window: int = 500, prior_weight: float = 2.0) -> None:
        self.window = window
        self.prior_weight = prior_weight
        self._prior = np.zeros(3)  # the profile's line
        self._precision = np.zeros(3)  # diagonal: how much the prior pulls each coefficient
        # decayed sums of x x' and x y over the forwards, x = (1, B, T): plain floats, as they are updated on every
        # forward (numpy's per-call overhead was a third of this method's time, run cold after each forward); the
        # same roundings as the arrays' `decay * xtx + outer(x, x)`
        self._xtx, self._xty = [[0.0] * 3 for _ in range(3)], [0.0] * 3
        self._n = 0.0  # effective observations (decayed)
        self._line: CostLine | None = None  # the fit, solved lazily: None while stale
        self._last: CostLine | None = None  # the last fit solved
        self.num_prior_points = 0
        self._chords: dict[int, tuple[tuple[float, float], tuple[float, ...]]] = {}  # B -> profile's (a, b), T's
        self._steps: StepCurve | None = None  # batch 1's forwards by T, what each draft position adds (`_steps_prior`)
        self._local: dict[int, LocalLine] = {}

    @staticmethod
    def _x(batch: float, tokens: float) -> np.ndarray:
        return np.array([1.0, float(batch), float(tokens)])

    def add_prior(self, points: Iterable[tuple[int, int, float]]) -> None:
        """Measured (B, T, seconds) forwards, e.g. the start-up profile's: their line is the prior."""
        points = list(points)
        if not points:
            return
        x = np.stack([self._x(b, t) for b, t, _ in points])
        y = np.array([s for _, _, s in points])
        xtx, xty = x.T @ x, x.T @ y
        scale = max(float(np.trace(xtx)), 1.0)
        self._prior = np.array(_nonnegative_fit(xtx + np.diag([0.0, 1.0, 1.0]) * RIDGE * scale, xty))
        self._precision = self.prior_weight * np.mean(x * x, axis=0)
        self.num_prior_points = len(points)
        self._line = self._last = None
        self._chords = _chords(points)
        self._steps = _steps_prior(points, self.prior_weight)
        self._local.clear()

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One verify forward that ran: B requests, T tokens, its wall seconds."""
        if batch <= 0 or tokens <= 0 or not seconds > 0:
            return
        decay = 1.0 - 1.0 / self.window
        x = (1.0, float(batch), float(tokens))
        for row, xi in zip(self._xtx, x):
            row[:] = [decay * v + xi * xj for v, xj in zip(row, x)]
        self._xty = [decay * v + xi * seconds for v, xi in zip(self._xty, x)]
        self._n = decay * self._n + 1.0
        self._line = None
        self._local_line(batch).observe(tokens, seconds)
        if self._steps is not None:
            if batch == 1:
                self._steps.observe(tokens, seconds)
            else:
                self._steps.interrupt()

    def _local_line(self, batch: int) -> LocalLine:
        if batch not in self._local:
            prior = self._chord_at(batch)
            self._local[batch] = LocalLine(None if prior is None else prior[0], () if prior is None else prior[1],
                                           self.prior_weight, self.window)
        return self._local[batch]

    def _chord_at(self, batch: int) -> tuple[tuple[float, float], tuple[float, ...]] | None:
        """The profile's line in T at this batch size: measured there, else its neighbours' interpolated in B (the
        nearest one beyond the profiled range); None without a profile."""
        if not self._chords:
            return None
        if batch in self._chords:
            return self._chords[batch]
        sizes = sorted(self._chords)
        lo = max((b for b in sizes if b < batch), default=None)
        hi = min((b for b in sizes if b > batch), default=None)
        if lo is None or hi is None:
            return self._chords[lo if hi is None else hi]
        w = (batch - lo) / (hi - lo)
        (a0, b0), t0 = self._chords[lo]
        (a1, b1), t1 = self._chords[hi]
        return ((1 - w) * a0 + w * a1, (1 - w) * b0 + w * b1), tuple((1 - w) * x + w * y for x, y in zip(t0, t1))

    def _local_fit(self, batch: float) -> tuple[float, float] | None:
        """(a, b) of this batch size's own line; None where it has none (no profile and under two T's seen, or not
        a whole number of requests)."""
        if batch < 1 or not float(batch).is_integer():
            return None
        return self._local_line(int(batch)).fit

    def seconds_per_token_at(self, batch: int) -> float:
        """What one more verified token adds to a forward of `batch` requests: at batch 1, where the profile timed
        every draft length, the mean of `StepCurve`'s steps (what `token_shape_at` divides); else that batch size's
        own line where it has one (profiled, interpolated or observed), else the global c_tok; 0 while nothing is
        known."""
        if batch == 1 and self._steps is not None and self._steps.mean_step > 0:
            return self._steps.mean_step  # the mean of its steps (`token_shape_at`)
        fit = self._local_fit(batch)
        return self.seconds_per_token if fit is None else fit[1]

    def token_shape_at(self, batch: int) -> tuple[float, ...] | None:
        """What each draft position of a request adds to a forward of `batch` requests, relative to
        `seconds_per_token_at(batch)` (mean 1): batch 1's steps (`StepCurve`: the profile's, refined by serving's
        forwards), at batch 1 only; None elsewhere, or where the profile did not time them (every position costs the
        same). Past batch 1 the probe's steps read what serving's do not: its requests share one forked 128-token
        context, and one request's first draft token cost 0.84 ms there at B = 4 against 1.33 over distinct 300-token
        contexts (the default model, Xeon, 2 threads); priced at the former, `spin` drafted first tokens that lost
        (`bench e2e` at B = 4: 0.93x `none` on mtbench, 0.90 on gsm8k)."""
        return self._steps.shape if batch == 1 and self._steps is not None else None

    @property
    def is_known(self) -> bool:
        return self.num_prior_points > 0 or self._n >= 3

    @property
    def line(self) -> CostLine | None:
        """The current fit; None until anything was seen."""
        if self._line is None and self.is_known:
            sum_xx, sum_xy = np.array(self._xtx), np.array(self._xty)
            if self.num_prior_points:
                xtx = sum_xx + np.diag(self._precision)
                xty = sum_xy + self._precision * self._prior
            else:
                scale = max(float(np.trace(sum_xx)), 1.0)
                xtx, xty = sum_xx + np.diag([0.0, 1.0, 1.0]) * RIDGE * scale, sum_xy
            self._line = self._last = CostLine(*_nonnegative_fit(xtx, xty))
        return self._line

    def predict(self, batch: float, tokens: float) -> float | None:
        """Seconds of a forward of `batch` requests and `tokens` tokens: that batch size's line where it has one,
        else the global line; None while nothing is known."""
        fit = self._local_fit(batch)
        if fit is not None:
            return max(0.0, fit[0] + fit[1] * tokens)
        line = self.line
        return None if line is None else line(batch, tokens)

    def predict_cheaply(self, batch: int, tokens: float) -> float | None:
        """`predict` without solving the global fit (~0.2 ms; a batch size's own line is a 2x2 solve): where B has
        no line, what the global line selection last read predicts. For per-forward callers (the dashboard's
        predicted-vs-measured)."""
        fit = self._local_fit(batch)
        if fit is not None:
            return max(0.0, fit[0] + fit[1] * tokens)
        return None if self._last is None else self._last(batch, tokens)

    @property
    def seconds_per_token(self) -> float:
        """c_tok: what one more verified token adds to the forward (0 while unknown)."""
        line = self.line
        return 0.0 if line is None else line.c_tok

    def describe(self) -> dict | None:
        line = self.line
        if line is None:
            return None
        by_batch = {}
        for b in sorted(self._local):
            fit = self._local[b].fit
            if fit is not None:
                by_batch[str(b)] = {"c0_ms": round(fit[0] * 1e3, 4), "per_token_ms": round(fit[1] * 1e3, 4),
                                    "observations": round(self._local[b].n, 1)}
        out = {"c0_ms": round(line.c0 * 1e3, 4), "per_request_ms": round(line.c_req * 1e3, 4),
               "per_token_ms": round(line.c_tok * 1e3, 4), "prior_points": self.num_prior_points,
               "observations": round(self._n, 1), "by_batch": by_batch}
        if self._steps is not None:  # what each draft position of batch 1's request adds (`StepCurve`)
            out["batch1_position_ms"] = [round(x * 1e3, 4) for x in self._steps.steps]
        return out


def _by_batch(points: Iterable[tuple[int, int, float]]) -> dict[int, dict[int, float]]:
    """Per batch size: T -> the mean seconds of its forwards of T tokens."""
    sums: dict[int, dict[int, list[float]]] = {}
    for b, t, sec in points:
        sums.setdefault(int(b), {}).setdefault(int(t), []).append(sec)
    return {b: {t: sum(v) / len(v) for t, v in ts.items()} for b, ts in sums.items()}


def _chords(points: list[tuple[int, int, float]]) -> dict[int, tuple[tuple[float, float], tuple[float, ...]]]:
    """Per batch size with forwards of at least two token counts: the least-squares line in T (slope kept >= 0), and
    its T's. At batch 1 through every forward (its one request drafting 1..k: the steps `StepCurve` reads); past it
    through the plain and the all-drafting forward only. The profile's forwards with one request drafting past batch 1
    (recorded, and `bench replay` models them) read cheaper than serving's: its requests share one forked 128-token
    context, and one request's first draft token cost 0.84 ms there at B = 4 against 1.33 over distinct 300-token
    contexts (the default model, Xeon, 2 threads). Priced from them, `spin` drafted where it lost: through `bench e2e`
    at B = 4, 0.94x `none` on mtbench and 0.96 on gsm8k, against 1.00 and 1.01 with the all-drafting chord the same
    hour; their T's near B also left the line's prior too weak to hold the slope against serving's noise."""
    chords = {}
    for b, curve in _by_batch(points).items():
        ts = sorted(curve) if b == 1 else sorted({min(curve), max(curve)})
        if len(ts) < 2:
            continue
        t, y = np.array(ts, dtype=float), np.array([curve[x] for x in ts])
        slope = max(0.0, float(np.polyfit(t, y, 1)[0]))
        chords[b] = ((float(np.mean(y) - slope * np.mean(t)), slope), tuple(float(x) for x in t))
    return chords


class StepCurve:
    """What each draft position of batch 1's one request adds to its forward: the first c1, each later one c2 (a
    CPU's forward is stepped in rows: the default model's second row rode along with the first on a Xeon, within 0.3
    ms of a 5.5-6 ms step, each later one adding 0.9-1.6 ms; on AVX2 the second row takes the kernels off their
    one-row loop and costs more than the rows after it). Read from consecutive forwards of distinct token counts: a
    forward of T tokens right after one of T' adds f(T) - f(T'), f(T) = c1 + c2 (T - 2) for T >= 2 and f(1) = 0, so
    the host's drift between moments cancels; per pair of counts the median of its latest STEP_WINDOW differences,
    the pairs' medians fitted by least squares weighed by their counts, c1, c2 >= 0. The profile's steps seed the
    pairs (1, T) as `weight` differences each until serving's replace them, and a pair serving never ran drops out
    once serving has made STEP_WINDOW of its own. The profile's probe reads steps serving does not (default model,
    AMD EPYC, 2 threads: its first draft token added 0.5 ms to a 7.3 ms step, serving's 1.6-1.9, its later ones 1.0-1.4
    against 1.2-1.7; T = 1 .. 5 alternated in one process, 1.0-1.3 each); priced at the probe's, selection drafted
    first tokens that did not pay. Medians and two numbers for four positions: this VM's forwards spike to 2x and
    drift by 10% within a minute. Read against the median of the latest plain forwards instead, c1 swung from 1.1 to
    2.1 ms between quarters of one `bench e2e` run whose quarters' own medians put it at 1.3-1.7 (gsm8k, batch 1; to
    0.6 on humaneval's `fixed:suffix`): a plain forward is rare where requests draft, and the plain step it was read
    against was minutes old. Replayed over the same forwards, the pairs read 1.4-1.8 (1.5 on humaneval). Much of what
    serving read above the probe was the kernels': on that CPU a many-row GEMM ran ~30% slower after 1-row GEMMs had
    streamed the weights (the hardware prefetchers' state), so a drafted forward after plain slots cost 0.6-0.9 ms
    more than one after a drafted forward; the 1-row loop prefetches its stream itself since stop 83
    (kernels/csrc/quant_gemm.cpp; `spind bench batch --after-decodes`)."""

    def __init__(self, prior: dict[int, float], weight: float) -> None:
        self.ts = sorted(prior)
        copies = max(1, round(weight))
        self._pairs = {(1, t): deque([prior[t] - prior[1]] * copies, maxlen=STEP_WINDOW) for t in self.ts[1:]}
        self._served: Counter[tuple[int, int]] = Counter()  # serving's differences per pair
        self._last: tuple[int, float] | None = None  # the latest forward (T, seconds), while the next may pair with it
        self._steps: tuple[float, ...] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens not in self.ts:  # beyond the profiled draft lengths: not priced from, breaks the run
            self._last = None
            return
        last, self._last = self._last, (tokens, seconds)
        if last is None or last[0] == tokens:
            return
        lo, hi = sorted((last, (tokens, seconds)))
        pair = (lo[0], hi[0])
        self._pairs.setdefault(pair, deque(maxlen=STEP_WINDOW)).append(hi[1] - lo[1])
        self._served[pair] += 1
        self._steps = None

    def interrupt(self) -> None:
        """A forward of another batch size ran: the next of batch 1 pairs with none before it."""
        self._last = None

    @property
    def steps(self) -> tuple[float, ...]:
        """Seconds each draft position adds: (c1, c2, c2, ...)."""
        if self._steps is None:
            settled = self._served.total() >= STEP_WINDOW
            c1, c2 = _first_and_rest([(lo, hi, statistics.median(q), len(q)) for (lo, hi), q in self._pairs.items()
                                      if not settled or self._served[(lo, hi)]])
            self._steps = (c1,) + (c2,) * (len(self.ts) - 2)
        return self._steps

    @property
    def mean_step(self) -> float:
        return sum(self.steps) / len(self.steps)

    @property
    def shape(self) -> tuple[float, ...] | None:
        mean = self.mean_step
        return tuple(x / mean for x in self.steps) if mean > 0 else None


def _first_and_rest(pairs: list[tuple[int, int, float, int]]) -> tuple[float, float]:
    """(c1, c2) >= 0 of f(hi) - f(lo) = y, f(T) = c1 [T >= 2] + c2 max(T - 2, 0), by least squares weighed by n over
    (lo, hi, y, n); where the pairs leave one of them unread it is the other's alike (a pair (1, 2) only: c2 = c1)."""
    rows = [(float(hi >= 2) - float(lo >= 2), max(hi - 2, 0) - max(lo - 2, 0), y, n) for lo, hi, y, n in pairs]
    s11 = sum(n * a * a for a, _, _, n in rows)
    s12 = sum(n * a * b for a, b, _, n in rows)
    s22 = sum(n * b * b for _, b, _, n in rows)
    s1y = sum(n * a * y for a, _, y, n in rows)
    s2y = sum(n * b * y for _, b, y, n in rows)
    det = s11 * s22 - s12 * s12
    if s11 <= 0 or s22 <= 0 or det <= 1e-12 * (s11 + s22) ** 2:  # one of the two unread: one step for all positions
        s = s11 + 2 * s12 + s22
        c = max(0.0, (s1y + s2y) / s) if s > 0 else 0.0
        return c, c
    c1, c2 = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
    if c1 >= 0 and c2 >= 0:
        return c1, c2
    if c2 < 0:  # flat past the first
        return max(0.0, s1y / s11), 0.0
    return 0.0, max(0.0, s2y / s22)


def _steps_prior(points: list[tuple[int, int, float]], weight: float) -> StepCurve | None:
    """Batch 1's steps, where the profile timed its forwards at every draft length 1..k (T = 1 .. k + 1); None where
    it did not (every position is then priced alike). Past batch 1 none (`_chords` says why)."""
    curve = _by_batch(points).get(1, {})
    ts = sorted(curve)
    if len(ts) < 3 or ts != list(range(1, ts[-1] + 1)):
        return None
    return StepCurve(curve, weight)


def _nonnegative_fit(xtx: np.ndarray, xty: np.ndarray) -> tuple[float, float, float]:
    """argmin of theta' xtx theta - 2 theta' xty with c_req, c_tok >= 0: the unconstrained solution if its slopes
    are, else the best over fits with a slope held at 0 (three coefficients: trying each subset is exact)."""
    best, best_loss = np.zeros(3), np.inf
    for keep in ([0, 1, 2], [0, 2], [0, 1], [0]):
        sub = np.ix_(keep, keep)
        try:
            theta_k = np.linalg.solve(xtx[sub] + np.eye(len(keep)) * 1e-15, xty[keep])
        except np.linalg.LinAlgError:
            continue
        theta = np.zeros(3)
        theta[keep] = theta_k
        if theta[1] < 0 or theta[2] < 0:
            continue
        loss = float(theta @ xtx @ theta - 2 * theta @ xty)
        if loss < best_loss:
            best, best_loss = theta, loss
    return float(best[0]), float(best[1]), float(best[2])
