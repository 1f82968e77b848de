// OwnedQuantizedModel: zero-copy views of every qwen3moe tensor, each checked for presence, type
// and exact shape against the ModelConfig (REFERENCE.md §3).
#include <initializer_list>

#include "moe/model.hpp"

namespace moe::model {
namespace {

using gguf::TensorInfo;
using gguf::Type;

std::string shape_of(std::initializer_list<int64_t> ne) {
  std::string s = "[";
  bool first = true;
  for (int64_t v : ne) {
    if (!first) s += ", ";
    s += std::to_string(v);
    first = false;
  }
  return s + "]";
}

enum class Kind { weight, norm };

Tensor view(const gguf::File& f, const std::string& name, std::initializer_list<int64_t> want, Kind kind,
            bool required = true) {
  const TensorInfo* t = f.tensor(name);
  if (!t) {
    if (!required) return {};
    fail(Exit::unsupported, "{}: required tensor '{}' is missing", f.path(), name);
  }
  bool ok = t->n_dims >= 1;
  size_t d = 0;
  for (int64_t v : want) ok = ok && t->ne[d++] == v;
  for (; d < 4; ++d) ok = ok && t->ne[d] == 1;
  if (!ok) fail(Exit::unsupported, "{}: expected {}, found {}", name, shape_of(want), t->shape_string());
  if (kind == Kind::norm && t->type != Type::F32)
    fail(Exit::unsupported, "{}: has type {}, norm weights must be F32", name, gguf::type_name(t->type));
  if (!quant::is_weight_type(t->type))
    fail(Exit::unsupported, "{}: has type {}, which moe-run cannot compute (supported: F32 F16 BF16 Q4_0 Q4_1 "
         "Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K)", name, gguf::type_name(t->type));
  Tensor v;
  v.info = t;
  v.type = t->type;
  v.data = t->data;
  for (int i = 0; i < 4; ++i) v.ne[i] = t->ne[i];
  v.row_bytes = gguf::row_bytes(t->type, t->ne[0]);
  v.matrix_bytes = v.row_bytes * static_cast<size_t>(t->ne[1]);
  return v;
}

}  // namespace

quant::Matrix Tensor::matrix() const {
  return quant::Matrix{data, type, ne[0], ne[1] * ne[2] * ne[3], row_bytes};
}

quant::Matrix Tensor::expert(int64_t e) const {
  return quant::Matrix{data + static_cast<size_t>(e) * matrix_bytes, type, ne[0], ne[1], row_bytes};
}

std::shared_ptr<const OwnedQuantizedModel> OwnedQuantizedModel::load(std::shared_ptr<const gguf::File> file) {
  auto m = std::make_shared<OwnedQuantizedModel>();
  const gguf::File& f = *file;
  m->file = file;
  m->config = ModelConfig::from_gguf(f);
  const ModelConfig& c = m->config;
  const int64_t E = c.n_embd, V = c.n_vocab, hd = c.head_dim, X = c.n_expert, F = c.expert_ffn;
  const int64_t q = c.q_dim(), kv = c.kv_dim();
  if (V == 0) fail(Exit::unsupported, "{}: the model has no vocabulary ('tokenizer.ggml.tokens' is missing)", f.path());

  m->token_embd = view(f, "token_embd.weight", {E, V}, Kind::weight);
  m->output_norm = view(f, "output_norm.weight", {E}, Kind::norm);
  m->output = view(f, "output.weight", {E, V}, Kind::weight, /*required=*/false);
  if (!m->output) m->output = m->token_embd;

  m->layers.resize(c.n_layer);
  for (uint32_t il = 0; il < c.n_layer; ++il) {
    auto name = [il](const char* s) { return "blk." + std::to_string(il) + "." + s + ".weight"; };
    if (!f.tensor(name("attn_q")) && f.tensor(name("attn_qkv")))
      fail(Exit::unsupported, "{}: fused QKV weights are not supported", name("attn_qkv"));
    for (const char* b : {"attn_q", "attn_k", "attn_v", "attn_qkv"}) {
      std::string bias = "blk." + std::to_string(il) + "." + b + ".bias";
      if (f.tensor(bias)) fail(Exit::unsupported, "{}: attention biases are not supported for qwen3moe", bias);
    }
    Layer& L = m->layers[il];
    L.attn_norm = view(f, name("attn_norm"), {E}, Kind::norm);
    L.attn_q = view(f, name("attn_q"), {E, q}, Kind::weight);
    L.attn_k = view(f, name("attn_k"), {E, kv}, Kind::weight);
    L.attn_v = view(f, name("attn_v"), {E, kv}, Kind::weight);
    L.attn_output = view(f, name("attn_output"), {q, E}, Kind::weight);
    L.attn_q_norm = view(f, name("attn_q_norm"), {hd}, Kind::norm);
    L.attn_k_norm = view(f, name("attn_k_norm"), {hd}, Kind::norm);
    L.ffn_norm = view(f, name("ffn_norm"), {E}, Kind::norm);
    L.ffn_gate_inp = view(f, name("ffn_gate_inp"), {E, X}, Kind::weight);
    L.ffn_gate_exps = view(f, name("ffn_gate_exps"), {E, F, X}, Kind::weight);
    L.ffn_up_exps = view(f, name("ffn_up_exps"), {E, F, X}, Kind::weight);
    L.ffn_down_exps = view(f, name("ffn_down_exps"), {F, E, X}, Kind::weight);
  }
  return m;
}

std::shared_ptr<const OwnedQuantizedModel> OwnedQuantizedModel::open(const std::string& path) {
  return load(gguf::File::open(path));
}

uint64_t OwnedQuantizedModel::weight_bytes() const {
  uint64_t total = 0;
  for (const gguf::TensorInfo& t : file->tensors()) total += t.nbytes;
  return total;
}

}  // namespace moe::model
