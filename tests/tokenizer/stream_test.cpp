// The streaming detokenizer (REFERENCE §6.8): output is always well-formed UTF-8, bytes are held
// until their character completes, and the concatenation equals the text.
#include <gtest/gtest.h>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using testing::qwen2;
using testing::valid_utf8;

const std::string kMultiByte =
    "na\xC3\xAFve caf\xC3\xA9 \xE6\x9D\xB1\xE4\xBA\xAC \xD0\x9F\xD1\x80\xD0\xB8 "
    "\xF0\x9F\xA6\x99\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 \xE0\xA4\xA8\xE0\xA5\x8D "
    "\xD9\x85\xD8\xB1 e\xCC\x81 \xF4\x8F\xBF\xBF!";

TEST(Stream, EverySplitPoint) {
  const Tokenizer& tok = qwen2();
  for (size_t k = 0; k <= kMultiByte.size(); ++k) {
    StreamDecoder d(tok);
    const std::string a = d.push_bytes(kMultiByte.substr(0, k));
    const std::string b = d.push_bytes(kMultiByte.substr(k));
    const std::string c = d.finish();
    EXPECT_TRUE(valid_utf8(a)) << k;
    EXPECT_TRUE(valid_utf8(b)) << k;
    EXPECT_EQ(a + b + c, kMultiByte) << k;
    EXPECT_TRUE(c.empty());
    // the first part is exactly the complete characters of the prefix
    size_t whole = k;
    while (whole > 0 && !valid_utf8(kMultiByte.substr(0, whole))) --whole;
    EXPECT_EQ(a, kMultiByte.substr(0, whole)) << k;
  }
}

TEST(Stream, EveryPairOfSplitPoints) {
  const Tokenizer& tok = qwen2();
  std::string s = kMultiByte.substr(0, 44);
  while (!valid_utf8(s)) s.pop_back();  // whole characters only: nothing is left for finish()
  ASSERT_GE(s.size(), 36u);
  for (size_t i = 0; i <= s.size(); ++i)
    for (size_t j = i; j <= s.size(); ++j) {
      StreamDecoder d(tok);
      std::string out = d.push_bytes(s.substr(0, i));
      const std::string mid = d.push_bytes(s.substr(i, j - i));
      EXPECT_TRUE(valid_utf8(mid));
      out += mid;
      out += d.push_bytes(s.substr(j));
      out += d.finish();
      ASSERT_EQ(out, s) << i << "," << j;
    }
}

TEST(Stream, ByteByByte) {
  const Tokenizer& tok = qwen2();
  StreamDecoder d(tok);
  std::string out;
  for (char c : kMultiByte) {
    const std::string part = d.push_bytes(std::string(1, c));
    EXPECT_TRUE(valid_utf8(part));
    out += part;
  }
  out += d.finish();
  EXPECT_EQ(out, kMultiByte);
}

TEST(Stream, TokensSplittingACharacter) {
  const Tokenizer& tok = qwen2();
  // " 🦙" is three tokens (llama.cpp's vectors): the 4-byte character is cut between them
  StreamDecoder d(tok);
  EXPECT_EQ(d.push(11162), " ");
  EXPECT_EQ(d.push(99), "");
  EXPECT_EQ(d.push(247), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(d.finish(), "");
  // every token of multi-byte text, one at a time
  const auto ids = tok.encode(kMultiByte);
  StreamDecoder d2(tok);
  std::string out;
  for (int32_t id : ids) {
    const std::string part = d2.push(id);
    EXPECT_TRUE(valid_utf8(part));
    out += part;
  }
  out += d2.finish();
  EXPECT_EQ(out, kMultiByte);
}

TEST(Stream, SpecialTokensStreamTheirText) {
  const Tokenizer& tok = qwen2();
  StreamDecoder d(tok);
  EXPECT_EQ(d.push(151645), "<|im_end|>");
}

TEST(Stream, InvalidBytesBecomeReplacementCharacters) {
  const Tokenizer& tok = qwen2();
  const std::string fffd = "\xEF\xBF\xBD";
  {
    StreamDecoder d(tok);
    EXPECT_EQ(d.push_bytes("a\xFF" "b"), "a" + fffd + "b");  // can never complete: at once
    EXPECT_EQ(d.push_bytes("\x80"), fffd);
  }
  {
    StreamDecoder d(tok);
    EXPECT_EQ(d.push_bytes("x\xE4\xB8"), "x");  // held: may still complete
    EXPECT_EQ(d.finish(), fffd + fffd);          // never completed
    EXPECT_EQ(d.finish(), "");
  }
  {
    StreamDecoder d(tok);
    EXPECT_EQ(d.push_bytes("\xE4"), "");
    EXPECT_EQ(d.push_bytes("A"), fffd + "A");  // the continuation never came
  }
  {
    StreamDecoder d(tok);
    EXPECT_EQ(d.push_bytes("\xED\xA0"), fffd + fffd);  // surrogate prefix: never valid
    EXPECT_EQ(d.push_bytes("\xF4\x90"), fffd + fffd);  // above U+10FFFF
    EXPECT_EQ(d.push_bytes("\xC0"), fffd);             // overlong lead byte
  }
  // token 99 alone is a continuation byte without a lead
  StreamDecoder d(tok);
  std::string lone = d.push(99);
  lone += d.finish();
  EXPECT_TRUE(valid_utf8(lone));
}

}  // namespace
}  // namespace moe::tok
