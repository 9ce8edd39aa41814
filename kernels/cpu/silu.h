// SwiGLU's silu(gate) * up over a row, shared by its op (activation.cpp) and the gate/up matmul
// that applies it to its own outputs (block_matmul.cpp): one arithmetic, so the same bits.
//
// The same arithmetic as torch's `F.silu(gate) * up` where torch runs its AVX2 code: runs of 16
// inputs as x / (1 + exp(-x)) with SLEEF's AVX2 exp (the one torch's vectorized silu calls), the
// rest of the row with std::exp (torch's scalar tail), then one rounded product with `up`.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

namespace specserve {

#if defined(__AVX2__)
inline void silu_mul8(const float* gate, const float* up, float* out) {
  const __m256 x = _mm256_loadu_ps(gate);
  const __m256 e = Sleef_expf8_u10avx2(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));  // exp(-x)
  const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  _mm256_storeu_ps(out, _mm256_mul_ps(silu, _mm256_loadu_ps(up)));
}
#endif

inline void silu_mul_row(const float* gate, const float* up, int64_t width, float* out) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 16 <= width; i += 16) {  // torch's vectorized loop takes two vectors at a time
    silu_mul8(gate + i, up + i, out + i);
    silu_mul8(gate + i + 8, up + i + 8, out + i + 8);
  }
#endif
  for (; i < width; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

}  // namespace specserve
