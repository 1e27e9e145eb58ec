// Causal attention over a paged KV cache (fp32, or fp16 widened exactly on load), one query row at a time, so that a
// row's output never depends on how many other rows (of its request or of others) share the forward: batch-invariant
// by construction.
//
// Tokens of all requests are packed: request b owns rows [cu_q[b], cu_q[b+1]) of q and its context is the
// ctx_lens[b] cache slots slots[slot_start[b] ...]; row t of request b sits at position
// ctx_lens[b] - (cu_q[b+1] - t) and sees the positions up to and including its own.
//
// Work items are up to kChunk rows of a request and one KV head with the query heads that share it (GQA), run on the
// kernels' thread pool in runs of equal work (a single decode row still splits by KV head); the item's rows share every
// K/V row read: an fp16 cache's K tile is widened once per item into an L1 buffer that all its rows read (a verify's 5
// rows x 3 query heads widened each K vector 15 times), and V goes through groups of rows (`v_rows`: up to 6 on AVX-512
// at head dim 64) whose accumulators stay in registers, each V vector widened once in a register for the group (against
// widening it into a buffer and reloading it per row pair: attention 8-10% faster at 8 decode rows, Zen 4).
// For one (row, head), in a fixed sequence whatever else is in the call:
//   scores: per position, q . k as a chain of vector FMAs over the head dim, its lanes summed by one fixed tree
//           (`transpose_sum`: kLanes positions per reduction, no horizontal sum per dot), times the scale;
//   softmax: the max, exp(score - max), their sum in kLanes strided partial sums, a fixed tree, the tail in order;
//   output: sum over positions, in increasing order, of exp-score x V row in vector registers, times 1 / sum.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace spind_cpu {
namespace {

constexpr int64_t kChunk = 8;   // rows of one request per work item (they share the K/V rows they read)
constexpr int64_t kVTile = 64;  // positions per pass over V (their rows stay in L1 for all of the item's rows)
constexpr int kMaxVecs = 16;    // head dim up to 16 vectors (256 on AVX-512, 128 on AVX2)
// K rows are prefetched this many positions ahead of the scores' tile: a decode row computes little per position,
// so one tile ahead (16) left the scattered K/V reads latency-bound (~4 GB/s at 1000 tokens of context)
constexpr int64_t kAheadK = 64;
// and an item's first positions' K rows are requested into L2 when it starts (the L2 holds more misses in flight than
// the L1). Zen 4, 16 decode rows of 256 positions over 30 layers (94 MB of fp16 KV, from memory) at 1 thread, with
// the V rows requested so too: 17.1-17.7 -> 14.8-15.8 ms. The V rows are requested into L2 during the K pass instead,
// a tile's V beside its K: on Zen 3 the prefetches of 256 positions' K and V at an item's start (1024 lines) stalled
// at the prefetch instructions themselves (perf: ~14 % of attention's samples on them), and the V pass still waited
// on its loads (~25 % on the first FMA of each V line); same-process A/B (`spind bench batch --against`), the
// default target's attention 0.90-0.94x the time at 1 to 16 decode rows of 256 positions, 1 and 2 threads.
constexpr int64_t kAheadL2 = 256;

template <typename KV>
inline void prefetch(const KV* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(KV)) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

template <typename KV>
inline void prefetch_l2(const KV* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(KV)) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// kLanes cache elements as fp32: fp32 as they are, fp16 widened (exactly)
inline vf load_kv(const float* p) { return vload(p); }
inline vf load_kv(const uint16_t* p) { return load_f16(p); }

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

inline float max_of(const float* p, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  if (n >= kLanes) {
    vf acc = vload(p);
    for (i = kLanes; i + kLanes <= n; i += kLanes) acc = vmax(acc, vload(p + i));
    m = vmax_lanes(acc);
  }
  for (; i < n; ++i) m = std::max(m, p[i]);
  return m;
}

// sum of p[0:n]: lane l accumulates positions l, l + kLanes, ... in order, then one fixed tree, then the tail in order
inline float sum_of(const float* p, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
  if (n >= kLanes) {
    vf acc = vload(p);
    for (i = kLanes; i + kLanes <= n; i += kLanes) acc = vadd(acc, vload(p + i));
    s = hsum(acc);
  }
  for (; i < n; ++i) s += p[i];
  return s;
}

template <typename KV>
struct Item {
  const float* q;      // [n][H][D] from the item's first row and first query head h0
  float* out;          // same layout
  const KV* k;         // cache base, offset to the item's KV head (fp32 or fp16 elements)
  const KV* v;
  const int64_t* rs;   // the request's cache slots by position
  int64_t row_stride;  // elements per cache slot (Hkv D)
  int64_t H, group, n, first_visible;  // group: the item's query heads (h0 ..), all on one KV head; row j sees
                                       // positions [0, first_visible + j)
  float scale;
  float* scores;  // [n group][ld]
  int64_t ld;

