// Tree attention over the paged KV cache on the CPU, one query row at a time: fp32 arithmetic over
// fp32 or bf16 queries and caches, in any pairing (bf16 values widened exactly on load, the result
// rounded once), or int8 caches (each row's codes times its scale, exact in fp32, widened a run of
// rows at a time into a buffer the fp32 loops read).
//
// Why: a query's result must not depend on the other queries of the step. CPU SDPA tiles its
// queries and keys by the call's shape, so the same token decoded alone and verified as a tree
// node differ in the last bits; quantized activations (kernels/cpu/block_matmul.cpp) can turn
// those bits into another token, and greedy speculation would then differ from plain decoding.
// Here every (token, head) walks exactly its visible keys (the cached context in order, then
// its tree ancestors and itself in node order) with the same fixed-order arithmetic, so its
// result is a function of those keys alone. It also reads K/V in place through the block
// table: no gathered copy of the cache per layer. bf16 needs it as much as fp32: CPU SDPA in bf16
// rounds a row differently with the rows beside it (on AVX2 hosts about one query in 40).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "fixed_order.h"
#include "scratch.h"
#include "kv_int8.h"

namespace {

using c10::BFloat16;

#if defined(__AVX2__)
// K (or V) rows this many keys ahead are prefetched into L2 (T2), not L1: a step's weights have
// streamed through every cache since the last step read its K/V, so they arrive cold, and loads
// waiting on DRAM one row after another left the attention latency-bound (on AMD EPYC Zen 4,
// 16 decodes over 500 keys spent most of a step there). Into L1 (T0) the same prefetches gained
// nothing: they held the few L1 misses in flight that the loads themselves needed.
constexpr int64_t kAheadKeys = 16;

// Always inlined: GCC deletes an out-of-line call to a function that only prefetches (it did
// so to the tiled matmuls' helper, kernels/cpu/block_matmul.cpp).
template <typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* row, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < elements * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T2);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {  // bf16 is fp32's upper half: widening is exact
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Vector paths for head sizes of C * 16: each head's scores and sums take exactly the steps of
// the portable loops below (fixed_order_dot; fma over keys in order), with the sums kept in
// registers (and a V row, or a key's K row past the last 16, loaded once for all heads of the part).
template <int C, typename T>
void scores_of(const float* q, const T* k, int64_t row_stride, const int64_t* slots, int64_t keys,
               int64_t heads, float scale, float* scores, int64_t stride) {
  const __m512 factor = _mm512_set1_ps(scale);
  int64_t i = 0;
  // Sixteen keys at a time, their sums reduced together: a decode's attention 0.30-0.72x of one
  // key at a time (benchmarks/results/cpu-attention-avx512.md).
  for (; i + 16 <= keys; i += 16) {
    for (int64_t r = i + kAheadKeys; r < std::min(keys, i + kAheadKeys + 16); ++r)
      prefetch_row(k + slots[r] * row_stride, C * 16);
    for (int64_t h = 0; h < heads; ++h) {
      __m512 qh[C], acc[16];
      for (int c = 0; c < C; ++c) qh[c] = _mm512_loadu_ps(q + h * C * 16 + 16 * c);
      // Unrolled, so that the sixteen sums stay in registers: GCC kept the loop and spilled them
      // to the stack, where the reduction's wide loads waited on the stores (fp32 8-node tree,
      // chunks and prompts 13-17% faster on AMD EPYC Zen 4; benchmarks/cpu_attention.py --against).
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const T* krow = k + slots[i + r] * row_stride;
        acc[r] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) acc[r] = _mm512_fmadd_ps(qh[c], load16(krow + 16 * c), acc[r]);
      }
      _mm512_storeu_ps(scores + h * stride + i, _mm512_mul_ps(specserve::fixed_order_sums16(acc), factor));
    }
  }
  for (; i < keys; ++i) {
    const T* krow = k + slots[i] * row_stride;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(krow + 16 * c);
    for (int64_t h = 0; h < heads; ++h) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * C * 16 + 16 * c), kv[c], acc);
      scores[h * stride + i] = specserve::fixed_order_sum(acc) * scale;
    }
  }
}

