"""Sampling: `to_probs` keeps the right tokens, and verification preserves the target's distribution.

The distribution checks run the real `verify_stochastic` on a 6-token vocabulary, where the target
distribution is known exactly, and compare 10^5 emitted tokens against it with a chi-square test.
Seeds are fixed, so the tests are deterministic; the p-value bound only says how unlikely a pass
would be for a sampler that is off by a visible amount.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spind.worker.sampling import (LOGPROB_FLOOR, SamplingParams, argmax_rows, make_generator, sample, to_probs,
                                   token_logprobs, verify_greedy, verify_stochastic)

V = 6
NUM_DRAWS = 100_000
MIN_P_VALUE = 1e-3
PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)


# ---- to_probs ------------------------------------------------------------------------------------

def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(to_probs(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1))


def test_logit_bias_is_added_before_temperature_top_k_and_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.5, top_k=3, logit_bias=((0, -100.0), (3, 4.0))).validate()
    biased_logits = torch.tensor([[-98.0, 1.0, 0.0, 3.0, 0.5]])
    torch.testing.assert_close(to_probs(logits, params),
                               to_probs(biased_logits, SamplingParams(temperature=0.5, top_k=3)))
    assert to_probs(logits, params)[0, 0] == 0.0  # banned (and outside the top 3)
    assert torch.equal(to_probs(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1))  # none: as is


@pytest.mark.parametrize("bias", [((1, 101.0),), ((1, float("nan")),), ((1, 1.0), (1, 2.0)), ((-1, 1.0),),
                                  ((1.5, 1.0),), ((1, True),), tuple((i, 1.0) for i in range(301))])
def test_bad_logit_bias_is_refused(bias: tuple) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias).validate()


def test_token_logprobs_are_the_raw_log_softmax_with_the_best_alternatives_first() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 3.0, 1.0, 1.0, -2.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
    got = token_logprobs(logits, [4, 1], 3)  # two committed tokens: the third row is not read
    ref = logits[:2].double().log_softmax(-1)
    assert len(got) == 2
    for (chosen, ids, values), row, tok in zip(got, ref, [4, 1]):
        assert chosen == pytest.approx(float(row[tok]), abs=1e-6)
        assert ids == row.argsort(descending=True)[:3].tolist()
        assert values == pytest.approx(row[ids].tolist(), abs=1e-6)
    assert token_logprobs(logits, [0], 0) == [(pytest.approx(float(ref[0, 0]), abs=1e-6), [], [])]
    assert token_logprobs(logits[:, :2], [0, 1], 20)[0][1] == [0, 1]  # no more alternatives than the vocabulary


def test_a_probability_that_underflows_reports_the_floor_not_minus_infinity() -> None:
    (chosen, _, values), = token_logprobs(torch.tensor([[0.0, float("-inf"), 1.0]]), [1], 3)
    assert chosen == LOGPROB_FLOOR and values[-1] == LOGPROB_FLOOR


@pytest.mark.parametrize("n", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_refused(n: object) -> None:
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=n).validate()


def test_speculative_sampling_follows_the_biased_target() -> None:
    """The target's biased distribution is what verification preserves, whatever the drafter's q (here the
    unbiased one, as a drafter that ignores the bias would propose)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g)
    params = SamplingParams(temperature=1.0, logit_bias=((2, 3.0), (4, -100.0))).validate()
    p, q = to_probs(logits, params), to_probs(logits, SamplingParams(temperature=1.0))
    gen = make_generator(5)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(30_000):
        draft = sample(q[0], gen)
        counts[verify_stochastic(p, [draft], q[:1], gen).tokens[0]] += 1
    assert counts[4] == 0
    assert _chi_square_p_value(counts, p[0].double().numpy()) > MIN_P_VALUE


def test_a_draft_cut_by_a_grammar_keeps_sampling_exact() -> None:
    """A grammar masks the target (p = 0 outside it); the drafter proposes from its unmasked q. A proposal the
    grammar refuses is cut before the verify, and its position samples from norm(max(p - q, 0)), as verifying it
    would have: the emitted tokens still follow p. (Sampling the bonus from p there instead would not: checked.)"""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, V, generator=g)
    allowed = torch.tensor([[True, False, True, True, False, True]])
    p = to_probs(logits.masked_fill(~allowed, float("-inf")), SamplingParams(temperature=1.0)).expand(2, V)
    q = to_probs(logits * 0.5, SamplingParams(temperature=1.0))  # puts mass on the refused tokens too
    gen = make_generator(9)
    exact, naive = np.zeros(V, dtype=np.int64), np.zeros(V, dtype=np.int64)
    for _ in range(40_000):
        x = sample(q[0], gen)
        if allowed[0, x]:
            tok = verify_stochastic(p, [x], q[:1], gen).tokens[0]
            exact[tok] += 1
            naive[tok] += 1
        else:  # cut: no draft left to verify, the cut proposal's row goes along
            exact[verify_stochastic(p[:1], [], None, gen, cut_q=q[0]).tokens[0]] += 1
            naive[verify_stochastic(p[:1], [], None, gen).tokens[0]] += 1
    assert exact[~allowed[0].numpy()].sum() == 0
    assert _chi_square_p_value(exact, p[0].double().numpy()) > MIN_P_VALUE
    assert _chi_square_p_value(naive, p[0].double().numpy()) < 1e-6


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, -0.2], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3, 4]
    assert (probs[1] > 0).nonzero().flatten().tolist() == [0, 1, 2]
    kept = logits[0, [1, 3, 4]].softmax(-1)
    torch.testing.assert_close(probs[0, [1, 3, 4]], kept)


