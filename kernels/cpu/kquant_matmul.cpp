// y = x W^T for W in GGUF's K-quant super-blocks of 256 inputs, kept as the file stores them:
// Q4_K (4-bit codes, 6-bit scale and minimum per 32 inputs, fp16 d and dmin per 256) and Q6_K
// (6-bit codes, int8 scale per 16 inputs, fp16 d per 256), w = d * sc * q - dmin * m and
// w = d * sc * (q - 32). Reading the file's bytes (not an fp32 scale and minimum per group, which
// made a Q6_K weight 1.8x and a Q4_K weight 1.3x larger) is what a bandwidth-bound decode needs.
//
// Activations are quantized to int8 per block of 256 (one scale each, as llama.cpp's Q8_K), so
// the float work per row is one multiply-add per 64 inputs: the weights' scale lanes are built
// once per output and super-block and shared by every row of the step.
//
// Layout (the same on every CPU): 4-bit codes per 128 inputs in 64 bytes, byte j holding input j
// in its low nibble and input j + 64 in its high nibble; Q6_K's two high bits per 128 inputs in
// 32 bytes, byte j holding inputs j, j + 32, j + 64, j + 96 in bits 0-1, 2-3, 4-5, 6-7.
//
// Every output element is computed by the same sequence of operations whatever the number of
// rows, the tile it falls in or the thread that runs it (exact speculative verification).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "int8_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KQ_WIDE 1
#define KQ_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KQ_WIDE 0
#define KQ_AVX2 1
#else
#define KQ_WIDE 0
#define KQ_AVX2 0
#endif

namespace {

constexpr int64_t kSuper = 256;

// The int8 activations and their per-block numbers, in one allocation read through raw pointers.
struct SuperActivations {
  at::Tensor storage;
  int64_t M, K;
  int8_t* q;       // [M, K]
  float* scale;    // [M, K / 256]
  float* sums;     // [M, K / sub]: sum of the int8 codes over each weight sub-block (exact)
  int32_t* pairs;  // [M, K / sub / 2]: those sums as int16 pairs (sub-blocks 2p, 2p + 1), for dpwssd
};

SuperActivations quantize_rows(const at::Tensor& x, int64_t sub) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kSuper;
  const int64_t words = M * blocks + M * (K / sub) + M * (K / sub / 2);  // floats and int32s
  at::Tensor storage = at::empty({words * 4 + M * K}, at::kByte);
  float* f = reinterpret_cast<float*>(storage.data_ptr<uint8_t>());
  SuperActivations a{storage, M, K, reinterpret_cast<int8_t*>(f + words), f, f + M * blocks,
                     reinterpret_cast<int32_t*>(f + M * blocks + M * (K / sub))};
  int32_t* pairs = a.pairs;
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q;
  float* sp = a.scale;
  float* sums = a.sums;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* qb = qp + m * K + b * kSuper;
        int32_t sums16[kSuper / 16], totals[kSuper / 16];
        sp[m * blocks + b] = specserve::quantize_int8_sums16(xp + m * K + b * kSuper, kSuper, qb, sums16);
        for (int64_t s = 0; s < kSuper / sub; ++s) {
          int32_t total = 0;
          for (int64_t j = 0; j < sub / 16; ++j) total += sums16[s * (sub / 16) + j];
          sums[m * (K / sub) + b * (kSuper / sub) + s] = static_cast<float>(total);
          totals[s] = total;
        }
        for (int64_t p = 0; p < kSuper / sub / 2; ++p)  // |sum| <= 32 * 127: fits int16
          pairs[m * (K / sub / 2) + b * (kSuper / sub / 2) + p] =
              static_cast<int32_t>(static_cast<uint16_t>(totals[2 * p]) | (static_cast<uint32_t>(totals[2 * p + 1]) << 16));
      }
    }
  });
  return a;
}

// One super-block of one output, as the kernel needs it: codes of its 256 inputs (natural order),
// the float scale of each sub-block (d * sc, exact) and the minimums' weights per activation sum
// (-dmin * m for Q4_K, -32 * d * sc for Q6_K; exact).
struct Weights {
  const uint8_t* codes;  // [N, K / 2]
  const uint8_t* high;   // [N, K / 4] (Q6_K) or null
  const void* sub_scale; // uint8 [N, K / 32] (Q4_K) or int8 [N, K / 16] (Q6_K)
  const uint8_t* sub_min;// uint8 [N, K / 32] (Q4_K) or null
  const float* d;        // [N, K / 256]
  const float* dmin;     // [N, K / 256] (Q4_K) or null
  int64_t K;
};

