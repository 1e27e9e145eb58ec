"""A small Prometheus registry (Counter, Gauge, Histogram with labels; text exposition format 0.0.4)
and the daemon's metrics, defined in one place.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SLOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


@dataclass
class _Metric:
    name: str
    help: str
    label_names: tuple[str, ...] = ()
    kind: str = ""

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.label_names)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


@dataclass
class Counter(_Metric):
    kind: str = "counter"
    values: dict[LabelValues, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        values = self.values if self.values or self.label_names else {(): 0.0}  # an unlabelled series starts at 0
        lines = [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in sorted(values.items())]
        return self.header() + lines


@dataclass
class Gauge(Counter):
    kind: str = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)


@dataclass
class Histogram(_Metric):
    kind: str = "histogram"
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    # per series: [count in (b[i-1], b[i]] for each bucket i, count above the last bucket, sum, count]
    series: dict[LabelValues, list[float]] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        s = self.series.setdefault(key, [0.0] * (len(self.buckets) + 3))
        s[bisect.bisect_left(self.buckets, value)] += 1  # index len(buckets): above every bucket
        s[-2] += value
        s[-1] += 1

    def count(self, **labels: str) -> int:
        s = self.series.get(self._key(labels))
        return int(s[-1]) if s else 0

    def render(self) -> list[str]:
        lines = self.header()
        for key, s in sorted(self.series.items()):
            cum = 0.0
            for b, n in zip(self.buckets, s):
                cum += n
                le = 'le="' + _num(b) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {_num(cum)}")
            inf = 'le="+Inf"'
            lines.append(f"{self.name}_bucket{_labels(self.label_names, key, inf)} {_num(s[-1])}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(s[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_num(s[-1])}")
        return lines


class Registry:
    def __init__(self) -> None:
        self.metrics: dict[str, _Metric] = {}

    def _add(self, m: _Metric) -> _Metric:
        if m.name in self.metrics:
            raise ValueError(f"metric {m.name} registered twice")
        self.metrics[m.name] = m
        return m

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._add(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets=tuple(sorted(buckets))))

    def render(self) -> str:
        return "\n".join(line for m in self.metrics.values() for line in m.render()) + "\n"


class EngineMetrics:
    """The coordinator's metrics. Label `drafter` is a drafter name or "none"."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("spind_requests_total", "Finished requests by status", ("status",))
        self.prompt_tokens = r.counter("spind_prompt_tokens_total", "Prompt tokens of admitted requests")
        self.generation_tokens = r.counter("spind_generation_tokens_total", "Generated (committed) tokens")
        self.latency = r.histogram("spind_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS)
        self.ttft = r.histogram("spind_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.slot = r.histogram("spind_time_slot_seconds", "Wall time of one time slot", SLOT_BUCKETS)
        self.overhead = r.histogram("spind_coordinator_overhead_seconds",
                                    "Time of a slot not spent waiting for workers", OVERHEAD_BUCKETS)
        self.drafted = r.counter("spind_draft_tokens_total", "Tokens drafted", ("drafter",))
        self.accepted = r.counter("spind_accepted_tokens_total", "Drafted tokens accepted", ("drafter",))
        self.accepted_at = r.counter("spind_accepted_at_position_total",
                                     "Drafts accepted at each draft position (0-based)", ("drafter", "position"))
        self.running = r.gauge("spind_requests_running", "Requests in the running batch")
        self.waiting = r.gauge("spind_requests_waiting", "Requests waiting for admission")
        self.restarts = r.counter("spind_worker_restarts_total", "Worker restarts after a fault", ("worker",))
        self.busy = r.counter("spind_worker_busy_seconds_total", "Worker forward time", ("worker", "kind"))

    def record_verify(self, drafter: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.drafted.inc(num_drafted, drafter=drafter)
            self.accepted.inc(num_accepted, drafter=drafter)
            for i in range(num_accepted):
                self.accepted_at.inc(position=str(i), drafter=drafter)

    def render(self) -> str:
        return self.registry.render()


@dataclass
class SlotTimes:
    """Time-slot wall time and the coordinator's own share of it (not waiting on workers)."""

    num_slots: int = 0
    last_slot_s: float = 0.0
    last_overhead_s: float = 0.0
    total_slot_s: float = 0.0
    total_overhead_s: float = 0.0

    def record(self, slot_s: float, overhead_s: float) -> None:
        self.num_slots += 1
        self.last_slot_s, self.last_overhead_s = slot_s, overhead_s
        self.total_slot_s += slot_s
        self.total_overhead_s += overhead_s

    def describe(self) -> dict:
        n = max(self.num_slots, 1)
        return {"num_slots": self.num_slots, "last_slot_ms": self.last_slot_s * 1e3,
                "mean_slot_ms": self.total_slot_s / n * 1e3, "last_overhead_ms": self.last_overhead_s * 1e3,
                "mean_overhead_ms": self.total_overhead_s / n * 1e3}
