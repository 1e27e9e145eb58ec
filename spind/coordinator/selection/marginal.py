"""Selection by the batch's goodput: arms that maximise the slot's committed tokens per second, not each request's.

A slot's requests share one verify forward, whose seconds grow with the tokens it carries (`cost.py`). So a
request's drafts lengthen every request's slot, and a sum of per-request goodputs (each request's tokens over
the shared slot) never charges a request for the time it adds to the others'. The batch's goodput is

    G(a) = sum_i E[committed_i(a_i)] / S(a),   S(a) = S_0 + sum_i cost_i(a_i),

S_0 the slot with every request chosen for decoding plainly, cost_i(a) = E[drafted_i(a)] * (c_tok + delta_j)
the seconds its drafts add: c_tok per verified token, delta_j per drafted token on drafter j's worker (charged
in full to each request, an upper bound where a drafter batches several). Maximising a ratio over an
assignment is Dinkelbach's method: at a price G (tokens per second of slot), the best assignment maximises

    sum_i  w_i(a_i),   w_i(a) = E[committed_i(a)] - G * cost_i(a)   (the request's marginal gain, in tokens)

which is a maximum-weight matching under the drafters' capacities (`matching.py`, the paper's Kuhn-Munkres);
then G is re-priced at that assignment, and the two repeat until the assignment stops changing (superlinear;
2-3 rounds in practice). Plain decoding's weight is exactly 1: a request speculates only where what its drafts
add in expected tokens beats what they cost everyone at the batch's current rate. So a batch where no drafts
pay gets none; one where a single request's pay gets exactly that one; at batch 1 it is the request's own
goodput argmax. Capacities, unknown arms (weight -inf: exploit only what was observed) and the switching
penalty are applied as the caller's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spind.coordinator.selection.arms import ArmSet
from spind.coordinator.selection.matching import max_weight_assignment

MAX_ROUNDS = 8


@dataclass(frozen=True)
class BatchChoice:
    arms: np.ndarray  # [n] arm index per request
    weights: np.ndarray  # [n, A] marginal gains at the final price
    price: float  # G: the batch's expected tokens per second at that assignment


def choose(committed: np.ndarray, cost_s: np.ndarray, adjust: np.ndarray, arm_set: ArmSet,
           room: dict[str | None, int | None], base_s: float, base_tokens: float = 0.0,
           unknown_weight: float = -1e6) -> BatchChoice:
    """Dinkelbach over the matching.

    committed, cost_s: [n, A] each request's expected tokens per slot and added slot seconds per arm (nan =
    unknown: never chosen); adjust: [n, A] tokens added to the weight (minus a switching penalty); room: free
    capacity per drafter; base_s: S_0, the slot's seconds with these n requests plain (and the others in the
    batch as they are); base_tokens: what the others in the batch are expected to commit.
    """
    rows = np.arange(committed.shape[0])
    arms = np.zeros(len(rows), dtype=np.int64)  # plain decoding
    if base_s <= 0:  # no slot cost to price drafts against: decode plainly, never slower than not speculating
        return BatchChoice(arms, np.where(np.isnan(committed), unknown_weight, committed + adjust), 0.0)
    base_s, base_tokens = float(base_s), float(base_tokens)
    price = (base_tokens + float(committed[rows, arms].sum())) / base_s
    for _ in range(MAX_ROUNDS):
        w = committed - price * cost_s  # the marginal gains at this price
        w = np.where(np.isnan(w), unknown_weight, w + adjust)
        new = max_weight_assignment(w, arm_set, room)
        price_new = (base_tokens + float(committed[rows, new].sum())) / (base_s + float(cost_s[rows, new].sum()))
        if np.array_equal(new, arms) or price_new <= price:
            arms = new if price_new >= price else arms
            break
        arms, price = new, price_new
    return BatchChoice(arms, w, float(price))
