// Small fused ops of the quantized target's forward: one call instead of several torch ops per layer (at batch 1 a
// decode step is ~30 layers x ~40 ops, and each torch op costs ~1-2 us of dispatch). Each output row depends on
// its own input row only, in a fixed order: batch-invariant like the GEMMs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace spind_cpu {
namespace {

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), what, " must be a contiguous fp32 [T, D]");
}

// y = w * (x / sqrt(mean(x^2) + eps)) per row; the sum of squares in vector lanes, a fixed horizontal sum, the tail last.
// With a residual r: x += r first, in place (each element one fp32 add, as torch's add_), in the same pass over the
// row: the residual add of a decoder layer without a torch op of its own (an at::add_ per residual was ~4 % of a
// 16-client prefill's samples: its dispatch, and OpenMP's threads beside the kernels' pool)
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor* residual = nullptr) {
  check_rows(x, "x");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be fp32 [D]");
  if (residual != nullptr) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
  }
  at::Tensor y = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float *rp = residual != nullptr ? residual->data_ptr<float>() : nullptr, *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * D;
      float* yr = yp + t * D;
      int64_t i = 0;
      vf acc = vzero();
      if (rp != nullptr) {
        const float* rr = rp + t * D;
        for (; i + kLanes <= D; i += kLanes) {
          const vf v = vadd(vload(xr + i), vload(rr + i));
          vstore(xr + i, v);
          acc = vfma(v, v, acc);
        }
        for (int64_t j = i; j < D; ++j) xr[j] += rr[j];
      } else {
        for (; i + kLanes <= D; i += kLanes) acc = vfma(vload(xr + i), vload(xr + i), acc);
      }
      float ss = hsum(acc);
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      const vf rv = vset1(r);
      for (i = 0; i + kLanes <= D; i += kLanes) vstore(yr + i, vmul(vload(wp + i), vmul(vload(xr + i), rv)));
      for (; i < D; ++i) yr[i] = wp[i] * (xr[i] * r);
    }
  });
  return y;
}

// silu(gate) * up for gu = [gate | up] along the last dim: [T, 2I] -> [T, I]
inline vf silu(vf x) {
  // sigmoid via e = exp(-|x|) <= 1: x >= 0 -> 1 / (1 + e), x < 0 -> e / (1 + e); the numerator chosen before the one
  // division (a vector division is the slowest instruction here: two of them were ~half of silu_mul's time)
  const vf ax = vmax(x, vsub(vzero(), x));
  const vf e = vexp_nonpositive(vsub(vzero(), ax));
  const vf one = vset1(1.0f);
  return vmul(x, vdiv(vselect_nonnegative(x, one, e), vadd(one, e)));
}

at::Tensor silu_mul_impl(const at::Tensor& gu) {
  check_rows(gu, "gu");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "gu must be [T, 2I]");
  at::Tensor y = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *gate = gp + t * 2 * I, *up = gate + I;
      float* out = yp + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) vstore(out + i, vmul(silu(vload(gate + i)), vload(up + i)));
      if (i < I) {  // the tail in a zero-padded vector: lanes are independent
        alignas(64) float g[kLanes] = {}, u[kLanes] = {};
        std::copy(gate + i, gate + I, g);
        std::copy(up + i, up + I, u);
        vstore(g, vmul(silu(vload(g)), vload(u)));
        std::copy(g, g + (I - i), out + i);
      }
    }
  });
  return y;
}

// HF rotate-half RoPE of one head: out = [x1 c - x2 s, x2 c + x1 s] (multiplies and add/sub rounded separately,
// as the torch reference does)
inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const vf x1 = vload(x + i), x2 = vload(x + half + i), cv = vload(c + i), sv = vload(s + i);
    vstore(out + i, vsub(vmul(x1, cv), vmul(x2, sv)));
    vstore(out + half + i, vadd(vmul(x2, cv), vmul(x1, sv)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * c[i] - x2 * s[i];
    out[half + i] = x2 * c[i] + x1 * s[i];
  }
}

// n floats into the cache's element type: fp32 as they are, fp16 rounded to nearest even (vectors, then c10::Half's
// scalar conversion for a tail: the same rounding)
inline void store_kv(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
inline void store_kv(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_f16(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = c10::Half(src[i]).x;
}

// qkv [T, (H + 2 Hkv) D] -> q [T, H, D] with RoPE; RoPE'd k and v written to the caches (fp32 or fp16) at slots [T]
template <typename KV>
void rope_kv_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                  at::Tensor& v_cache, const int64_t* sl, int64_t H, int64_t Hkv, at::Tensor& q) {
  const int64_t T = qkv.size(0), D = k_cache.size(2), half = D / 2;
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  KV *kp = reinterpret_cast<KV*>(k_cache.data_ptr()), *vp = reinterpret_cast<KV*>(v_cache.data_ptr());
  const int64_t width = (H + 2 * Hkv) * D;
  parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> k(std::is_same_v<KV, float> ? 0 : D);
    for (int64_t t = begin; t < end; ++t) {
      const float *x = xp + t * width, *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) rotate(x + h * D, c, s, half, qp + (t * H + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        KV* dst = kp + (sl[t] * Hkv + h) * D;
        if constexpr (std::is_same_v<KV, float>) {
          rotate(x + (H + h) * D, c, s, half, dst);
        } else {
          rotate(x + (H + h) * D, c, s, half, k.data());
          store_kv(dst, k.data(), D);
        }
      }
      store_kv(vp + sl[t] * Hkv * D, x + (H + Hkv) * D, Hkv * D);
    }
  });
}

at::Tensor rope_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slots, int64_t H, int64_t Hkv) {
  check_rows(qkv, "qkv");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == Hkv && (kv_type == at::kFloat || kv_type == at::kHalf) &&
              k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv_type &&
              v_cache.is_contiguous(), "caches must be contiguous fp32 or fp16 [slots, Hkv, D], both the same");
  const int64_t T = qkv.size(0), D = k_cache.size(2), half = D / 2, S = k_cache.size(0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * Hkv) * D, "qkv must be [T, (H + 2 Hkv) D]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->numel() == T * half && t->scalar_type() == at::kFloat && t->is_contiguous(), "cos/sin must be fp32 [T, D/2]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T && slots.is_contiguous(), "slots must be int64 [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "slot out of range");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  if (kv_type == at::kFloat) {
    rope_kv_rows<float>(qkv, cos, sin, k_cache, v_cache, sl, H, Hkv, q);
  } else {
    rope_kv_rows<uint16_t>(qkv, cos, sin, k_cache, v_cache, sl, H, Hkv, q);
  }
  return q;
}

}  // namespace

namespace SPIND_OPS {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm_impl(x, w, eps); }
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, w, eps, &residual);
}
at::Tensor silu_mul(const at::Tensor& gu) { return silu_mul_impl(gu); }
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                   at::Tensor v_cache, const at::Tensor& slots, int64_t H, int64_t Hkv) {
  return rope_kv_impl(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv);
}
}  // namespace SPIND_OPS

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("rope_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int H, "
        "int Hkv) -> Tensor", &SPIND_OPS::rope_kv);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &SPIND_OPS::rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor w, float eps) -> Tensor", &SPIND_OPS::add_rms_norm);
  m.def("silu_mul(Tensor gu) -> Tensor", &SPIND_OPS::silu_mul);
}

}  // namespace spind_cpu
