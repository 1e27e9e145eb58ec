"""The coordinator's Prometheus metrics (prometheus_client, one private registry per coordinator so that
several engines in one process never share series), and its slot timings for /v1/spind/state.

Label `drafter` is a drafter name or "none"; `worker` a worker name; `kind` what a worker's time went to
(draft, verify, prefill, precompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # *_created series per label set only add noise to a scrape

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SLOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("spind_requests", "Finished requests by status", ("status",), registry=r)
        self.prompt_tokens = Counter("spind_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.shared_prompt_tokens = Counter("spind_shared_prompt_tokens", "Prompt tokens whose KV a completion (n > 1) "
                                            "shares with the completion that prefilled it", registry=r)
        self.prefix_hit_tokens = Counter("spind_prefix_cache_hit_tokens", "Prompt tokens whose KV the target's prefix "
                                         "cache held from an earlier prompt (reused, not prefilled)", registry=r)
        self.generation_tokens = Counter("spind_generation_tokens", "Generated (committed) tokens", registry=r)
        self.latency = Histogram("spind_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram("spind_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.slot = Histogram("spind_time_slot_seconds", "Wall time of one time slot", buckets=SLOT_BUCKETS, registry=r)
        self.overhead = Histogram("spind_coordinator_overhead_seconds", "Time of a slot not spent waiting for workers",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.drafted = Counter("spind_draft_tokens", "Tokens drafted", ("drafter",), registry=r)
        self.accepted = Counter("spind_accepted_tokens", "Drafted tokens accepted", ("drafter",), registry=r)
        self.accepted_at = Counter("spind_accepted_at_position", "Drafts accepted at each draft position (0-based)",
                                   ("drafter", "position"), registry=r)
        self.running = Gauge("spind_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("spind_requests_waiting", "Requests waiting for admission", registry=r)
        self.restarts = Counter("spind_worker_restarts", "Worker restarts after a fault", ("worker",), registry=r)
        self.hangs = Counter("spind_worker_hangs", "Workers killed by the watchdog: no heartbeat and no CPU used",
                             ("worker",), registry=r)
        self.busy = Counter("spind_worker_busy_seconds", "Worker time by what it was spent on", ("worker", "kind"),
                            registry=r)
        self.ahead = Counter("spind_draft_ahead", "Drafts drafted ahead during a verify: used or dropped", ("outcome",),
                             registry=r)
        self.failed = Counter("spind_request_failures", "Requests failed alone by their own bad data", registry=r)

    def record_verify(self, drafter: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.drafted.labels(drafter=drafter).inc(num_drafted)
            self.accepted.labels(drafter=drafter).inc(num_accepted)
            for i in range(num_accepted):
                self.accepted_at.labels(drafter=drafter, position=str(i)).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()


@dataclass
class SlotTimes:
    """Time-slot wall time, the coordinator's own share of it (not waiting on workers), and the workers' busy time
    by kind (prefill, verify, draft, precompute: summed over workers), so that a client can tell where a slot's time
    goes as load grows (`spind bench serve`'s per-slot prefill and verify)."""

    num_slots: int = 0
    last_slot_s: float = 0.0
    last_overhead_s: float = 0.0
    total_slot_s: float = 0.0
    total_overhead_s: float = 0.0
    grammar_s: float = 0.0  # the target's structured-output work (Verified.grammar_s)
    grammar_tokens: int = 0  # tokens committed to requests with a grammar
    busy_s: dict[str, float] = field(default_factory=dict)  # kind -> the workers' busy seconds

    def record(self, slot_s: float, overhead_s: float) -> None:
        self.num_slots += 1
        self.last_slot_s, self.last_overhead_s = slot_s, overhead_s
        self.total_slot_s += slot_s
        self.total_overhead_s += overhead_s

    def record_busy(self, kind: str, seconds: float) -> None:
        self.busy_s[kind] = self.busy_s.get(kind, 0.0) + max(0.0, seconds)

    def describe(self) -> dict:
        n = max(self.num_slots, 1)
        return {"num_slots": self.num_slots, "last_slot_ms": self.last_slot_s * 1e3,
                "mean_slot_ms": self.total_slot_s / n * 1e3, "last_overhead_ms": self.last_overhead_s * 1e3,
                "mean_overhead_ms": self.total_overhead_s / n * 1e3, "grammar_s": self.grammar_s,
                "grammar_tokens": self.grammar_tokens, "busy_s": dict(self.busy_s)}