template <int Bits>
constexpr int64_t sub_size() { return Bits == 4 ? 32 : 16; }

#if !KQ_WIDE
// The sub-block float scales and minimum weights of super-block b of output n.
template <int Bits>
inline void super_scales(const Weights& w, int64_t n, int64_t b, float* scales, float* mins) {
  constexpr int64_t subs = kSuper / sub_size<Bits>();
  const int64_t blocks = w.K / kSuper;
  const float d = w.d[n * blocks + b];
  if constexpr (Bits == 4) {
    const uint8_t* sc = static_cast<const uint8_t*>(w.sub_scale) + (n * blocks + b) * subs;
    const uint8_t* mn = w.sub_min + (n * blocks + b) * subs;
    const float dmin = w.dmin[n * blocks + b];
    for (int j = 0; j < subs; ++j) {
      scales[j] = d * static_cast<float>(sc[j]);
      mins[j] = -(dmin * static_cast<float>(mn[j]));
    }
  } else {
    const int8_t* sc = static_cast<const int8_t*>(w.sub_scale) + (n * blocks + b) * subs;
    for (int j = 0; j < subs; ++j) {
      scales[j] = d * static_cast<float>(sc[j]);
      mins[j] = -32.f * scales[j];
    }
  }
}
#endif

#if KQ_WIDE

// The four 64-input code vectors of super-block b (inputs 0-63, 64-127, 128-191, 192-255).
template <int Bits>
inline void load_codes(const Weights& w, int64_t n, int64_t b, __m512i* v) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* c = w.codes + n * (w.K / 2) + b * 128;
  for (int half = 0; half < 2; ++half) {
    const __m512i packed = _mm512_loadu_si512(c + 64 * half);
    v[2 * half] = _mm512_and_si512(packed, low4);
    v[2 * half + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
  }
  if constexpr (Bits == 6) {
    const __m512i high2 = _mm512_set1_epi8(0x30);
    // epi16 shifts per 256-bit half: the first 32 inputs' bits to 4-5, the next 32's likewise
    const __m512i up = _mm512_set_epi64(2 | 2ll << 16 | 2ll << 32 | 2ll << 48, 2 | 2ll << 16 | 2ll << 32 | 2ll << 48,
                                        2 | 2ll << 16 | 2ll << 32 | 2ll << 48, 2 | 2ll << 16 | 2ll << 32 | 2ll << 48,
                                        4 | 4ll << 16 | 4ll << 32 | 4ll << 48, 4 | 4ll << 16 | 4ll << 32 | 4ll << 48,
                                        4 | 4ll << 16 | 4ll << 32 | 4ll << 48, 4 | 4ll << 16 | 4ll << 32 | 4ll << 48);
    const __m512i down = _mm512_set_epi64(2 | 2ll << 16 | 2ll << 32 | 2ll << 48, 2 | 2ll << 16 | 2ll << 32 | 2ll << 48,
                                          2 | 2ll << 16 | 2ll << 32 | 2ll << 48, 2 | 2ll << 16 | 2ll << 32 | 2ll << 48,
                                          0, 0, 0, 0);
    const uint8_t* h = w.high + n * (w.K / 4) + b * 64;
    for (int half = 0; half < 2; ++half) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32 * half));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bits), bits, 1);
      v[2 * half] = _mm512_or_si512(v[2 * half], _mm512_and_si512(_mm512_sllv_epi16(both, up), high2));
      v[2 * half + 1] = _mm512_or_si512(v[2 * half + 1], _mm512_and_si512(_mm512_srlv_epi16(both, down), high2));
    }
  }
}

