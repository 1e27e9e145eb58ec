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
// Three builds, one contract: every y[r, n] is a fixed sequence of operations on row r of x and column n of W,
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
// avx512amx: the avx512vnni build, whose calls of at least `amx_min_rows` rows (a verify, a batch, a prefill) compute
// the same exact int32 block dots by AMX int8 tiles (tdpbsud / tdpbssd, 16 x 16 outputs x 32 k per instruction)
// and pass them through the same epilogue: bit-identical to avx512vnni at every M.
//
// avx2 (fp32 path): w = fma(q, d, m) in a register (exactly gguf's fp32 weight: d q is exact), then two fp32
// FMA chains per output (k mod 32 < 16 and >= 16, k increasing), added at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace spind_cpu {
namespace {

// The inner loops' helpers are forced inline: left to the compiler, Column::dot was an out-of-line call in every
// row-block instantiation, with the column's 8 unpacked code vectors spilled to the stack before each call and
// reloaded inside it (measured on Zen 4: the 1-row GEMMs of a decode step 1.5x slower).
#define SPIND_INLINE inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;  // GGUF block along K
constexpr int64_t kPair = 32;   // output rows per packed block (two 16-row tiles)
constexpr int kCols = 2;        // vectors of output rows per unit of work
constexpr int64_t kUnit = kCols * kLanes;  // 32 (a pair) or 16 (a tile)
// Software prefetch distance in blocks (10 KB of Q4_1). Measured on the default model at 1 thread (AVX-512 VNNI):
// without it a 5-row verify's GEMMs take 1.6x longer; 8 to 32 are within noise of each other.
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
  void prefetch_ahead(int64_t pair, int64_t g) const { prefetch(pair * groups + g + kPrefetchBlocks); }
  void prefetch(int64_t i) const {
    if (i < num_blocks)
      for (int64_t off = 0; off < block_bytes(); off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + i * block_bytes() + off), _MM_HINT_T0);
  }
  // Multi-row calls: the first row block's pass streams the pair's blocks into L2 kPrefetchBlocks ahead (the later
  // passes over the pair find them there). Fetching into L1 instead, one block per pass spread over the passes
  // (the previous scheme), left a 5-row verify's GEMMs 1.4x slower on Zen 4 (13.1 vs 9.7 ms over the default
  // model's layers at 1 thread): the prefetches of a whole 640-byte block at once queued behind the L1's few
  // outstanding misses.
  void prefetch_l2(int64_t pair, int64_t g, int pass) const {
    const int64_t i = pair * groups + g + kPrefetchBlocks;
    if (pass == 0 && i < num_blocks)
      for (int64_t off = 0; off < block_bytes(); off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + i * block_bytes() + off), _MM_HINT_T1);
  }
  const uint16_t* d(const uint8_t* b) const { return reinterpret_cast<const uint16_t*>(b); }
  const uint16_t* m(const uint8_t* b) const { return reinterpret_cast<const uint16_t*>(b + 64); }
  const uint8_t* codes(const uint8_t* b, int64_t tile) const {
    return b + (format == Format::kQ4_1 ? 128 : 64) + tile * code_rows() * 64;
  }
};

// ---- integer path: activations as int8 digits, exact int32 block dots, one fp32 epilogue on every ISA ----

// A block of 32 activations as D int8 digits: x ~ scale * sum_e kBase^(D-1-e) digit_e (balanced digits).
//   D = 1 (`gguf-q8`, llama.cpp's Q8_1 idea): |digit| <= 127, an 8-bit copy of the block (1 in 254 of its largest
//         entry); on the default model its top-1 agrees with fp32 activations at ~93 % of positions;
//   D = 2 (`gguf-q16`): a 15-bit copy (1 in 65024), |q| <= 127 x 255 + 127 (AVX2 dots q itself, q16, by vpmaddwd);
//   D = 3 (`gguf` on AVX-512 VNNI): a 23-bit fixed-point copy, as fine as fp32's 24-bit significand for the block's
//         largest entry.
// Digits in base 256, each in [-128, 127]. D = 2 used base 255 until stop 60 (digits within +-127, for AVX2's
// maddubs, which no longer dots them): base 256 combines two digit dots as (dot_0 << 8) + dot_1, one integer
// operation fewer per row and 16 outputs of every block on VNNI and AMX, for the same exact q and dot.
// The same code on every build (AVX2 vectors, which AVX-512 builds have too): every build quantizes identically.
template <int D>
struct Digits {
  static constexpr int32_t kBase = 256;
  static constexpr int32_t kLimit = D == 1 ? 127 : D == 2 ? 127 * 255 + 127 : (1 << 22) - 1;  // |x / scale| <= kLimit
  int64_t rows, groups;
  std::unique_ptr<int8_t[]> digits;  // [G][M][D][32]: digit e of x[r, 32g + k] at ((g M + r) D + e) 32 + k (block-major:
                                     // a block's rows and digits are one run of 32-byte rows, as an AMX tile reads
                                     // them), and one row's digits of padding, zeros (an AMX row block may read one row
                                     // past its own). Not zero-filled: every block is written (a 64-row prefill's
                                     // inputs to the down GEMM are 196 KB, zero-filled and then overwritten)
  std::vector<float> scale;        // [M][G]
  std::vector<float> sum;          // [M][G] sum of the block's x (fp32, k increasing), for Q4_1's m term
  std::vector<int32_t> digit_sum;  // [M][G][D], for Q8_0's +128 offset on VNNI; written only when asked for (zeros
                                   // otherwise: the paths that do not use it read it still, as an unused argument)
#ifndef SPIND_VNNI
  std::vector<int16_t> q16;        // D = 2: [M][G][32] the value kBase a + b itself (AVX2 dots it in one vpmaddwd),
                                   // each 4 k in the order k0, k0 + 2, k0 + 1, k0 + 3 (dot16_rows' even | odd)
#endif

  // with_digit_sums: compute digit_sum (what Q8_0 weights need on the VNNI path)
  Digits(const float* x, int64_t M, int64_t K, bool with_digit_sums)
      : rows(M), groups(K / kBlock), digits(new int8_t[(M * K + kBlock) * D]), scale(M * groups), sum(M * groups),
        digit_sum(M * groups * D), digit_sums(with_digit_sums)
#ifndef SPIND_VNNI
      , q16(D == 2 ? M * K : 0)
#endif
  {
    std::fill_n(digits.get() + M * K * D, kBlock * D, int8_t{0});
    parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
      int64_t rg = begin;
#ifdef SPIND_VNNI
      for (; rg + kWide <= end; rg += kWide) quantize_wide(x, rg);
#endif
      for (; rg + kSumLanes <= end; rg += kSumLanes) quantize_blocks<kSumLanes>(x, rg);
      for (; rg < end; ++rg) quantize_blocks<1>(x, rg);
    });
  }

  // The D x 32 digits of row r's block g
  const int8_t* at(int64_t r, int64_t g) const { return digits.get() + (g * rows + r) * D * kBlock; }

 private:
  bool digit_sums;