// Heads [h0, h0 + NH) of the part in one pass over the keys: a V row is loaded once for all NH.
template <int C, int NH, typename T>
void value_pass(const float* scores, int64_t stride, const T* v, int64_t row_stride, const int64_t* slots,
                int64_t keys, int64_t h0, float* out) {
  __m512 acc[NH][C];  // onto what `out` holds (zeros, or the sums over earlier keys)
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_loadu_ps(out + (h0 + h) * C * 16 + 16 * c);
  for (int64_t i = 0; i < keys; ++i) {
    if (h0 == 0 && i + kAheadKeys < keys) prefetch_row(v + slots[i + kAheadKeys] * row_stride, C * 16);
    const T* vrow = v + slots[i] * row_stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vrow + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 weight = _mm512_set1_ps(scores[(h0 + h) * stride + i]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(weight, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (h0 + h) * C * 16 + 16 * c, acc[h][c]);
}

// As many heads per pass as the registers hold (kHeads * C accumulators of 32), the pass's head
// count a compile-time constant: a runtime count left a compare beside every key's multiply-adds.
template <int C, typename T>
void values_of(const float* scores, int64_t stride, const T* v, int64_t row_stride, const int64_t* slots,
               int64_t keys, int64_t heads, float* out) {
  constexpr int kHeads = C <= 4 ? 4 : 2;
  int64_t h0 = 0;
  for (; h0 + kHeads <= heads; h0 += kHeads)
    value_pass<C, kHeads>(scores, stride, v, row_stride, slots, keys, h0, out);
  switch (heads - h0) {
    case 3: value_pass<C, 3>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    case 2: value_pass<C, 2>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    case 1: value_pass<C, 1>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    default: break;
  }
}
#define TREE_ATTENTION_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The same on AVX2: fixed_order_dot's 16 lanes as two 8-lane registers (lanes j and j + 8), the
// same fma per lane and key as the portable loops. Eight keys at a time: their 16-lane sums are
// reduced together (transposed, the same pairs added in the same order as fixed_order_sum, so the
// same bits), where one key at a time spent most of the scores' time in horizontal adds.

// fixed_order_sum of each key's lanes j + (j + 8) (`s8[r]`: key r's), keys 0-7 in order.
inline __m256 fixed_order_sums8(const __m256* s8) {
  __m256 s4[4];  // keys 2p (low half) and 2p + 1 (high half): lanes j + (j + 4)
  for (int p = 0; p < 4; ++p)
    s4[p] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * p], s8[2 * p + 1], 0x20),
                          _mm256_permute2f128_ps(s8[2 * p], s8[2 * p + 1], 0x31));
  __m256 s2[2];  // lanes j + (j + 2) of keys 4p, 4p + 2 (low half) and 4p + 1, 4p + 3 (high half)
  for (int p = 0; p < 2; ++p)
    s2[p] = _mm256_add_ps(_mm256_shuffle_ps(s4[2 * p], s4[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(s4[2 * p], s4[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 s1 = _mm256_hadd_ps(s2[0], s2[1]);  // keys 0 2 4 6 | 1 3 5 7
  return _mm256_permutevar8x32_ps(s1, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A key's 16 lanes of products summed over the head: lanes 0-7 in `lo`, 8-15 in `hi`.
template <int C, typename T>
inline void key_lanes(const float* qh, const T* krow, __m256& lo, __m256& hi) {
  lo = _mm256_setzero_ps();
  hi = _mm256_setzero_ps();
  for (int c = 0; c < C; ++c) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c), load8(krow + 16 * c), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c + 8), load8(krow + 16 * c + 8), hi);
  }
}

template <int C, typename T>
void scores_of(const float* q, const T* k, int64_t row_stride, const int64_t* slots, int64_t keys,
               int64_t heads, float scale, float* scores, int64_t stride) {
  const __m256 factor = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= keys; i += 8) {
    for (int64_t r = i + kAheadKeys; r < std::min(keys, i + kAheadKeys + 8); ++r)
      prefetch_row(k + slots[r] * row_stride, C * 16);
    const T* krows[8];
    for (int r = 0; r < 8; ++r) krows[r] = k + slots[i + r] * row_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * C * 16;
      __m256 s8[8];
      for (int r = 0; r < 8; ++r) {
        __m256 lo, hi;
        key_lanes<C>(qh, krows[r], lo, hi);
        s8[r] = _mm256_add_ps(lo, hi);  // fixed_order_sum's first step
      }
      _mm256_storeu_ps(scores + h * stride + i, _mm256_mul_ps(fixed_order_sums8(s8), factor));
    }
  }
  for (; i < keys; ++i) {
    const T* krow = k + slots[i] * row_stride;
    for (int64_t h = 0; h < heads; ++h) {
      __m256 lo, hi;
      key_lanes<C>(q + h * C * 16, krow, lo, hi);
      scores[h * stride + i] = specserve::fixed_order_sum(lo, hi) * scale;
    }
  }
}

