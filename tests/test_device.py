"""Issue 22, the device: what a worker sees of its GPU, its KV pools sized from the device's memory, every duration it
reports taken on a synchronised clock, and a lost device handled as a crash (the worker exits, is restarted, and its
requests finish as if nothing happened). CPU unit tests over a tiny random checkpoint (tests/tiny_model.py), in
seconds; the `gpu` ones run where CUDA is."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from spind import protocol as P
from spind.config import SpindConfig, from_dict, max_kv_blocks
from spind.coordinator.transport.process_pool import worker_env
from spind.worker.device import DeviceClock, device_name, is_fatal_device_error, pin_device
from spind.worker.memory import auto_num_blocks, device_share, kv_block_bytes
from tiny_model import write_tiny_checkpoint

GiB = 1 << 30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def tiny_config(model_dir: Path, cache: Path, device: str = "cpu", drafters: tuple[dict, ...] = (), dtype: str = "auto",
                **runtime) -> SpindConfig:
    return from_dict({
        "model": {"target": str(model_dir), "dtype": dtype, "max_model_len": 64, "cache_dir": str(cache)},
        "runtime": {"attention": "packed", "kv_block_size": 16, "kv_num_blocks": 0, "max_batch_size": 4,
                    "profile": "off", **runtime},
        "speculation": {"k": 3}, "selection": {"policy": "lbss", "k_set": [2, 3]},
        "drafters": [{"name": "ngram", "kind": "ngram", "worker": "target"}, *drafters],
        "workers": [{"name": "target", "device": device}]})


# ---- which device a worker process sees ----------------------------------------------------------------------------
def test_a_gpu_worker_sees_its_own_gpu_only_as_cuda_0_and_a_cpu_worker_none():
    env, device = worker_env("cuda:1", {"PATH": "/bin"})
    assert (env["CUDA_VISIBLE_DEVICES"], device, env["PATH"]) == ("1", "cuda:0", "/bin")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert worker_env("cuda", {})[0]["CUDA_VISIBLE_DEVICES"] == "0"
    # indices count the GPUs the daemon itself was given
    assert worker_env("cuda:1", {"CUDA_VISIBLE_DEVICES": "2, 3"})[0]["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='2,3' shows the daemon 2 GPU"):
        worker_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "2,3"})
    env, device = worker_env("cpu", {"CUDA_VISIBLE_DEVICES": "0", "OMP_WAIT_POLICY": "ACTIVE"})
    assert (env["CUDA_VISIBLE_DEVICES"], device, env["OMP_WAIT_POLICY"]) == ("", "cpu", "ACTIVE")


def test_a_worker_pins_its_cuda_device_and_leaves_a_cpu_one(monkeypatch):
    pinned = []
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    pin_device("cpu")
    pin_device("cuda:1")
    assert pinned == [torch.device("cuda:1")]
    assert device_name("cpu")  # the CPU's model name: what a cost profile is valid on


# ---- KV blocks from the device's memory ----------------------------------------------------------------------------
def test_auto_kv_blocks_fill_what_the_models_leave_of_the_share_and_no_more_than_requests_use():
    block = 2 * GiB // 1024  # 2 MiB
    # 0.9 of 80 GiB = 72 GiB, less 10 GiB used: 62 GiB of 2 MiB blocks
    assert auto_num_blocks(80 * GiB, 10 * GiB, 0.9, block, 10**9) == 62 * 512
    assert auto_num_blocks(80 * GiB, 10 * GiB, 0.9, block, 1000) == 1000  # all that max_batch x max_model_len needs
    assert auto_num_blocks(80 * GiB, 10 * GiB, 0.45, block, 10**9) == 26 * 512  # two workers on the GPU
    with pytest.raises(ValueError, match="no device memory left for the KV cache.*gpu_memory_utilization"):
        auto_num_blocks(80 * GiB, 75 * GiB, 0.9, block, 10**9)


def test_workers_on_one_gpu_split_its_share(tiny_dir, tmp_path):
    draft = {"name": "d", "kind": "self", "variant": "bf16", "worker": "draft"}
    cfg = tiny_config(tiny_dir, tmp_path, drafters=(draft,))
    share = {}
    for target, draft in (("cuda", "cuda:0"), ("cuda:0", "cuda:1"), ("cuda:0", "cpu")):
        c = dataclasses.replace(cfg, workers=(dataclasses.replace(cfg.worker("target"), device=target),
                                              dataclasses.replace(cfg.worker("draft"), device=draft)))
        share[draft] = device_share(c, "target")
    assert share == {"cuda:0": 0.45, "cuda:1": 0.9, "cpu": 0.9}


def test_kv_block_bytes_is_the_caches_layout():
    from spind.models.kv_cache import KVCache

    kv = KVCache(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    model = type("M", (), {"layers": [0, 1, 2], "args": type("A", (), {"num_kv_heads": 2, "head_dim": 8})})()
    assert kv_block_bytes(model, 4, torch.bfloat16) * 5 == sum(t.nbytes for t in kv.k + kv.v)


# ---- a lost device -------------------------------------------------------------------------------------------------
def test_lost_device_errors_are_told_from_failed_ops():
    fatal = [torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
             RuntimeError("CUDA error: device-side assert triggered"),
             RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"),
             RuntimeError("Triton Error [CUDA]: unspecified launch failure"), RuntimeError("NCCL error: unhandled")]
    survivable = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"),
                  ValueError("CUDA error in the message of a ValueError"), KeyError("r1")]
    assert all(map(is_fatal_device_error, fatal)) and not any(map(is_fatal_device_error, survivable))


# ---- every timed path reads the device clock -----------------------------------------------------------------------
def test_device_clock_synchronizes_cuda_before_reading_the_time(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    DeviceClock("cpu").now()
    assert synced == []
    DeviceClock("cuda:1").now()
    assert synced == [torch.device("cuda:1")]


class CountingClock(DeviceClock):
    """Whole seconds from 1000 on, one per read: a duration taken from any other clock would not be whole."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        return 1000.0 + self.reads