#ifdef SPIND_VNNI
  // AVX-512 builds: kWide blocks at a time, the same bytes and floats as quantize_blocks (so every build quantizes
  // identically). Each block's sum and largest magnitude are taken across blocks, a block a lane (its k-th entries
  // gathered, k increasing: the same fp32 chain as quantize_blocks'), and its digits from its two 16-lane vectors:
  // digit e is q's low byte (vpmovdb truncates: ((q + 128) & 255) - 128 as int8), then q = (q + 128) >> 8, which is
  // (q - digit) >> 8 (the digit is q mod 256 in [-128, 127]). Against quantize_blocks on a Xeon (AVX-512, 1 thread),
  // the 15-bit digits of 64 rows x 576: 0.35x the time without the digit sums, 0.49x with them.
  static constexpr int kWide = 16;
  SPIND_INLINE void quantize_wide(const float* x, int64_t rg) {
    const float* xb = x + rg * kBlock;
    const __m512i lane_block = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kBlock));
    __m512 s = _mm512_setzero_ps(), m = _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int k = 0; k < kBlock; ++k) {
      const __m512 v = _mm512_i32gather_ps(lane_block, xb + k, 4);
      s = _mm512_add_ps(s, v);
      m = _mm512_max_ps(m, _mm512_abs_ps(v));  // a maximum: any order is exact
    }
    _mm512_storeu_ps(sum.data() + rg, s);
    const __m512 limit = _mm512_set1_ps(static_cast<float>(kLimit));
    _mm512_storeu_ps(scale.data() + rg, _mm512_div_ps(m, limit));
    alignas(64) float inv[kWide];  // kLimit / amax, 0 for a block of zeros
    _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ), limit, m));
    const __m512i hi = _mm512_set1_epi32(kLimit), lo = _mm512_set1_epi32(-kLimit), half = _mm512_set1_epi32(128);
    for (int i = 0; i < kWide; ++i) {
      const int64_t b = rg + i;
      int8_t* out = digits.get() + ((b % groups) * rows + b / groups) * D * kBlock;  // at(r, g)
      const __m512 iv = _mm512_set1_ps(inv[i]);
      for (int j = 0; j < 2; ++j) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i * kBlock + 16 * j), iv));
        q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
        for (int e = D - 1; e >= 0; --e) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + e * kBlock + 16 * j), _mm512_cvtepi32_epi8(q));
          if (e > 0) q = _mm512_srai_epi32(_mm512_add_epi32(q, half), 8);
        }
      }
      if (digit_sums)
        for (int e = 0; e < D; ++e) {
          const __m128i* d = reinterpret_cast<const __m128i*>(out + e * kBlock);
          digit_sum[b * D + e] = _mm512_reduce_add_epi32(
              _mm512_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(d)), _mm512_cvtepi8_epi32(_mm_loadu_si128(d + 1))));
        }
    }
  }
#endif

  // Blocks whose sums are computed side by side (N independent chains: one block's sequential sum was a chain of
  // 32 dependent fp32 adds, the quantizer's critical path)
  static constexpr int kSumLanes = 8;

  // Blocks rg .. rg + N of x (consecutive blocks are consecutive in memory, across rows too)
  template <int N>
  SPIND_INLINE void quantize_blocks(const float* x, int64_t rg) {
    const float* xb = x + rg * kBlock;
    // Each block's sum in fp32, k increasing (the order is part of the result); the N blocks' chains interleaved
    float s[N];
    for (int i = 0; i < N; ++i) s[i] = 0.0f;
    for (int k = 0; k < kBlock; ++k)
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) s[i] += xb[i * kBlock + k];
    for (int i = 0; i < N; ++i) {
      sum[rg + i] = s[i];
      quantize_block(xb + i * kBlock, rg + i);
    }
  }

  // Exact integer steps after one fp32 multiply: q = round-to-nearest-even(x inv) (vcvtps2dq, as lrintf), clamped;
  // then per digit, least significant last: ((q + 128) & 255) - 128, and q = (q - digit) >> 8. The digits are
  // narrowed to int8 by saturating packs (exact: every digit fits) and the digit sums added in int32 (exact).
  SPIND_INLINE void quantize_block(const float* xb, int64_t rg) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 xv[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      xv[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_and_ps(xv[j], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));  // a maximum: any order is exact
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    scale[rg] = amax / kLimit;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? kLimit / amax : 0.0f);
    const __m256i hi = _mm256_set1_epi32(kLimit), lo = _mm256_set1_epi32(-kLimit);
    __m256i digit[D][4];
    for (int j = 0; j < 4; ++j) {
      __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(xv[j], inv));
      q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
#ifndef SPIND_VNNI
      if constexpr (D == 2) {  // |q| <= 32512: the saturating pack is exact; each 4 k as k0, k0 + 2, k0 + 1, k0 + 3
        const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q16.data() + rg * kBlock + 8 * j),
                         _mm_shufflehi_epi16(_mm_shufflelo_epi16(p, 0xD8), 0xD8));
      }
#endif
      for (int e = D - 1; e >= 0; --e) {
        __m256i d;
        d = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, _mm256_set1_epi32(128)), _mm256_set1_epi32(255)),
                             _mm256_set1_epi32(128));
        q = _mm256_srai_epi32(_mm256_sub_epi32(q, d), 8);
        digit[e][j] = d;
      }
    }
    int8_t* out = digits.get() + ((rg % groups) * rows + rg / groups) * D * kBlock;  // at(r, g)
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs' 4-byte groups back in k order
    for (int e = 0; e < D; ++e) {
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(digit[e][0], digit[e][1]),
                                                _mm256_packs_epi32(digit[e][2], digit[e][3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e * kBlock), _mm256_permutevar8x32_epi32(packed, order));
      if (!digit_sums) continue;
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(digit[e][0], digit[e][1]),
                                         _mm256_add_epi32(digit[e][2], digit[e][3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      digit_sum[rg * D + e] = _mm_cvtsi128_si32(t4);
    }
  }
};

// A column's Q4 codes as u8 nibbles: wq[p] holds k = 4p .. 4p + 3 (low nibbles) and wq[p + 4] k = 16 + 4p ..
SPIND_INLINE void unpack_nibbles(const uint8_t* codes, vi* wq) {
  const vi low4 = iset1(0x0F0F0F0F);
  for (int p = 0; p < 4; ++p) {
    const vi v = iload(codes + p * 64);
    wq[p] = iand(v, low4);
    wq[p + 4] = iand(srl16(v, 4), low4);
  }
}

// One column (kLanes output rows) of one block's codes, unpacked once and dotted with every row's digits. dot(q)
// is the exact int32 sum over the block's 32 k of code x digit per lane (Q8_0: the signed code; Q4_x: the 4-bit
// code, its offset living in m), whatever the ISA: so are the fp32 results built from it.
struct Column {
  bool q4;
#ifdef SPIND_VNNI
  vi wq[8];  // u8 per byte: Q4 the nibble, Q8 the code + 128 (corrected by 128 x the digit sum)
  SPIND_INLINE void load(const uint8_t* codes, bool is_q4) {
    q4 = is_q4;
    const vi flip = iset1(static_cast<int32_t>(0x80808080));
    if (q4) {
      unpack_nibbles(codes, wq);
    } else {
      for (int p = 0; p < 8; ++p) wq[p] = ixor(iload(codes + p * 64), flip);
    }
  }
  // quads: the block's 32 digits as 8 int32 (4 consecutive k each)
  SPIND_INLINE vi dot(const int32_t* quads, int32_t digit_sum) const {
    vi d0 = izero(), d1 = izero();  // two chains: integer sums are exact, so their order is free
    for (int p = 0; p < 8; p += 2) {
      d0 = dpbusd(d0, wq[p], iset1(quads[p]));
      d1 = dpbusd(d1, wq[p + 1], iset1(quads[p + 1]));
    }
    const vi dot = iadd(d0, d1);
    return q4 ? dot : isub(dot, iset1(128 * digit_sum));
  }
#else
  vi wq[8];  // Q4: the nibbles (u8); Q8: |code| (u8)
  vi ws[8];  // Q8: the signed codes (their signs move onto the digits)
  SPIND_INLINE void load(const uint8_t* codes, bool is_q4) {
    q4 = is_q4;
    if (q4) {
      unpack_nibbles(codes, wq);
    } else {
      for (int p = 0; p < 8; ++p) {
        ws[p] = iload(codes + p * 64);
        wq[p] = iabs8(ws[p]);
      }
    }
  }
  // Single digits only (|digit| <= 127): Q4 pairs are <= 2 x 15 x 127, so 8 of them add in int16 without
  // saturating (30480); Q8 pairs are <= 2 x 128 x 127 = 32512, widened to int32 one at a time.
  SPIND_INLINE vi dot(const int32_t* quads, int32_t /* digit_sum */) const {
    const vi ones = iset1_16(1);
    if (q4) {
      vi s0 = maddubs(wq[0], iset1(quads[0])), s1 = maddubs(wq[1], iset1(quads[1]));
      for (int p = 2; p < 8; p += 2) {
        s0 = iadd16(s0, maddubs(wq[p], iset1(quads[p])));
        s1 = iadd16(s1, maddubs(wq[p + 1], iset1(quads[p + 1])));
      }
      return madd16(iadd16(s0, s1), ones);
    }
    vi d0 = izero(), d1 = izero();
    for (int p = 0; p < 8; p += 2) {
      d0 = iadd(d0, madd16(maddubs(wq[p], isign8(iset1(quads[p]), ws[p])), ones));
      d1 = iadd(d1, madd16(maddubs(wq[p + 1], isign8(iset1(quads[p + 1]), ws[p + 1])), ones));
    }
    return iadd(d0, d1);
  }
#endif
};

