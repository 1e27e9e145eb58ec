"""The request tables and the phases of a time slot, each over an explicit batch: what both of the coordinator's
loops are made of (its lockstep slot, `spind.coordinator.lockstep`, and its pipeline, `spind.coordinator.pipeline`).

    schedule(busy)              finish aborted requests, admit waiting ones, plan this slot's prefill chunks
    select(ready, held)         decide: an Arm per request (the selector, then each worker's own limit), and the
                                precompute and shadow work that implies; send_side_work(selection) does that work
    prefill(chunks)             target: write the chunks' KV (sent before the verify, runs while drafters draft)
    propose(worker, items)      one drafter worker's drafts (items from propose_item, per request)
    verify_isolating(batch...)  target: inline drafts, one verify forward, accept, roll back; a verify that fails
                                without naming its culprits is split until they are found
    update(outcome, ...)        commit tokens, stop rules, selector feedback, stream deltas

and what goes around them: finishing and failing requests, restarting dead workers, the slot's timings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace

from spind import protocol as P
from spind.config import TARGET_WORKER, SpindConfig, configured_kv_blocks
from spind.coordinator.history import History
from spind.coordinator.interface import Delta, Usage
from spind.coordinator.metrics import EngineMetrics, SlotTimes
from spind.coordinator.placement import target_all_threads, threads_for, verify_threads
from spind.coordinator.profile import SystemProfile
from spind.coordinator.recovery import RestartPolicy
from spind.coordinator.request import RequestState, SpecStats, output_logprobs
from spind.coordinator.scheduler import KVBudget, num_admissible, plan_prefill, visible_len
from spind.coordinator.selection.protocol import (AUTO, PLAIN, PLAIN_ARM, Arm, Capacity, RequestInfo, Selector,
                                                  SlotFeedback)
from spind.coordinator.selection.lbss import NUM_BUCKETS, bucket_of
from spind.coordinator.selection.regime import MIN_BATCH, RegimeTrial
from spind.coordinator.selection.shadow import FREE_KINDS, SHADOW_K, ShadowDrafts, is_shadow_turn
from spind.coordinator.transport.pool import WorkerDied, WorkerError, WorkerPool
from spind.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_FORCED = 16  # grammar-forced tokens a draft may grow by (a JSON key and its punctuation)
Chunks = list[tuple[RequestState, int]]  # (request, prompt tokens the target prefills for it this slot)


@dataclass
class Selection:
    """What select decided: the arms, and the side work they imply (send_side_work sends it)."""

    arms: dict[str, Arm] = field(default_factory=dict)
    precompute: list[tuple[RequestState, str]] = field(default_factory=list)  # (request, model drafter): queue its KV


@dataclass
class VerifyOutcome:
    """A verify pass's results, in batch order: the requests verified (those whose data failed the target were
    failed alone and are left out), their results, and the pass's wall seconds."""

    batch: list[RequestState] = field(default_factory=list)
    results: list[P.VerifyResult] = field(default_factory=list)
    verify_s: float = 0.0
    num_forwards: int = 1  # more when a failing verify was split to find its culprits
    shadow_s: float = 0.0  # the target's worker drafting shadow drafts for it (Verified.shadow_s)
    prefilled: bool = False  # its forward also wrote prefill chunks (`SlotPhases.prefill_and_verify`)
    prefill_s: float = 0.0  # of that forward, the chunks' part (`SlotPhases._split_fused`), not the verify's
    on_share: bool = False  # the target ran it on its share of the cores (a drafter drafted on another worker
    #                         meanwhile), not on those it verifies with alone (`SlotPhases.on_share`)

    def live(self) -> VerifyOutcome:
        """This outcome without the requests that ended meanwhile (a follow-on's, after the slot before ended them; a
        pipelined pass's, aborted while it ran)."""
        if all(st.status == "running" for st in self.batch):
            return self
        live = [(st, r) for st, r in zip(self.batch, self.results) if st.status == "running"]
        return replace(self, batch=[st for st, _ in live], results=[r for _, r in live])

    @property
    def num_tokens(self) -> int:
        """Tokens the verify forward carried (each request's drafts and one more); 0 if it was split, also
        prefilled, or run on the target's share of the cores (no one forward of verify rows alone, on the threads
        the verify-cost model prices, to learn its cost from)."""
        if self.num_forwards != 1 or self.prefilled or self.on_share:
            return 0
        return sum(r.num_drafted + 1 for r in self.results)


