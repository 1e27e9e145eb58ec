"""The contract between the coordinator's engine (request state, time slots, workers) and its front ends
(HTTP, ZeroMQ client API). Front ends only ever see these types.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import AsyncIterator, Protocol

from spind import protocol as P
from spind.errors import StatusError
from spind.params import SamplingParams
from spind.state import SpindState


class EngineError(StatusError):
    """A request the engine refuses; `status` is the HTTP status a front end should answer with."""


@dataclass
class EngineRequest:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str = "auto"  # "auto" (the configured selection policy) | a drafter name | "none"
    k: int | None = None  # tokens drafted per step; None = config
    n: int = 1  # completions of the prompt: n requests sharing its prefilled KV, their deltas tagged with `index`


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    _: KW_ONLY  # Usage(prompt, completion) reads plainly; the rest by name
    # spind extension: per drafter {"drafted": n, "accepted": n}, time slots, mean accepted length
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)
    num_steps: int = 0
    mean_accepted_length: float = 0.0
    finish_detail: str = ""  # why a request ended early ("abort"): the reason a client sees
    draft_s: float = 0.0  # seconds of drafting and of verification this request took part in
    verify_s: float = 0.0
    arms: list[str] = field(default_factory=list)  # the arm of every slot, in order (benches; not sent to clients)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (OpenAI's prompt_tokens_details)

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    @staticmethod
    def merge(usages: list["Usage"]) -> "Usage":
        """The usage of a request's n completions: the prompt once, the rest summed."""
        if len(usages) == 1:
            return usages[0]
        drafters: dict[str, dict[str, int]] = {}
        for u in usages:
            for name, counts in u.drafters.items():
                into = drafters.setdefault(name, {})
                for key, value in counts.items():
                    into[key] = into.get(key, 0) + value
        num_steps = sum(u.num_steps for u in usages)
        committed = sum(u.mean_accepted_length * u.num_steps for u in usages)
        return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), drafters=drafters,
                     num_steps=num_steps, mean_accepted_length=committed / num_steps if num_steps else 0.0,
                     finish_detail="; ".join(dict.fromkeys(u.finish_detail for u in usages if u.finish_detail)),
                     draft_s=sum(u.draft_s for u in usages), verify_s=sum(u.verify_s for u in usages),
                     arms=[a for u in usages for a in u.arms], cached_tokens=usages[0].cached_tokens)

    def spind_json(self) -> dict:
        out = {"drafters": self.drafters, "time_slots": self.num_steps,
               "mean_accepted_length": round(self.mean_accepted_length, 4)}
        if self.finish_detail:
            out["finish_detail"] = self.finish_detail
        return out


@dataclass
class Delta:
    """What a request gained in one time slot."""

    token_ids: list[int]
    text: str  # new text since the previous delta (text that may still turn into a stop string is held back)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    usage: Usage | None = None  # on the last delta
    logprobs: list[P.OutputLogprobs] | None = None  # one per token_ids entry, when the request asked for them
    index: int = 0  # which of the request's n completions (EngineRequest.n) it belongs to


class Engine(Protocol):
    model_name: str

    async def start(self) -> None: ...

    async def shutdown(self, drain: bool = True) -> None:
        """drain=True: refuse new requests, finish in-flight ones, then stop workers."""

    def generate(self, req: EngineRequest) -> AsyncIterator[Delta]:
        """Stream a request's deltas (of its n completions, interleaved, each ending with a delta that has its
        finish_reason; the stream ends after the last). Raises EngineError before the first delta for bad or
        unfittable input
        (400 bad input, 413 prompt over the context limit, 503 overloaded or draining). Closing the iterator
        early (client gone) aborts the request and frees its KV on every worker."""

    def encode_prompt(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        """Completion prompt (text or token ids) or chat messages -> prompt ids; EngineError(400) if invalid."""

    def snapshot(self) -> SpindState:
        """The engine's state for GET /v1/spind/state (schema: spind.state); the front end fills in `api`."""

    def render_metrics(self) -> str:
        """Prometheus text exposition for GET /metrics."""

    async def reset_cache(self) -> None:
        """Forget what the drafters learned from finished requests (their outputs, which suffix decoding drafts
        from), on every worker; the selector's statistics stay. For POST /v1/spind/reset_cache."""

    def health(self) -> str | None:
        """None while the engine can serve; else why not (gave up, a worker stalled), for GET /health."""

    async def wait_failed(self) -> None:
        """Returns once the engine has given up for good (the daemon then exits non-zero)."""
