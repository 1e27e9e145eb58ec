"""Structured output: a request's grammar (`SamplingParams.grammar`) as llguidance compiles and enforces it.

llguidance (Microsoft's Rust grammar engine, the one behind vLLM's and SGLang's `guidance` backends) was chosen
over xgrammar because it needs neither torch nor transformers (the coordinator validates a grammar without loading
either), it builds its tokenizer from the model's own tokenizer.json, it compiles JSON schemas lazily (no
ahead-of-time compile of large schemas on the request path), and its matcher validates a run of draft tokens and
rolls back, which is what verifying speculative drafts under a grammar needs.

- `check_grammar` (front ends, off the event loop, then the engine at admission): a grammar that does not compile
  is the request's 400.
- `Grammars` (target worker): one matcher per request, advanced by what each verify commits. Before a verify
  forward it cuts each draft at its first token the grammar refuses (such drafts cost nothing) and gives the
  tokens the grammar forces next (`forced`: a JSON key), which may lengthen it; after the forward it masks every
  verified position's logits to the tokens the grammar allows there.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from spind.params import Grammar

GRAMMAR_KINDS = ("json_schema", "regex", "grammar")  # "grammar": Lark or GBNF (llama.cpp's EBNF)
# JSON between tokens: any whitespace, but at most 20 characters of it in a row, so that a model caught in a
# whitespace loop cannot spend its whole max_tokens inside one gap of valid JSON (a schema's own "x-guidance"
# options override this, as llguidance applies them after these defaults)
JSON_DEFAULTS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a matcher that left its grammar (a bug, not a sampling outcome)."""


@lru_cache(maxsize=256)
def to_llguidance(grammar: Grammar) -> str:
    """The llguidance grammar of a spind Grammar (cached: n completions and retries ask for the same one)."""
    import llguidance

    try:
        if grammar.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_DEFAULTS)
        fmt = {"regex": "regex", "grammar": "grammar"}[grammar.kind]
        return llguidance.grammar_from(fmt, grammar.text)
    except KeyError:
        raise GrammarError(f"unknown grammar kind {grammar.kind!r}; one of {', '.join(GRAMMAR_KINDS)}") from None
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the {grammar.kind.replace('_', ' ')} does not compile: {e}") from None


def check_grammar(grammar: Grammar) -> None:
    """Raise GrammarError unless llguidance compiles the grammar (without a tokenizer: the coordinator's check).
    A large grammar can take 100 ms or more to compile: front ends call this off the event loop first, and the
    engine's own call at admission then finds the answer cached."""
    error = _grammar_error(grammar)
    if error:
        raise GrammarError(error)


@lru_cache(maxsize=256)
def _grammar_error(grammar: Grammar) -> str:
    import llguidance

    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.text)
        except ValueError as e:
            return f"the JSON schema is not JSON: {e}"
        if not isinstance(schema, (dict, bool)):
            return "a JSON schema must be an object"
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(to_llguidance(grammar))
    except GrammarError as e:
        return str(e)
    return f"the {grammar.kind.replace('_', ' ')} does not compile: {messages[0]}" if is_error else ""


class Grammars:
    """The target worker's matchers, one per request with a grammar. The LLTokenizer is built on first use (~1 s
    for a 50k vocabulary), from the model's tokenizer.json, with one mask bit per row of the target's logits."""

    def __init__(self, tokenizer_json: Path, vocab_rows: int, eos_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_rows = vocab_rows
        self.eos_ids = sorted(eos_ids)
        self._tok = None
        self._executor = None
        self.matchers: dict = {}  # req_id -> llguidance.LLMatcher

    def _tokenizer(self):
        if self._tok is None:
            import llguidance

            self._tok = llguidance.LLTokenizer(self._tokenizer_json.read_text(), n_vocab=self.vocab_rows,
                                               eos_token=self.eos_ids or None)
            self._executor = llguidance.LLExecutor(num_threads=1)  # the worker's cores belong to the forward
            import torch

            # llguidance lets a finished grammar end on any special token; spind ends output only on EOS
            self._non_eos_special = torch.tensor([self._tok.is_special_token(i) and i not in self.eos_ids
                                                  for i in range(self.vocab_rows)])
        return self._tok

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def add(self, req_id: str, grammar: Grammar, output: list[int]) -> None:
        """A matcher for the request, past the output it already has (a re-prefill after a restart)."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), to_llguidance(grammar), log_level=0)
        if m.is_error():
            raise GrammarError(f"{req_id}: the grammar does not compile: {m.get_error()}")
        if not all(m.consume_token(t) for t in output):
            raise GrammarError(f"{req_id}: its output so far does not follow its grammar: {m.get_error()}")
        self.matchers[req_id] = m

    def fork(self, src: str, dst: str) -> None:
        if src in self.matchers:
            self.matchers[dst] = self.matchers[src].deep_copy()

    def free(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def valid_prefix(self, req_id: str, draft: list[int]) -> int:
        """How many of the draft's tokens the grammar allows in a row from the request's state."""
        return self.matchers[req_id].validate_tokens(draft) if draft else 0

    def forced(self, req_id: str, draft: list[int]) -> list[int]:
        """The tokens the grammar forces after the request's state and `draft` (valid): JSON's keys, quotes and
        punctuation between values. The matcher is left where it was."""
        m = self.matchers[req_id]
        if draft and not m.consume_tokens(draft):
            raise GrammarError(f"{req_id}: a draft that was validated was refused")
        try:
            return m.compute_ff_tokens()
        finally:
            if draft:
                m.rollback(len(draft))

    def allowed(self, items: list[tuple[str, list[int]]]):
        """Per (req_id, draft): a bool tensor [len(draft) + 1, vocab_rows] of the tokens the grammar allows at each
        verified position (row j: after the draft's first j tokens, which must be valid: see valid_prefix)."""
        import torch

        words = (self.vocab_rows + 31) // 32
        rows = [len(draft) + 1 for _, draft in items]
        bits = torch.zeros(sum(rows), words, dtype=torch.int32)  # llguidance's layout: bit i % 32 of word i // 32
        starts, at = [], 0
        for n in rows:
            starts.append(at)
            at += n
        self._tokenizer()
        # (not llguidance.torch's helpers: importing that module compiles a kernel with torch.compile, seconds)
        plain = [(self.matchers[r], s) for (r, d), s in zip(items, starts) if not d]
        drafted = [(self.matchers[r], s, d) for (r, d), s in zip(items, starts) if d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, len(bits))
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.data_ptr(), words * 4, len(bits))
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(len(bits), words * 32)[:, :self.vocab_rows]
        return list((allowed & ~self._non_eos_special).split(rows))

    def check(self, req_id: str, allowed) -> None:
        """Raise GrammarError (the request's alone) if its matcher failed or a verified position allows nothing."""
        m = self.matchers[req_id]
        if m.is_error():
            raise GrammarError(f"the grammar failed: {m.get_error()}")
        if not bool(allowed.any(-1).all()):
            raise GrammarError("the grammar allows no token at a verified position")

    def commit(self, req_id: str, tokens: list[int]) -> None:
        """Advance past committed tokens, up to the first EOS, where the output ends. Each was allowed by its mask;
        should the matcher still refuse one (a bug), it keeps its error state, which fails the request (alone) at
        its next verify (`check`): the verify that committed them has already changed the request's KV."""
        m = self.matchers[req_id]
        end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), None)
        # one by one: llguidance's consume_tokens refuses EOS on a matcher that stopped in an earlier call
        for t in tokens if end is None else tokens[:end + 1]:
            if not m.consume_token(t):
                break