// The block's D exact int32 digit dots (most significant first) as one fp32 value: Horner in fp32, dot_0 kBase +
// dot_1 ... (each dot < 2^20 in magnitude, exact in fp32). On VNNI the leading pair is combined in int32 instead
// (|kBase dot_0 + dot_1| < 2^28) and converted once: the same value, as fma(dot_0, kBase, dot_1) is the exact sum
// rounded once too, with one conversion and one FMA fewer beside the dot products (Zen 4: 5-10 % off the many-row
// GEMMs of a verify or a prefill at D = 2). The AMX path (below) feeds its tiles' dots through the same function.
template <int D>
SPIND_INLINE vf combine_digits(vi d0, vi d1, vi d2) {
  if constexpr (D == 1) {
    return to_float(d0);
  } else {
#ifdef SPIND_VNNI
    if constexpr (D == 2) return to_float(iadd(_mm512_slli_epi32(d0, 8), d1));  // 256 d0 + d1
    else return vfma(to_float(iadd(_mm512_slli_epi32(d0, 8), d1)), vset1(256.0f), to_float(d2));
#else
    const vf base = vset1(static_cast<float>(Digits<D>::kBase));
    vf t = vfma(to_float(d0), base, to_float(d1));
    if constexpr (D == 3) t = vfma(t, base, to_float(d2));
    return t;
#endif
  }
}

template <int D>
SPIND_INLINE vf block_dot(const Column& col, const int32_t* quads, const int32_t* digit_sum) {
  const vi d0 = col.dot(quads, digit_sum[0]);
  const vi d1 = D > 1 ? col.dot(quads + 8, digit_sum[1]) : d0;
  const vi d2 = D > 2 ? col.dot(quads + 16, digit_sum[2]) : d0;
  return combine_digits<D>(d0, d1, d2);
}

#ifndef SPIND_VNNI
// AVX2, 16-bit activations: the exact int32 block dots of one column (kLanes output rows) with MR rows, into
// out[0 .. MR). A 64-byte code row gives each lane (output row) 4 consecutive k; read as 16-bit words, a lane's two
// words hold k0, k1 and k2, k3, so masking (or shifting) the words gives the lane's even codes k0, k2 and its odd
// codes k1, k3 as int16 in place, and vpmaddwd against the row's (q[k0], q[k2]) and (q[k1], q[k3]) broadcast (q16
// keeps each 4 k in that order) adds two products into the lane's own int32: one running sum a row, no interleave
// of the codes and no horizontal add (a row held two sums before stop 59). Each code row is widened and used by every
// row at once: a widened copy of the block did not fit the 16 registers beside the sums. The exact int32 sum over
// the block of code x q for 16-bit q (|q| <= 32512: a pair <= 8.3e6, the block <= 1.4e8, no overflow): the value a
// two-digit dot reaches as 256 dot(a) + dot(b).
// Integer adds being associative, GCC (12) turned each row's running sum into a tree, every code row's products of
// all MR rows computed first and spilled to the stack; an empty asm naming the sum as an in-out register after each
// add keeps it a running sum (the same exact integers; stop 57, Zen 3: 5-row GEMMs 0.78x / 0.91x the time at 1 / 2
// threads, a 20-row verify step 0.85x / 0.88x).
template <int MR>
SPIND_INLINE void dot16_rows(const uint8_t* codes, bool q4, const int16_t* const* q, vi* out) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) out[r] = izero();
  auto use = [&](vi even, vi odd, int k0) {  // one code row's 4 consecutive k per lane, from k0: k0, k0 + 2 | odd
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int32_t* qk = reinterpret_cast<const int32_t*>(q[r] + k0);  // q[k0], q[k0 + 2] | q[k0 + 1], q[k0 + 3]
      out[r] = iadd(out[r], iadd(madd16(even, iset1(qk[0])), madd16(odd, iset1(qk[1]))));
      asm("" : "+x"(out[r]));  // the sum stays a running sum, in a register (see above)
    }
  };
  if (q4) {
    const vi low4 = iset1_16(0x000F);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // code row p: low nibbles k = 4p .., high nibbles k = 16 + 4p ..
      const vi v = iload(codes + p * 64);
      use(iand(v, low4), iand(srl16(v, 8), low4), 4 * p);
      use(iand(srl16(v, 4), low4), srl16(v, 12), 16 + 4 * p);
    }
  } else {
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {  // signed codes, each byte sign-extended in its word
      const vi v = iload(codes + p * 64);
      use(sra16(sll16(v, 8), 8), sra16(v, 8), 4 * p);
    }
  }
}
#endif

#ifdef SPIND_VNNI
// MR rows' exact block dots with one column, as the integers combine_digits forms from the D digit dots: lead =
// kBase dot_0 + dot_1 (D = 2), dot_0 (D = 1), 256 dot_0 + dot_1 with tail = dot_2 (D = 3); Q8_0's +128 code offset
// still in (the caller takes it off). quads: row r0's digits at the block, row r0 + r's at + r D 8. Integer sums are
// exact, so the order of the vpdpbusd is free, and it is chosen for the 2 a cycle that Intel's server cores (and
// Zen 4) issue against their 5-cycle latency: each code vector's vpdpbusd run over all MR rows before the next
// vector's, two chains a row (D = 2: one per digit; D = 1: even and odd code vectors; D = 3: the first two digits
// into one sum, multiplied by the base between them, and the third apart), so 2 MR chains are in flight. Each row
// used to be two dependent chains of 4 per digit, one row after the other: 16- and 64-row GEMMs ~25 % slower at
// 1 thread on a Xeon (Emerald Rapids, AVX-512 VNNI).
template <int MR, int D>
SPIND_INLINE void lead_dots(const Column& col, const int32_t* quads, vi* lead, vi* tail) {
  auto q = [&](int r, int e, int p) { return iset1(quads[(r * D + e) * 8 + p]); };
  if constexpr (D < 3) {
    vi other[MR];  // D = 2: dot_1; D = 1: dot_0's odd code vectors
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lead[r] = other[r] = izero();
#pragma GCC unroll 8
    for (int p = 0; p < 8; p += (D == 1 ? 2 : 1))
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        lead[r] = dpbusd(lead[r], col.wq[p], q(r, 0, p));
        other[r] = D == 1 ? dpbusd(other[r], col.wq[p + 1], q(r, 0, p + 1)) : dpbusd(other[r], col.wq[p], q(r, 1, p));
      }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      lead[r] = D == 1 ? iadd(lead[r], other[r]) : iadd(_mm512_slli_epi32(lead[r], 8), other[r]);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lead[r] = tail[r] = izero();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        lead[r] = dpbusd(lead[r], col.wq[p], q(r, 0, p));
        tail[r] = dpbusd(tail[r], col.wq[p], q(r, 2, p));
      }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lead[r] = _mm512_slli_epi32(lead[r], 8);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) lead[r] = dpbusd(lead[r], col.wq[p], q(r, 1, p));
  }
}
#endif

// Every loop's block epilogue, in one order: acc = fma(T, d * scale, acc), then acc = fma(m, sum, acc) for Q4_x (T the
// block's exact dot as one fp32 value; d, m the block's fp16 scale and minimum for these outputs; scale, sum the
// activations' for this row and block). Every path adds each block so, which is what makes their rows bit-identical.
SPIND_INLINE vf add_block(vf acc, vf t, vf d, vf m, bool q4, float scale, float sum) {
  acc = vfma(t, vmul(d, vset1(scale)), acc);
  return q4 ? vfma(m, vset1(sum), acc) : acc;
}

// use(r, t) for r < MR in order, t the exact block dot of row r0 + r at block g with one column's codes as the one
// fp32 value combine_digits makes of it (the same value on every build and path)
template <int MR, int D, class Use>
SPIND_INLINE void rows_block_dots(const uint8_t* codes, bool q4, const Digits<D>& a, int64_t r0, int64_t g,
                                  const Use& use) {
#ifdef SPIND_VNNI
  Column col;
  col.load(codes, q4);
  vi lead[MR], tail[MR];
  lead_dots<MR, D>(col, reinterpret_cast<const int32_t*>(a.at(r0, g)), lead, tail);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    if (!q4) {  // Q8_0's +128 code offset, from the digit sums (wrapping int32 arithmetic of an exact result)
      const int32_t* ds = &a.digit_sum[((r0 + r) * a.groups + g) * D];
      if constexpr (D == 1) {
        lead[r] = isub(lead[r], iset1(128 * ds[0]));
      } else {
        lead[r] = isub(lead[r], iset1(128 * (Digits<D>::kBase * ds[0] + ds[1])));
        if constexpr (D == 3) tail[r] = isub(tail[r], iset1(128 * ds[2]));
      }
    }
    if constexpr (D == 3) use(r, vfma(to_float(lead[r]), vset1(256.0f), to_float(tail[r])));
    else use(r, to_float(lead[r]));
  }
