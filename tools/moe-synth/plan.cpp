// Tensor list and per-tensor types. The *_M mixes follow llama-quantize's rules (REFERENCE.md §5.10)
// so a moe-synth Q4_K_M file has the same type layout as a stock Q4_K_M conversion of that geometry.
#include <algorithm>
#include <cctype>
#include <cstdio>

#include "moe/error.hpp"
#include "synth.hpp"

namespace synth {

using moe::Error;
using moe::Exit;

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_k_quant(Type t) {
  return t == Type::Q2_K || t == Type::Q3_K || t == Type::Q4_K || t == Type::Q5_K || t == Type::Q6_K;
}

// llama-quantize replaces a K-quant whose rows are not whole super-blocks by a 32-block type, and
// anything that still does not divide by F16.
Type compatible_type(Type t, int64_t ne0) {
  auto fits = [&](Type x) { return ne0 % moe::gguf::type_traits(x).block_elems == 0; };
  if (fits(t)) return t;
  if (is_k_quant(t)) {
    switch (t) {
      case Type::Q2_K: case Type::Q3_K: t = Type::Q4_0; break;
      case Type::Q4_K: t = Type::Q5_0; break;
      case Type::Q5_K: t = Type::Q5_1; break;
      default: t = Type::Q8_0; break;
    }
    if (fits(t)) return t;
  }
  return Type::F16;
}

Type base_type(Mix m) {
  switch (m) {
    case Mix::q4_k_m: return Type::Q4_K;
    case Mix::q5_k_m: return Type::Q5_K;
    case Mix::q6_k: return Type::Q6_K;
    case Mix::q8_0: return Type::Q8_0;
    case Mix::bf16: return Type::BF16;
    case Mix::f16: return Type::F16;
    case Mix::f32: return Type::F32;
  }
  return Type::F32;
}

bool is_quantized_mix(Mix m) { return m != Mix::bf16 && m != Mix::f16 && m != Mix::f32; }

// The type llama-quantize picks for a matrix under `mix` (no imatrix, no overrides).
Type mix_type(const Geometry& g, const TensorPlan& t, Mix mix) {
  Type type = base_type(mix);
  if (!is_quantized_mix(mix)) return type;
  const bool more_bits_mix = mix == Mix::q4_k_m || mix == Mix::q5_k_m;
  const bool eight_experts = g.n_expert == 8;
  const int n = static_cast<int>(g.n_layer);
  // The LM head (the token embedding when tied) gets 6 bits unless the mix is already 8-bit.
  const bool is_head = t.role == Role::output || (g.tied && t.role == Role::token_embd);
  if (is_head) {
    if (t.ne[0] % 256 != 0) return Type::Q8_0;
    return type == Type::Q8_0 ? type : Type::Q6_K;
  }
  switch (t.role) {
    case Role::attn_v:
      if (more_bits_mix && use_more_bits(t.layer, n)) type = Type::Q6_K;
      if (eight_experts) type = Type::Q8_0;
      break;
    case Role::attn_k:
      if (eight_experts) type = Type::Q8_0;
      break;
    case Role::attn_output:
      if (eight_experts && mix == Mix::q4_k_m) type = Type::Q5_K;
      break;
    case Role::expert_down:
      if (more_bits_mix && use_more_bits(t.layer, n)) type = Type::Q6_K;
      break;
    default:
      break;
  }
  return type;
}

TensorPlan make(std::string name, Role role, int layer, std::initializer_list<int64_t> ne) {
  TensorPlan t;
  t.name = std::move(name);
  t.role = role;
  t.layer = layer;
  t.n_dims = static_cast<uint32_t>(ne.size());
  int i = 0;
  for (int64_t v : ne) t.ne[i++] = v;
  return t;
}

int name_layer(const std::string& s) {
  int l = -1;
  if (std::sscanf(s.c_str(), "blk.%d.", &l) == 1) return l;
  return -1;
}

}  // namespace

bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

std::optional<Mix> parse_mix(const std::string& s) {
  const std::string l = lower(s);
  for (Mix m : {Mix::q4_k_m, Mix::q5_k_m, Mix::q6_k, Mix::q8_0, Mix::bf16, Mix::f16, Mix::f32})
    if (l == mix_name(m)) return m;
  return std::nullopt;
}

const char* mix_name(Mix m) {
  switch (m) {
    case Mix::q4_k_m: return "q4_k_m";
    case Mix::q5_k_m: return "q5_k_m";
    case Mix::q6_k: return "q6_k";
    case Mix::q8_0: return "q8_0";
    case Mix::bf16: return "bf16";
    case Mix::f16: return "f16";
    case Mix::f32: return "f32";
  }
  return "?";
}