// Scale lanes for the four code vectors of super-block b (dpbusd lane i covers inputs 4i..4i+3)
// and the minimums' weights per activation sum: the values of super_scales, built in registers.
template <int Bits>
inline void scale_lanes(const Weights& w, int64_t n, int64_t b, __m512* lanes, __m512* min_weights) {
  const int64_t blocks = w.K / kSuper;
  const __m512 d = _mm512_set1_ps(w.d[n * blocks + b]);
  if constexpr (Bits == 4) {  // sub-blocks of 32: 8 lanes each, two per vector
    const uint8_t* sc = static_cast<const uint8_t*>(w.sub_scale) + (n * blocks + b) * 8;
    const uint8_t* mn = w.sub_min + (n * blocks + b) * 8;
    const auto widen = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    const __m512 s = _mm512_mul_ps(d, widen(sc));  // lanes 8-15 are zero
    for (int t = 0; t < 4; ++t) {
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * t)),
                                             _mm256_set1_epi32(2 * t + 1), 1);
      lanes[t] = _mm512_permutexvar_ps(idx, s);
    }
    *min_weights = _mm512_mul_ps(_mm512_set1_ps(-w.dmin[n * blocks + b]), widen(mn));
  } else {  // sub-blocks of 16: 4 lanes each, four per vector
    const int8_t* sc = static_cast<const int8_t*>(w.sub_scale) + (n * blocks + b) * 16;
    const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
    for (int t = 0; t < 4; ++t) {
      const __m512i idx = _mm512_set_epi32(4 * t + 3, 4 * t + 3, 4 * t + 3, 4 * t + 3, 4 * t + 2, 4 * t + 2,
                                           4 * t + 2, 4 * t + 2, 4 * t + 1, 4 * t + 1, 4 * t + 1, 4 * t + 1,
                                           4 * t, 4 * t, 4 * t, 4 * t);
      lanes[t] = _mm512_permutexvar_ps(idx, s);
    }
    *min_weights = _mm512_mul_ps(_mm512_set1_ps(-32.f), s);
  }
}

// Rows [0, R) of output n.
template <int Bits, int R>
void output_rows(const Weights& w, int64_t n, const SuperActivations& a, int64_t m, float* y, int64_t ldy) {
  constexpr int64_t sub = sub_size<Bits>(), subs = kSuper / sub;
  constexpr __mmask16 kMinLanes = subs == 16 ? 0xFFFF : 0x00FF;
  const int64_t K = w.K, blocks = K / kSuper;
  const int8_t* xq = a.q + m * K;
  const float* xs = a.scale + m * blocks;
  const float* xsum = a.sums + m * (K / sub);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i codes[4];
    __m512 lanes[4], min_weights;
    load_codes<Bits>(w, n, b, codes);
    scale_lanes<Bits>(w, n, b, lanes, &min_weights);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + b * kSuper;
      __m512 block = _mm512_setzero_ps();
      for (int t = 0; t < 4; ++t) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[t], _mm512_loadu_si512(x + 64 * t));
        block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lanes[t], block);
      }
      const __m512 sums = _mm512_maskz_loadu_ps(kMinLanes, xsum + r * (K / sub) + b * subs);
      block = _mm512_fmadd_ps(min_weights, sums, block);
      acc[r] = _mm512_fmadd_ps(block, _mm512_set1_ps(xs[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}

#else  // portable: the same arithmetic, one sub-block at a time

template <int Bits>
inline int32_t code_at(const Weights& w, int64_t n, int64_t i) {  // i: input index in the row
  const int64_t chunk = i / 128, j = i % 128;
  const uint8_t byte = w.codes[n * (w.K / 2) + chunk * 64 + j % 64];
  int32_t q = j < 64 ? (byte & 0x0F) : (byte >> 4);
  if constexpr (Bits == 6) {
    const uint8_t h = w.high[n * (w.K / 4) + chunk * 32 + j % 32];
    q |= ((h >> (2 * (j / 32))) & 0x03) << 4;
  }
  return q;
}

template <int Bits, int R>
void output_rows(const Weights& w, int64_t n, const SuperActivations& a, int64_t m, float* y, int64_t ldy) {
  constexpr int64_t sub = sub_size<Bits>(), subs = kSuper / sub;
  const int64_t K = w.K, blocks = K / kSuper;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = a.q + (m + r) * K;
    const float* xs = a.scale + (m + r) * blocks;
    const float* xsum = a.sums + (m + r) * (K / sub);
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      float scales[16], mins[16];
      super_scales<Bits>(w, n, b, scales, mins);
      float block = 0.f;
      for (int64_t s = 0; s < subs; ++s) {
        int32_t dot = 0;
        for (int64_t j = 0; j < sub; ++j) {
          const int64_t i = b * kSuper + s * sub + j;
          dot += code_at<Bits>(w, n, i) * static_cast<int32_t>(xq[i]);
        }
        block = std::fma(static_cast<float>(dot), scales[s], block);
      }
      for (int64_t s = 0; s < subs; ++s) block = std::fma(mins[s], xsum[b * subs + s], block);
      acc = std::fma(block, xs[b], acc);
    }
    y[r * ldy] = acc;
  }
}