#else
  if constexpr (D == 2) {  // one 16-bit dot a row: round(exact sum), as VNNI's two digits combined
    const int16_t* q[MR];
    for (int r = 0; r < MR; ++r) q[r] = a.q16.data() + ((r0 + r) * a.groups + g) * kBlock;
    vi dots[MR];
    dot16_rows<MR>(codes, q4, q, dots);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) use(r, to_float(dots[r]));
  } else {  // D = 1 (D = 3 is VNNI's only)
    Column col;
    col.load(codes, q4);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t rg = (r0 + r) * a.groups + g;
      use(r, block_dot<D>(col, reinterpret_cast<const int32_t*>(a.at(r0 + r, g)), &a.digit_sum[rg * D]));
    }
  }
#endif
}

// y[r0 + r, unit] for MR rows. Per output, blocks in increasing order: D exact int32 dots combined into T
// (block_dot, rows_block_dots), then add_block. One instance per block format (kQ4: Q4_x), so that the inner loops
// carry no test of the format (a run-time flag left a branch per row in every block's epilogue; with dot16_rows'
// even | odd words, same-process A/B on Zen 3 (AMD EPYC), the default target's GEMMs 0.93-0.97x the time at 1 and 4
// decode rows, 0.93-0.95x at a 5-row verify, 0.91-0.94x at 64 rows, 1 and 2 threads).
template <int MR, int D, bool kQ4>
void int_row_block(const Weights& w, const Digits<D>& a, int64_t unit, int64_t r0, float* y, int64_t ldy,
                   int pass) {
  constexpr bool q4 = kQ4;
  const int64_t pair = unit * kUnit / kPair, row0 = unit * kUnit % kPair;  // first output row of the unit in its pair
#ifdef SPIND_VNNI
  if constexpr (MR == 1) {
    // One row (decode): both columns of each block before the next block, so the weights are read once, in stream
    // order (column by column, each pair's blocks were read twice; ~2x slower on Zen 4 once the weights come from
    // memory: the default model's Q8_0 lm_head 2.25 -> 1.19 ms at 1 thread). Two accumulators and two columns' codes
    // fit the registers at one row. Each output's blocks are still added in increasing order: the same results.
    // Every line of the stream is prefetched into L2 kPrefetchBlocks ahead, as the many-row loop does. Left to the
    // hardware prefetchers (one software prefetch a block, 16 KB ahead, to carry the stream across 4 KB pages: until
    // stop 83), the 1-row GEMMs left them in a state that slowed the many-row GEMMs after them: on AMD EPYC (Zen 5,
    // 32 MB L3, 2 vCPUs) the default model's 5-row GEMMs took 8.4-9.7 ms after four 1-row passes against 6.8-7.3
    // after a 5-row one (1 thread; 2 threads 5.3-6.1 against 4.4-4.8), a verify at batch 1 after 8 decode steps
    // 4.0-4.4 ms against 3.3-3.5 after a verify. Prefetched so, both read alike after either (5-row 7.0-7.3 ms),
    // and a whole decode step at 2 threads took 2.43-2.45 ms against 2.83-2.88 (1 thread: 3.72-3.89 against 3.70-3.76).
    vf acc[kCols] = {vzero(), vzero()};
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* blk = w.block(pair, g);
      w.prefetch_l2(pair, g, 0);
      const int64_t rg = r0 * w.groups + g;
      const int32_t* quads = reinterpret_cast<const int32_t*>(a.at(r0, g));
#pragma GCC unroll 2
      for (int c = 0; c < kCols; ++c) {
        const int64_t row = row0 + c * kLanes;
        Column col;
        col.load(w.codes(blk, row / 16) + (row % 16) * 4, q4);
        const vf t = block_dot<D>(col, quads, &a.digit_sum[rg * D]);
        const vf m = q4 ? load_f16(w.m(blk) + row) : vzero();
        acc[c] = add_block(acc[c], t, load_f16(w.d(blk) + row), m, q4, a.scale[rg], a.sum[rg]);
      }
    }
    for (int c = 0; c < kCols; ++c) vstore(y + c * kLanes, acc[c]);
    return;
  }
#else
  if constexpr (MR == 1) {
    // One row (decode): both columns of each block before the next block, as on VNNI (their codes share every
    // 64-byte line; column by column, each unit's blocks were streamed twice). Each output's blocks in increasing
    // order, the same operations as the many-row loop below: the same results. Same-process A/B on Zen 3 (`spind
    // bench batch --against`), the default target's decode step: 0.85x the time at 1 thread, 0.93x at 2 (stop 56 had
    // seen no gain from this order in whole runs alternated, not in rounds paired in a process); with 8-bit
    // activations (`gguf-q8`, which kept the column order until stop 58): its decode step 0.90x / 0.93x.
    vf acc[kCols] = {vzero(), vzero()};
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* blk = w.block(pair, g);
      w.prefetch_l2(pair, g, pass);
      const int64_t rg = r0 * w.groups + g;
#pragma GCC unroll 2
      for (int c = 0; c < kCols; ++c) {
        const int64_t row = row0 + c * kLanes;
        const vf d = load_f16(w.d(blk) + row);
        const vf m = q4 ? load_f16(w.m(blk) + row) : vzero();
        rows_block_dots<1, D>(w.codes(blk, row / 16) + (row % 16) * 4, q4, a, r0, g,
                              [&](int, vf t) { acc[c] = add_block(acc[c], t, d, m, q4, a.scale[rg], a.sum[rg]); });
      }
    }
    for (int c = 0; c < kCols; ++c) vstore(y + c * kLanes, acc[c]);
    return;
  }
#endif
  // Many rows (verify, batch, prefill): one column at a time over every block, MR accumulators (both columns' 2 MR
  // accumulators did not fit the registers: the compiler spilled them in every block).
  for (int c = 0; c < kCols; ++c) {
    const int64_t row = row0 + c * kLanes;  // 0..31 within the pair: tile row / 16, lane row % 16
    vf acc[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = vzero();
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* blk = w.block(pair, g);
      if (c == 0) w.prefetch_l2(pair, g, pass);
      const vf d = load_f16(w.d(blk) + row);
      const vf m = q4 ? load_f16(w.m(blk) + row) : vzero();
      rows_block_dots<MR, D>(w.codes(blk, row / 16) + (row % 16) * 4, q4, a, r0, g, [&](int r, vf t) {
        const int64_t rg = (r0 + r) * w.groups + g;
        acc[r] = add_block(acc[r], t, d, m, q4, a.scale[rg], a.sum[rg]);
      });
    }
    for (int r = 0; r < MR; ++r) vstore(y + r * ldy + c * kLanes, acc[r]);
  }
}

