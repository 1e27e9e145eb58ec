// y = x W^T for W stored as GGUF blocks (Q4_1, Q8_0); x and y fp32.
//
// Weights [N, K] keep GGUF's blocks of 32 along K (their codes and fp16 scales, byte for byte), regrouped so that
// 32 output rows (a pair of 16-row tiles) read one contiguous stream, with each output row owning 4 consecutive
// bytes (an int32 lane) of every 64-byte row of codes (packing: spind/models/gguf_linear.py):
//   blocks [N/32, K/32, B] uint8, for output rows 32t .. 32t + 31 and inputs 32g .. 32g + 31:
//     Q4_1  B = 640:  d[32] fp16 | m[32] fp16 | codes[2][4][64]   w = d q + m
//     Q8_0  B = 1088: d[32] fp16 | codes[2][8][64]                w = d q
//   codes[h][p][4 lane + i] belongs to output row 32t + 16h + lane: for Q4_1 it is GGUF's qs[4p + i] (low nibble
//   k = 32g + 4p + i, high nibble k = 32g + 16 + 4p + i), for Q8_0 the int8 q at k = 32g + 4p + i.
//
// Two builds, one contract: every y[r, n] is a fixed sequence of operations on row r of x and column n of W,
// whatever M is and whatever else is in the call, so a 1-row decode and a (k+1)-row verify give bit-identical
// rows (batch invariance). Rows are blocked (a block of rows shares each unpacked weight vector), never split
// along K; threads split N.
//
// avx512vnni (integer path): each block of 32 activations is written as scale * (256^2 a + 256 b + c) with int8
// digits a, b, c (a 23-bit fixed-point copy, as fine as fp32's 24-bit significand for the block's largest entry),
// and each digit is dotted with the 4-bit (or 8-bit) codes exactly in int32 by vpdpbusd, 64 products per
// instruction. Per block: y += d * scale * (Horner of the three integer dots) + m * (sum of the block's x).
// The weights are read once per call for every row; unpacking nibbles costs 3 operations per 128 weights.
//
// avx2 (fp32 path): w = fma(q, d, m) in a register (exactly gguf's fp32 weight: d q is exact), then two fp32
// FMA chains per output (k mod 32 < 16 and >= 16, k increasing), added at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "simd.h"

namespace spind_cpu {
namespace {

constexpr int64_t kBlock = 32;  // GGUF block along K
constexpr int64_t kPair = 32;   // output rows per packed block (two 16-row tiles)
constexpr int kCols = 2;        // vectors of output rows per unit of work
constexpr int64_t kUnit = kCols * kLanes;  // 32 (a pair) or 16 (a tile)
// Software prefetch distance in blocks (10 KB of Q4_1). Measured on the default model at 1 thread (AVX-512 VNNI):
// without it a 5-row verify's GEMMs take 1.6x longer; 4 to 32 are within noise of each other.
constexpr int64_t kPrefetchBlocks = 16;

enum class Format { kQ4_1, kQ8_0 };

struct Weights {
  Format format;
  const uint8_t* blocks;
  int64_t groups;
  int64_t num_blocks;  // pairs x groups: blocks are one contiguous stream, pair-major
  int64_t block_bytes() const { return format == Format::kQ4_1 ? 640 : 1088; }
  int64_t code_rows() const { return format == Format::kQ4_1 ? 4 : 8; }  // 64-byte rows per tile
  const uint8_t* block(int64_t pair, int64_t g) const { return blocks + (pair * groups + g) * block_bytes(); }
  // prefetch the block kPrefetchBlocks ahead in the stream (the next pair's first ones near a pair's end)
  void prefetch_ahead(int64_t pair, int64_t g) const {
    const int64_t i = pair * groups + g + kPrefetchBlocks;
    if (i < num_blocks)
      for (int64_t off = 0; off < block_bytes(); off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + i * block_bytes() + off), _MM_HINT_T0);
  }
  const uint16_t* d(const uint8_t* b) const { return reinterpret_cast<const uint16_t*>(b); }
  const uint16_t* m(const uint8_t* b) const { return reinterpret_cast<const uint16_t*>(b + 64); }
  const uint8_t* codes(const uint8_t* b, int64_t tile) const {
    return b + (format == Format::kQ4_1 ? 128 : 64) + tile * code_rows() * 64;
  }
};

#ifdef SPIND_VNNI
constexpr int kRows = 5;  // rows per register block: a k = 4 verify in one pass over the weights
// int8 digits per activation. Two (16-bit activations) measured 8% faster per decode step and 22% per 5-row
// verify, but move the default model's logits up to 1.3e-2 off the fp32 reference (three: 1.5e-4, as fp32's own
// reorderings); the contract here is fp32 precision.
constexpr int kDigits = 3;
constexpr int32_t kLimit = (1 << 22) - 1;  // |x / scale| <= kLimit keeps the leading digit in [-64, 64]

// The activations of one call as digits: prepared once, read by every unit.
struct Activations {
  int64_t groups;
  std::vector<int8_t> digits;  // [M][G][kDigits][32]; digit e of x[r, 32g + k] at ((r G + g) kDigits + e) 32 + k
  std::vector<float> scale;    // [M][G]
  std::vector<float> sum;      // [M][G] sum of the block's x (fp32, k increasing), for Q4_1's m term
  std::vector<int32_t> digit_sum;  // [M][G][kDigits], for Q8_0's +128 offset