// Heads [h0, h0 + NH) of the part, W registers of columns (8 W of them) per pass over the keys:
// a V row's columns are loaded once for all NH heads. Each lane's sum takes the keys in order.
template <int C, int NH, int W, typename T>
void value_passes(const float* scores, int64_t stride, const T* v, int64_t row_stride, const int64_t* slots,
                  int64_t keys, int64_t h0, float* out) {
  for (int c0 = 0; c0 < 2 * C; c0 += W) {
    __m256 acc[NH][W];  // onto what `out` holds (zeros, or the sums over earlier keys)
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < W; ++c) acc[h][c] = _mm256_loadu_ps(out + (h0 + h) * C * 16 + 8 * (c0 + c));
    for (int64_t i = 0; i < keys; ++i) {
      if (h0 == 0 && c0 == 0 && i + kAheadKeys < keys) prefetch_row(v + slots[i + kAheadKeys] * row_stride, C * 16);
      const T* vrow = v + slots[i] * row_stride + 8 * c0;
      __m256 vv[W];
      for (int c = 0; c < W; ++c) vv[c] = load8(vrow + 8 * c);
      for (int h = 0; h < NH; ++h) {
        const __m256 weight = _mm256_set1_ps(scores[(h0 + h) * stride + i]);
        for (int c = 0; c < W; ++c) acc[h][c] = _mm256_fmadd_ps(weight, vv[c], acc[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(out + (h0 + h) * C * 16 + 8 * (c0 + c), acc[h][c]);
  }
}

// As many heads per pass as the 16 registers hold beside their columns: one head takes a whole
// row per pass; more share narrower passes, so a long context's V rows are read once for all
// the part's heads (one head at a time re-read them from L3 for every head).
template <int C, typename T>
void values_of(const float* scores, int64_t stride, const T* v, int64_t row_stride, const int64_t* slots,
               int64_t keys, int64_t heads, float* out) {
  int64_t h0 = 0;
  for (; h0 + 4 <= heads; h0 += 4) value_passes<C, 4, 2>(scores, stride, v, row_stride, slots, keys, h0, out);
  switch (heads - h0) {
    case 3: value_passes<C, 3, 2>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    case 2: value_passes<C, 2, 4>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    case 1: value_passes<C, 1, 8>(scores, stride, v, row_stride, slots, keys, h0, out); break;
    default: break;
  }
}
#define TREE_ATTENTION_VECTOR 1
#endif

using Buffer = specserve::AlignedVector<float>;  // fp32 scratch (see scratch.h)

// n values of T as fp32 (an item's query rows, or one K or V row on the portable path): the
// values themselves for fp32, else widened (exactly) into `staged`.
template <typename T>
const float* as_float(const T* rows, int64_t n, Buffer& staged) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    staged.resize(n);
    for (int64_t i = 0; i < n; ++i) staged[i] = static_cast<float>(rows[i]);
    return staged.data();
  }
}

// scores[h * stride + i] = scale * (head h's query . key row i), for `keys` rows at `slots` of
// `row_stride`: the vector path for head sizes it has, else the same sums in portable loops.
template <typename T>
void head_scores(int64_t D, const float* q, const T* k, int64_t row_stride, const int64_t* slots, int64_t keys,
                 int64_t heads, float scale, float* scores, int64_t stride, Buffer& staged_row) {
#if defined(TREE_ATTENTION_VECTOR)
  if (D == 64) return scores_of<4>(q, k, row_stride, slots, keys, heads, scale, scores, stride);
  if (D == 128) return scores_of<8>(q, k, row_stride, slots, keys, heads, scale, scores, stride);
#endif
  for (int64_t i = 0; i < keys; ++i) {
    const float* krow = as_float(k + slots[i] * row_stride, D, staged_row);
    for (int64_t h = 0; h < heads; ++h) scores[h * stride + i] = specserve::fixed_order_dot(q + h * D, krow, D) * scale;
  }
}

// out[h] += sum over the `keys` rows, in order, of head h's weight times the value row: what
// `out` holds comes first in every lane's sum (zeros, or the rows before), so rows taken a run
// at a time give the sums of all at once.
template <typename T>
void head_values(int64_t D, const float* scores, int64_t stride, const T* v, int64_t row_stride,
                 const int64_t* slots, int64_t keys, int64_t heads, float* out, Buffer& staged_row) {
#if defined(TREE_ATTENTION_VECTOR)
  if (D == 64) return values_of<4>(scores, stride, v, row_stride, slots, keys, heads, out);
  if (D == 128) return values_of<8>(scores, stride, v, row_stride, slots, keys, heads, out);
#endif
  for (int64_t i = 0; i < keys; ++i) {
    const float* vrow = as_float(v + slots[i] * row_stride, D, staged_row);
    for (int64_t h = 0; h < heads; ++h) {
      const float weight = scores[h * stride + i];
      float* orow = out + h * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = std::fma(weight, vrow[d], orow[d]);
    }
  }
}

// Rows of an int8 cache widened at a time (16 KiB of fp32 for heads of 64), and their slots in
// the staging buffer: 0, 1, ...
constexpr int64_t kStagedRows = 64;
constexpr auto kInOrder = [] {
  std::array<int64_t, kStagedRows> slots{};
  for (int64_t i = 0; i < kStagedRows; ++i) slots[i] = i;
  return slots;
}();
const int64_t* const in_order = kInOrder.data();

// The largest of n scores, eight lanes at a time (a maximum does not depend on the order it is
// taken in; one running maximum waited on every compare).
inline float largest(const float* s, int64_t n) {
  float lanes[8];
  std::fill(lanes, lanes + 8, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] = std::max(lanes[j], s[i + j]);
  for (; i < n; ++i) lanes[0] = std::max(lanes[0], s[i]);
  return *std::max_element(lanes, lanes + 8);
}

// totals[h] += scores of head h over keys [0, n) in key order, for NH heads side by side: each
// waits on its own adds only (one head at a time waited on every add).
template <int NH>
inline void key_order_sums(const float* scores, int64_t stride, int64_t n, float* totals) {
  float t[NH];
  for (int h = 0; h < NH; ++h) t[h] = totals[h];
  for (int64_t i = 0; i < n; ++i)
    for (int h = 0; h < NH; ++h) t[h] += scores[h * stride + i];
  for (int h = 0; h < NH; ++h) totals[h] = t[h];
}

inline void key_order_sums(const float* scores, int64_t stride, int64_t n, int64_t heads, float* totals) {
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) key_order_sums<4>(scores + h * stride, stride, n, totals + h);
  switch (heads - h) {
    case 3: key_order_sums<3>(scores + h * stride, stride, n, totals + h); break;
    case 2: key_order_sums<2>(scores + h * stride, stride, n, totals + h); break;
    case 1: key_order_sums<1>(scores + h * stride, stride, n, totals + h); break;
    default: break;
  }
}

