"""The one error shape every side of spind shares: a message with an HTTP-style status and an OpenAI error code.
(Its own module, importing nothing: the client library uses it without the daemon.)"""

from __future__ import annotations


class StatusError(Exception):
    """`status` is HTTP-style (400 bad input, 401 key, 413 too long, 503 overloaded or draining, 500 internal)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
