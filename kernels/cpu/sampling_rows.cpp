// Per-row passes over a step's logits for sampling and verification (specserve/sampling.py
// defines what they compute; its torch code is the reference they are tested against).
// torch's CPU argmax reads a 49k-token row at a quarter of the speed of its amax, and a
// top-p filter sorts the row: on a 2-core host those were most of a busy step's verification.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "fixed_order.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, name, ": x must be float32 [rows, vocab]");
  TORCH_CHECK(x.size(1) > 0, name, ": empty rows");
}

// The row's max and the first index holding it; a NaN counts as the max (its first one), as in
// torch.argmax. One pass: each lane keeps its max and where it first saw it.
std::tuple<float, int64_t> argmax_row(const float* row, int64_t n) {
  float best = -kInf;
  int64_t at = -1, i = 0;
  bool nan = false;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 lane_best = _mm512_set1_ps(-kInf);
    __m512i lane_at = _mm512_set1_epi32(-1), position = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                          13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 better = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, better, v);
      lane_at = _mm512_mask_mov_epi32(lane_at, better, position);
      position = _mm512_add_epi32(position, step);
    }
    nan = unordered != 0;
    alignas(64) float values[16];
    alignas(64) int32_t where[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(where, lane_at);
    for (int j = 0; j < 16; ++j)  // the largest, then the earliest
      if (where[j] >= 0 && (values[j] > best || (values[j] == best && where[j] < at))) best = values[j], at = where[j];
  }
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(row[i]);
    if (row[i] > best || at < 0) best = row[i], at = i;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(row[j])) return {row[j], j};
  }
  if (best == -kInf) return {best, 0};  // every value -inf: the first, as torch
  return {best, at};
}

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x) {
  check_rows(x, "row_argmax");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor values = at::empty({rows}, x.options());
  at::Tensor indices = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(vp[r], ip[r]) = argmax_row(xp + r * vocab, vocab);
  });
  return {values, indices};
}

// A float's bits as an unsigned key in the float's order (non-NaN values).
inline uint32_t order_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

constexpr float kCutoff = -87.f;  // exp below it is outside float's normal range: counted as 0

// weights[i] = exp(scores[i] - top) (0 below the cutoff, -inf included), into `weights` when
// given; returns their sum. A block at a time through fixed_order.h's vectorised exp.
float weigh(const float* scores, int64_t n, float top, float* weights) {
  constexpr int64_t kBlock = 256;
  alignas(64) float block[kBlock + specserve::kExpPad];
  float lanes[specserve::kLanes] = {0};
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t size = std::min(kBlock, n - start);
    for (int64_t i = 0; i < size; ++i) block[i] = std::max(scores[start + i] - top, kCutoff);
    specserve::exp_in_place(block, size);
    for (int64_t i = 0; i < size; ++i) block[i] = scores[start + i] - top >= kCutoff ? block[i] : 0.f;
    for (int64_t i = size; i % specserve::kLanes; ++i) block[i] = 0.f;  // the last block's padding
    for (int64_t i = 0; i < size; i += specserve::kLanes)
      for (int j = 0; j < specserve::kLanes; ++j) lanes[j] += block[i + j];
    if (weights) std::copy(block, block + size, weights + start);
  }
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

// scores[i] = row[i] / temperature; returns (max, smallest score above -inf, whether any is NaN or +inf).
std::tuple<float, float, bool> scale(const float* row, int64_t n, float temperature, float* scores) {
  float top = -kInf, bottom = kInf;
  bool bad = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(temperature), inf = _mm512_set1_ps(kInf), ninf = _mm512_set1_ps(-kInf);
  __m512 hi = ninf, lo = inf;
  __mmask16 wrong = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 s = _mm512_div_ps(_mm512_loadu_ps(row + i), t);
    _mm512_storeu_ps(scores + i, s);
    wrong |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(s, inf, _CMP_EQ_OQ);
    hi = _mm512_max_ps(hi, s);
    lo = _mm512_mask_min_ps(lo, _mm512_cmp_ps_mask(s, ninf, _CMP_GT_OQ), lo, s);
  }
  top = _mm512_reduce_max_ps(hi);
  bottom = _mm512_reduce_min_ps(lo);
  bad = wrong != 0;
#endif
  for (; i < n; ++i) {
    const float s = row[i] / temperature;
    scores[i] = s;
    bad |= std::isnan(s) || s == kInf;
    top = s > top ? s : top;
    if (s > -kInf && s < bottom) bottom = s;
  }
  return {top, bottom, bad};
}

