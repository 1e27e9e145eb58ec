"""A request's generation state and its stopping rules (pure; shared by the offline engine and the daemon)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spind.models.tokenizer import Tokenizer
from spind.sampling import SamplingParams


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


@dataclass
class Sequence:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""  # decoded output, cut at a stop string
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def max_draft(self, k: int) -> int:
        """Drafts worth proposing now: never past max_tokens or the context limit."""
        left = self.params.max_tokens - len(self.output_ids) - 1
        room = self.max_model_len - len(self.prompt_ids) - len(self.output_ids)
        return max(0, min(k, left, room))

    def append(self, new_ids: list[int], tokenizer: Tokenizer | None) -> list[int]:
        """Commit verified tokens, honouring EOS, max_tokens, stop strings and the context limit.
        Returns the ids actually kept (a prefix of new_ids): those one-token-at-a-time decoding would keep."""
        start = len(self.output_ids)
        kept = []
        for tok in new_ids:
            kept.append(tok)
            self.output_ids.append(tok)
            if tok in self.eos_token_ids and not self.params.ignore_eos:
                self.output_ids.pop()  # EOS ends the output; it is not part of the text
                kept.pop()
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens or len(self.tokens) >= self.max_model_len:
                self.finish_reason = "length"
                break
        if tokenizer is not None:
            self.text = tokenizer.decode(self.output_ids)
            if self.params.stop and self._find_stop(self.text) >= 0:
                self._stop_at_first_match(tokenizer, start)
        return kept[:len(self.output_ids) - start]

    def _find_stop(self, text: str) -> int:
        """Index of the earliest stop string in text; -1 if none."""
        return min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)

    def _stop_at_first_match(self, tokenizer: Tokenizer, start: int) -> None:
        """Drop the tokens after the one that completed a stop string (a verified chunk may run past it,
        plain decoding stops there); the text ends before the stop string."""
        for n in range(start + 1, len(self.output_ids) + 1):
            text = tokenizer.decode(self.output_ids[:n])
            cut = self._find_stop(text)
            if cut >= 0:
                del self.output_ids[n:]
                self.text = text[:cut]
                self.finish_reason = "stop"
                return
