// Loading from GGUF metadata (REFERENCE §2.5): what is accepted, what is refused with
// Exit::unsupported and a message naming the key, and the tiny model's own vocabulary checked
// against the prompt ids llama.cpp produced for its goldens.
#include <gtest/gtest.h>

#include "golden.hpp"
#include "json_lite.hpp"
#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using Ids = std::vector<int32_t>;

// Loading the edited image must fail with Exit::unsupported and a message containing `needle`.
void expect_refused(const gguf_test::Image& img, const std::string& needle) {
  try {
    testing::load_image(img);
    ADD_FAILURE() << "loaded although it should be refused (" << needle << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Load, VocabFixture) {
  const Tokenizer& tok = testing::qwen2();
  EXPECT_EQ(tok.n_vocab(), 151936);
  EXPECT_EQ(tok.n_merges(), 151387u);
  EXPECT_EQ(tok.pre(), "qwen2");
  ASSERT_NE(tok.chat_template(), nullptr);
  EXPECT_TRUE(template_is_chatml(*tok.chat_template()));
  const std::string s = tok.summary();
  EXPECT_NE(s.find("151936 tokens"), std::string::npos) << s;
  EXPECT_NE(s.find("qwen2"), std::string::npos) << s;
  EXPECT_EQ(s.find('\n'), std::string::npos) << s;
  EXPECT_EQ(tok.token_attr(151644), kAttrControl);
  EXPECT_EQ(tok.token_attr(151700), kAttrUserDefined);
  EXPECT_EQ(tok.token_attr(9707), kAttrNormal);
}

TEST(Load, RefusesMissingOrUnknownModel) {
  auto img = testing::vocab_image();
  testing::set_string(img, "tokenizer.ggml.model", "llama");
  expect_refused(img, "tokenizer.ggml.model");
  img.erase("tokenizer.ggml.model");
  expect_refused(img, "tokenizer.ggml.model");
}

TEST(Load, RefusesMissingOrUnknownPreTokenizer) {
  auto img = testing::vocab_image();
  testing::set_string(img, "tokenizer.ggml.pre", "llama-bpe");
  expect_refused(img, "tokenizer.ggml.pre");
  img.erase("tokenizer.ggml.pre");
  expect_refused(img, "tokenizer.ggml.pre");
}

TEST(Load, AcceptsQwen2Aliases) {
  for (const char* alias : {"deepseek-r1-qwen", "megrez"}) {
    auto img = testing::vocab_image();
    testing::set_string(img, "tokenizer.ggml.pre", alias);
    const auto l = testing::load_image(img);
    EXPECT_EQ(l->tok.encode("Hello, world!"), (Ids{9707, 11, 1879, 0})) << alias;
  }
}

TEST(Load, RefusesBadTokenLists) {
  auto img = testing::vocab_image();
  auto types = testing::get_i32s(img, "tokenizer.ggml.token_type");
  types.resize(1000);
  testing::set_i32s(img, "tokenizer.ggml.token_type", types);
  expect_refused(img, "tokenizer.ggml.token_type");

  img = testing::vocab_image();
  img.erase("tokenizer.ggml.tokens");
  expect_refused(img, "tokenizer.ggml.tokens");

  img = testing::vocab_image();
  img.set_u32("tokenizer.ggml.tokens", 5);  // wrong type
  expect_refused(img, "tokenizer.ggml.tokens");

  img = testing::vocab_image();
  img.erase("tokenizer.ggml.merges");
  expect_refused(img, "tokenizer.ggml.merges");
}

TEST(Load, RefusesSpecialIdsOutsideTheVocabulary) {
  for (const char* key : {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id"}) {
    auto img = testing::vocab_image();
    img.set_u32(key, 151936);
    expect_refused(img, key);
  }
}

TEST(Load, BosOnlyWhenTheMetadataAsks) {
  auto img = testing::vocab_image();
  testing::set_bool(img, "tokenizer.ggml.add_bos_token", true);
  auto l = testing::load_image(img);
  EXPECT_TRUE(l->tok.add_bos());
  EXPECT_EQ(l->tok.bos_id(), 151643);
  // encode() itself never adds it: the caller prepends bos_id()
  EXPECT_EQ(l->tok.encode("Hello world"), (Ids{9707, 1879}));

  testing::set_bool(img, "tokenizer.ggml.add_bos_token", false);
  l = testing::load_image(img);
  EXPECT_FALSE(l->tok.add_bos());

  img.erase("tokenizer.ggml.add_bos_token");
  img.erase("tokenizer.ggml.bos_token_id");
  l = testing::load_image(img);
  EXPECT_FALSE(l->tok.add_bos());
  EXPECT_EQ(l->tok.bos_id(), -1);
}

TEST(Load, NoChatTemplate) {
  auto img = testing::vocab_image();
  img.erase("tokenizer.chat_template");
  const auto l = testing::load_image(img);
  EXPECT_EQ(l->tok.chat_template(), nullptr);
}

TEST(Load, EmptyTokenTextsAreRenamed) {  // as llama.cpp does: "[EMPTY_<id>]"
  auto img = testing::vocab_image();
  auto tokens = testing::get_strings(img, "tokenizer.ggml.tokens");
  tokens[151700] = "";
  testing::set_strings(img, "tokenizer.ggml.tokens", tokens);
  const auto l = testing::load_image(img);
  EXPECT_EQ(l->tok.token_text(151700), "[EMPTY_151700]");
}

// The tiny model's 4099-token vocabulary against llama.cpp's tokenization of its golden prompts.
TEST(Load, TinyModelGoldenPrompts) {
  const auto f = gguf::File::open(testing::kTinyModelPath);
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  EXPECT_EQ(tok.n_vocab(), 4099);
  EXPECT_EQ(tok.eog_ids(), (Ids{4096, 4098}));  // <|endoftext|>, <|im_end|> (= eos)
  EXPECT_EQ(tok.eos_id(), 4098);
  EXPECT_FALSE(tok.add_bos());
  ASSERT_NE(tok.chat_template(), nullptr);
  EXPECT_TRUE(template_is_chatml(*tok.chat_template()));
  const std::string dir = golden::dir(MOE_TEST_DATA, "tiny-qwen3moe-q8_0");
  int checked = 0;
  for (const auto& run : golden::run_names(dir)) {
    const json_lite::Value j = json_lite::load(dir + "/" + run + ".json");
    if (j.at("prompt_kind").str != "text") continue;
    const std::string text = j.at("text").str;
    const Ids expected = j.at("prompt_ids").ints();
    EXPECT_EQ(tok.encode(text, true), expected) << run;
    EXPECT_EQ(tok.decode(expected), text) << run;
    ++checked;
  }
  EXPECT_EQ(checked, 3);
}

}  // namespace
}  // namespace moe::tok
