"""Training an EAGLE-3 head on the target's own answers, with training-time test (EAGLE-3's TTT).

Entry p of a sequence is (token p, the target's features at p - 1) at RoPE position p; its output predicts token
p + 1. Drafting feeds the head its own output: so training unrolls `unroll` steps, step j's entry p being (token
p + j, step j - 1's output at entry p) at position p + j, predicting token p + j + 1. Its query sees what serving
would hold in the head's KV cache at that point: the target-fed entries up to p (causally, within the sequence)
and its own entries at p for steps 1..j (`ttt_attention`). Step j's loss (cross-entropy against the target's own
next token, where that token is in the draft vocabulary) weighs `decay ** j`; only answer tokens are scored.

Checkpoints (`ckpt-*.pt`: head, optimizer, schedule, data order and RNG) are written every `save_every` steps and
on exit; a rerun resumes from the newest. Acceptance on the held-aside sequences is reported as the chance that
draft position j is accepted under greedy chain drafting (every earlier one accepted), measured by the same
unrolled forward with the head's own argmax tokens fed back.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spind.models.eagle import EagleConfig, EagleHead
from spind.train.data import Sequence
from spind.train.settings import TrainSettings


def bf16_fast() -> bool:
    """Whether this CPU has bfloat16 matmul units (AVX-512 BF16 or AMX): there autocast halves training time."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def draft_vocabulary(seqs: list[Sequence], size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ascending ids): EAGLE-3's truncated draft vocabulary."""
    counts = Counter(t for s in seqs for t in s.answer)
    top = [t for t, _ in counts.most_common(size)]
    if len(top) < size:  # a tiny corpus: pad with the lowest unused ids
        used = set(top)
        top += [t for t in range(size * 2) if t not in used][: size - len(top)]
    return torch.tensor(sorted(top), dtype=torch.long)


def ttt_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], doc: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Step j = len(qs) - 1's attention output [n, H, D]: its query at entry p over step 0's keys at entries
    p' <= p of the same sequence (doc ids [n], each sequence contiguous) and over steps 1..j's keys at entry p
    itself. Computed per sequence (a packed batch's cross-sequence scores would be wasted work)."""
    q = qs[-1]
    heads = q.shape[1]
    rep = heads // ks[0].shape[1]
    # steps 1..j: each entry's own keys, one score per head and step
    diag = [(q * k.repeat_interleave(rep, 1)).sum(-1) * scale for k in ks[1:]]  # [n, H] each
    outs = []
    start = 0
    for length in torch.unique_consecutive(doc, return_counts=True)[1].tolist():
        sl = slice(start, start + length)
        qd = q[sl].transpose(0, 1)  # [H, L, D]
        k0 = ks[0][sl].repeat_interleave(rep, 1).transpose(0, 1)
        v0 = vs[0][sl].repeat_interleave(rep, 1).transpose(0, 1)
        scores = (qd @ k0.transpose(1, 2)) * scale  # [H, L, L]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        extra = [d[sl].T[..., None] for d in diag]  # [H, L, 1] each
        probs = torch.cat([scores, *extra], -1).softmax(-1)
        out = probs[..., :length] @ v0  # [H, L, D]
        for i, v in enumerate(vs[1:]):
            out = out + probs[..., length + i, None] * v[sl].repeat_interleave(rep, 1).transpose(0, 1)
        outs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outs)


@dataclass
class Packed:
    tokens: torch.Tensor  # [n] the sequences' tokens, concatenated
    features: torch.Tensor  # [n, width] fp32: row p, the target's features after token p
    positions: torch.Tensor  # [n] within each sequence
    doc: torch.Tensor  # [n] sequence index
    scored: torch.Tensor  # [n] bool: token p is an answer token (its prediction is scored)


def pack(seqs: list[Sequence], feats: list[torch.Tensor]) -> Packed:
    tokens, features, positions, doc, scored = [], [], [], [], []
    for i, (s, f) in enumerate(zip(seqs, feats)):
        n = len(s.tokens)
        tokens.append(torch.tensor(s.tokens))
        features.append(f.float())
        positions.append(torch.arange(n))
        doc.append(torch.full((n,), i))
        scored.append(torch.arange(n) >= len(s.prompt))
    return Packed(torch.cat(tokens), torch.cat(features), torch.cat(positions), torch.cat(doc), torch.cat(scored))