#endif

template <int Bits>
void kquant_impl(const SuperActivations& a, const Weights& w, int64_t N, at::Tensor& y) {
  const int64_t M = a.M;
  float* yp = y.data_ptr<float>();
  constexpr int kRows = 8;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      specserve::for_row_tiles<kRows>(M, [&](auto rows, int64_t m) {
        output_rows<Bits, decltype(rows)::value>(w, n, a, m, yp + m * N + n, N);
      });
    }
  });
}

// The same product over super-blocks repacked in tiles of 16 outputs (`SuperBlockWeight.tiles`):
// per tile, super-block and 32 inputs, four 64-byte vectors whose lane o holds output o's low code
// bits of inputs 4k..4k+3 (k < 4) and, in the high nibbles, of inputs 16 + 4k.. (Q6_K: then two
// vectors of the top two bits, vector k's in bits 2k..2k+1 of the first for k < 4, of the second
// for k >= 4); then per super-block the sub-scales [subs][16] (and Q4_K's minimums as [4][16][2]
// pairs) in 256 bytes, d [16] and dmin [16]. One dpbusd of a broadcast activation word serves 16 outputs; the
// sub-scales apply in integers; the float work is once per output and super-block. Lane o of a
// tile sees one fixed sequence of operations, whatever the rows of the step.
constexpr int64_t kTile = 16;

template <int Bits>
constexpr int64_t tile_code_bytes() { return Bits == 4 ? 2048 : 3072; }  // per tile and super-block
constexpr int64_t kTileScaleBytes = 256;  // per tile and super-block: sub-scales (+ Q4_K's minimums)

#if KQ_WIDE || KQ_AVX2
// Where the tiles' prefetches put the next codes: L1 for one row (a decode streams, and its
// activations are small), L2 for several, whose activations and sums the L1 must keep (AMD EPYC
// Zen 4, Qwen2.5-Coder-1.5B in-process A/B: 8 rows 0.92-0.95x the time with L1 prefetches; one
// row 0.99-1.05x slower with L2 ones).
template <int R>
constexpr _mm_hint kPrefetchHint = R == 1 ? _MM_HINT_T0 : _MM_HINT_T1;
#endif

