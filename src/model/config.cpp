// ModelConfig::from_gguf: every qwen3moe hyperparameter of REFERENCE.md §2.2-2.3, strictly typed,
// with llama.cpp's defaults only where llama.cpp has them.
#include <cmath>

#include "moe/model.hpp"

namespace moe::model {
namespace {

using gguf::File;
using gguf::Value;
using gguf::ValueType;

bool is_supported_arch(std::string_view a) { return a == "qwen3moe" || a == "qwen3_moe"; }

class Keys {
 public:
  Keys(const File& f, std::string arch) : f_(f), arch_(std::move(arch)) {}

  std::string key(std::string_view suffix) const { return arch_ + "." + std::string(suffix); }

  std::optional<uint32_t> opt_u32(std::string_view s) const { return f_.opt_u32(key(s)); }
  uint32_t u32(std::string_view s) const { return f_.get_u32(key(s)); }
  std::optional<float> opt_f32(std::string_view s) const { return f_.opt_f32(key(s)); }

  // A "scalar or per-layer array" key (head_count, expert_used_count, ...). Arrays must have exactly
  // n_layer elements of an integer type; moe-run needs every layer to agree.
  std::optional<uint32_t> opt_per_layer(std::string_view s, uint32_t n_layer) const {
    std::string k = key(s);
    const Value* v = f_.find(k);
    if (!v) return std::nullopt;
    if (v->type == ValueType::UINT32) return static_cast<uint32_t>(v->u);
    if (v->type != ValueType::ARRAY ||
        !(v->elem_type == ValueType::UINT32 || v->elem_type == ValueType::INT32 || v->elem_type == ValueType::BOOL))
      fail(Exit::unsupported, "metadata '{}' should be UINT32 or an array of {} integers, found {}", k, n_layer,
           v->type_string());
    if (v->count != n_layer)
      fail(Exit::unsupported, "metadata '{}' has {} elements, expected one per layer ({})", k, v->count, n_layer);
    int64_t first = v->int_at(0);
    for (uint64_t i = 1; i < v->count; ++i)
      if (v->int_at(i) != first)
        fail(Exit::unsupported, "metadata '{}' differs between layers ({} vs {}); moe-run needs one value", k,
             first, v->int_at(i));
    if (first < 0 || first > UINT32_MAX) fail(Exit::unsupported, "metadata '{}' has value {}", k, first);
    return static_cast<uint32_t>(first);
  }

