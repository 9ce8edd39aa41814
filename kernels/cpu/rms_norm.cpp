// RMSNorm over the last dimension, fp32, one row at a time in a fixed order: y = w * x / rms(x).
// torch's fused CPU rms_norm costs ~20 us per call for one 576-wide row (SmolLM2's 61 calls a
// step: over a millisecond); this is a single pass, and a row's result never depends on the others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "fixed_order.h"

namespace {

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [T, H], weight [H]");
}

void normalize_row(const float* row, const float* w, int64_t width, double eps, float* out) {
  const float squares = specserve::fixed_order_dot(row, row, width);
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
  for (int64_t i = 0; i < width; ++i) out[i] = w[i] * (row[i] * inverse);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * width, wp, width, eps, yp + r * width);
  });
  return y;
}

// The residual add before a norm, in the same pass: (x + delta, rms_norm(x + delta)). The sum is
// one fp32 rounding per element, as torch's add; the norm is rms_norm's arithmetic on it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == at::kFloat,
              "add_rms_norm: delta must be float32 of x's shape");
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor sum = at::empty_like(xc), y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* dp = dc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = sp + r * width;
      for (int64_t i = 0; i < width; ++i) row[i] = xp[r * width + i] + dp[r * width + i];
      normalize_row(row, wp, width, eps, yp + r * width);
    }
  });
  return {sum, y};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