#if KQ_WIDE
template <int Bits, int R>
void ktile_rows(const uint8_t* codes, const uint8_t* scales, const float* d, const float* dmin, int64_t blocks,
                const SuperActivations& a, int64_t m, float* y, int64_t ldy, int64_t ahead) {
  constexpr int64_t sub = sub_size<Bits>(), subs = kSuper / sub;
  const int64_t K = blocks * kSuper;
  const int8_t* xq = a.q + m * K;
  const float* xs = a.scale + m * blocks;
  const int32_t* xpairs = a.pairs + m * (K / sub / 2);
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* cb = codes + b * tile_code_bytes<Bits>();
    const uint8_t* sb = scales + b * kTileScaleBytes;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int64_t u = 0; u < kSuper / 32; ++u) {  // 32 inputs: eight code vectors
      const uint8_t* cu = cb + u * (Bits == 4 ? 256 : 384);
      // The next tile's codes, one tile ahead: a step of several rows computes long enough per
      // tile that the hardware prefetcher alone leaves the loads waiting on memory. Into L2
      // where several rows share the tile (see kPrefetchHint).
      for (int line = 0; line < (Bits == 4 ? 4 : 6); ++line)
        _mm_prefetch(reinterpret_cast<const char*>(cu + ahead + 64 * line), kPrefetchHint<R>);
      constexpr int kSums = specserve::sums_per_row<R>();
      const int8_t* xu = xq + b * kSuper + 32 * u;
      __m512i dot[R][kSums];
      if constexpr (Bits == 4) {  // one sub-block of 32: one scale per output
        // Code vectors k and k + 4 (the low and high nibbles of one load) at a time, each used by
        // every row while in a register: eight rows' sums fit beside them.
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * u)));
        for (auto& row : dot) std::fill(row, row + kSums, _mm512_setzero_si512());
        for (int k = 0; k < 4; ++k) {
          const __m512i packed = _mm512_loadu_si512(cu + 64 * k);
          specserve::add_products<R>(dot, 0, _mm512_and_si512(packed, low4), xu, K, k);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          specserve::add_products<R>(dot, kSums - 1, high, xu, K, k + 4);
        }
        for (int r = 0; r < R; ++r)
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(specserve::row_sum<R>(dot, r), sc));
      } else {  // two sub-blocks of 16: vectors 0-3 (low nibbles), then 4-7 (high nibbles)
        const int8_t* s8 = reinterpret_cast<const int8_t*>(sb);
        for (int h = 0; h < 2; ++h) {
          const __m512i sc =
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s8 + 16 * (2 * u + h))));
          const __m512i hb = _mm512_loadu_si512(cu + 256 + 64 * h);  // vector 4h + k's top bits: bits 2k..2k+1
          for (auto& row : dot) std::fill(row, row + kSums, _mm512_setzero_si512());
          for (int k = 0; k < 4; ++k) {
            const __m512i packed = _mm512_loadu_si512(cu + 64 * k);
            const __m512i low = _mm512_and_si512(h == 0 ? packed : _mm512_srli_epi16(packed, 4), low4);
            const __m512i top = k == 0 ? _mm512_slli_epi16(hb, 4) : k == 1 ? _mm512_slli_epi16(hb, 2)
                                : k == 2 ? hb : _mm512_srli_epi16(hb, 2);
            const __m512i w = _mm512_or_si512(low, _mm512_and_si512(top, top2));
            specserve::add_products<R>(dot, k % kSums, w, xu, K, 4 * h + k);
          }
          for (int r = 0; r < R; ++r)
            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(specserve::row_sum<R>(dot, r), sc));
        }
      }
    }
    // The offsets: Q4_K's minimums (-dmin * m * sum), Q6_K's -32 * sc * sum, as int16 pairs
    constexpr int kPairs = subs / 2;
    __m512i off[kPairs];
    for (int p = 0; p < kPairs; ++p) {
      if constexpr (Bits == 4) {  // stored as pairs
        off[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * p)));
      } else {  // the sub-scales of sub-blocks 2p and 2p + 1, interleaved per output
        const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * (2 * p)));
        const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * (2 * p + 1)));
        off[p] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd)));
      }
    }
    const __m512 dv = _mm512_loadu_ps(d + b * kTile);
    for (int r = 0; r < R; ++r) {
      const int32_t* xp = xpairs + r * (K / sub / 2) + b * kPairs;
      __m512i osum = _mm512_setzero_si512();
      for (int p = 0; p < kPairs; ++p) osum = _mm512_dpwssd_epi32(osum, off[p], _mm512_set1_epi32(xp[p]));
      const __m512 x_scale = _mm512_set1_ps(xs[r * blocks + b]);
      if constexpr (Bits == 4) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dv, x_scale), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(osum), _mm512_mul_ps(_mm512_loadu_ps(dmin + b * kTile), x_scale),
                                  acc[r]);
      } else {
        const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(osum, 5));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, x_scale), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
// Rows a tile computes at once: eight rows' sums and accumulators beside one or two code vectors,
// so an 8-node tree is one pass over the codes (Qwen2.5-Coder-1.5B's 8-node tree forward 6%
// faster than six rows with a sub-block's eight code vectors held).
template <int Bits>
constexpr int ktile_row_count() { return 8; }
#elif KQ_AVX2
// The same tiles on AVX2, each 64-byte vector as two halves of 8 outputs, one half after the
// other per super-block (the second reads the codes from L1). maddubs gives int16 pairs, summed
// as int16 while they cannot pass 32767 (Q4_K: a sub-block's 8 vectors, 8 x 2 x 15 x 127 = 30480;
// Q6_K: 2 vectors, 2 x 2 x 63 x 127 = 32004); one madd with the sub-scale in both int16 halves of
// each lane then gives dot x scale in int32, as the AVX-512 path's mullo does. The float work is
// that path's, lane for lane: the same bits on both.

