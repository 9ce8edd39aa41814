// Sums whose order depends only on their length: what keeps a row's result the same whatever
// the other rows of a step are (see tree_attention.cpp, rms_norm.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace specserve {

constexpr int kLanes = 16;  // partial sums, reduced pairwise in a fixed order

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The 16 lanes' partial sums reduced pairwise: lanes j + 8, then j + 4, j + 2, j + 1, as the
// portable loop of fixed_order_dot.
inline float fixed_order_sum(__m512 acc) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}

// fixed_order_sum of 16 registers at once (`acc[i]`: key i's lanes), lane i of the result key i's:
// the same pairs added in the same order, transposed so that each add serves several keys.
inline __m512 fixed_order_sums16(const __m512* acc) {
  __m512 s8[8];  // keys 2p | 2p + 1 (256 bits each): lanes j + (j + 8)
  for (int p = 0; p < 8; ++p)
    s8[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  __m512 s4[4];  // keys 4p .. 4p + 3 (128 bits each): lanes j + (j + 4)
  for (int p = 0; p < 4; ++p)
    s4[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * p], s8[2 * p + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * p], s8[2 * p + 1], 0xDD));
  __m512 s2[2];  // 128-bit lane l: keys 8p + l (two lanes), then 8p + 4 + l: lanes j + (j + 2)
  for (int p = 0; p < 2; ++p)
    s2[p] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s4[2 * p], s4[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lane l: keys l, 4 + l, 8 + l, 12 + l: lanes 0 + 1
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s1);
}
#elif defined(__AVX2__)
// The same reduction of 16 lanes held as lanes 0-7 and lanes 8-15.
inline float fixed_order_sum(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
#endif

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
  return fixed_order_sum(acc);
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

// exp(x) for x <= 0 (softmax weights), in place over n values of a buffer with room for
// kExpPad - 1 more: every value takes the same instructions, a polynomial (Cephes' expf, about
// 1 ulp) vectorized, so a weight depends on its score alone, not on where it sits in the
// buffer. libm's exp, one call per key, was most of a tree's attention time.
constexpr int64_t kExpPad = 16;

inline float exp_poly(float x) {  // the same steps as the vector paths below, one lane
  x = std::fmax(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  return std::ldexp(y, static_cast<int>(n));
}

inline void exp_in_place(float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(-0.693359375f), c2 = _mm256_set1_ps(2.12194440e-4f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(k, c1, v);
    r = _mm256_fmadd_ps(k, c2, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    // 2^k by building the exponent bits (k >= -126 after the clamp: a normal number)
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = exp_poly(x[i]);
#endif
}

}  // namespace specserve