uint32_t mix_file_type(Mix m) {
  switch (m) {
    case Mix::q4_k_m: return 15;
    case Mix::q5_k_m: return 17;
    case Mix::q6_k: return 18;
    case Mix::q8_0: return 7;
    case Mix::bf16: return 32;
    case Mix::f16: return 1;
    case Mix::f32: return 0;
  }
  return 0;
}

std::optional<Type> parse_type(const std::string& s) {
  const std::string l = lower(s);
  for (Type t : {Type::F32, Type::F16, Type::BF16, Type::Q4_0, Type::Q4_1, Type::Q5_0, Type::Q5_1,
                 Type::Q8_0, Type::Q2_K, Type::Q3_K, Type::Q4_K, Type::Q5_K, Type::Q6_K})
    if (l == lower(moe::gguf::type_name(t))) return t;
  return std::nullopt;
}

std::vector<TensorPlan> plan_tensors(const Geometry& g, uint32_t n_vocab, Mix mix,
                                     const std::vector<TypeOverride>& overrides) {
  const int64_t E = g.n_embd, V = n_vocab, Q = int64_t(g.head_dim) * g.n_head,
                KV = int64_t(g.head_dim) * g.n_head_kv, F = g.expert_ffn, X = g.n_expert, D = g.head_dim;
  std::vector<TensorPlan> ts;
  ts.push_back(make("token_embd.weight", Role::token_embd, -1, {E, V}));
  ts.push_back(make("output_norm.weight", Role::output_norm, -1, {E}));
  if (!g.tied) ts.push_back(make("output.weight", Role::output, -1, {E, V}));
  for (int l = 0; l < static_cast<int>(g.n_layer); ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    ts.push_back(make(p + "attn_norm.weight", Role::attn_norm, l, {E}));
    ts.push_back(make(p + "attn_q.weight", Role::attn_q, l, {E, Q}));
    ts.push_back(make(p + "attn_k.weight", Role::attn_k, l, {E, KV}));
    ts.push_back(make(p + "attn_v.weight", Role::attn_v, l, {E, KV}));
    ts.push_back(make(p + "attn_output.weight", Role::attn_output, l, {Q, E}));
    ts.push_back(make(p + "attn_q_norm.weight", Role::qk_norm, l, {D}));
    ts.push_back(make(p + "attn_k_norm.weight", Role::qk_norm, l, {D}));
    ts.push_back(make(p + "ffn_norm.weight", Role::ffn_norm, l, {E}));
    ts.push_back(make(p + "ffn_gate_inp.weight", Role::router, l, {E, X}));
    ts.push_back(make(p + "ffn_gate_exps.weight", Role::expert_gate, l, {E, F, X}));
    ts.push_back(make(p + "ffn_up_exps.weight", Role::expert_up, l, {E, F, X}));
    ts.push_back(make(p + "ffn_down_exps.weight", Role::expert_down, l, {F, E, X}));
  }
  // llama-quantize's order: by layer (non-block tensors first), then by name.
  std::stable_sort(ts.begin(), ts.end(), [](const TensorPlan& a, const TensorPlan& b) {
    const int la = name_layer(a.name), lb = name_layer(b.name);
    if (la != lb) return la < lb;
    return a.name < b.name;
  });

  for (auto& t : ts) {
    // Norms and the router stay F32 in every mix, as the converter and the quantizer keep them.
    const bool matrix = t.n_dims >= 2 && t.role != Role::router;
    t.type = matrix ? compatible_type(mix_type(g, t, mix), t.ne[0]) : Type::F32;
    // Overrides, like llama-quantize's --tensor-type, touch matrices only: norms stay F32.
    for (const auto& o : overrides) {
      if (t.n_dims < 2 || !std::regex_search(t.name, o.re)) continue;
      const auto tr = moe::gguf::type_traits(o.type);
      if (t.ne[0] % tr.block_elems != 0)
        throw Error(Exit::usage, fmt::format("--type-override {}: {} has rows of {} elements, not a multiple of "
                                             "the {}-element blocks of {}",
                                             o.pattern, t.name, t.ne[0], tr.block_elems, tr.name));
      t.type = o.type;
      break;  // the first matching pattern wins
    }
    t.nbytes = moe::gguf::row_bytes(t.type, t.ne[0]) * static_cast<uint64_t>(t.rows());
  }
  return ts;
}

}  // namespace synth