def whole(x: float) -> bool:
    return abs(x - round(x)) < 1e-9


def test_every_duration_a_worker_reports_is_read_from_its_device_clock(tiny_dir, tmp_path):
    from spind.worker.worker import Worker

    small = {"name": "small", "kind": "self", "variant": "bf16", "worker": "target"}
    cfg = tiny_config(tiny_dir, tmp_path, drafters=(small,))
    clock = CountingClock()
    w = Worker("target", cfg, clock=clock)
    ready = w.ready(1)
    assert ready.dtype == "float32"  # "auto" on CPU, a checkpoint from no GGUF
    assert ready.kv_num_blocks == max_kv_blocks(cfg) == 16 and ready.device == "cpu" and ready.device_name

    def op(msg: object, timed: bool = True) -> object:
        before = clock.reads
        reply = w.answer(msg)
        assert not isinstance(reply, P.ErrorReply), reply
        assert clock.reads > before or not timed, f"{type(msg).__name__} timed nothing on the device clock"
        assert all(b.start >= 1000 and whole(b.start) and whole(b.end) for b in getattr(reply, "busy", []))
        return reply

    prompt = [3, 5, 7, 9, 11, 13, 15, 17]
    op(P.AddRequest(1, "r", prompt, P.SamplingParams(max_tokens=8), True), timed=False)
    op(P.Prefill(2, [P.PrefillItem("r", 4)]))
    proposed = op(P.Propose(3, 1, [P.ProposeItem("r", "small", len(prompt), [], 3)]))
    d = proposed.drafts[0]
    assert len(d.tokens) == 3 and whole(d.draft_s) and d.switch_s > 0 and whole(d.switch_s)  # 7 tokens caught up
    assert whole(w.drafters["small"].ms_per_token * 3 / 1e3)
    verified = op(P.Verify(4, 2, [P.VerifyItem("r", d.tokens)]))
    assert verified.verify_s > 0 and whole(verified.verify_s)
    inline = op(P.Verify(5, 3, [P.VerifyItem("r", [], inline_drafter="ngram", k=2)]))
    assert whole(inline.verify_s) and whole(inline.results[0].draft_s)
    op(P.Precompute(6, [P.PrecomputeItem("r", "small", len(w.mirrors["r"].tokens), [])]), timed=False)
    before = clock.reads
    while w.precompute_queue:
        w.run_precompute()
    assert clock.reads > before and whole(w.busy[-1].end - w.busy[-1].start)
    profiled = op(P.Profile(7, 2, [1, 2], 16, 3))  # medians of 3: one sample each
    assert all(whole(ms / 1e3) for ms in profiled.verify_ms.values())
    assert whole(profiled.draft_ms_per_token["small"] * 2 / 1e3)


