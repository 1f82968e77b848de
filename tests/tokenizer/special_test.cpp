// Special tokens (REFERENCE §6.6, FIXTURES.md): matched in the text before BPE, longest first;
// USER_DEFINED ones even without special parsing; llama.cpp's end-of-generation detection.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using testing::qwen2;
using testing::vocab_id;
using Ids = std::vector<int32_t>;

constexpr int32_t kEndOfText = 151643, kImStart = 151644, kImEnd = 151645, kSlashS = 128247;

TEST(Special, ControlTokensInsideText) {
  const Tokenizer& tok = qwen2();
  const Ids ids = tok.encode("Hello<|im_end|>world");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], 9707);
  EXPECT_EQ(ids[1], kImEnd);
  EXPECT_EQ(Ids(ids.begin() + 2, ids.end()), tok.encode("world"));
  EXPECT_EQ(tok.encode("<|im_start|>user\nHi<|im_end|>\n").front(), kImStart);
  EXPECT_EQ(tok.encode("<|im_end|><|im_end|><|endoftext|>"), (Ids{kImEnd, kImEnd, kEndOfText}));
  // no whitespace is absorbed around special tokens; the fragment end closes a whitespace run
  const Ids sp = tok.encode("Hi  <|im_end|>  x");
  ASSERT_EQ(sp.size(), 5u);
  EXPECT_EQ(sp[1], 256);  // "  "
  EXPECT_EQ(sp[2], kImEnd);
  EXPECT_EQ(sp[3], 220);  // " ": the run before "x" keeps its last space for " x"
  EXPECT_EQ(sp[4], vocab_id(tok, " x"));
}

TEST(Special, PartialAndBrokenMarkersAreText) {
  const Tokenizer& tok = qwen2();
  for (const char* s : {"<|im_end", "<|im_end |>", "|im_end|>", "<|IM_END|>", "<|im_\xE2\x80\x8B" "end|>"}) {
    const Ids ids = tok.encode(s);
    EXPECT_TRUE(std::none_of(ids.begin(), ids.end(), [](int32_t id) { return id >= kEndOfText; })) << s;
    EXPECT_EQ(tok.decode(ids), s);
  }
}

TEST(Special, ParseSpecialOffKeepsControlTextAsText) {
  const Tokenizer& tok = qwen2();
  const std::string s = "<|im_start|>user\nx<|im_end|>";
  const Ids ids = tok.encode(s, false);
  EXPECT_TRUE(std::none_of(ids.begin(), ids.end(), [](int32_t id) { return id >= kEndOfText; }));
  EXPECT_EQ(tok.decode(ids), s);
}

TEST(Special, UserDefinedTokensMatchEvenWithoutSpecialParsing) {  // FIXTURES.md
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("a[PAD151700]b", true), (Ids{64, 151700, 65}));
  EXPECT_EQ(tok.encode("a[PAD151700]b", false), (Ids{64, 151700, 65}));
  EXPECT_EQ(tok.decode(Ids{151700}), "[PAD151700]");
  EXPECT_EQ(tok.encode("[PAD151935][PAD151646]"), (Ids{151935, 151646}));
}

TEST(Special, SlashSIsEndOfGenerationAndControl) {  // FIXTURES.md: llama.cpp's observed behaviour
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("</s>", true), (Ids{kSlashS}));
  EXPECT_EQ(tok.encode("</s>", false), (Ids{522, 82, 29}));
  EXPECT_TRUE(tok.is_eog(kSlashS));
  EXPECT_EQ(tok.piece(kSlashS), "</s>");
}

TEST(Special, EndOfGenerationSet) {
  const Tokenizer& tok = qwen2();
  // <|endoftext|> (also bos/eos/pad), <|im_end|>, and the auto-detected </s>
  EXPECT_EQ(tok.eog_ids(), (Ids{kSlashS, kEndOfText, kImEnd}));
  EXPECT_TRUE(tok.is_eog(kEndOfText));
  EXPECT_TRUE(tok.is_eog(kImEnd));
  EXPECT_FALSE(tok.is_eog(kImStart));
  EXPECT_FALSE(tok.is_eog(198));
  EXPECT_EQ(tok.bos_id(), kEndOfText);
  EXPECT_EQ(tok.eos_id(), kEndOfText);
  EXPECT_FALSE(tok.add_bos());  // no add_bos_token key: no BOS for qwen2
  EXPECT_FALSE(tok.add_eos());
}