#ifdef SPIND_VNNI
// Calls of 2 to 16 rows on VNNI at D = 2 (`gguf-q16`'s decode batches and verifies): a block of rows x the unit's
// two columns (32 outputs) per block of K, code vector by code vector, so each broadcast activation quad feeds both
// columns' vpdpbusd (int_row_block's many-row loop, a column at a time, broadcasts every quad once a column: a load
// beside every vpdpbusd, and unpacks the codes once per column and row block). Four int32 chains a row (a digit's dot
// a column) beside the two columns' two code vectors, so at most 6 rows a block (IntPath::block_rows: 9 to 16 rows in
// blocks of at most 6; a call of 7 rows, one block of 7, keeps the column loop). The fp32 sums (2 MR vectors, which
// do not fit the registers beside the 4 MR chains) live in L1, each block added as add_block adds it, blocks in
// increasing order: the same operations on the same values as every other loop, so the same bits, and a call may take
// either loop. From 3 rows they sit in a buffer on the stack, copied to the output rows at the end: read and written
// in the output rows themselves (until stop 87), the sums of a 5-row block took the gate_up GEMM 1.10x the time
// (its rows are 12 KB apart, a multiple of 4 KB: every row's lines fall in the same L1 sets), the other three GEMMs
// 1.02-1.05x (streamed shapes, 2 threads). In the default target's forward (`spind bench batch --against`, 30
// rounds, GEMM time against the output-row sums): a batch-1 verify of 5 rows 0.87x at 2 threads (step 0.92x), 0.96x
// at 1; of 8 rows 0.96x; of 16 rows 0.975x; 4, 8 and 16 decode rows 0.95-0.97x at 1 and 2 threads. At 2 rows the
// buffer read 1.10-1.18x the time (cause not found): 2-row blocks keep the output rows.
// Same-process A/B on AMD EPYC (Zen 5, 2 vCPUs; `spind bench batch --against`, 24 rounds), the default target's GEMMs
// at 2 threads against the column loop: decode rows B = 2 0.77x the time, B = 4 0.87x, B = 6 0.90x, B = 8 0.86x
// (1 thread: 0.63x, 0.83x, 0.88x, 0.85x), a batch-1 verify of 8 rows 0.88x (of 5 rows 1.01x, 1 thread 0.85x); 9 to
// 16 rows in blocks of 6 against the column loop's blocks of 7: decode rows B = 9 0.88x, B = 12 0.92x, B = 16 0.94x,
// verifies of 10, 15 and 16 rows 0.89x, 0.92x, 0.93x. Through the daemon (`spind bench serve`, mixed prompts, `none`,
// 1 to 16 clients, medians of 6 runs) it read 0.97-1.00x the column loop's tokens/s, two daemons on identical kernels
// 0.99-1.02x each other's: no gain shown there, where the calls it speeds are a part of a loaded server's work and its
// prefill chunks (calls of more rows) are left as they were. For calls of more rows the paired A/B read either way
// from one session to the next (a request's 16 verify rows 1.06x and 0.93x the time), and every call through this
// loop gave the daemon no faster prefill (its time to first token 1.04-1.31x, within its noise): they keep the column
// loop. At one digit (`gguf-q8`, two chains a row there) it read 1.04-1.09x slower from 5 rows on: D = 1 keeps it too.
constexpr int kBothColumnsRows = 6;          // rows a block at most (4 int32 chains a row beside 4 code vectors)
constexpr int64_t kBothColumnsMaxCall = 16;  // rows a call at most

template <int MR, int D, bool kQ4>
void int_rows_both_columns(const Weights& w, const Digits<D>& a, int64_t unit, int64_t r0, float* y, int64_t ldy,
                           int pass) {
  static_assert(D == 2 && MR <= kBothColumnsRows && kUnit == kPair, "one unit is one pair of 16-output tiles");
  constexpr bool q4 = kQ4;
  const int64_t pair = unit;
  alignas(64) float buffer[MR][kUnit];  // the sums from 3 rows (above); 2-row blocks keep them in the output rows
  float* const acc = MR > 2 ? &buffer[0][0] : y;
  const int64_t ld = MR > 2 ? kUnit : ldy;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) vstore(acc + r * ld + c * kLanes, vzero());
  const vi low4 = iset1(0x0F0F0F0F), flip = iset1(static_cast<int32_t>(0x80808080));
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* blk = w.block(pair, g);
    w.prefetch_l2(pair, g, pass);
    const int32_t* quads = reinterpret_cast<const int32_t*>(a.at(r0, g));
    vi s0[MR][kCols], s1[MR][kCols];  // digit 0's and digit 1's dots
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kCols; ++c) s0[r][c] = s1[r][c] = izero();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      vi lo[kCols], hi[kCols];  // code vectors j and j + 4 of each column
      for (int c = 0; c < kCols; ++c) {
        const uint8_t* codes = w.codes(blk, c);
        if (q4) {
          const vi v = iload(codes + j * 64);
          lo[c] = iand(v, low4);
          hi[c] = iand(srl16(v, 4), low4);
        } else {
          lo[c] = ixor(iload(codes + j * 64), flip);
          hi[c] = ixor(iload(codes + (j + 4) * 64), flip);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int32_t* qr = quads + r * D * 8;
        vi b = iset1(qr[j]);
        for (int c = 0; c < kCols; ++c) s0[r][c] = dpbusd(s0[r][c], lo[c], b);
        b = iset1(qr[j + 4]);
        for (int c = 0; c < kCols; ++c) s0[r][c] = dpbusd(s0[r][c], hi[c], b);
        b = iset1(qr[8 + j]);
        for (int c = 0; c < kCols; ++c) s1[r][c] = dpbusd(s1[r][c], lo[c], b);
        b = iset1(qr[8 + j + 4]);
        for (int c = 0; c < kCols; ++c) s1[r][c] = dpbusd(s1[r][c], hi[c], b);
      }
    }
    vf d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      d[c] = load_f16(w.d(blk) + c * kLanes);
      m[c] = q4 ? load_f16(w.m(blk) + c * kLanes) : vzero();
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t rg = (r0 + r) * w.groups + g;
      const int32_t* ds = &a.digit_sum[rg * D];  // Q8_0's +128 code offset, as rows_block_dots takes it off
      const int32_t offset = q4 ? 0 : 128 * (Digits<D>::kBase * ds[0] + ds[1]);
      for (int c = 0; c < kCols; ++c) {
        vi lead = iadd(_mm512_slli_epi32(s0[r][c], 8), s1[r][c]);  // 256 dot_0 + dot_1
        if (!q4) lead = isub(lead, iset1(offset));
        float* out = acc + r * ld + c * kLanes;
        vstore(out, add_block(vload(out), to_float(lead), d[c], m[c], q4, a.scale[rg], a.sum[rg]));
      }
    }
  }
  if constexpr (MR > 2) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kCols; ++c) vstore(y + r * ldy + c * kLanes, vload(acc + r * ld + c * kLanes));
  }
}
#endif

template <int D>
struct IntPath {
  using Inputs = Digits<D>;
#ifdef SPIND_VNNI
  static constexpr int kRows = D == 3 ? 5 : 7;  // rows sharing each unpacked code vector (registers: 3 a row)
#else
  // At least 5 rows so that a verify of k = 4 drafts is one block (it was 4 + 1: the codes unpacked and the block's
  // epilogue run twice). Same-process A/B on Zen 3 (`spind bench batch --k 4 --against`), 1 / 2 threads: 8-bit
  // activations (gguf-q8, 4 rows until stop 58) 5 rows 0.88x / 0.96x the time, 20 rows 0.96x / 0.96x, 10 rows 0.94x /
  // 0.97x, 64 rows 0.97x / 0.97x. 16-bit (dot16_rows, the default gguf-q16; stop 57's 5 rows took its 5-row verify
  // step to 0.87x / 0.94x the time of 4 + 1): 8 rows since a row holds one int32 sum (stop 59), the unpacked codes
  // shared by more rows: the default target's GEMMs at 8 rows against 5, 1 / 2 threads, 16 decode rows 0.90x / 0.98x,
  // 20 rows (B = 4, k = 4) 0.93x / 0.99x, 64 rows 0.94x / 0.95x; 4 rows (a 5-row verify as 3 + 2) 1.09-1.15x at 5 and
  // 10 rows (the GEMM alone)
  static constexpr int kRows = D == 2 ? 8 : 5;
#endif
  // rows a block at most in a call of M rows: 9 to 16 rows in int_rows_both_columns' blocks (up to 8, kRows' blocks
  // fit them but for a call of 7)
  static int64_t block_rows(int64_t M) {
#ifdef SPIND_VNNI
    if (D == 2 && M > 8 && M <= kBothColumnsMaxCall) return kBothColumnsRows;
#endif
    return kRows;
  }
  template <int MR>
  static void block(const Weights& w, const Inputs& in, int64_t unit, int64_t r0, float* y, int64_t ldy, int pass) {
#ifdef SPIND_VNNI
    if constexpr (D == 2 && MR > 1 && MR <= kBothColumnsRows) {
      if (in.rows <= kBothColumnsMaxCall) {
        if (w.format == Format::kQ4_1) int_rows_both_columns<MR, D, true>(w, in, unit, r0, y, ldy, pass);
        else int_rows_both_columns<MR, D, false>(w, in, unit, r0, y, ldy, pass);
        return;
      }
    }
#endif
    if (w.format == Format::kQ4_1) int_row_block<MR, D, true>(w, in, unit, r0, y, ldy, pass);
    else int_row_block<MR, D, false>(w, in, unit, r0, y, ldy, pass);
  }
};

