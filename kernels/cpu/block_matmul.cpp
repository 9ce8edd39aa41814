// y = x W^T for W held in GGUF-style blocks: unsigned codes q with one scale and one minimum
// per group of 16 or 32 inputs, w = scale * q + min (Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 all map
// onto this). Activations are quantized to int8 per block of 32 (one scale each, as llama.cpp's
// Q8_1), so each group's dot product is exact integer arithmetic (VNNI or AVX2 maddubs).
//
// Why a kernel of our own: torch's int4/int8 weight-only CPU kernels cost 3-5x more for 8 rows
// than for one, so a verification tree costs several tokens. Here one weight group is unpacked
// once and used for every row while it sits in registers: the step reads the weights once.
//
// Every output element is computed by the same sequence of operations whatever the number of
// rows, the tile it falls in or the thread that runs it: a row's result never depends on the
// other rows of the step (what speculative verification needs to be exact).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "int8_rows.h"
#include "scratch.h"
#include "silu.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define SPECSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kActBlock = 32;  // activation quantization block (one int8 scale each)

// The int8 activations and their per-block numbers, in the calling thread's scratch (scratch.h),
// read through raw pointers, valid until that thread quantizes again: a decode makes a hundred
// small matmuls a step, and allocations and tensor accessors added up.
struct Activations {
  int64_t M, K;
  int8_t* q;      // [M, K]
  float* scale;   // [M, K / 32]
  float* sums;    // [M, K / group]: scale * sum(q) over each weight group
  float* lanes;   // [M, K / 4]: each block's scale once per int32 lane (512-bit path), or nullptr
};

// `lanes`: also fill `Activations::lanes` (the untiled 512-bit path's; the tiles never read it).
Activations quantize_activations(const at::Tensor& x, int64_t group, bool lanes) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t scales = M * (K / kActBlock), sums = M * (K / group), lane_count = lanes ? M * (K / 4) : 0;
  const int64_t floats = scales + sums + lane_count;
  thread_local specserve::AlignedVector<float> storage;
  storage.resize(floats + (M * K + 3) / 4);
  float* f = storage.data();
  Activations a{M, K, reinterpret_cast<int8_t*>(f + floats), f, f + scales, lanes ? f + scales + sums : nullptr};
  float* lp = a.lanes;
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q;
  float* sp = a.scale;
  float* sump = a.sums;
  // Rows split across threads beyond 8 (the other thread waited while one quantized a prompt
  // chunk's hundreds, or a 9-node tree's rows: such SmolLM2 steps take 0.94-0.99x the time,
  // in-process A/B on Zen 4); each row's codes are its own, whichever thread makes them.
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < K / kActBlock; ++b) {
        int32_t halves[2];  // the block's code sums, inputs 0-15 and 16-31
        const float d = specserve::quantize_int8_sums16(xp + m * K + b * kActBlock, kActBlock, qp + m * K + b * kActBlock,
                                                        halves);
        sp[m * (K / kActBlock) + b] = d;
        if (lp != nullptr)
          for (int j = 0; j < kActBlock / 4; ++j) lp[m * (K / 4) + b * (kActBlock / 4) + j] = d;
        float* block_sums = sump + m * (K / group) + b * (kActBlock / group);
        if (group == kActBlock) {
          block_sums[0] = d * static_cast<float>(halves[0] + halves[1]);
        } else {  // groups of 16
          block_sums[0] = d * static_cast<float>(halves[0]);
          block_sums[1] = d * static_cast<float>(halves[1]);
        }
      }
    }
  });
  return a;
}

#if defined(__AVX2__)

// 32 weight codes of one 32-input span, as unsigned bytes in input order.
template <int Bits>
inline __m256i load_codes(const uint8_t* codes) {
  if constexpr (Bits == 4) {  // 16 bytes: low nibbles are inputs 0-15, high nibbles 16-31
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(hi, lo);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  }
}

// Eight int32 lanes, lane i the sum of four products of inputs 4i..4i+3 (exact).
template <int Bits>
inline __m256i dot_span(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  if constexpr (Bits <= 6) {  // products fit maddubs' saturating int16 pairs: 63 * 127 * 2 < 32767
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  } else {
    // 8-bit codes could saturate maddubs: widen to int16 first, then pair sums, then fold the
    // pairs so that each lane covers inputs 4i..4i+3 as in the VNNI path.
    const __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
    const __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
    const __m256i x_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x));
    const __m256i x_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
    const __m256i p_lo = _mm256_madd_epi16(w_lo, x_lo);  // pairs of inputs 0-15
    const __m256i p_hi = _mm256_madd_epi16(w_hi, x_hi);  // pairs of inputs 16-31
    const __m256i s = _mm256_hadd_epi32(p_lo, p_hi);     // quads, lanes interleaved per 128 bits
    return _mm256_permute4x64_epi64(s, 0xD8);            // quads in input order
  }
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, R) of one output: R accumulators share each unpacked weight span.
template <int Bits, int Group, int R>
void output_rows(const uint8_t* codes, const float* scale, const float* min, const int8_t* xq,
                 const float* xscale, const float* xsums, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t kCodeBytes = Bits == 4 ? 16 : 32;  // bytes per 32 inputs
  const int64_t spans = K / 32, groups = K / Group;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < spans; ++s) {
    const __m256i w = load_codes<Bits>(codes + s * kCodeBytes);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + s * 32));
      const float xs = xscale[r * spans + s];
      __m256 factor;
      if constexpr (Group == 32) {
        factor = _mm256_set1_ps(scale[s] * xs);
      } else {  // two groups of 16: lanes 0-3 and 4-7
        factor = _mm256_set_m128(_mm_set1_ps(scale[2 * s + 1] * xs), _mm_set1_ps(scale[2 * s] * xs));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_span<Bits>(w, x)), factor, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // The minimums' share: sum over groups of min * (activation scale * sum of codes).
    __m256 macc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      macc = _mm256_fmadd_ps(_mm256_loadu_ps(min + g), _mm256_loadu_ps(xsums + r * groups + g), macc);
    float tail = 0.f;
    for (; g < groups; ++g) tail = std::fma(min[g], xsums[r * groups + g], tail);
    y[r * ldy] = hsum(acc[r]) + (hsum(macc) + tail);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kWide = true;

