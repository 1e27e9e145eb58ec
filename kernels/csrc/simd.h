// The few vector operations spind's CPU kernels use, for one of two builds (kernels/cpu_ext.py picks per machine):
//   avx512vnni: 16 fp32 lanes, and vpdpbusd (u8 x s8 -> int32 dot products of 4) for the integer GEMM path;
//   avx2:       8 fp32 lanes with FMA and F16C, and vpmaddubsw / vpmaddwd (u8 x s8 pairs -> int16 -> int32) for the
//               single-digit integer GEMM path.
// Every kernel is written once against these.
//
// Only exact-by-definition operations appear here (loads, integer ops, conversions of small integers and fp16,
// fused multiply-add, add, mul), so a kernel's arithmetic is exactly what its source says: nothing is
// reassociated and no -ffast-math is used. That is what makes the kernels batch-invariant by construction.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace spind_cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPIND_VNNI 1
constexpr int kLanes = 16;
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
// x >= 0 ? a : b, per lane
inline vf vselect_nonnegative(vf x, vf a, vf b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
inline vf load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// round to nearest even, as c10::Half does
inline void store_f16(uint16_t* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
// 2^n for integer-valued n in [-126, 127]
inline vf exp2i(vf n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// integer lanes
inline vi iload(const void* p) { return _mm512_loadu_si512(p); }
inline vi iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi ixor(vi a, vi b) { return _mm512_xor_si512(a, b); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi isub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi srl16(vi a, int n) { return _mm512_srli_epi16(a, n); }
// acc + the sum of the 4 products of the u8 bytes of u with the s8 bytes of s, per int32 lane (exact)
inline vi dpbusd(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
// lane i = the sum of v[i]'s lanes, for 16 vectors, by one fixed tree for every i: 128-bit quarters (q0 + q2) +
// (q1 + q3), then within the quarter (e0 + e2) + (e1 + e3)
inline vf transpose_sum(const vf* v) {
  vf a[8], b[4];
  for (int i = 0; i < 8; ++i)  // a[i]: [q0+q2, q1+q3] of v[i] | of v[i + 8]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // b[i]: the quarter sums of v[i], v[i + 8], v[i + 4], v[i + 12]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  const vf c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const vf c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  const vf d = _mm512_add_ps(_mm512_shuffle_ps(c0, c1, 0x44), _mm512_shuffle_ps(c0, c1, 0xEE));
  return _mm512_shuffle_f32x4(d, d, 0xD8);  // quarters hold v[0..3], v[8..11], v[4..7], v[12..15]: reorder
}
inline float vmax_lanes(vf v) { return _mm512_reduce_max_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
constexpr int kLanes = 8;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vselect_nonnegative(vf x, vf a, vf b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline vf load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store_f16(uint16_t* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline float hsum(vf v) {  // fixed tree: halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vf exp2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vi iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline vi iand(vi a, vi b) { return _mm256_and_si256(a, b); }
// lane i = the sum of v[i]'s lanes, for 8 vectors, by one fixed tree for every i: ((e0 + e1) + (e2 + e3)) +
// ((e4 + e5) + (e6 + e7))
inline vf transpose_sum(const vf* v) {
  const vf u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const vf u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline float vmax_lanes(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// byte `i` of every int32 lane, zero- or sign-extended
inline vi byte_u(vi v, int i) { return _mm256_and_si256(_mm256_srli_epi32(v, 8 * i), _mm256_set1_epi32(255)); }
inline vi byte_s(vi v, int i) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * i), 24); }
inline vi srl32(vi a, int n) { return _mm256_srli_epi32(a, n); }
inline vi izero() { return _mm256_setzero_si256(); }
inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi srl16(vi a, int n) { return _mm256_srli_epi16(a, n); }
inline vi sll16(vi a, int n) { return _mm256_slli_epi16(a, n); }
inline vi sra16(vi a, int n) { return _mm256_srai_epi16(a, n); }
inline vi iset1_16(int16_t x) { return _mm256_set1_epi16(x); }
inline vi iadd16(vi a, vi b) { return _mm256_add_epi16(a, b); }
inline vi iabs8(vi a) { return _mm256_abs_epi8(a); }  // |-128| = 128 read as u8
// a's bytes negated where b's are negative, zeroed where b's are zero
inline vi isign8(vi a, vi b) { return _mm256_sign_epi8(a, b); }
// u8 x s8 products summed in adjacent pairs into int16 (saturating: callers keep the pairs below 2^15)
inline vi maddubs(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
// int16 products summed in adjacent pairs into int32 (exact)
inline vi madd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
#else
#error "spind's CPU kernels build for AVX-512 + VNNI or for AVX2 + FMA + F16C (without AVX-512 flags)"
#endif

// exp(x) for x <= 0 (softmax after subtracting the max), ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, Cephes polynomial.
inline vf vexp_nonpositive(vf x) {
  x = vmax(x, vset1(-87.0f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);  // ln2 split in two for an exact-ish reduction
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vmul(p, exp2i(n));
}

}  // namespace spind_cpu
