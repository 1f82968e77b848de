// BPE merge order (REFERENCE §6.4) on small synthetic vocabularies, where the expected result can be
// worked out by hand: lowest rank first, leftmost on ties, merges never cross words, and llama.cpp's
// per-byte fallback when a merge result is missing from the vocabulary.
#include <gtest/gtest.h>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using Ids = std::vector<int32_t>;

// 256 byte symbols (ids 0-255, by byte value) followed by `extra` tokens, with `merges`.
std::unique_ptr<testing::Loaded> synthetic(const std::vector<std::string>& extra,
                                           const std::vector<std::string>& merges) {
  gguf_test::Image img;
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(testing::gpt2_encode(std::string(1, char(b))));
  for (const auto& e : extra) tokens.push_back(e);
  testing::set_string(img, "general.architecture", "test");
  testing::set_string(img, "tokenizer.ggml.model", "gpt2");
  testing::set_string(img, "tokenizer.ggml.pre", "qwen2");
  testing::set_strings(img, "tokenizer.ggml.tokens", tokens);
  testing::set_strings(img, "tokenizer.ggml.merges", merges);
  return testing::load_image(img);
}

int32_t byte_id(char c) { return static_cast<unsigned char>(c); }

TEST(Bpe, LowestRankFirst) {
  // "b c" has rank 0, "a b" rank 1: in "abc" the pair bc merges first although ab is leftmost
  const auto l = synthetic({"bc", "ab"}, {"b c", "a b"});
  EXPECT_EQ(l->tok.encode("abc"), (Ids{byte_id('a'), 256}));
  EXPECT_EQ(l->tok.encode("abd"), (Ids{257, byte_id('d')}));
}

TEST(Bpe, LeftmostOnEqualRank) {
  const auto l = synthetic({"aa", "aaaa"}, {"a a", "aa aa"});
  EXPECT_EQ(l->tok.encode("aaa"), (Ids{256, byte_id('a')}));
  EXPECT_EQ(l->tok.encode("aaaa"), (Ids{257}));
  EXPECT_EQ(l->tok.encode("aaaaa"), (Ids{257, byte_id('a')}));
  EXPECT_EQ(l->tok.encode("aaaaaa"), (Ids{257, 256}));
}

TEST(Bpe, MergesChainAndReevaluateNeighbours) {
  // after "a b" -> "ab", the new pair ("ab", "c") becomes possible although its rank is above "c d"
  const auto l = synthetic({"ab", "cd", "abc", "abcd"}, {"a b", "c d", "ab c", "ab cd"});
  EXPECT_EQ(l->tok.encode("abcd"), (Ids{259}));  // a b -> ab, c d -> cd, ab cd -> abcd
  EXPECT_EQ(l->tok.encode("abc"), (Ids{258}));
  EXPECT_EQ(l->tok.encode("abce"), (Ids{258, byte_id('e')}));
}

TEST(Bpe, NeverAcrossWords) {
  // "x y" would merge x and y, but " y" starts a new pre-token word
  const auto l = synthetic({"xy", "x\xC4\xA0"}, {"x y", "x \xC4\xA0"});
  EXPECT_EQ(l->tok.encode("xy"), (Ids{256}));
  EXPECT_EQ(l->tok.encode("x y"), (Ids{byte_id('x'), byte_id(' '), byte_id('y')}));
}

TEST(Bpe, FirstSpaceAfterTheFirstCharacterSplitsAMerge) {
  // a merge line is split at the first space at index >= 1 (REFERENCE §6.4); a line without one
  // is ignored
  const auto l = synthetic({"ab"}, {"nospace", "a b"});
  EXPECT_EQ(l->tok.encode("ab"), (Ids{256}));
}

TEST(Bpe, MissingMergeResultFallsBackPerByte) {
  // the merge result "xy" is not a token: llama.cpp looks up each byte of the symbol alone
  const auto l = synthetic({}, {"x y"});
  EXPECT_EQ(l->tok.encode("xy"), (Ids{byte_id('x'), byte_id('y')}));
  // For a non-ASCII symbol the single bytes of its encoded form are not tokens and are dropped
  // (llama.cpp's behaviour): "Ġa" (C4 A0 61) keeps only "a".
  const auto m = synthetic({}, {"\xC4\xA0 a"});
  EXPECT_EQ(m->tok.encode(" a"), (Ids{byte_id('a')}));
}

TEST(Bpe, DuplicateMergesKeepTheFirstRank) {
  // "b c" appears at rank 0 and again at rank 2; "a b" (rank 1) must lose to the first entry
  const auto l = synthetic({"bc", "ab"}, {"b c", "a b", "b c"});
  EXPECT_EQ(l->tok.encode("abc"), (Ids{byte_id('a'), 256}));
}

TEST(Bpe, LongWordsStayLinear) {
  // a long word of one repeated byte merges pairwise, level by level, leftmost first
  const auto l = synthetic({"aa", "aaaa", "aaaaaaaa"}, {"a a", "aa aa", "aaaa aaaa"});
  const std::string w(20000, 'a');
  const Ids ids = l->tok.encode(w);
  EXPECT_EQ(ids, Ids(2500, 258));
}

}  // namespace
}  // namespace moe::tok
