// Model-level malformed files (metadata and shapes) generated from a valid fixture: each must give
// moe::Error with category 5 (unsupported model), a message naming the key or tensor, no signal,
// and no allocation sized by the file's claims.
#include <gtest/gtest.h>

#include "malformed.hpp"
#include "moe/gguf.hpp"
#include "moe/model.hpp"

namespace {

using gguf_test::Image;
using moe::Exit;

using gguf_test::Outcome;

const std::vector<uint8_t>& fixture() { return gguf_test::q8_fixture(); }

// Parses the bytes and builds the model.
Outcome load(const std::vector<uint8_t>& bytes) {
  return gguf_test::attempt([&] { moe::model::OwnedQuantizedModel::load(moe::gguf::File::parse(bytes, "bad.gguf")); });
}

void expect_error(const std::vector<uint8_t>& bytes, Exit code, const std::string& needle) {
  gguf_test::expect_rejected(load(bytes), bytes.size(), code, needle);
}

TEST(ModelMalformed, MissingAndMistypedKeys) {
  Image img = Image::read(fixture());
  img.erase("qwen3moe.expert_count");
  expect_error(img.write(), Exit::unsupported, "'qwen3moe.expert_count' is missing from the GGUF metadata");
  img = Image::read(fixture());
  img.erase("qwen3moe.attention.layer_norm_rms_epsilon");
  expect_error(img.write(), Exit::unsupported, "'qwen3moe.attention.layer_norm_rms_epsilon' is missing");
  img = Image::read(fixture());
  img.set_i32("qwen3moe.block_count", 2);
  expect_error(img.write(), Exit::unsupported, "'qwen3moe.block_count' should be UINT32, found INT32");
  img = Image::read(fixture());
  img.set_u32("qwen3moe.expert_used_count", 9);
  expect_error(img.write(), Exit::unsupported, "more than the 8 experts");
}

TEST(ModelMalformed, OtherArchitectureIsNamed) {
  Image img = Image::read(fixture());
  auto* a = img.find("general.architecture");
  a->value.clear();
  gguf_test::put<uint64_t>(a->value, 5);
  a->value.insert(a->value.end(), {'l', 'l', 'a', 'm', 'a'});
  expect_error(img.write(), Exit::unsupported, "unsupported architecture 'llama'");
}

TEST(ModelMalformed, QwenUnderscoreSpellingIsAccepted) {
  Image img = Image::read(fixture());
  auto* a = img.find("general.architecture");
  a->value.clear();
  std::string s = "qwen3_moe";
  gguf_test::put<uint64_t>(a->value, s.size());
  a->value.insert(a->value.end(), s.begin(), s.end());
  Outcome o = load(img.write());
  EXPECT_FALSE(o.threw) << o.message;
}

TEST(ModelMalformed, ShapesInconsistentWithTheConfig) {
  Image img = Image::read(fixture());
  img.set_u32("qwen3moe.expert_feed_forward_length", 512);
  expect_error(img.write(), Exit::unsupported, "blk.0.ffn_gate_exps.weight: expected [256, 512, 8], found [256, 256, 8]");
  img = Image::read(fixture());
  img.set_u32("qwen3moe.expert_count", 16);
  expect_error(img.write(), Exit::unsupported, "blk.0.ffn_gate_inp.weight: expected [256, 16], found [256, 8]");
  img = Image::read(fixture());
  img.tensor("blk.1.attn_k_norm.weight")->name = "blk.1.attn_k_normx.weight";
  expect_error(img.write(), Exit::unsupported, "'blk.1.attn_k_norm.weight' is missing");
}

TEST(ModelMalformed, UncomputableTensorTypeIsNamed) {
  Image img = Image::read(fixture());
  // Retype a Q8_0 [256, 128] tensor as IQ4_NL (32-element blocks of 18 bytes): the bytes still fit.
  img.tensor("blk.0.attn_k.weight")->type = 20;
  expect_error(img.write(), Exit::unsupported, "blk.0.attn_k.weight: has type IQ4_NL");
}

}  // namespace