class SlotPhases:
    """The coordinator's request tables (`requests`, `waiting`, `running`, the KV budget) and the phases that move
    requests through them. Owned by the Coordinator; both loops call it only through these public methods."""

    def __init__(self, cfg: SpindConfig, pool: WorkerPool, call_timeout_s: float = 300.0,
                 restarts: RestartPolicy | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.restarts = restarts or RestartPolicy()
        self.selector: Selector | None = None  # set before the first slot (Coordinator.start)
        self.tokenizer: Tokenizer | None = None  # the target's (Coordinator.start): the text of logprobs' tokens
        self.profile: SystemProfile | None = None  # the measured costs, when measured
        self.metrics = EngineMetrics()
        self.history = History()  # busy intervals, per-second throughput, latencies: for the dashboard
        self.times = SlotTimes()
        # until the workers say what they hold (kv_num_blocks = 0: each sizes its pools), the config's number
        self.budget = KVBudget(configured_kv_blocks(cfg), cfg.runtime.kv_block_size)
        self.prefix_hit_tokens = 0  # prompt tokens the target's prefix cache held (reused, not prefilled)
        self.max_batch_size = cfg.runtime.max_batch_size
        self.requests: dict[str, RequestState] = {}  # waiting + running
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.slot_id = 0
        self.drafter_counters = {d.name: SpecStats() for d in cfg.drafters}
        self.drafter_worker = {d.name: d.worker for d in cfg.drafters}
        self.capacity = Capacity({d.name: cfg.drafter_capacity(d.name) for d in cfg.drafters})
        self.worker_capacity = {w: cfg.worker_capacity(w) for w in set(self.drafter_worker.values())}
        self.model_drafters = {d.name for d in cfg.drafters if d.kind not in FREE_KINDS}  # with KV
        # free drafters beside the target: the target's worker drafts their shadow drafts as it verifies (shadow.py)
        self.shadowed = tuple(d.name for d in cfg.drafters if d.kind in FREE_KINDS and d.worker == TARGET_WORKER)
        self.shadows = ShadowDrafts()
        self._shadow_turn = 0  # counts selects: whose turn it is for shadow drafts
        self.all_threads = target_all_threads(cfg)  # the target's threads while nothing drafts elsewhere
        self.own_threads = threads_for(cfg, TARGET_WORKER)  # ... and while something does
        self._verify_threads: int | None = None  # `on_share`
        self.failure: str | None = None  # why the engine gave up (a worker that cannot be restarted)
        self.failed = asyncio.Event()  # set with failure
        self.idle = asyncio.Event()  # set while no request is waiting or running
        self.idle.set()
        self.wait_s = 0.0  # time of the current lockstep slot spent awaiting workers
        self.committed_tokens = 0  # output tokens committed so far (a slot's are the difference around it)
        self._trial: RegimeTrial | None = None  # the lockstep's regime trial (`regime_of`), made at its first slot
        self._held: list[tuple[RequestState, Delta]] | None = None  # deltas held back (hold_deltas), in order
        self._held_feedback: list[SlotFeedback] = []  # the selector's feedback held back with them

    # ---- the request tables -------------------------------------------------------------------------------------
    def add(self, st: RequestState) -> None:
        """A checked request joins the queue."""
        self.requests[st.req_id] = st
        self.waiting.append(st)
        self.idle.clear()

    def sync_kv_budget(self) -> None:
        """Admit against the smallest KV pool any worker holds (as its Ready reported; a restarted worker may have
        sized its pools anew)."""
        reported = [n for n in (self.pool.info(w).kv_num_blocks for w in self.pool.names) if n > 0]
        if reported:
            self.budget.num_blocks = min(reported)

    def workers_alive(self) -> bool:
        return all(self.pool.is_alive(n) for n in self.pool.names)

    def next_slot(self) -> int:
        """A new verify pass: its slot id (drafts and their probabilities are keyed by it)."""
        self.slot_id += 1
        return self.slot_id

    def record_slot(self, slot_s: float, overhead_s: float) -> None:
        """A slot's wall time and the part of it the coordinator itself spent (not awaiting workers)."""
        self.times.record(slot_s, overhead_s)
        self.metrics.slot.observe(slot_s)
        self.metrics.overhead.observe(overhead_s)

    def on_busy(self, worker: str, b: P.BusyInterval) -> None:
        """A worker reported what it was busy with (the pool's hook)."""
        self.metrics.busy.labels(worker=worker, kind=b.kind).inc(max(0.0, b.end - b.start))
        self.times.record_busy(b.kind, b.end - b.start)
        self.history.add_busy(worker, b)

    async def await_workers(self, aw):
        """Await worker replies, counting the time as the slot's waiting (not the coordinator's own) time."""
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            self.wait_s += time.perf_counter() - t0

    # ---- schedule -----------------------------------------------------------------------------------------------
    def schedule(self, busy: frozenset[str] = frozenset()) -> Chunks:
        """Finish aborted requests (but those in `busy`, in an op still in flight), admit waiting ones, plan this
        slot's prefill chunks."""
        for st in [s for s in self.running if s.is_abort_requested and s.req_id not in busy]:
            self.finish(st, "abort", detail="the client went away")
        n = num_admissible([st.num_blocks for st in self.waiting], len(self.running), self.max_batch_size,
                           self.budget)
        for _ in range(n):
            st = self.waiting.popleft()
            try:
                self._admit(st)
            except Exception as e:  # this request's data cannot even be sent (it passed the checks): it alone fails
                log.exception("admitting request %s", st.req_id)
                self.fail_requests(WorkerError(TARGET_WORKER, f"cannot send the request: {e}", [st.req_id]))
        pending = [st for st in self.running if not st.is_prefilled and st.fork_of is None]
        sizes = plan_prefill([st.num_prefill_left for st in pending], self.cfg.runtime.max_prefill_tokens)
        return [(st, size) for st, size in zip(pending, sizes) if size]

    def _admit(self, st: RequestState) -> None:
        self.budget.reserve(st.num_blocks)
        st.status = "running"
        self.running.append(st)
        self.metrics.prompt_tokens.inc(st.seq.num_prompt_tokens)
        if st.leader is not None and self._is_prefilling(st.leader):
            st.fork_of = st.leader  # its KV comes from the leader's prefill (prefilled), not a prefill of its own
            st.leader.forks.append(st)
        else:
            self.history.add_prompt_tokens(st.seq.num_prompt_tokens)
            self._add_to_target(st)
        name = st.req.drafter if st.req.drafter != AUTO else self.selector.precompute_hint(st.req_id)
        if name in self.model_drafters:  # the drafter it will most likely draft with: its KV is worth precomputing
            self._precompute(st, name)

    @staticmethod
    def _is_prefilling(st: RequestState) -> bool:
        """On the target with its own prompt still to prefill: its completions (n > 1) can wait to share its KV."""
        return st.status == "running" and st.fork_of is None and TARGET_WORKER in st.synced \
            and st.num_prefill_left > 0 and not st.seq.num_output_tokens

    def _add_to_target(self, st: RequestState) -> None:
        tokens = list(st.seq.token_ids)  # a snapshot: an in-process worker may read it after more commits
        self.pool.cast(TARGET_WORKER, P.AddRequest(0, st.req_id, tokens, st.seq.params, True,
                                                   num_output=st.seq.num_output_tokens))
        st.synced[TARGET_WORKER] = len(tokens)
        st.num_target_kv = 0

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

    # ---- select -------------------------------------------------------------------------------------------------
    @property
    def regime_trial(self) -> RegimeTrial | None:
        """Whether selection's speculation beats plain decoding, per batch size, measured on the lockstep's slots
        (`selection/regime.py`): with a selector that predicts a plain forward's seconds (`plain_seconds`: LBSS)
        and `[selection] regime_trial` on; else None."""
        if self._trial is None and self.cfg.selection.regime_trial and hasattr(self.selector, "plain_seconds"):
            self._trial = RegimeTrial(NUM_BUCKETS, self.selector.plain_seconds, seed=self.cfg.selection.seed)
        return self._trial

    @regime_trial.setter
    def regime_trial(self, trial: RegimeTrial | None) -> None:
        """Another trial (a test's scripted one); None: made afresh at the next slot, as configured."""
        self._trial = trial

    def describe_selection(self) -> dict | None:
        """The selector's describe() with the regime trial's under "regime"; None without a selector."""
        if self.selector is None:
            return None
        described = self.selector.describe()
        if self._trial is not None:
            described["regime"] = self._trial.describe()
        return described

    def regime_of(self, batch: list[RequestState]) -> str | None:
        """The regime this lockstep slot of `batch` (every request it verifies) runs in: `regime.SELECT` or
        `regime.PLAIN` (select(plain=True)); None where no trial runs, below its MIN_BATCH, or where no request
        leaves its drafter to spind."""
        trial = self.regime_trial
        if trial is None or len(batch) < MIN_BATCH or not any(st.req.drafter == AUTO for st in batch):
            return None
        return trial.regime(bucket_of(len(batch)), len(batch))

    def record_regime(self, regime: str | None, batch_size: int, tokens: int, seconds: float) -> None:
        """What a slot run in `regime` made: `tokens` committed in `seconds` of its wall time (0: not measured)."""
        if regime is not None and self._trial is not None:
            self._trial.record(bucket_of(batch_size), regime, tokens, batch_size, seconds)

    def select(self, ready: list[RequestState], held: dict[str, Arm] | None = None, plain: bool = False,
               ahead: bool = False) -> Selection:
        """Arms for `ready`, within each drafter's B_j and each worker's limit less what `held` (the arms other
        requests still run with: the pipeline selects some requests while others are mid-cycle) takes; and the
        precompute and shadow work they imply. Decides only: nothing is sent. plain: the requests that leave the
        drafter to spind decode plainly, unselected (no arm, no shadow drafts, no feedback: what `none` does; the
        lockstep's regime trial, `selection/regime.py`); those that named a drafter are selected as always. ahead:
        selected before the slot in flight commits (the lockstep's follow-on; `ShadowDrafts.due`)."""
        if plain:
            ready = [st for st in ready if st.req.drafter != AUTO]
        start = time.perf_counter()
        infos = [RequestInfo(req_id=st.req_id, requested=st.req.drafter, requested_k=st.req.k, current=st.arm,
                             num_prompt_tokens=st.seq.num_prompt_tokens, num_output_tokens=st.seq.num_output_tokens,
                             prompt_repetition=st.prompt_repetition) for st in ready]
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
        out = Selection()
        # shadow drafts for SHADOWED_PER_SLOT of the requests, in turn (`is_shadow_turn`: at batch 1 every slot, at
        # batch B each request every B-th), so their cost (~0.1 ms a request: the lookups, resolving them, learning
        # from them) stays one request's a slot, not the batch's (at batch 4 on alpaca, where nearly every slot decodes
        # plainly, it cost `spin` ~5% of `none`'s speed); the calibration they feed is the drafters', not the request's.
        # Each turn every free drafter, its own drafter's too (all SHADOW_K positions, past a cut draft); at batch 1
        # those whose last shadow draft of the request is decided (`ShadowDrafts.due`: paced)
        self._shadow_turn += 1
        for i, (st, arm) in enumerate(zip(ready, arms)):  # a worker's own limit, over all the drafters it hosts
            if arm.drafter is not None:
                w = self.drafter_worker[arm.drafter]
                used[w] = used.get(w, 0) + 1
                if used[w] > self.worker_capacity[w]:
                    arm = PLAIN_ARM
            out.arms[st.req_id] = arm
            st.cut = self.selector.cut_rule(st.req_id) if arm.drafter is not None else None
            if st.seq.params.is_greedy and st.req.drafter == AUTO and is_shadow_turn(self._shadow_turn, i, len(ready)) \
                    and self.selector.wants_shadow(st.req_id):
                st.shadow = self.shadows.due(st.req_id, self.shadowed, every_slot=len(ready) == 1, ahead=ahead)
            hint = self.selector.precompute_hint(st.req_id)
            if hint is not None and hint in self.model_drafters and hint not in st.precomputed:
                out.precompute.append((st, hint))
        share = (time.perf_counter() - start) / max(1, len(ready))  # what selecting cost, for the selector to weigh
        for st in ready:
            st.select_s = share
        return out

    def send_side_work(self, selection: Selection) -> None:
        """The drafter KV worth precomputing."""
        for st, drafter in selection.precompute:
            self._precompute(st, drafter)

    # ---- prefill, speculate, verify -----------------------------------------------------------------------------
    def prefill(self, chunks: Chunks, threads: int = 0) -> asyncio.Future:
        """Send the chunks' prefill to the target (at once); the future settles when it wrote their KV."""
        if not chunks:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut
        items = [P.PrefillItem(st.req_id, n) for st, n in chunks]
        return self.pool.cast(TARGET_WORKER, P.Prefill(0, items, threads))

    def prefilled(self, chunks: Chunks, reply: P.Prefilled | P.Verified | None) -> None:
        """The target wrote these chunks' KV (`reply` says how much of it its prefix cache held). A request whose
        prefill this completes gives its KV to the completions of its prompt waiting for it (n > 1), before any
        verify can add to it."""
        reused = reply.reused if reply is not None else [0] * len(chunks)
        for (st, n), r in zip(chunks, reused):
            st.num_target_kv += n
            if r:
                st.num_cached_tokens += r
                self.prefix_hit_tokens += r
                self.metrics.prefix_hit_tokens.inc(r)
            if st.forks and st.is_prefilled:
                self._fork(st)

    def _fork(self, leader: RequestState) -> None:
        for st in leader.forks:
            if st.status != "running" or st.fork_of is not leader:
                continue
            tokens = list(st.seq.token_ids)
            self.pool.cast(TARGET_WORKER, P.AddRequest(0, st.req_id, tokens, st.seq.params, True, leader.req_id))
            st.synced[TARGET_WORKER] = len(tokens)
            st.num_target_kv, st.fork_of = leader.num_target_kv, None
            self.metrics.shared_prompt_tokens.inc(leader.num_target_kv)
        leader.forks.clear()

    def _unfork(self, leader: RequestState) -> None:
        """The leader will not prefill (it ended, or the target restarted): its waiting completions prefill alone."""
        for st in leader.forks:
            if st.status == "running" and st.fork_of is leader:
                st.fork_of = None
                self._add_to_target(st)
        leader.forks.clear()

    def needs_draft(self, st: RequestState, arm: Arm) -> bool:
        """Drafted on a drafter worker (not plain, not inline beside the target, room left to draft)."""
        w = self.drafter_worker.get(arm.drafter)
        return w is not None and w != TARGET_WORKER and st.seq.max_draft(arm.k) > 0

    def propose_item(self, st: RequestState, arm: Arm, assume: list[int] | None = None) -> P.ProposeItem:
        """The Propose item of a request that needs a draft, on its drafter's worker; sends the mirror first if
        the worker never saw the request. `assume`: draft ahead, k + 1 tokens past these tentative ones (the
        first is the drafter's guess of the bonus token)."""
        w = self.drafter_worker[arm.drafter]
        k = arm.k + 1 if assume else st.seq.max_draft(arm.k)
        self._ensure_mirror(st, w)
        base, tokens = st.synced[w], st.seq.token_ids
        st.synced[w] = len(tokens)
        st.precomputed.add(arm.drafter)
        return P.ProposeItem(req_id=st.req_id, drafter=arm.drafter, base_len=base, new_tokens=tokens[base:], k=k,
                             assume=assume or [])

    async def propose(self, worker: str, items: list[P.ProposeItem]) -> dict[str, P.DraftRecord]:
        """One Propose on one drafter worker; if it fails as a whole its requests just go without drafts."""
        try:
            reply = await self.pool.call(worker, P.Propose(0, self.slot_id, items), self.call_timeout_s)
        except WorkerError as e:
            if e.req_ids:
                raise
            log.warning("%s; its requests decode without a draft this time", e)
            return {}
        return {d.req_id: d for d in reply.drafts}

    async def prefill_and_speculate(self, chunks: Chunks, ready: list[RequestState], arms: dict[str, Arm],
                                    threads: int = 0) -> dict[str, P.DraftRecord]:
        """The lockstep slot's first half: the target prefills the chunks while the drafter workers draft, all
        concurrently. The prefill is accounted for whatever happened to the drafters; a drafter's failure is
        raised first, then the target's."""
        prefill = self.prefill(chunks, threads)  # sent first
        proposes: dict[str, list[P.ProposeItem]] = {}
        for st in ready:
            arm = arms.get(st.req_id, PLAIN_ARM)  # a request left out of the selection (select(plain=True)): plain
            if self.needs_draft(st, arm):
                proposes.setdefault(self.drafter_worker[arm.drafter], []).append(self.propose_item(st, arm))
        *parts, prefilled = await self.await_workers(asyncio.gather(
            *(self.propose(w, items) for w, items in proposes.items()), prefill, return_exceptions=True))
        if not isinstance(prefilled, BaseException):
            self.prefilled(chunks, prefilled)
        drafts: dict[str, P.DraftRecord] = {}
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            drafts.update(part)
        if isinstance(prefilled, BaseException):
            raise prefilled
        return drafts

    def target_threads(self, arms: dict[str, Arm]) -> int:
        """All cores for the target while nothing drafts on another worker meanwhile, else its own share."""
        if not self.cfg.runtime.adaptive_threads or self.pool.info(TARGET_WORKER).device != "cpu":
            return 0
        drafting = any(self.drafter_worker.get(a.drafter, TARGET_WORKER) != TARGET_WORKER for a in arms.values())
        return 0 if drafting else self.all_threads

    def on_share(self, threads: int) -> bool:
        """Whether a verify sent with `threads` (`target_threads`) runs on fewer threads than the target verifies
        with while nothing drafts beside it (`placement.verify_threads`, what the profile times)."""
        if self._verify_threads is None:  # the target's device is known once its worker greeted
            self._verify_threads = verify_threads(self.cfg, self.pool.info(TARGET_WORKER).device)
        return (threads or self.own_threads) < self._verify_threads

    def fuses(self, chunks: Chunks, batch: list[RequestState]) -> bool:
        """Whether this slot's prefill chunks ride in its verify's forward (`prefill_and_verify`): there are both,
        and no chunk's request has completions of its prompt waiting for its KV (they copy it before any verify
        adds to it)."""
        return self.cfg.runtime.fuse_prefill and bool(chunks) and bool(batch) and not any(st.forks for st, _ in chunks)

    def drafts_elsewhere(self, ready: list[RequestState], arms: dict[str, Arm]) -> bool:
        """Whether a drafter worker drafts for any of `ready` under `arms` this slot (a prefill op on the target
        would overlap that drafting)."""
        return any(self.needs_draft(st, arms.get(st.req_id, PLAIN_ARM)) for st in ready)

    async def prefill_and_verify(self, chunks: Chunks, batch: list[RequestState], arms: dict[str, Arm],
                                 drafts: dict[str, P.DraftRecord], threads: int = 0,
                                 items: dict[str, P.VerifyItem] | None = None, slot: int | None = None
                                 ) -> VerifyOutcome:
        """The chunks' prefill, then the batch's verify. Where `fuses`, as one op (`Verify.prefill`): one forward
        computes both, reading the weights once (on a CPU they are most of a forward's time: a slot admitting
        prompts paid two passes). A fused op that fails changed nothing on the target; the slot then runs the two
        ops as without fusing (the prefill, then the verify that fails its culprits alone)."""
        fused = self.fuses(chunks, batch)
        if fused:
            if items is None:
                items = self.verify_items(batch, arms, drafts)
            prefill = [P.PrefillItem(st.req_id, n) for st, n in chunks]
            msg = P.Verify(0, self.slot_id if slot is None else slot, [items[st.req_id] for st in batch], threads,
                           prefill=prefill)
            try:
                reply = await self.await_workers(self._call_target(msg))
            except WorkerError as e:
                log.info("a verify with prefill chunks failed (%s); prefilling, then verifying apart", e)
            else:
                outcome = self._verified(batch, reply, threads)
                self.prefilled(chunks, reply)
                self._split_fused(outcome, sum(b.end - b.start for b in reply.busy if b.kind == "prefill"))
                return outcome
        self.prefilled(chunks, await self.await_workers(self.prefill(chunks, threads)))
        if not batch:
            return VerifyOutcome()
        outcome = await self.verify_isolating(batch, arms, drafts, threads, items, slot)
        outcome.num_forwards += fused  # the failed one too: no one forward's time to learn from
        return outcome

    def _split_fused(self, outcome: VerifyOutcome, prefill_s: float) -> None:
        """A fused forward's seconds split between its verify and its chunks. The worker splits them by rows, but a
        forward's cost is not proportional to its rows (a 16-row verify is ~10% of the rows beside a 150-token chunk
        and ~40% of the seconds, streaming the weights): what the selector's rewards and the regime trial read as the
        verify's seconds is then what the cost model predicts the verify alone costs (`verify_seconds`, where the
        selector has one), at most the whole forward; the rest is the chunks'."""
        outcome.prefilled = True
        whole = outcome.verify_s + prefill_s
        predict = getattr(self.selector, "verify_seconds", None)
        alone = None if predict is None else predict(len(outcome.batch),
                                                     sum(r.num_drafted + 1 for r in outcome.results))
        if alone is not None:
            outcome.verify_s = min(whole, alone)
        outcome.prefill_s = whole - outcome.verify_s

    def verify_items(self, batch: list[RequestState], arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                     caps: dict[str, int] | None = None) -> dict[str, P.VerifyItem]:
        """What the target verifies for each request, from its arm, its draft and its state now: an inline drafter
        drafts at most the request's `max_draft` (or its `caps` entry, where lower), its cut (`CutRule`) and the
        shadow drafts selection asked of this pass go with it."""
        items = {}
        for st in batch:
            arm = arms.get(st.req_id, PLAIN_ARM)
            d = drafts.get(st.req_id)
            # a speculating request with a grammar: the tokens the grammar forces may lengthen its draft up to this
            forced = st.seq.max_draft(arm.k + MAX_FORCED) if arm.drafter and st.seq.params.grammar else 0
            if arm.drafter is not None and self.drafter_worker[arm.drafter] == TARGET_WORKER:
                k = st.seq.max_draft(arm.k)
                if caps is not None and st.req_id in caps:
                    k = min(k, caps[st.req_id])
                values, prices = (list(st.cut.values), list(st.cut.prices)) if st.cut else ([], [])
                item = P.VerifyItem(st.req_id, [], inline_drafter=arm.drafter, k=k, max_draft=forced,
                                    cut_values=values, cut_prices=prices)
            elif d is not None:
                item = P.VerifyItem(st.req_id, d.tokens, d.has_probs, d.slot, max_draft=forced)
            else:
                item = P.VerifyItem(st.req_id, [], max_draft=forced)
            if st.shadow:
                item.shadow, item.shadow_k = st.shadow, SHADOW_K
            items[st.req_id] = item
        return items

    async def verify_pass(self, batch: list[RequestState], arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                          threads: int = 0, items: dict[str, P.VerifyItem] | None = None,
                          slot: int | None = None) -> VerifyOutcome:
        """One verify forward on the target: `items` as built when the pass was decided (`verify_items`; built now
        where None), sent as slot `slot` (the current slot where None)."""
        if items is None:
            items = self.verify_items(batch, arms, drafts)
        if not batch:
            return VerifyOutcome()
        msg = P.Verify(0, self.slot_id if slot is None else slot, [items[st.req_id] for st in batch], threads)
        return self._verified(batch, await self.await_workers(self._call_target(msg)), threads)

    def send_follow_on(self, batch: list[RequestState], items: dict[str, P.VerifyItem], threads: int,
                       slot: int) -> Awaitable[VerifyOutcome]:
        """A follow-on's verify (`Verify.follows`), sent before this returns, so that it reaches the target's worker
        ahead of anything sent after (a retry of the verify it follows, above all); the awaitable gives its outcome.
        Its wait is counted by the slot that awaits it."""
        msg = P.Verify(0, slot, [items[st.req_id] for st in batch], threads, follows=True)
        reply = self.pool.start_call(TARGET_WORKER, msg, self.call_timeout_s)

        async def outcome() -> VerifyOutcome:
            return self._verified(batch, await reply, threads)
        return outcome()

    def _verified(self, batch: list[RequestState], reply: P.Verified, threads: int) -> VerifyOutcome:
        if [r.req_id for r in reply.results] != [st.req_id for st in batch]:
            raise WorkerError(TARGET_WORKER, "verify results do not match the batch")
        self.times.grammar_s += reply.grammar_s
        return VerifyOutcome(list(batch), reply.results, reply.verify_s, shadow_s=reply.shadow_s,
                             on_share=self.on_share(threads))

    async def _call_target(self, msg: object) -> object:
        """pool.call to the target; deltas and feedback held back (`hold_deltas`) are released once the op is on its
        way, so the front ends write and the selector learns while the target computes."""
        if self._held is None:
            return await self.pool.call(TARGET_WORKER, msg, self.call_timeout_s)
        reply = self.pool.start_call(TARGET_WORKER, msg, self.call_timeout_s)  # the op is on its way
        self.flush_deltas()
        return await reply

    async def verify_isolating(self, batch: list[RequestState], arms: dict[str, Arm],
                               drafts: dict[str, P.DraftRecord], threads: int = 0,
                               items: dict[str, P.VerifyItem] | None = None, slot: int | None = None
                               ) -> VerifyOutcome:
        """One verify forward; but a verify that fails without naming its culprits (the target changed nothing)
        is retried on each half of the batch, down to the single requests that fail; those are failed alone."""
        try:
            return await self.verify_pass(batch, arms, drafts, threads, items, slot)
        except WorkerError as e:
            if e.req_ids:
                raise
            if len(batch) == 1:
                self.fail_requests(WorkerError(e.name, str(e), [batch[0].req_id]))
                return VerifyOutcome()
        out = VerifyOutcome(num_forwards=0)
        mid = len(batch) // 2
        for half in (batch[:mid], batch[mid:]):
            part = await self.verify_isolating(half, arms, drafts, threads, items, slot)
            out.batch += part.batch
            out.results += part.results
            out.verify_s += part.verify_s
            out.num_forwards += part.num_forwards
            out.shadow_s += part.shadow_s
        return out

    # ---- update -------------------------------------------------------------------------------------------------
    def update(self, outcome: VerifyOutcome, arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
               shadow: dict[str, list[str]] | None = None) -> None:
        """Commit what the verify accepted (stop rules), feed the selector, stream a delta per request. shadow: the
        drafters each request's pass shadowed, where selection has since chosen for a later pass (a follow-on);
        None: each request's `shadow` as it is."""
        now = time.perf_counter()
        feedback = [f for st, r in zip(outcome.batch, outcome.results)
                    if (f := self._commit(st, r, arms, drafts, outcome, now, shadow)) is not None]
        self.history.add_queue(len(self.running), len(self.waiting))
        if not feedback:
            return
        if self._held is None:
            self.selector.observe(feedback)
        else:  # the selector learns from it after the next pass is dispatched (flush_deltas), off its critical path
            self._held_feedback.extend(feedback)

    def _commit(self, st: RequestState, r: P.VerifyResult, arms: dict[str, Arm], drafts: dict[str, P.DraftRecord],
                outcome: VerifyOutcome, now: float, shadow: dict[str, list[str]] | None = None) -> SlotFeedback | None:
        seq = st.seq
        arm = arms.get(st.req_id, PLAIN_ARM)
        seq.stats.record(r.num_drafted, r.num_accepted)
        name = arm.drafter or PLAIN
        if arm.drafter is not None and r.num_drafted:
            st.per_drafter.setdefault(name, SpecStats()).record(r.num_drafted, r.num_accepted)
            self.drafter_counters[name].record(r.num_drafted, r.num_accepted)
            self.metrics.record_verify(name, r.num_drafted, r.num_accepted)
        names = st.shadow if shadow is None else shadow.get(st.req_id, ())
        if shadow is None:
            st.shadow = []
        taken = self.shadows.add(st.req_id, len(seq.token_ids), r.shadow, r.shadow_confidence,
                                 (len(r.tokens), arm.drafter if r.num_drafted else ""),
                                 every_slot=len(outcome.batch) == 1)
        shadowed = arm.drafter is not None and arm.drafter in names and arm.drafter in taken
        kept = seq.append(r.tokens)
        self.committed_tokens += len(kept)
        if seq.params.grammar is not None:
            self.times.grammar_tokens += len(kept)
        st.num_target_kv = len(seq.token_ids) - 1
        st.synced[TARGET_WORKER] = len(seq.token_ids)
        d = drafts.get(st.req_id)
        draft_s = d.draft_s if d is not None else r.draft_s
        switch_s = d.switch_s if d is not None else r.switch_s  # a drafter's catch-up: the switch's cost, not drafting
        st.draft_s += draft_s
        st.verify_s += outcome.verify_s
        st.arms_used.append(arm.name)
        feedback = None
        if st.req_id in arms:
            st.arm = arm
            decided = self.shadows.resolve(st.req_id, seq.token_ids, seq.is_finished)
            feedback = SlotFeedback(
                req_id=st.req_id, arm=arm, num_drafted=r.num_drafted, num_accepted=r.num_accepted,
                num_committed=len(kept), draft_s=max(0.0, draft_s - switch_s), verify_s=outcome.verify_s,
                switch_s=switch_s, batch_size=len(outcome.batch),
                batch_tokens=outcome.num_tokens, shadow=tuple(d[:3] for d in decided), shadowed=shadowed,
                shadow_slot=tuple(d.slot for d in decided),
                shadow_confidence=tuple((d.drafter, d.confidence, d.accepted) for d in decided if d.confidence),
                select_s=st.select_s + outcome.shadow_s / max(1, len(outcome.batch)))
            st.select_s = 0.0
        self.metrics.generation_tokens.inc(len(kept))
        self.history.add_step(name, len(kept), r.num_drafted, r.num_accepted)
        if kept and st.first_token_at is None:
            st.first_token_at = now
            self.metrics.ttft.observe(now - st.arrival)
            self.history.add_ttft(now - st.arrival)
        logprobs = None if r.logprobs is None else output_logprobs(self.tokenizer, kept, r.logprobs[:len(kept)])
        if seq.is_finished:
            self.finish(st, seq.finish_reason, kept, logprobs=logprobs)
        else:
            self._emit(st, Delta(kept, self._text_delta(st, visible_len(seq.text, seq.params.stop)), logprobs=logprobs))
        return feedback

    # ---- streaming ----------------------------------------------------------------------------------------------
    def _emit(self, st: RequestState, delta: Delta) -> None:
        """A delta onto its request's stream, or held back in order while `hold_deltas` is on."""
        delta.index = st.index
        if self._held is None:
            st.queue.put_nowait(delta)
        else:
            self._held.append((st, delta))

    def hold_deltas(self) -> None:
        """Hold the deltas of what completes now until `flush_deltas`: waking the front ends (an SSE chunk per request
        and token) is then scheduled after the next verify pass was dispatched, not before it, so the target does not
        idle while the tokens are written (~0.3-1 ms a slot on a 2-core CPU). The selector's feedback is held with
        them (its observe, ~0.15 ms a slot at 4 requests): selection then reads rewards one pass old, which a bandit
        does not notice, and the target does not wait for the bookkeeping."""
        if self._held is None:
            self._held = []

    def flush_deltas(self) -> None:
        held, self._held = self._held, None
        for st, delta in held or ():
            st.queue.put_nowait(delta)
        feedback, self._held_feedback = self._held_feedback, []
        if feedback:
            self.selector.observe(feedback)

    def _text_delta(self, st: RequestState, end: int) -> str:
        text = st.seq.text[st.num_streamed_chars:end]
        st.num_streamed_chars = max(st.num_streamed_chars, end)
        return text

    # ---- finishing, faults --------------------------------------------------------------------------------------
    def finish(self, st: RequestState, reason: str, token_ids: list[int] | None = None, detail: str = "",
               logprobs: list[P.OutputLogprobs] | None = None) -> None:
        """Last delta (with usage) to the consumer; free the request everywhere; release its KV."""
        if st.status == "finished":
            return
        if st.status == "running":
            self.running.remove(st)
            self.budget.release(st.num_blocks)
            for name in st.synced:
                self.pool.cast(name, P.FreeRequests(0, [st.req_id]))
            self.selector.remove(st.req_id)
            self.shadows.remove(st.req_id)
        elif st in self.waiting:
            self.waiting.remove(st)
        st.status = "finished"
        if st.forks:
            self._unfork(st)
        st.seq.finish_reason = st.seq.finish_reason or reason
        st.finish_detail = st.finish_detail or detail
        self.requests.pop(st.req_id, None)
        if not self.requests:
            self.idle.set()
        s = st.seq.stats
        usage = Usage(prompt_tokens=st.seq.num_prompt_tokens, completion_tokens=st.seq.num_output_tokens,
                      drafters={n: {"drafted": c.num_drafted, "accepted": c.num_accepted}
                                for n, c in st.per_drafter.items()},
                      num_steps=s.num_steps, mean_accepted_length=s.mean_accepted_length,
                      finish_detail=st.finish_detail, draft_s=st.draft_s, verify_s=st.verify_s, arms=st.arms_used,
                      cached_tokens=st.num_cached_tokens)
        self._emit(st, Delta(token_ids or [], self._text_delta(st, len(st.seq.text)), st.seq.finish_reason, usage,
                             logprobs))
        self.metrics.requests.labels(status=st.seq.finish_reason).inc()
        latency_s = time.perf_counter() - st.arrival
        self.metrics.latency.observe(latency_s)
        self.history.add_latency(latency_s)

    def finish_all(self, detail: str, running_only: bool = False) -> None:
        """Abort every running (and, unless running_only, waiting) request."""
        for st in list(self.running) + ([] if running_only else list(self.waiting)):
            self.finish(st, "abort", detail=detail)

    def fail_requests(self, e: WorkerError) -> None:
        """A worker op failed and changed nothing: fail the requests it names alone (the others run again
        next slot); an op that failed as a whole fails the slot's requests."""
        victims = [self.requests[r] for r in e.req_ids if r in self.requests] if e.req_ids else list(self.running)
        log.error("%s; failing %d request(s)", e, len(victims))
        for st in victims:
            self.metrics.failed.inc()
            self.finish(st, "abort", detail=f"the request failed: {e}")

    async def recover(self) -> None:
        """Restart dead workers (within the restart policy); re-add the target's requests from the committed
        sequences, to be re-prefilled chunk by chunk; drafter mirrors resync lazily on their next use. A worker
        that cannot be restarted fails the engine: every request is aborted."""
        for name in [n for n in self.pool.names if not self.pool.is_alive(n)]:
            self.metrics.restarts.labels(worker=name).inc()
            try:
                if not self.restarts.allow(name, time.monotonic()):
                    raise WorkerDied(name, f"restarted {self.restarts.max_restarts} times within "
                                           f"{self.restarts.window_s:.0f} s; giving up")
                await self.pool.restart(name)
                self.sync_kv_budget()
            except Exception as e:
                log.error("cannot restart worker %s: %s; failing all requests", name, e)
                self.failure = f"worker {name!r} cannot be restarted: {e}"
                self.failed.set()
                self.finish_all(self.failure)
                return
            hosted = set(self.pool.info(name).drafters)
            for st in self.running:
                st.synced.pop(name, None)
                st.precomputed -= hosted
                if name == TARGET_WORKER:  # each prefills its own sequence again: nothing is shared
                    st.fork_of = None
                    st.forks.clear()
                    self._add_to_target(st)
