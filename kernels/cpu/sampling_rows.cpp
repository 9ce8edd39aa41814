// Per-row passes over a step's logits for sampling and verification (specserve/sampling.py
// defines what they compute; its torch code is the reference they are tested against).
// torch's CPU argmax reads a 49k-token row at a quarter of the speed of its amax, and a
// top-p filter sorts the row: on a 2-core host those were most of a busy step's verification.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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
// torch.argmax.
std::tuple<float, int64_t> argmax_row(const float* row, int64_t n) {
  float best = -kInf;
  int64_t i = 0;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(-kInf);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, v);
  }
  best = _mm512_reduce_max_ps(acc);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(row[i]);
    best = row[i] > best ? row[i] : best;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(row[j])) return {row[j], j};
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
    if (hit) return {best, j + __builtin_ctz(hit)};
  }
#endif
  for (; j < n; ++j)
    if (row[j] == best) return {best, j};
  return {best, 0};  // every value -inf... and none equal: cannot happen, the max is one of them
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

// The largest key t for which keep(t) holds, keep monotone (true at 0): a binary search over
// the 32-bit key space, so the threshold is found exactly without sorting the row.
template <typename Keep>
uint32_t largest_key(Keep keep) {
  uint64_t lo = 0, hi = uint64_t{1} << 32;  // keep(lo) holds, keep(hi) does not
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (keep(static_cast<uint32_t>(mid))) lo = mid; else hi = mid;
  }
  return static_cast<uint32_t>(lo);
}

int64_t count_at_least(const uint32_t* keys, int64_t n, uint32_t t) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += keys[i] >= t;
  return count;
}

float mass_at_least(const uint32_t* keys, const float* weights, int64_t n, uint32_t t) {
  float lanes[specserve::kLanes] = {0};
  int64_t i = 0;
  for (; i + specserve::kLanes <= n; i += specserve::kLanes)
    for (int j = 0; j < specserve::kLanes; ++j) lanes[j] += keys[i + j] >= t ? weights[i + j] : 0.f;
  for (int j = 0; i < n; ++i, ++j) lanes[j] += keys[i] >= t ? weights[i] : 0.f;
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

struct RowFilter {
  float temperature;
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
};

// One row's filtered distribution, as specserve/sampling.py's filter_rows defines it: the
// scores x / temperature, then top-k, top-p and min-p, each keeping the tokens whose score is
// at least a threshold. Returns that threshold (the smallest kept score), the log of the kept
// tokens' normaliser (p_i = exp(s_i - log_norm) for s_i >= threshold) and whether the row is
// finite (no NaN, no +inf, something left).
std::tuple<float, float, bool> filter_row(const float* row, int64_t n, const RowFilter& f, float* scores,
                                          float* weights, uint32_t* keys) {
  float top = -kInf;
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const float s = row[i] / f.temperature;
    scores[i] = s;
    bad |= std::isnan(s) || s == kInf;
    top = s > top ? s : top;
  }
  if (bad || top == -kInf) return {kInf, kInf, false};
  for (int64_t i = 0; i < n; ++i) weights[i] = scores[i] - top;
  specserve::exp_in_place(weights, n);
  for (int64_t i = 0; i < n; ++i) {
    if (scores[i] - top < -87.f) weights[i] = 0.f;  // below float's normal range (and -inf): nothing
    keys[i] = order_key(scores[i]);
  }
  uint32_t floor = 0;  // keys below it are filtered out
  if (f.top_k > 0 && f.top_k < n) {
    floor = largest_key([&](uint32_t t) { return count_at_least(keys, n, t) >= f.top_k; });
  }
  if (f.top_p < 1.f) {
    const float kept = mass_at_least(keys, weights, n, floor);
    const float reach = f.top_p * kept;  // the smallest set of likeliest tokens holding top_p of it
    const uint32_t p_floor = largest_key([&](uint32_t t) {
      return t <= floor || mass_at_least(keys, weights, n, t) >= reach;
    });
    floor = p_floor > floor ? p_floor : floor;
  }
  // The smallest kept score, and min-p's floor: probability at least min_p times the likeliest's
  // (whose weight is 1).
  float threshold = kInf;
  for (int64_t i = 0; i < n; ++i)
    if (keys[i] >= floor && (f.min_p <= 0.f || weights[i] >= f.min_p) && scores[i] < threshold) threshold = scores[i];
  float lanes[specserve::kLanes] = {0};
  for (int64_t i = 0; i < n; ++i) lanes[i % specserve::kLanes] += scores[i] >= threshold ? weights[i] : 0.f;
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return {threshold, top + std::log(total), true};
}

