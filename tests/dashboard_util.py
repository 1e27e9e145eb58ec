"""A mixed workload for the dashboard's tests: chat prompts and passage-copying prompts (so that the learning
selector gives them different drafters), sent to a real daemon over HTTP from background threads; and the
recording of the state snapshots tests/data/*.json that the page's AppTest renders.

Re-record after a STATE_VERSION bump:  python tests/dashboard_util.py
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from prompts import PASSAGE, PROMPTS

DATA = Path(__file__).parent / "data"
CHATS = [p.text for p in PROMPTS if p.is_chat and p.kind in ("instruction", "chat", "math")]
PASSAGES = [f"{task}\n\n{PASSAGE}" for task in ("Repeat the following passage word for word.",
                                                "Copy the following passage exactly.")]


def chat(url: str, text: str, max_tokens: int, headers: dict[str, str] | None = None) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=600) as resp:
        return json.loads(resp.read())


class MixedLoad:
    """`clients` threads, each sending passage and chat prompts in turn until stopped."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 48, headers: dict[str, str] | None = None):
        self.url, self.max_tokens, self.headers = url, max_tokens, headers
        self.num_done = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        prompts = PASSAGES + CHATS
        while not self._stop.is_set():
            try:
                chat(self.url, prompts[i % len(prompts)], self.max_tokens, self.headers)
                self.num_done += 1
            except Exception as e:  # noqa: BLE001 - reported by stop()
                self.errors.append(e)
                return
            i += 1

    def __enter__(self) -> MixedLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)


def record_states() -> None:
    """tests/data/{idle,busy}.json from a real daemon with the embedded default config."""
    from daemon_util import start_daemon

    DATA.mkdir(exist_ok=True)
    with start_daemon() as d:
        (DATA / "idle.json").write_text(json.dumps(d.state()))
        with MixedLoad(d.url):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                state = d.state()
                sel = state["selection"] or {}
                if (state["num_running"] >= 3 and len(sel.get("estimates", {})) >= 3
                        and state["latency"]["num_requests"] >= 4 and all(w["utilisation"] for w in state["workers"])):
                    break
                time.sleep(0.5)
            (DATA / "busy.json").write_text(json.dumps(state))


if __name__ == "__main__":
    record_states()
