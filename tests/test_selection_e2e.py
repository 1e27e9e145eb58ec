"""LBSS end to end: the real daemon with the embedded default config (policy lbss; drafters ngram, suffix, int8,
dyn8, bf16) over an fp32 target, a mixed batch of requests that copy a given passage and open chat, all with drafter
"auto". The fp32 target, not the default 4-bit one: a model drafter pays only while its draft token costs well
under a target step (int8 ~0.6x of an fp32 step here; 2.3x of a gguf step, where only n-gram lookup pays and
LBSS rightly learns that).

The learning selector must give the two kinds different drafters, in the direction their acceptance points (the
model-free ones, n-gram lookup and suffix decoding, accept the passages and little of chat, so chat draws less of
its output from them), show it in /v1/spind/state and in each response's usage, and stay lossless: greedy output
token-identical to plain decoding of the same prompts.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from daemon_util import start_daemon
from prompts import PASSAGE
from spind.client import AsyncSpindClient

pytestmark = pytest.mark.e2e

MAX_TOKENS = 96
COPYING = {"ngram", "suffix"}  # the model-free drafters, which draft what the context already holds
PASSAGES = [f"{task}\n\n{PASSAGE}" for task in (
    "Repeat the following passage word for word.", "Rewrite the following passage, keeping its wording.",
    "Copy the following passage exactly.", "Repeat this passage verbatim.")]
CHATS = ["Give three tips for staying healthy.", "Write a short, friendly email to a colleague asking to move our "
         "Tuesday meeting.", "What are the main causes of climate change?", "Describe a good morning routine."]


def top_drafter(usage) -> str:
    """The drafter whose tokens made up most of the output (accepted, not drafted: an n-gram arm at k = 8 drafts
    four times what a model arm at k = 2 does in a slot, so drafted counts would favour it)."""
    return max(usage.drafters, key=lambda d: usage.drafters[d]["accepted"]) if usage.drafters else "none"


async def run_all(address: str, drafter: str) -> list:
    async with AsyncSpindClient(address, timeout_s=600) as c:
        return await asyncio.gather(*(
            c.complete(messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS, ignore_eos=True,
                       drafter=drafter) for text in PASSAGES + CHATS))


def test_auto_gives_passages_and_chat_different_drafters_losslessly():
    with start_daemon(None, "--dtype", "float32") as d:
        seen: set[str] = set()
        stop = threading.Event()

        def watch() -> None:  # the per-request drafters, as the dashboard sees them
            while not stop.is_set():
                seen.update(r["drafter"] for r in d.state()["requests"] if r["status"] == "running")
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            auto = asyncio.run(run_all(d.zmq_address, "auto"))
        finally:
            stop.set()
            watcher.join(5)
        state = d.state()
        plain = asyncio.run(run_all(d.zmq_address, "none"))

    assert [a.token_ids for a in auto] == [p.token_ids for p in plain]  # lossless
    assert all(len(a.token_ids) == MAX_TOKENS for a in auto)
    copy_share = [sum(v["accepted"] for a in group for d, v in a.usage.drafters.items() if d in COPYING) /
                  max(1, sum(v["accepted"] for a in group for v in a.usage.drafters.values()))
                  for group in (auto[:len(PASSAGES)], auto[len(PASSAGES):])]
    tops = [top_drafter(a.usage) for a in auto]
    # The two kinds get different drafters, in the direction their acceptance points: copying drafters accept chat
    # little, so chat draws a smaller share of its tokens from them than the passages do. Not asserted: that the
    # passages go mostly to copying drafters. Over this fp32 target the int8 and bf16 self-drafts accept a copied
    # passage as whole as lookup does (76 of 76 drafted tokens, fixed, at batch 8), and they draft on the other
    # core while the target verifies, so cost alone, which is noisy on a shared VM, decides between them: full-suite
    # runs on a Zen 4 VM gave the passages a copying share of 0.44 and 0.52 (chat 0.26 and 0.44) where quiet runs
    # gave 0.76-0.87 (chat 0.17-0.24). Which drafter wins under which costs is the simulator's to test
    # (test_bandit.py), with scripted costs.
    assert copy_share[0] > copy_share[1], (copy_share, tops)
    assert seen & COPYING and seen & {"int8", "dyn8", "bf16"}, seen
    sel = state["selector"]
    assert sel["policy"] == "lbss" and sel["epoch"] >= 2 and sel["num_slots"] > 0
    assert set(sel["arms"]) >= {"none", "ngram@8", "int8@2"}
