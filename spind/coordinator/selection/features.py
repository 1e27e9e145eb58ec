"""Cheap request features: a request's context is (prompt-length bucket, prompt-repetition bucket).

Repetition is what matters most for prompt-lookup drafters (text that repeats its context is what they
copy); prompt length is the paper's own proxy for difficulty (the greedy baseline of §VII).
"""

from __future__ import annotations

import bisect

LENGTH_EDGES = (64, 256, 1024)  # prompt tokens: [0, 64) [64, 256) [256, 1024) [1024, inf)
REPETITION_EDGES = (0.1, 0.3)  # share of the prompt's 3-grams seen earlier in it: low, some, high
REPETITION_NAMES = ("low", "some", "high")
NUM_CONTEXTS = (len(LENGTH_EDGES) + 1) * (len(REPETITION_EDGES) + 1)


def context_of(num_prompt_tokens: int, prompt_repetition: float) -> int:
    """The request's context index in [0, NUM_CONTEXTS)."""
    length = bisect.bisect_right(LENGTH_EDGES, num_prompt_tokens)
    repetition = bisect.bisect_right(REPETITION_EDGES, prompt_repetition)
    return length * len(REPETITION_NAMES) + repetition


def context_name(context: int) -> str:
    """"prompt 64-256 tokens, repetition low" style, for describe()."""
    length, repetition = divmod(context, len(REPETITION_NAMES))
    lo, hi = (0, *LENGTH_EDGES)[length], (*LENGTH_EDGES, None)[length]
    span = f"{lo}-{hi}" if hi is not None else f">={lo}"
    return f"prompt {span} tokens, repetition {REPETITION_NAMES[repetition]}"
