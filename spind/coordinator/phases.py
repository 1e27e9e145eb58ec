"""The phases of a time slot, each over an explicit batch: what the coordinator's synchronous slot
(`Coordinator.step`) and its pipelined loop (`spind.coordinator.pipeline`) are both made of.

    _schedule()                 finish aborted requests, admit waiting ones, plan this slot's prefill chunks
    _select(ready)              an Arm per request: the selector, then each worker's own limit
    _prefill(chunks)            target: write the chunks' KV (sent before the verify, runs while drafters draft)
    _propose(worker, items)     one drafter worker's drafts (items from _propose_item, per request)
    _verify(batch, arms, ...)   target: inline drafts, one verify forward, accept, roll back
    _update(batch, ...)         commit tokens, stop rules, selector feedback, stream deltas
"""

from __future__ import annotations

import asyncio
import logging
import time

from spind import protocol as P
from spind.config import TARGET_WORKER
from spind.coordinator.interface import Delta
from spind.coordinator.transport.pool import WorkerError
from spind.coordinator.request import RequestState, SpecStats
from spind.coordinator.scheduler import num_admissible, plan_prefill, visible_len
from spind.coordinator.selection.protocol import AUTO, PLAIN, PLAIN_ARM, Arm, Capacity, RequestInfo, SlotFeedback

log = logging.getLogger(__name__)


