"""A worker that speaks the real protocol over a deterministic arithmetic "model", for coordinator unit tests
that run in milliseconds (the issue's in-process fake worker).

The target's next token after a sequence is `truth(tokens)`; the drafters propose from it with known
quality: `good` always right, `bad` always wrong, `half` right for the first half of its draft. It keeps
the same state a real worker keeps (mirrors, the target's KV length, what each drafter holds) and checks
the same invariants (mirror lengths, prefill bounds, verify only once prefilled), so a coordinator bug
shows up as an ErrorReply or a wrong token. `fail_verify_of` names requests whose data "breaks" a verify:
the op fails naming them and changes nothing, as the real TargetVerifier does. Every op is logged.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from spind import protocol as P

VOCAB = 50
EOS = 0
SHADOW_S = 0.0005  # every verify reports this much shadow drafting (Verified.shadow_s)
FUSED_S = 0.004  # a verify with prefill chunks: one forward this long (3 ms without them)


def truth(tokens: list[int]) -> int:
    """The target's greedy next token (never EOS, so outputs run to max_tokens)."""
    return (tokens[-1] * 7 + len(tokens) * 3) % (VOCAB - 1) + 1


def continuation(tokens: list[int], k: int) -> list[int]:
    out, seq = [], list(tokens)
    for _ in range(k):
        out.append(truth(seq))
        seq.append(out[-1])
    return out


class ScriptedFailure(Exception):
    """A request's data breaks the op (named in args[1:])."""


