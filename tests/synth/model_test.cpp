// moe-synth files against the project's GGUF rules and loader: shapes, metadata, canonical offsets,
// determinism, tokenizer consistency and the scale of the weights.
#include <cmath>
#include <cstring>
#include <numeric>
#include <unordered_set>

#include "moe/model.hpp"
#include "moe/quant.hpp"
#include "synth_util.hpp"

namespace {

using namespace synth_test;
using moe::gguf::File;
using moe::gguf::TensorInfo;

struct Geo {
  uint32_t layers, embd, heads, kv_heads, head_dim, experts, used, ffn, context;
  std::string args() const {
    return fmt::format(
        "--layers {} --embd {} --heads {} --kv-heads {} --head-dim {} --experts {} --experts-used {} --expert-ffn {} "
        "--context {}",
        layers, embd, heads, kv_heads, head_dim, experts, used, ffn, context);
  }
};

void expect_ne(const File& f, const std::string& name, std::vector<int64_t> want) {
  const auto* t = f.tensor(name);
  ASSERT_NE(t, nullptr) << name;
  ASSERT_EQ(t->n_dims, want.size()) << name;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(t->ne[i], want[i]) << name << " dim " << i;
}

TEST(SynthModel, GeometriesLoadWithTheProjectLoader) {
  const std::pair<Geo, std::string> cases[] = {
      {{2, 256, 4, 2, 64, 8, 2, 256, 1024}, "--type q4_k_m"},
      {{3, 512, 6, 2, 128, 6, 3, 512, 2048}, "--type q8_0 --rope-base 10000 --eps 1e-5"},
      {{1, 128, 2, 2, 32, 3, 1, 96, 64}, "--type f16 --tied"},
      {{2, 256, 2, 1, 128, 4, 4, 256, 512}, "--type bf16"},
  };
  int i = 0;
  for (const auto& [g, extra] : cases) {
    const auto path = make_model("geo" + std::to_string(i++) + ".gguf", g.args() + " --vocab-size 500 " + extra);
    const auto m = moe::model::OwnedQuantizedModel::open(path);
    const auto& c = m->config;
    EXPECT_EQ(c.arch, "qwen3moe");
    EXPECT_EQ(c.n_layer, g.layers);
    EXPECT_EQ(c.n_embd, g.embd);
    EXPECT_EQ(c.n_head, g.heads);
    EXPECT_EQ(c.n_head_kv, g.kv_heads);
    EXPECT_EQ(c.head_dim, g.head_dim);
    EXPECT_EQ(c.n_expert, g.experts);
    EXPECT_EQ(c.n_expert_used, g.used);
    EXPECT_EQ(c.expert_ffn, g.ffn);
    EXPECT_EQ(c.context_length, g.context);
    EXPECT_EQ(c.n_vocab, 505u);  // 500 ordinary + 5 special tokens
    EXPECT_EQ(c.tied_output, extra.find("--tied") != std::string::npos);
    if (extra.find("--rope-base") != std::string::npos) {
      EXPECT_FLOAT_EQ(c.rope_base, 10000.f);
      EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
    } else {
      EXPECT_FLOAT_EQ(c.rope_base, 1e6f);
      EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
    }
    const File& f = *m->file;
    const int64_t E = g.embd, Q = g.heads * g.head_dim, KV = g.kv_heads * g.head_dim, V = 505;
    expect_ne(f, "token_embd.weight", {E, V});
    expect_ne(f, "output_norm.weight", {E});
    if (!c.tied_output) expect_ne(f, "output.weight", {E, V});
    for (uint32_t l = 0; l < g.layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      expect_ne(f, p + "attn_q.weight", {E, Q});
      expect_ne(f, p + "attn_k.weight", {E, KV});
      expect_ne(f, p + "attn_v.weight", {E, KV});
      expect_ne(f, p + "attn_output.weight", {Q, E});
      expect_ne(f, p + "attn_q_norm.weight", {g.head_dim});
      expect_ne(f, p + "attn_k_norm.weight", {g.head_dim});
      expect_ne(f, p + "ffn_gate_inp.weight", {E, g.experts});
      expect_ne(f, p + "ffn_gate_exps.weight", {E, g.ffn, g.experts});
      expect_ne(f, p + "ffn_up_exps.weight", {E, g.ffn, g.experts});
      expect_ne(f, p + "ffn_down_exps.weight", {g.ffn, E, g.experts});
    }
    EXPECT_EQ(f.tensors().size(), (c.tied_output ? 2u : 3u) + 12u * g.layers);
  }
}

TEST(SynthModel, OffsetsAreCanonicalAndAligned) {
  const auto f = File::open(make_model("offsets.gguf", "--layers 3 --type q4_k_m --vocab-size 777"));
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->data_offset() % 32, 0u);
  uint64_t expect = 0;
  for (const auto& t : f->tensors()) {
    EXPECT_EQ(t.offset, expect) << t.name;
    const auto tr = moe::gguf::type_traits(t.type);
    const uint64_t nbytes = static_cast<uint64_t>(t.nelements()) / tr.block_elems * tr.block_bytes;
    EXPECT_EQ(t.nbytes, nbytes) << t.name;
    expect = (t.offset + nbytes + 31) / 32 * 32;
  }
  EXPECT_GE(f->file_size(), f->data_offset() + expect - 31);
  EXPECT_LE(f->file_size(), f->data_offset() + expect);
}