// The largest key t with `amount(key >= t) >= want` among the candidates (indices into keys):
// a radix select, 11 bits a level (sign, exponent and the top mantissa bits first), each level
// scanning only the bucket the answer is in. With counts (weights null) that is the want-th
// largest key; with weights, the smallest set of largest keys holding `want` of the mass. The
// answer is always some candidate's key.
uint32_t select_key(const uint32_t* keys, const float* weights, std::vector<int32_t>& candidates, double want,
                    std::vector<int32_t>& next) {
  constexpr int kShifts[] = {21, 10, 0};
  constexpr uint32_t kMasks[] = {2047u, 2047u, 1023u};
  uint32_t prefix = 0;
  std::vector<double> amount(2048);
  std::vector<int64_t> members(2048);
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t mask = kMasks[level];
    std::fill(amount.begin(), amount.begin() + mask + 1, 0.0);
    std::fill(members.begin(), members.begin() + mask + 1, 0);
    for (int32_t i : candidates) {
      const uint32_t digit = (keys[i] >> shift) & mask;
      amount[digit] += weights ? weights[i] : 1.0;
      ++members[digit];
    }
    uint32_t bucket = mask;
    double above = 0.0;  // held by the buckets above
    for (; bucket > 0; --bucket) {  // the highest bucket holding a candidate that reaches it
      if (members[bucket] && above + amount[bucket] >= want) break;
      above += amount[bucket];
    }
    want -= above;
    prefix |= bucket << shift;
    if (members[bucket] == static_cast<int64_t>(candidates.size())) continue;  // all in it: nothing to drop
    next.clear();
    for (int32_t i : candidates)
      if (((keys[i] >> shift) & mask) == bucket) next.push_back(i);
    candidates.swap(next);
  }
  return prefix;
}

struct RowFilter {
  float temperature;
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
};

struct Buffers {
  std::vector<float> scores, weights;
  std::vector<uint32_t> keys;
  std::vector<int32_t> candidates, next;
  explicit Buffers(int64_t n) : scores(n), weights(n), keys(n) {
    candidates.reserve(n);
    next.reserve(n);
  }
};

// One row's filtered distribution, as specserve/sampling.py's filter_rows defines it: the
// scores x / temperature, then top-k, top-p and min-p, each keeping the tokens whose score is
// at least a threshold. Returns that threshold (the smallest kept score above -inf), the log
// of the kept tokens' normaliser (p_i = exp(s_i - log_norm) for s_i >= threshold) and whether
// the row is finite (no NaN, no +inf, something left).
std::tuple<float, float, bool> filter_row(const float* row, int64_t n, const RowFilter& f, Buffers& b) {
  float* scores = b.scores.data();
  const auto [top, bottom, bad] = scale(row, n, f.temperature, scores);
  if (bad || top == -kInf) return {kInf, kInf, false};
  const bool top_k = f.top_k > 0 && f.top_k < n, top_p = f.top_p < 1.f, min_p = f.min_p > 0.f;
  if (!top_k && !top_p && !min_p) return {bottom, top + std::log(weigh(scores, n, top, nullptr)), true};
  float* weights = b.weights.data();
  uint32_t* keys = b.keys.data();
  weigh(scores, n, top, weights);
  for (int64_t i = 0; i < n; ++i) keys[i] = order_key(scores[i]);
  uint32_t floor = 0;  // keys below it are filtered out
  if (top_k) {
    b.candidates.resize(n);
    for (int64_t i = 0; i < n; ++i) b.candidates[i] = static_cast<int32_t>(i);
    floor = select_key(keys, nullptr, b.candidates, static_cast<double>(f.top_k), b.next);
  }
  if (top_p) {
    b.candidates.clear();
    double kept = 0.0;
    for (int64_t i = 0; i < n; ++i)
      if (keys[i] >= floor) {
        b.candidates.push_back(static_cast<int32_t>(i));
        kept += weights[i];
      }
    floor = select_key(keys, weights, b.candidates, f.top_p * kept, b.next);  // never below floor: all candidates
  }
  // The smallest kept score, and min-p's floor: probability at least min_p times the likeliest's
  // (whose weight is 1).
  float threshold = kInf;
  for (int64_t i = 0; i < n; ++i)
    if (keys[i] >= floor && (!min_p || weights[i] >= f.min_p) && scores[i] < threshold && scores[i] > -kInf)
      threshold = scores[i];
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += scores[i] >= threshold ? weights[i] : 0.f;
  return {threshold, top + std::log(total), true};
}

void check_params(const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                  const at::Tensor& min_p, int64_t rows) {
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong,
              "filter parameters: float32 temperature, top_p, min_p and int64 top_k");
  TORCH_CHECK(temperature.numel() == rows && top_k.numel() == rows && top_p.numel() == rows &&
                  min_p.numel() == rows,
              "one filter parameter of each kind per row");
}