TEST(Special, ControlPiecesRenderTheirText) {
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.piece(kImStart), "<|im_start|>");
  EXPECT_EQ(tok.piece(kImEnd), "<|im_end|>");
  EXPECT_EQ(tok.piece(198), "\n");
  EXPECT_EQ(tok.piece(220), " ");
  EXPECT_EQ(tok.decode(Ids{kImStart, 872, 198}), "<|im_start|>user\n");
}

// Longest candidates are cut first, over the whole text, before shorter ones (llama.cpp's
// tokenizer_st_partition); checked on a vocabulary with overlapping user-defined tokens.
TEST(Special, LongestCandidateWinsOverlaps) {
  auto img = testing::vocab_image();
  auto tokens = testing::get_strings(img, "tokenizer.ggml.tokens");
  tokens[151700] = "ab";   // user-defined (type 4 in the fixture)
  tokens[151701] = "bcd";
  tokens[151702] = "xx";
  testing::set_strings(img, "tokenizer.ggml.tokens", tokens);
  const auto l = testing::load_image(img);
  const Tokenizer& tok = l->tok;
  // "bcd" is longer, so it is cut first even though "ab" starts earlier
  EXPECT_EQ(tok.encode("abcd"), (Ids{vocab_id(qwen2(), "a"), 151701}));
  EXPECT_EQ(tok.encode("abab"), (Ids{151700, 151700}));
  // non-overlapping occurrences, left to right
  EXPECT_EQ(tok.encode("xxx"), (Ids{151702, vocab_id(qwen2(), "x")}));
  EXPECT_EQ(tok.encode("xxxx"), (Ids{151702, 151702}));
}

// A Qwen3-style vocabulary: the Qwen2 fixture with Qwen3's added tokens (REFERENCE §6.6 table).
const testing::Loaded* qwen3_like() {
  static const auto loaded = [] {
  auto img = testing::vocab_image();
  auto tokens = testing::get_strings(img, "tokenizer.ggml.tokens");
  auto types = testing::get_i32s(img, "tokenizer.ggml.token_type");
  const std::pair<int32_t, const char*> added[] = {
      {151646, "<|object_ref_start|>"}, {151647, "<|object_ref_end|>"}, {151648, "<|box_start|>"},
      {151649, "<|box_end|>"}, {151650, "<|quad_start|>"}, {151651, "<|quad_end|>"},
      {151652, "<|vision_start|>"}, {151653, "<|vision_end|>"}, {151654, "<|vision_pad|>"},
      {151655, "<|image_pad|>"}, {151656, "<|video_pad|>"}, {151657, "<tool_call>"},
      {151658, "</tool_call>"}, {151659, "<|fim_prefix|>"}, {151660, "<|fim_middle|>"},
      {151661, "<|fim_suffix|>"}, {151662, "<|fim_pad|>"}, {151663, "<|repo_name|>"},
      {151664, "<|file_sep|>"}, {151665, "<tool_response>"}, {151666, "</tool_response>"},
      {151667, "<think>"}, {151668, "</think>"}};
  for (const auto& [id, text] : added) {
    tokens[size_t(id)] = text;
    const std::string t = text;
    types[size_t(id)] = (t.size() > 4 && t.substr(0, 2) == "<|") ? 3 : 4;
  }
  for (size_t id = 151669; id < tokens.size(); ++id) types[id] = 5;  // UNUSED fillers
  testing::set_strings(img, "tokenizer.ggml.tokens", tokens);
  testing::set_i32s(img, "tokenizer.ggml.token_type", types);
  img.set_u32("tokenizer.ggml.eos_token_id", 151645);
  return testing::load_image(img);
  }();
  return loaded.get();
}

