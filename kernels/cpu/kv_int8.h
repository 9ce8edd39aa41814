// An int8 KV cache row (one token's K or V for one K/V head): head_dim int8 codes, then one scale
// byte per group of kKvGroup channels (one group when head_dim is not a multiple), as
// kernels/reference.py lays it out (quantize_kv / dequantize_kv, encode_scales / decode_scales).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace specserve {

constexpr int64_t kKvGroup = 32;
constexpr int kScaleExponentBias = 24;

inline int64_t kv_scale_groups(int64_t D) { return D % kKvGroup == 0 ? D / kKvGroup : 1; }

// The head size of rows `W` wide (multiples of 32 first), as reference.head_dim_of.
inline int64_t kv_head_dim_of(int64_t W) { return W % (kKvGroup + 1) == 0 ? W * kKvGroup / (kKvGroup + 1) : W - 1; }

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// A scale byte's fp32 value (5 exponent bits, 3 mantissa bits; 0 is 0), built from its bits.
inline float decode_scale(uint8_t code) {
  if (code == 0) return 0.f;
  const uint32_t bits = static_cast<uint32_t>((code >> 3) - kScaleExponentBias + 127) << 23 |
                        static_cast<uint32_t>(code & 7) << 20;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The smallest scale byte >= `scale` (>= 0), saturating at the largest.
inline uint8_t encode_scale(float scale) {
  if (!(scale > 0.f)) return 0;
  const uint32_t bits = float_bits(scale);
  int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127 + kScaleExponentBias;
  int mantissa = static_cast<int>((bits >> 20) & 7) + ((bits & 0xFFFFF) != 0);
  exponent += mantissa >> 3;
  mantissa &= 7;
  if (exponent < 1) exponent = 1, mantissa = 0;
  if (exponent > 31) exponent = 31, mantissa = 7;
  return static_cast<uint8_t>(exponent * 8 + mantissa);
}

// D values into a row, as the reference quantizes them: per group, scale = the smallest scale byte
// >= max |x| / 127, codes round-half-even(x / scale) within +-127 (the same bits).
inline void quantize_kv_row(const float* x, int64_t D, int8_t* row) {
  const int64_t groups = kv_scale_groups(D), size = D / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * size;
    float amax = 0.f;
    for (int64_t d = 0; d < size; ++d) amax = std::max(amax, std::fabs(xg[d]));
    const uint8_t code = encode_scale(amax / 127.f);
    const float scale = decode_scale(code), safe = scale > 0.f ? scale : 1.f;
    for (int64_t d = 0; d < size; ++d)
      row[g * size + d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xg[d] / safe))));
    row[D + g] = static_cast<int8_t>(code);
  }
}

// A row's D values in fp32: code * scale (exact).
inline void dequantize_kv_row(const int8_t* row, int64_t D, float* out) {
  const int64_t groups = kv_scale_groups(D), size = D / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = decode_scale(static_cast<uint8_t>(row[D + g]));
    for (int64_t d = 0; d < size; ++d) out[g * size + d] = static_cast<float>(row[g * size + d]) * scale;
  }
}

// Every scale byte's value (decode_scale), for widening many rows.
struct ScaleTable {
  float value[256];
  ScaleTable() {
    for (int code = 0; code < 256; ++code) value[code] = decode_scale(static_cast<uint8_t>(code));
  }
};

// dequantize_kv_row for `rows` rows (at `slots` of `row_stride`) into consecutive rows of `out`,
// the same products; on AVX2, eight codes a vector where the head size is a multiple of 32.
// Attention over an int8 cache widens every visible row: row by row, with each scale decoded
// from its bits, that took three times the scores' own time.
inline void dequantize_kv_rows(const int8_t* base, int64_t row_stride, const int64_t* slots, int64_t rows, int64_t D,
                               float* out) {
#if defined(__AVX2__)
  static const ScaleTable table;
  if (D % kKvGroup == 0) {
    const int64_t groups = D / kKvGroup;
    for (int64_t i = 0; i < rows; ++i) {
      const int8_t* row = base + slots[i] * row_stride;
      float* values = out + i * D;
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 factor = _mm256_set1_ps(table.value[static_cast<uint8_t>(row[D + g])]);
        for (int64_t d = g * kKvGroup; d < (g + 1) * kKvGroup; d += 8) {
          const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
          _mm256_storeu_ps(values + d, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), factor));
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < rows; ++i) dequantize_kv_row(base + slots[i] * row_stride, D, out + i * D);
}

}  // namespace specserve