RowFilter row_filter(const float* temperature, const int64_t* top_k, const float* top_p, const float* min_p,
                     int64_t r) {
  return {temperature[r], top_k[r], top_p[r], min_p[r]};
}

void check_params(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& min_p, int64_t rows) {
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
  check_params(x, temperature, top_k, top_p, min_p, rows);
  const at::Tensor xc = x.contiguous(), tc = temperature.contiguous(), kc = top_k.contiguous();
  const at::Tensor pc = top_p.contiguous(), mc = min_p.contiguous();
  at::Tensor threshold = at::empty({rows}, x.options()), log_norm = at::empty({rows}, x.options());
  at::Tensor finite = at::empty({rows}, x.options().dtype(at::kBool));
  const float* xp = xc.data_ptr<float>();
  float *thp = threshold.data_ptr<float>(), *lp = log_norm.data_ptr<float>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(vocab), weights(vocab + specserve::kExpPad);
    std::vector<uint32_t> keys(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const RowFilter f = row_filter(tc.data_ptr<float>(), kc.data_ptr<int64_t>(), pc.data_ptr<float>(),
                                     mc.data_ptr<float>(), r);
      std::tie(thp[r], lp[r], fp[r]) = filter_row(xp + r * vocab, vocab, f, scores.data(), weights.data(), keys.data());
    }
  });
  return {threshold, log_norm, finite};
}

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
  const int64_t width = excluded.size(1);
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(vocab + specserve::kExpPad);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = rc.data_ptr<int64_t>()[k];
      TORCH_CHECK(r >= 0 && r < x.size(0), "sample_rows: row out of range");
      const float* row = xc.data_ptr<float>() + r * vocab;
      const float t = tc.data_ptr<float>()[k], floor = hc.data_ptr<float>()[k], norm = lc.data_ptr<float>()[k];
      for (int64_t i = 0; i < vocab; ++i) {
        const float s = row[i] / t;
        p[i] = s >= floor ? s - norm : -kInf;
      }
      specserve::exp_in_place(p.data(), vocab);
      for (int64_t i = 0; i < vocab; ++i)
        if (!(row[i] / t >= floor)) p[i] = 0.f;
      const int64_t* skip = ec.data_ptr<int64_t>() + k * width;
      float removed = 0.f, total = 0.f;
      std::vector<float> held(width, 0.f);
      for (int64_t j = 0; j < width; ++j) {
        const int64_t token = skip[j];
        if (token >= 0 && token < vocab && p[token] > 0.f) {
          held[j] = p[token];
          removed += p[token];
          p[token] = 0.f;
        }
      }
      for (int64_t i = 0; i < vocab; ++i) total += p[i];
      if (!(total > 0.f)) {  // the excluded tokens held it all: the whole distribution again
        for (int64_t j = 0; j < width; ++j)
          if (held[j] > 0.f) p[skip[j]] = held[j];
        total = removed;
      }
      const float target = uc.data_ptr<float>()[k] * total;
      float running = 0.f;
      int64_t drawn = -1, likeliest = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        if (p[i] > p[likeliest]) likeliest = i;
        running += p[i];
        if (drawn < 0 && p[i] > 0.f && running > target) drawn = i;
      }
      op[k] = drawn >= 0 ? drawn : likeliest;  // rounding ran past the end: the likeliest
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
