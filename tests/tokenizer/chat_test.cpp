// The ChatML prompt (REFERENCE §6.9, CLI.md --system / --thinking) and template recognition.
#include <gtest/gtest.h>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using Ids = std::vector<int32_t>;

const std::string kQwen3Like =
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false "
    "%}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

const std::string kLlama3 =
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

TEST(Chat, ThinkingOffIsTheDefault) {
  ChatRequest r;
  r.user = "What is 2+2?";
  EXPECT_FALSE(r.thinking);
  EXPECT_EQ(render_chat(&kQwen3Like, r),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(Chat, ThinkingOn) {
  ChatRequest r{"What is 2+2?", std::nullopt, true};
  EXPECT_EQ(render_chat(&kQwen3Like, r),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Chat, SystemMessage) {
  ChatRequest r{"Hi", std::string("You are terse."), true};
  EXPECT_EQ(render_chat(&kQwen3Like, r),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  r.thinking = false;
  EXPECT_EQ(render_chat(&kQwen3Like, r),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(Chat, TextIsInsertedVerbatim) {
  ChatRequest r{"  line1\n\tline2 <b>{{ x }}</b>  ", std::string(""), true};
  EXPECT_EQ(render_chat(nullptr, r),
            "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n  line1\n\tline2 <b>{{ x }}</b>  "
            "<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Chat, NoTemplateStillRendersChatML) {  // --chat on a GGUF without a template
  ChatRequest r{"x", std::nullopt, false};
  EXPECT_EQ(render_chat(nullptr, r),
            "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(Chat, ThinkBlockOnlyWhereTheTemplateHasTheSwitch) {
  // Qwen2's ChatML template (the vocab fixture's) has no enable_thinking: it renders no think block.
  const std::string qwen2 =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  ChatRequest r{"x", std::nullopt, false};
  EXPECT_EQ(render_chat(&qwen2, r), "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_FALSE(template_has_thinking(&qwen2));
  EXPECT_TRUE(template_has_thinking(&kQwen3Like));
  EXPECT_TRUE(template_has_thinking(nullptr));
}

TEST(Chat, NonChatMLTemplateIsRefused) {
  EXPECT_FALSE(template_is_chatml(kLlama3));
  EXPECT_FALSE(template_is_chatml(""));
  EXPECT_FALSE(template_is_chatml("{{ messages[0]['content'] }}"));
  try {
    render_chat(&kLlama3, ChatRequest{"x", std::nullopt, false});
    ADD_FAILURE() << "a non-ChatML template was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::unsupported);
    EXPECT_NE(std::string(e.what()).find("ChatML"), std::string::npos) << e.what();
  }
}

TEST(Chat, FixtureTemplatesAreChatML) {
  EXPECT_TRUE(template_is_chatml(kQwen3Like));
  const Tokenizer& tok = testing::qwen2();
  ASSERT_NE(tok.chat_template(), nullptr);
  EXPECT_TRUE(template_is_chatml(*tok.chat_template()));
  const auto f = gguf::File::open(testing::kTinyModelPath);
  const auto tiny = Tokenizer::from_gguf(*f);
  ASSERT_NE(tiny.chat_template(), nullptr);
  EXPECT_EQ(*tiny.chat_template(), kQwen3Like);  // FIXTURES.md gives the template text
}

TEST(Chat, RenderedPromptTokenizes) {  // REFERENCE §6.9: 151644 872 198 <user> 151645 198 151644 77091 198
  const Tokenizer& tok = testing::qwen2();
  const std::string user = "What is 2+2?";
  const Ids ids = tok.encode(render_chat(tok.chat_template(), ChatRequest{user, std::nullopt, true}));
  Ids expected = {151644, 872, 198};
  const Ids body = tok.encode(user);
  expected.insert(expected.end(), body.begin(), body.end());
  expected.insert(expected.end(), {151645, 198, 151644, 77091, 198});
  EXPECT_EQ(ids, expected);
  const Ids sys = tok.encode(render_chat(nullptr, ChatRequest{user, std::string("Be brief."), true}));
  ASSERT_GE(sys.size(), 3u);
  EXPECT_EQ((Ids{sys[0], sys[1], sys[2]}), (Ids{151644, 8948, 198}));
}

}  // namespace
}  // namespace moe::tok
