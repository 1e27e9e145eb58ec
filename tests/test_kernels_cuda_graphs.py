"""CUDA-graph buckets (kernels/cuda_graphs.py): the pure parts and the padded static path on CPU; capture
and replay on a GPU (skipped without one).

The forward here is a one-layer attention model (embedding + position table, q/k/v projections, KV
written at slot_mapping, the backend, an output projection): enough to see every input of a verify
forward go through the static buffers.
"""

from __future__ import annotations

import pytest
import torch

from spind.kernels.attention import TORCH_BACKENDS, get_backend
from spind.kernels.cuda_graphs import (Bucket, CudaGraphForward, StaticBatch, choose_bucket, make_buckets,
                                       padded_lengths)
from spind.kernels.metadata import AttentionMetadata
from spind.kernels.testing import make_paged_case

H, HKV, D, VOCAB = 6, 2, 32, 50


class OneLayer:
    def __init__(self, backend, device: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.embed, self.pos = torch.randn(VOCAB, 48, generator=gen), torch.randn(512, 48, generator=gen)
        self.wqkv = torch.randn(48, (H + 2 * HKV) * D, generator=gen) / 7
        self.wo = torch.randn(H * D, VOCAB, generator=gen) / 14
        for name in ("embed", "pos", "wqkv", "wo"):
            setattr(self, name, getattr(self, name).to(device))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[0]
        q, k, v = ((self.embed[tokens] + self.pos[positions]) @ self.wqkv).split([H * D, HKV * D, HKV * D], -1)
        k_cache.index_copy_(0, meta.slot_mapping, k.reshape(t, HKV, D))
        v_cache.index_copy_(0, meta.slot_mapping, v.reshape(t, HKV, D))
        return self.backend(q.reshape(t, H, D), k_cache, v_cache, D ** -0.5).reshape(t, H * D) @ self.wo


def test_buckets_cover_batch_sizes_and_query_lengths() -> None:
    buckets = make_buckets(32, [5, 1])
    assert sorted({b.num_seqs for b in buckets}) == [1, 2, 4, 8, 16, 24, 32]
    assert {b.query_len for b in buckets} == {1, 5} and len(buckets) == 14
    assert make_buckets(3, [2]) == (Bucket(1, 2), Bucket(2, 2), Bucket(3, 2))


def test_choose_bucket_takes_the_smallest_that_fits() -> None:
    buckets = make_buckets(32, [1, 5])
    assert choose_bucket(buckets, 3, 5) == Bucket(4, 5)
    assert choose_bucket(buckets, 3, 1) == Bucket(4, 1)
    assert choose_bucket(buckets, 9, 2) == Bucket(16, 5)
    assert choose_bucket(buckets, 33, 5) is None and choose_bucket(buckets, 2, 6) is None


def test_padded_lengths_append_empty_sequences() -> None:
    assert padded_lengths([5, 1], [40, 9], Bucket(4, 5)) == ((5, 1, 0, 0), (40, 9, 0, 0))
    with pytest.raises(ValueError, match="does not fit"):
        padded_lengths([6], [9], Bucket(4, 5))


def _batch(q_lens: list[int], seq_lens: list[int], seed: int, device: str = "cpu"):
    case = make_paged_case(q_lens, seq_lens, H, HKV, D, block_size=4, seed=seed, device=device)
    tokens = torch.randint(0, VOCAB, (case.meta.num_tokens,), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    unowned = set(range(case.k_cache.shape[0] // 4)) - set(case.meta.block_tables.flatten().tolist()) - {0}
    return case, tokens.to(device), positions.to(device), max(unowned)


@pytest.mark.parametrize("name", TORCH_BACKENDS)
def test_a_batch_padded_into_its_bucket_gives_the_eager_outputs_and_kv(name: str) -> None:
    """Static buffers, padded with empty sequences and ownerless tokens: same logits for the real tokens,
    same KV everywhere but the pad block (what a replay computes, run eagerly here)."""
    case, tokens, positions, pad_block = _batch([5, 1, 3], [40, 9, 26], seed=1)
    model = OneLayer(get_backend(name)(H, HKV, D, "cpu"), "cpu")
    k_eager, v_eager = case.k_cache.clone(), case.v_cache.clone()
    model.backend.plan(case.meta)
    eager = model.forward(tokens, positions, case.meta, k_eager, v_eager)

    bucket = Bucket(4, 5)
    static = StaticBatch(Bucket(8, 5), case.meta.block_tables.shape[1], 4, pad_block, torch.device("cpu"))
    static.load_worst_case(Bucket(8, 5))  # leave stale values behind, as an earlier capture would
    s_tokens, s_positions, s_meta = static.load(bucket, tokens, positions, case.meta)
    assert s_meta.num_tokens == 20 and s_meta.query_lens_cpu == (5, 1, 3, 0)
    assert s_meta.slot_mapping[9:].eq(pad_block * 4).all() and s_meta.query_start_loc.tolist() == [0, 5, 6, 9, 9]
    k_static, v_static = case.k_cache.clone(), case.v_cache.clone()
    model.backend.plan(s_meta)
    out = model.forward(s_tokens, s_positions, s_meta, k_static, v_static)

    torch.testing.assert_close(out[:9], eager, atol=1e-5, rtol=0)
    keep = torch.ones(k_eager.shape[0], dtype=torch.bool)
    keep[pad_block * 4:(pad_block + 1) * 4] = False
    assert torch.equal(k_static[keep].nan_to_num(), k_eager[keep].nan_to_num())
    assert torch.equal(v_static[keep].nan_to_num(), v_eager[keep].nan_to_num())


def test_graphs_are_off_on_cpu_and_the_forward_runs_eagerly() -> None:
    case, tokens, positions, pad_block = _batch([5, 5], [12, 30], seed=2)
    model = OneLayer(get_backend("packed")(H, HKV, D, "cpu"), "cpu")
    k, v = case.k_cache.clone(), case.v_cache.clone()
    graphed = CudaGraphForward(lambda t, p, m: model.forward(t, p, m, k, v), model.backend, make_buckets(4, [5]),
                               max_blocks_per_seq=case.meta.block_tables.shape[1], block_size=4,
                               pad_block=pad_block, device="cpu")
    assert not graphed.enabled
    out = graphed(tokens, positions, case.meta)
    model.backend.plan(case.meta)
    torch.testing.assert_close(out, model.forward(tokens, positions, case.meta, case.k_cache.clone(),
                                                  case.v_cache.clone()), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["triton-packed", "triton-decomposed"])
def test_replayed_graphs_match_eager_forwards_on_gpu(name: str) -> None:
    """Several batches through one set of captured buckets (one bucket twice with other lengths, another
    bucket, a decode bucket, one batch outside every bucket): each equals an eager forward."""
    batches = [([5, 5, 5], [40, 9, 26]), ([4, 5, 1], [90, 6, 1]), ([5, 2], [70, 5]), ([1] * 5, [3, 90, 17, 33, 4]),
               ([7], [30])]
    pool_blocks = 512
    k_pool = torch.zeros(pool_blocks * 4, HKV, D, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    model = OneLayer(get_backend(name)(H, HKV, D, "cuda"), "cuda")
    graphed = CudaGraphForward(lambda t, p, m: model.forward(t, p, m, k_pool, v_pool), model.backend,
                               make_buckets(8, [1, 5]), max_blocks_per_seq=64, block_size=4,
                               pad_block=pool_blocks - 1, device="cuda")
    assert graphed.enabled
    graphed.capture()
    for i, (q_lens, seq_lens) in enumerate(batches):
        case, tokens, positions, _ = _batch(q_lens, seq_lens, seed=10 + i, device="cuda")
        used = case.k_cache.shape[0]  # the batch's blocks are the front of the pool; the pad block is the last
        k_pool.zero_()
        v_pool.zero_()
        k_pool[:used].copy_(case.k_cache)
        v_pool[:used].copy_(case.v_cache)
        k_eager, v_eager = k_pool.clone(), v_pool.clone()
        out = graphed(tokens, positions, case.meta).clone()
        model.backend.plan(case.meta)
        eager = model.forward(tokens, positions, case.meta, k_eager, v_eager)
        torch.testing.assert_close(out, eager, atol=1e-4, rtol=0)
        # the K/V written agree to fp32 rounding, not bit for bit: the replay's projections run at the bucket's padded
        # row count, for which cuBLAS may pick another kernel (seen on an H100: 7e-7 apart)
        torch.testing.assert_close(k_pool[:used], k_eager[:used], atol=1e-5, rtol=0, equal_nan=True)
        torch.testing.assert_close(v_pool[:used], v_eager[:used], atol=1e-5, rtol=0, equal_nan=True)