template <int Bits>
inline __m512i load_codes2(const uint8_t* codes) {  // two spans: 64 codes in input order
  if constexpr (Bits == 4) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
    // lanes: [lo0 | lo1 | hi0 | hi1] (16 bytes each) -> [lo0 | hi0 | lo1 | hi1]
    return _mm512_and_si512(_mm512_shuffle_i64x2(both, both, 0xD8), mask);
  } else {
    return _mm512_loadu_si512(codes);
  }
}

// The weights' scales once per int32 lane of two spans.
template <int Group>
inline __m512 scale_lanes2(const float* scale, int64_t s) {
  if constexpr (Group == 32) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(scale + s))));
  } else {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(scale + 2 * s)));
  }
}

template <int Bits, int Group, int R>
void output_rows_wide(const uint8_t* codes, const float* scale, const float* min, const int8_t* xq,
                      const float* xlanes, const float* xsums, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t kCodeBytes = Bits == 4 ? 16 : 32;
  const int64_t spans = K / 32, groups = K / Group;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; s += 2) {
    const __m512i w = load_codes2<Bits>(codes + s * kCodeBytes);
    const __m512 ws = scale_lanes2<Group>(scale, s);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xq + r * K + s * 32);
      const __m512 factor = _mm512_mul_ps(ws, _mm512_loadu_ps(xlanes + r * (K / 4) + s * 8));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), factor, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // The minimums' share (sum over groups of min * activation sums) joins the same lanes, the
    // last partial vector masked: one reduction per output, no scalar tail.
    __m512 total = acc[r];
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 live = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, min + g), _mm512_maskz_loadu_ps(live, xsums + r * groups + g),
                              total);
    }
    y[r * ldy] = _mm512_reduce_add_ps(total);
  }
}
// Two neighbouring outputs at once: each row's activations and scales are loaded once for both.
// Every output's arithmetic is output_rows_wide's, step for step (the same bits either way).
template <int Bits, int Group, int R>
void output_pair_rows_wide(const uint8_t* codes, int64_t code_row, const float* scale, const float* min,
                           const int8_t* xq, const float* xlanes, const float* xsums, int64_t K, float* y,
                           int64_t ldy) {
  constexpr int64_t kCodeBytes = Bits == 4 ? 16 : 32;
  const int64_t spans = K / 32, groups = K / Group;
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; s += 2) {
    const __m512i w0 = load_codes2<Bits>(codes + s * kCodeBytes);
    const __m512i w1 = load_codes2<Bits>(codes + code_row + s * kCodeBytes);
    const __m512 ws0 = scale_lanes2<Group>(scale, s);
    const __m512 ws1 = scale_lanes2<Group>(scale + groups, s);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xq + r * K + s * 32);
      const __m512 xl = _mm512_loadu_ps(xlanes + r * (K / 4) + s * 8);
      const __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x);
      const __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x);
      acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(ws0, xl), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(ws1, xl), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 total0 = acc0[r], total1 = acc1[r];
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 live = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      const __m512 sums = _mm512_maskz_loadu_ps(live, xsums + r * groups + g);
      total0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, min + g), sums, total0);
      total1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, min + groups + g), sums, total1);
    }
    y[r * ldy] = _mm512_reduce_add_ps(total0);
    y[r * ldy + 1] = _mm512_reduce_add_ps(total1);
  }
}
#else
constexpr bool kWide = false;
template <int Bits, int Group, int R>
void output_rows_wide(const uint8_t*, const float*, const float*, const int8_t*, const float*, const float*,
                      int64_t, float*, int64_t) {}
template <int Bits, int Group, int R>
void output_pair_rows_wide(const uint8_t*, int64_t, const float*, const float*, const int8_t*, const float*,
                           const float*, int64_t, float*, int64_t) {}
#endif

#else  // portable fallback with the same arithmetic structure (eight lanes, then the minimums)

template <int Bits, int Group, int R>
void output_rows(const uint8_t* codes, const float* scale, const float* min, const int8_t* xq,
                 const float* xscale, const float* xsums, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t kCodeBytes = Bits == 4 ? 16 : 32;
  const int64_t spans = K / 32, groups = K / Group;
  for (int r = 0; r < R; ++r) {
    float acc[8] = {0};
    for (int64_t s = 0; s < spans; ++s) {
      uint8_t w[32];
      const uint8_t* c = codes + s * kCodeBytes;
      for (int j = 0; j < 32; ++j) w[j] = Bits == 4 ? (j < 16 ? c[j] & 0x0F : c[j - 16] >> 4) : c[j];
      const int8_t* x = xq + r * K + s * 32;
      for (int lane = 0; lane < 8; ++lane) {
        int32_t dot = 0;
        for (int j = 4 * lane; j < 4 * lane + 4; ++j) dot += int32_t(w[j]) * int32_t(x[j]);
        const float sc = Group == 32 ? scale[s] : scale[2 * s + lane / 4];
        acc[lane] = std::fma(float(dot), sc * xscale[r * spans + s], acc[lane]);
      }
    }
    float total = 0.f, mins = 0.f;
    for (float a : acc) total += a;
    for (int64_t g = 0; g < groups; ++g) mins = std::fma(min[g], xsums[r * groups + g], mins);
    y[r * ldy] = total + mins;
  }
}

