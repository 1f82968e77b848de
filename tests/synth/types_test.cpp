// Per-tensor types of moe-synth's mixes. The oracle for the tiny geometry is llama-quantize itself:
// the fixture files were made by it from an F32 model of the same shape. Other expectations are
// written out by hand from REFERENCE.md §5.10.
#include <set>

#include "synth_util.hpp"

namespace {

using namespace synth_test;
using moe::gguf::File;

// A small geometry whose every row length is a multiple of 256 (no K-quant fallback) and with an
// expert count other than 8 (no 8-expert rules).
std::string small(int layers) {
  return "--layers " + std::to_string(layers) + " --embd 256 --heads 2 --kv-heads 1 --head-dim 128 --experts 4 --experts-used 2 "
    "--expert-ffn 256 --vocab-size 300 --context 256";
}

TEST(SynthTypes, TinyQ4KMMatchesLlamaQuantize) {
  for (const char* mix : {"q4_k_m", "q8_0"}) {
    const auto path = make_model(std::string("tiny-") + mix + ".gguf",
                                 std::string("--preset tiny --vocab-size 4096 --type ") + mix);
    const auto ours = File::open(path);
    const auto ref = File::open(std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-" + mix + ".gguf");
    ASSERT_EQ(ours->tensors().size(), ref->tensors().size()) << mix;
    for (size_t i = 0; i < ref->tensors().size(); ++i) {
      const auto& r = ref->tensors()[i];
      // Same order as llama-quantize writes them.
      EXPECT_EQ(ours->tensors()[i].name, r.name) << mix << " position " << i;
      const auto* t = ours->tensor(r.name);
      ASSERT_NE(t, nullptr) << r.name;
      EXPECT_EQ(moe::gguf::type_name(t->type), moe::gguf::type_name(r.type)) << mix << " " << r.name;
      EXPECT_EQ(t->n_dims, r.n_dims) << r.name;
      EXPECT_EQ(t->ne[0], r.ne[0]) << r.name;
      // The vocabulary dimension differs: moe-synth also appends <think> and </think>.
      if (r.name != "token_embd.weight" && r.name != "output.weight") {
        EXPECT_EQ(t->ne, r.ne) << r.name;
      }
    }
  }
}

std::set<int> q4km_more_bits_layers_16() { return {0, 1, 4, 7, 10, 13, 14, 15}; }

TEST(SynthTypes, Q4KMAndQ5KMLayerRule) {
  for (const std::string mix : {"q4_k_m", "q5_k_m"}) {
    const auto f = File::open(make_model("l16-" + mix + ".gguf", small(16) + " --type " + mix));
    const std::string base = mix == "q4_k_m" ? "Q4_K" : "Q5_K";
    const auto more = q4km_more_bits_layers_16();
    EXPECT_EQ(type_of(*f, "output.weight"), "Q6_K");
    EXPECT_EQ(type_of(*f, "token_embd.weight"), base);
    EXPECT_EQ(type_of(*f, "output_norm.weight"), "F32");
    for (int l = 0; l < 16; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      const std::string v = more.count(l) ? "Q6_K" : base;
      EXPECT_EQ(type_of(*f, p + "attn_v.weight"), v) << mix << " layer " << l;
      EXPECT_EQ(type_of(*f, p + "ffn_down_exps.weight"), v) << mix << " layer " << l;
      for (const char* n : {"attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"})
        EXPECT_EQ(type_of(*f, p + n + ".weight"), base) << mix << " " << p << n;
      for (const char* n : {"attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp"})
        EXPECT_EQ(type_of(*f, p + n + ".weight"), "F32") << mix << " " << p << n;
    }
  }
}

TEST(SynthTypes, UniformMixes) {
  const std::pair<const char*, const char*> mixes[] = {
      {"q6_k", "Q6_K"}, {"q8_0", "Q8_0"}, {"bf16", "BF16"}, {"f16", "F16"}, {"f32", "F32"}};
  for (const auto& [mix, type] : mixes) {
    const auto f = File::open(make_model(std::string("u-") + mix + ".gguf",
                                         "--layers 3 --embd 256 --heads 2 --kv-heads 1 --head-dim 128 --experts 4 "
                                         "--experts-used 2 --expert-ffn 256 --vocab-size 300 --type " +
                                             std::string(mix)));
    for (const auto& t : f->tensors()) {
      const bool f32_kept = t.n_dims == 1 || t.name.find("ffn_gate_inp") != std::string::npos;
      EXPECT_EQ(moe::gguf::type_name(t.type), f32_kept ? "F32" : type) << mix << " " << t.name;
    }
    const uint32_t ftype = f->get_u32("general.file_type");
    const std::map<std::string, uint32_t> want = {{"q6_k", 18}, {"q8_0", 7}, {"bf16", 32}, {"f16", 1}, {"f32", 0}};
    EXPECT_EQ(ftype, want.at(mix)) << mix;
  }
}

TEST(SynthTypes, KQuantFallbackForRowsNotMultipleOf256) {
  // n_embd 320: rows of 320 elements cannot hold K-quant super-blocks; q dim (4x64) and expert_ffn are 256.
  const std::string geo =
      "--layers 2 --embd 320 --heads 4 --kv-heads 2 --head-dim 64 --experts 4 --experts-used 2 --expert-ffn 256 "
      "--vocab-size 300";
  {
    const auto f = File::open(make_model("fb-q4.gguf", geo + " --type q4_k_m"));
    EXPECT_EQ(type_of(*f, "token_embd.weight"), "Q5_0");
    EXPECT_EQ(type_of(*f, "output.weight"), "Q8_0");
    EXPECT_EQ(type_of(*f, "blk.0.attn_q.weight"), "Q5_0");
    EXPECT_EQ(type_of(*f, "blk.0.attn_v.weight"), "Q5_0");
    EXPECT_EQ(type_of(*f, "blk.1.attn_v.weight"), "Q8_0");  // use_more_bits(1, 2) wants Q6_K
    EXPECT_EQ(type_of(*f, "blk.1.ffn_gate_exps.weight"), "Q5_0");
    EXPECT_EQ(type_of(*f, "blk.0.attn_output.weight"), "Q4_K");  // rows of q dim 256
    EXPECT_EQ(type_of(*f, "blk.0.ffn_down_exps.weight"), "Q4_K");
    EXPECT_EQ(type_of(*f, "blk.1.ffn_down_exps.weight"), "Q6_K");
  }
  {
    const auto f = File::open(make_model("fb-q5.gguf", geo + " --type q5_k_m"));
    EXPECT_EQ(type_of(*f, "blk.0.attn_q.weight"), "Q5_1");
  }
  {
    const auto f = File::open(make_model("fb-q6.gguf", geo + " --type q6_k"));
    EXPECT_EQ(type_of(*f, "blk.0.attn_q.weight"), "Q8_0");
    EXPECT_EQ(type_of(*f, "blk.0.attn_output.weight"), "Q6_K");
  }
  {
    // 48 is a multiple of neither 256 nor 32: F16.
    const auto f = File::open(make_model(
        "fb-f16.gguf",
        "--layers 1 --embd 48 --heads 2 --kv-heads 1 --head-dim 24 --experts 2 --experts-used 1 --expert-ffn 64 "
        "--vocab-size 300 --type q8_0"));
    EXPECT_EQ(type_of(*f, "blk.0.attn_q.weight"), "F16");
    EXPECT_EQ(type_of(*f, "blk.0.ffn_down_exps.weight"), "Q8_0");  // rows of 64
  }
}

TEST(SynthTypes, TiedHeadGetsTheOutputRule) {
  const auto f = File::open(make_model("tied.gguf", small(2) + " --tied --type q4_k_m"));
  EXPECT_EQ(f->tensor("output.weight"), nullptr);
  EXPECT_EQ(type_of(*f, "token_embd.weight"), "Q6_K");
  EXPECT_EQ(f->tensors().size(), 2u + 12u * 2u);
}

TEST(SynthTypes, Overrides) {
  const auto f = File::open(make_model(
      "ovr.gguf", small(2) + " --type q4_k_m --type-override 'ffn_(gate|up)_exps=q8_0' "
                             "--type-override 'blk\\.1\\.attn_q=F16' --type-override 'attn_q=bf16'"));
  EXPECT_EQ(type_of(*f, "blk.0.ffn_gate_exps.weight"), "Q8_0");
  EXPECT_EQ(type_of(*f, "blk.1.ffn_up_exps.weight"), "Q8_0");
  EXPECT_EQ(type_of(*f, "blk.1.attn_q.weight"), "F16");   // the first matching pattern wins
  EXPECT_EQ(type_of(*f, "blk.0.attn_q.weight"), "BF16");
  EXPECT_EQ(type_of(*f, "blk.1.ffn_down_exps.weight"), "Q6_K");
  EXPECT_EQ(type_of(*f, "blk.0.attn_k.weight"), "Q4_K");
}

TEST(SynthTypes, BadFlagsAreUsageErrors) {
  const std::string out = "-o '" + (tmp_dir() / "bad.gguf").string() + "' ";
  for (const std::string& args :
       {std::string("--type q3_k_s"), std::string("--experts 4 --experts-used 5"), std::string("--heads 3 --kv-heads 2"),
        std::string("--type-override attn_q"), std::string("--type-override attn_q=q9_9"),
        std::string("--type-override 'attn_q=q4_k' --embd 320 --head-dim 80"), std::string("--layers 0"),
        std::string("--no-such-flag")}) {
    const auto r = run_synth(out + args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << args << "\n" << r.err;
  }
  EXPECT_FALSE(fs::exists(tmp_dir() / "bad.gguf"));
  const auto r = run_synth(out + "--vocab /no/such/vocab.gguf");
  EXPECT_EQ(r.rc, 3) << r.err;
  // An output that cannot be created: exit 1, one error line naming it, nothing left behind.
  const fs::path dir = tmp_dir() / "no-such-dir";
  const auto w = run_synth("-o '" + (dir / "x.gguf").string() + "'");
  EXPECT_EQ(w.rc, 1) << w.err;
  EXPECT_EQ(w.err.rfind("error: ", 0), 0u) << w.err;
  EXPECT_NE(w.err.find("no-such-dir"), std::string::npos) << w.err;
  EXPECT_FALSE(fs::exists(dir));
}

}  // namespace