TEST(SynthModel, Metadata) {
  const auto f = File::open(make_model("meta.gguf", "--type q4_k_m"));
  EXPECT_EQ(f->get_string("general.architecture"), "qwen3moe");
  EXPECT_EQ(f->get_u32("general.file_type"), 15u);
  EXPECT_EQ(f->get_u32("general.quantization_version"), 2u);
  EXPECT_EQ(f->get_u32("qwen3moe.attention.key_length"), 64u);
  EXPECT_EQ(f->get_u32("qwen3moe.attention.value_length"), 64u);
  EXPECT_EQ(f->get_u32("qwen3moe.expert_feed_forward_length"), 256u);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f->get_string("tokenizer.ggml.pre"), "qwen2");
  EXPECT_FALSE(f->get_bool("tokenizer.ggml.add_bos_token"));
  const auto tmpl = f->get_string("tokenizer.chat_template");
  EXPECT_NE(tmpl.find("<|im_start|>"), std::string::npos);
  EXPECT_NE(tmpl.find("enable_thinking"), std::string::npos);
  EXPECT_NE(tmpl.find("<think>\\n\\n</think>\\n\\n"), std::string::npos);
}

TEST(SynthModel, DeterministicBySeed) {
  const std::string geo = "--layers 2 --type q4_k_m --vocab-size 600 ";
  const auto a = read_bytes(make_model("seed1a.gguf", geo + "--seed 7 --threads 1"));
  const auto b = read_bytes(make_model("seed1b.gguf", geo + "--seed 7 --threads 2"));
  const auto c = read_bytes(make_model("seed2.gguf", geo + "--seed 8"));
  ASSERT_GT(a.size(), 100000u);
  EXPECT_TRUE(a == b) << "same seed, different thread counts, different bytes";
  ASSERT_EQ(a.size(), c.size());
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += a[i] != c[i];
  EXPECT_GT(differing, a.size() / 4) << "another seed should change most weight bytes";
}

TEST(SynthModel, TruncatedVocabularyIsConsistent) {
  const auto src = File::open(vocab_file());
  const auto f = File::open(make_model("vocab1000.gguf", "--layers 1 --vocab-size 1000 --type q8_0"));
  const auto& tokens = f->get_string_array("tokenizer.ggml.tokens");
  const auto& src_tokens = src->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 1005u);
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(tokens[i], src_tokens[i]) << i;
  const std::vector<std::string> specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"};
  const auto& types = f->get_array("tokenizer.ggml.token_type", moe::gguf::ValueType::INT32);
  ASSERT_EQ(types.count, 1005u);
  for (size_t i = 0; i < 1000; ++i) EXPECT_EQ(types.int_at(i), 1) << i;
  for (size_t i = 0; i < specials.size(); ++i) {
    EXPECT_EQ(tokens[1000 + i], specials[i]);
    EXPECT_EQ(types.int_at(1000 + i), i < 3 ? 3 : 4) << specials[i];  // control / user-defined
  }
  EXPECT_EQ(f->get_u32("tokenizer.ggml.bos_token_id"), 1000u);
  EXPECT_EQ(f->get_u32("tokenizer.ggml.padding_token_id"), 1000u);
  EXPECT_EQ(f->get_u32("tokenizer.ggml.eos_token_id"), 1002u);
  EXPECT_EQ(f->tensor("token_embd.weight")->ne[1], 1005);

  // Every kept merge has its parts and its result in the vocabulary, and no qualifying merge is lost.
  const std::unordered_set<std::string_view> vocab(tokens.begin(), tokens.end());
  auto qualifies = [&](std::string_view m) {
    const size_t sp = m.find(' ');
    if (sp == std::string_view::npos) return false;
    const std::string joined = std::string(m.substr(0, sp)) + std::string(m.substr(sp + 1));
    return vocab.count(m.substr(0, sp)) && vocab.count(m.substr(sp + 1)) && vocab.count(joined);
  };
  const auto& merges = f->get_string_array("tokenizer.ggml.merges");
  ASSERT_GT(merges.size(), 500u);
  for (auto m : merges) EXPECT_TRUE(qualifies(m)) << m;
  size_t want = 0;
  for (auto m : src->get_string_array("tokenizer.ggml.merges")) want += qualifies(m);
  EXPECT_EQ(merges.size(), want);
}