constexpr bool kWide = false;
template <int Bits, int Group, int R>
void output_rows_wide(const uint8_t*, const float*, const float*, const int8_t*, const float*, const float*,
                      int64_t, float*, int64_t) {}
template <int Bits, int Group, int R>
void output_pair_rows_wide(const uint8_t*, int64_t, const float*, const float*, const int8_t*, const float*,
                           const float*, int64_t, float*, int64_t) {}
#endif

// One output, rows [0, R): the 512-bit kernel when the spans pair up, else the 256-bit one.
// The choice depends on K only, so every row of every step takes the same path.
template <int Bits, int Group, int R>
inline void rows_of_output(const uint8_t* codes, const float* scale, const float* min, const Activations& a,
                           int64_t m, int64_t K, float* y, int64_t ldy) {
  const int64_t spans = K / 32, groups = K / Group;
  const int8_t* xq = a.q + m * K;
  const float* xsums = a.sums + m * groups;
  if (kWide && spans % 2 == 0)
    output_rows_wide<Bits, Group, R>(codes, scale, min, xq, a.lanes + m * (K / 4), xsums, K, y, ldy);
  else
    output_rows<Bits, Group, R>(codes, scale, min, xq, a.scale + m * spans, xsums, K, y, ldy);
}

// Outputs n and n + 1, rows [0, R), through the 512-bit kernel (only when the spans pair up).
template <int Bits, int Group, int R>
inline void rows_of_output_pair(const uint8_t* codes, int64_t code_row, const float* scale, const float* min,
                                const Activations& a, int64_t m, int64_t K, float* y, int64_t ldy) {
  const int64_t groups = K / Group;
  output_pair_rows_wide<Bits, Group, R>(codes, code_row, scale, min, a.q + m * K,
                                        a.lanes + m * (K / 4), a.sums + m * groups,
                                        K, y, ldy);
}

template <int Bits, int Group>
void block_matmul_impl(const Activations& a, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& min, at::Tensor& y) {
  const int64_t M = a.M, K = a.K, N = codes.size(0);
  const int64_t code_row = codes.size(1), groups = K / Group;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = min.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRows = 4;
  // Pairs pay off from two rows on; one row (a decode) streams its weights faster one output at a
  // time. Either way an output gets the same bits, so the choice may depend on the step's rows.
  const bool pairs = kWide && (K / 32) % 2 == 0 && M > 1;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; pairs && n + 2 <= end; n += 2) {
      const uint8_t* c = cp + n * code_row;
      const float* s = sp + n * groups;
      const float* mn = mp + n * groups;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        rows_of_output_pair<Bits, Group, kRows>(c, code_row, s, mn, a, m, K, yp + m * N + n, N);
      const int64_t rest = M - m;
      if (rest == 3) rows_of_output_pair<Bits, Group, 3>(c, code_row, s, mn, a, m, K, yp + m * N + n, N);
      if (rest == 2) rows_of_output_pair<Bits, Group, 2>(c, code_row, s, mn, a, m, K, yp + m * N + n, N);
      if (rest == 1) rows_of_output_pair<Bits, Group, 1>(c, code_row, s, mn, a, m, K, yp + m * N + n, N);
    }
    for (; n < end; ++n) {
      const uint8_t* c = cp + n * code_row;
      const float* s = sp + n * groups;
      const float* mn = mp + n * groups;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) rows_of_output<Bits, Group, kRows>(c, s, mn, a, m, K, yp + m * N + n, N);
      const int64_t rest = M - m;
      if (rest == 3) rows_of_output<Bits, Group, 3>(c, s, mn, a, m, K, yp + m * N + n, N);
      if (rest == 2) rows_of_output<Bits, Group, 2>(c, s, mn, a, m, K, yp + m * N + n, N);
      if (rest == 1) rows_of_output<Bits, Group, 1>(c, s, mn, a, m, K, yp + m * N + n, N);
    }
  });
}

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& min, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_matmul: x must be a 2-D float32 tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2, "block_matmul: codes must be 2-D uint8");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "block_matmul: bits must be 4, 5, 6 or 8");
  TORCH_CHECK(group == 16 || group == 32, "block_matmul: group must be 16 or 32");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 32 == 0, "block_matmul: the input size must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == (bits == 4 ? K / 2 : K), "block_matmul: codes do not fit the input size");
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({N, K / group}) && min.sizes() == scale.sizes() &&
                  scale.scalar_type() == at::kFloat && min.scalar_type() == at::kFloat,
              "block_matmul: scale and min must be float32 [N, K / group]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor cc = codes.contiguous(), sc = scale.contiguous(), mc = min.contiguous();
  const Activations a = quantize_activations(xc, group, true);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  if (bits == 4 && group == 32) block_matmul_impl<4, 32>(a, cc, sc, mc, y);
  else if (bits == 4) block_matmul_impl<4, 16>(a, cc, sc, mc, y);
  // 5- and 6-bit codes take one byte each and cannot saturate maddubs: one path
  else if (bits <= 6 && group == 32) block_matmul_impl<6, 32>(a, cc, sc, mc, y);
  else if (bits <= 6) block_matmul_impl<6, 16>(a, cc, sc, mc, y);
  else if (group == 32) block_matmul_impl<8, 32>(a, cc, sc, mc, y);
  else block_matmul_impl<8, 16>(a, cc, sc, mc, y);
  return y;
}

