"""A worker: hosts the target verifier (worker "target") and the drafters whose `worker` names it, and
answers the coordinator's ops one at a time. No I/O here: the process main (`spind.worker.main`) and the
in-process pool (`spind.coordinator.transport.pool`) both drive `Worker.answer`.

State: a mirror of each request it serves, keyed by req_id: its sampling params and the committed tokens
it knows of. `AddRequest` sends them whole; `Propose`/`Precompute` send only the tokens committed since;
the target worker extends its own mirror with what it verifies (the coordinator commits exactly that, or
finishes the request). The coordinator owns the truth; a worker never decides what is committed.

Drafters hosted beside the target draft *inline*: a Verify names them and the target worker drafts right
before verifying, with no round trip and no queueing behind other ops (n-gram lookup, by default).

Device work is timed through one `DeviceClock` (spind/worker/device.py), which waits for the device first. An op
that loses the device (a sticky CUDA error) is not answered: `answer` raises it, and the process exits to be
restarted (spind/worker/main.py), since every later op would fail the same way.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spind import protocol as P
from spind.config import TARGET_WORKER, DrafterConfig, SpindConfig, canonical_device, is_cuda, resolve_dtype
from spind.draft_cut import CutRule
from spind.drafters import Drafter, DraftInput, load_drafter_model, make_drafter, resolve_head_dir
from spind.drafters.base import cut_at
from spind.drafters.eagle import make_eagle_drafters
from spind.grammar import Grammars
from spind.models.llama import LlamaModel, layer_subset, load_llama
from spind.models.loader import resolve_model_dir
from spind.models.runner import ModelRunner, resolve_kv_dtype
from spind.params import SamplingParams
from spind.tokenizer import Tokenizer
from spind.worker.device import DeviceClock, bf16_supported, device_name, is_fatal_device_error, pin_device
from spind.worker.memory import memory_baseline, num_kv_blocks
from spind.worker.probs import ProbsReceiver, ProbsSender
from spind.worker.profile import probe_prompt, time_draft_tokens, time_verify
from spind.worker.target import RequestFailed, TargetVerifier, VerifyItem
from spind.worker.tensor_parallel import LeaderRunner, TargetGroup, cpu_threads, start_group

log = logging.getLogger(__name__)

PRECOMPUTE_CHUNK = 256  # tokens one precompute step feeds, so it never holds up a Propose for long
PROBS_TIMEOUT_S = 30.0


def shared_self_draft(dc: DrafterConfig, target: LlamaModel | None) -> LlamaModel | None:
    """A `layers` self-draft hosted beside its (float) target: a view of the target's own modules, no second copy
    of the weights; None where it must be loaded apart (another worker, a quantized target, another variant)."""
    if (target is None or dc.kind != "self" or dc.variant != "layers" or target.quantized is not None
            or target.shard is not None):  # a tensor-parallel target's layers hold one rank's heads
        return None
    return layer_subset(target, dc.layers)


def whole_embedding(model_dir, target: LlamaModel):
    """The token embedding of a tensor-parallel target, whole, on rank 0 (a feature-level draft head embeds its own
    tokens; the target's embedding lookup is split over the ranks): read from the checkpoint, in the target's dtype."""
    import torch

    from spind.models.loader import read_tensors, weight_files

    (_, weight), = read_tensors(weight_files(model_dir), ["model.embed_tokens.weight"], str(target.device))
    return torch.nn.Embedding.from_pretrained(weight.to(target.dtype), freeze=True)


@dataclass
class Mirror:
    params: SamplingParams
    tokens: list[int]  # committed sequence as known to this worker
    num_prompt: int = 0  # ... of which the prompt (the rest is output)


class Worker:
    """Everything one worker hosts, and the handling of one op at a time."""

    def __init__(self, name: str, cfg: SpindConfig, probs_out: ProbsSender | None = None,
                 probs_in: ProbsReceiver | None = None, device: str | None = None,
                 clock: DeviceClock | None = None, group_devices: list[str] | None = None) -> None:
        """`device`: the worker's device as this process names it (a process worker sees its GPU as cuda:0, see
        spind/coordinator/transport/process_pool.py); by default the config's. `clock`: tests count its reads.
        `group_devices`: a tensor-parallel target's devices, rank by rank, as this process names them (by default
        the config's)."""
        self.name = name
        self.config_device = cfg.worker(name).device  # what the coordinator and the operator call it
        self.device = canonical_device(device or self.config_device)
        pin_device(self.device)  # before any CUDA work
        baseline = memory_baseline(self.device)
        self.clock = clock or DeviceClock(self.device)
        model_dir = resolve_model_dir(cfg.model.target, cfg.cache_path)
        self.dtype = resolve_dtype(cfg, model_dir, self.device, bf16_supported(self.device))
        tokenizer = Tokenizer(model_dir)
        self.probs_out, self.probs_in = probs_out, probs_in
        # every model first, then their KV pools: "auto" sizes the pools from what the models leave of the device
        wc = cfg.worker(name)
        self.group: TargetGroup | None = None  # a tensor-parallel target's other ranks
        self.ranks: list[str] = []  # its devices, as configured
        target = None
        if name == TARGET_WORKER and wc.tensor_parallel > 1:
            self.ranks = list(wc.group_devices)
            devices = [canonical_device(d) for d in (group_devices or self.ranks)]
            self.group = start_group(cfg, model_dir, self.dtype, [self.device, *devices[1:]])
            target = self.group.model
        elif name == TARGET_WORKER:
            target = load_llama(model_dir, self.dtype, self.device)
        try:
            self._host(cfg, model_dir, tokenizer, target, baseline)
        except BaseException:
            self.close()
            raise
        self.threads = self._threads_now = 0  # set by ready(): the worker's own torch thread count
        self.shadow_s = 0.0  # the last verify's shadow drafting (Verified.shadow_s)
        self.last_verify_ok = False  # the last Verify answered succeeded (a follow-on runs only after one that did)

    def close(self) -> None:
        """Stop what this worker started outside its process's memory: a tensor-parallel target's other ranks."""
        if self.group is not None:
            self.group.close()

    def _host(self, cfg: SpindConfig, model_dir, tokenizer: Tokenizer, target: LlamaModel | None, baseline) -> None:
        """The drafters' models, every KV pool, the target's verifier and the drafters."""
        name, r = self.name, cfg.runtime
        hosted = [d for d in cfg.drafters if d.worker == name]
        drafter_models = {d.name: shared_self_draft(d, target) or
                          load_drafter_model(d, cfg, model_dir, tokenizer, self.device, self.dtype) for d in hosted}
        kv = [(m, resolve_kv_dtype("auto", m, r.attention)) for m in drafter_models.values() if m is not None]
        if target is not None:
            kv.insert(0, (target, resolve_kv_dtype(r.kv_cache_dtype, target, r.attention)))
        max_len = min([cfg.model.max_model_len, *(m.args.max_position for m, _ in kv)])
        num_blocks = num_kv_blocks(cfg, name, self.device, kv, max_len, baseline)
        self.target: TargetVerifier | None = None
        if target is not None:
            ks = sorted({cfg.speculation.k, *cfg.selection.k_set})
            if self.group is not None:
                runner = LeaderRunner(self.group, target, num_blocks, r.kv_block_size, r.attention,
                                      cfg.model.max_model_len, r.max_batch_size, kv_cache_dtype=r.kv_cache_dtype,
                                      prefix_caching=r.prefix_caching)
            else:
                runner = ModelRunner(target, num_blocks, r.kv_block_size, r.attention, cfg.model.max_model_len,
                                     r.max_batch_size, cuda_graphs=r.cuda_graphs,
                                     graph_query_lens=tuple(sorted({1, *(k + 1 for k in ks)})),
                                     kv_cache_dtype=r.kv_cache_dtype, prefix_caching=r.prefix_caching)
            self.target = TargetVerifier(runner,
                                         Grammars(model_dir / "tokenizer.json", target.args.vocab_size,
                                                  sorted(tokenizer.eos_token_ids)))
        eagles = [d for d in hosted if d.kind == "eagle"]
        if eagles and self.target is None:
            raise ValueError(f"worker {name!r}: eagle drafters ({', '.join(d.name for d in eagles)}) run on the "
                             f"target's worker")
        heads = make_eagle_drafters(eagles, self.target, resolve_head_dir,
                                    lambda: whole_embedding(model_dir, target)) if eagles else {}
        self.drafters: dict[str, Drafter] = {
            d.name: heads[d.name] if d.kind == "eagle" else make_drafter(d, cfg, drafter_models[d.name], num_blocks)
            for d in hosted}
        for drafter in self.drafters.values():  # they run on this worker's device
            drafter.clock = self.clock
        self.drafter_reqs: dict[str, set[str]] = {n: set() for n in self.drafters}
        self.mirrors: dict[str, Mirror] = {}
        self.precompute_queue: deque[tuple[str, str]] = deque()  # (req_id, drafter)
        self.busy: list[P.BusyInterval] = []  # since the last reply
        self.max_model_len = self.target.max_model_len if self.target else cfg.model.max_model_len

    def _runners(self) -> dict[str, ModelRunner]:
        runners = {TARGET_WORKER: self.target.runner} if self.target else {}
        runners.update({n: d.runner for n, d in self.drafters.items() if hasattr(d, "runner")})
        return runners

    def ready(self, num_threads: int) -> P.Ready:
        self.threads = self._threads_now = num_threads
        free = [r.kv.num_free_blocks for r in self._runners().values()]  # a CUDA graph's padding block is taken
        return P.Ready(name=self.name, pid=os.getpid(), is_target=self.target is not None,
                       drafters=sorted(self.drafters), max_model_len=self.max_model_len, num_threads=num_threads,
                       device=self.config_device, dtype=self.dtype, device_name=device_name(self.device),
                       kv_num_blocks=min(free, default=0),
                       vocab_size=self.target.runner.model.args.vocab_size if self.target is not None else 0,
                       ranks=self.ranks)

    # ---- dispatch -------------------------------------------------------------------------------
    def answer(self, msg: object) -> object:
        """One op -> its reply; a failure becomes an ErrorReply naming the requests at fault, if known. A lost
        device is raised, not answered: the worker cannot go on (see is_fatal_device_error)."""
        seq = getattr(msg, "seq", -1)
        try:
            return self.handle(msg)
        except RequestFailed as e:
            return P.ErrorReply(seq, str(e), e.req_ids)
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            return P.ErrorReply(seq, f"{type(e).__name__}: {e}")  # the op failed as a whole; the worker lives on

    def handle(self, msg: object) -> object:
        if isinstance(msg, P.AddRequest):
            self.add_request(msg)
            return self._ack(msg.seq)
        if isinstance(msg, P.Prefill):
            self._use_threads(msg.threads)
            reused = self.prefill(msg.items)
            return P.Prefilled(msg.seq, reused, self._take_busy())
        if isinstance(msg, P.Propose):
            return P.Proposed(msg.seq, self.propose(msg.slot, msg.items), self._take_busy())
        if isinstance(msg, P.Verify):
            if msg.follows and not self.last_verify_ok:  # what it follows did not happen as its sender assumed
                return P.ErrorReply(msg.seq, P.FOLLOW_REFUSED)
            self.last_verify_ok = False
            self._use_threads(msg.threads)
            results, verify_s, reused = self.verify(msg.slot, msg.items, msg.prefill)
            self.last_verify_ok = True
            return P.Verified(msg.seq, results, verify_s, self._take_busy(), self._target().grammar_s, self.shadow_s,
                              reused)
        if isinstance(msg, P.Precompute):
            self.enqueue_precompute(msg.items)
            return self._ack(msg.seq)
        if isinstance(msg, P.FreeRequests):
            for req_id in msg.req_ids:
                self.free_request(req_id)
            return self._ack(msg.seq)
        if isinstance(msg, P.ForgetFinished):
            for drafter in self.drafters.values():
                drafter.forget_finished()
            if self.target is not None:
                self.target.reset_prefix_cache()
            return self._ack(msg.seq)
        if isinstance(msg, P.Profile):
            return self.profile(msg)
        if isinstance(msg, P.Ping):
            return self.stats(msg.seq)
        raise ValueError(f"worker cannot handle {type(msg).__name__}")

    def _use_threads(self, threads: int) -> None:
        """Run this op with `threads` torch threads (0: the worker's own count). The coordinator asks for all
        cores when nothing drafts meanwhile, so plain decoding is never held to a share of the machine."""
        want = threads or self.threads
        if self.group is not None and not is_cuda(self.device):  # every rank runs at once: a share each
            want = cpu_threads(want, self.group.world)
        if want != self._threads_now:
            import torch

            torch.set_num_threads(want)
            self._threads_now = want

    def _ack(self, seq: int) -> P.Ack:
        return P.Ack(seq, self._take_busy())

    def _take_busy(self) -> list[P.BusyInterval]:
        busy, self.busy = self.busy, []
        return busy

    def _timed(self, kind: str, num_reqs: int, fn, drafter: str = ""):
        """fn(), recorded as a busy interval of the device (self.busy[-1]: its seconds are end - start)."""
        start = self.clock.now()
        try:
            return fn()
        finally:
            self.busy.append(P.BusyInterval(kind, start, self.clock.now(), num_reqs, drafter))

    def _last_busy_s(self) -> float:
        return self.busy[-1].end - self.busy[-1].start

    # ---- request lifecycle ----------------------------------------------------------------------
    def add_request(self, msg: P.AddRequest) -> None:
        if not msg.tokens:
            raise ValueError(f"{msg.req_id}: empty token list")
        if msg.req_id in self.mirrors:  # a resync: start over from the full sequence
            self.free_request(msg.req_id, finished=False)
        params = msg.params.validate()
        if msg.is_target:
            if self.target is None:
                raise ValueError(f"worker {self.name!r} does not host the target")
            if msg.fork_of is None:
                self.target.add_request(msg.req_id, msg.tokens, params, msg.num_output)
            elif self._mirror(msg.fork_of).tokens != msg.tokens:
                raise ValueError(f"{msg.req_id}: its tokens are not those of {msg.fork_of}, whose KV it would share")
            else:
                self.target.fork(msg.fork_of, msg.req_id, params)
        self.mirrors[msg.req_id] = Mirror(params, list(msg.tokens), len(msg.tokens) - msg.num_output)

    def free_request(self, req_id: str, finished: bool = True) -> None:
        mirror = self.mirrors.get(req_id)
        if mirror is not None and finished:
            for drafter in self.drafters.values():
                drafter.observe_finished(req_id, mirror.tokens[mirror.num_prompt:])
        if self.target is not None:
            self.target.free_request(req_id)
        for name, reqs in self.drafter_reqs.items():
            if req_id in reqs:
                self.drafters[name].free_request(req_id)
                reqs.discard(req_id)
        self.mirrors.pop(req_id, None)

    def _mirror(self, req_id: str) -> Mirror:
        m = self.mirrors.get(req_id)
        if m is None:
            raise ValueError(f"{req_id}: unknown request on worker {self.name!r}")
        return m

    def _sync(self, req_id: str, drafter: str, base_len: int, new_tokens: list[int]) -> Mirror:
        """Apply the coordinator's news to the mirror; make sure `drafter` holds the request."""
        m = self._mirror(req_id)
        if len(m.tokens) != base_len:
            raise ValueError(f"{req_id}: mirror has {len(m.tokens)} tokens, coordinator assumed {base_len}")
        m.tokens.extend(new_tokens)
        self._attach(req_id, drafter, m)
        return m

    def _attach(self, req_id: str, drafter: str, m: Mirror) -> None:
        if drafter not in self.drafters:
            raise ValueError(f"drafter {drafter!r} is not hosted on worker {self.name!r}")
        if req_id not in self.drafter_reqs[drafter]:
            self.drafters[drafter].add_request(req_id, m.params)
            self.drafter_reqs[drafter].add(req_id)

    # ---- ops ------------------------------------------------------------------------------------
    def prefill(self, items: list[P.PrefillItem]) -> list[int]:
        """The chunks' KV; per item, the tokens of it the prefix cache held (not computed)."""
        target = self._target()
        for it in items:
            if not target.has_request(it.req_id):
                raise ValueError(f"{it.req_id}: unknown request on the target")
        return self._timed("prefill", len(items),
                           lambda: target.prefill([(it.req_id, it.num_tokens) for it in items]))

    def _draft(self, name: str, inputs: list[DraftInput]):
        """One drafter's batch -> (drafts, seconds)."""
        drafts = self._timed("draft", len(inputs), lambda: self.drafters[name].propose(inputs), name)
        return drafts, self._last_busy_s()

    def propose(self, slot: int, items: list[P.ProposeItem]) -> list[P.DraftRecord]:
        groups: dict[str, list[tuple[int, DraftInput]]] = {}  # drafter -> (position in items, input)
        for i, it in enumerate(items):
            m = self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
            tokens = m.tokens + it.assume if it.assume else m.tokens  # draft ahead: past tentative tokens
            groups.setdefault(it.drafter, []).append((i, DraftInput(it.req_id, tokens, it.k)))
        out: list[P.DraftRecord | None] = [None] * len(items)
        for name, batch in groups.items():
            drafts, elapsed = self._draft(name, [x for _, x in batch])
            for (i, x), d in zip(batch, drafts):
                if d.probs is not None:
                    if self.probs_out is None:
                        raise RuntimeError(f"worker {self.name!r} has no channel to send draft probabilities on")
                    self.probs_out.send(slot, x.req_id, d.probs)
                out[i] = P.DraftRecord(req_id=x.req_id, tokens=d.tokens, has_probs=d.probs is not None, slot=slot,
                                       draft_s=elapsed, switch_s=d.switch_s)
        return out

    def verify(self, slot: int, items: list[P.VerifyItem], prefill: Sequence[P.PrefillItem] = ()
               ) -> tuple[list[P.VerifyResult], float, list[int]]:
        """The items verified (and the chunks of `prefill` written in the same forward): their results, the verify's
        seconds, and per chunk the tokens the prefix cache held."""
        target = self._target()
        for it in [*items, *prefill]:
            if not target.has_request(it.req_id):
                raise ValueError(f"{it.req_id}: unknown request on the target")
        drafts = {it.req_id: (it.draft, None) for it in items}
        draft_s = {}
        inline: dict[str, list[DraftInput]] = {}
        cut: dict[str, CutRule] = {}  # the inline drafts' cuts (none: not cut)
        for it in items:
            if it.inline_drafter and it.k:
                m = self._mirror(it.req_id)
                self._attach(it.req_id, it.inline_drafter, m)
                inline.setdefault(it.inline_drafter, []).append(DraftInput(it.req_id, m.tokens, it.k))
                if it.cut_values and it.cut_prices:
                    cut[it.req_id] = CutRule(tuple(it.cut_values), tuple(it.cut_prices))
        switch_s = {}
        for name, inputs in inline.items():
            out, elapsed = self._draft(name, inputs)
            for x, d in zip(inputs, out):
                d = cut_at(d, cut.get(x.req_id))  # the tokens its drafter is not confident enough of do not pay
                drafts[x.req_id] = (d.tokens, d.probs)
                draft_s[x.req_id] = elapsed
                switch_s[x.req_id] = d.switch_s
        t0 = time.perf_counter()
        shadows, shadow_confidence = self._shadow_drafts(items)
        self.shadow_s = time.perf_counter() - t0  # what selection's shadow drafts cost this verify (Verified.shadow_s)
        wanted = [(slot if it.probs_slot < 0 else it.probs_slot, it.req_id) for it in items if it.has_probs]
        if wanted:
            if self.probs_in is None:
                raise RuntimeError(f"worker {self.name!r} has no channel to receive draft probabilities on")
            probs = self.probs_in.take(wanted, PROBS_TIMEOUT_S)
            drafts.update((r, (drafts[r][0], probs[r])) for _, r in wanted)
        device = target.runner.model.device  # q [len(draft), V] meets the target's p on its device
        vitems = [VerifyItem(it.req_id, drafts[it.req_id][0],
                             None if drafts[it.req_id][1] is None else drafts[it.req_id][1].to(device), it.max_draft)
                  for it in items]
        chunks = [(it.req_id, it.num_tokens) for it in prefill]
        try:
            reused, outs = self._timed("verify", len(items), lambda: target.prefill_and_verify(chunks, vitems))
        except RequestFailed:  # nothing changed: the other requests' drafts come again, their probabilities with them
            if wanted:
                self.probs_in.put_back({key: probs[key[1]] for key in wanted})
            raise
        verify_s = self._last_busy_s()
        if chunks:
            verify_s = self._split_prefill(chunks, reused, vitems)
        for o in outs:
            self.mirrors[o.req_id].tokens.extend(o.tokens)
        results = [P.VerifyResult(o.req_id, o.num_drafted, o.num_accepted, o.tokens, draft_s.get(o.req_id, 0.0),
                                  None if o.logprobs is None else [P.TokenLogprobs(*t) for t in o.logprobs],
                                  shadows.get(o.req_id, {}), switch_s.get(o.req_id, 0.0),
                                  shadow_confidence.get(o.req_id, {}))
                   for o in outs]
        return results, verify_s, reused

    def _split_prefill(self, chunks: list[tuple[str, int]], reused: list[int], items: list[VerifyItem]) -> float:
        """A verify forward that also wrote prefill chunks: its busy interval split into a prefill part and a verify
        part by their shares of the rows computed (an estimate: the two ran as one forward), so occupancy and
        `prefill` time read as they would for two ops. Returns the verify part's seconds."""
        verified = {it.req_id for it in items}
        pre_rows = sum(n for _, n in chunks) - sum(reused)
        verify_rows = sum(len(it.draft) + 1 for it in items)
        whole = self.busy.pop()
        cut = whole.start + (whole.end - whole.start) * pre_rows / max(1, pre_rows + verify_rows)
        n_pre = sum(1 for req_id, _ in chunks if req_id not in verified) or len(chunks)
        self.busy.append(P.BusyInterval("prefill", whole.start, cut, n_pre))
        self.busy.append(P.BusyInterval("verify", cut, whole.end, whole.num_reqs))
        return whole.end - cut

    def _shadow_drafts(self, items: list[P.VerifyItem]) -> tuple[dict[str, dict[str, list[int]]],
                                                                 dict[str, dict[str, list[float]]]]:
        """The counterfactual drafts the coordinator asked for: what each named model-free drafter would propose
        after the request's committed tokens (the coordinator checks them against what then commits, and the
        selector learns the request's acceptance at every draft position, on each free drafter: the one it ran
        too, whose real draft may have been cut short), and their confidences where the drafter has them (what
        selection calibrates them on). Grouped per drafter, one batch each."""
        groups: dict[str, list[DraftInput]] = {}
        for it in items:
            if it.shadow and it.shadow_k:
                m = self._mirror(it.req_id)
                for name in it.shadow:
                    self._attach(it.req_id, name, m)
                    groups.setdefault(name, []).append(DraftInput(it.req_id, m.tokens, it.shadow_k))
        out: dict[str, dict[str, list[int]]] = {}
        confidence: dict[str, dict[str, list[float]]] = {}
        for name, inputs in groups.items():  # microseconds a request: part of the verify op, not a busy interval
            for x, d in zip(inputs, self.drafters[name].propose(inputs)):
                out.setdefault(x.req_id, {})[name] = list(d.tokens)
                if d.confidence is not None:
                    confidence.setdefault(x.req_id, {})[name] = list(d.confidence)
        return out, confidence

    def _target(self) -> TargetVerifier:
        if self.target is None:
            raise ValueError(f"worker {self.name!r} does not host the target")
        return self.target

    def enqueue_precompute(self, items: list[P.PrecomputeItem]) -> None:
        for it in items:
            self._sync(it.req_id, it.drafter, it.base_len, it.new_tokens)
            self.precompute_queue.append((it.req_id, it.drafter))

    @property
    def has_idle_work(self) -> bool:
        """Work to run while no op waits: queued precomputes, or a drafter's own (the suffix cache's inserts)."""
        return bool(self.precompute_queue) or any(d.has_background_work for d in self.drafters.values())

    def run_idle_work(self, stop: Callable[[], bool] | None = None) -> None:
        """One chunk of idle work (called only when no op is waiting): a drafter's background work first (it
        serves every later request; it ends early where `stop` says an op now waits), else one precompute chunk."""
        for name, drafter in self.drafters.items():
            if drafter.has_background_work:
                self._timed("precompute", 0, lambda: drafter.background_work(PRECOMPUTE_CHUNK, stop), name)
                return
        if self.precompute_queue:
            self.run_precompute()

    def run_precompute(self) -> None:
        """One chunk of the oldest queued precompute (called only when no op is waiting); a request with
        more to feed goes to the back of the queue."""
        req_id, drafter = self.precompute_queue.popleft()
        if req_id not in self.mirrors or req_id not in self.drafter_reqs[drafter]:
            return
        tokens = self.mirrors[req_id].tokens
        try:
            left = self._timed("precompute", 1,
                               lambda: self.drafters[drafter].precompute(req_id, tokens, PRECOMPUTE_CHUNK), drafter)
        except Exception as e:  # nobody waits on a precompute: log it (the propose that needs it catches up)
            if is_fatal_device_error(e):
                raise
            log.exception("precompute of %s for drafter %s failed on worker %s", req_id, drafter, self.name)
            return
        if left:
            self.precompute_queue.append((req_id, drafter))

    def profile(self, msg: P.Profile) -> P.Profiled:
        runner = self.target.runner if self.target else None
        any_runner = runner or next((d.runner for d in self.drafters.values() if hasattr(d, "runner")), None)
        vocab = any_runner.model.args.vocab_size if any_runner is not None else 32000
        prompt = probe_prompt(msg.context, vocab)
        self._use_threads(0)
        draft = self._timed("profile", 0, lambda: time_draft_tokens(self.drafters, prompt, msg.k, msg.reps))
        verify = {}
        if runner is not None and msg.batch_sizes:
            self._use_threads(msg.threads)
            verify = self._timed("profile", 0, lambda: time_verify(runner, list(msg.batch_sizes), msg.context, msg.k,
                                                                   msg.reps, self.clock, msg.drafting))
            self._use_threads(0)
        return P.Profiled(msg.seq, {n: ms for n, ms in draft.items() if ms is not None}, verify, self._take_busy())

    def stats(self, seq: int) -> P.WorkerStats:
        kv = {}
        for n, r in self._runners().items():
            kv[n] = P.KVStats(r.kv.num_blocks, r.kv.num_free_blocks, len(r.kv.seqs))
        ms = {n: float(d.ms_per_token) for n, d in self.drafters.items() if d.ms_per_token is not None}
        return P.WorkerStats(seq=seq, name=self.name, pid=os.getpid(), req_ids=sorted(self.mirrors), kv=kv,
                             drafter_reqs={n: sorted(r) for n, r in self.drafter_reqs.items()}, ms_per_token=ms,
                             num_precompute_queued=len(self.precompute_queue), rss_bytes=rss_bytes(),
                             busy=self._take_busy())


def rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