// Rows per tile of a many-row call (prefill): a thread runs every unit of its share over one tile of rows before the
// next, so the tile's activations stay in L1/L2 while the share's weights (<= ~0.5 MB per thread for the default
// model's layers) stream from L2. Decode and verify calls are one tile.
constexpr int64_t kRowTile = 64;

#ifdef SPIND_AMX
// ---- AMX path (avx512amx build): the integer path's block dots by int8 tiles, for calls of >= amx_min_rows rows ----
//
// Per block g of a pair (32 outputs) and a block of MR rows: one A tile holds the MR rows' D digits of the block as
// MR D rows of 32 int8 (Digits is block-major, so they are one run: tile row D r + e is digit e of row r), and one
// instruction per 16-output half h gives every row's every digit dot at once: C_h = A B_h, with B_h the half's codes
// (32 k x 16 outputs: Q8_0's packed codes as they lie, signed; Q4_1's nibbles unpacked to a byte each, unsigned).
// Digits on the tile's rows keep a verify's few rows from wasting it: 5 rows x 3 digits fill 15 of 16. The C tiles'
// exact int32 dots go through memory (a tile store) into the very epilogue of the VNNI path (combine_digits, then
// the same FMAs in the same order per output), so every row is bit-identical to the VNNI path's, whatever M and
// whichever path a call takes: greedy speculation stays exact when a forward's row count crosses the threshold.
//
// Tile registers are not renamed: a tile load waits for the dot products still reading the tile it overwrites, and
// a tile zeroed waits for the store still reading it. So a block's work is laid out over different tiles, the next
// block's tile work issued before this block's C tiles are stored (stop 59's scheme loaded, dotted and stored one
// set of tiles in turn; on a Xeon with AMX its samples sat on the tile instructions, and 64 rows of the default
// target's layers took 0.87x the VNNI path's time at 1 thread). On that Xeon the tile work and the vector epilogue
// did not overlap (a microbenchmark's tile step and epilogue took the sum of their times), so what is left to gain
// is in doing less of either. Two layouts (which one a tile takes: amx_pair_above, below):
// - row block by row block (a verify, a batch of decodes; on some CPUs every call), with tiles 0, 1 = B_0, B_1,
//   2 = A, and two C pairs (3, 4 and 5, 6) used by alternate blocks. Q4_1's codes are unpacked one block ahead of
//   their tile load, into alternate buffers (a tile load does not take data forwarded from pending stores: unpacked
//   just before, it waited for them to reach L1, ~35 % of a 64-row call's samples).
// - in pairs (prefill chunks, where that is faster): B_0, B_1 (the unit's codes, unpacked once for all its row
//   blocks) shared by two A tiles (2, 3) and four C tiles (4 .. 7), the accumulators in the output rows (32 of them
//   do not fit the registers).
// Every row block of a call has the tiles' one height (the largest of its even split): a block one row shorter
// reads one row of digits past its own (Digits pads the end), whose dots the epilogue leaves unread.

// Calls of at least this many rows take the tiles (SPIND_AMX_MIN_ROWS; `spind bench decode` shows it).
int64_t amx_default_min_rows() {
  const char* env = std::getenv("SPIND_AMX_MIN_ROWS");
  return env != nullptr && *env != '\0' ? std::max<int64_t>(1, std::atoll(env)) : 4;
}
std::atomic<int64_t> amx_min_rows{amx_default_min_rows()};

// rows per row block: D MR tile rows <= 16, and (a row block at a time) the 2 MR accumulators in registers
template <int D>
constexpr int64_t kAmxRows = D == 3 ? 5 : 8;

// Row blocks of a tile above which they go in pairs (prefill chunks); fewer run row block by row block. Which layout
// is faster depends on the CPU, so kernels/cpu_ext.py times both once per process (tune_amx_layout) and sets this
// (SPIND_AMX_PAIR_ABOVE fixes it instead). Measured, the default target's layers' shapes with random codes, pairs'
// time over row block by row block's: stop 62's Xeon (2 vCPUs, L3 480 MB), 1 thread, medians of 3 alternated
// processes: 12 rows 1.05x, 16 rows 1.07x, 32 rows 0.99x, 64 rows 0.87x; stop 64's Xeon (Sapphire Rapids, L3 105 MB),
// 9 alternated rounds in one process, 1 and 2 threads: 64 rows 1.26x / 1.29x, 229 rows 1.20x / 1.12x (there the
// accumulators kept in memory cost more than the shared B tiles and codes save, at any height).
int64_t amx_default_pair_above() {
  const char* env = std::getenv("SPIND_AMX_PAIR_ABOVE");
  return env != nullptr && *env != '\0' ? std::clamp<int64_t>(std::atoll(env), 1, int64_t{1} << 30) : 4;
}
std::atomic<int64_t> amx_pair_above{amx_default_pair_above()};

// Tiles of a call whose row blocks, `height` rows each, run one at a time (`paired` false) or in pairs
amx::Config tile_config(int D, int64_t height, bool paired) {
  amx::Config c;
  c.set(0, kBlock / 4, 64);
  c.set(1, kBlock / 4, 64);
  const int rows = static_cast<int>(height * D);
  const int n_a = paired ? 2 : 1;
  for (int t = 2; t < 2 + n_a; ++t) c.set(t, rows, kBlock);
  for (int t = 2 + n_a; t < 2 + n_a + 4; ++t) c.set(t, rows, 64);
  return c;
}

// 64-byte rows of unpacked codes, as a B tile reads them
struct alignas(64) CodeRow {
  uint8_t bytes[64];
};

// Block blk's Q4_1 codes as the B tiles read them, out[h][p] (row p: k = 4p .. 4p + 3 of the half's 16 outputs, the
// low nibbles; p >= 4 the high ones)
SPIND_INLINE void unpack_block(const Weights& w, const uint8_t* blk, CodeRow* out) {
  for (int h = 0; h < 2; ++h) {
    vi wq[8];
    unpack_nibbles(w.codes(blk, h), wq);
    for (int p = 0; p < 8; ++p) _mm512_store_si512(out[h * 8 + p].bytes, wq[p]);
  }
}

// The epilogue of one row's block g for one half: acc (y's 16 outputs, or a register) += the row's C rows dots
template <int D, bool kQ4>
SPIND_INLINE vf epilogue(vf acc, const int32_t* dots, vf d, vf m, float scale, float sum) {
  const vf t = combine_digits<D>(iload(dots), iload(dots + 16 * (D > 1)), iload(dots + 32 * (D > 2)));
  return add_block(acc, t, d, m, kQ4, scale, sum);
}