// The same product over weights repacked in tiles of 16 outputs (`BlockWeight.tiles`): per tile
// and group of 32 inputs, eight 64-byte vectors whose lane o holds output o's codes of inputs
// 4k..4k+3 (4- and 5-bit codes: four vectors, inputs 16 + 4k.. in the high nibbles; 5-bit codes
// then eight 64-bit masks, bit 4o + i of mask k the fifth bit of that code), then the group's 16
// scales and 16 minimums in fp16 (the file's own: exact). A row's four activation bytes are
// broadcast to all lanes, so one dpbusd serves 16 outputs and a group's float work (one convert,
// two multiply-adds) is shared by 16 outputs: about a third of the instructions per row of the
// layout above, which multi-row steps (verification, batched decodes, prefill) need. Lane o of a
// tile sees one fixed sequence of operations, whatever the rows of the step.
constexpr int64_t kTile = 16;
constexpr int64_t kAheadGroups = 16;  // software prefetch distance (4 KiB of 4-bit codes)

template <int Bits>
constexpr int64_t tile_group_bytes() { return Bits == 4 ? 256 : Bits == 5 ? 320 : 512; }

// Rows from m on: their int8 activations, scales and sums per group of 32 (tiles' groups).
struct RowActivations {
  const int8_t* q;
  const float* scale;
  const float* sums;
  static RowActivations of(const Activations& a, int64_t m, int64_t groups) {
    return {a.q + m * groups * 32, a.scale + m * groups,
            a.sums + m * groups};
  }
};

#if defined(__AVX2__)
// Codes, scales and minimums 16 groups ahead (into the next tile at the end of this one): a
// call is too short for the hardware prefetcher to ramp up on its three streams (a sweep of
// SmolLM2's weights in one process: 1 row -3%, 2 rows -6%, 8 rows -13%). Into L2, not L1: the
// rows' activations and sums stay in L1 (AMD EPYC Zen 4, SmolLM2 in-process A/B against L1
// prefetches: 8 rows 0.94-0.95x, one row 0.96-1.00x).
// Always inlined: GCC 12 left the call out of line in both vector paths, found the function free
// of side effects and deleted the call, so the tiles ran without prefetches (restored: SmolLM2's
// decode 7% and 8-node tree 10% faster on AMD EPYC Zen 4, in-process A/B).
template <int Bits>
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* c, const uint16_t* scale, const uint16_t* min,
                                                          int64_t g) {
  for (int line = 0; line < tile_group_bytes<Bits>(); line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(c + kAheadGroups * tile_group_bytes<Bits>() + line), _MM_HINT_T1);
  if (g % 2 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(scale + (g + kAheadGroups) * kTile), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(min + (g + kAheadGroups) * kTile), _MM_HINT_T1);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// One row's float step for a group of 16 outputs (`dot`: its exact int32 sums; the weights'
// scales `ws` and minimums `wm`; the row's activation scale and code sum): the same in every
// 512-bit path (dpbusd or AMX tiles), so that they give the same bits.
inline __m512 add_group_step(__m512 acc, __m512i dot, __m512 ws, __m512 wm, float x_scale, float x_sum) {
  const __m512 factor = _mm512_mul_ps(ws, _mm512_set1_ps(x_scale));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), factor, acc);
  return _mm512_fmadd_ps(wm, _mm512_set1_ps(x_sum), acc);
}

// A group's code vectors k and k + 4 (`c`: the group's bytes in the tile layout) as bytes.
template <int Bits>
inline std::pair<__m512i, __m512i> code_vectors(const uint8_t* c, int k) {
  if constexpr (Bits == 8) return {_mm512_loadu_si512(c + 64 * k), _mm512_loadu_si512(c + 64 * (k + 4))};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i packed = _mm512_loadu_si512(c + 64 * k);
  __m512i w0 = _mm512_and_si512(packed, low4);
  __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
  if constexpr (Bits == 5) {
    const __m512i fifth = _mm512_set1_epi8(0x10);
    const uint64_t* high = reinterpret_cast<const uint64_t*>(c + 256);
    w0 = _mm512_mask_add_epi8(w0, _cvtu64_mask64(high[k]), w0, fifth);
    w1 = _mm512_mask_add_epi8(w1, _cvtu64_mask64(high[k + 4]), w1, fifth);
  }
  return {w0, w1};
}