TEST(SynthModel, FullVocabularyHasQwen3SpecialIds) {
  const auto f = File::open(make_model("fullvocab.gguf", "--layers 1 --vocab-size 0 --type q8_0"));
  const auto& tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 151936u);
  EXPECT_EQ(tokens[151643], "<|endoftext|>");
  EXPECT_EQ(tokens[151645], "<|im_end|>");
  EXPECT_EQ(tokens[151657], "<tool_call>");
  EXPECT_EQ(tokens[151667], "<think>");
  EXPECT_EQ(tokens[151668], "</think>");
  EXPECT_EQ(tokens[151669], "[PAD151669]");
  EXPECT_EQ(f->get_u32("tokenizer.ggml.eos_token_id"), 151645u);
  EXPECT_EQ(f->get_u32("tokenizer.ggml.bos_token_id"), 151643u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges").size(), 151387u);
  const auto m = moe::model::OwnedQuantizedModel::open(f->path());
  EXPECT_EQ(m->config.n_vocab, 151936u);
}

TEST(SynthModel, SyntheticVocabulary) {
  const auto f = File::open(make_model("synvocab.gguf", "--layers 1 --vocab synthetic --type f32"));
  const auto& tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_GT(tokens.size(), 256u + 5u);
  EXPECT_EQ(tokens[65], "A");
  EXPECT_EQ(tokens[32], "\xC4\xA0");  // the space byte as GPT-2 code point U+0120
  const std::unordered_set<std::string_view> vocab(tokens.begin(), tokens.end());
  for (auto m : f->get_string_array("tokenizer.ggml.merges")) {
    const size_t sp = m.find(' ');
    ASSERT_NE(sp, std::string_view::npos) << m;
    EXPECT_TRUE(vocab.count(m.substr(0, sp)) && vocab.count(m.substr(sp + 1))) << m;
    EXPECT_TRUE(vocab.count(std::string(m.substr(0, sp)) + std::string(m.substr(sp + 1)))) << m;
  }
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"})
    EXPECT_TRUE(vocab.count(s)) << s;
  EXPECT_LT(f->get_u32("tokenizer.ggml.eos_token_id"), tokens.size());
  EXPECT_LT(f->get_u32("tokenizer.ggml.bos_token_id"), tokens.size());
  EXPECT_NO_THROW(moe::model::OwnedQuantizedModel::open(f->path()));
}

// Row statistics of a tensor, dequantized.
struct Stats {
  double mean = 0, rms = 0;
  bool finite = true;
};
Stats stats(const TensorInfo& t, int64_t max_rows = 64) {
  Stats s;
  std::vector<float> row(static_cast<size_t>(t.ne[0]));
  const int64_t rows = std::min<int64_t>(max_rows, t.nelements() / t.ne[0]);
  double sum = 0, sq = 0;
  for (int64_t r = 0; r < rows; ++r) {
    moe::quant::dequantize_row(t.type, t.data + r * t.row_bytes(), row.data(), t.ne[0]);
    for (float v : row) {
      s.finite &= std::isfinite(v);
      sum += v;
      sq += double(v) * v;
    }
  }
  const double n = double(rows) * t.ne[0];
  s.mean = sum / n;
  s.rms = std::sqrt(sq / n);
  return s;
}