class SlotPhases:
    """Mixed into the Coordinator, whose state these methods read and write."""

    # ---- phases: each takes the requests it works on and returns its result ---------------------------------------------------------------------------------
    def _schedule(self, busy: frozenset[str] = frozenset()) -> list[tuple[RequestState, int]]:
        """Finish aborted requests (but those in `busy`, in an op still in flight), admit waiting ones, plan this
        slot's prefill chunks."""
        for st in [s for s in self.running if s.is_abort_requested and s.req_id not in busy]:
            self._finish(st, "abort", detail="the client went away")
        n = num_admissible([st.num_blocks for st in self.waiting], len(self.running), self.max_batch_size,
                           self.budget)
        for _ in range(n):
            st = self.waiting.popleft()
            try:
                self._admit(st)
            except Exception as e:  # this request's data cannot even be sent (it passed the checks): it alone fails
                log.exception("admitting request %s", st.req_id)
                self._fail_requests(WorkerError(TARGET_WORKER, f"cannot send the request: {e}", [st.req_id]))
        pending = [st for st in self.running if not st.is_prefilled]
        sizes = plan_prefill([st.num_prefill_left for st in pending], self.cfg.runtime.max_prefill_tokens)
        return [(st, size) for st, size in zip(pending, sizes) if size]

    def _admit(self, st: RequestState) -> None:
        self.budget.reserve(st.num_blocks)
        st.status = "running"
        self.running.append(st)
        self.metrics.prompt_tokens.inc(st.seq.num_prompt_tokens)
        self.history.add_prompt_tokens(st.seq.num_prompt_tokens)
        self._add_to_target(st)
        hint = self._first_drafter(st)
        if hint is not None:
            self._precompute(st, hint)

    def _add_to_target(self, st: RequestState) -> None:
        tokens = list(st.seq.token_ids)  # a snapshot: an in-process worker may read it after more commits
        self.pool.cast(TARGET_WORKER, P.AddRequest(0, st.req_id, tokens, st.seq.params, True))
        st.synced[TARGET_WORKER] = len(tokens)
        st.num_target_kv = 0

    def _first_drafter(self, st: RequestState) -> str | None:
        """The model drafter a new request will most likely draft with (its KV is worth precomputing)."""
        name = st.req.drafter if st.req.drafter != AUTO else self.selector.precompute_hint(st.req_id)
        return name if name in self.model_drafters else None

    def _precompute(self, st: RequestState, drafter: str) -> None:
        """Queue a drafter's KV of this request on its worker, to run in that worker's idle time."""
        w = self.drafter_worker[drafter]
        self._ensure_mirror(st, w)
        base = st.synced[w]
        tokens = st.seq.token_ids
        self.pool.cast(w, P.Precompute(0, [P.PrecomputeItem(st.req_id, drafter, base, tokens[base:])]))
        st.synced[w] = len(tokens)
        st.precomputed.add(drafter)

    def _ensure_mirror(self, st: RequestState, worker: str) -> None:
        if worker not in st.synced:  # first use on this worker (or it restarted): mirror the request
            tokens = list(st.seq.token_ids)  # a snapshot, as above
            self.pool.cast(worker, P.AddRequest(0, st.req_id, tokens, st.seq.params, False))
            st.synced[worker] = len(tokens)

    def _select(self, ready: list[RequestState], held: dict[str, Arm] | None = None) -> dict[str, Arm]:
        """Arms for `ready`, within each drafter's B_j and each worker's limit less what `held` (the arms other
        requests still run with: the pipeline selects some requests while others are mid-cycle) takes."""
        infos = [RequestInfo(st.req_id, st.req.drafter, st.req.k, st.arm, st.seq.num_prompt_tokens,
                             st.seq.num_output_tokens, st.prompt_repetition) for st in ready]
        used: dict[str, int] = {}  # per worker
        capacity = self.capacity
        if held:
            taken: dict[str, int] = {}
            for arm in held.values():
                if arm.drafter is not None:
                    taken[arm.drafter] = taken.get(arm.drafter, 0) + 1
                    w = self.drafter_worker[arm.drafter]
                    used[w] = used.get(w, 0) + 1
            capacity = Capacity({d: max(0, b - taken.get(d, 0)) for d, b in capacity.per_drafter.items()})
        arms = self.selector.select(infos, capacity) if infos else []
        out = {}
        for st, arm in zip(ready, arms):  # a worker's own limit, over all the drafters it hosts
            if arm.drafter is not None:
                w = self.drafter_worker[arm.drafter]
                used[w] = used.get(w, 0) + 1
                if used[w] > self.worker_capacity[w]:
                    arm = PLAIN_ARM
            out[st.req_id] = arm
            if st.seq.params.is_greedy:
                self.shadows.draft(st.req_id, st.seq.token_ids, exclude=arm.drafter)
            hint = self.selector.precompute_hint(st.req_id)
            if hint is not None and hint in self.model_drafters and hint not in st.precomputed:
                self._precompute(st, hint)
        return out

    def _prefill(self, chunks: list[tuple[RequestState, int]], threads: int = 0) -> asyncio.Future:
        if not chunks:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut
        items = [P.PrefillItem(st.req_id, n) for st, n in chunks]
        return self.pool.cast(TARGET_WORKER, P.Prefill(0, items, threads))

    def _prefilled(self, chunks: list[tuple[RequestState, int]]) -> None:
        """The target wrote these chunks' KV."""
        for st, n in chunks:
            st.num_target_kv += n

    def _needs_draft(self, st: RequestState, arm: Arm) -> bool:
        """Drafted on a drafter worker (not plain, not inline beside the target, room left to draft)."""
        w = self.drafter_worker.get(arm.drafter)
        return w is not None and w != TARGET_WORKER and st.seq.max_draft(arm.k) > 0

    def _propose_item(self, st: RequestState, arm: Arm, assume: list[int] | None = None) -> tuple[str, P.ProposeItem]:
        """The Propose item of a request that needs a draft, on its drafter's worker; sends the mirror first if
        the worker never saw the request. `assume`: draft ahead, k + 1 tokens past these tentative ones (the
        first is the drafter's guess of the bonus token)."""
        w = self.drafter_worker[arm.drafter]
        k = arm.k + 1 if assume else st.seq.max_draft(arm.k)
        self._ensure_mirror(st, w)
        base, tokens = st.synced[w], st.seq.token_ids
        st.synced[w] = len(tokens)
        st.precomputed.add(arm.drafter)
        return w, P.ProposeItem(st.req_id, arm.drafter, base, tokens[base:], k, assume or [])

    async def _propose(self, worker: str, items: list[P.ProposeItem]) -> dict[str, P.DraftRecord]:
        """One Propose on one drafter worker; if it fails as a whole its requests just go without drafts."""
        try:
            reply = await self.pool.call(worker, P.Propose(0, self.slot_id, items), self.call_timeout_s)
        except WorkerError as e:
            if e.req_ids:
                raise
            log.warning("%s; its requests decode without a draft this time", e)
            return {}
        return {d.req_id: d for d in reply.drafts}

    async def _speculate(self, ready: list[RequestState], arms: dict[str, Arm]) -> dict[str, P.DraftRecord]:
        """Drafts from the drafter workers, all concurrently (drafters on the target worker draft inline)."""
        proposes: dict[str, list[P.ProposeItem]] = {}
        for st in ready:
            if self._needs_draft(st, arms[st.req_id]):
                w, item = self._propose_item(st, arms[st.req_id])
                proposes.setdefault(w, []).append(item)
        drafts: dict[str, P.DraftRecord] = {}
        for part in await self._await_workers(asyncio.gather(*(self._propose(w, it) for w, it in proposes.items()))):
            drafts.update(part)
        return drafts

    def _target_threads(self, arms: dict[str, Arm]) -> int:
        """All cores for the target while nothing drafts on another worker meanwhile, else its own share."""
        if not self.cfg.runtime.adaptive_threads or self.pool.info(TARGET_WORKER).device != "cpu":
            return 0
        drafting = any(self.drafter_worker.get(a.drafter, TARGET_WORKER) != TARGET_WORKER for a in arms.values())
        return 0 if drafting else self.num_cores

    async def _verify(self, batch: list[RequestState], arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                      threads: int = 0) -> tuple[list[P.VerifyResult], float]:
        """One verify forward on the target: results in batch order, and its wall time."""
        items = []
        for st in batch:
            arm = arms.get(st.req_id, PLAIN_ARM)
            d = drafts.get(st.req_id)
            if arm.drafter is not None and self.drafter_worker[arm.drafter] == TARGET_WORKER:
                items.append(P.VerifyItem(st.req_id, [], inline_drafter=arm.drafter, k=st.seq.max_draft(arm.k)))
            elif d is not None:
                items.append(P.VerifyItem(st.req_id, d.tokens, d.has_probs, d.slot))
            else:
                items.append(P.VerifyItem(st.req_id, []))
        if not items:
            return [], 0.0
        reply = await self._await_workers(
            self.pool.call(TARGET_WORKER, P.Verify(0, self.slot_id, items, threads), self.call_timeout_s))
        if [r.req_id for r in reply.results] != [st.req_id for st in batch]:
            raise WorkerError(TARGET_WORKER, "verify results do not match the batch")
        return reply.results, reply.verify_s

    async def _verify_isolating(self, batch: list[RequestState], arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                                threads: int = 0) -> tuple[list[RequestState], list[P.VerifyResult], float]:
        """_verify, but a verify that fails without naming its culprits (the target changed nothing) is retried
        on each half of the batch, down to the single requests that fail; those are failed alone. Returns the
        requests verified, their results and the verify seconds."""
        try:
            results, verify_s = await self._verify(batch, arms, drafts, threads)
            return batch, results, verify_s
        except WorkerError as e:
            if e.req_ids:
                raise
            if len(batch) == 1:
                self._fail_requests(WorkerError(e.name, str(e), [batch[0].req_id]))
                return [], [], 0.0
        mid = len(batch) // 2
        kept, results, verify_s = [], [], 0.0
        for half in (batch[:mid], batch[mid:]):
            k, r, s = await self._verify_isolating(half, arms, drafts, threads)
            kept, results, verify_s = kept + k, results + r, verify_s + s
        return kept, results, verify_s

    def _update(self, batch: list[RequestState], arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                results: list[P.VerifyResult], verify_s: float) -> None:
        now = time.perf_counter()
        feedback = []
        for st, r in zip(batch, results):
            seq = st.seq
            arm = arms.get(st.req_id, PLAIN_ARM)
            seq.stats.record(r.num_drafted, r.num_accepted)
            name = arm.drafter or PLAIN
            if arm.drafter is not None and r.num_drafted:
                st.per_drafter.setdefault(name, SpecStats()).record(r.num_drafted, r.num_accepted)
                self.drafter_counters[name].record(r.num_drafted, r.num_accepted)
                self.metrics.record_verify(name, r.num_drafted, r.num_accepted)
            kept = seq.append(r.tokens)
            st.num_target_kv = len(seq.token_ids) - 1
            st.synced[TARGET_WORKER] = len(seq.token_ids)
            d = drafts.get(st.req_id)
            draft_s = d.draft_s if d is not None else r.draft_s
            st.draft_s += draft_s
            st.verify_s += verify_s
            st.arms_used.append(arm.name)
            if st.req_id in arms:
                st.arm = arm
                shadow = tuple(self.shadows.resolve(st.req_id, seq.token_ids, seq.is_finished))
                feedback.append(SlotFeedback(st.req_id, arm, r.num_drafted, r.num_accepted, len(kept), draft_s,
                                             verify_s, d.switch_s if d is not None else 0.0, len(batch),
                                             shadow))
            self.metrics.generation_tokens.inc(len(kept))
            self.history.add_step(name, len(kept), r.num_drafted, r.num_accepted)
            if kept and st.first_token_at is None:
                st.first_token_at = now
                self.metrics.ttft.observe(now - st.arrival)
                self.history.add_ttft(now - st.arrival)
            if seq.is_finished:
                self._finish(st, seq.finish_reason, kept)
            else:
                self._emit(st, Delta(kept, self._text_delta(st, visible_len(seq.text, seq.params.stop))))
        self.history.add_queue(len(self.running), len(self.waiting))
        if feedback:
            self.selector.observe(feedback)

    def _text_delta(self, st: RequestState, end: int) -> str:
        text = st.seq.text[st.num_streamed_chars:end]
        st.num_streamed_chars = max(st.num_streamed_chars, end)
        return text