template <int Bits, int R>
void tile_rows(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, int64_t groups, const Activations& a,
               int64_t m, float* y, int64_t ldy) {
  const int64_t K = groups * 32;
  const auto [xq, xs, xsum] = RowActivations::of(a, m, groups);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * tile_group_bytes<Bits>();
    prefetch_ahead<Bits>(c, scale, min, g);
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kTile)));
    const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(min + g * kTile)));
    // Code vectors k and k + 4 at a time, each used by every row while it is in a register.
    constexpr int kSums = specserve::sums_per_row<R>();
    const int8_t* xg = xq + g * 32;
    __m512i dots[R][kSums];
    for (auto& row : dots) std::fill(row, row + kSums, _mm512_setzero_si512());
    for (int k = 0; k < 4; ++k) {
      const auto [w0, w1] = code_vectors<Bits>(c, k);
      specserve::add_products<R>(dots, 0, w0, xg, K, k);
      specserve::add_products<R>(dots, kSums - 1, w1, xg, K, k + 4);
    }
    for (int r = 0; r < R; ++r)
      acc[r] = add_group_step(acc[r], specserve::row_sum<R>(dots, r), ws, wm, xs[r * groups + g], xsum[r * groups + g]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
// Rows a tile computes at once: eight rows' sums and accumulators, two code vectors and the
// group's scales take 21 of the 32 registers, and an 8-node tree is one pass over the codes
// (SmolLM2's 8-node tree forward 10% faster than six rows with every code vector held).
template <int Bits>
constexpr int tile_row_count() { return 8; }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// The same tiles on AVX2, each 64-byte vector as two halves of 8 outputs. Without dpbusd the
// products go through maddubs (int16 pairs) and are summed as int16 over several vectors before
// one madd widens them: exact while no int16 sum can pass 32767 (4-bit codes: 8 vectors,
// 8 x 2 x 15 x 127 = 30480; 5-bit: 4 vectors; 8-bit codes as two 4-bit halves, 16 x hi + lo).
// The float work per group is the AVX-512 path's, lane for lane: the same bits on both.

// Fifth bits of 32 lane bytes (bits of one half of a mask) as 0x10 where set.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

using specserve::broadcast_word;

template <int Bits, int R>
void tile_rows(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, int64_t groups, const Activations& a,
               int64_t m, float* y, int64_t ldy) {
  const int64_t K = groups * 32;
  const auto [xq, xs, xsum] = RowActivations::of(a, m, groups);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * tile_group_bytes<Bits>();
    prefetch_ahead<Bits>(c, scale, min, g);
    // lo: products of vectors 0-3 (4- and 5-bit) or of the low nibbles (8-bit); hi: the rest.
    // 4-bit codes sum all eight vectors in lo.
    __m256i lo[R][2], hi[R][2];
    for (int r = 0; r < R; ++r) lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = _mm256_setzero_si256();
    const int8_t* xg = xq + g * 32;
    if constexpr (Bits <= 5) {
      for (int k = 0; k < 4; ++k) {
        __m256i wl[2], wh[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * k + 32 * h));
          wl[h] = _mm256_and_si256(packed, low4);
          wh[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
          if constexpr (Bits == 5) {
            const uint32_t* high = reinterpret_cast<const uint32_t*>(c + 256);  // mask k: words 2k, 2k + 1
            wl[h] = _mm256_or_si256(wl[h], fifth_bits(high[2 * k + h]));
            wh[h] = _mm256_or_si256(wh[h], fifth_bits(high[2 * (k + 4) + h]));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xl = broadcast_word(xg + r * K, k), xh = broadcast_word(xg + r * K, k + 4);
          for (int h = 0; h < 2; ++h) {
            const __m256i pl = _mm256_maddubs_epi16(wl[h], xl), ph = _mm256_maddubs_epi16(wh[h], xh);
            if constexpr (Bits == 4) {
              lo[r][h] = _mm256_add_epi16(lo[r][h], _mm256_add_epi16(pl, ph));
            } else {
              lo[r][h] = _mm256_add_epi16(lo[r][h], pl);
              hi[r][h] = _mm256_add_epi16(hi[r][h], ph);
            }
          }
        }
      }
    } else {
      for (int k = 0; k < 8; ++k) {
        __m256i wl[2], wh[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * k + 32 * h));
          wl[h] = _mm256_and_si256(raw, low4);
          wh[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x = broadcast_word(xg + r * K, k);
          for (int h = 0; h < 2; ++h) {
            lo[r][h] = _mm256_add_epi16(lo[r][h], _mm256_maddubs_epi16(wl[h], x));
            hi[r][h] = _mm256_add_epi16(hi[r][h], _mm256_maddubs_epi16(wh[h], x));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * kTile + 8 * h)));
      const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(min + g * kTile + 8 * h)));
      for (int r = 0; r < R; ++r) {
        __m256i dot = _mm256_madd_epi16(lo[r][h], ones);
        if constexpr (Bits == 5) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(hi[r][h], ones));
        if constexpr (Bits == 8) dot = _mm256_add_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(hi[r][h], ones), 4));
        const __m256 factor = _mm256_mul_ps(ws, _mm256_set1_ps(xs[r * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), factor, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xsum[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[r][h]);
}
// Four rows' int16 sums fit the 16 registers beside the codes; two where codes keep two sums.
template <int Bits>
constexpr int tile_row_count() { return Bits == 4 ? 4 : 2; }
#else
template <int Bits>
constexpr int tile_row_count() { return 4; }
template <int Bits, int R>
void tile_rows(const uint8_t* codes, const uint16_t* scale, const uint16_t* min, int64_t groups, const Activations& a,
               int64_t m, float* y, int64_t ldy) {
  const int64_t K = groups * 32;
  const auto half = [](uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); };
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = a.q + (m + r) * K;
    const float* xs = a.scale + (m + r) * groups;
    const float* xsum = a.sums + (m + r) * groups;
    float acc[kTile] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = codes + g * tile_group_bytes<Bits>();
      for (int o = 0; o < kTile; ++o) {
        int32_t dot = 0;
        for (int k = 0; k < 8; ++k)
          for (int i = 0; i < 4; ++i) {
            int32_t q = Bits <= 5 ? (k < 4 ? c[64 * k + 4 * o + i] & 0x0F : c[64 * (k - 4) + 4 * o + i] >> 4)
                                  : c[64 * k + 4 * o + i];
            if (Bits == 5) q |= ((c[256 + 8 * k + (4 * o + i) / 8] >> ((4 * o + i) % 8)) & 1) << 4;
            dot += q * static_cast<int32_t>(xq[g * 32 + 4 * k + i]);
          }
        acc[o] = std::fma(static_cast<float>(dot), half(scale[g * kTile + o]) * xs[g], acc[o]);
        acc[o] = std::fma(half(min[g * kTile + o]), xsum[g], acc[o]);
      }
    }
    for (int o = 0; o < kTile; ++o) y[r * ldy + o] = acc[o];
  }
}
#endif