@pytest.mark.parametrize("top_p, kept", [(0.45, [2]), (0.75, [2, 0]), (0.85, [2, 0, 3]),
                                         (0.99, [2, 0, 3, 1]), (1.0, [2, 0, 3, 1])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: list[int]) -> None:
    target = torch.tensor([0.3, 0.05, 0.5, 0.15])  # sorted: 0.5 (id 2), 0.3 (0), 0.15 (3), 0.05 (1)
    probs = to_probs(target.log()[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert set((probs > 0).nonzero().flatten().tolist()) == set(kept)
    torch.testing.assert_close(probs[kept], target[kept] / target[kept].sum())


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    target = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k=2 leaves {0: 4/7, 1: 3/7}; top-p=0.5 then needs only token 0
    probs = to_probs(target.log()[None], SamplingParams(temperature=1.0, top_k=2, top_p=0.5))[0]
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


# ---- greedy verification ------------------------------------------------------------------------

def _one_hot_logits(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_accepts_the_agreeing_prefix_then_recovers() -> None:
    res = verify_greedy(_one_hot_logits([3, 1, 4, 0]), [3, 1, 5])
    assert res.num_accepted == 2 and res.tokens == [3, 1, 4]


def test_greedy_bonus_after_full_acceptance_and_no_draft() -> None:
    assert verify_greedy(_one_hot_logits([3, 1, 2]), [3, 1]).tokens == [3, 1, 2]
    assert verify_greedy(_one_hot_logits([5]), []).tokens == [5]


# ---- stochastic verification: exact properties ----------------------------------------------------

def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))  # [rows, V]


def test_draft_with_p_at_least_q_is_always_accepted() -> None:
    p, q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]]), torch.tensor([[0.2, 0.8, 0, 0, 0, 0]])
    for seed in range(200):
        res = verify_stochastic(p, [0], q, make_generator(seed))
        assert res.num_accepted == 1 and res.tokens == [0, 2]


