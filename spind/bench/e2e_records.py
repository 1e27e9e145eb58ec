"""The records of `spind bench e2e` (spind/bench/e2e.py) that its transformers systems (spind/bench/e2e_hf.py) share:
the settings, a system's spec, a request's record, and the refusal of a system this build cannot run.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field

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
    settings: tuple[tuple[str, str, object], ...] = ()  # (section, key, value): the system's own config values


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
    rounds: int = 1  # closed loop: the spind systems take turns over this many slices of the requests (0: as many
    #                  as the requests allow, `num_rounds`)
    workers: str = "threads"  # the spind systems' workers: "threads" of this process, or "processes" (the daemon's)
    repeats: int = 1  # closed loop: the systems taking turns run the requests this many times, on engines loaded
    #                   afresh each time, their rounds' order continuing (`run_repeats`)

    def num_rounds(self) -> int:
        """Rounds actually run: 1 in an open loop (arrivals are timed from the start); else `rounds`, at most as many
        as leave each slice two batches of requests (fewer and the batch would never fill), and that many where
        `rounds` is 0. The finer the slices, the shorter the stretch of time between two systems' turns: this VM's
        step time drifts 7 -> 10.7 -> 7 ms within a minute, and at batch 1 a second plain engine read 0.82x and
        1.14x the first over 4 rounds of 96 requests (humaneval, mtbench), 0.96x and 1.04x over 24."""
        if self.rate is not None:
            return 1
        most = max(1, self.num_requests // (2 * self.batch_size))
        return most if self.rounds <= 0 else min(self.rounds, most)


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


@dataclass(frozen=True)
class SlotAccount:
    """A spind system's slots by its engine's own accounting: the verify passes it ran, their wall seconds, the
    coordinator's share of them (not awaiting a worker: scheduling, selection, commits, streaming) and the target
    worker's busy seconds (prefill, verify, drafting beside it, idle work). It tells a selector's own cost from its
    choices: two systems with the same tokens per second of target time differ only by what runs around it. The
    other workers' busy seconds (drafting, KV precompute) say what ran beside the target, on the same cores. CPU
    seconds, of this process (the coordinator, and in-process workers) and of the worker processes: the work each
    did, which other tenants of a shared host inflate far less than they do wall time. And, in a closed loop, the
    seconds of its slices while all of their clients were busy (from a slice's start until a client first found no
    request left in it: the batch full, but for the moments of an admission) and the tokens streamed in them: a
    slice's end, where the batch drains to its last request, is no part of serving at that batch, and it is longer for
    a system whose requests progress unevenly (speculation) than for one that keeps equally long requests in step."""

    num_slots: int = 0
    slot_s: float = 0.0
    coordinator_s: float = 0.0
    target_s: float = 0.0
    side_s: float = 0.0
    process_cpu_s: float = 0.0
    workers_cpu_s: float = 0.0
    full_s: float = 0.0
    full_tokens: int = 0

    def __add__(self, other: SlotAccount) -> SlotAccount:
        return SlotAccount(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __sub__(self, other: SlotAccount) -> SlotAccount:
        return SlotAccount(*(a - b for a, b in zip(astuple(self), astuple(other))))

    def per_slot(self) -> dict:
        """JSON-ready: the slots and their mean milliseconds (None with no slot)."""
        n = self.num_slots

        def ms(seconds: float) -> float | None:
            return seconds / n * 1e3 if n else None

        return {"num_slots": n, "slot_ms": ms(self.slot_s), "coordinator_ms": ms(self.coordinator_s),
                "target_busy_ms": ms(self.target_s), "side_busy_ms": ms(self.side_s),
                "process_cpu_ms": ms(self.process_cpu_s), "workers_cpu_ms": ms(self.workers_cpu_s)}

    @property
    def full_batch_goodput(self) -> float | None:
        """Tokens a second while every client was busy (None: no such time, e.g. an open loop)."""
        return self.full_tokens / self.full_s if self.full_s > 0 else None

