// Sums whose order depends only on their length: what keeps a row's result the same whatever
// the other rows of a step are (see tree_attention.cpp, rms_norm.cpp).
#pragma once

#include <cmath>
#include <cstdint>

namespace specserve {

constexpr int kLanes = 16;  // partial sums, reduced pairwise in a fixed order

inline float fixed_order_dot(const float* a, const float* b, int64_t n) {
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