#if defined(SPECSERVE_AMX)
// AMX (Intel Xeon from Sapphire Rapids): one tile instruction multiplies up to 16 rows' 32 int8
// activations of a group by its 16 outputs' codes, where the VNNI path takes 8 dpbusds per row.
// The group's codes are the B tile as they are (8-bit) or unpacked into a scratch tile (4- and
// 5-bit), the rows' activations the A tile straight from their buffer (stride K), and each
// row's exact int32 sums then take tile_rows' float steps, lane for lane: the same bits as the
// VNNI path, whatever the rows.

// GCC 12's intrinsics tell the compiler that ldtilecfg reads 8 of the config's 64 bytes and that
// tileloadd reads no memory at all, so it dropped the stores feeding them: our own, with the
// memory they read (a store: the int32 rows it writes, an array of 64-byte rows).
// (No "memory" clobber: it made the compiler keep the rows' accumulators on the stack.)
#define SPECSERVE_TILE_LOAD(tile, base, stride)                                                  \
  asm volatile("tileloadd (%1,%2,1), %%tmm" #tile ::"m"(*reinterpret_cast<const char(*)[]>(base)), \
               "r"(base), "r"(static_cast<long>(stride)))
#define SPECSERVE_TILE_STORE(tile, rows) \
  asm volatile("tilestored %%tmm" #tile ", (%1,%2,1)" : "=m"(rows) : "r"(rows), "r"(64L))

// Linux refuses tile instructions to a process that has not asked for the tile state.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

// The tile registers as one thread's calls configure them: A (rows x 32 bytes), B (8 x 64), C
// (rows x 64), twice, so that two groups are in flight. Configured per call and released at the
// end: other libraries in the thread (oneDNN's AMX kernels) configure tiles of their own.
class AmxTiles {
 public:
  ~AmxTiles() {
    if (rows_ > 0) _tile_release();
  }
  // Unpacked codes: the current tile's and the next one's.
  uint8_t* current(int64_t groups) { return buffer(groups, which_); }
  uint8_t* ahead(int64_t groups) { return buffer(groups, 1 - which_); }
  int64_t unpacked_tile() const { return unpacked_; }
  // The tile unpacked ahead (or -1) becomes the current one.
  void unpacked(int64_t tile) {
    unpacked_ = tile;
    if (tile >= 0) which_ = 1 - which_;
  }

  void use(int rows) {
    if (rows == rows_) return;
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes[16] = {};
      uint8_t rows[16] = {};
    } config;
    const auto set = [&](int tile, int r, int bytes) {
      config.bytes[tile] = static_cast<uint16_t>(bytes);
      config.rows[tile] = static_cast<uint8_t>(r);
    };
    for (int t = 0; t < 6; t += 3) {
      set(t, rows, 32);
      set(t + 1, 8, 64);
      set(t + 2, rows, 64);
    }
    static_assert(sizeof(config) == 64);
    asm volatile("ldtilecfg %0" ::"m"(config));
    rows_ = rows;
  }

 private:
  uint8_t* buffer(int64_t groups, int which) {
    thread_local specserve::AlignedVector<uint8_t> both;
    if (static_cast<int64_t>(both.size()) < 2 * groups * 512) both.resize(2 * groups * 512);
    return both.data() + which * groups * 512;
  }
  int rows_ = 0, which_ = 0;
  int64_t unpacked_ = -1;
};

// Rows a tile instruction takes at once, and the fewest for which the tiles beat dpbusd. Per
// group and tile of 16 outputs (Q4_1 in L2, TSC ticks): the tiles ~33 whatever the rows (the
// loads, the product, and a store of ~11 that waits on it) plus ~3 a row for the float steps;
// dpbusd ~12 plus ~5 a row. SmolLM2 steps on Xeon, AMX against VNNI, in-process: 9 rows 1.03x,
// 10 1.02x, 11 0.94x, 12 0.91-0.92x, 16 0.90x, 24 0.90x (earlier, with the accumulators on the
// stack: 12 rows 1.01x, 16 0.94-0.99x, 32 0.89-0.90x, 64 0.84-0.87x).
constexpr int kAmxRows = 16;
constexpr int kAmxMinRows = 11;

// A group's 4- or 5-bit codes as tile_rows' eight vectors of 64 bytes, at `out`.
template <int Bits>
inline void unpack_group(const uint8_t* c, uint8_t* out) {
  for (int k = 0; k < 4; ++k) {
    const auto [w0, w1] = code_vectors<Bits>(c, k);
    _mm512_store_si512(out + 64 * k, w0);
    _mm512_store_si512(out + 64 * (k + 4), w1);
  }
}

