// Causal attention over a paged KV cache, one query row at a time, so that a row's output never depends on
// how many other rows (of its request or of others) share the forward: batch-invariant by construction.
//
// Tokens of all requests are packed: request b owns rows [cu_q[b], cu_q[b+1]) of q and its context is the
// ctx_lens[b] cache slots slots[slot_start[b] ...]; row t of request b sits at position
// ctx_lens[b] - (cu_q[b+1] - t) and sees the positions up to and including its own. For one (row, head):
// scores over the visible positions in increasing order (a fixed-order dot product per position), max,
// exp, a sequential sum, then the weighted sum of V rows in increasing position order. All heads of a row are
// handled together, and up to kChunk rows of a request share each read: a cache slot (every KV head) is read
// once per chunk, front to back, prefetched.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace spind_cpu {
namespace {

// dot(a, b) over D: vector lanes in a fixed chain, a fixed horizontal sum, then the tail in order.
inline float dot(const float* a, const float* b, int64_t D) {
  int64_t i = 0;
  float s = 0.0f;
  if (D >= kLanes) {
    vf acc = vmul(vload(a), vload(b));
    for (i = kLanes; i + kLanes <= D; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
    s = hsum(acc);
  }
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

// p[0:n] = exp(p[0:n] - max): whole vectors from 0, the tail in a padded vector (lanes are independent).
inline void exp_shifted(float* p, int64_t n, float max) {
  const vf mv = vset1(max);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(p + i, vexp_nonpositive(vsub(vload(p + i), mv)));
  if (i < n) {
    alignas(64) float tail[kLanes];
    std::fill(tail, tail + kLanes, max);
    std::copy(p + i, p + n, tail);
    vstore(tail, vexp_nonpositive(vsub(vload(tail), mv)));
    std::copy(tail, tail + (n - i), p + i);
  }
}

constexpr int64_t kAhead = 8;  // cache slots to prefetch ahead: a request's slots are scattered over the pool
constexpr int64_t kChunk = 8;  // rows of one request per work item (they share the K/V rows they read)

inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// out += w * v over D (vector lanes, then the tail)
inline void axpy(float* out, float w, const float* v, int64_t D) {
  int64_t i = 0;
  const vf wv = vset1(w);
  for (; i + kLanes <= D; i += kLanes) vstore(out + i, vfma(wv, vload(v + i), vload(out + i)));
  for (; i < D; ++i) out[i] += w * v[i];
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& slot_start, const at::Tensor& cu_q,
                         const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous fp32 [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous fp32 [slots, Hkv, D]");
  for (const at::Tensor* t : {&slots, &slot_start, &cu_q, &ctx_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "index tensors must be int64 1-D");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), B = ctx_lens.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(cu_q.size(0) == B + 1 && slot_start.size(0) == B, "cu_q must be [B + 1] and slot_start [B]");
  const int64_t group = H / Hkv;
  const int64_t *cu = cu_q.data_ptr<int64_t>(), *ctx = ctx_lens.data_ptr<int64_t>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *start = slot_start.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_q must run from 0 to T");
  // work items: up to kChunk consecutive rows of one request, which share every K/V row they read
  struct Chunk { int64_t b, first, last; };
  std::vector<Chunk> chunks;
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cu[b + 1] - cu[b] <= ctx[b] && cu[b + 1] >= cu[b], "request ", b, ": more queries than context");
    TORCH_CHECK(start[b] >= 0 && start[b] + ctx[b] <= slots.size(0), "request ", b, ": slots out of range");
    for (int64_t t = cu[b]; t < cu[b + 1]; t += kChunk) chunks.push_back({b, t, std::min(t + kChunk, cu[b + 1])});
    max_ctx = std::max(max_ctx, ctx[b]);
  }
  const int64_t num_slots = k_cache.size(0);
  for (int64_t i = 0; i < slots.size(0); ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "slot out of range");

  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats per cache slot: read whole, all KV heads at once
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunk * H * max_ctx);  // [row in chunk][head][position]
    std::vector<float> inv_denom(kChunk * H);
    for (int64_t c = begin; c < end; ++c) {
      const Chunk ch = chunks[c];
      const int64_t n = ch.last - ch.first, b = ch.b;
      const int64_t first_visible = ctx[b] - (cu[b + 1] - ch.first) + 1;  // positions row `first` sees
      const int64_t all_visible = first_visible + n - 1;                   // ... and the chunk's last row
      const int64_t* rs = sl + start[b];
      for (int64_t p = 0; p < all_visible; ++p) {
        if (p + kAhead < all_visible) prefetch_row(kp + rs[p + kAhead] * row, row);
        const float* krow = kp + rs[p] * row;
        for (int64_t j = std::max<int64_t>(0, p - first_visible + 1); j < n; ++j) {  // rows that see p
          const float* qt = qp + (ch.first + j) * H * D;
          float* sj = scores.data() + j * H * max_ctx;
          for (int64_t h = 0; h < H; ++h) sj[h * max_ctx + p] = dot(qt + h * D, krow + (h / group) * D, D) * sc;
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t visible = first_visible + j;
        for (int64_t h = 0; h < H; ++h) {
          float* s = scores.data() + (j * H + h) * max_ctx;
          exp_shifted(s, visible, *std::max_element(s, s + visible));
          float denom = 0.0f;
          for (int64_t p = 0; p < visible; ++p) denom += s[p];
          inv_denom[j * H + h] = 1.0f / denom;
        }
      }
      float* oc = op + ch.first * H * D;
      std::fill(oc, oc + n * H * D, 0.0f);
      for (int64_t p = 0; p < all_visible; ++p) {
        if (p + kAhead < all_visible) prefetch_row(vp + rs[p + kAhead] * row, row);
        const float* vrow = vp + rs[p] * row;
        for (int64_t j = std::max<int64_t>(0, p - first_visible + 1); j < n; ++j)
          for (int64_t h = 0; h < H; ++h)
            axpy(oc + (j * H + h) * D, scores[(j * H + h) * max_ctx + p], vrow + (h / group) * D, D);
      }
      for (int64_t j = 0; j < n * H; ++j)
        for (int64_t x = 0; x < D; ++x) oc[j * D + x] *= inv_denom[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("row_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor slot_start, Tensor cu_q, "
        "Tensor ctx_lens, float scale) -> Tensor", &row_attention);
}

}  // namespace spind_cpu
