"""One name for each drafter on every page (no streamlit, no altair).

The daemon's state names a drafter by its configured name (`[[drafters]] name`, e.g. ngram, suffix, int8), plain
decoding by `spind.state.PLAIN` ("none"), and an arm of the selector as "drafter@k". A newcomer read "none" as
"no data" and "ngram@4" as a different thing from the "ngram" of the assignment chart, so every table, axis and
legend shows the labels made here: the configured name as it is, plain decoding as "none (plain)", an arm as its
drafter's label and its draft length ("ngram k=4").
"""

from __future__ import annotations

from spind.state import PLAIN

PLAIN_LABEL = f"{PLAIN} (plain)"


def drafter_label(name: str | None) -> str:
    """A drafter's configured name; plain decoding (PLAIN, or no drafter at all) as PLAIN_LABEL."""
    return PLAIN_LABEL if not name or name == PLAIN else name


def drafter_of(arm: str) -> str:
    """The drafter of an arm: 'int8@4' -> 'int8'; 'none' stays."""
    return arm.split("@", 1)[0]


def arm_label(arm: str) -> str:
    """An arm as its drafter's label and its draft length: 'ngram@4' -> 'ngram k=4'; 'none' -> 'none (plain)'."""
    drafter, _, k = arm.partition("@")
    return f"{drafter_label(drafter)} k={k}" if k else drafter_label(drafter)


def short_id(req_id: str) -> str:
    """chatcmpl-3f9a...e41c -> …e41c: enough to tell a page's requests apart, the same on every page."""
    return "…" + req_id[-6:]