TEST(SynthModel, WeightScalesFollowTheRecipe) {
  const std::string geo = "--layers 2 --embd 512 --heads 4 --kv-heads 2 --head-dim 128 --experts 4 --experts-used 2 "
                          "--expert-ffn 256 --vocab-size 1000 --seed 3 ";
  const auto f = File::open(make_model("scale-f32.gguf", geo + "--type f32"));
  auto near = [](double got, double want, double rel) { return std::abs(got - want) <= rel * want; };
  EXPECT_TRUE(near(stats(*f->tensor("token_embd.weight")).rms, 1.0, 0.05));
  EXPECT_TRUE(near(stats(*f->tensor("blk.0.attn_q.weight")).rms, 1 / std::sqrt(512.0), 0.05));
  EXPECT_TRUE(near(stats(*f->tensor("blk.1.ffn_up_exps.weight")).rms, 1 / std::sqrt(512.0), 0.05));
  EXPECT_TRUE(near(stats(*f->tensor("blk.0.attn_output.weight")).rms, 0.7 / std::sqrt(512.0), 0.05));
  EXPECT_TRUE(near(stats(*f->tensor("blk.0.ffn_down_exps.weight")).rms, 0.6 / 16.0, 0.05));
  const auto norm = stats(*f->tensor("blk.0.attn_norm.weight"));
  EXPECT_TRUE(near(norm.mean, 1.0, 0.03));
  // The LM head rows vary in scale (per-token log-normal factor): some rows are much larger than others.
  const auto* out = f->tensor("output.weight");
  std::vector<float> row(512);
  double lo = 1e9, hi = 0;
  for (int64_t r = 0; r < 200; ++r) {
    std::memcpy(row.data(), out->data + r * out->row_bytes(), 512 * 4);
    double sq = 0;
    for (float v : row) sq += double(v) * v;
    lo = std::min(lo, std::sqrt(sq / 512)), hi = std::max(hi, std::sqrt(sq / 512));
  }
  EXPECT_GT(hi / lo, 2.0);

  // The quantized file holds the same values, rounded: same seed, so dequantized ≈ F32.
  const auto q = File::open(make_model("scale-q4km.gguf", geo + "--type q4_k_m"));
  for (const char* name : {"token_embd.weight", "output.weight", "blk.0.attn_v.weight", "blk.1.attn_v.weight",
                           "blk.1.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight"}) {
    const auto* a = f->tensor(name);
    const auto* b = q->tensor(name);
    std::vector<float> x(static_cast<size_t>(a->ne[0])), y(x.size());
    double err = 0, ref = 0;
    const int64_t rows = std::min<int64_t>(32, a->nelements() / a->ne[0]);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(x.data(), a->data + r * a->row_bytes(), x.size() * 4);
      moe::quant::dequantize_row(b->type, b->data + r * b->row_bytes(), y.data(), a->ne[0]);
      for (size_t i = 0; i < x.size(); ++i) err += double(x[i] - y[i]) * (x[i] - y[i]), ref += double(x[i]) * x[i];
    }
    EXPECT_LT(std::sqrt(err / ref), 0.12) << name << " (" << moe::gguf::type_name(b->type) << ")";
    EXPECT_TRUE(stats(*b).finite) << name;
  }
}

}  // namespace

namespace {

// Big enough that the large matrices are built from the pre-quantized chunk pool: the values are
// still the same across types, scaled as the recipe says, and no two rows repeat.
TEST(SynthModel, PooledMatricesAreConsistentAcrossTypes) {
  const std::string geo =
      "--layers 1 --embd 768 --heads 6 --kv-heads 2 --head-dim 128 --experts 22 --experts-used 2 --expert-ffn 768 "
      "--vocab-size 1000 --seed 5 ";
  const auto ref = File::open(make_model("pool-f16.gguf", geo + "--type f16"));
  const auto q = File::open(make_model("pool-q4km.gguf", geo + "--type q4_k_m"));
  for (const char* name : {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
                           "blk.0.attn_q.weight", "token_embd.weight"}) {
    const auto* a = ref->tensor(name);
    const auto* b = q->tensor(name);
    ASSERT_TRUE(a && b) << name;
    const int64_t n = a->ne[0], rows = a->nelements() / n;
    std::vector<float> x(static_cast<size_t>(n)), y(x.size());
    double err = 0, sq = 0;
    for (int64_t r = 0; r < rows; r += 97) {
      moe::quant::dequantize_row(a->type, a->data + r * a->row_bytes(), x.data(), n);
      moe::quant::dequantize_row(b->type, b->data + r * b->row_bytes(), y.data(), n);
      for (int64_t i = 0; i < n; ++i) err += double(x[i] - y[i]) * (x[i] - y[i]), sq += double(x[i]) * x[i];
    }
    EXPECT_LT(std::sqrt(err / sq), 0.12) << name;
    const double rms = std::sqrt(sq / double(n * ((rows + 96) / 97)));
    const double want = std::string(name) == "token_embd.weight"            ? 1.0
                        : std::string(name) == "blk.0.ffn_down_exps.weight" ? 0.6 / std::sqrt(768.0)
                                                                             : 1 / std::sqrt(768.0);
    EXPECT_NEAR(rms, want, 0.05 * want) << name;
  }
  const auto* gate = q->tensor("blk.0.ffn_gate_exps.weight");
  std::unordered_set<std::string_view> seen;
  const int64_t rows = gate->nelements() / gate->ne[0];
  for (int64_t r = 0; r < rows; ++r)
    seen.insert(std::string_view(reinterpret_cast<const char*>(gate->data + r * gate->row_bytes()), gate->row_bytes()));
  EXPECT_EQ(static_cast<int64_t>(seen.size()), rows) << "repeated rows";
}

}  // namespace
