"""The coordinator's state as a `spind.state.SpindState` (GET /v1/spind/state): built on demand from what its
`SlotPhases`, selector and `History` hold; nothing here runs per slot."""

from __future__ import annotations

import os
import time

from spind.coordinator.history import WINDOW_S
from spind.coordinator.phases import SlotPhases
from spind.coordinator.selection.protocol import PLAIN
from spind.state import DrafterState, RequestSummary, SelectionState, SpindState, WorkerState

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def build_state(ph: SlotPhases, *, model_name: str, accepting: bool, loop: dict | None) -> SpindState:
    """`loop`: what the loop body describes of itself (the pipeline's occupancy; None in lockstep)."""
    now = time.monotonic()
    described = ph.describe_selection()
    return SpindState(
        model=model_name, accepting=accepting, failure=ph.failure, now=now, window_s=WINDOW_S,
        num_waiting=len(ph.waiting), num_running=len(ph.running), workers=_workers(ph, now), requests=_requests(ph),
        drafters=_drafters(ph), selection=_selection(ph, described), selector=described,
        throughput=ph.history.throughput(now), latency=ph.history.latency(), slots=ph.times.describe(),
        kv={"num_blocks": ph.budget.num_blocks, "num_reserved": ph.budget.num_reserved,
            "prefix_hit_tokens": ph.prefix_hit_tokens},
        profile=ph.profile.to_json() if ph.profile else None,
        pipeline=loop)


def _workers(ph: SlotPhases, now: float) -> list[WorkerState]:
    out = []
    for w in ph.pool.describe():  # the workers that exist now (none after a stop)
        name = w["name"]
        spans = ph.history.busy_spans(name, now)
        models = [f"{d.name} ({d.variant or d.kind})" for d in ph.cfg.drafters if d.worker == name]
        if w["is_target"]:
            models.insert(0, f"{ph.cfg.model.target} ({w['dtype'] or ph.cfg.model.dtype})")  # "auto" as resolved
        ranks = list(w.get("ranks") or [])
        out.append(WorkerState(
            name=name, is_target=w["is_target"], model=", ".join(models), drafters=list(w["drafters"]),
            device=f"{' + '.join(ranks)} (tensor parallel)" if ranks else w["device"], ranks=ranks,
            dtype=w["dtype"], threads=w["threads"], pid=w["pid"], alive=w["alive"],
            restarts=w["restarts"], hangs=w.get("hangs", 0), rss_bytes=_rss_bytes(w["pid"]), busy=spans,
            busy_s={k: round(v, 3) for k, v in ph.history.busy_s.get(name, {}).items()},
            utilisation=ph.history.utilisation(spans, now)))
    return out


def _rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def _requests(ph: SlotPhases) -> list[RequestSummary]:
    return [RequestSummary(req_id=st.req_id, status=st.status, drafter=(st.arm.drafter if st.arm else None) or PLAIN,
                           k=st.arm.k if st.arm else 0, requested_drafter=st.req.drafter,
                           num_prompt_tokens=st.seq.num_prompt_tokens, num_output_tokens=st.seq.num_output_tokens,
                           num_steps=st.seq.stats.num_steps, prefill_left=st.num_prefill_left)
            for st in list(ph.running) + list(ph.waiting)]


def _drafters(ph: SlotPhases) -> dict[str, DrafterState]:
    return {n: DrafterState(worker=ph.drafter_worker[n], capacity=ph.capacity.of(n), drafted=s.num_drafted,
                            accepted=s.num_accepted, accepted_at=list(s.accepted_at), num_steps=s.num_steps,
                            acceptance_rate=s.num_accepted / max(s.num_drafted, 1))
            for n, s in ph.drafter_counters.items()}


def _selection(ph: SlotPhases, d: dict | None) -> SelectionState | None:
    """The policy-independent view of selector.describe() (d): LBSS's fields where it has them."""
    if d is None:
        return None
    precompute_s = sum(kinds.get("precompute", 0.0) for kinds in ph.history.busy_s.values())
    capacity = {n: ph.capacity.of(n) for n in ph.drafter_counters} | d.get("capacity", {})  # B_j at the last slot
    return SelectionState(
        policy=d["policy"], epoch=d.get("epoch"), stage=d.get("stage"), slot_in_stage=d.get("slot_in_stage"),
        stage_slots=d.get("stage_slots"), arms=d.get("arms", []),
        estimates={r: v["estimate"] for r, v in d.get("requests", {}).items()},
        assignment=d.get("assignment", {}), capacity=capacity, num_slots=d.get("num_slots"),
        num_switches=d.get("num_switches"),
        switches_per_minute=d.get("switches_per_minute"), switch_s=d.get("switch_s"),
        precompute_s=round(precompute_s, 3))
