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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

RIDGE = 1e-6  # without a prior: a pull of the slopes towards 0, relative to the data's scale


@dataclass(frozen=True)
class CostLine:
    """A fitted verify_s(B, T) = c0 + c_req * B + c_tok * T (seconds)."""

    c0: float
    c_req: float
    c_tok: float

    def __call__(self, batch: float, tokens: float) -> float:
        return max(0.0, self.c0 + self.c_req * batch + self.c_tok * tokens)


class VerifyCost:
    """Online ridge regression of verify seconds on (1, B, T) towards the profile's line; see the module doc."""

    def __init__(self, window: int = 500, prior_weight: float = 2.0) -> None:
        self.window = window
        self.prior_weight = prior_weight
        self._prior = np.zeros(3)  # the profile's line
        self._precision = np.zeros(3)  # diagonal: how much the prior pulls each coefficient
        self._xtx, self._xty = np.zeros((3, 3)), np.zeros(3)
        self._n = 0.0  # effective observations (decayed)
        self._line: CostLine | None = None
        self.num_prior_points = 0

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
        self._line = None

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One verify forward that ran: B requests, T tokens, its wall seconds."""
        if batch <= 0 or tokens <= 0 or not seconds > 0:
            return
        decay = 1.0 - 1.0 / self.window
        x = self._x(batch, tokens)
        self._xtx = decay * self._xtx + np.outer(x, x)
        self._xty = decay * self._xty + x * seconds
        self._n = decay * self._n + 1.0
        self._line = None

    @property
    def is_known(self) -> bool:
        return self.num_prior_points > 0 or self._n >= 3

    @property
    def line(self) -> CostLine | None:
        """The current fit; None until anything was seen."""
        if self._line is None and self.is_known:
            if self.num_prior_points:
                xtx = self._xtx + np.diag(self._precision)
                xty = self._xty + self._precision * self._prior
            else:
                scale = max(float(np.trace(self._xtx)), 1.0)
                xtx, xty = self._xtx + np.diag([0.0, 1.0, 1.0]) * RIDGE * scale, self._xty
            self._line = CostLine(*_nonnegative_fit(xtx, xty))
        return self._line

    def predict(self, batch: float, tokens: float) -> float | None:
        line = self.line
        return None if line is None else line(batch, tokens)

    @property
    def seconds_per_token(self) -> float:
        """c_tok: what one more verified token adds to the forward (0 while unknown)."""
        line = self.line
        return 0.0 if line is None else line.c_tok

    def describe(self) -> dict | None:
        line = self.line
        if line is None:
            return None
        return {"c0_ms": round(line.c0 * 1e3, 4), "per_request_ms": round(line.c_req * 1e3, 4),
                "per_token_ms": round(line.c_tok * 1e3, 4), "prior_points": self.num_prior_points,
                "observations": round(self._n, 1)}


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
