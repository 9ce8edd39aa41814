// An int8 KV cache row (one token's K or V for one K/V head): head_dim int8 codes, then their
// fp16 scale in two bytes, as kernels/reference.py lays it out (quantize_kv / dequantize_kv).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specserve {

constexpr int64_t kKvScaleBytes = 2;

// D values into a row, as the reference quantizes them: scale fp16(max |x| / 127), codes
// round-half-even(x / scale) within +-127 (the same bits).
inline void quantize_kv_row(const float* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const c10::Half scale(amax / 127.f);
  const float safe = static_cast<float>(scale) > 0.f ? static_cast<float>(scale) : 1.f;
  for (int64_t d = 0; d < D; ++d)
    row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / safe))));
  const uint16_t bits = scale.x;
  std::memcpy(row + D, &bits, sizeof(bits));
}

// A row's D values in fp32, code * scale rounded once (as the reference dequantizes).
inline void dequantize_kv_row(const int8_t* row, int64_t D, float* out) {
  uint16_t bits;
  std::memcpy(&bits, row + D, sizeof(bits));
  const float scale = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(row[d]) * scale;
}

}  // namespace specserve