// tile_rows' float steps for group g of R rows whose int32 sums are at `dots` (16 per row).
// Inlined and unrolled, as are the loops over `acc` around it: else GCC kept the rows'
// accumulators on the stack, a load and a store per row and group (16 rows of SmolLM2's matmuls
// against dpbusd's in the same process: 0.895x with them on the stack, 0.879x in registers).
template <int R>
__attribute__((always_inline)) inline void add_group(__m512 (&acc)[R], const int32_t* dots, const uint16_t* scale,
                                                     const uint16_t* min, int64_t g, int64_t groups, const float* xs,
                                                     const float* xsum) {
  const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kTile)));
  const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(min + g * kTile)));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    acc[r] = add_group_step(acc[r], _mm512_load_si512(dots + r * kTile), ws, wm, xs[r * groups + g], xsum[r * groups + g]);
}

// Rows [m, m + R) of a tile whose codes are bytes (tile_rows' vectors for every group). Each
// pass of two groups also prefetches the codes `stream` (those the thread reads next) and, where
// `ahead` is given, unpacks the next tile's codes (`next`, 4- or 5-bit) there.
template <int Bits, int R>
void amx_tile_rows(AmxTiles& tiles, const uint8_t* codes, const uint16_t* scale, const uint16_t* min, int64_t groups,
                   const Activations& a, int64_t m, float* y, int64_t ldy, const uint8_t* stream,
                   const uint8_t* next, uint8_t* ahead) {
  const int64_t K = groups * 32;
  const auto [xq, xs, xsum] = RowActivations::of(a, m, groups);
  tiles.use(R);
  alignas(64) int32_t dots[2][R * kTile];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // Always inlined: out of line, GCC found the 8-bit version (prefetches only) free of side
  // effects and deleted its calls.
  const auto alongside = [&](int64_t g) __attribute__((always_inline)) {
    prefetch_ahead<Bits>(stream + g * tile_group_bytes<Bits>(), scale, min, g);
    if constexpr (Bits != 8)
      if (ahead != nullptr) unpack_group<Bits>(next + g * tile_group_bytes<Bits>(), ahead + g * 512);
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    SPECSERVE_TILE_LOAD(1, codes + g * 512, 64);
    SPECSERVE_TILE_LOAD(4, codes + (g + 1) * 512, 64);
    SPECSERVE_TILE_LOAD(0, xq + g * 32, K);
    SPECSERVE_TILE_LOAD(3, xq + (g + 1) * 32, K);
    _tile_zero(2);
    _tile_zero(5);
    _tile_dpbsud(2, 0, 1);
    _tile_dpbsud(5, 3, 4);
    SPECSERVE_TILE_STORE(2, dots[0]);
    SPECSERVE_TILE_STORE(5, dots[1]);
    alongside(g);
    alongside(g + 1);
    add_group<R>(acc, dots[0], scale, min, g, groups, xs, xsum);
    add_group<R>(acc, dots[1], scale, min, g + 1, groups, xs, xsum);
  }
  if (g < groups) {
    SPECSERVE_TILE_LOAD(1, codes + g * 512, 64);
    SPECSERVE_TILE_LOAD(0, xq + g * 32, K);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    SPECSERVE_TILE_STORE(2, dots[0]);
    alongside(g);
    add_group<R>(acc, dots[0], scale, min, g, groups, xs, xsum);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#else
bool amx_granted() { return false; }
struct AmxTiles {};
#endif

// A tiled weight (`tiled_matmul`'s codes, scales and minimums) as its kernels read it.
template <int Bits>
struct Tiles {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* min;
  int64_t count, groups;

  Tiles(const at::Tensor& c, const at::Tensor& s, const at::Tensor& m)
      : codes(c.data_ptr<uint8_t>()), scale(reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>())),
        min(reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>())), count(c.size(0)), groups(c.size(1)) {}

  const uint8_t* tile_codes(int64_t t) const { return codes + t * groups * tile_group_bytes<Bits>(); }

  // Tile t's 16 outputs for every row of `a`, row m's at y + m * ldy; through `amx`'s tile
  // registers where given and the step has the rows for it, `next` the tile the thread takes
  // next (or -1).
  void rows(int64_t t, const Activations& a, float* y, int64_t ldy, AmxTiles* amx, int64_t next = -1) const {
    const uint8_t* c = tile_codes(t);
    const uint16_t* s = scale + t * groups * kTile;
    const uint16_t* mn = min + t * groups * kTile;
#if defined(SPECSERVE_AMX)
    if (amx != nullptr && a.M >= kAmxMinRows) {
      amx_rows(t, s, mn, next, a, y, ldy, *amx);
      return;
    }
#endif
    specserve::for_row_tiles<tile_row_count<Bits>()>(a.M, [&](auto rows, int64_t m) {
      tile_rows<Bits, decltype(rows)::value>(c, s, mn, groups, a, m, y + m * ldy, ldy);
    });
  }

#if defined(SPECSERVE_AMX)
  // 4- and 5-bit codes go to the tile instructions as bytes, unpacked a tile ahead while the
  // tile before runs (a tile load of what vector stores wrote a moment before waits for them
  // to retire, and the unpacking's reads of the codes overlap the arithmetic).
  void amx_rows(int64_t t, const uint16_t* s, const uint16_t* mn, int64_t next, const Activations& a, float* y,
                int64_t ldy, AmxTiles& amx) const {
    const uint8_t* bytes = tile_codes(t);
    uint8_t* ahead = nullptr;
    if constexpr (Bits != 8) {
      if (amx.unpacked_tile() != t)
        for (int64_t g = 0; g < groups; ++g)
          unpack_group<Bits>(tile_codes(t) + g * tile_group_bytes<Bits>(), amx.current(groups) + g * 512);
      bytes = amx.current(groups);
      if (next >= 0) ahead = amx.ahead(groups);
    }
    const uint8_t* next_codes = next >= 0 ? tile_codes(next) : nullptr;
    // the codes read next from memory: the next tile's where they are unpacked ahead
    const uint8_t* stream = ahead != nullptr ? next_codes : tile_codes(t);
    specserve::for_even_row_tiles<kAmxRows>(a.M, [&](auto rows, int64_t m) {
      amx_tile_rows<Bits, decltype(rows)::value>(amx, bytes, s, mn, groups, a, m, y + m * ldy, ldy, stream,
                                                 next_codes, m == 0 ? ahead : nullptr);
    });
    amx.unpacked(ahead != nullptr ? next : -1);
  }
#endif
};