// Eight outputs' sub-scales, each in both int16 halves of its int32 lane (for madd).
template <bool Signed>
inline __m256i paired_scales(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

using specserve::broadcast_word;

// Q6_K's top two bits of code vector k (of four) from their byte vector, at bits 4-5.
inline __m256i top_bits(__m256i hb, int k, __m256i top2) {
  const __m256i moved = k == 0 ? _mm256_slli_epi16(hb, 4) : k == 1 ? _mm256_slli_epi16(hb, 2)
                        : k == 2 ? hb : _mm256_srli_epi16(hb, 2);
  return _mm256_and_si256(moved, top2);
}

template <int Bits, int R>
void ktile_rows(const uint8_t* codes, const uint8_t* scales, const float* d, const float* dmin, int64_t blocks,
                const SuperActivations& a, int64_t m, float* y, int64_t ldy, int64_t ahead) {
  constexpr int64_t sub = sub_size<Bits>(), subs = kSuper / sub, kPairs = subs / 2;
  const int64_t K = blocks * kSuper;
  const int8_t* xq = a.q + m * K;
  const float* xs = a.scale + m * blocks;
  const int32_t* xpairs = a.pairs + m * (K / sub / 2);
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* cb = codes + b * tile_code_bytes<Bits>();
    const uint8_t* sb = scales + b * kTileScaleBytes;
    for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int64_t u = 0; u < kSuper / 32; ++u) {
        const uint8_t* cu = cb + u * (Bits == 4 ? 256 : 384);
        if (h == 0)
          for (int line = 0; line < (Bits == 4 ? 4 : 6); ++line)
            _mm_prefetch(reinterpret_cast<const char*>(cu + ahead + 64 * line), kPrefetchHint<R>);
        const int8_t* xu = xq + b * kSuper + 32 * u;
        if constexpr (Bits == 4) {
          const __m256i sc = paired_scales<false>(sb + 16 * u + 8 * h);
          __m256i s16[R];
          for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cu + 64 * k + 32 * h));
            const __m256i wl = _mm256_and_si256(packed, low4);
            const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            for (int r = 0; r < R; ++r)
              s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(wl, broadcast_word(xu + r * K, k)),
                                                                 _mm256_maddubs_epi16(wh, broadcast_word(xu + r * K, k + 4))));
          }
          for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], sc));
        } else {  // two sub-blocks of 16: vectors 0-3 and 4-7
          const __m256i sc0 = paired_scales<true>(sb + 16 * (2 * u) + 8 * h);
          const __m256i sc1 = paired_scales<true>(sb + 16 * (2 * u + 1) + 8 * h);
          const __m256i hb0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cu + 256 + 32 * h));
          const __m256i hb1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cu + 320 + 32 * h));
          __m256i p0[R], p1[R];
          for (int k = 0; k < 4; ++k) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cu + 64 * k + 32 * h));
            const __m256i wl = _mm256_or_si256(_mm256_and_si256(packed, low4), top_bits(hb0, k, top2));
            const __m256i wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4), top_bits(hb1, k, top2));
            for (int r = 0; r < R; ++r) {
              const __m256i q0 = _mm256_maddubs_epi16(wl, broadcast_word(xu + r * K, k));
              const __m256i q1 = _mm256_maddubs_epi16(wh, broadcast_word(xu + r * K, k + 4));
              if (k % 2 == 0) {
                p0[r] = q0;
                p1[r] = q1;
              } else {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(p0[r], q0), sc0));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(p1[r], q1), sc1));
              }
            }
          }
        }
      }
      // The offsets (Q4_K's minimums, Q6_K's -32 * sc) as int16 pairs, times the activation sums.
      __m256i off[kPairs];
      for (int p = 0; p < kPairs; ++p) {
        if constexpr (Bits == 4) {
          off[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 128 + 32 * p + 16 * h)));
        } else {
          const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * (2 * p)));
          const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * (2 * p + 1)));
          off[p] = _mm256_cvtepi8_epi16(h == 0 ? _mm_unpacklo_epi8(even, odd) : _mm_unpackhi_epi8(even, odd));
        }
      }
      const __m256 dv = _mm256_loadu_ps(d + b * kTile + 8 * h);
      for (int r = 0; r < R; ++r) {
        const int32_t* xp = xpairs + r * (K / sub / 2) + b * kPairs;
        __m256i osum = _mm256_setzero_si256();
        for (int p = 0; p < kPairs; ++p)
          osum = _mm256_add_epi32(osum, _mm256_madd_epi16(off[p], _mm256_set1_epi32(xp[p])));
        const __m256 x_scale = _mm256_set1_ps(xs[r * blocks + b]);
        if constexpr (Bits == 4) {
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dv, x_scale), acc[r][h]);
          acc[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(osum),
                                       _mm256_mul_ps(_mm256_loadu_ps(dmin + b * kTile + 8 * h), x_scale), acc[r][h]);
        } else {
          const __m256i total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(osum, 5));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, x_scale), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[r][h]);
}
// Four rows' sums beside a vector's codes fit the 16 registers; Q6_K keeps two sums a row, and
// three rows measured fastest there (two: 15% slower at 8 rows; four spill: 2x slower).
template <int Bits>
constexpr int ktile_row_count() { return Bits == 4 ? 4 : 3; }
#else
template <int Bits>
constexpr int ktile_row_count() { return 4; }
template <int Bits, int R>
void ktile_rows(const uint8_t* codes, const uint8_t* scales, const float* d, const float* dmin, int64_t blocks,
                const SuperActivations& a, int64_t m, float* y, int64_t ldy, int64_t) {
  constexpr int64_t sub = sub_size<Bits>(), subs = kSuper / sub;
  const int64_t K = blocks * kSuper;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = a.q + (m + r) * K;
    const float* xs = a.scale + (m + r) * blocks;
    const float* xsum = a.sums + (m + r) * (K / sub);
    for (int o = 0; o < kTile; ++o) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* cb = codes + b * tile_code_bytes<Bits>();
        const uint8_t* sb = scales + b * kTileScaleBytes;
        int32_t isum = 0, osum = 0;
        for (int64_t u = 0; u < kSuper / 32; ++u) {
          const uint8_t* cu = cb + u * (Bits == 4 ? 256 : 384);
          for (int k = 0; k < 8; ++k) {
            int32_t dot = 0;
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = cu[64 * (k % 4) + 4 * o + i];
              int32_t q = k < 4 ? (byte & 0x0F) : (byte >> 4);
              if constexpr (Bits == 6) q |= ((cu[256 + 64 * (k / 4) + 4 * o + i] >> (2 * (k % 4))) & 0x03) << 4;
              dot += q * static_cast<int32_t>(xq[b * kSuper + 32 * u + 4 * k + i]);
            }
            const int64_t j = Bits == 4 ? u : 2 * u + k / 4;  // sub-block
            const int32_t sc = Bits == 4 ? sb[16 * j + o] : reinterpret_cast<const int8_t*>(sb)[16 * j + o];
            isum += dot * sc;
          }
        }
        for (int64_t j = 0; j < subs; ++j) {
          const int32_t s = static_cast<int32_t>(xsum[b * subs + j]);
          osum += (Bits == 4 ? sb[128 + 32 * (j / 2) + 2 * o + j % 2] : reinterpret_cast<const int8_t*>(sb)[16 * j + o]) * s;
        }
        const float x_scale = xs[b];
        if constexpr (Bits == 4) {
          acc = std::fma(static_cast<float>(isum), d[b * kTile + o] * x_scale, acc);
          acc = std::fma(-static_cast<float>(osum), dmin[b * kTile + o] * x_scale, acc);
        } else {
          acc = std::fma(static_cast<float>(isum - 32 * osum), d[b * kTile + o] * x_scale, acc);
        }
      }
      y[r * ldy + o] = acc;
    }
  }
}
#endif