def unrolled(head: EagleHead, p: Packed, steps: int, greedy: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step j: (draft-vocab logits [n, V_d] of entry p, i.e. predicting token p + j + 1, and that token's
    index in the shifted frame: the target token id, or -1 past the sequence's end). Entries p >= 1 only: entry p
    reads the features at p - 1, so row p here is entry p + 1. `greedy`: feed back the head's own argmax tokens
    (acceptance measurement) instead of the target's."""
    n = p.tokens.shape[0] - 1
    first_doc = p.doc[1:] == p.doc[:-1]  # entry p + 1 is in the same sequence as features p
    # a sequence's first token reads the previous sequence's last features: an entry serving never has (its
    # entries start at position 1), so it goes in an attention block of its own, which nothing else reads
    doc = torch.where(first_doc, p.doc[1:], -1 - p.doc[1:])
    hidden = head.hidden_in(p.features[:-1])  # [n, h]
    tok = p.tokens[1:]
    pos = p.positions[1:]
    qs, ks, vs, out = [], [], [], []
    for j in range(steps):
        q, k, v, residual = head.qkv(tok, hidden, pos + j)
        qs.append(q), ks.append(k), vs.append(v)
        hidden = head.finish(ttt_attention(qs, ks, vs, doc, head.scale), residual)
        logits = head.logits(hidden)
        shift = j + 1  # the target token this step predicts, for entry p + 1: token p + 1 + shift
        idx = torch.arange(n) + 1 + shift
        valid = (idx < p.tokens.shape[0])
        idx_c = idx.clamp(max=p.tokens.shape[0] - 1)
        valid &= p.doc[idx_c] == p.doc[1:]
        valid &= first_doc
        label = torch.where(valid, p.tokens[idx_c], torch.full_like(idx_c, -1))
        out.append((logits, label))
        if greedy:
            tok = head.to_target_ids(logits.argmax(-1))
        else:
            tok = torch.where(valid, p.tokens[idx_c], tok)
    return out


class Trainer:
    def __init__(self, head: EagleHead, seqs: list[Sequence], features, out_dir: Path,
                 settings: TrainSettings, log=print) -> None:
        self.head, self.features, self.out_dir, self.s, self.log = head, features, Path(out_dir), settings, log
        self.train = [s for s in seqs if not s.held_out]
        self.held = [s for s in seqs if s.held_out][: settings.eval_sequences]
        vocab = head.cfg.draft_vocab_size
        self.t2d = torch.full((head.target_vocab,), -1, dtype=torch.long)
        self.t2d[head.d2t] = torch.arange(vocab)
        params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95))
        self.step = 0
        self.order: list[int] = []
        self.cursor = 0
        self.history: list[dict] = []

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint_path(self) -> Path | None:
        found = sorted(self.out_dir.glob("ckpt-*.pt"))
        return found[-1] if found else None

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"ckpt-{self.step:07d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "d2t": self.head.d2t, "opt": self.opt.state_dict(),
                    "step": self.step, "order": self.order, "cursor": self.cursor, "history": self.history,
                    "settings": asdict(self.s), "rng": torch.get_rng_state()}, tmp)
        tmp.replace(path)
        for old in sorted(self.out_dir.glob("ckpt-*.pt"))[:-2]:  # keep the last two
            old.unlink()

    def resume(self) -> bool:
        path = self.checkpoint_path()
        if path is None:
            return False
        state = torch.load(path, weights_only=False)
        self.head.load_state_dict(state["head"])
        self.head.d2t = state["d2t"]
        self.opt.load_state_dict(state["opt"])
        self.step, self.order, self.cursor = state["step"], state["order"], state["cursor"]
        self.history = state["history"]
        torch.set_rng_state(state["rng"])
        self.log(f"train: resumed from {path.name} (step {self.step})")
        return True

    # ---- the loop ------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        s = self.s
        if step < s.warmup:
            return s.lr * (step + 1) / s.warmup
        frac = (step - s.warmup) / max(1, s.steps - s.warmup)
        return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def next_batch(self) -> list[Sequence]:
        batch, total = [], 0
        while True:
            if self.cursor >= len(self.order):
                self.order = list(range(len(self.train)))
                random.Random(self.s.seed + self.step).shuffle(self.order)
                self.cursor = 0
            s = self.train[self.order[self.cursor]]
            if batch and total + len(s.tokens) > self.s.tokens_per_step:
                return batch
            batch.append(s)
            total += len(s.tokens)
            self.cursor += 1
            if total >= self.s.tokens_per_step:
                return batch

    def loss(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[float]]:
        p = pack(seqs, self.features.get(seqs))
        scored = p.scored
        total, accs = 0.0, []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.s.bf16):
            steps = unrolled(self.head, p, self.s.unroll)
        for j, (logits, label) in enumerate(steps):
            logits = logits.float()
            target = self.t2d[label.clamp(min=0)]
            idx = torch.arange(label.shape[0]) + 1 + j + 1
            ok = (label >= 0) & (target >= 0) & scored[idx.clamp(max=scored.shape[0] - 1)]
            if ok.any():
                total = total + self.s.decay ** j * F.cross_entropy(logits[ok], target[ok])
                accs.append(float((logits[ok].argmax(-1) == target[ok]).float().mean()))
            else:
                accs.append(float("nan"))
        return total, accs

    def run(self) -> None:
        s = self.s
        self.head.train().requires_grad_(True)
        start, start_step = time.perf_counter(), self.step
        tokens = 0
        while self.step < s.steps:
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.step)
            seqs = self.next_batch()
            loss, accs = self.loss(seqs)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.opt.step()
            self.step += 1
            tokens += sum(len(x.tokens) for x in seqs)
            spent = time.perf_counter() - start
            rate = (self.step - start_step) / spent
            self.log(f"train: step {self.step}/{s.steps} loss {float(loss.detach()):.3f} top-1 by step "
                     f"{' '.join(f'{a:.2f}' for a in accs)} | {tokens / spent:.0f} tok/s, "
                     f"eta {(s.steps - self.step) / rate / 60:.0f} min")
            if self.step % s.save_every == 0 or self.step == s.steps:
                self.save()
            if self.held and (self.step % s.eval_every == 0 or self.step == s.steps):
                acc = self.evaluate()
                self.history.append({"step": self.step, "loss": float(loss.detach()), "acceptance": acc})
                self.log(f"eval: step {self.step} acceptance by draft position {' '.join(f'{a:.3f}' for a in acc)}"
                         f"; mean accepted of 4 drafts {sum(acc):.2f}")
                self.save()
        self.head.eval().requires_grad_(False)

    @torch.no_grad()
    def evaluate(self, positions: int = 4) -> list[float]:
        return acceptance(self.head, self.held, self.features, positions)