  Activations(const float* x, int64_t M, int64_t K)
      : groups(K / kBlock), digits(M * K * kDigits), scale(M * groups), sum(M * groups), digit_sum(M * groups * kDigits) {
    at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t rg = begin; rg < end; ++rg) quantize_block(x + rg * kBlock, rg);
    });
  }

  void quantize_block(const float* xb, int64_t rg) {
    float amax = 0.0f, s = 0.0f;
    for (int k = 0; k < kBlock; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      s += xb[k];
    }
    sum[rg] = s;
    scale[rg] = amax / kLimit;
    const float inv = amax > 0.0f ? kLimit / amax : 0.0f;
    int8_t* out = digits.data() + rg * kDigits * kBlock;
    int32_t dsum[kDigits] = {};
    for (int k = 0; k < kBlock; ++k) {
      int32_t q = static_cast<int32_t>(std::lrintf(xb[k] * inv));
      q = std::min(std::max(q, -kLimit), kLimit);
      for (int e = kDigits - 1; e >= 0; --e) {  // balanced base-256 digits, least significant last
        const int32_t digit = ((q + 128) & 255) - 128;
        out[e * kBlock + k] = static_cast<int8_t>(digit);
        dsum[e] += digit;
        q = (q - digit) >> 8;
      }
    }
    for (int e = 0; e < kDigits; ++e) digit_sum[rg * kDigits + e] = dsum[e];
  }
};

