"""The daemon's state for the page: a SpindState, or an `Unavailable` saying why there is none (the page shows
it as a message, never a traceback, and keeps polling)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from spind.client import http_json
from spind.state import SpindState, StateVersionError, decode_state

STATE_PATH = "/v1/spind/state"


@dataclass(frozen=True)
class Unavailable:
    title: str
    detail: str


def fetch_state(url: str, api_key: str = "", timeout_s: float = 2.0) -> SpindState | Unavailable:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status, body = http_json(url.rstrip("/") + STATE_PATH, headers, timeout_s)
    if status == 0:
        return Unavailable("The daemon is not reachable",
                           f"Nothing answers at {url}. Start it with `spind start`, or correct the address in the "
                           f"sidebar; this page keeps trying every second.")
    if status == 401:
        return Unavailable("The daemon refused the API key",
                           "Enter the daemon's key ([server].api_key of its config) in the sidebar.")
    if status != 200 or body is None:
        message = ((body or {}).get("error") or {}).get("message", "") if isinstance(body, dict) else ""
        return Unavailable(f"The daemon answered HTTP {status}", message or "No state in the answer.")
    try:
        return decode_state(body)
    except StateVersionError as e:
        return Unavailable("This page and the daemon are different spind versions", str(e))
    except msgspec.ValidationError as e:
        return Unavailable("The daemon's state does not match this page's schema", str(e))
