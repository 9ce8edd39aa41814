// A model's decoder layers run from C++ in one call, over weights bound once (`DecoderStack`).
//
// A small model's decode is mostly per-op costs: SmolLM2-135M makes about 400 op calls a step
// (four projections, two norms, rotary + K/V write, attention and SwiGLU's product per layer) and
// on a 2-core AVX2 host the Python between them (argument parsing, the dispatcher, module
// attribute lookups) took about 60% of the step's time. Here each layer is the very same ops,
// called through the dispatcher from C++: the same kernels in the same order, so the same bits
// as `specserve.models.llama.DecoderLayer`'s fp32 CPU path (a test holds the two equal).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

c10::OperatorHandle handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// One weight of a projection: a matmul op of ours with its weight's tensors and ints bound
// (`QuantizedRows.kernel_call()`), computing that weight's slice of the outputs.
struct Part {
  c10::OperatorHandle op;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> ints;

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(1 + tensors.size() + ints.size());
    stack.emplace_back(x);
    for (const auto& t : tensors) stack.emplace_back(t);
    for (int64_t i : ints) stack.emplace_back(i);
    op.callBoxed(stack);
    return stack[0].toTensor();
  }
};

// `specserve.models.linear.Projection` over quantized weights: its parts' outputs side by side, then the bias.
struct Projection {
  std::vector<Part> parts;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    TORCH_CHECK(!parts.empty(), "DecoderStack: a projection has no weights");
    at::Tensor y;
    if (parts.size() == 1) {
      y = parts[0](x);
    } else {
      std::vector<at::Tensor> outs;
      for (const auto& part : parts) outs.push_back(part(x));
      y = at::cat(outs, -1);
    }
    return bias ? y + *bias : y;
  }
};

enum Slot : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection projections[4];
};

using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RopeWriteKV = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                               const at::Tensor&, int64_t, int64_t);
using SiluMul = at::Tensor(const at::Tensor&);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : layers_(num_layers), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        norm_(handle("specserve_cpu::rms_norm").typed<Norm>()),
        add_norm_(handle("specserve_cpu::add_rms_norm").typed<AddNorm>()),
        rope_write_kv_(handle("specserve_cpu::rope_write_kv").typed<RopeWriteKV>()),
        attention_(handle("specserve_cpu::tree_attention").typed<Attention>()),
        silu_mul_(handle("specserve_cpu::silu_mul").typed<SiluMul>()) {}

  void set_norms(int64_t layer, at::Tensor input_norm, at::Tensor post_norm) {
    Layer& l = at(layer);
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
  }

  // Projection `slot` (0 qkv, 1 o, 2 gate/up, 3 down) of `layer` gains a weight: `op(x, *tensors, *ints)`.
  void add_part(int64_t layer, int64_t slot, const std::string& op, std::vector<at::Tensor> tensors,
                std::vector<int64_t> ints) {
    projection(layer, slot).parts.push_back(Part{handle(op.c_str()), std::move(tensors), std::move(ints)});
  }

  void set_bias(int64_t layer, int64_t slot, at::Tensor bias) { projection(layer, slot).bias = std::move(bias); }

  // Layers [begin, end) over the step: the residual stream enters as x + delta (delta absent: x)
  // and leaves as the sum of the two returned tensors, as `DecoderLayer.forward` has it (an empty
  // range returns them as they came).
  std::tuple<at::Tensor, std::optional<at::Tensor>> forward(at::Tensor x, std::optional<at::Tensor> delta, const at::Tensor& cos,
                                             const at::Tensor& sin, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                             const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                             const at::Tensor& block_tables, const at::Tensor& ancestor_mask,
                                             double scale, int64_t begin, int64_t end) {
    TORCH_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(layers_.size()),
                "DecoderStack: layers [", begin, ", ", end, ") outside [0, ", layers_.size(), ")");
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == static_cast<int64_t>(layers_.size()),
                "DecoderStack: caches must be [layers, blocks, block_size, kv_heads, head_dim]");
    const int64_t tokens = x.size(0);
    at::Tensor h, dx = delta ? *delta : at::Tensor();
    for (int64_t i = begin; i < end; ++i) {
      const Layer& l = layers_[i];
      std::tie(x, h) = residual_norm(x, dx, l.input_norm);
      const at::Tensor qkv = l.projections[kQkv](h);
      auto [k, v] = cache_layer(k_cache, v_cache, i);
      const at::Tensor q = rope_write_kv_.call(qkv, cos, sin, k, v, slot_mapping, heads_, kv_heads_);
      const at::Tensor attended = attention_.call(q, k, v, query_start_loc, context_lens, block_tables,
                                                  ancestor_mask, scale);
      const at::Tensor o = l.projections[kO](attended.reshape({tokens, heads_ * head_dim_}));
      std::tie(x, h) = add_norm_.call(x, o, l.post_norm, eps_);
      const at::Tensor gate_up = l.projections[kGateUp](h);
      dx = l.projections[kDown](silu_mul_.call(gate_up));
    }
    if (!dx.defined()) return {x, std::nullopt};
    return {x, dx};
  }

 private:
  std::tuple<at::Tensor, at::Tensor> residual_norm(const at::Tensor& x, const at::Tensor& delta,
                                                   const at::Tensor& weight) const {
    if (!delta.defined()) return {x, norm_.call(x, weight, eps_)};
    return add_norm_.call(x, delta, weight, eps_);
  }

  // Layer i's K and V caches: views made once per cache tensor (a decode would make sixty a step).
  std::pair<at::Tensor, at::Tensor> cache_layer(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t i) {
    const bool same = !k_views_.empty() && k_views_.front().data_ptr() == k_cache.data_ptr() &&
                      v_views_.front().data_ptr() == v_cache.data_ptr() && cache_sizes_ == k_cache.sizes().vec();
    if (!same) {
      k_views_ = k_cache.unbind(0);
      v_views_ = v_cache.unbind(0);
      cache_sizes_ = k_cache.sizes().vec();
    }
    return {k_views_[i], v_views_[i]};
  }

  Layer& at(int64_t layer) {
    TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers_.size()), "DecoderStack: no layer ", layer);
    return layers_[layer];
  }

  Projection& projection(int64_t layer, int64_t slot) {
    TORCH_CHECK(0 <= slot && slot < 4, "DecoderStack: projection slot ", slot, " is not 0-3");
    return at(layer).projections[slot];
  }

  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_views_, v_views_;
  std::vector<int64_t> cache_sizes_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  c10::TypedOperatorHandle<Norm> norm_;
  c10::TypedOperatorHandle<AddNorm> add_norm_;
  c10::TypedOperatorHandle<RopeWriteKV> rope_write_kv_;
  c10::TypedOperatorHandle<Attention> attention_;
  c10::TypedOperatorHandle<SiluMul> silu_mul_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("set_norms", &DecoderStack::set_norms)
      .def("add_part", &DecoderStack::add_part)
      .def("set_bias", &DecoderStack::set_bias)
      .def("forward", &DecoderStack::forward);
}
