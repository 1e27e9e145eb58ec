// The kernels a forward chains, callable from C++ (csrc/stack.cpp runs a whole decoder stack through them). They
// live in a namespace per build (SPIND_OPS = spind_cpu_<isa>), so two builds loaded side by side share no symbol.
#pragma once

#include <ATen/ATen.h>

namespace spind_cpu {
namespace SPIND_OPS {

// y = x W^T from packed GGUF blocks (csrc/quant_gemm.cpp): Q8_0 or Q4_1 (Q4_0 packed as Q4_1); digits: 0 for
// fp32-precision activations, 1 or 2 for 8- or 15-bit ones
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, bool q8_0, int64_t digits);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// x += residual in place, then rms_norm(x, w, eps): a decoder layer's residual add and the next norm in one pass
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                   at::Tensor v_cache, const at::Tensor& slots, int64_t H, int64_t Hkv);
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& slot_start, const at::Tensor& cu_q,
                         const at::Tensor& ctx_lens, double scale);

}  // namespace SPIND_OPS
}  // namespace spind_cpu