  // item row r (row r / group of the chunk, query head h0 + r % group): its offset in q and out for head dim D, and
  // how many positions it sees
  int64_t row_offset(int64_t r, int64_t D) const { return ((r / group) * H + r % group) * D; }
  int64_t visible(int64_t r) const { return first_visible + r / group; }
};

// Rows a V pass carries at once: each row's NV accumulators in registers, beside one widened V vector and its weight.
#if defined(SPIND_VNNI)
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif
template <int NV>
constexpr int64_t kVRows = std::max(1, (kVecRegs - 2) / (NV + 1));

// Rows r0 .. r0 + count - 1 (count <= G) of an item through V positions [t0, t1): out row += sum over the positions
// it sees, in increasing order, of its exp-score x the V row, one FMA per position and vector; each V vector is widened
// once, in registers, for all the rows. A row's chain is the same whatever rows share the pass.
template <typename KV, int NV, int G>
void v_rows(const Item<KV>& it, int64_t r0, int64_t count, int64_t t0, int64_t t1) {
  if constexpr (G > 1) {
    if (count < G) return v_rows<KV, NV, G - 1>(it, r0, count, t0, t1);
  }
  float* o[G];
  const float* s[G];
  int64_t end[G], shared = t1;
  for (int g = 0; g < G; ++g) {
    const int64_t r = r0 + g;
    o[g] = it.out + it.row_offset(r, NV * kLanes);
    s[g] = it.scores + r * it.ld;
    end[g] = std::min(t1, it.visible(r));
    shared = std::min(shared, end[g]);
  }
  vf acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = vload(o[g] + v * kLanes);
  int64_t p = t0;
  for (; p < shared; ++p) {  // positions every row of the group sees
    const KV* src = it.v + it.rs[p] * it.row_stride;
    for (int v = 0; v < NV; ++v) {
      const vf x = load_kv(src + v * kLanes);
      for (int g = 0; g < G; ++g) acc[g][v] = vfma(vset1(s[g][p]), x, acc[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)  // a verify's later rows see further
    for (int64_t q = p; q < end[g]; ++q) {
      const KV* src = it.v + it.rs[q] * it.row_stride;
      const vf w = vset1(s[g][q]);
      for (int v = 0; v < NV; ++v) acc[g][v] = vfma(w, load_kv(src + v * kLanes), acc[g][v]);
    }
  for (int g = 0; g < G; ++g)
    if (end[g] > t0)
      for (int v = 0; v < NV; ++v) vstore(o[g] + v * kLanes, acc[g][v]);
}

template <typename KV, int NV>
void attend(const Item<KV>& it) {
  constexpr int64_t D = NV * kLanes;
  const int64_t all_visible = it.first_visible + it.n - 1, R = it.n * it.group;
  auto qrow = [&](int64_t r) { return it.q + it.row_offset(r, D); };
  auto orow = [&](int64_t r) { return it.out + it.row_offset(r, D); };
  auto visible = [&](int64_t r) { return it.visible(r); };
  // scores, kLanes positions at a time (lanes past a row's last visible position are computed and never read)
  for (int64_t i = 0; i < std::min(kAheadK, all_visible); ++i) prefetch(it.k + it.rs[i] * it.row_stride, D);
  for (int64_t i = kAheadK; i < std::min(kAheadL2, all_visible); ++i) prefetch_l2(it.k + it.rs[i] * it.row_stride, D);
  alignas(64) float kbuf[kLanes][D];  // an fp16 tile's K rows widened once for all the item's rows (fp32: unused)
  for (int64_t p0 = 0; p0 < all_visible; p0 += kLanes) {
    const float* krow[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const KV* src = it.k + it.rs[std::min(p0 + i, all_visible - 1)] * it.row_stride;
      if constexpr (std::is_same_v<KV, float>) {
        krow[i] = src;
      } else {
        for (int v = 0; v < NV; ++v) vstore(kbuf[i] + v * kLanes, load_kv(src + v * kLanes));
        krow[i] = kbuf[i];
      }
    }
    for (int64_t i = p0 + kAheadK; i < std::min(p0 + kAheadK + kLanes, all_visible); ++i)
      prefetch(it.k + it.rs[i] * it.row_stride, D);
    for (int64_t i = p0; i < std::min(p0 + kLanes, all_visible); ++i)  // this tile's V rows, for the V pass
      prefetch_l2(it.v + it.rs[i] * it.row_stride, D);
    for (int64_t r = 0; r < R; ++r) {
      if (p0 >= visible(r)) continue;
      const float* qv = qrow(r);
      vf q[NV];
      for (int v = 0; v < NV; ++v) q[v] = vload(qv + v * kLanes);
      vf part[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        vf a = vmul(q[0], vload(krow[i]));
        for (int v = 1; v < NV; ++v) a = vfma(q[v], vload(krow[i] + v * kLanes), a);
        part[i] = a;
      }
      vstore(it.scores + r * it.ld + p0, vmul(transpose_sum(part), vset1(it.scale)));
    }
  }
  // softmax numerators and 1 / denominators
  float inv[kChunk * 64];
  for (int64_t r = 0; r < R; ++r) {
    float* s = it.scores + r * it.ld;
    const int64_t n = visible(r);
    exp_shifted(s, n, max_of(s, n));
    inv[r] = 1.0f / sum_of(s, n);
  }
  // outputs, V in tiles of kVTile positions (a tile's V rows stay in L1 for all the item's row groups)
  for (int64_t r = 0; r < R; ++r) std::fill_n(orow(r), D, 0.0f);
  for (int64_t i = 0; i < std::min(kVTile, all_visible); ++i) prefetch(it.v + it.rs[i] * it.row_stride, D);
  for (int64_t t0 = 0; t0 < all_visible; t0 += kVTile) {
    const int64_t t1 = std::min(t0 + kVTile, all_visible);
    for (int64_t i = t1; i < std::min(t1 + kVTile, all_visible); ++i)  // the next tile's rows, while this one runs
      prefetch(it.v + it.rs[i] * it.row_stride, D);
    for (int64_t r = 0; r < R; r += kVRows<NV>) v_rows<KV, NV, kVRows<NV>>(it, r, std::min(kVRows<NV>, R - r), t0, t1);
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = orow(r);
    const vf w = vset1(inv[r]);
    for (int v = 0; v < NV; ++v) vstore(o + v * kLanes, vmul(vload(o + v * kLanes), w));
  }
}

template <typename KV>
using AttendFn = void (*)(const Item<KV>&);
template <typename KV, std::size_t... I>
constexpr std::array<AttendFn<KV>, sizeof...(I)> attend_table(std::index_sequence<I...>) {
  return {&attend<KV, static_cast<int>(I) + 1>...};
}

struct Chunk {
  int64_t b, first, last;
  int64_t visible_end;  // positions the chunk's last row sees
};

// Each request's rows in chunks of up to kChunk, in order
std::vector<Chunk> make_chunks(const int64_t* cu, const int64_t* ctx, int64_t B) {
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; t += kChunk) {
      const int64_t last = std::min(t + kChunk, cu[b + 1]);
      chunks.push_back({b, t, last, ctx[b] - (cu[b + 1] - last)});
    }
  return chunks;
}

// An item's work in (row, position) units: every row of every query head over the positions the chunk sees, the
// K tile's widening, and a fixed start
int64_t item_work(const Chunk& ch, int64_t group) {
  constexpr int64_t kItemStart = 64;
  return ch.visible_end * ((ch.last - ch.first) * group + 2) + kItemStart;
}

// The items [0, chunks x Hkv) cut into one contiguous part per thread of about equal work (item_work): bounds[p] ..
// bounds[p + 1] is part p. Cut by item count instead, a prefill's second half held most of its work (a chunk sees
// the positions of every chunk before it: 3/4 of a long prompt's attention), and its attention at 2 threads took 0.8x
// its time at 1 thread (Xeon, 229 tokens; 0.44x cut by work). Which thread runs an item changes no result.
std::vector<int64_t> balanced_parts(const std::vector<Chunk>& chunks, int64_t Hkv, int64_t group, int64_t threads) {
  const int64_t items = static_cast<int64_t>(chunks.size()) * Hkv;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  std::vector<int64_t> bounds{0};
  if (parts == 1) {
    bounds.push_back(items);
    return bounds;
  }
  int64_t total = 0;
  for (const Chunk& ch : chunks) total += item_work(ch, group) * Hkv;
  int64_t done = 0;
  for (int64_t item = 0; item < items; ++item) {
    const int64_t p = static_cast<int64_t>(bounds.size());  // the next part to start
    if (p < parts && done * parts >= total * p) bounds.push_back(item);
    done += item_work(chunks[item / Hkv], group);
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) bounds.push_back(items);
  return bounds;
}

// Every (chunk of rows, KV head) item on the pool: a KV head's query heads in one item, so they share each K/V read.
// (One item per query head would balance a decode row's 3 KV heads on 2 threads, and change no result, but measured
// slower: it reads K/V once per query head.)
template <typename KV>
void run_items(const std::vector<Chunk>& chunks, const float* qp, float* op, const KV* kp, const KV* vp,
               const int64_t* sl, const int64_t* start, const int64_t* cu, const int64_t* ctx, int64_t H, int64_t Hkv,
               int64_t D, int64_t group, int64_t max_ctx, float scale) {
  static constexpr auto table = attend_table<KV>(std::make_index_sequence<kMaxVecs>{});
  const AttendFn<KV> fn = table[D / kLanes - 1];
  const int64_t ld = (max_ctx + kLanes - 1) / kLanes * kLanes;
  const std::vector<int64_t> bounds = balanced_parts(chunks, Hkv, group, at::get_num_threads());
  parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    thread_local std::vector<float> scores;  // reused across calls, never zeroed: every score read is written first
    if (static_cast<int64_t>(scores.size()) < kChunk * group * ld) scores.resize(kChunk * group * ld);
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const Chunk ch = chunks[item / Hkv];
      const int64_t kvh = item % Hkv, h0 = kvh * group, n = ch.last - ch.first, b = ch.b;
      const Item<KV> it{qp + (ch.first * H + h0) * D, op + (ch.first * H + h0) * D, kp + kvh * D,
                        vp + kvh * D, sl + start[b], Hkv * D, H, group, n, ctx[b] - (cu[b + 1] - ch.first) + 1,
                        scale, scores.data(), ld};
      fn(it);
    }
  });
}

}  // namespace