template <int Bits>
void tiled_impl(const Activations& a, const Tiles<Bits>& w, at::Tensor& y) {
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.count, 1, [&](int64_t begin, int64_t end) {
    AmxTiles amx;
    AmxTiles* tiles = amx_granted() ? &amx : nullptr;
    for (int64_t t = begin; t < end; ++t) w.rows(t, a, yp + t * kTile, w.count * kTile, tiles, t + 1 < end ? t + 1 : -1);
  });
}

// SwiGLU over a gate/up projection's tiles (gate's outputs in the first half, up's in the
// second): each thread takes gate tile p with up tile p and writes silu(gate) * up for those 16
// outputs (silu.h), where the separate op read the whole [T, 2 * width] product again, split
// by rows so that half of it came from the other core's cache, after a join of its own.
template <int Bits>
void tiled_swiglu_impl(const Activations& a, const Tiles<Bits>& w, at::Tensor& y) {
  const int64_t M = a.M, pairs = w.count / 2, width = pairs * kTile;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local specserve::AlignedVector<float> both;  // [M][gate's 16 | up's 16]
    both.resize(M * 2 * kTile);
    float* bp = both.data();
    AmxTiles amx;
    AmxTiles* tiles = amx_granted() ? &amx : nullptr;
    for (int64_t p = begin; p < end; ++p) {
      w.rows(p, a, bp, 2 * kTile, tiles, p + pairs);
      w.rows(p + pairs, a, bp + kTile, 2 * kTile, tiles, p + 1 < end ? p + 1 : -1);
      for (int64_t m = 0; m < M; ++m)
        specserve::silu_mul_row(bp + m * 2 * kTile, bp + m * 2 * kTile + kTile, kTile, yp + m * width + p * kTile);
    }
  });
}

// x W^T over tiles (`tiled_matmul`), or with SwiGLU applied to it (`tiled_swiglu`: the gate's
// tiles, then as many of up's).
at::Tensor tiled(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const at::Tensor& min, int64_t bits, bool swiglu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be a 2-D float32 tensor");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, op, ": bits must be 4, 5 or 8 (codes up to 8 bits in bytes)");
  const int64_t K = x.size(1);
  const int64_t group_bytes = bits == 4 ? 256 : bits == 5 ? 320 : 512;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && K % 32 == 0 && codes.size(1) == K / 32 &&
                  codes.size(2) == group_bytes,
              op, ": codes [N / 16, K / 32, ", group_bytes, "] do not fit ", K, " inputs");
  const int64_t tiles = codes.size(0);
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({tiles, K / 32, kTile}) && min.sizes() == scale.sizes() &&
                  scale.scalar_type() == at::kHalf && min.scalar_type() == at::kHalf,
              op, ": scale and min must be float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(!swiglu || tiles % 2 == 0, op, ": gate and up need as many tiles each, got ", tiles, " tiles");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous(), mc = min.contiguous();
  at::Tensor y = at::empty({x.size(0), (swiglu ? tiles / 2 : tiles) * kTile}, x.options());
  if (x.size(0) == 0 || tiles == 0) return y;
  const Activations a = quantize_activations(xc, 32, false);
  auto run = [&](const auto& w) { swiglu ? tiled_swiglu_impl(a, w, y) : tiled_impl(a, w, y); };
  if (bits == 4) run(Tiles<4>(cc, sc, mc));
  else if (bits == 5) run(Tiles<5>(cc, sc, mc));
  else run(Tiles<8>(cc, sc, mc));
  return y;
}

at::Tensor tiled_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                        int64_t bits) {
  return tiled("tiled_matmul", x, codes, scale, min, bits, false);
}

// silu_mul(tiled_matmul(x, ...)) in one op, the same bits: [T, N / 2] for N outputs (gate's, then up's).
at::Tensor tiled_swiglu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& min,
                        int64_t bits) {
  return tiled("tiled_swiglu", x, codes, scale, min, bits, true);
}

// Which instruction path this build took (for logs and benchmark records).
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return amx_granted() ? "avx512-vnni+amx" : "avx512-vnni";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx2+vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("block_matmul(Tensor x, Tensor codes, Tensor scale, Tensor min, int bits, int group) -> Tensor");
  m.def("tiled_matmul(Tensor x, Tensor codes, Tensor scale, Tensor min, int bits) -> Tensor");
  m.def("tiled_swiglu(Tensor x, Tensor codes, Tensor scale, Tensor min, int bits) -> Tensor");
  m.def("isa() -> str");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("block_matmul", &block_matmul);
  m.impl("tiled_matmul", &tiled_matmul);
  m.impl("tiled_swiglu", &tiled_swiglu);
}

TORCH_LIBRARY_IMPL(specserve_cpu, CatchAll, m) { m.impl("isa", &isa); }
