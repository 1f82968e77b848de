// decode(encode(s)) == s for valid UTF-8 (hand-picked and random strings), random bytes never
// crash and come back with every malformed byte replaced by U+FFFD.
#include <gtest/gtest.h>

#include <random>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using testing::qwen2;

void append_cp(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

// Random text drawn from ranges that exercise every pre-tokenizer rule.
std::string random_text(std::mt19937& rng, size_t max_cps) {
  static const std::pair<uint32_t, uint32_t> ranges[] = {
      {0x20, 0x7E},       {0x20, 0x7E},      {0x20, 0x7E},      {'0', '9'},        {0x09, 0x0D},
      {0x00, 0x1F},       {0x7F, 0xFF},      {0x100, 0x24F},    {0x300, 0x36F},    {0x400, 0x4FF},
      {0x600, 0x6FF},     {0x900, 0x97F},    {0x1780, 0x17FF},  {0x2000, 0x206F},  {0x3000, 0x303F},
      {0x4E00, 0x9FFF},   {0xAC00, 0xD7A3},  {0xE000, 0xE0FF},  {0xFFF0, 0xFFFF},  {0x1F300, 0x1FAFF},
      {0x10000, 0x10FFFF}};
  std::uniform_int_distribution<size_t> len_d(0, max_cps), range_d(0, std::size(ranges) - 1);
  std::string s;
  const size_t n = len_d(rng);
  for (size_t i = 0; i < n; ++i) {
    const auto [lo, hi] = ranges[range_d(rng)];
    uint32_t cp = std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
    if (rng() % 16 == 0) {
      s += "'";
      s += "sStTmMdDrRvVlL"[rng() % 14];
    }
    append_cp(s, cp);
  }
  return s;
}

TEST(RoundTrip, HandPicked) {
  const Tokenizer& tok = qwen2();
  for (const std::string& s : std::vector<std::string>{"", " ", "\n", "\r\n\r\n", "a", "Hello, world!", "  leading and trailing  ", "\t\t\tx\n\n",
        "C'est l'\xC3\xA9t\xC3\xA9, n'est-ce pas?", "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C",
        "\xF0\x9F\x91\xA9\xF0\x9F\x8F\xBD\xE2\x80\x8D\xF0\x9F\x92\xBB", std::string("nul\0byte", 8),
        "\xEF\xBF\xBD", "\xF4\x8F\xBF\xBF", "<|im_start|>system\n<|im_end|>", "[PAD151646]</s>"}) {
    for (bool special : {true, false}) {
      const auto ids = tok.encode(s, special);
      EXPECT_EQ(tok.decode(ids), s) << s;
    }
  }
}

TEST(RoundTrip, RandomValidUtf8) {
  const Tokenizer& tok = qwen2();
  std::mt19937 rng(12345);
  for (int i = 0; i < 3000; ++i) {
    const std::string s = random_text(rng, 48);
    ASSERT_TRUE(testing::valid_utf8(s));
    const auto ids = tok.encode(s, i % 2 == 0);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.n_vocab());
    ASSERT_EQ(tok.decode(ids), s) << "case " << i;
  }
}

TEST(RoundTrip, RandomTextWithSpecialTokens) {
  const Tokenizer& tok = qwen2();
  std::mt19937 rng(777);
  const char* specials[] = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "[PAD151800]", "</s>"};
  for (int i = 0; i < 1000; ++i) {
    std::string s;
    for (int k = 0; k < 4; ++k) {
      s += random_text(rng, 8);
      if (rng() % 2) s += specials[rng() % std::size(specials)];
    }
    ASSERT_EQ(tok.decode(tok.encode(s, true)), s) << "case " << i;
    ASSERT_EQ(tok.decode(tok.encode(s, false)), s) << "case " << i;
  }
}

TEST(RoundTrip, RandomBytesNeverCrash) {
  const Tokenizer& tok = qwen2();
  std::mt19937 rng(4242);
  for (int i = 0; i < 3000; ++i) {
    std::string s(rng() % 40, '\0');
    for (auto& c : s) c = char(rng() % 4 == 0 ? 0x80 + rng() % 0x80 : rng() % 256);
    const auto ids = tok.encode(s, true);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.n_vocab());
    ASSERT_EQ(tok.decode(ids), testing::replace_invalid(s)) << "case " << i;
  }
}

TEST(RoundTrip, LongInputs) {
  const Tokenizer& tok = qwen2();
  std::string big;
  for (int i = 0; i < 2000; ++i) big += "word" + std::to_string(i) + (i % 7 ? " " : ".\n");
  big += std::string(5000, ' ') + std::string(3000, 'a') + std::string(2000, '!');
  EXPECT_EQ(tok.decode(tok.encode(big)), big);
}

}  // namespace
}  // namespace moe::tok
