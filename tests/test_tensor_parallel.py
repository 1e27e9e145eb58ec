"""Tensor parallelism (spind/models/tensor_parallel.py, spind/worker/tensor_parallel.py): the split of a model over
ranks (pure), the config, and real groups of processes joined by gloo on CPU, against one rank: the tiny random
LLaMA with GQA (2 ranks, and 4 ranks that replicate its KV heads) and the default model with every drafter.

A killed rank mid-generation is tested through the daemon (tests/test_daemon_e2e.py), where the restart lives.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import generate
from spind.config import ConfigError, from_dict, load_config, with_tensor_parallel
from spind.coordinator.transport.local import LocalEngine
from spind.models.layers import LlamaArgs
from spind.models.runner import ForwardItem
from spind.models.tensor_parallel import Shard, TensorParallelError, split_range
from spind.params import SamplingParams
from spind.worker.tensor_parallel import backend_for, cpu_threads
from spind.worker.worker import Worker
from tiny_model import write_tiny_checkpoint


def args(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 49152, head_dim: int = 64) -> LlamaArgs:
    return LlamaArgs(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter, num_layers=2,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position=256, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
                     eos_token_ids=())


# ---- the split (pure) ----------------------------------------------------------------------------------------------
def test_ranges_split_as_evenly_as_they_go_in_whole_units():
    assert [split_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [split_range(1536, 2, r, 32) for r in range(2)] == [(0, 768), (768, 1536)]
    assert [split_range(96, 2, r, 32) for r in range(2)] == [(0, 64), (64, 96)]  # 3 blocks: 2 + 1
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        split_range(3, 4, 0)


def test_the_default_models_heads_split_on_kv_groups_2_and_1():
    # SmolLM2-135M: 9 q heads over 3 KV heads, so 6 + 3 q heads; 1536 intermediate; 49152 vocabulary
    r0, r1 = (Shard.plan(args(9, 3), r, 2) for r in range(2))
    assert (r0.heads, r0.kv_heads, r1.heads, r1.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert (r0.inter, r1.inter, r0.vocab, r1.vocab) == ((0, 768), (768, 1536), (0, 24576), (24576, 49152))
    local = r1.local_args(args(9, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (3, 1, 768, 24576)
    # each rank's q heads read only its own KV heads: the group size is unchanged
    assert local.num_heads // local.num_kv_heads == 3


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head_over_its_q_heads():
    shards = [Shard.plan(args(4, 2), r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="9 attention heads over 3 KV heads cannot be split over 4 ranks"):
        Shard.plan(args(9, 3), 0, 4)


def test_each_rank_reads_its_slice_of_each_checkpoint_tensor():
    s = Shard.plan(args(9, 3), 1, 2)
    assert s.slice_of("model.layers.3.self_attn.q_proj.weight") == (0, 384, 576)
    assert s.slice_of("model.layers.3.self_attn.k_proj.bias") == (0, 128, 192)
    assert s.slice_of("model.layers.3.self_attn.o_proj.weight") == (1, 384, 576)
    assert s.slice_of("model.layers.3.mlp.up_proj.weight") == (0, 768, 1536)
    assert s.slice_of("model.layers.3.mlp.down_proj.weight") == (1, 768, 1536)
    assert s.slice_of("model.embed_tokens.weight") == s.slice_of("lm_head.weight") == (0, 24576, 49152)
    assert s.slice_of("model.layers.3.input_layernorm.weight") is None  # replicated
    with pytest.raises(ValueError, match="row-parallel layer with a bias"):
        s.slice_of("model.layers.0.mlp.down_proj.bias")


def test_cpu_ranks_share_the_threads_and_gpus_of_their_own_use_nccl():
    assert [cpu_threads(t, 2) for t in (1, 2, 8)] == [1, 1, 4]
    assert backend_for(["cpu", "cpu"]) == "gloo"
    assert backend_for(["cuda:0", "cuda:1"]) == "nccl"
    assert backend_for(["cuda:0", "cuda:0"]) == "gloo"


def test_the_placement_line_names_each_ranks_device():
    from spind.coordinator.placement import describe_placement

    line = describe_placement([
        {"name": "target", "device": "cuda:0", "is_target": True, "drafters": ["ngram"],
         "ranks": ["cuda:0", "cuda:1"]},
        {"name": "ssm1", "device": "cuda:2", "is_target": False, "drafters": ["llama-68m"], "ranks": []}])
    assert line == ("target on cuda:0 + cuda:1 (tensor parallel): the target, ngram; "
                    "ssm1 on cuda:2: llama-68m")


# ---- shared-memory collectives (two ranks as threads of this process: they share only the mapped file) -----------
def shm_ranks(tmp_path: Path, slot_bytes: int, vocab: list[int], timeout_s: float = 30.0, alive=lambda: None):
    from spind.models.tensor_parallel import ShmArea, ShmCollectives

    path = str(tmp_path / "shm")
    areas = [ShmArea(path, 2, slot_bytes, create=True), ShmArea(path, 2, slot_bytes, create=False)]
    return [ShmCollectives(None, r, 2, vocab, areas[r], alive, timeout_s) for r in range(2)]


def run_ranks(fns) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(fns)) as ex:
        return [f.result(timeout=60) for f in [ex.submit(fn) for fn in fns]]


def test_shm_all_reduce_gives_every_rank_the_same_rank_ordered_sum_in_pieces(tmp_path: Path):
    ranks = shm_ranks(tmp_path, 4096, [3, 2])  # 1024 fp32 a slot: the 5 x 576 tensors go in 3 pieces
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 576, generator=g) * 10 ** r for r in range(2)]
    want = xs[0].clone().add_(xs[1])
    for _ in range(3):  # both buffers, reused
        out = run_ranks([lambda r=r, c=c: c.all_reduce(xs[r].clone()) for r, c in enumerate(ranks)])
        assert torch.equal(out[0], want) and torch.equal(out[1], want)


def test_shm_gather_joins_uneven_vocabulary_slices(tmp_path: Path):
    ranks = shm_ranks(tmp_path, 4096, [3, 2])
    parts = [torch.arange(12.).view(4, 3), -torch.arange(8.).view(4, 2)]
    out = run_ranks([lambda r=r, c=c: c.gather_vocab(parts[r]) for r, c in enumerate(ranks)])
    assert torch.equal(out[0], torch.cat(parts, 1)) and torch.equal(out[1], out[0])
    big = [torch.randn(700, 3), torch.randn(700, 2)]  # more rows than a slot holds: in pieces of rows
    out = run_ranks([lambda r=r, c=c: c.gather_vocab(big[r]) for r, c in enumerate(ranks)])
    assert torch.equal(out[0], torch.cat(big, 1))


def test_a_shm_collective_gives_up_on_a_gone_or_silent_peer(tmp_path: Path):
    def gone():
        raise TensorParallelError("rank 1 exited")

    (rank0, _) = shm_ranks(tmp_path, 4096, [1, 1], alive=gone)
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        rank0.all_reduce(torch.ones(4))
    (tmp_path / "b").mkdir()
    (rank0, _) = shm_ranks(tmp_path / "b", 4096, [1, 1], timeout_s=0.2)
    with pytest.raises(TensorParallelError, match="no peer reached collective 1 within 0 s"):
        rank0.all_reduce(torch.ones(4))


# ---- config --------------------------------------------------------------------------------------------------------
def test_tensor_parallel_config_and_its_cli_override():
    cfg = with_tensor_parallel(load_config(), 2)
    target = cfg.worker("target")
    assert (target.tensor_parallel, target.group_devices) == (2, ("cpu", "cpu"))
    assert with_tensor_parallel(cfg, None) is cfg
    gpu = from_dict({"model": {"dtype": "auto"}, "runtime": {"attention": "triton-packed"},
                     "workers": [{"name": "target", "tensor_parallel": 2, "devices": ["cuda:2", "cuda:3"]}]})
    assert (gpu.worker("target").device, gpu.worker("target").group_devices) == ("cuda:2", ("cuda:2", "cuda:3"))
    assert with_tensor_parallel(gpu, 4).worker("target").group_devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")


def test_the_commands_that_serve_through_the_engine_take_tensor_parallel_and_the_runner_benches_do_not():
    from spind.cli import build_parser
    from spind.cli_args import config_from_args

    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["start"], ["bench", "e2e"], ["bench", "pipeline"]):
        args = parser.parse_args([*argv, "--tensor-parallel", "2"])
        if argv[0] != "start":  # start resolves its run dir too (daemon_cli.load_daemon_config)
            assert config_from_args(args).worker("target").tensor_parallel == 2
    for argv in (["bench", "decode"], ["bench", "batch"], ["bench", "drafters"]):  # they time the runner directly
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--tensor-parallel", "2"])


@pytest.mark.parametrize("worker, why", [
    ({"name": "draft", "tensor_parallel": 2}, "only the target worker"),
    ({"name": "target", "tensor_parallel": 2, "devices": ["cpu"]}, "one per rank"),
    ({"name": "target", "tensor_parallel": 2, "devices": ["cuda:0", "cpu"]}, "mix CPU and GPU"),
    ({"name": "target", "tensor_parallel": 2, "devices": ["cuda:0", "cuda:0"]}, "a GPU of its own"),
    ({"name": "target", "tensor_parallel": 0}, "must be >= 1"),
])
def test_a_group_that_cannot_run_is_refused_at_load(worker: dict, why: str):
    with pytest.raises(ConfigError, match=why):
        from_dict({"model": {"dtype": "auto"}, "runtime": {"attention": "packed"}, "workers": [worker]})


# ---- real groups on CPU (gloo) -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"))


def tiny_config(model_dir: Path, cache: Path, ranks: int):
    return from_dict({
        "model": {"target": str(model_dir), "dtype": "float32", "max_model_len": 128, "cache_dir": str(cache)},
        "runtime": {"attention": "packed", "kv_block_size": 16, "kv_num_blocks": 32, "max_batch_size": 4,
                    "profile": "off"},
        "drafters": [{"name": "ngram", "kind": "ngram", "worker": "target"}],
        "workers": [{"name": "target", "tensor_parallel": ranks}]})


def forward_logits(worker: Worker, rounds: list[list[tuple[str, list[int], int]]]) -> list[torch.Tensor]:
    """Each round one batched forward of (req_id, tokens, num_logits) through the target's runner (requests added on
    first sight, then truncated by one token, as a rejected draft is), and its logits."""
    runner, out = worker.target.runner, []
    for items in rounds:
        for req_id, _, _ in items:
            if not runner.has_request(req_id):
                runner.add_request(req_id)
        out += runner.forward([ForwardItem(*it) for it in items])
        for req_id, _, _ in items:
            runner.truncate(req_id, runner.length(req_id) - 1)
    return out


TINY_ROUNDS = [[("a", [5, 9, 3, 7, 2, 8], 6), ("b", [4, 4, 1], 1)],  # prefill-like rows and a short prompt
               [("a", [6, 1], 2), ("b", [2, 9, 3, 5], 4)],  # verifies
               [("b", [7], 1)]]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_split_tiny_gqa_model_gives_one_ranks_logits(tiny_dir: Path, tmp_path: Path, ranks: int):
    one = Worker("target", tiny_config(tiny_dir, tmp_path, 1))
    split = Worker("target", tiny_config(tiny_dir, tmp_path, ranks))
    try:
        assert split.group is not None and split.group.world == ranks
        want, got = forward_logits(one, TINY_ROUNDS), forward_logits(split, TINY_ROUNDS)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        # KV state stayed in step on every rank: a request freed and one added after it read the same blocks
        split.target.runner.free_request("a")
        one.target.runner.free_request("a")
        more = [[("c", [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 1], 2)]]
        torch.testing.assert_close(forward_logits(split, more)[0], forward_logits(one, more)[0], rtol=1e-5,
                                   atol=1e-5)
    finally:
        split.close()
        one.close()


def test_a_bad_request_fails_alone_and_the_ranks_stay_in_step(tiny_dir: Path, tmp_path: Path):
    split = Worker("target", tiny_config(tiny_dir, tmp_path, 2))
    one = Worker("target", tiny_config(tiny_dir, tmp_path, 1))
    try:
        for w in (split, one):
            w.target.runner.add_request("long")
            with pytest.raises(ValueError, match="exceed the context limit"):
                w.target.runner.forward([ForwardItem("long", [1] * 200, 1)])
        torch.testing.assert_close(forward_logits(split, TINY_ROUNDS)[-1], forward_logits(one, TINY_ROUNDS)[-1],
                                   rtol=1e-5, atol=1e-5)
    finally:
        split.close()
        one.close()


def test_a_dead_rank_fails_the_next_forward_as_a_lost_device(tiny_dir: Path, tmp_path: Path):
    from spind.worker.device import is_fatal_device_error

    split = Worker("target", tiny_config(tiny_dir, tmp_path, 2))
    try:
        forward_logits(split, TINY_ROUNDS[:1])
        split.group.procs[0].kill()
        split.group.procs[0].wait()
        with pytest.raises(TensorParallelError, match="rank 1 .* exited") as e:
            forward_logits(split, TINY_ROUNDS[1:2])
        assert is_fatal_device_error(e.value)  # the worker exits to be restarted whole (spind/worker/main.py)
    finally:
        split.close()


def test_a_rank_that_cannot_load_fails_the_start_naming_it(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    broken = write_tiny_checkpoint(tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:30].clone()  # rank 0's rows are there, rank 1's are not
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(TensorParallelError, match="rank 1 .* exited with 1"):
        Worker("target", tiny_config(broken, tmp_path, 2))


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(tmp_path: Path):
    odd = write_tiny_checkpoint(tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))  # MQA: 4 q heads, 1 KV head
    with pytest.raises(ValueError, match="4 attention heads over 1 KV heads cannot be split over 3 ranks"):
        Worker("target", tiny_config(odd, tmp_path, 3))


# ---- the default model, every drafter -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_engine(cfg):
    e = LocalEngine.load(with_tensor_parallel(cfg, 2))
    yield e
    e.close()


# float32: fp32 sums in another order. The served 4-bit target quantizes each layer's activations per block (23-bit
# fixed point for "gguf", 15-bit for the default "gguf-q16"): a last-bit difference can move a rounding step, and 30
# layers carry it on: up to 3e-3 and 3.2e-2 of logits up to ~30 (measured on these prompts); the argmax never moved.
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-4), ("auto", 0.1)])
def test_the_split_default_model_gives_one_ranks_logits(cfg, prompt_ids: list[list[int]], dtype: str, atol: float):
    base = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    one, split = Worker("target", base), Worker("target", with_tensor_parallel(base, 2))
    try:
        assert split.group.world == 2 and split.ranks == ["cpu", "cpu"]
        rounds = [[("l0", prompt_ids[0], 3), ("l1", prompt_ids[1][:40], 5)], [("l0", [11, 12, 13, 14, 15], 5)]]
        for w, g in zip(forward_logits(one, rounds), forward_logits(split, rounds), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=atol)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
    finally:
        split.close()
        one.close()


@pytest.mark.parametrize("drafter", [None, "ngram", "suffix", "int8", "dyn8", "bf16"])
def test_the_split_default_model_generates_one_ranks_greedy_tokens_with_every_drafter(
        split_engine: LocalEngine, engine: LocalEngine, prompt_ids: list[list[int]], drafter: str | None):
    prompts = prompt_ids[:3]
    params = [SamplingParams(max_tokens=24)] * len(prompts)
    want = generate(engine, prompts, drafter, 4, params)
    got = generate(split_engine, prompts, drafter, 4, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert drafter is None or sum(r.num_drafted for r in got) > 0



def test_an_eagle3_head_beside_the_split_default_model_drafts_as_beside_one_rank(cfg, prompt_ids: list[list[int]]):
    from spind.config import DrafterConfig

    eagle = DrafterConfig(name="eagle", kind="eagle", path="default", worker="target")
    base = dataclasses.replace(cfg, drafters=(*cfg.drafters, eagle))
    prompts, params = prompt_ids[:2], [SamplingParams(max_tokens=24)] * 2
    outs = []
    for ranks in (1, 2):
        e = LocalEngine.load(with_tensor_parallel(base, ranks), drafters=["eagle"])
        try:
            outs.append(generate(e, prompts, "eagle", 4, params))
        finally:
            e.close()
    assert [r.token_ids for r in outs[1]] == [r.token_ids for r in outs[0]]
    assert sum(r.num_accepted for r in outs[1]) > 0  # the head read the split target's features and drafted
