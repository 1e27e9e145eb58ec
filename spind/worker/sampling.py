"""Lossless verification of drafted tokens and the sampling it needs (pure: numbers in, decisions out).

Terms (as in the speculative sampling papers):
- a *draft* is k tokens proposed by a drafter, with their proposal distributions q (or none: a point mass);
- *accepted* drafts are the longest prefix the target agrees with;
- the *recovered* token replaces the first rejected draft: sampled from norm(max(p - q, 0));
- the *bonus* token follows when all k drafts are accepted: sampled from the target's p at position k.
Each verification therefore emits `num_accepted + 1` tokens, and the emitted sequence has exactly the
distribution of sampling from the target alone (greedy: it is the target's argmax sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spind.params import SamplingParams


def make_generator(seed: int | None, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * 1_000_003 + salt) % (2**63))
    return g


def argmax_rows(rows: torch.Tensor | list[torch.Tensor]) -> list[int]:
    """Each row's argmax (the first of equal maxima, as torch's), in one list, of a [n, V] tensor or of several,
    in order. On the CPU through numpy, whose vectorised argmax reads a 49k-entry float32 row in ~4 us where torch's
    takes ~45 us: a verify picks one per row it carries (80 rows for a batch of 16 with 4 drafts each: 1.7 ms against
    0.25). On a device, one device->host copy for all of them (not a sync per tensor)."""
    parts = [rows] if isinstance(rows, torch.Tensor) else rows
    if all(x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad for x in parts):
        return [t for x in parts for t in x.detach().numpy().argmax(-1).tolist()]
    return torch.cat([x.argmax(-1) for x in parts]).tolist()


def biased(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] with the request's logit_bias added (the tensor itself when it has none)."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=logits.device)
    return logits.float().index_add(-1, ids, bias.expand(*logits.shape[:-1], len(ids)))


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after logit_bias, temperature, top-k and top-p (same for target and
    drafter)."""
    x = biased(logits, params).float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= params.top_p  # keep the smallest prefix with mass >= top_p
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


LOGPROB_FLOOR = -9999.0  # what a probability that underflows float32 reports (as vLLM does)


def token_logprobs(rows: torch.Tensor, tokens: list[int], num_top: int) -> list[tuple[float, list[int], list[float]]]:
    """Raw log-probabilities of committed tokens: rows [>= len(tokens), V] are the target's logits at the positions
    that chose them. Per token: its log-softmax value, and the ids and values of the `num_top` most likely tokens
    (most likely first). The model's own distribution, before logit_bias, temperature, top-k and top-p."""
    lp = torch.log_softmax(rows[:len(tokens)].float(), dim=-1).nan_to_num(neginf=LOGPROB_FLOOR)  # JSON has no -inf
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if not num_top:
        return [(c, [], []) for c in chosen]
    top = lp.topk(min(num_top, lp.shape[-1]), dim=-1)
    return list(zip(chosen, top.indices.tolist(), top.values.tolist()))


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    tokens: list[int]  # accepted drafts, then one recovered or bonus token


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> VerifyResult:
    """target_logits [k+1, V]: row i is the target's prediction for draft position i (row k: bonus)."""
    return accept_greedy(argmax_rows(target_logits), draft)


def accept_greedy(target: list[int], draft: list[int]) -> VerifyResult:
    """target: the target's argmax at each of the k + 1 positions (read from the device by the caller, batched)."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return VerifyResult(n, draft[:n] + [target[n]])


def verify_stochastic(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                      generator: torch.Generator, cut_q: torch.Tensor | None = None) -> VerifyResult:
    """Rejection sampling. p [k+1, V] target probs; q [k, V] drafter probs, or None for a point mass
    (a deterministic drafter such as n-gram lookup, for which q(x) = 1 at the drafted token).

    cut_q [V]: the draft went on past these k tokens with a token that p cannot produce (a grammar refused it, so it
    was cut before the verify), drafted from cut_q. That token is rejected for certain, so position k samples the
    recovered token from norm(max(p - cut_q, 0)), not the bonus from p: exactly what verifying it would have done."""
    k = len(draft)
    if k:
        rows, idx = torch.arange(k, device=p.device), torch.tensor(draft, device=p.device)
        p_x = p[rows, idx]
        q_x = torch.ones(k, device=p.device) if q is None else q[rows, idx]
        u = torch.rand(k, generator=generator).to(p.device)  # the generator lives on the CPU
        rejected = (u * q_x > p_x).nonzero()  # accept iff u < p/q, written without dividing by q
        n = int(rejected[0]) if len(rejected) else k
    else:
        n = 0
    if n == k and cut_q is None:
        return VerifyResult(k, draft + [sample(p[k], generator)])
    if n == k:
        return VerifyResult(k, draft + [_recover(p[k], cut_q, generator)])
    q_n = torch.zeros_like(p[n]).index_fill_(0, torch.tensor([draft[n]], device=p.device), 1.0) if q is None else q[n]
    return VerifyResult(n, draft[:n] + [_recover(p[n], q_n, generator)])


def _recover(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int:
    """The token that replaces a rejected draft: sampled from norm(max(p - q, 0)) (p itself where that is empty)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return sample(residual / total if total > 0 else p, generator)
