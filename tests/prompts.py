"""Prompts written for the tests, so that the suite runs from a plain clone (no ../shared/datasets).

They cover what the benches' workloads cover: an instruction, open chat, code to complete (raw text, no
chat template), a word problem, and passages to repeat or summarise (output that copies its context, where
n-gram drafting wins), from a handful to ~500 tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TestPrompt:
    kind: str
    text: str
    is_chat: bool  # wrap in the model's chat template; False = a raw completion prompt


PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the island itself. "
    "For more than a century its keepers lived in the cottage at its foot, trimming the wick every four hours "
    "and winding the clockwork that turned the great lens. In winter the supply boat came once a month, when "
    "the sea allowed it, bringing flour, lamp oil, letters and the occasional visitor. The last keeper, a "
    "quiet man named Arvid Lund, kept a diary in which he recorded the weather, the ships that passed, and the "
    "birds that struck the lantern glass on foggy nights. When the light was automated in 1983, Lund moved to "
    "the mainland, but he returned every summer to repaint the door of the cottage in the same dark green. "
    "Today the cottage is a small museum. Visitors can read pages of the diary, climb the one hundred and "
    "twelve steps to the lantern room, and look out over the same grey water that Lund watched for thirty "
    "years. On clear days the outline of the old supply harbour is still visible to the south, and the "
    "granite of the tower, weathered to a soft silver, glows in the low evening sun."
)

CODE = '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)])
    [(1, 6), (8, 10), (15, 18)]
    >>> merge_intervals([(1, 4), (4, 5)])
    [(1, 5)]
    """
'''

PROMPTS = [
    TestPrompt("short", "Once upon a time", False),
    TestPrompt("instruction", "Give three tips for staying healthy.", True),
    TestPrompt("instruction", "Explain why the sky is blue to a ten-year-old, in two short paragraphs.", True),
    TestPrompt("chat", "I am planning a three-day trip to Kyoto in autumn. What should I see, and in which order? "
                       "I like gardens, old streets and quiet temples more than museums.", True),
    TestPrompt("chat", "Write a short, friendly email to a colleague asking to move our Tuesday meeting to "
                       "Thursday afternoon.", True),
    TestPrompt("code", CODE, False),
    TestPrompt("math", "A baker makes 24 muffins. She sells two thirds of them in the morning and half of the rest "
                       "in the afternoon. How many muffins are left? Explain step by step.", True),
    TestPrompt("passage", f"Repeat the following passage word for word.\n\n{PASSAGE}", True),
    TestPrompt("passage", f"Summarize the following passage, reusing its wording.\n\n{PASSAGE}", True),
]


def encode(tokenizer, p: TestPrompt) -> list[int]:
    if p.is_chat:
        return tokenizer.apply_chat([{"role": "user", "content": p.text}])
    return tokenizer.encode(p.text)


SHORT_PROMPTS = ("Repeat this: the cat sat on the mat, the cat sat on the mat.", "Name three colors.",
                 "Once upon a time", "Count to five: one, two,")


def write_prompt_file(path: Path, num: int = 3) -> Path:
    """A bench prompt file (a JSON list of strings) of the first `num` SHORT_PROMPTS: a copying one first."""
    path.write_text(json.dumps(list(SHORT_PROMPTS[:num])))
    return path