// The work items [bounds[r], bounds[r + 1]) of each of `ranges` threads: contiguous runs of about
// equal work, a token's items costing its visible keys (at most its context and nodes so far)
// plus a fixed share. Even runs of items gave the thread with a prompt's later rows most of the
// work: 3/4 of a fresh 1024-token prompt's. Which thread runs an item never changes its result.
constexpr int64_t kItemKeys = 32;  // an item's fixed cost (its slots, softmax, output), in keys

std::vector<int64_t> balanced_ranges(const int64_t* starts, const int64_t* context, const std::vector<int64_t>& request,
                                     int64_t items_per_token, int64_t ranges) {
  const int64_t tokens = static_cast<int64_t>(request.size());
  thread_local std::vector<int64_t> until;  // the cost of tokens [0, t)
  until.assign(tokens + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = request[t];
    until[t + 1] = until[t] + context[b] + (t - starts[b]) + 1 + kItemKeys;
  }
  std::vector<int64_t> bounds(ranges + 1, tokens * items_per_token);
  bounds[0] = 0;
  int64_t t = 0;
  for (int64_t r = 1; r < ranges; ++r) {
    // Range r starts at the first item whose work starts at or after r / ranges of the total
    // (items of one token cost alike, each 1 / items_per_token of it).
    const double target = static_cast<double>(until[tokens]) * r / ranges;
    while (t < tokens && until[t + 1] <= target) ++t;
    int64_t item = t * items_per_token;
    if (t < tokens) {
      const double share = (target - until[t]) / static_cast<double>(until[t + 1] - until[t]);
      item += std::min(items_per_token, static_cast<int64_t>(std::ceil(share * items_per_token)));
    }
    bounds[r] = std::max(bounds[r - 1], std::min(item, tokens * items_per_token));
  }
  return bounds;
}