namespace SPIND_OPS {
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& slot_start, const at::Tensor& cu_q,
                         const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous fp32 [T, H, D]");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && (kv_type == at::kFloat || kv_type == at::kHalf) && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv_type && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous fp32 or fp16 [slots, Hkv, D], both the same");
  for (const at::Tensor* t : {&slots, &slot_start, &cu_q, &ctx_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "index tensors must be int64 1-D");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), B = ctx_lens.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(D % kLanes == 0 && D / kLanes <= kMaxVecs, "head dim ", D, " must be a multiple of ", kLanes, " up to ",
              kLanes * kMaxVecs);
  TORCH_CHECK(cu_q.size(0) == B + 1 && slot_start.size(0) == B, "cu_q must be [B + 1] and slot_start [B]");
  const int64_t group = H / Hkv;
  TORCH_CHECK(group <= 64, "more than 64 query heads per KV head");
  const int64_t *cu = cu_q.data_ptr<int64_t>(), *ctx = ctx_lens.data_ptr<int64_t>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *start = slot_start.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_q must run from 0 to T");
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cu[b + 1] - cu[b] <= ctx[b] && cu[b + 1] >= cu[b], "request ", b, ": more queries than context");
    TORCH_CHECK(start[b] >= 0 && start[b] + ctx[b] <= slots.size(0), "request ", b, ": slots out of range");
    max_ctx = std::max(max_ctx, ctx[b]);
  }
  const std::vector<Chunk> chunks = make_chunks(cu, ctx, B);
  const int64_t num_slots = k_cache.size(0);
  for (int64_t i = 0; i < slots.size(0); ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "slot out of range");

  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (kv_type == at::kFloat) {
    run_items<float>(chunks, qp, op, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sl, start, cu, ctx, H, Hkv,
                     D, group, max_ctx, static_cast<float>(scale));
  } else {
    run_items<uint16_t>(chunks, qp, op, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                        reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), sl, start, cu, ctx, H, Hkv, D, group,
                        max_ctx, static_cast<float>(scale));
  }
  return out;
}
}  // namespace SPIND_OPS

