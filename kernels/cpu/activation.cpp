// SwiGLU's activation in one pass: silu(gate) * up over the gate/up projection's output, where
// torch needs a silu, a product and their two allocations (~12 us per layer of a SmolLM2 decode
// on a 2-core AVX2 host, for 1536 products).
//
// Same arithmetic as torch's `F.silu(gate) * up` where torch runs its AVX2 code (silu.h), so the
// same bits. (torch's AVX-512 code takes runs of 32 with its 16-wide exp: there the last bit may
// differ now and then. The decoder stack and the layers one by one both compute it with silu.h,
// so they agree with each other on every CPU.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "silu.h"

namespace {

using specserve::silu_mul_row;

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a float32 [T, 2 * intermediate] tensor");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Rows split across threads from 4096 products each (a verification tree's 8 rows of 1536: 1-2%
  // off SmolLM2's tree forward; a decode's one row stays on one thread).
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * 2 * width;
      silu_mul_row(row, row + width, width, op + r * width);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) { m.impl("silu_mul", &silu_mul); }