# ---- a lost device in a worker process: exit, restart, replay ------------------------------------------------------
FAULT_WORKER = (sys.executable, str(Path(__file__).with_name("fault_worker.py")))


async def collect(stream) -> list:
    return [d async for d in stream]


def generate_through_processes(cfg: SpindConfig, run_dir: Path, prompts: list[list[int]], command=FAULT_WORKER):
    from spind.coordinator.engine import Coordinator
    from spind.coordinator.interface import EngineRequest
    from spind.coordinator.transport.process_pool import ProcessPool

    async def go():
        pool = ProcessPool(cfg, run_dir, load_timeout_s=120, command=command)
        engine = Coordinator(cfg, pool, call_timeout_s=120)
        await engine.start()
        try:
            first_pid = pool.info("target").pid
            reqs = [EngineRequest(f"r{i}", p, P.SamplingParams(max_tokens=20, ignore_eos=True), drafter)
                    for i, (p, drafter) in enumerate(zip(prompts, ("ngram", "none", "auto")))]
            outs = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
            return outs, pool.info("target"), first_pid, engine.render_metrics()
        finally:
            await engine.shutdown(drain=False)

    return asyncio.run(go())


def reference(cfg: SpindConfig, prompts: list[list[int]]) -> list[list[int]]:
    from spind.coordinator.transport.local import GenRequest, LocalEngine

    engine = LocalEngine.load(cfg, drafters=[])
    try:
        params = P.SamplingParams(max_tokens=20, ignore_eos=True)
        return [r.token_ids for r in engine.generate([GenRequest(f"ref{i}", p, params) for i, p in enumerate(prompts)])]
    finally:
        engine.close()


PROMPTS = [[3, 5, 7, 9, 3, 5, 7], [11, 13, 2], [21, 22, 23, 24, 25, 26]]


def run_with_a_lost_device(cfg: SpindConfig, tmp_path: Path, monkeypatch, caplog, fault: str):
    marker = tmp_path / "faulted"
    monkeypatch.setenv("SPIND_TEST_FAULT", fault)
    monkeypatch.setenv("SPIND_TEST_FAULT_AT", "3")  # mid-generation: every request has committed tokens
    monkeypatch.setenv("SPIND_TEST_FAULT_MARKER", str(marker))
    outs, info, first_pid, metrics = generate_through_processes(cfg, tmp_path / "run", PROMPTS)
    assert marker.read_text() == str(first_pid)  # the first incarnation lost its device on its 3rd verify
    assert info.restarts == 1 and info.pid != first_pid  # restarted once, a new process
    assert 'spind_worker_restarts_total{worker="target"} 1.0' in metrics
    assert any("exited with 75" in r.getMessage() for r in caplog.records)  # EXIT_DEVICE_ERROR, not a crash
    for deltas, want in zip(outs, reference(cfg, PROMPTS)):  # replayed: as if nothing happened
        assert deltas[-1].finish_reason == "length" and [t for d in deltas for t in d.token_ids] == want


def test_a_worker_that_loses_its_device_exits_is_restarted_and_its_requests_finish_unchanged(
        tiny_dir, tmp_path, monkeypatch, caplog):
    run_with_a_lost_device(tiny_config(tiny_dir, tmp_path), tmp_path, monkeypatch, caplog, "raise")