// y[r0 + r, unit] for MR rows. Per output: for each block, three exact int32 dots, Horner in fp32, then
// acc = fma(T, d * scale, acc) (and acc = fma(m, sum, acc) for Q4_1), blocks in increasing order.
template <int MR>
void row_block(const Weights& w, const Activations& a, int64_t unit, int64_t r0, float* y, int64_t ldy) {
  vf acc[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = vzero();
  const vi low4 = iset1(0x0F0F0F0F), flip = iset1(static_cast<int32_t>(0x80808080));
  const bool q4 = w.format == Format::kQ4_1;
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* blk = w.block(unit, g);
    w.prefetch_ahead(unit, g);
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* codes = w.codes(blk, c);
      vi wq[8];  // u8 codes, 16 lanes x 4 consecutive k each: wq[p] holds k = 32g + 4p .. 4p + 3
      if (q4) {
        for (int p = 0; p < 4; ++p) {
          const vi v = iload(codes + p * 64);
          wq[p] = iand(v, low4);
          wq[p + 4] = iand(srl16(v, 4), low4);
        }
      } else {
        for (int p = 0; p < 8; ++p) wq[p] = ixor(iload(codes + p * 64), flip);  // q + 128
      }
      const vf d = load_f16(w.d(blk) + c * kLanes);
      const vf m = q4 ? load_f16(w.m(blk) + c * kLanes) : vzero();
      for (int r = 0; r < MR; ++r) {
        const int64_t rg = (r0 + r) * w.groups + g;
        const int32_t* quads = reinterpret_cast<const int32_t*>(a.digits.data() + rg * kDigits * kBlock);
        vi dot[kDigits];
        for (int e = 0; e < kDigits; ++e) {
          vi d0 = izero(), d1 = izero();  // two chains: integer sums are exact, so their order is free
          for (int p = 0; p < 8; p += 2) {
            d0 = dpbusd(d0, wq[p], iset1(quads[e * 8 + p]));
            d1 = dpbusd(d1, wq[p + 1], iset1(quads[e * 8 + p + 1]));
          }
          dot[e] = iadd(d0, d1);
          if (!q4) dot[e] = isub(dot[e], iset1(128 * a.digit_sum[rg * kDigits + e]));
        }
        vf t = to_float(dot[0]);
        for (int e = 1; e < kDigits; ++e) t = vfma(t, vset1(256.0f), to_float(dot[e]));
        acc[r][c] = vfma(t, vmul(d, vset1(a.scale[rg])), acc[r][c]);
        if (q4) acc[r][c] = vfma(m, vset1(a.sum[rg]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) vstore(y + r * ldy + c * kLanes, acc[r][c]);
}

using Inputs = Activations;
#else
constexpr int kRows = 2;

struct Inputs {  // the fp32 rows as they are
  const float* x;
  int64_t ldx;
  Inputs(const float* x, int64_t /* M */, int64_t K) : x(x), ldx(K) {}
};

// y[r0 + r, unit] for MR rows: w dequantized in registers, two fp32 FMA chains per output.
template <int MR>
void row_block(const Weights& w, const Inputs& in, int64_t unit, int64_t r0, float* y, int64_t ldy) {
  const float* x = in.x + r0 * in.ldx;
  const int64_t ldx = in.ldx;
  vf lo[MR][kCols], hi[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) lo[r][c] = hi[r][c] = vzero();
  const vi low4 = iset1(15);
  const int64_t pair = unit / 2, tile = unit % 2;  // an avx2 unit is one tile (16 rows, two 8-lane columns)
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* blk = w.block(pair, g);
    if (tile == 0) w.prefetch_ahead(pair, g);
    const uint8_t* qs[kCols];
    vf d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      const int64_t lane0 = tile * 16 + c * kLanes;
      qs[c] = w.codes(blk, tile) + c * kLanes * 4;
      d[c] = load_f16(w.d(blk) + lane0);
      m[c] = w.format == Format::kQ4_1 ? load_f16(w.m(blk) + lane0) : vzero();
    }
    const float* xg = x + g * kBlock;
    if (w.format == Format::kQ4_1) {
      for (int p = 0; p < 4; ++p) {
        vi v[kCols];
        for (int c = 0; c < kCols; ++c) v[c] = iload(qs[c] + p * 64);
        for (int i = 0; i < 4; ++i) {
          vf wl[kCols], wh[kCols];
          for (int c = 0; c < kCols; ++c) {
            const vi b = byte_u(v[c], i);
            wl[c] = vfma(to_float(iand(b, low4)), d[c], m[c]);
            wh[c] = vfma(to_float(srl32(b, 4)), d[c], m[c]);
          }
          for (int r = 0; r < MR; ++r) {
            const vf xl = vset1(xg[r * ldx + 4 * p + i]), xh = vset1(xg[r * ldx + 16 + 4 * p + i]);
            for (int c = 0; c < kCols; ++c) {
              lo[r][c] = vfma(wl[c], xl, lo[r][c]);
              hi[r][c] = vfma(wh[c], xh, hi[r][c]);
            }
          }
        }
      }
    } else {
      for (int p = 0; p < 8; ++p) {
        vi v[kCols];
        for (int c = 0; c < kCols; ++c) v[c] = iload(qs[c] + p * 64);
        for (int i = 0; i < 4; ++i) {
          vf wk[kCols];
          for (int c = 0; c < kCols; ++c) wk[c] = vmul(to_float(byte_s(v[c], i)), d[c]);
          for (int r = 0; r < MR; ++r) {
            const vf xk = vset1(xg[r * ldx + 4 * p + i]);
            for (int c = 0; c < kCols; ++c) {
              if (p < 4) lo[r][c] = vfma(wk[c], xk, lo[r][c]);
              else hi[r][c] = vfma(wk[c], xk, hi[r][c]);
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) vstore(y + r * ldy + c * kLanes, vadd(lo[r][c], hi[r][c]));
}

#endif

// y[r0 .. r0 + n) for one unit, in register blocks of at most MR rows
template <int MR>
void rows(const Weights& w, const Inputs& in, int64_t unit, int64_t r0, float* y, int64_t ldy, int64_t n) {
  if constexpr (MR > 1) {
    if (n < MR) return rows<MR - 1>(w, in, unit, r0, y, ldy, n);
  }
  row_block<MR>(w, in, unit, r0, y, ldy);
}

at::Tensor gemm(const at::Tensor& x, const Weights& w, int64_t n_out) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  const Inputs in(x.data_ptr<float>(), M, K);  // avx512vnni: x as digits, once for every unit
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out / kUnit, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      for (int64_t r0 = 0; r0 < M; r0 += kRows)
        rows<kRows>(w, in, u, r0, yp + r0 * n_out + u * kUnit, n_out, std::min<int64_t>(kRows, M - r0));
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, Format format) {
  const Weights w{format, nullptr, blocks.dim() == 3 ? blocks.size(1) : 0, 0};
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == w.block_bytes() && blocks.scalar_type() == at::kByte &&
              blocks.is_contiguous(), "blocks must be a contiguous uint8 [N/32, K/32, ", w.block_bytes(), "]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) == w.groups * kBlock, "x has ", x.size(1), " columns, the weight ", w.groups * kBlock);
  return gemm(x, Weights{format, blocks.data_ptr<uint8_t>(), w.groups, blocks.size(0) * w.groups}, blocks.size(0) * kPair);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ4_1); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ8_0); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks) -> Tensor", &q4_1_linear);
  m.def("q8_0_linear(Tensor x, Tensor blocks) -> Tensor", &q8_0_linear);
}

}  // namespace spind_cpu