TEST(Special, Qwen3EndOfGenerationSet) {
  const auto* l = qwen3_like();
  // REFERENCE §6.6 {151643, 151645, 151662, 151663, 151664}, plus </s> (FIXTURES.md)
  EXPECT_EQ(l->tok.eog_ids(), (Ids{kSlashS, 151643, 151645, 151662, 151663, 151664}));
  EXPECT_EQ(l->tok.eos_id(), 151645);
}

TEST(Special, Qwen3ThinkTokens) {
  const auto* l = qwen3_like();
  const Tokenizer& tok = l->tok;
  EXPECT_EQ(tok.encode("<think>\n\n</think>\n\n"), (Ids{151667, 271, 151668, 271}));  // §6.9
  EXPECT_EQ(tok.encode("<think>\n\n</think>\n\n", false), (Ids{151667, 271, 151668, 271}));
  EXPECT_EQ(tok.encode("<tool_call>\n{}"), (Ids{151657, 198, vocab_id(tok, "{}")}));
  // UNUSED fillers are never matched and render as nothing
  EXPECT_EQ(tok.piece(151700), "");
  const Ids filler = tok.encode("[PAD151700]");
  EXPECT_GT(filler.size(), 1u);
  EXPECT_EQ(tok.decode(filler), "[PAD151700]");
}

}  // namespace
}  // namespace moe::tok

namespace moe::tok {
namespace {

// The partition against a literal transcription of llama.cpp's loop (for each candidate, longest
// first, search every remaining text fragment left to right), on random text made of overlapping
// user-defined tokens. Raw fragments contain no candidate afterwards, so they are tokenized alone.
TEST(Special, PartitionMatchesTheReferenceLoop) {
  const std::vector<std::pair<int32_t, std::string>> cands = {
      {151700, "ab"}, {151701, "bcd"}, {151702, "xx"}, {151703, "abc"}, {151704, "cda"},
      {151705, "dab"}, {151706, "abcdab"}, {151707, "b"}};
  auto img = testing::vocab_image();
  auto tokens = testing::get_strings(img, "tokenizer.ggml.tokens");
  for (const auto& [id, text] : cands) tokens[size_t(id)] = text;
  testing::set_strings(img, "tokenizer.ggml.tokens", tokens);
  const auto l = testing::load_image(img);
  const Tokenizer& tok = l->tok;

  // priority: longer first; equal lengths by id (llama.cpp leaves that order unspecified)
  auto order = cands;
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
  struct Frag {
    std::string text;
    int32_t id;  // -1: raw text
  };
  std::mt19937 rng(99);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string text;
    const size_t len = rng() % 24;
    for (size_t i = 0; i < len; ++i) text += "abcdx "[rng() % 6];
    std::vector<Frag> frags = {{text, -1}};
    for (const auto& [id, cand] : order) {
      std::vector<Frag> next;
      for (const Frag& f : frags) {
        if (f.id >= 0) {
          next.push_back(f);
          continue;
        }
        size_t at = 0;
        while (true) {
          const size_t m = f.text.find(cand, at);
          if (m == std::string::npos) break;
          if (m > at) next.push_back({f.text.substr(at, m - at), -1});
          next.push_back({cand, id});
          at = m + cand.size();
        }
        if (at < f.text.size()) next.push_back({f.text.substr(at), -1});
      }
      frags = std::move(next);
    }
    Ids expected;
    for (const Frag& f : frags) {
      if (f.id >= 0) {
        expected.push_back(f.id);
      } else {
        const Ids part = tok.encode(f.text);
        for (int32_t id : part) ASSERT_LT(id, 151700) << "a candidate survived in '" << f.text << "'";
        expected.insert(expected.end(), part.begin(), part.end());
      }
    }
    ASSERT_EQ(tok.encode(text), expected) << "text '" << text << "'";
    ASSERT_EQ(tok.encode(text, false), expected) << "text '" << text << "'";
  }
}

}  // namespace
}  // namespace moe::tok
