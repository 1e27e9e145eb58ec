"""The selection policy value (spind/policy.py): parse -> str round trip, and what it refuses."""

from __future__ import annotations

import pytest

from spind.config import SelectionConfig
from spind.policy import NAMES, Policy


@pytest.mark.parametrize("text, policy", [
    ("lbss", Policy("lbss")),
    ("none", Policy("none")),
    ("greedy-length", Policy("greedy-length")),
    ("epsilon-greedy", Policy("epsilon-greedy")),
    ("random", Policy("random")),
    ("oracle", Policy("oracle")),
    ("fixed:int8", Policy("fixed", "int8")),
    ("fixed:int8@2", Policy("fixed", "int8", 2)),
    ("fixed:my-draft.v2@16", Policy("fixed", "my-draft.v2", 16)),
])
def test_parse_and_str_round_trip(text: str, policy: Policy) -> None:
    assert Policy.parse(text) == policy
    assert str(policy) == text
    assert Policy.parse(str(policy)) == policy


def test_properties() -> None:
    fixed = Policy.parse("fixed:ngram@8")
    assert fixed.is_fixed and not fixed.is_plain and (fixed.name, fixed.drafter, fixed.k) == ("fixed", "ngram", 8)
    assert Policy.parse("fixed:ngram").k is None  # the configured [speculation].k
    assert Policy.parse("none").is_plain and not Policy.parse("none").is_fixed
    assert not any(Policy.parse(n).is_fixed for n in NAMES if n != "fixed")
    assert str(Policy.parse("fixed:a@08")) == "fixed:a@8"  # canonical text
    with pytest.raises(AttributeError):
        fixed.k = 2  # type: ignore[misc]
    assert len({Policy.parse("lbss"), Policy("lbss")}) == 1  # hashable, equal by value


@pytest.mark.parametrize("text, message", [
    ("best", r"policy 'best' is not one of lbss, fixed:NAME\[@K\], greedy-length"),
    ("", r"policy '' is not one of"),
    (" lbss", r"policy ' lbss' is not one of"),
    ("LBSS", r"is not one of"),
    ("fixedint8", r"is not one of"),
    ("fixed", r"policy 'fixed' needs a drafter name"),
    ("fixed:", r"policy 'fixed:' needs a drafter name"),
    ("fixed:@4", r"needs a drafter name"),
    ("fixed: int8", r"needs a drafter name"),
    ("fixed:int8@", r"policy 'fixed:int8@': k must be an integer >= 1, got ''"),
    ("fixed:int8@0", r"k must be an integer >= 1, got '0'"),
    ("fixed:int8@-1", r"k must be an integer >= 1"),
    ("fixed:int8@two", r"k must be an integer >= 1"),
    ("fixed:int8@2@3", r"k must be an integer >= 1"),
    ("fixed:int8@²", r"k must be an integer >= 1"),
])
def test_parse_refuses_bad_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy.parse(text)


def test_construction_is_checked_too() -> None:
    for bad in (dict(name="best"), dict(name="lbss", drafter="int8"), dict(name="none", k=4),
                dict(name="fixed"), dict(name="fixed", drafter=""), dict(name="fixed", drafter="a@2"),
                dict(name="fixed", drafter="int8", k=0), dict(name="fixed", drafter="int8", k=True)):
        with pytest.raises(ValueError):
            Policy(**bad)
    with pytest.raises(ValueError, match="policy must be a string"):
        Policy.parse(4)  # type: ignore[arg-type]


def test_selection_config_keeps_the_text_and_exposes_the_parse() -> None:
    sel = SelectionConfig(policy="fixed:int8@2")
    assert sel.policy == "fixed:int8@2" and sel.parsed_policy == Policy("fixed", "int8", 2)
    assert SelectionConfig().parsed_policy == Policy("lbss")
    with pytest.raises(ValueError, match=r"^\[selection\] policy 'fixed:int8@x': k must be"):
        SelectionConfig(policy="fixed:int8@x")
