"""The selection policy (`[selection].policy`, `spind bench select --policies`), parsed once into a value.

    lbss | fixed:NAME[@K] | greedy-length | epsilon-greedy | random | none | oracle

`Policy.parse(text)` is the one parser (ValueError with what is wrong); `str(policy)` is the canonical text
back (`Policy.parse(str(p)) == p`). Whether a fixed drafter is configured is for the caller to check: this
module knows no config and imports nothing of spind, so `spind.config` and the selectors can both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED = "fixed"
FIXED_PREFIX = "fixed:"
NAMES = ("lbss", FIXED, "greedy-length", "epsilon-greedy", "random", "none", "oracle")
# as users write them (error messages, help texts)
POLICY_NAMES = ("lbss", "fixed:NAME[@K]", "greedy-length", "epsilon-greedy", "random", "none", "oracle")


@dataclass(frozen=True)
class Policy:
    """name: one of NAMES; drafter and k only for `fixed` (k None: the configured [speculation].k)."""

    name: str
    drafter: str | None = None
    k: int | None = None

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"policy {self.name!r} is not one of {', '.join(POLICY_NAMES)}")
        if self.name != FIXED:
            if self.drafter is not None or self.k is not None:
                raise ValueError(f"policy {self.name!r} takes no drafter or k (only fixed:NAME[@K] does)")
            return
        if not isinstance(self.drafter, str) or not self.drafter or "@" in self.drafter \
                or self.drafter != self.drafter.strip():
            raise ValueError(f"policy fixed needs a drafter name (fixed:NAME or fixed:NAME@K), got {self.drafter!r}")
        if self.k is not None and (not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1):
            raise ValueError(f"policy {FIXED_PREFIX}{self.drafter}: k must be an integer >= 1, got {self.k!r}")

    @classmethod
    def parse(cls, text: str) -> Policy:
        """'lbss', 'fixed:int8', 'fixed:int8@2', ... -> Policy; ValueError naming the policy and what is wrong."""
        if not isinstance(text, str):
            raise ValueError(f"policy must be a string, got {text!r}")
        if text == FIXED or text.startswith(FIXED_PREFIX):
            drafter, sep, k = text.removeprefix(FIXED).removeprefix(":").partition("@")
            if not drafter or drafter != drafter.strip():
                raise ValueError(f"policy {text!r} needs a drafter name: fixed:NAME or fixed:NAME@K")
            if sep and not (k.isascii() and k.isdigit() and int(k) >= 1):
                raise ValueError(f"policy {text!r}: k must be an integer >= 1, got {k!r}")
            return cls(FIXED, drafter, int(k) if sep else None)
        if text not in NAMES:
            raise ValueError(f"policy {text!r} is not one of {', '.join(POLICY_NAMES)}")
        return cls(text)

    def __str__(self) -> str:
        if self.name != FIXED:
            return self.name
        return f"{FIXED_PREFIX}{self.drafter}" + ("" if self.k is None else f"@{self.k}")

    @property
    def is_fixed(self) -> bool:
        """`fixed:NAME[@K]`: every AUTO request on one drafter (vanilla speculative decoding)."""
        return self.name == FIXED

    @property
    def is_plain(self) -> bool:
        """`none`: every AUTO request decodes without drafts."""
        return self.name == "none"
