// Tree attention over the paged KV cache on the CPU, fp32, one query row at a time.
//
// Why: a query's result must not depend on the other queries of the step. CPU SDPA tiles its
// queries and keys by the call's shape, so the same token decoded alone and verified as a tree
// node differ in the last bits; quantized activations (kernels/cpu/block_matmul.cpp) can turn
// those bits into another token, and greedy speculation would then differ from plain decoding.
// Here every (token, head) walks exactly its visible keys (the cached context in order, then
// its tree ancestors and itself in node order) with the same fixed-order arithmetic, so its
// result is a function of those keys alone. It also reads K/V in place through the block
// table: no gathered copy of the cache per layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fixed_order.h"

namespace {

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                          const at::Tensor& block_tables, const at::Tensor& ancestor_mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "tree_attention: float32 queries and caches only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "tree_attention: q [T, Hq, D] and caches [blocks, block_size, Hkv, D]");
  const at::Tensor qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor starts = query_start_loc.to(at::kLong).contiguous(), ctx = context_lens.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor mask = ancestor_mask.to(at::kBool).contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "tree_attention: head sizes do not fit");
  const int64_t B = ctx.size(0), max_blocks = tables.size(1), max_n = mask.size(1);
  const int64_t group = Hq / Hkv;
  at::Tensor out = at::empty_like(qc);

  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // The request of each flat token (tokens of request b are [start[b], start[b + 1])).
  std::vector<int64_t> request(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = sp[b]; t < sp[b + 1]; ++t) request[t] = b;

  at::parallel_for(0, T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;  // the visible keys of token `slots_of`, shared by its heads
    std::vector<float> scores;
    int64_t slots_of = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hq, h = item % Hq, b = request[t], node = t - sp[b], context = cp[b];
      const int64_t kv_head = h / group;
      if (t != slots_of) {
        auto slot_of = [&](int64_t position) {
          return tp[b * max_blocks + position / block_size] * block_size + position % block_size;
        };
        slots.clear();
        for (int64_t p = 0; p < context; ++p) slots.push_back(slot_of(p));
        const bool* ancestors = mp + (b * max_n + node) * max_n;
        for (int64_t j = 0; j <= node; ++j)
          if (ancestors[j]) slots.push_back(slot_of(context + j));
        slots_of = t;
      }
      const float* qrow = qp + (t * Hq + h) * D;
      const int64_t keys = static_cast<int64_t>(slots.size());
      scores.resize(keys + specserve::kExpPad);
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < keys; ++i) {
        scores[i] = specserve::fixed_order_dot(qrow, kp + (slots[i] * Hkv + kv_head) * D, D) * fscale;
        best = std::max(best, scores[i]);
      }
      for (int64_t i = 0; i < keys; ++i) scores[i] -= best;
      specserve::exp_in_place(scores.data(), keys);
      float* orow = op + (t * Hq + h) * D;
      std::fill(orow, orow + D, 0.f);
      float total = 0.f;
      for (int64_t i = 0; i < keys; ++i) {
        const float weight = scores[i];
        total += weight;
        const float* vrow = vp + (slots[i] * Hkv + kv_head) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = std::fma(weight, vrow[d], orow[d]);
      }
      const float inverse = 1.f / total;
      for (int64_t d = 0; d < D; ++d) orow[d] *= inverse;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor context_lens, "
        "Tensor block_tables, Tensor ancestor_mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
