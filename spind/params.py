"""Sampling parameters of one request: validated by the coordinator (no torch), carried on the wire as is."""

from __future__ import annotations

import math

import msgspec

MIN_TEMPERATURE = 1e-2  # below this, logits / T overflows fp32 softmax; such a request is treated as greedy
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_GRAMMAR_CHARS = 1 << 16  # a JSON schema, regex or grammar's text
MAX_N = 128  # completions of one prompt (OpenAI's limit for n)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit, vLLM's default max_logprobs)


class Grammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured output (spind.grammar): the output must match it. kind: "json_schema" (text: the schema as JSON;
    OpenAI's json_object is the schema {"type": "object"}), "regex", or "grammar" (Lark or GBNF)."""

    kind: str
    text: str


def grammar_param(kind: object) -> str:
    """Where a grammar of `kind` sits in an OpenAI body, as error bodies name it: a JSON schema in
    response_format.json_schema.schema (json_object's too), a regex or grammar in the spind object."""
    return "response_format.json_schema.schema" if kind == "json_schema" else \
        f"spind.{kind}" if kind in ("regex", "grammar") else "spind.grammar"


class ParamError(ValueError):
    """A sampling parameter out of range, naming it (`param`: its name in the OpenAI body, as error bodies give it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def drafter_k_conflict(drafter: str, k: int | None) -> str | None:
    """Why a request's drafter and k contradict each other, or None. k = 0 drafts nothing: with a named drafter
    (or auto, which would pick one) it was once served silently as plain decoding; plain decoding is drafter "none"."""
    if k == 0 and drafter != "none":
        what = "auto selection" if drafter == "auto" else f"drafter {drafter!r}"
        return (f"k = 0 drafts no tokens, which contradicts {what}: give k >= 1 to draft, or drafter \"none\" for "
                f"plain decoding")
    return None


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # (token id, bias in [-100, 100]) pairs added to the target's logits before temperature, top-k and top-p (and to
    # a model drafter's, so its drafts follow the biased target): OpenAI's logit_bias, -100 bans a token
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no log-probabilities; n: each output token's log-probability under the target and its n most likely
    # alternatives (0 <= n <= MAX_LOGPROBS). Raw: the model's log-softmax, before logit_bias, temperature, top-k and
    # top-p (vLLM's default), so the values are those of plain decoding whichever drafter ran and however it sampled
    logprobs: int | None = None
    # the output follows this grammar: the target's distribution is masked to what it allows at every position, and
    # draft tokens it refuses are cut before the verify. Output that ends at max_tokens may be incomplete
    grammar: Grammar | None = None

    def validate(self) -> "SamplingParams":
        """Raise ValueError on anything a worker could choke on; returns self (normalised) when valid."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ParamError("max_tokens", "max_tokens must be a positive integer")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or not 0.0 <= self.temperature <= 100.0:
            raise ParamError("temperature", "temperature must be a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", "top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise ParamError("top_k", "top_k must be a non-negative integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise ParamError("seed", "seed must be a 64-bit integer")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop takes at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise ParamError("stop", f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} "
                                         f"characters")
            if not is_encodable(s):
                raise ParamError("stop", "stop strings must be valid Unicode (no lone surrogates)")
        self._validate_logit_bias()
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParamError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token)")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar) or self.grammar.kind not in ("json_schema", "regex", "grammar") \
                    or not isinstance(self.grammar.text, str) or not self.grammar.text:
                raise ParamError(grammar_param(getattr(self.grammar, "kind", None)),
                                 'a grammar needs a kind ("json_schema", "regex" or "grammar") and its text')
            if len(self.grammar.text) > MAX_GRAMMAR_CHARS:
                raise ParamError(grammar_param(self.grammar.kind),
                                 f"a grammar takes at most {MAX_GRAMMAR_CHARS} characters")
            if self.ignore_eos:
                raise ParamError("ignore_eos",
                                 "ignore_eos cannot go with a grammar: the output ends where the grammar does")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM does: a vanishing temperature is greedy decoding, not a softmax that overflows.
            return msgspec.structs.replace(self, temperature=0.0)
        return self

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        seen = set()
        for pair in self.logit_bias:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ParamError("logit_bias", "logit_bias must be (token id, bias) pairs")
            token, bias = pair
            if type(token) is not int or not 0 <= token < 2**31:
                raise ParamError("logit_bias", "logit_bias token ids must be integers in [0, 2**31)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ParamError("logit_bias",
                                 f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
            if token in seen:
                raise ParamError("logit_bias", f"logit_bias names token {token} twice")
            seen.add(token)

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
