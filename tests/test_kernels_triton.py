"""The Triton kernels (triton-packed, triton-decomposed) against the per-sequence fp64 reference.

Without a GPU they run in Triton's interpreter, which must be switched on before any kernel module is
imported (the registry imports Triton backends lazily, and no other test imports them). Interpreter shapes
are small (one program is Python + NumPy); the GPU tests add the real model's and LLaMA-7B's shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from spind.kernels.attention import get_backend  # noqa: E402
from spind.kernels.cuda_graphs import Bucket, StaticBatch  # noqa: E402
from spind.kernels.testing import make_paged_case, reference_attention  # noqa: E402

TRITON_BACKENDS = ("triton-packed", "triton-decomposed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 2e-5

# (query lengths, KV lengths, block size): interpreter-sized, yet each with decode and verify rows,
# a length-1 request, and one long enough to be split into several rows of many key tiles
SMALL_BATCHES = {
    "mixed": ([1, 5, 1, 3, 7], [1, 40, 150, 3, 29], 4),
    "decode-only": ([1, 1, 1], [1, 17, 90], 8),
    "verify": ([5, 5], [5, 61], 16),
}


def run_backend(name: str, case, scale: float, **options) -> torch.Tensor:
    h, hkv, d = case.q.shape[1], case.k_cache.shape[1], case.q.shape[2]
    backend = get_backend(name)(h, hkv, d, DEVICE, **options)
    backend.plan(case.meta)
    return backend(case.q, case.k_cache, case.v_cache, scale)


@pytest.mark.parametrize("name", TRITON_BACKENDS)
@pytest.mark.parametrize("batch", SMALL_BATCHES)
def test_triton_kernel_matches_the_reference(name: str, batch: str) -> None:
    q_lens, seq_lens, block_size = SMALL_BATCHES[batch]
    case = make_paged_case(q_lens, seq_lens, 6, 2, 32, block_size=block_size, seed=1, device=DEVICE)
    out = run_backend(name, case, 0.2)
    torch.testing.assert_close(out, reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2),
                               atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", TRITON_BACKENDS)
def test_triton_kernel_at_the_default_models_head_shape(name: str) -> None:
    """SmolLM2's 9 query heads over 3 KV heads of 64 (GROUP 3 does not divide BLOCK_M), a 600-key request."""
    case = make_paged_case([5, 5, 1], [600, 37, 80], 9, 3, 64, block_size=16, seed=5, device=DEVICE)
    torch.testing.assert_close(run_backend(name, case, 0.125),
                               reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125),
                               atol=FP32_ATOL, rtol=0)


def test_triton_decomposed_merges_a_split_request_and_skips_empty_rows() -> None:
    """rows_per_seq 3: the 150-key request is split over several rows, and the row grid (3 x 5 rows) is
    larger than the plan, so the kernel also sees rows of length 0."""
    q_lens, seq_lens, block_size = SMALL_BATCHES["mixed"]
    case = make_paged_case(q_lens, seq_lens, 6, 2, 32, block_size=block_size, seed=2, device=DEVICE)
    backend = get_backend("triton-decomposed")(6, 2, 32, DEVICE, rows_per_seq=3.0)
    backend.plan(case.meta)
    assert backend.decomposition.num_rows < backend.num_rows
    assert sum(r.seq == 2 for r in backend.decomposition.rows) > 1
    out = backend(case.q, case.k_cache, case.v_cache, 0.2)
    torch.testing.assert_close(out, reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2),
                               atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", TRITON_BACKENDS)
def test_triton_kernels_in_a_padded_bucket_match_the_unpadded_batch(name: str) -> None:
    """What a CUDA-graph replay sees: the batch copied into static buffers and padded to its bucket."""
    case = make_paged_case([3, 1], [20, 9], 6, 2, 32, block_size=4, seed=3, device=DEVICE)
    unowned = set(range(case.k_cache.shape[0] // 4)) - set(case.meta.block_tables.flatten().tolist())
    static = StaticBatch(Bucket(4, 4), case.meta.block_tables.shape[1], 4, max(unowned), torch.device(DEVICE))
    _, _, meta = static.load(Bucket(4, 4), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                             case.meta)
    q = torch.cat([case.q, torch.randn(12, 6, 32, device=DEVICE)])  # 16 bucket tokens, 4 of them real
    backend = get_backend(name)(6, 2, 32, DEVICE)
    backend.plan(meta)
    out = backend(q, case.k_cache, case.v_cache, 0.2)
    torch.testing.assert_close(out[:4], reference_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2),
                               atol=FP32_ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TRITON_BACKENDS)
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 32, 128), (32, 8, 128)])  # SmolLM2, LLaMA-7B, GQA-8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_reference_on_gpu(name: str, shape: tuple[int, int, int], dtype) -> None:
    h, hkv, d = shape
    q_lens = [5] * 12 + [1] * 3 + [64]
    seq_lens = [45, 70, 33, 130, 61, 9, 52, 5, 400, 47, 88, 1500, 1, 17, 300, 64]
    case = make_paged_case(q_lens, seq_lens, h, hkv, d, block_size=16, seed=4, dtype=dtype, device="cuda")
    ref = reference_attention(case.q, case.k_cache, case.v_cache, case.meta, d ** -0.5)
    atol = FP32_ATOL if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(run_backend(name, case, d ** -0.5), ref, atol=atol, rtol=0)