@torch.no_grad()
def acceptance(head: EagleHead, seqs: list[Sequence], features, positions: int = 4) -> list[float]:
    """P(draft position j accepted) under greedy chain drafting from every answer position of `seqs`: position j
    counts when the head's own argmax chain matches the target's next j + 1 tokens."""
    was = head.training
    head.eval()
    hits = torch.zeros(positions)
    count = 0
    for i in range(0, len(seqs), 8):
        group = seqs[i:i + 8]
        p = pack(group, features.get(group))
        steps = unrolled(head, p, positions, greedy=True)
        # entry p + 1 drafts from position p + 1 on, after the target committed token p + 1: score answer starts
        base = p.scored[1:] & (steps[0][1] >= 0)
        alive = base.clone()
        for j, (logits, label) in enumerate(steps):
            right = head.to_target_ids(logits.argmax(-1)) == label
            alive = alive & right & (label >= 0)
            hits[j] += float(alive.sum())
        count += int(base.sum())
    head.train(was)
    return (hits / max(1, count)).tolist()


def new_head(target_args, draft_vocab: torch.Tensor, feature_layers: tuple[int, ...]) -> EagleHead:
    """A fresh EAGLE-3 head for `target_args` (the target's own layer shape)."""
    import dataclasses

    args = dataclasses.replace(target_args, num_layers=1)
    cfg = EagleConfig("eagle3", args, len(draft_vocab), feature_layers)
    head = EagleHead(cfg, target_args.vocab_size)
    head.d2t = draft_vocab.clone()
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return head
