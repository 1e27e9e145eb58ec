"""A request's state on the coordinator: its token sequence, stop rules and incremental text, and where it is in
the pipeline's cycle (`Stage`).

Per-slot work is proportional to what the slot added, never to the output so far: tokens are appended to
one list, text is detokenized incrementally over a small window, and stop strings are searched only in
the new text (plus the few characters before it that a stop string could straddle).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import msgspec

from spind import protocol as P
from spind.coordinator.interface import EngineRequest
from spind.coordinator.selection.protocol import Arm
from spind.draft_cut import CutRule
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer


@dataclass
class SpecStats:
    num_steps: int = 0  # time slots (verification forwards) this request took part in
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: drafts accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if len(self.accepted_at) < num_drafted:
            self.accepted_at.extend([0] * (num_drafted - len(self.accepted_at)))
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification step (accepted + the recovered/bonus one)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


class IncrementalDetokenizer:
    """Text of a growing token list, one small decode per token: the text between `prefix_offset` and the
    end, minus the already-emitted text between `prefix_offset` and `read_offset` (as vLLM does). A token
    that ends in an incomplete UTF-8 character emits nothing until the character completes. Offsets are
    absolute indices into the list; decoding starts at `start` (the first output token)."""

    def __init__(self, tokenizer: Tokenizer, start: int) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = start
        self.read_offset = start

    def step(self, ids: list[int], final: bool = False) -> str:
        """New text after ids grew; final=True also flushes a trailing incomplete character."""
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self.prefix_offset:self.read_offset])
        new_text = decode(ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return new_text[len(prefix_text):]
        return ""


class Sequence:
    """Token ids (prompt + output in one list), output text, finish reason, stop rules."""

    def __init__(self, req_id: str, prompt_ids: list[int], params: SamplingParams, eos_token_ids: frozenset[int],
                 max_model_len: int, tokenizer: Tokenizer | None) -> None:
        self.req_id = req_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.text = ""  # decoded output, cut at a stop string
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stats = SpecStats()
        self._detok = IncrementalDetokenizer(tokenizer, len(self.token_ids)) if tokenizer is not None else None
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def max_draft(self, k: int) -> int:
        """Drafts worth proposing now: never past max_tokens or the context limit."""
        left = self.params.max_tokens - self.num_output_tokens - 1
        room = self.max_model_len - len(self.token_ids)
        return max(0, min(k, left, room))

    def append(self, new_ids: list[int]) -> list[int]:
        """Commit verified tokens, honouring EOS, stop strings, max_tokens and the context limit, one token at
        a time as plain decoding would. Returns the ids kept (a prefix of new_ids)."""
        kept: list[int] = []
        for tok in new_ids:
            if tok in self.eos_token_ids and not self.params.ignore_eos:
                self.finish_reason = "stop"  # EOS ends the output; it is not part of it
                break
            self.token_ids.append(tok)
            kept.append(tok)
            if self._detok is not None and self._add_text():
                self.finish_reason = "stop"
                return kept  # the text ends before the stop string; nothing more to flush
            if self.num_output_tokens >= self.params.max_tokens or len(self.token_ids) >= self.max_model_len:
                self.finish_reason = "length"
                break
        if self.is_finished and self._detok is not None:
            self.text += self._detok.step(self.token_ids, final=True)
        return kept

    def _add_text(self) -> bool:
        """Decode the newest token; True (and the text cut before it) when a stop string completed."""
        before = len(self.text)
        self.text += self._detok.step(self.token_ids)
        if not self.params.stop or len(self.text) == before:
            return False
        lo = max(0, before - self._max_stop + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True


def output_logprobs(tokenizer: Tokenizer | None, token_ids: list[int],
                    raw: list[P.TokenLogprobs]) -> list[P.OutputLogprobs]:
    """The target's per-token log-probabilities with each token's text and bytes, for the client."""
    def entry(token_id: int, logprob: float) -> P.Logprob:
        if tokenizer is None:
            return P.Logprob(token_id, "", b"", logprob)
        return P.Logprob(token_id, tokenizer.token_text(token_id), tokenizer.token_bytes(token_id), logprob)

    return [P.OutputLogprobs(entry(tok, t.logprob), [entry(i, v) for i, v in zip(t.top_ids, t.top_logprobs)])
            for tok, t in zip(token_ids, raw, strict=True)]


def choice_id(req_id: str, index: int) -> str:
    """The request id of completion `index` > 0 of a request (n > 1); completion 0 keeps the request's own."""
    return f"{req_id}/{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s parameters: a seeded request's completions each draw from a random stream of their own,
    derived from the seed (completion 0 keeps it: n = 1 and choice 0 of n = 4 give the same output)."""
    if params.seed is None or index == 0:
        return params
    mixed = (params.seed + index * 0x9E3779B97F4A7C15) % 2**64  # a golden-ratio step: no two choices collide
    return msgspec.structs.replace(params, seed=mixed - 2**64 if mixed >= 2**63 else mixed)


def prompt_repetition(ids: list[int], n: int = 3) -> float:
    """Share of the prompt's n-grams that already occurred earlier in it: a cheap signal that the output
    may copy its context (where n-gram lookup drafts well). O(len(ids))."""
    if len(ids) <= n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(ids) - n + 1)


class Stage(enum.Enum):
    """Where a running request is in its cycle: select -> draft -> verify. The pipeline moves each request through
    it on its own; a lockstep slot takes every request through the whole cycle within the slot, so between slots
    they are all READY."""

    READY = "ready"  # no arm for its next cycle yet (new, or its last verify ended)
    SELECTED = "selected"  # has its cycle's arm; waits for its drafter worker (or, needing no draft, for the target)
    DRAFTING = "drafting"  # in a Propose in flight
    DRAFTED = "drafted"  # its draft waits for the next verify pass
    VERIFYING = "verifying"  # in the verify pass in flight
    AWAITING_AHEAD = "awaiting_ahead"  # verified; the draft ahead of that verify is still in flight

    @property
    def is_in_flight(self) -> bool:
        """In a worker op that is still running: its state may change when the op lands."""
        return self in (Stage.DRAFTING, Stage.VERIFYING, Stage.AWAITING_AHEAD)


@dataclass
class Ahead:
    """A draft ahead: drafted past the draft under verification, on the guess that the verify accepts all of it."""

    assume: list[int]  # the draft under verification it was drafted past
    draft: P.DraftRecord | None = None  # None while its Propose is in flight
    committed: list[int] | None = None  # what the verify committed, when it ended before the draft ahead landed


@dataclass
class RequestState:
    req: EngineRequest
    seq: Sequence
    num_blocks: int  # target KV blocks reserved while running
    queue: asyncio.Queue  # Delta items, the last one has finish_reason set
    prompt_repetition: float = 0.0
    arrival: float = field(default_factory=time.perf_counter)
    status: str = "waiting"  # waiting | running | finished
    arm: Arm | None = None  # arm of the last slot it ran in
    num_target_kv: int = 0  # committed tokens whose KV the target holds (all but the newest once prefilled)
    num_cached_tokens: int = 0  # of its prompt, tokens whose KV the target's prefix cache held (not prefilled)
    synced: dict[str, int] = field(default_factory=dict)  # worker -> committed tokens its mirror holds
    precomputed: set[str] = field(default_factory=set)  # drafters asked to precompute this request's KV
    shadow: list[str] = field(default_factory=list)  # free drafters its next verify drafts shadow drafts of
    cut: CutRule | None = None  # where its next inline draft stops paying (`Selector.cut_rule`); None: no cut
    select_s: float = 0.0  # its share of the coordinator's seconds selecting its next slot (SlotFeedback.select_s)
    per_drafter: dict[str, SpecStats] = field(default_factory=dict)  # this request's counts per drafter
    num_streamed_chars: int = 0
    first_token_at: float | None = None
    is_abort_requested: bool = False
    finish_detail: str = ""
    draft_s: float = 0.0  # drafting and verification time of the batches it took part in
    verify_s: float = 0.0
    arms_used: list[str] = field(default_factory=list)  # the arm of each slot it was verified in ("none" too)
    # its cycle (the pipeline's; see Stage)
    stage: Stage = Stage.READY
    cycle_arm: Arm | None = None  # the arm of its current cycle (SELECTED .. AWAITING_AHEAD)
    draft: P.DraftRecord | None = None  # DRAFTED: the draft for its next verify pass
    ahead: Ahead | None = None  # its draft ahead, while one is in flight or waits to be used
    # n > 1: the completions of one prompt share a queue; each is a request of its own, `index` its choice
    index: int = 0
    leader: "RequestState | None" = None  # choice 0, whose prefilled KV the others share (None for choice 0)
    fork_of: "RequestState | None" = None  # the leader while this waits for its prefill, to share its KV
    forks: list["RequestState"] = field(default_factory=list)  # (leader) the choices waiting for its prefill

    def reset_cycle(self) -> None:
        """Back to READY with no arm, draft or draft ahead (its workers restarted, or its cycle ended)."""
        self.stage, self.cycle_arm, self.draft, self.ahead = Stage.READY, None, None, None

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def is_prefilled(self) -> bool:
        """The target holds KV for every committed token but the newest: it can verify."""
        return self.num_target_kv >= len(self.seq.token_ids) - 1

    @property
    def num_prefill_left(self) -> int:
        return max(0, len(self.seq.token_ids) - 1 - self.num_target_kv)