def test_rejected_draft_recovers_only_where_p_exceeds_q() -> None:
    p = torch.tensor([[0.0, 0.5, 0.3, 0.2, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    q = torch.tensor([[0.6, 0.1, 0.3, 0.0, 0, 0]])  # p - q > 0 only at tokens 1 and 3
    seen = {verify_stochastic(p, [0], q, make_generator(seed)).tokens[0] for seed in range(300)}
    assert seen == {1, 3}


def test_point_mass_draft_rejected_never_repeats_the_draft() -> None:
    p = torch.tensor([[0.2, 0.8, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    outs = [verify_stochastic(p, [0], None, make_generator(seed)) for seed in range(300)]
    assert {o.tokens[0] for o in outs if o.num_accepted == 0} == {1}
    assert {tuple(o.tokens) for o in outs if o.num_accepted == 1} == {(0, 0)}


# ---- stochastic verification: distribution of the first two emitted tokens --------------------------

class TwoStepWorld:
    """A target p(x0) p(x1 | x0) and a drafter q(x0) q(x1 | x0) (or a deterministic drafter: q = None)."""

    def __init__(self, seed: int, stochastic_drafter: bool, draft_vocab: list[int] | None = None) -> None:
        target0, target1 = _logits(seed, 1), _logits(seed + 1, V)  # row x0 of target1: logits of x1 | x0
        # the drafter approximates the target: its logits are the target's plus noise, so supports overlap
        draft0, draft1 = target0 + 0.8 * _logits(seed + 2, 1), target1 + 0.8 * _logits(seed + 3, V)
        if draft_vocab is not None:  # a draft head's truncated vocabulary (EAGLE-3): q is zero outside it
            outside = torch.ones(V, dtype=torch.bool)
            outside[draft_vocab] = False
            draft0, draft1 = draft0.masked_fill(outside, float("-inf")), draft1.masked_fill(outside, float("-inf"))
        # both sides go through to_probs with temperature, top-k and top-p, as the engine does
        self.p0, self.p1 = to_probs(target0, PARAMS)[0], to_probs(target1, PARAMS)  # p1[x0] = p(x1 | x0)
        self.q0, self.q1 = to_probs(draft0, PARAMS)[0], to_probs(draft1, PARAMS)
        self.bonus = torch.full((V,), 1.0 / V)
        self.stochastic_drafter = stochastic_drafter
        self.gen = make_generator(seed)

    def expected_joint(self) -> np.ndarray:
        return (self.p0[:, None] * self.p1).double().numpy()  # [V, V]

    def draft(self, dist: torch.Tensor) -> int:
        """A sampled draft, or the deterministic drafter's pick: its most likely token."""
        return sample(dist, self.gen) if self.stochastic_drafter else int(dist.argmax())

    def first_two_tokens(self) -> tuple[int, int]:
        """Draft two tokens and verify; if fewer than two were emitted, draft and verify the next one."""
        d0 = self.draft(self.q0)
        d1 = self.draft(self.q1[d0])
        q = torch.stack([self.q0, self.q1[d0]]) if self.stochastic_drafter else None
        res = verify_stochastic(torch.stack([self.p0, self.p1[d0], self.bonus]), [d0, d1], q, self.gen)
        if len(res.tokens) >= 2:
            return res.tokens[0], res.tokens[1]
        x0 = res.tokens[0]
        d1 = self.draft(self.q1[x0])
        q = self.q1[x0][None] if self.stochastic_drafter else None
        res = verify_stochastic(torch.stack([self.p1[x0], self.bonus]), [d1], q, self.gen)
        return x0, res.tokens[0]


def _chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value of counts against a distribution; 0 when a count falls where it has no mass
    (a token the target's top-k/top-p removed cannot be emitted at all)."""
    support = expected_probs > 0
    assert support.sum() >= 2, "a point-mass target would make the test vacuous"
    if observed[~support].sum():
        return 0.0
    expected = expected_probs[support] / expected_probs[support].sum() * observed.sum()
    return float(chisquare(observed[support], expected).pvalue)


@pytest.mark.parametrize("stochastic_drafter, draft_vocab", [(True, None), (False, None), (True, "half")],
                         ids=["q-sampled", "q-point-mass", "q-sampled-over-a-draft-vocabulary"])
def test_first_two_emitted_tokens_follow_the_target(stochastic_drafter: bool, draft_vocab: str | None) -> None:
    """The third case is an eagle head's: it drafts from its own vocabulary, half the target's here, so the
    target emits tokens the drafter can never propose, and must still emit them as often as p says."""
    world = TwoStepWorld(seed=11, stochastic_drafter=stochastic_drafter,
                         draft_vocab=None if draft_vocab is None else list(range(0, V, 2)))
    expected = world.expected_joint()
    assert (expected == 0).any() and not torch.allclose(world.p0, world.q0)  # top-k/p bite; q differs from p
    joint = np.zeros((V, V), dtype=np.int64)
    for _ in range(NUM_DRAWS):
        x0, x1 = world.first_two_tokens()
        joint[x0, x1] += 1
    assert _chi_square_p_value(joint.sum(1), expected.sum(1)) > MIN_P_VALUE  # first token: p(x0)
    assert _chi_square_p_value(joint.ravel(), expected.ravel()) > MIN_P_VALUE  # 2nd position: p(x0) p(x1|x0)


def test_chi_square_detects_a_biased_sampler() -> None:
    """The statistical check has teeth: sampling from the drafter's q instead of p is caught."""
    world = TwoStepWorld(seed=11, stochastic_drafter=True)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(20_000):
        counts[sample(world.q0, world.gen)] += 1
    assert _chi_square_p_value(counts, world.p0.double().numpy()) < MIN_P_VALUE


def test_argmax_rows_picks_what_torch_picks_ties_and_nans_included():
    """The verify's greedy picks go through numpy on the CPU (10x faster than torch's argmax): the first of equal
    maxima, a NaN taken as the maximum, in every dtype and over several tensors in order."""
    x = torch.randn(6, 4099)
    x[1, 10] = x[1, 20] = 50.0  # a tie: the first
    x[2, 7] = x[2, 3000] = float("nan")  # NaN wins, the first one
    x[3, :] = float("-inf")
    x[4, 4098] = 80.0
    assert argmax_rows(x) == x.argmax(-1).tolist()
    assert argmax_rows([x[:2], x[2:5], x[5:]]) == x.argmax(-1).tolist()
    for dtype in (torch.float16, torch.bfloat16):
        assert argmax_rows(x.to(dtype)) == x.to(dtype).argmax(-1).tolist()
    assert argmax_rows(x.t().contiguous().t()) == x.argmax(-1).tolist()  # not contiguous
