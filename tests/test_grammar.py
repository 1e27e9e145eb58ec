"""Structured output's grammar layer (spind/grammar.py) on the default model's tokenizer: what a grammar allows at each
verified position, where it cuts a draft, and how committed tokens advance it. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spind.grammar import GrammarError, Grammars, check_grammar, to_llguidance
from spind.params import Grammar, SamplingParams
from spind.tokenizer import Tokenizer

SCHEMA = Grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def grammars(model_dir: Path, tok: Tokenizer) -> Grammars:
    return Grammars(model_dir / "tokenizer.json", tok.vocab_size, sorted(tok.eos_token_ids))


def test_grammars_that_do_not_compile_are_refused_with_the_reason() -> None:
    check_grammar(SCHEMA)
    check_grammar(Grammar("regex", "[a-z]+@[a-z]+\\.com"))
    check_grammar(Grammar("grammar", 'root ::= "yes" | "no"'))  # GBNF
    check_grammar(Grammar("grammar", 'start: "yes" | "no"'))  # Lark
    for bad, message in ((Grammar("regex", "(a"), "regex does not compile"),
                         (Grammar("json_schema", "{"), "not JSON"), (Grammar("json_schema", "[1]"), "an object"),
                         (Grammar("grammar", "root ::= ???"), "grammar does not compile")):
        with pytest.raises(GrammarError, match=message):
            check_grammar(bad)
    with pytest.raises(ValueError, match="ignore_eos cannot go with a grammar"):
        SamplingParams(grammar=SCHEMA, ignore_eos=True).validate()
    with pytest.raises(ValueError, match="a grammar needs a kind"):
        SamplingParams(grammar=Grammar("xml", "<a/>")).validate()


def _mask_of(grammars: Grammars, grammar: Grammar, tokens: list[int]) -> torch.Tensor:
    """A fresh llguidance matcher's own mask after `tokens`, as a bool row."""
    import llguidance

    m = llguidance.LLMatcher(grammars._tokenizer(), to_llguidance(grammar), log_level=0)
    assert all(m.consume_token(t) for t in tokens)
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:grammars.vocab_rows].astype(bool))


def test_a_draft_is_cut_at_its_first_refused_token_and_each_position_gets_its_own_mask(grammars: Grammars,
                                                                                        tok: Tokenizer) -> None:
    grammars.add("r", SCHEMA, [])
    good, bad = tok.encode('{"a": 12'), tok.encode('{"b": 1}')
    assert grammars.valid_prefix("r", good + tok.encode("x")) == len(good)
    assert grammars.valid_prefix("r", bad) == 1  # "{" then a key the schema does not have
    rows = grammars.allowed([("r", good), ("r", [])])
    assert [len(r) for r in rows] == [len(good) + 1, 1]
    for j in range(len(good) + 1):  # row j: the grammar after the draft's first j tokens (the matcher rolled back)
        want = _mask_of(grammars, SCHEMA, good[:j]) & ~grammars._non_eos_special
        assert torch.equal(rows[0][j], want), j
    assert torch.equal(rows[1][0], rows[0][0])
    assert not rows[0][:, sorted(i for i in range(len(grammars._non_eos_special))
                                 if grammars._non_eos_special[i])].any()  # no special token but EOS, ever


def test_commits_advance_it_up_to_eos_in_any_split_and_forks_go_their_own_way(grammars: Grammars,
                                                                              tok: Tokenizer) -> None:
    eos = sorted(tok.eos_token_ids)[0]
    whole = tok.encode('{"a": 7}')
    grammars.add("r", SCHEMA, whole[:2])  # a re-prefill: two output tokens already past
    grammars.fork("r", "f")
    grammars.commit("r", whole[2:])
    (row,) = grammars.allowed([("r", [])])
    assert row[0].nonzero().flatten().tolist() == [eos]  # done: only EOS
    grammars.commit("r", [eos, 5, 6])  # in a later commit (llguidance refuses that in one consume_tokens call)
    assert not grammars.matchers["r"].is_error()
    (fork_row,) = grammars.allowed([("f", [])])  # the fork is still where the re-prefill left it
    assert torch.equal(fork_row[0], _mask_of(grammars, SCHEMA, whole[:2]) & ~grammars._non_eos_special)
    grammars.free("r")
    assert "r" not in grammars and "f" in grammars


def test_a_matcher_in_error_fails_its_request_at_the_next_check(grammars: Grammars, tok: Tokenizer) -> None:
    grammars.add("r", SCHEMA, [])
    grammars.commit("r", tok.encode("nope"))  # cannot happen through verify: each token passed its mask
    (row,) = grammars.allowed([("r", [])])
    with pytest.raises(GrammarError, match="the grammar failed"):
        grammars.check("r", row)
    with pytest.raises(GrammarError, match="does not follow its grammar"):
        grammars.add("s", SCHEMA, tok.encode("nope"))


def test_forced_tokens_are_the_keys_the_schema_leaves_no_choice_about(grammars: Grammars, tok: Tokenizer) -> None:
    two = Grammar("json_schema", json.dumps({"type": "object", "additionalProperties": False,
                                             "required": ["first", "second"],
                                             "properties": {"first": {"type": "integer"},
                                                            "second": {"type": "integer"}}}))
    grammars.add("r", two, [])
    draft = tok.encode('{"first": 1, "')
    forced = grammars.forced("r", draft)
    assert tok.decode(forced).startswith("second") and grammars.valid_prefix("r", draft + forced) == len(draft) + len(
        forced)
    assert grammars.forced("r", []) == [] or tok.decode(grammars.forced("r", [])).startswith("{")
    assert grammars.valid_prefix("r", draft) == len(draft)  # the matcher is back where it was
    (row,) = grammars.allowed([("r", [])])
    assert torch.equal(row[0], _mask_of(grammars, two, []) & ~grammars._non_eos_special)


def test_json_whitespace_runs_are_bounded_unless_the_schema_says_otherwise(grammars: Grammars,
                                                                          tok: Tokenizer) -> None:
    """A model looping on whitespace inside valid JSON cannot spend its max_tokens in one gap."""
    grammars.add("r", SCHEMA, [])
    assert grammars.valid_prefix("r", tok.encode("{" + " " * 20 + '"a": 1}')) == len(tok.encode("{" + " " * 20
                                                                                              + '"a": 1}'))
    text = "{" + " " * 21 + '"a": 1}'
    assert grammars.valid_prefix("r", tok.encode(text)) < len(tok.encode(text))
    loose = Grammar("json_schema", json.dumps({**json.loads(SCHEMA.text),
                                               "x-guidance": {"whitespace_pattern": "[ ]*"}}))
    grammars.add("s", loose, [])
    assert grammars.valid_prefix("s", tok.encode(text)) == len(tok.encode(text))