// One row block of MR <= kAmxRows rows: y[r0 + r, unit]
template <int MR, int D, bool kQ4>
void amx_single_block(const Weights& w, const Digits<D>& a, int64_t pair, int64_t r0, float* y, int64_t ldy,
                      int pass) {
  alignas(64) CodeRow b[2][16];                 // Q4_1: the unpacked codes of alternate blocks
  alignas(64) int32_t c[2][amx::kMaxRows][16];  // [h][D r + e][output]
  auto dots = [&](int64_t g) {  // block g's dots into C pair 3, 4 (g even) or 5, 6
    w.prefetch_l2(pair, g, pass);
    if constexpr (kQ4) {
      amx::load<0>(b[g & 1][0].bytes, 64);
      amx::load<1>(b[g & 1][8].bytes, 64);
      if (g + 1 < w.groups) unpack_block(w, w.block(pair, g + 1), b[(g + 1) & 1]);
    } else {
      const uint8_t* blk = w.block(pair, g);
      amx::load<0>(w.codes(blk, 0), 64);
      amx::load<1>(w.codes(blk, 1), 64);
    }
    amx::load<2>(a.at(r0, g), kBlock);
    if (g & 1) {
      amx::zero<5>(), amx::zero<6>();
      amx::dp<5, 2, 0, kQ4>(), amx::dp<6, 2, 1, kQ4>();
    } else {
      amx::zero<3>(), amx::zero<4>();
      amx::dp<3, 2, 0, kQ4>(), amx::dp<4, 2, 1, kQ4>();
    }
  };
  vf acc0[MR], acc1[MR];  // the halves' accumulators (a 2-D array of them GCC kept on the stack)
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = vzero();
  if constexpr (kQ4) unpack_block(w, w.block(pair, 0), b[0]);
  dots(0);
  for (int64_t g = 0; g < w.groups; ++g) {
    if (g + 1 < w.groups) dots(g + 1);
    if (g & 1) amx::store<5>(c[0], 64), amx::store<6>(c[1], 64);
    else amx::store<3>(c[0], 64), amx::store<4>(c[1], 64);
    const uint8_t* blk = w.block(pair, g);
    const vf d0 = load_f16(w.d(blk)), d1 = load_f16(w.d(blk) + 16);
    const vf m0 = kQ4 ? load_f16(w.m(blk)) : vzero(), m1 = kQ4 ? load_f16(w.m(blk) + 16) : vzero();
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {  // a row's two halves together (by half, GCC spilled the accumulators)
      const int64_t rg = (r0 + r) * w.groups + g;
      acc0[r] = epilogue<D, kQ4>(acc0[r], c[0][D * r], d0, m0, a.scale[rg], a.sum[rg]);
      acc1[r] = epilogue<D, kQ4>(acc1[r], c[1][D * r], d1, m1, a.scale[rg], a.sum[rg]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    vstore(y + r * ldy, acc0[r]);
    vstore(y + r * ldy + 16, acc1[r]);
  }
}

template <int D, bool kQ4, int MR = kAmxRows<D>>
void amx_single(const Weights& w, const Digits<D>& a, int64_t pair, int64_t r0, float* y, int64_t ldy, int64_t n,
                int pass) {
  if constexpr (MR > 1) {
    if (n < MR) return amx_single<D, kQ4, MR - 1>(w, a, pair, r0, y, ldy, n, pass);
  }
  amx_single_block<MR, D, kQ4>(w, a, pair, r0, y, ldy, pass);
}

// Two row blocks of n0 and n1 rows from row r0: y[r0 + r, unit] accumulated in place. codes:
// the pair's blocks as B tiles read them (Q4_1 unpacked; Q8_0 null: the packed codes as they lie).
template <int D, bool kQ4>
void amx_block_pair(const Weights& w, const CodeRow* codes, const Digits<D>& a, int64_t pair, int64_t r0, int64_t n0,
                    int64_t n1, float* y, int64_t ldy, int pass) {
  alignas(64) int32_t c[2][2][amx::kMaxRows][16];  // [row block][h][D r + e][output]
  auto dots = [&](int64_t g) {
    if constexpr (kQ4) {
      amx::load<0>(codes[g * 16].bytes, 64);
      amx::load<1>(codes[g * 16 + 8].bytes, 64);
    } else {
      const uint8_t* blk = w.block(pair, g);
      w.prefetch_l2(pair, g, pass);
      amx::load<0>(w.codes(blk, 0), 64);
      amx::load<1>(w.codes(blk, 1), 64);
    }
    amx::load<2>(a.at(r0, g), kBlock);
    amx::load<3>(a.at(r0 + n0, g), kBlock);
    amx::zero<4>(), amx::zero<5>(), amx::zero<6>(), amx::zero<7>();
    amx::dp<4, 2, 0, kQ4>(), amx::dp<5, 2, 1, kQ4>(), amx::dp<6, 3, 0, kQ4>(), amx::dp<7, 3, 1, kQ4>();
  };
  for (int64_t r = 0; r < n0 + n1; ++r) vstore(y + r * ldy, vzero()), vstore(y + r * ldy + 16, vzero());
  dots(0);
  for (int64_t g = 0; g < w.groups; ++g) {
    amx::store<4>(c[0][0], 64), amx::store<5>(c[0][1], 64), amx::store<6>(c[1][0], 64), amx::store<7>(c[1][1], 64);
    if (g + 1 < w.groups) dots(g + 1);
    const uint8_t* blk = w.block(pair, g);
    const vf d0 = load_f16(w.d(blk)), d1 = load_f16(w.d(blk) + 16);
    const vf m0 = kQ4 ? load_f16(w.m(blk)) : vzero(), m1 = kQ4 ? load_f16(w.m(blk) + 16) : vzero();
    for (int64_t r = 0; r < n0 + n1; ++r) {  // the pair's rows are consecutive: row r is block i's row r - i n0
      const int i = r >= n0, rb = static_cast<int>(r - i * n0);
      const int64_t rg = (r0 + r) * w.groups + g;
      float* yr = y + r * ldy;
      vstore(yr, epilogue<D, kQ4>(vload(yr), c[i][0][D * rb], d0, m0, a.scale[rg], a.sum[rg]));
      vstore(yr + 16, epilogue<D, kQ4>(vload(yr + 16), c[i][1][D * rb], d1, m1, a.scale[rg], a.sum[rg]));
    }
  }
}

// As gemm<IntPath<D>>: threads split the units (32 outputs each); a thread runs its units over each tile of kRowTile
// rows, a unit over the tile's row blocks (the unit's weights stay in cache between them).
template <int D, bool kQ4>
at::Tensor amx_gemm(const at::Tensor& x, const Weights& w, int64_t n_out) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n_out}, x.options());
  const Digits<D> in(x.data_ptr<float>(), M, K, false);  // tiles take Q8_0 codes signed: no +128 offset
  float* yp = y.data_ptr<float>();
  const int64_t paired_above = amx_pair_above.load(std::memory_order_relaxed) * kAmxRows<D>;  // rows, for the call
  parallel_for(0, n_out / kUnit, 1, [&](int64_t begin, int64_t end) {
    std::vector<CodeRow> codes(kQ4 && M > paired_above ? w.groups * 16 : 0);  // a pair's unpacked codes
    int64_t configured = 0;  // height x 2 + paired
    for (int64_t tile = 0; tile < M; tile += kRowTile) {
      const int64_t rows = std::min(M - tile, kRowTile);
      const bool paired = rows > paired_above;
      const int64_t blocks = paired ? 2 * ((rows + 2 * kAmxRows<D> - 1) / (2 * kAmxRows<D>))
                                    : (rows + kAmxRows<D> - 1) / kAmxRows<D>;
      const int64_t lo = rows / blocks, n_hi = rows % blocks, hi = lo + (n_hi != 0);  // n_hi blocks of hi rows first
      if (hi * 2 + paired != configured) {
        amx::configure(tile_config(D, hi, paired));
        configured = hi * 2 + paired;
      }
      for (int64_t u = begin; u < end; ++u) {
        if (!paired) {
          for (int64_t i = 0, r0 = tile; i < blocks; ++i) {
            const int64_t n = i < n_hi ? hi : lo;
            amx_single<D, kQ4>(w, in, u, r0, yp + r0 * n_out + u * kUnit, n_out, n, static_cast<int>(i));
            r0 += n;
          }
          continue;
        }
        if constexpr (kQ4)
          for (int64_t g = 0; g < w.groups; ++g) {
            w.prefetch_l2(u, g, 0);
            unpack_block(w, w.block(u, g), codes.data() + g * 16);
          }
        for (int64_t i = 0, r0 = tile; i < blocks; i += 2) {
          const int64_t n0 = i < n_hi ? hi : lo, n1 = i + 1 < n_hi ? hi : lo;
          amx_block_pair<D, kQ4>(w, codes.data(), in, u, r0, n0, n1, yp + r0 * n_out + u * kUnit, n_out,
                                 static_cast<int>(i));
          r0 += n0 + n1;
        }
      }
    }
    amx::release();
  });
  return y;
}

template <int D>
at::Tensor amx_gemm(const at::Tensor& x, const Weights& w, int64_t n_out) {
  return w.format == Format::kQ4_1 ? amx_gemm<D, true>(x, w, n_out) : amx_gemm<D, false>(x, w, n_out);
}
#endif  // SPIND_AMX

// ---- avx2 fp32 path (`gguf` on AVX2): the weights dequantized in registers, fp32 FMAs ----
#ifndef SPIND_VNNI
struct Fp32Rows {  // the fp32 rows as they are
  const float* x;
  int64_t ldx;
  Fp32Rows(const float* x, int64_t /* M */, int64_t K, bool /* q8_0 */) : x(x), ldx(K) {}
};