template <int Bits>
void ktiled_impl(const SuperActivations& a, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& d,
                 const at::Tensor& dmin, at::Tensor& y) {
  const int64_t M = a.M, tiles = codes.size(0), blocks = codes.size(1), N = tiles * kTile;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* dmp = Bits == 4 ? dmin.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  constexpr int kRows = ktile_row_count<Bits>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = cp + t * blocks * tile_code_bytes<Bits>();
      const uint8_t* s = sp + t * blocks * kTileScaleBytes;
      const float* dt = dp + t * blocks * kTile;
      const float* dmt = Bits == 4 ? dmp + t * blocks * kTile : nullptr;
      float* out = yp + t * kTile;
      const int64_t ahead = t + 1 < end ? blocks * tile_code_bytes<Bits>() : 0;
      specserve::for_row_tiles<kRows>(M, [&](auto rows, int64_t m) {
        ktile_rows<Bits, decltype(rows)::value>(c, s, dt, dmt, blocks, a, m, out + m * N, N, ahead);
      });
    }
  });
}

at::Tensor kquant_tiled_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                               const at::Tensor& d, const at::Tensor& dmin, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "kquant_tiled_matmul: x must be a 2-D float32 tensor");
  TORCH_CHECK(bits == 4 || bits == 6, "kquant_tiled_matmul: bits must be 4 (Q4_K) or 6 (Q6_K)");
  const int64_t K = x.size(1), tiles = codes.size(0), blocks = K / kSuper;
  const int64_t code_bytes = bits == 4 ? tile_code_bytes<4>() : tile_code_bytes<6>();
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && K % kSuper == 0 && codes.size(1) == blocks &&
                  codes.size(2) == code_bytes,
              "kquant_tiled_matmul: codes [N / 16, K / 256, ", code_bytes, "] do not fit ", K, " inputs");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.sizes() == at::IntArrayRef({tiles, blocks, 256}),
              "kquant_tiled_matmul: scales must be uint8 [N / 16, K / 256, 256]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.sizes() == at::IntArrayRef({tiles, blocks, kTile}) &&
                  (bits == 6 || (dmin.scalar_type() == at::kFloat && dmin.sizes() == d.sizes())),
              "kquant_tiled_matmul: d (and Q4_K's dmin) must be float32 [N / 16, K / 256, 16]");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous(), dc = d.contiguous(),
                   dmc = dmin.contiguous();
  at::Tensor y = at::empty({x.size(0), tiles * kTile}, x.options());
  if (x.size(0) == 0 || tiles == 0) return y;
  const SuperActivations a = quantize_rows(xc, bits == 4 ? 32 : 16);
  if (bits == 4) ktiled_impl<4>(a, cc, sc, dc, dmc, y);
  else ktiled_impl<6>(a, cc, sc, dc, dmc, y);
  return y;
}