def draft(kind: str, tokens: list[int], k: int) -> list[int]:
    """good: all right; bad: all wrong; half and inl (the inline one): right for the first half."""
    right = continuation(tokens, k)
    good = {"good": k, "bad": 0, "half": (k + 1) // 2, "inl": (k + 1) // 2}[kind]
    return right[:good] + [t % (VOCAB - 1) + 1 for t in right[good:]]  # a wrong token is never the right one


def write_tokenizer(model_dir: Path) -> Path:
    """A word-level tokenizer over 't0'..'t49' (t0 = EOS), as tokenizer.json + configs, for the coordinator."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tk = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tk.pre_tokenizer = WhitespaceSplit()
    tk.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
    return model_dir


class ScriptedWorker:
    def __init__(self, name: str, drafters: list[str], is_target: bool,
                 draft_ms: dict[str, float] | None = None) -> None:
        self.name, self.drafters, self.is_target = name, drafters, is_target
        self.draft_ms = draft_ms or {}  # what Profile reports per draft token (default 1 ms)
        self.mirrors: dict[str, list[int]] = {}
        self.kv_len: dict[str, int] = {}  # target: committed tokens with KV
        self.limit: dict[str, int] = {}  # the longest each sequence may grow: prompt + max_tokens (its KV reservation)
        self.drafter_reqs: dict[str, set[str]] = {d: set() for d in drafters}
        self.precompute_queue: deque = deque()
        self.precomputed: list[tuple[str, str]] = []
        self.log: list[object] = []
        self.fail_verify_of: set[str] = set()
        self.poison: set[str] = set()  # requests whose presence breaks a verify without saying whose fault it is
        self.last_verify_ok = False  # a follow-on Verify runs only after one that succeeded (as the real worker)

    def ready(self, num_threads: int) -> P.Ready:
        return P.Ready(name=self.name, pid=os.getpid(), is_target=self.is_target, drafters=self.drafters,
                       max_model_len=4096, num_threads=num_threads, device="cpu", dtype="script")

    def answer(self, msg: object) -> object:
        self.log.append(msg)
        try:
            return self.handle(msg)
        except ScriptedFailure as e:
            return P.ErrorReply(msg.seq, f"{e.args[0]}", list(e.args[1:]))
        except Exception as e:
            return P.ErrorReply(msg.seq, f"{type(e).__name__}: {e}")

    def handle(self, msg: object) -> object:
        if isinstance(msg, P.AddRequest):
            assert msg.is_target == self.is_target
            self.mirrors[msg.req_id] = list(msg.tokens)
            self.kv_len[msg.req_id] = 0
            self.limit[msg.req_id] = len(msg.tokens) - msg.num_output + msg.params.max_tokens
            for reqs in self.drafter_reqs.values():
                reqs.discard(msg.req_id)
            return P.Ack(msg.seq)
        if isinstance(msg, P.Prefill):
            self._prefill(msg.items)
            return P.Prefilled(msg.seq, [0] * len(msg.items), [P.BusyInterval("prefill", 0.0, 0.001, len(msg.items))])
        if isinstance(msg, P.Propose):
            out = []
            for it in msg.items:
                self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
                out.append(P.DraftRecord(it.req_id, draft(it.drafter, self.mirrors[it.req_id] + it.assume, it.k), False,
                                         msg.slot, 0.002))
            return P.Proposed(msg.seq, out, [P.BusyInterval("draft", 0.0, 0.002, len(out), msg.items[0].drafter)])
        if isinstance(msg, P.Verify):
            if msg.follows and not self.last_verify_ok:
                raise ScriptedFailure(P.FOLLOW_REFUSED)
            self.last_verify_ok = False
            reply = self._verify(msg)
            self.last_verify_ok = True
            return reply
        if isinstance(msg, P.Precompute):
            for it in msg.items:
                self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
                self.precompute_queue.append((it.req_id, it.drafter))
            return P.Ack(msg.seq)
        if isinstance(msg, P.FreeRequests):
            for r in msg.req_ids:
                self.mirrors.pop(r, None)
                self.kv_len.pop(r, None)
                for reqs in self.drafter_reqs.values():
                    reqs.discard(r)
            return P.Ack(msg.seq)
        if isinstance(msg, P.ForgetFinished):  # its drafters keep nothing across requests
            return P.Ack(msg.seq)
        if isinstance(msg, P.Profile):  # a verify costs 2 ms + 0.5 ms a request; a draft token 1 ms (draft_ms)
            verify = {b: 2.0 + 0.5 * b for b in msg.batch_sizes} if self.is_target else {}
            return P.Profiled(msg.seq, {d: self.draft_ms.get(d, 1.0) for d in self.drafters}, verify)
        if isinstance(msg, P.Ping):
            return P.WorkerStats(seq=msg.seq, name=self.name, pid=os.getpid(), req_ids=sorted(self.mirrors), kv={},
                                 drafter_reqs={d: sorted(r) for d, r in self.drafter_reqs.items()}, ms_per_token={},
                                 num_precompute_queued=len(self.precompute_queue))
        raise ValueError(f"unexpected {type(msg).__name__}")

    def _sync(self, req_id: str, drafter: str, base_len: int, new_tokens: list[int]) -> None:
        m = self.mirrors[req_id]
        assert len(m) == base_len, f"{req_id}: mirror {len(m)} != base {base_len}"
        m.extend(new_tokens)
        self.drafter_reqs[drafter].add(req_id)

    def _prefill(self, items: list[P.PrefillItem]) -> None:
        for it in items:
            assert 0 < it.num_tokens and self.kv_len[it.req_id] + it.num_tokens < len(self.mirrors[it.req_id])
            self.kv_len[it.req_id] += it.num_tokens

    def _verify(self, msg: P.Verify) -> P.Verified:
        bad = [it.req_id for it in msg.items if it.req_id in self.fail_verify_of]
        if bad:
            raise ScriptedFailure("scripted failure", *bad)
        if any(it.req_id in self.poison for it in msg.items):
            raise RuntimeError("a forward failed")  # nobody named: the coordinator has to find out
        self._prefill(msg.prefill)  # the chunks riding in this verify's forward (as the real worker: only if it runs)
        results = []
        for it in msg.items:
            tokens = self.mirrors[it.req_id]
            assert self.kv_len[it.req_id] == len(tokens) - 1, f"{it.req_id}: verify before its prefill completed"
            d = draft(it.inline_drafter, tokens, it.k) if it.inline_drafter else it.draft
            assert len(tokens) + len(d) + 1 <= self.limit[it.req_id], f"{it.req_id}: a verify past its max_tokens"
            shadow = {n: draft(n, tokens, it.shadow_k) for n in it.shadow}  # before the tokens it commits
            right = continuation(tokens, len(d) + 1)
            n = 0
            while n < len(d) and d[n] == right[n]:
                n += 1
            new = d[:n] + [right[n]]
            tokens.extend(new)
            self.kv_len[it.req_id] = len(tokens) - 1
            results.append(P.VerifyResult(it.req_id, len(d), n, new, 0.001 if it.inline_drafter else 0.0,
                                          shadow=shadow))
        busy = [P.BusyInterval("verify", 0.0, 0.003, len(results))]
        if msg.prefill:  # one forward of FUSED_S, split by rows as the real worker splits it
            rows = sum(r.num_drafted + 1 for r in results)
            cut = FUSED_S * sum(it.num_tokens for it in msg.prefill) / (sum(it.num_tokens for it in msg.prefill) + rows)
            busy = [P.BusyInterval("prefill", 0.0, cut, len(msg.prefill)),
                    P.BusyInterval("verify", cut, FUSED_S, len(results))]
        return P.Verified(msg.seq, results, busy[-1].end - busy[-1].start, busy, shadow_s=SHADOW_S,
                          reused=[0] * len(msg.prefill))

    @property
    def has_idle_work(self) -> bool:
        return bool(self.precompute_queue)

    def run_idle_work(self, stop=None) -> None:
        self.run_precompute()

    def run_precompute(self) -> None:
        self.precomputed.append(self.precompute_queue.popleft())
