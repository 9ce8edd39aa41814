// Sums whose order depends only on their length: what keeps a row's result the same whatever
// the other rows of a step are (see tree_attention.cpp, rms_norm.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace specserve {

constexpr int kLanes = 16;  // partial sums, reduced pairwise in a fixed order

inline float fixed_order_dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // The same sums as below, in one register: lane j takes elements j, j + 16, ...
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(live, a + i), _mm512_maskz_loadu_ps(live, b + i), acc, live);
  }
  // pairwise halves: lanes j + 8, then j + 4, j + 2, j + 1, as the portable loop
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
#endif
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::fma(a[d + j], b[d + j], lanes[j]);
  for (int j = 0; d < n; ++d, ++j) lanes[j] = std::fma(a[d], b[d], lanes[j]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

}  // namespace specserve
