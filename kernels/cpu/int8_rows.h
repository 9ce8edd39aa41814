// What the quantized matmuls share: activations rounded to int8 per block, and steps cut into
// tiles of rows whose sizes are compile-time constants (each row's arithmetic stays its own).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace specserve {

#if defined(__AVX2__)
// Activation word k of a row (its inputs 4k..4k+3) in every int32 lane: what one vector of a tile's
// codes (one output per lane) multiplies.
inline __m256i broadcast_word(const int8_t* x, int k) {
  return _mm256_set1_epi32(reinterpret_cast<const int32_t*>(x)[k]);
}
#endif

// x[0, n) as int8 codes with scale max|x| / 127, rounded to nearest, ties to even (cvtps2dq's
// rounding: the same integers on every CPU); returns the scale.
inline float quantize_int8_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  int64_t j = 0;
#if defined(__AVX2__)
  // The maximum of |x| is the same whatever the order; the scalar loop's fmax was a libm call per
  // input. max_ps(v, m) keeps m where v is NaN, as fmax(amax, NaN) keeps amax.
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float lane : lanes) amax = lane > amax ? lane : amax;
#endif
  for (; j < n; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
  return d;
}

// quantize_int8_block of n inputs (a multiple of 16), and the sum of each 16 inputs' codes
// (`sums16`, n / 16 of them). Sixteen lanes at a time on AVX-512, the sums taken in registers,
// where the loops took about two cycles an input (rounding, then widening bytes to sum them) on
// the thread that a tree's few rows leave the other waiting for: the same maximum (max_ps keeps
// the running value where an input is NaN, as that loop), the same rounding (cvtps2dq: to
// nearest, ties to even, as nearbyint), the same codes (vpmovdb keeps the low byte as the cast
// does; codes are within +-127, a NaN's 0x80000000 becomes 0), summed as those bytes.
inline float quantize_int8_sums16(const float* x, int64_t n, int8_t* q, int32_t* sums16) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 m = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) m = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(x + j), magnitude), m);
  const float d = _mm512_reduce_max_ps(m) / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  for (int64_t j = 0; j < n; j += 16) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(codes));
    sums16[j / 16] = _mm512_reduce_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(codes, 24), 24));
  }
  return d;
#else
  const float d = quantize_int8_block(x, n, q);
  for (int64_t j = 0; j < n; j += 16) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[j + i];
    sums16[j / 16] = sum;
  }
  return d;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The tiled kernels' inner step: each of R rows' products with one code vector (16 outputs' codes
// of inputs 4k..4k+3 per lane, k = `word`) added to the row's sum `slot`. Few rows keep two sums
// each so that dependent dpbusds do not queue; from four rows on, the rows are the independent
// chains. Integer sums: exact in any order, so the split never changes a result.
template <int R>
constexpr int sums_per_row() { return R >= 4 ? 1 : 2; }

template <int R>
inline void add_products(__m512i (*dot)[sums_per_row<R>()], int slot, __m512i w, const int8_t* x, int64_t K, int word) {
  for (int r = 0; r < R; ++r)
    dot[r][slot] = _mm512_dpbusd_epi32(dot[r][slot], w,
                                       _mm512_set1_epi32(reinterpret_cast<const int32_t*>(x + r * K)[word]));
}

template <int R>
inline __m512i row_sum(const __m512i (*dot)[sums_per_row<R>()], int r) {
  return sums_per_row<R>() == 1 ? dot[r][0] : _mm512_add_epi32(dot[r][0], dot[r][sums_per_row<R>() - 1]);
}
#endif

template <int R, typename F>
inline void row_tile_rest(int64_t rest, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (rest == R) f(std::integral_constant<int, R>{}, m);
    else row_tile_rest<R - 1>(rest, m, f);
  }
}

// f(std::integral_constant<int, R>{}, m) for rows [m, m + R): tiles of kRows, then one smaller.
template <int kRows, typename F>
inline void for_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) f(std::integral_constant<int, kRows>{}, m);
  row_tile_rest<kRows - 1>(M - m, m, f);
}

// The same over as few tiles of at most kRows as cover M, their sizes within one of each other
// (24 rows: 12 and 12, not 16 and 8, where a tile's cost barely depends on its rows).
template <int kRows, typename F>
inline void for_even_row_tiles(int64_t M, F&& f) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  int64_t m = 0;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t rows = M / tiles + (i < M % tiles ? 1 : 0);
    row_tile_rest<kRows>(rows, m, f);
    m += rows;
  }
}

}  // namespace specserve