at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& high,
                         const at::Tensor& sub_scale, const at::Tensor& sub_min, const at::Tensor& d,
                         const at::Tensor& dmin, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "kquant_matmul: x must be a 2-D float32 tensor");
  TORCH_CHECK(bits == 4 || bits == 6, "kquant_matmul: bits must be 4 (Q4_K) or 6 (Q6_K)");
  const int64_t K = x.size(1), N = codes.size(0), sub = bits == 4 ? 32 : 16;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && K % kSuper == 0 && codes.size(1) == K / 2,
              "kquant_matmul: codes [N, K / 2] do not fit ", K, " inputs (K must be a multiple of 256)");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.sizes() == at::IntArrayRef({N, K / kSuper}),
              "kquant_matmul: d must be float32 [N, K / 256]");
  TORCH_CHECK(sub_scale.dim() == 2 && sub_scale.size(0) == N && sub_scale.size(1) == K / sub &&
                  sub_scale.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "kquant_matmul: sub_scale must be uint8 [N, K / 32] (Q4_K) or int8 [N, K / 16] (Q6_K)");
  if (bits == 4) {
    TORCH_CHECK(sub_min.scalar_type() == at::kByte && sub_min.sizes() == sub_scale.sizes() &&
                    dmin.scalar_type() == at::kFloat && dmin.sizes() == d.sizes(),
                "kquant_matmul: Q4_K needs uint8 sub_min [N, K / 32] and float32 dmin [N, K / 256]");
  } else {
    TORCH_CHECK(high.scalar_type() == at::kByte && high.dim() == 2 && high.size(0) == N && high.size(1) == K / 4,
                "kquant_matmul: Q6_K needs uint8 high bits [N, K / 4]");
  }
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), hc = high.contiguous();
  const at::Tensor sc = sub_scale.contiguous(), mc = sub_min.contiguous(), dc = d.contiguous(),
                   dmc = dmin.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const SuperActivations a = quantize_rows(xc, sub);
  const Weights w{cc.data_ptr<uint8_t>(), bits == 6 ? hc.data_ptr<uint8_t>() : nullptr, sc.data_ptr(),
                  bits == 4 ? mc.data_ptr<uint8_t>() : nullptr, dc.data_ptr<float>(),
                  bits == 4 ? dmc.data_ptr<float>() : nullptr, K};
  if (bits == 4) kquant_impl<4>(a, w, N, y);
  else kquant_impl<6>(a, w, N, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("kquant_matmul(Tensor x, Tensor codes, Tensor high, Tensor sub_scale, Tensor sub_min, Tensor d, "
        "Tensor dmin, int bits) -> Tensor");
  m.def("kquant_tiled_matmul(Tensor x, Tensor codes, Tensor scales, Tensor d, Tensor dmin, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("kquant_matmul", &kquant_matmul);
  m.impl("kquant_tiled_matmul", &kquant_tiled_matmul);
}