// y[r0 + r, unit] for MR rows: w dequantized in registers, two fp32 FMA chains per output.
template <int MR>
void fp32_row_block(const Weights& w, const Fp32Rows& in, int64_t unit, int64_t r0, float* y, int64_t ldy) {
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

struct Fp32Path {
  using Inputs = Fp32Rows;
  static constexpr int kRows = 2;
  static int64_t block_rows(int64_t) { return kRows; }
  template <int MR>
  static void block(const Weights& w, const Inputs& in, int64_t unit, int64_t r0, float* y, int64_t ldy,
                    int /*pass*/) {
    fp32_row_block<MR>(w, in, unit, r0, y, ldy);
  }
};
#endif

// y[r0 .. r0 + n) for one unit, in register blocks of at most MR rows
template <class Path, int MR>
void rows(const Weights& w, const typename Path::Inputs& in, int64_t unit, int64_t r0, float* y, int64_t ldy,
          int64_t n, int pass) {
  if constexpr (MR > 1) {
    if (n < MR) return rows<Path, MR - 1>(w, in, unit, r0, y, ldy, n, pass);
  }
  Path::template block<MR>(w, in, unit, r0, y, ldy, pass);
}

template <class Path>
at::Tensor gemm(const at::Tensor& x, const Weights& w, int64_t n_out) {
  constexpr int kRows = Path::kRows;
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  // integer paths: x as digits, once for every unit
  const typename Path::Inputs in(x.data_ptr<float>(), M, K, w.format == Format::kQ8_0);
  float* yp = y.data_ptr<float>();
  const int64_t per_block = Path::block_rows(M);  // <= kRows
  parallel_for(0, n_out / kUnit, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = 0; tile < M; tile += kRowTile) {
      const int64_t tile_end = std::min(M, tile + kRowTile);
      // row blocks of at most per_block, as even as they go: with 5, 16 rows are 4 blocks of 4, not 5 + 5 + 5 + 1
      const int64_t n = tile_end - tile, blocks = (n + per_block - 1) / per_block;
      for (int64_t u = begin; u < end; ++u)
        for (int64_t b = 0, r0 = tile; b < blocks; ++b) {
          const int64_t rows_b = n / blocks + (b < n % blocks ? 1 : 0);
          rows<Path, kRows>(w, in, u, r0, yp + r0 * n_out + u * kUnit, n_out, rows_b, static_cast<int>(b));
          r0 += rows_b;
        }
    }
  });
  return y;
}

// digits: 0 = the build's fp32-precision path (3 digits on AVX-512 VNNI, fp32 FMAs on AVX2); 1 or 2 = 8- or 15-bit
// activations, bit-identical on every build
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, Format format, int digits) {
  const Weights w{format, nullptr, blocks.dim() == 3 ? blocks.size(1) : 0, 0};
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == w.block_bytes() && blocks.scalar_type() == at::kByte &&
              blocks.is_contiguous(), "blocks must be a contiguous uint8 [N/32, K/32, ", w.block_bytes(), "]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) == w.groups * kBlock, "x has ", x.size(1), " columns, the weight ", w.groups * kBlock);
  const Weights ws{format, blocks.data_ptr<uint8_t>(), w.groups, blocks.size(0) * w.groups};
  const int64_t n_out = blocks.size(0) * kPair;
#ifdef SPIND_AMX
  if (x.size(0) >= amx_min_rows.load(std::memory_order_relaxed) && amx::status().empty()) {
    if (digits == 1) return amx_gemm<1>(x, ws, n_out);
    if (digits == 2) return amx_gemm<2>(x, ws, n_out);
    return amx_gemm<3>(x, ws, n_out);
  }
#endif
  if (digits == 1) return gemm<IntPath<1>>(x, ws, n_out);
  if (digits == 2) return gemm<IntPath<2>>(x, ws, n_out);
#ifdef SPIND_VNNI
  return gemm<IntPath<3>>(x, ws, n_out);
#else
  return gemm<Fp32Path>(x, ws, n_out);
#endif
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ4_1, 0); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ8_0, 0); }
at::Tensor q4_1_linear_q8(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ4_1, 1); }
at::Tensor q8_0_linear_q8(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ8_0, 1); }
at::Tensor q4_1_linear_q16(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ4_1, 2); }
at::Tensor q8_0_linear_q16(const at::Tensor& x, const at::Tensor& blocks) { return linear(x, blocks, Format::kQ8_0, 2); }

// The digits the integer path computes with, for tests: (digits int8 [M, K/32, D, 32], scale [M, K/32], sum
// [M, K/32]) of x
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t digits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be a contiguous fp32 [M, K] with K a multiple of 32");
  TORCH_CHECK(digits >= 1 && digits <= 3, "digits must be 1, 2 or 3");
  const int64_t M = x.size(0), G = x.size(1) / kBlock;
  auto copy_out = [&](const auto& a) {
    at::Tensor d = at::empty({M, G, digits, kBlock}, x.options().dtype(at::kChar));
    int8_t* out = d.data_ptr<int8_t>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < G; ++g) std::copy_n(a.at(r, g), digits * kBlock, out + (r * G + g) * digits * kBlock);
    at::Tensor s = at::empty({M, G}, x.options()), t = at::empty({M, G}, x.options());
    std::copy(a.scale.begin(), a.scale.end(), s.data_ptr<float>());
    std::copy(a.sum.begin(), a.sum.end(), t.data_ptr<float>());
    return std::make_tuple(d, s, t);
  };
  if (digits == 1) return copy_out(Digits<1>(x.data_ptr<float>(), M, x.size(1), true));
  if (digits == 2) return copy_out(Digits<2>(x.data_ptr<float>(), M, x.size(1), true));
  return copy_out(Digits<3>(x.data_ptr<float>(), M, x.size(1), true));
}

// (kind, why the tiles go unused or "", rows from which a call takes them, row blocks of a tile above which they go in
// pairs): kind is "hardware", "emulated" (the test build) or "none" (a build without tiles)
std::tuple<std::string, std::string, int64_t, int64_t> amx_info() {
#ifdef SPIND_AMX
  return {amx::kKind, amx::status(), amx_min_rows.load(), amx_pair_above.load()};
#else
  return {"none", "a build without AMX tiles", 0, 0};
#endif
}

// Tiles of more than `blocks` row blocks run them in pairs from now on; returns the previous value. Every value gives
// the same rows (tests, benches, and cpu_ext.tune_amx_layout).
int64_t set_amx_pair_above(int64_t blocks) {
  TORCH_CHECK(blocks >= 1 && blocks <= (int64_t{1} << 30), "set_amx_pair_above: blocks must be in [1, 2^30], got ",
              blocks);
#ifdef SPIND_AMX
  return amx_pair_above.exchange(blocks);
#else
  return 0;
#endif
}

// Calls of at least `rows` rows take the tiles from now on; returns the previous threshold (tests and benches)
int64_t set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "set_amx_min_rows: rows must be >= 1, got ", rows);
#ifdef SPIND_AMX
  return amx_min_rows.exchange(rows);
#else
  return 0;
#endif
}

}  // namespace

namespace SPIND_OPS {
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, bool q8_0, int64_t digits) {
  return linear(x, blocks, q8_0 ? Format::kQ8_0 : Format::kQ4_1, static_cast<int>(digits));
}
}  // namespace SPIND_OPS

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks) -> Tensor", &q4_1_linear);
  m.def("q8_0_linear(Tensor x, Tensor blocks) -> Tensor", &q8_0_linear);
  m.def("q4_1_linear_q8(Tensor x, Tensor blocks) -> Tensor", &q4_1_linear_q8);
  m.def("q8_0_linear_q8(Tensor x, Tensor blocks) -> Tensor", &q8_0_linear_q8);
  m.def("q4_1_linear_q16(Tensor x, Tensor blocks) -> Tensor", &q4_1_linear_q16);
  m.def("q8_0_linear_q16(Tensor x, Tensor blocks) -> Tensor", &q8_0_linear_q16);
  m.def("quantize_rows(Tensor x, int digits) -> (Tensor, Tensor, Tensor)", &quantize_rows);
  m.def("amx_info() -> (str, str, int, int)", &amx_info);
  m.def("set_amx_pair_above(int blocks) -> int", &set_amx_pair_above);
  m.def("set_amx_min_rows(int rows) -> int", &set_amx_min_rows);
}

}  // namespace spind_cpu
