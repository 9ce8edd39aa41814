// Rotary embedding of a step's queries and keys straight out of the fused q/k/v projection, with
// the keys and values written into their paged-cache slots: one pass over [T, (Hq + 2 Hkv) D]
// where torch needs about fifteen small ops per layer (split, views, negate, cat, four products,
// two sums, two index copies), each costing more than its arithmetic in a decode step.
//
// Same arithmetic as specserve.models.rope.apply_rotary, x * cos + rotate_half(x) * sin with
// every product rounded on its own (the build turns off contraction into fused multiply-adds):
// the fused and the torch paths give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "kv_int8.h"

namespace {

// dst = rotary(src): the first half pairs with the second, as rotate_half does.
inline void rotate(const float* src, const float* cos, const float* sin, int64_t D, float* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) dst[d] = src[d] * cos[d] - src[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) dst[d] = src[d] * cos[d] + src[d - half] * sin[d];
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads) {
  const auto kind = k_cache.scalar_type();
  const bool int8 = kind == at::kChar;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  (kind == at::kFloat || kind == at::kBFloat16 || int8) && v_cache.scalar_type() == kind,
              "rope_write_kv: float32 activations into float32, bfloat16 or int8 caches");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "rope_write_kv: caches must be contiguous [blocks, block_size, Hkv, D] (int8: D + a scale byte per 32)");
  const int64_t W = k_cache.size(3), T = qkv.size(0), D = int8 ? specserve::kv_head_dim_of(W) : W;
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && D % 2 == 0, "rope_write_kv: cache heads do not fit");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rope_write_kv: qkv must be [T, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && slot_mapping.numel() == T,
              "rope_write_kv: cos, sin [T, head_dim] and one slot per token");
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t total_slots = k_cache.size(0) * k_cache.size(1);
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t width = (num_heads + 2 * num_kv_heads) * D, kv_width = num_kv_heads * D;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < total_slots, "rope_write_kv: slot ", slot[t], " outside the cache");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(kind == at::kFloat ? 0 : D);  // a rotated K row, before it is rounded
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      const float* ct = cp + t * D;
      const float* st = sp + t * D;
      for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * D, ct, st, D, qp + (t * num_heads + h) * D);
      const float* v_row = row + (num_heads + num_kv_heads) * D;
      if (int8) {
        int8_t* k_slot = k_cache.data_ptr<int8_t>() + slot[t] * num_kv_heads * W;
        int8_t* v_slot = v_cache.data_ptr<int8_t>() + slot[t] * num_kv_heads * W;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          rotate(row + (num_heads + h) * D, ct, st, D, rotated.data());
          specserve::quantize_kv_row(rotated.data(), D, k_slot + h * W);
          specserve::quantize_kv_row(v_row + h * D, D, v_slot + h * W);
        }
      } else if (kind == at::kBFloat16) {  // rounded to nearest even, as torch's .to(bfloat16)
        c10::BFloat16* k_slot = k_cache.data_ptr<c10::BFloat16>() + slot[t] * kv_width;
        c10::BFloat16* v_slot = v_cache.data_ptr<c10::BFloat16>() + slot[t] * kv_width;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          rotate(row + (num_heads + h) * D, ct, st, D, rotated.data());
          for (int64_t d = 0; d < D; ++d) k_slot[h * D + d] = c10::BFloat16(rotated[d]);
        }
        for (int64_t i = 0; i < kv_width; ++i) v_slot[i] = c10::BFloat16(v_row[i]);
      } else {
        float* k_slot = k_cache.data_ptr<float>() + slot[t] * kv_width;
        for (int64_t h = 0; h < num_kv_heads; ++h) rotate(row + (num_heads + h) * D, ct, st, D, k_slot + h * D);
        std::memcpy(v_cache.data_ptr<float>() + slot[t] * kv_width, v_row, kv_width * sizeof(float));
      }
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) { m.impl("rope_write_kv", &rope_write_kv); }
