// Int8 matrix tiles (AMX-INT8) for the integer GEMM's many-row calls, in one of two forms:
//   avx512amx     (-mamx-tile -mamx-int8): the CPU's tiles (Intel Sapphire Rapids and later);
//   avx512amxemu  (-DSPIND_AMX_EMULATE): the same operations in scalar code, with the hardware's shape rules
//                 checked, so the tile path's layouts and epilogue are tested on every AVX-512 VNNI machine (CI),
//                 not only where AMX exists. Never picked to serve: kernels/cpu_ext.py loads it for tests only.
//
// A tile is up to 16 rows of up to 64 bytes. dp<C, A, B> adds to the int32 tile C[m][n] the exact sum over k of
// A[m][4k + i] * B[k][4n + i] (i < 4): A holds the rows' activation digits (int8, K along its bytes), B the
// weights' codes with 4 consecutive k of one output per int32 lane (the "VNNI layout": spind's packed GGUF blocks
// already store a 16-output tile's codes this way, csrc/quant_gemm.cpp). Tiles are named by compile-time
// indices, as the instructions encode them.
//
// Linux grants a process the tile state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
// `status()` asks once and says why the tiles cannot be used, if they cannot.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#if defined(SPIND_AMX_EMULATE)
#define SPIND_AMX 1
#include <ATen/ATen.h>  // TORCH_CHECK for the emulator's shape rules
#elif defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPIND_AMX 1
#include <cerrno>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef SPIND_AMX
namespace spind_cpu {
namespace amx {
// Internal linkage: the builds are loaded side by side, and a function-local static of an inline function (the
// tile permission's, the emulated tiles) is a process-wide unique symbol otherwise, even across RTLD_LOCAL
// libraries: a hardware build would then have read the emulated build's "usable" and run tiles without Linux's
// permission.
namespace {

constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int nrows, int bytes) {
    rows[tile] = static_cast<uint8_t>(nrows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};
static_assert(sizeof(Config) == 64, "ldtilecfg reads 64 bytes");

#if defined(SPIND_AMX_EMULATE)
struct Emulated {
  Config cfg;
  bool configured = false;
  alignas(64) uint8_t data[8][kMaxRows][kMaxColsb];
};
thread_local Emulated tiles;

constexpr const char* kKind = "emulated";
inline const std::string& status() {  // empty: usable
  static const std::string s;
  return s;
}
inline void configure(const Config& c) {  // as ldtilecfg: every tile zeroed
  tiles.cfg = c;
  tiles.configured = true;
  std::memset(tiles.data, 0, sizeof(tiles.data));
}
inline void release() { tiles.configured = false; }
inline void check_tile(int t) {
  TORCH_CHECK(tiles.configured, "AMX emulation: tile used without a configuration");
  TORCH_CHECK(tiles.cfg.rows[t] >= 1 && tiles.cfg.rows[t] <= kMaxRows && tiles.cfg.colsb[t] >= 4 &&
              tiles.cfg.colsb[t] <= kMaxColsb && tiles.cfg.colsb[t] % 4 == 0, "AMX emulation: tile ", t, " is ",
              int(tiles.cfg.rows[t]), " x ", tiles.cfg.colsb[t], " bytes");
}
template <int T>
void load(const void* p, int64_t stride) {
  check_tile(T);
  std::memset(tiles.data[T], 0, sizeof(tiles.data[T]));
  for (int r = 0; r < tiles.cfg.rows[T]; ++r)
    std::memcpy(tiles.data[T][r], static_cast<const uint8_t*>(p) + r * stride, tiles.cfg.colsb[T]);
}
template <int T>
void zero() {
  check_tile(T);
  std::memset(tiles.data[T], 0, sizeof(tiles.data[T]));
}
template <int T>
void store(void* p, int64_t stride) {
  check_tile(T);
  for (int r = 0; r < tiles.cfg.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, tiles.data[T][r], tiles.cfg.colsb[T]);
}
template <int C, int A, int B, bool kUnsignedB>
void dp() {
  check_tile(C), check_tile(A), check_tile(B);
  const Config& c = tiles.cfg;
  // the hardware's rules (#UD otherwise): A and C rows agree, A's K / 4 is B's rows, B and C row widths agree
  TORCH_CHECK(c.rows[A] == c.rows[C] && c.colsb[A] / 4 == c.rows[B] && c.colsb[B] == c.colsb[C],
              "AMX emulation: tile shapes do not compose");
  const int n_cols = c.colsb[C] / 4, n_k = c.colsb[A] / 4;
  for (int m = 0; m < c.rows[C]; ++m) {
    int32_t acc[kMaxColsb / 4];
    int8_t a[kMaxColsb];
    std::memcpy(acc, tiles.data[C][m], sizeof(acc));
    std::memcpy(a, tiles.data[A][m], sizeof(a));
    for (int k = 0; k < n_k; ++k)
      for (int n = 0; n < n_cols; ++n)
        for (int i = 0; i < 4; ++i) {
          const uint8_t braw = tiles.data[B][k][4 * n + i];
          acc[n] += int32_t{a[4 * k + i]} * (kUnsignedB ? int32_t{braw} : int32_t{static_cast<int8_t>(braw)});
        }
    std::memcpy(tiles.data[C][m], acc, sizeof(acc));
  }
}
#else
constexpr const char* kKind = "hardware";
// Once per process: the CPU's AMX-INT8 bit (CPUID.(7,0):EDX[25]), then Linux's permission for the tile state.
// Empty when the tiles are usable, else why not.
inline const std::string& status() {
  static const std::string s = []() -> std::string {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return "this CPU lacks AMX-TILE / AMX-INT8 (CPUID leaf 7)";
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("Linux refused the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): ") +
             std::strerror(errno) + ")";
    return "";
  }();
  return s;
}
inline void configure(const Config& c) { _tile_loadconfig(&c); }
inline void release() { _tile_release(); }
// The tile instructions in inline assembly of our own (the tile index an immediate, printed by %c), each telling the
// compiler exactly which memory it reads or writes: a tile's rows lie within kMaxRows x kMaxColsb bytes of its base
// at the strides used here (Span). GCC's intrinsics describe tilestored by a "memory" clobber, which made GCC keep
// the GEMM's accumulators on the stack, reloaded and stored around every block; and tileloadd by no memory operand at
// all, so nothing told GCC that the stores the tile reads must come first.
struct Span {
  uint8_t bytes[kMaxRows * kMaxColsb];
};
template <int T>
inline void load(const void* p, int64_t stride) {
  __asm__ volatile("tileloadd (%1,%2,1), %%tmm%c3" : : "m"(*static_cast<const Span*>(p)), "r"(p), "r"(stride), "i"(T));
}
template <int T>
inline void zero() {
  __asm__ volatile("tilezero %%tmm%c0" : : "i"(T));
}
template <int T>
inline void store(void* p, int64_t stride) {
  __asm__ volatile("tilestored %%tmm%c3, (%1,%2,1)" : "=m"(*static_cast<Span*>(p)) : "r"(p), "r"(stride), "i"(T));
}
// C += A B: signed A x unsigned B (tdpbsud) or signed x signed (tdpbssd)
template <int C, int A, int B, bool kUnsignedB>
inline void dp() {
  static_assert(C >= 0 && C < 8 && A >= 0 && A < 8 && B >= 0 && B < 8 && C != A && C != B && A != B, "tiles 0 .. 7");
  if constexpr (kUnsignedB) __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
  else __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}
#endif

}  // namespace
}  // namespace amx
}  // namespace spind_cpu
#endif  // SPIND_AMX