// filter_row for every row: (threshold, log_norm, finite).
std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_stats(const at::Tensor& x, const at::Tensor& temperature,
                                                            const at::Tensor& top_k, const at::Tensor& top_p,
                                                            const at::Tensor& min_p) {
  check_rows(x, "filter_stats");
  const int64_t rows = x.size(0), vocab = x.size(1);
  check_params(temperature, top_k, top_p, min_p, rows);
  const at::Tensor xc = x.contiguous(), tc = temperature.contiguous(), kc = top_k.contiguous();
  const at::Tensor pc = top_p.contiguous(), mc = min_p.contiguous();
  at::Tensor threshold = at::empty({rows}, x.options()), log_norm = at::empty({rows}, x.options());
  at::Tensor finite = at::empty({rows}, x.options().dtype(at::kBool));
  const float* xp = xc.data_ptr<float>();
  const float *tp = tc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *mp = mc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  float *thp = threshold.data_ptr<float>(), *lp = log_norm.data_ptr<float>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Buffers buffers(vocab);
    for (int64_t r = begin; r < end; ++r)
      std::tie(thp[r], lp[r], fp[r]) = filter_row(xp + r * vocab, vocab, {tp[r], kp[r], pp[r], mp[r]}, buffers);
  });
  return {threshold, log_norm, finite};
}

constexpr int64_t kChunk = 256;  // the inverse CDF finds the chunk first, then the token in it

// One token per selected row, drawn by inverse CDF with its uniform from the filtered
// distribution (threshold and log_norm from filter_stats) without the row's `excluded` tokens
// (-1: none), renormalised; where they held all its mass, from the whole distribution. Tokens
// are taken in vocabulary order, as a cumulative sum and a search would.
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& temperature,
                       const at::Tensor& threshold, const at::Tensor& log_norm, const at::Tensor& excluded,
                       const at::Tensor& uniform) {
  check_rows(x, "sample_rows");
  const int64_t count = rows.numel(), vocab = x.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && excluded.scalar_type() == at::kLong && excluded.dim() == 2 &&
                  excluded.size(0) == count,
              "sample_rows: int64 rows [N] and excluded [N, W]");
  TORCH_CHECK(temperature.numel() == count && threshold.numel() == count && log_norm.numel() == count &&
                  uniform.numel() == count,
              "sample_rows: one temperature, threshold, log_norm and uniform per row");
  const at::Tensor xc = x.contiguous(), rc = rows.contiguous(), ec = excluded.contiguous();
  const at::Tensor tc = temperature.contiguous().to(at::kFloat), hc = threshold.contiguous().to(at::kFloat);
  const at::Tensor lc = log_norm.contiguous().to(at::kFloat), uc = uniform.contiguous().to(at::kFloat);
  at::Tensor out = at::empty({count}, rows.options());
  const int64_t width = excluded.size(1), chunks = (vocab + kChunk - 1) / kChunk;
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(vocab), p(vocab), chunk_mass(chunks);
    std::vector<float> held(width);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = rc.data_ptr<int64_t>()[k];
      TORCH_CHECK(r >= 0 && r < x.size(0), "sample_rows: row out of range");
      const float floor = hc.data_ptr<float>()[k], norm = lc.data_ptr<float>()[k];
      scale(xc.data_ptr<float>() + r * vocab, vocab, tc.data_ptr<float>()[k], scores.data());
      weigh(scores.data(), vocab, norm, p.data());
      for (int64_t i = 0; i < vocab; ++i) p[i] = scores[i] >= floor ? p[i] : 0.f;
      const int64_t* skip = ec.data_ptr<int64_t>() + k * width;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t token = skip[j];
        held[j] = token >= 0 && token < vocab ? p[token] : 0.f;
        if (held[j] > 0.f) p[token] = 0.f;
      }
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        float mass = 0.f;
        for (int64_t i = c * kChunk; i < std::min(vocab, (c + 1) * kChunk); ++i) mass += p[i];
        chunk_mass[c] = mass;
        total += mass;
      }
      if (!(total > 0.f)) {  // the excluded tokens held it all: the whole distribution again
        for (int64_t j = 0; j < width; ++j)
          if (held[j] > 0.f) p[skip[j]] = held[j];
        total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          float mass = 0.f;
          for (int64_t i = c * kChunk; i < std::min(vocab, (c + 1) * kChunk); ++i) mass += p[i];
          chunk_mass[c] = mass;
          total += mass;
        }
      }
      const float target = uc.data_ptr<float>()[k] * total;
      float running = 0.f;
      int64_t drawn = -1;
      for (int64_t c = 0; c < chunks && drawn < 0; ++c) {
        if (running + chunk_mass[c] <= target) {
          running += chunk_mass[c];
          continue;
        }
        for (int64_t i = c * kChunk; i < std::min(vocab, (c + 1) * kChunk); ++i) {
          running += p[i];
          if (p[i] > 0.f && running > target) {
            drawn = i;
            break;
          }
        }
      }
      if (drawn < 0) {  // rounding ran past the end: the likeliest
        drawn = 0;
        for (int64_t i = 1; i < vocab; ++i)
          if (p[i] > p[drawn]) drawn = i;
      }
      op[k] = drawn;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("row_argmax(Tensor x) -> (Tensor, Tensor)");
  m.def("filter_stats(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> (Tensor, Tensor, Tensor)");
  m.def("sample_rows(Tensor x, Tensor rows, Tensor temperature, Tensor threshold, Tensor log_norm, Tensor excluded, "
        "Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("row_argmax", &row_argmax);
  m.impl("filter_stats", &filter_stats);
  m.impl("sample_rows", &sample_rows);
}