// A thread's buffers, kept from call to call (moved out for the call and back: a thread_local
// used in place made every push to it a store and a load, 4-8% of a 1024-token prompt's time):
// made afresh per call, they cost ~25 allocations per layer (a token's visible slots grew a push
// at a time; cpu_attention.py --against on Zen 4: 16 fp32 decodes over 512 keys 0.57x the time
// with them kept, an 8-node tree 0.93x). Every use sizes or refills them first.
struct Scratch {
  std::vector<int64_t> slots;  // the visible keys of token `slots_of`, shared by its items
  Buffer scores;  // [heads of the part][keys + kExpPad]
  Buffer staged_q, staged_row, sums;  // fp32 copies where T is not fp32
  Buffer totals;  // each head's sum of its softmax weights
  Buffer staged_kv;  // int8 caches: a run of the item's visible K (then V) rows in fp32
};

// T: the queries' (and output's) type; C: the caches' (fp32, bf16, or int8 rows with their scales).
template <typename T, typename C>
void attend(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& starts,
            const at::Tensor& ctx, const at::Tensor& tables, const at::Tensor& mask, float scale, at::Tensor& out) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t tokens = qc.size(0), Hq = qc.size(1), D = qc.size(2);
  const int64_t block_size = kc.size(1), Hkv = kc.size(2), W = kc.size(3);  // W: a cache row's elements
  const int64_t B = ctx.size(0), max_blocks = tables.size(1), max_n = mask.size(1);
  const int64_t group = Hq / Hkv;
  const T* qp = qc.data_ptr<T>();
  const C* kp = kc.data_ptr<C>();
  const C* vp = vc.data_ptr<C>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();

  // The request of each flat token (tokens of request b are [start[b], start[b + 1])).
  // Kept from call to call (see Scratch), and read through a reference: inside the items' lambda
  // a thread_local's own name would be the running thread's copy.
  thread_local std::vector<int64_t> requests;
  std::vector<int64_t>& request = requests;
  request.resize(tokens);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = sp[b]; t < sp[b + 1]; ++t) request[t] = b;

  // Work items are (token, KV head, part of that head's query group): a K/V row is loaded once
  // for the part's query heads (not once per head) while each head keeps its own sequence of
  // operations, so results do not depend on how heads are grouped. Groups are split into parts
  // only as far as it takes to give every thread work in a one-token step.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min(group, std::max<int64_t>(1, (2 * threads + tokens * Hkv - 1) / (tokens * Hkv)));
  const int64_t per_part = (group + parts - 1) / parts;
  const std::vector<int64_t> bounds = balanced_ranges(sp, cp, request, Hkv * parts, threads);
  at::parallel_for(0, threads, 1, [&](int64_t first_range, int64_t last_range) {
    const int64_t begin = bounds[first_range], end = bounds[last_range];  // ranges side by side: one run
    thread_local Scratch kept;
    Scratch scratch = std::move(kept);  // this thread's buffers as its last call left them
    auto& [slots, scores, staged_q, staged_row, sums, totals, staged_kv] = scratch;
    int64_t slots_of = -1, context_of = -1;  // the token whose keys `slots` holds; the request of its context part
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / (Hkv * parts), kv_head = item / parts % Hkv, part = item % parts;
      const int64_t first = kv_head * group + part * per_part;
      const int64_t heads = std::min(per_part, (kv_head + 1) * group - first);
      if (heads <= 0) continue;
      const int64_t b = request[t], node = t - sp[b], context = cp[b];
      if (t != slots_of) {
        // Block by block (no division per key); a request's context slots kept for its next token.
        const int64_t* table = tp + b * max_blocks;
        if (b != context_of) {
          slots.clear();
          for (int64_t p = 0; p < context; p += block_size) {
            const int64_t base = table[p / block_size] * block_size;
            for (int64_t o = 0; o < std::min(block_size, context - p); ++o) slots.push_back(base + o);
          }
          context_of = b;
        }
        slots.resize(context);
        const bool* ancestors = mp + (b * max_n + node) * max_n;
        int64_t block = context / block_size, offset = context % block_size;
        for (int64_t j = 0; j <= node; ++j) {
          if (ancestors[j]) slots.push_back(table[block] * block_size + offset);
          if (++offset == block_size) offset = 0, ++block;
        }
        slots_of = t;
      }
      const int64_t keys = static_cast<int64_t>(slots.size()), stride = keys + specserve::kExpPad;
      scores.resize(heads * stride);
      const float* qrows = as_float(qp + (t * Hq + first) * D, heads * D, staged_q);
      // The K (then V) rows the item reads: in the cache (fp32, bf16), or (int8) widened into fp32
      // kStagedRows at a time (a buffer that stays in L1, where a whole long context's did not),
      // which the fp32 paths then read unchanged at the slots `in_order`.
      auto over_rows = [&](const C* cache, auto&& run) {
        if constexpr (kInt8) {
          for (int64_t i0 = 0; i0 < keys; i0 += kStagedRows) {
            const int64_t n = std::min(kStagedRows, keys - i0);
            staged_kv.resize(n * D);
            specserve::dequantize_kv_rows(cache + kv_head * W, Hkv * W, slots.data() + i0, n, D, staged_kv.data());
            run(staged_kv.data(), D, in_order, i0, n);
          }
        } else {
          run(cache + kv_head * D, Hkv * W, slots.data(), 0, keys);
        }
      };
      over_rows(kp, [&](const auto* rows, int64_t row_stride, const int64_t* key_slots, int64_t i0, int64_t n) {
        head_scores(D, qrows, rows, row_stride, key_slots, n, heads, scale, scores.data() + i0, stride, staged_row);
      });
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * stride;
        const float best = largest(s, keys);
        for (int64_t i = 0; i < keys; ++i) s[i] -= best;
        specserve::exp_in_place(s, keys);
      }
      T* out_rows = op + (t * Hq + first) * D;
      float* orows;
      if constexpr (std::is_same_v<T, float>) {
        orows = out_rows;
      } else {
        sums.resize(heads * D);
        orows = sums.data();
      }
      std::fill(orows, orows + heads * D, 0.f);
      over_rows(vp, [&](const auto* rows, int64_t row_stride, const int64_t* key_slots, int64_t i0, int64_t n) {
        head_values(D, scores.data() + i0, stride, rows, row_stride, key_slots, n, heads, orows, staged_row);
      });
      totals.assign(heads, 0.f);
      key_order_sums(scores.data(), stride, keys, heads, totals.data());
      for (int64_t h = 0; h < heads; ++h) {
        const float inverse = 1.f / totals[h];
        for (int64_t d = 0; d < D; ++d) out_rows[h * D + d] = static_cast<T>(orows[h * D + d] * inverse);
      }
    }
    kept = std::move(scratch);
  });
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                          const at::Tensor& block_tables, const at::Tensor& ancestor_mask, double scale) {
  const auto dtype = q.scalar_type(), kind = k_cache.scalar_type();
  const bool int8 = kind == at::kChar;
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  (kind == at::kFloat || kind == at::kBFloat16 || int8) && v_cache.scalar_type() == kind,
              "tree_attention: float32 or bfloat16 queries over float32, bfloat16 or int8 caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "tree_attention: q [T, Hq, D] and caches [blocks, block_size, Hkv, D] (int8: D + a scale byte per 32)");
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (int8 ? specserve::kv_scale_groups(q.size(2)) : 0) &&
                  q.size(1) % k_cache.size(2) == 0,
              "tree_attention: head sizes do not fit");
  const at::Tensor qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor starts = query_start_loc.to(at::kLong).contiguous(), ctx = context_lens.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor mask = ancestor_mask.to(at::kBool).contiguous();
  at::Tensor out = at::empty_like(qc);
  const float fscale = static_cast<float>(scale);
  auto over = [&](auto query) {  // the cache's element type, for queries of decltype(query)
    using T = decltype(query);
    if (int8)
      attend<T, int8_t>(qc, kc, vc, starts, ctx, tables, mask, fscale, out);
    else if (kind == at::kFloat)
      attend<T, float>(qc, kc, vc, starts, ctx, tables, mask, fscale, out);
    else
      attend<T, BFloat16>(qc, kc, vc, starts, ctx, tables, mask, fscale, out);
  };
  if (dtype == at::kFloat)
    over(float{});
  else
    over(BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor context_lens, "
        "Tensor block_tables, Tensor ancestor_mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