# ---- on a GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
def test_gpu_a_real_device_side_assert_restarts_the_worker_with_a_fresh_context(tiny_dir, tmp_path, monkeypatch,
                                                                                caplog):
    # float32: greedy tokens that no batch shape's rounding flips, to compare with the in-process reference
    run_with_a_lost_device(tiny_config(tiny_dir, tmp_path, "cuda", dtype="float32"), tmp_path, monkeypatch, caplog,
                           "assert")


@pytest.mark.gpu
@cuda
def test_gpu_worker_resolves_auto_dtype_names_its_gpu_and_sizes_kv_from_its_memory(tiny_dir, tmp_path):
    from spind.worker.memory import memory_baseline, num_kv_blocks
    from spind.worker.worker import Worker

    cfg = tiny_config(tiny_dir, tmp_path, "cuda:0")
    baseline = memory_baseline("cuda:0")  # what earlier tests left in this process's allocator
    w = Worker("target", cfg)
    ready = w.ready(1)
    assert ready.dtype == "bfloat16"  # a float32 checkpoint on a GPU
    assert ready.device_name == torch.cuda.get_device_name(0) and ready.device == "cuda:0"
    assert ready.kv_num_blocks == max_kv_blocks(cfg)  # capped: all 4 requests of 64 tokens need
    # uncapped (a huge batch), the pools fill what the model leaves of 0.5 of the GPU, and that much does fit
    model = w.target.runner.model
    big = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, max_batch_size=10**8,
                                                               gpu_memory_utilization=0.5))
    blocks = num_kv_blocks(big, "target", "cuda:0", [(model, torch.bfloat16)], 64, baseline)
    total = torch.cuda.get_device_properties(0).total_memory
    block = kv_block_bytes(model, 16, torch.bfloat16)
    assert 0.5 * total - 2 * GiB < blocks * block <= 0.5 * total
    kv = model.new_kv_cache(blocks, 16, 64, torch.bfloat16)  # it is allocated, not only counted
    del kv


@pytest.mark.gpu
@cuda
def test_gpu_device_clock_waits_for_queued_kernels():
    import time

    x = torch.randn(4096, 4096, device="cuda")
    clock = DeviceClock("cuda:0")
    (x @ x).sum().item()  # cuBLAS initialised: from here the host only queues
    start, host = clock.now(), time.monotonic()
    for _ in range(200):
        x = x @ x / 64
    queued = time.monotonic() - host
    ran = clock.now() - start
    assert ran > 5 * queued  # the host only queued them; the device clock waited for them to run


@pytest.mark.gpu
@cuda
def test_gpu_the_int8_weight_only_self_draft_the_config_allows_on_a_gpu_runs_there():
    from spind.models.quant import Int8WeightOnlyLinear

    linear = torch.nn.Linear(256, 512, bias=False).cuda()
    x = torch.randn(8, 256, device="cuda")
    y = Int8WeightOnlyLinear(linear)(x)
    assert y.device.type == "cuda" and torch.allclose(y, linear(x), atol=0.05, rtol=0.05)


def test_a_cost_profile_is_cached_per_device_name_and_resolved_dtype(tiny_dir, tmp_path):
    from spind.coordinator.profile import profile_key

    cfg = tiny_config(tiny_dir, tmp_path)
    worker = {"name": "target", "device": "cuda:0", "threads": 4, "dtype": "bfloat16", "device_name": "NVIDIA H100"}
    key = profile_key(cfg, [worker], 2048)
    assert profile_key(cfg, [dict(worker)], 2048) == key
    assert profile_key(cfg, [{**worker, "device_name": "NVIDIA A10G"}], 2048) != key  # same index, another GPU
    assert profile_key(cfg, [{**worker, "dtype": "float16"}], 2048) != key  # "auto", resolved otherwise
    assert profile_key(cfg, [{**worker, "ranks": []}], 2048) == key  # one process: the key it always had
    assert profile_key(cfg, [{**worker, "ranks": ["cuda:0", "cuda:1"]}], 2048) != key  # a split target
