// A model's decoder layers run from C++ in one call, over weights bound once (`DecoderStack`);
// with the model's embedding, final norm and LM head bound too, a whole step from token ids to
// logits (`logits`).
//
// A small model's decode is mostly per-op costs: SmolLM2-135M makes about 400 op calls a step
// (four projections, two norms, rotary + K/V write, attention and SwiGLU's product per layer) and
// on a 2-core AVX2 host the Python between them (argument parsing, the dispatcher, module
// attribute lookups) took about 60% of the step's time. Here each layer is the very same ops,
// called through the dispatcher from C++: the same kernels in the same order, so the same bits
// as `specserve.models.llama.DecoderLayer`'s fp32 CPU path (a test holds the two equal).
// The Python around the layers cost as much again once the step's weights had streamed through
// the caches: the embedding's dequantization, the rows' selection, the final norm and the head's
// module calls took ~0.4 ms of a 6.7 ms SmolLM2 decode on a 2-core Zen 4, against ~0.1 ms hot.
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
  std::optional<Part> swiglu;  // silu_mul(gate/up projection) as one op, where that weight is tiled
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

  // `layer`'s silu_mul(gate/up projection) as one op over that projection's weight (the same bits).
  void set_swiglu(int64_t layer, const std::string& op, std::vector<at::Tensor> tensors, std::vector<int64_t> ints) {
    at(layer).swiglu = Part{handle(op.c_str()), std::move(tensors), std::move(ints)};
  }

  // Token embeddings as a float32 table [vocab, hidden] (read as `F.embedding` reads it).
  void set_embedding_table(at::Tensor table) {
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat, "DecoderStack: a float32 [vocab, hidden] table");
    embedding_ = Embedding{.table = table.contiguous()};
  }

  // Token embeddings in quantized blocks, dequantized row by row as `BlockWeight.dequantize` does:
  // codes uint8 [vocab, hidden / 2] (4 bits, Q4_0's nibble order per 32) or [vocab, hidden]; scale
  // and min float32 [vocab, hidden / group]; w = (q - zero_point) * scale, or q * scale + min.
  void set_embedding_blocks(at::Tensor codes, at::Tensor scale, at::Tensor min, int64_t bits, int64_t group,
                            int64_t zero_point) {
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && scale.scalar_type() == at::kFloat &&
                    min.sizes() == scale.sizes() && min.scalar_type() == at::kFloat && scale.size(0) == codes.size(0) &&
                    group > 0 && (bits != 4 || group % 32 == 0) &&
                    codes.size(1) * (bits == 4 ? 2 : 1) == scale.size(1) * group,
                "DecoderStack: embedding blocks do not fit together");
    embedding_ = Embedding{.codes = codes.contiguous(), .scale = scale.contiguous(), .min = min.contiguous(),
                           .bits = bits, .group = group, .zero_point = zero_point};
  }

  // Token embeddings in K-quant super-blocks of 256, dequantized row by row as
  // `SuperBlockWeight.dequantize` does: Q4_K (bits 4: w = d * sc * q - dmin * m per 32) or Q6_K
  // (bits 6: w = d * sc * (q - 32) per 16), in that class's layout of the file's bytes.
  void set_embedding_superblocks(at::Tensor codes, at::Tensor high, at::Tensor sub_scale, at::Tensor sub_min,
                                 at::Tensor d, at::Tensor dmin, int64_t bits) {
    const int64_t sub = bits == 4 ? 32 : 16;
    TORCH_CHECK((bits == 4 || bits == 6) && codes.scalar_type() == at::kByte && codes.dim() == 2 &&
                    d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == codes.size(0) &&
                    codes.size(1) * 2 == d.size(1) * kSuper && sub_scale.size(1) * sub == d.size(1) * kSuper &&
                    (bits == 6 ? high.size(1) * 4 == d.size(1) * kSuper && sub_scale.scalar_type() == at::kChar
                               : sub_min.sizes() == sub_scale.sizes() && sub_scale.scalar_type() == at::kByte &&
                                     dmin.sizes() == d.sizes() && dmin.scalar_type() == at::kFloat),
                "DecoderStack: embedding super-blocks do not fit together");
    embedding_ = Embedding{.codes = codes.contiguous(), .scale = d.contiguous(), .min = dmin.contiguous(),
                           .high = high.contiguous(), .sub_scale = sub_scale.contiguous(),
                           .sub_min = sub_min.contiguous(), .bits = bits, .group = sub, .super_blocks = true};
  }

  // The embeddings of token ids [T], float32 [T, hidden] (what `logits` starts from).
  at::Tensor embed(const at::Tensor& ids) const {
    TORCH_CHECK(embedding_.bound(), "DecoderStack: no embedding bound");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "DecoderStack: token ids must be int64 [T]");
    const at::Tensor idc = ids.contiguous();
    const int64_t* id = idc.data_ptr<int64_t>();
    const int64_t tokens = idc.numel(), vocab = embedding_.vocab();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(0 <= id[t] && id[t] < vocab, "DecoderStack: token id ", id[t], " outside the vocabulary of ", vocab);
    if (embedding_.table.defined()) return embedding_.table.index_select(0, idc);
    const int64_t hidden = embedding_.hidden();
    at::Tensor out = at::empty({tokens, hidden}, at::kFloat);
    float* rows = out.data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t) {
      if (embedding_.super_blocks) super_block_row(id[t], rows + t * hidden);
      else block_row(id[t], rows + t * hidden);
    }
    return out;
  }

  // The rotary tables [positions, head_dim] (`RotaryEmbedding.cos`, `.sin`): `logits` takes positions.
  void set_rotary(at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat,
                "DecoderStack: rotary tables must be float32 [positions, head_dim]");
    cos_ = cos.contiguous();
    sin_ = sin.contiguous();
  }

  // The final norm's weight, and the LM head's weights as `add_part` takes them (with a bias).
  void set_final_norm(at::Tensor weight) { final_norm_ = std::move(weight); }

  void add_head_part(const std::string& op, std::vector<at::Tensor> tensors, std::vector<int64_t> ints) {
    head_.parts.push_back(Part{handle(op.c_str()), std::move(tensors), std::move(ints)});
  }

  void set_head_bias(at::Tensor bias) { head_.bias = std::move(bias); }

  // The residual stream after every layer (as x + delta) of a step from its token ids.
  std::tuple<at::Tensor, std::optional<at::Tensor>> final_stream(
      const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
      const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
      const at::Tensor& block_tables, const at::Tensor& ancestor_mask, double scale) {
    TORCH_CHECK(final_norm_.defined() && !head_.parts.empty() && embedding_.bound() && cos_.defined(),
                "DecoderStack: logits needs the embedding, rotary tables, final norm and LM head bound");
    const at::Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);
    return forward(embed(ids), std::nullopt, cos, sin, k_cache, v_cache, slot_mapping, query_start_loc,
                   context_lens, block_tables, ancestor_mask, scale, 0, static_cast<int64_t>(layers_.size()));
  }

  at::Tensor final_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta) {
    return delta ? std::get<1>(add_norm_.call(x, *delta, final_norm_, eps_)) : norm_.call(x, final_norm_, eps_);
  }

  // A step from the token ids [T] at `positions` to the float32 logits of the tokens `rows` names
  // (all when absent): the embedding, every layer as `forward` runs them, the final residual add
  // and norm, the LM head. Token ids outside the vocabulary, and positions past the tables, are refused.
  at::Tensor logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                    const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& ancestor_mask,
                    double scale, std::optional<at::Tensor> rows) {
    auto [x, delta] = final_stream(ids, positions, k_cache, v_cache, slot_mapping, query_start_loc, context_lens,
                                   block_tables, ancestor_mask, scale);
    if (rows) {
      x = x.index_select(0, *rows);
      if (delta) delta = delta->index_select(0, *rows);
    }
    return head_(final_norm(x, delta));
  }

  // `logits`, and the final-normed states of every token (what a feature head drafts from).
  std::tuple<at::Tensor, at::Tensor> logits_and_normed(
      const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
      const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
      const at::Tensor& block_tables, const at::Tensor& ancestor_mask, double scale, std::optional<at::Tensor> rows) {
    auto [x, delta] = final_stream(ids, positions, k_cache, v_cache, slot_mapping, query_start_loc, context_lens,
                                   block_tables, ancestor_mask, scale);
    const at::Tensor normed = final_norm(x, delta);
    return {head_(rows ? normed.index_select(0, *rows) : normed), normed};
  }

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
      dx = l.projections[kDown](l.swiglu ? (*l.swiglu)(h) : silu_mul_.call(l.projections[kGateUp](h)));
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

  static constexpr int64_t kSuper = 256;  // weights per K-quant super-block

  // Where `embed` reads: a float32 table; blocks of `group` (codes, scale, min); or super-blocks
  // (codes, high, sub_scale, sub_min, with d in `scale` and dmin in `min`).
  struct Embedding {
    at::Tensor table;
    at::Tensor codes, scale, min, high, sub_scale, sub_min;
    int64_t bits = 0, group = 0, zero_point = 0;
    bool super_blocks = false;

    bool bound() const { return table.defined() || codes.defined(); }
    int64_t vocab() const { return table.defined() ? table.size(0) : scale.size(0); }
    int64_t hidden() const {
      return table.defined() ? table.size(1) : scale.size(1) * (super_blocks ? kSuper : group);
    }
  };

  // Row `id` of a block embedding (`set_embedding_blocks`) into `row`.
  void block_row(int64_t id, float* row) const {
    const Embedding& e = embedding_;
    const int64_t groups = e.scale.size(1), hidden = e.hidden();
    const uint8_t* codes = e.codes.data_ptr<uint8_t>() + id * e.codes.size(1);
    const float* scale = e.scale.data_ptr<float>() + id * groups;
    const float* min = e.min.data_ptr<float>() + id * groups;
    const float zero_point = static_cast<float>(e.zero_point);
    for (int64_t j = 0; j < hidden; ++j) {
      // 4-bit codes: per 32 columns, byte k holds column k (low nibble) and k + 16 (high)
      const int64_t span = j / 32 * 16, k = j % 32;
      const float q = e.bits == 4 ? static_cast<float>(k < 16 ? codes[span + k] & 0x0F : codes[span + k - 16] >> 4)
                                  : static_cast<float>(codes[j]);
      const int64_t g = j / e.group;
      row[j] = e.zero_point != 0 ? (q - zero_point) * scale[g] : q * scale[g] + min[g];  // two roundings, as torch's
    }
  }

  // Row `id` of a super-block embedding (`set_embedding_superblocks`) into `row`.
  void super_block_row(int64_t id, float* row) const {
    const Embedding& e = embedding_;
    const int64_t blocks = e.scale.size(1), hidden = e.hidden(), subs = hidden / e.group;
    const bool q6 = e.bits == 6;
    const uint8_t* codes = e.codes.data_ptr<uint8_t>() + id * (hidden / 2);
    const float* d = e.scale.data_ptr<float>() + id * blocks;
    // The row's own pointers, once: Q6_K's top bits and int8 sub-scales; Q4_K's uint8 sub-scales,
    // minimums and dmin
    const uint8_t* high = q6 ? e.high.data_ptr<uint8_t>() + id * (hidden / 4) : nullptr;
    const int8_t* signed_scales = q6 ? e.sub_scale.data_ptr<int8_t>() + id * subs : nullptr;
    const uint8_t* scales = q6 ? nullptr : e.sub_scale.data_ptr<uint8_t>() + id * subs;
    const uint8_t* mins = q6 ? nullptr : e.sub_min.data_ptr<uint8_t>() + id * subs;
    const float* dmin = q6 ? nullptr : e.min.data_ptr<float>() + id * blocks;
    for (int64_t j = 0; j < hidden; ++j) {
      // Per 128 columns: 64 bytes of low bits (column k low nibble, k + 64 high); Q6_K's top two
      // bits in 32 bytes (byte b: columns b, b + 32, b + 64, b + 96 in bits 0-1, 2-3, 4-5, 6-7)
      const int64_t chunk = j / 128, k = j % 128, s = j / e.group, b = j / kSuper;
      int32_t q = k < 64 ? codes[chunk * 64 + k] & 0x0F : codes[chunk * 64 + k - 64] >> 4;
      if (q6) {
        q |= ((high[chunk * 32 + k % 32] >> (2 * (k / 32))) & 3) << 4;
        row[j] = (static_cast<float>(q) - 32.f) * (d[b] * static_cast<float>(signed_scales[s]));
      } else {  // two roundings, as torch's mul_ then sub_
        row[j] = static_cast<float>(q) * (d[b] * static_cast<float>(scales[s])) - dmin[b] * static_cast<float>(mins[s]);
      }
    }
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
  Embedding embedding_;
  at::Tensor cos_, sin_, final_norm_;
  Projection head_;
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
      .def("set_swiglu", &DecoderStack::set_swiglu)
      .def("set_embedding_table", &DecoderStack::set_embedding_table)
      .def("set_embedding_blocks", &DecoderStack::set_embedding_blocks)
      .def("set_embedding_superblocks", &DecoderStack::set_embedding_superblocks)
      .def("embed", &DecoderStack::embed)
      .def("set_rotary", &DecoderStack::set_rotary)
      .def("set_final_norm", &DecoderStack::set_final_norm)
      .def("add_head_part", &DecoderStack::add_head_part)
      .def("set_head_bias", &DecoderStack::set_head_bias)
      .def("forward", &DecoderStack::forward)
      .def("logits_and_normed", &DecoderStack::logits_and_normed)
      .def("logits", &DecoderStack::logits);
}
