// A LLaMA decoder stack of the quantized (`gguf`, `gguf-q16`, `gguf-q8`) targets in one call: per layer RMSNorm, the
// fused q/k/v GEMM, RoPE and the KV-cache writes, row attention, the output GEMM, the residual add and RMSNorm (one
// pass: add_rms_norm), the fused gate/up GEMM, SiLU x up, the down GEMM, whose residual add the next layer's first
// norm does (the last layer's is an add of its own). The kernels compute what the per-module forward computes
// (csrc/ops.h: the same operations per element, in the same order on the same tensors), so the results are
// bit-identical to it; what goes is the Python between them (~11 module calls per layer, ~2 ms of a ~10 ms decode
// step of the default model at 1 thread), which also ran on one core while the other waited.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "ops.h"

namespace spind_cpu {
namespace {

// A copy of a contiguous CPU tensor in memory the kernel may back with 2 MB pages (transparent huge pages in
// `madvise` mode, the common default). The weights of a decode step are ~100 MB streamed once per step: on 4 KB
// pages that is a TLB miss every 4 KB, on 2 MB pages one every 2 MB. Falls back to a plain copy where madvise
// refuses (the memory is still valid, just not huge).
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (linux/mman.h, 6.1), which older C headers lack

at::Tensor huge_page_copy(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "huge_page_copy: a contiguous CPU tensor");
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = t.numel() * t.element_size();
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  if (size == 0) return t.clone();
  void* p = std::aligned_alloc(kHuge, size);
  TORCH_CHECK(p != nullptr, "huge_page_copy: out of memory (", size, " bytes)");
  madvise(p, size, MADV_HUGEPAGE);  // before the first touch, so the faults below take huge pages
  std::memcpy(p, t.data_ptr(), bytes);
  // A fault takes a 4 KB page where no free 2 MB one was at hand (memory fragmented by what loaded before: in one
  // `spind bench e2e` the last target worker loaded held 234 of its 270 MB of weights on huge pages, the first 270).
  // Linux >= 6.1 collapses them now, compacting as it must; elsewhere (EINVAL) khugepaged does it in its own time.
  madvise(p, size, kMadvCollapse);
  return at::from_blob(p, t.sizes(), [](void* q) { std::free(q); }, t.options());
}

// Where a stack call's time goes, for `spind bench batch`: seconds in the GEMMs, in row attention, and in
// the row-wise ops (RMSNorm, RoPE and the cache writes, SiLU x up, residual adds), summed over calls while
// profiling is on (`stack_profile`). Off, it costs one relaxed load per call.
enum Phase { kGemm, kAttention, kRowOps, kPhases };
std::atomic<bool> g_profiling{false};
std::array<std::atomic<int64_t>, kPhases> g_phase_ns{};
std::atomic<int64_t> g_calls{0};

// [gemm, attention, row-wise ops] seconds and the number of stack calls since the last call; `enable` turns the
// timers on or off from now on
at::Tensor stack_profile(bool enable) {
  at::Tensor out = at::empty({kPhases + 1}, at::kDouble);
  double* o = out.data_ptr<double>();
  for (int p = 0; p < kPhases; ++p) o[p] = g_phase_ns[p].exchange(0) * 1e-9;
  o[kPhases] = static_cast<double>(g_calls.exchange(0));
  g_profiling.store(enable);
  return out;
}

// weights: 4 per layer (qkv, o, gate_up, down) as packed blocks; q8_0 / out_features: per weight; norms: 2 per
// layer (input, post-attention); digits: the activations' (0: fp32 precision; 1, 2: 8 or 15 bits)
at::Tensor decoder_layers(const at::Tensor& h, at::TensorList weights, c10::ArrayRef<int64_t> q8_0,
                          c10::ArrayRef<int64_t> out_features, at::TensorList norms, double eps,
                          int64_t digits, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& write_slots,
                          const at::Tensor& slots, const at::Tensor& slot_start, const at::Tensor& cu_q,
                          const at::Tensor& ctx_lens, double scale, int64_t H, int64_t Hkv) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be fp32 [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(q8_0.size()) == 4 * layers &&
              static_cast<int64_t>(out_features.size()) == 4 * layers &&
              static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(v_caches.size()) == layers,
              "decoder_layers: 4 weights, 2 norms and one K and V cache per layer");
  auto linear = [&](const at::Tensor& x, int64_t i) {
    at::Tensor y = SPIND_OPS::gguf_linear(x, weights[i], q8_0[i] != 0, digits);
    return y.size(1) == out_features[i] ? y : y.narrow(1, 0, out_features[i]).contiguous();
  };
  const int64_t T = h.size(0);
  const bool profiling = g_profiling.load(std::memory_order_relaxed);
  using Clock = std::chrono::steady_clock;
  Clock::time_point mark = profiling ? Clock::now() : Clock::time_point{};
  auto lap = [&](Phase p) {  // the time since the last lap goes to p
    if (!profiling) return;
    const Clock::time_point now = Clock::now();
    g_phase_ns[p].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark).count());
    mark = now;
  };
  at::Tensor x = h.contiguous().clone();
  at::Tensor down;  // the previous layer's MLP output, added to x by this layer's first norm
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor normed = l == 0 ? SPIND_OPS::rms_norm(x, norms[0], eps)
                               : SPIND_OPS::add_rms_norm(x, down, norms[2 * l], eps);
    lap(kRowOps);
    at::Tensor qkv = linear(normed, 4 * l);
    lap(kGemm);
    at::Tensor q = SPIND_OPS::rope_kv(qkv, cos, sin, k_caches[l], v_caches[l], write_slots, H, Hkv);
    lap(kRowOps);
    at::Tensor o = SPIND_OPS::row_attention(q, k_caches[l], v_caches[l], slots, slot_start, cu_q, ctx_lens, scale);
    lap(kAttention);
    at::Tensor attn_out = linear(o.view({T, -1}), 4 * l + 1);
    lap(kGemm);
    normed = SPIND_OPS::add_rms_norm(x, attn_out, norms[2 * l + 1], eps);  // x += attn_out first
    lap(kRowOps);
    at::Tensor gu = linear(normed, 4 * l + 2);
    lap(kGemm);
    at::Tensor act = SPIND_OPS::silu_mul(gu);
    lap(kRowOps);
    down = linear(act, 4 * l + 3);
    lap(kGemm);
  }
  if (layers > 0) x.add_(down);
  lap(kRowOps);
  if (profiling) g_calls.fetch_add(1);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("huge_page_copy(Tensor t) -> Tensor", &huge_page_copy);
  m.def("stack_profile(bool enable) -> Tensor", &stack_profile);
  m.def("decoder_layers(Tensor h, Tensor[] weights, int[] q8_0, int[] out_features, Tensor[] norms, float eps, "
        "int digits, Tensor cos, Tensor sin, Tensor[] k_caches, Tensor[] v_caches, Tensor write_slots, "
        "Tensor slots, Tensor slot_start, Tensor cu_q, Tensor ctx_lens, float scale, int H, int Hkv) -> Tensor",
        &decoder_layers);
}

}  // namespace spind_cpu
