"""Sampling parameters of one request: validated by the coordinator (no torch), carried on the wire as is."""

from __future__ import annotations

import math

import msgspec

MIN_TEMPERATURE = 1e-2  # below this, logits / T overflows fp32 softmax; such a request is treated as greedy
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        """Raise ValueError on anything a worker could choke on; returns self (normalised) when valid."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise ValueError("top_k must be a non-negative integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise ValueError("seed must be a 64-bit integer")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} characters")
            if not is_encodable(s):
                raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM does: a vanishing temperature is greedy decoding, not a softmax that overflows.
            return msgspec.structs.replace(self, temperature=0.0)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def is_encodable(text: str) -> bool:
    """True when text can be encoded as UTF-8 (JSON can carry lone surrogates that UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
