"""The records of `spind bench e2e` (spind/bench/e2e.py) that its transformers systems (spind/bench/e2e_hf.py) share:
the settings, a system's spec, a request's record, and the refusal of a system this build cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spind.policy import Policy


class RefusedSystem(ValueError):
    """A system this build cannot run as asked; reported in the results, never faked."""


@dataclass(frozen=True, kw_only=True)
class SystemSpec:
    name: str
    kind: str  # spind | hf
    policy: Policy = Policy("none")  # the spind systems' [selection].policy
    drafters: tuple[str, ...] = ()
    pipeline: bool = False
    attention: str | None = None  # [runtime].attention for this system; None: the configured one (what serving runs)
    hf_drafter: str = ""  # hf-assisted: the configured drafter standing in as the assistant model


@dataclass(frozen=True)
class E2ESettings:
    workload: str
    num_requests: int
    batch_size: int
    max_tokens: int
    systems: tuple[str, ...]
    temperature: float = 0.0
    seed: int = 0
    rate: float | None = None  # open loop: Poisson arrivals per second; None = closed loop
    k: int = 4
    rounds: int = 1  # closed loop: the spind systems take turns over this many slices of the requests

    def num_rounds(self) -> int:
        """Rounds actually run: 1 in an open loop (arrivals are timed from the start) and where a slice would hold
        under two batches of requests (the batch would never fill); else `rounds`."""
        if self.rate is not None:
            return 1
        return max(1, min(self.rounds, self.num_requests // (2 * self.batch_size)))


@dataclass
class RequestRecord:
    index: int
    category: str
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    arrival_s: float = 0.0  # since the run started
    ttft_s: float | None = None
    latency_s: float = 0.0
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)
    arms: list[str] = field(default_factory=list)  # the arm of each slot
    lossless: bool | None = None  # greedy output equal to `none`'s (None: not compared)
    round: int = 0  # closed loop with rounds: the slice of the requests it ran in

    @property
    def goodput(self) -> float:
        return len(self.token_ids) / self.latency_s if self.latency_s else 0.0