 private:
  const File& f_;
  std::string arch_;
};

void require(bool ok, const std::string& key, const std::string& what) {
  if (!ok) fail(Exit::unsupported, "metadata '{}' {}", key, what);
}

}  // namespace

ModelConfig ModelConfig::from_gguf(const File& f) {
  ModelConfig c;
  std::string arch(f.get_string("general.architecture"));
  if (!is_supported_arch(arch))
    fail(Exit::unsupported, "{}: unsupported architecture '{}' (moe-run runs qwen3moe models)", f.path(), arch);
  c.arch = arch;
  // Files spelled 'qwen3_moe' may still carry 'qwen3moe.' keys: use whichever prefix has block_count.
  std::string prefix = arch;
  if (!f.has(prefix + ".block_count")) prefix = arch == "qwen3moe" ? "qwen3_moe" : "qwen3moe";
  if (!f.has(prefix + ".block_count")) prefix = arch;
  Keys k(f, prefix);

  c.context_length = k.u32("context_length");
  c.n_embd = k.u32("embedding_length");
  c.n_layer = k.u32("block_count");
  require(c.n_layer > 0 && c.n_layer <= 512, k.key("block_count"), fmt::format("is {}, must be in 1..512", c.n_layer));
  require(c.n_embd > 0, k.key("embedding_length"), "is 0");
  require(c.context_length > 0, k.key("context_length"), "is 0");

  auto heads = k.opt_per_layer("attention.head_count", c.n_layer);
  if (!heads) fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", k.key("attention.head_count"));
  c.n_head = *heads;
  require(c.n_head > 0, k.key("attention.head_count"), "is 0");
  c.n_head_kv = k.opt_per_layer("attention.head_count_kv", c.n_layer).value_or(c.n_head);
  require(c.n_head_kv > 0 && c.n_head % c.n_head_kv == 0, k.key("attention.head_count_kv"),
          fmt::format("is {}, must divide the head count {}", c.n_head_kv, c.n_head));

  uint32_t default_hd = c.n_embd / c.n_head;
  c.head_dim = k.opt_u32("attention.key_length").value_or(default_hd);
  uint32_t v_len = k.opt_u32("attention.value_length").value_or(default_hd);
  require(c.head_dim > 0 && c.head_dim % 2 == 0, k.key("attention.key_length"),
          fmt::format("is {}, must be even and non-zero", c.head_dim));
  require(v_len == c.head_dim, k.key("attention.value_length"),
          fmt::format("is {}, must equal the key length {}", v_len, c.head_dim));
  uint32_t n_rot = k.opt_u32("rope.dimension_count").value_or(c.head_dim);
  require(n_rot == c.head_dim, k.key("rope.dimension_count"),
          fmt::format("is {}, qwen3moe rotates the whole head ({})", n_rot, c.head_dim));

  c.rms_eps = f.get_f32(k.key("attention.layer_norm_rms_epsilon"));
  require(std::isfinite(c.rms_eps) && c.rms_eps >= 0.f, k.key("attention.layer_norm_rms_epsilon"),
          fmt::format("is {}", c.rms_eps));
  c.rope_base = k.opt_f32("rope.freq_base").value_or(10000.f);
  require(std::isfinite(c.rope_base) && c.rope_base > 0.f, k.key("rope.freq_base"), fmt::format("is {}", c.rope_base));

  c.n_expert = k.opt_u32("expert_count").value_or(0);
  if (c.n_expert == 0) fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", k.key("expert_count"));
  require(c.n_expert <= 1024, k.key("expert_count"), fmt::format("is {}, at most 1024", c.n_expert));
  c.n_expert_used = k.opt_per_layer("expert_used_count", c.n_layer).value_or(0);
  if (c.n_expert_used == 0)
    fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", k.key("expert_used_count"));
  require(c.n_expert_used <= c.n_expert, k.key("expert_used_count"),
          fmt::format("is {}, more than the {} experts", c.n_expert_used, c.n_expert));
  c.feed_forward_length = k.opt_per_layer("feed_forward_length", c.n_layer).value_or(0);
  c.expert_ffn = k.opt_per_layer("expert_feed_forward_length", c.n_layer).value_or(0);
  if (c.expert_ffn == 0) c.expert_ffn = c.feed_forward_length / c.n_expert_used;
  if (c.expert_ffn == 0)
    fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", k.key("expert_feed_forward_length"));

  // RoPE scaling (REFERENCE §2.3).
  std::string stype = "linear";
  if (auto t = f.opt_string(k.key("rope.scaling.type"))) stype = std::string(*t);
  float factor = 0.f;
  if (auto fac = k.opt_f32("rope.scaling.factor")) factor = *fac;
  else if (auto lin = k.opt_f32("rope.scale_linear")) factor = *lin;
  if (stype == "none") {
    c.rope_scaling = RopeScalingType::none;
  } else if (stype == "linear") {
    c.rope_scaling = factor > 0.f ? RopeScalingType::linear : RopeScalingType::none;
  } else if (stype == "yarn") {
    c.rope_scaling = RopeScalingType::yarn;
  } else {
    fail(Exit::unsupported, "metadata '{}' is '{}' (moe-run supports none, linear and yarn)",
         k.key("rope.scaling.type"), stype);
  }
  require(std::isfinite(factor) && factor >= 0.f, k.key("rope.scaling.factor"), fmt::format("is {}", factor));
  c.rope_freq_scale = (c.rope_scaling == RopeScalingType::none || factor == 0.f) ? 1.f : 1.f / factor;
  c.rope_n_ctx_orig = k.opt_u32("rope.scaling.original_context_length").value_or(c.context_length);
  c.rope_attn_factor = k.opt_f32("rope.scaling.attn_factor").value_or(1.f);

  if (f.has("tokenizer.ggml.tokens")) {
    size_t n = f.get_string_array("tokenizer.ggml.tokens").size();
    require(n > 0 && n <= INT32_MAX, "tokenizer.ggml.tokens", fmt::format("has {} tokens", n));
    c.n_vocab = static_cast<uint32_t>(n);
  } else if (const gguf::TensorInfo* t = f.tensor("token_embd.weight")) {
    c.n_vocab = static_cast<uint32_t>(t->ne[1]);
  }
  c.tied_output = f.tensor("output.weight") == nullptr;
  return c;
}

}  // namespace moe::model
