"""The schema of GET /v1/spind/state: what the daemon is doing, for the dashboard, `spind status` and the benches.

The coordinator builds a `SpindState` (`Coordinator.snapshot`); the HTTP front end adds `api` and encodes it;
readers call `decode_state`, which refuses a snapshot of another STATE_VERSION with a clear message rather
than misreading it. Bump STATE_VERSION on any change that renames, removes or retypes a field; adding a field
with a default does not need it.

Times are `time.monotonic()` seconds on the daemon's machine (workers share that clock); `now` is the
snapshot's own time, so a reader plots `start - now` and never compares with its own clock.
"""

from __future__ import annotations

import msgspec

STATE_VERSION = 1
PLAIN = "none"  # the drafter of plain decoding (no speculation), wherever the state names drafters or arms
BUSY_KINDS = ("draft", "verify", "prefill", "precompute")  # what a worker's busy time goes to; the rest is idle
PERCENTILES = (50, 90, 99)


class StateVersionError(ValueError):
    pass


class _State(msgspec.Struct):
    pass


class BusySpan(_State, array_like=True):
    """A stretch of one worker's time (array-like on the wire: hundreds per snapshot). The daemon's snapshot gives
    one per activity per 0.2 s of the window, its seconds laid from the start of that 0.2 s
    (spind.coordinator.history)."""

    kind: str  # one of BUSY_KINDS
    drafter: str  # for draft and precompute: which drafter; else ""
    start: float
    end: float
    num_reqs: int = 0  # the most requests one of its intervals served


class WorkerState(_State):
    name: str
    is_target: bool
    model: str  # the target model, or the drafters it hosts
    drafters: list[str]
    device: str  # a tensor-parallel target: every rank's, "cpu + cpu (tensor parallel)"
    dtype: str
    threads: int
    pid: int | None
    alive: bool
    restarts: int
    hangs: int = 0  # times the watchdog killed it (no heartbeat and no CPU used for watchdog_s)
    rss_bytes: int | None = None  # resident memory of the worker's process (None: unknown)
    busy: list[BusySpan] = []  # the last `window_s` seconds, oldest first
    busy_s: dict[str, float] = {}  # kind -> seconds busy since start
    utilisation: float = 0.0  # busy share of the last `window_s` seconds
    ranks: list[str] = []  # a tensor-parallel target: each rank's device, rank 0's first ([]: one process)


class RequestSummary(_State):
    req_id: str
    status: str  # waiting | running
    drafter: str  # the drafter of its current arm; "none" = plain decoding
    k: int
    requested_drafter: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    prefill_left: int


class DrafterState(_State):
    worker: str
    capacity: int | None  # B_j: requests it drafts for per slot (None: unbounded)
    drafted: int
    accepted: int
    accepted_at: list[int]  # accepted_at[i]: drafts accepted at position i
    num_steps: int
    acceptance_rate: float


class SelectionState(_State):
    """The selector's view, the same for every policy; the learning selector (LBSS) fills epoch, stage and
    the estimates, the static ones leave them empty."""

    policy: str
    epoch: int | None = None
    stage: str | None = None  # explore | exploit
    slot_in_stage: int | None = None
    stage_slots: int | None = None
    arms: list[str] = []  # "none" first, then "drafter@k"
    estimates: dict[str, dict[str, float | None]] = {}  # req_id -> arm -> estimated goodput (tok/s; None unknown)
    assignment: dict[str, int] = {}  # arm -> requests on it at the last slot
    capacity: dict[str, int | None] = {}  # drafter -> B_j
    num_slots: int | None = None  # slots selected for so far
    num_switches: int | None = None
    switches_per_minute: float | None = None
    switch_s: float | None = None  # KV catch-up seconds paid on switches
    precompute_s: float = 0.0  # worker seconds spent precomputing drafter KV ahead of switches


class DraftCounts(_State, array_like=True):
    num_committed: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0


class ThroughputSample(_State):
    """One whole second of the daemon's life."""

    t: float  # start of the second
    num_prompt_tokens: int = 0  # prefilled
    num_running: int = 0  # after the second's last slot (a second without slots: the second before's)
    num_waiting: int = 0
    drafters: dict[str, DraftCounts] = {}  # by the drafter the requests ran with ("none" = plain)


class LatencyState(_State):
    """Percentiles (PERCENTILES, as "p50"...) in ms over the most recent finished requests."""

    num_requests: int = 0
    ttft_ms: dict[str, float] = {}
    latency_ms: dict[str, float] = {}


class ApiState(_State):
    status: str
    num_active: int


class SpindState(_State, kw_only=True):
    version: int = STATE_VERSION
    model: str
    accepting: bool
    failure: str | None
    now: float
    window_s: float  # how far back `busy` and `throughput` reach
    num_waiting: int
    num_running: int
    workers: list[WorkerState]
    requests: list[RequestSummary]
    drafters: dict[str, DrafterState]
    selection: SelectionState | None
    selector: dict | None  # the selector's own describe(), policy-specific
    throughput: list[ThroughputSample]
    latency: LatencyState
    slots: dict
    kv: dict
    profile: dict | None = None
    pipeline: dict | None = None
    api: ApiState | None = None


_decoder = msgspec.json.Decoder(SpindState)


def encode_state(state: SpindState) -> bytes:
    return msgspec.json.encode(state)


def decode_state(data: bytes | str | dict) -> SpindState:
    """A SpindState from JSON (bytes or str) or an already parsed dict. Raises StateVersionError for a snapshot
    of another schema version, msgspec.ValidationError for one that does not match this schema."""
    raw = msgspec.json.decode(data) if isinstance(data, (bytes, str)) else data
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != STATE_VERSION:
        raise StateVersionError(f"the daemon's state has schema version {version}; this spind reads version "
                                f"{STATE_VERSION}: run the same spind version on both sides")
    if isinstance(data, (bytes, str)):
        return _decoder.decode(data)
    return msgspec.convert(raw, SpindState)