namespace {
// The kernel's view of a forward's block tables: every sequence's cache slots of positions 0 .. seq_len - 1, packed
// ([sum of seq_lens] int64), and where each sequence's run starts ([B] int64). One pass on the host: as a dozen
// torch ops (spind/kernels/row_attention.py `context_slots`, the reference) it cost ~0.15 ms per forward.
std::tuple<at::Tensor, at::Tensor> context_slots(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                 int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              block_tables.device().is_cpu(), "block_tables must be a contiguous int32 CPU [B, W]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
              seq_lens.device().is_cpu() && seq_lens.size(0) == block_tables.size(0),
              "seq_lens must be a contiguous int32 CPU [B]");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t B = block_tables.size(0), W = block_tables.size(1);
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  at::Tensor start = at::empty({B}, block_tables.options().dtype(at::kLong));
  int64_t* st = start.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= W * block_size, "sequence ", b, ": ", lens[b], " positions, its table ",
                "holds ", W * block_size);
    st[b] = total;
    total += lens[b];
  }
  at::Tensor slots = at::empty({total}, start.options());
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < lens[b]; ++p)
      *out++ = int64_t{tables[b * W + p / block_size]} * block_size + p % block_size;
  return {slots, start};
}

// How row_attention cuts a call's items over `threads` threads, for tests: (bounds [parts + 1], each item's work)
std::tuple<at::Tensor, at::Tensor> row_attention_parts(const at::Tensor& cu_q, const at::Tensor& ctx_lens, int64_t Hkv,
                                                       int64_t group, int64_t threads) {
  TORCH_CHECK(cu_q.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong && cu_q.is_contiguous() &&
              ctx_lens.is_contiguous() && cu_q.size(0) == ctx_lens.size(0) + 1, "cu_q [B + 1] and ctx_lens [B], int64");
  TORCH_CHECK(Hkv >= 1 && group >= 1 && threads >= 1, "Hkv, group and threads must be >= 1");
  const std::vector<Chunk> chunks = make_chunks(cu_q.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(),
                                                ctx_lens.size(0));
  const std::vector<int64_t> bounds = balanced_parts(chunks, Hkv, group, threads);
  at::Tensor work = at::empty({static_cast<int64_t>(chunks.size()) * Hkv}, at::kLong);
  for (int64_t i = 0; i < work.size(0); ++i) work.data_ptr<int64_t>()[i] = item_work(chunks[i / Hkv], group);
  return {at::tensor(at::ArrayRef<int64_t>(bounds)), work};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(SPIND_OPS, m) {
  m.def("context_slots(Tensor block_tables, Tensor seq_lens, int block_size) -> (Tensor, Tensor)", &context_slots);
  m.def("row_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor slot_start, Tensor cu_q, "
        "Tensor ctx_lens, float scale) -> Tensor", &SPIND_OPS::row_attention);
  m.def("row_attention_parts(Tensor cu_q, Tensor ctx_lens, int Hkv, int group, int threads) -> (Tensor, Tensor)",
        &row_attention_parts);
}

}  // namespace spind_cpu
