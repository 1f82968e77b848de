// Tokenization of hand-picked text (REFERENCE §6.3-§6.5). Ids come from llama.cpp (REFERENCE table,
// FIXTURES.md) or straight from the vocabulary's token list; pre-tokenizer split points are worked
// out by hand from the qwen2 rules and checked as token boundaries.
#include <gtest/gtest.h>

#include <algorithm>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

using testing::qwen2;
using testing::token_ends;
using testing::vocab_id;
using Ids = std::vector<int32_t>;

// Every given word boundary must be a token boundary, the tokens must decode to the text, and no
// token may cross a word: the words, tokenized one by one, give the same ids.
void expect_words(const std::vector<std::string>& words) {
  const Tokenizer& tok = qwen2();
  std::string text;
  std::vector<size_t> bounds;
  for (const auto& w : words) bounds.push_back((text += w).size());
  const Ids ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  const auto ends = token_ends(tok, ids);
  for (size_t b : bounds)
    EXPECT_TRUE(std::find(ends.begin(), ends.end(), b) != ends.end())
        << "no token boundary at byte " << b << " of '" << text << "'";
  Ids joined;
  for (const auto& w : words) {
    const Ids part = tok.encode(w);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  EXPECT_EQ(ids, joined) << "text: '" << text << "'";
}

TEST(Encode, ReferenceTable) {  // REFERENCE §6.5
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("Hello world"), (Ids{9707, 1879}));
  EXPECT_EQ(tok.encode(" Hello world"), (Ids{21927, 1879}));
  EXPECT_EQ(tok.encode("  Hello"), (Ids{220, 21927}));
  EXPECT_EQ(tok.encode("\n"), (Ids{198}));
  EXPECT_EQ(tok.encode("\n\n"), (Ids{271}));
  EXPECT_EQ(tok.encode("\n\n\n"), (Ids{1406}));
  EXPECT_EQ(tok.encode("\t\n"), (Ids{1572}));
  EXPECT_EQ(tok.encode("Hello, world!"), (Ids{9707, 11, 1879, 0}));
  EXPECT_EQ(tok.encode("333"), (Ids{18, 18, 18}));
  EXPECT_EQ(tok.encode("ied 4 \xC2\xBD months"), (Ids{1122, 220, 19, 220, 26062, 3951}));
  EXPECT_EQ(tok.encode("' era"), (Ids{6, 11385}));
  EXPECT_EQ(tok.encode("user"), (Ids{872}));
  EXPECT_EQ(tok.encode("assistant"), (Ids{77091}));
  EXPECT_EQ(tok.encode("system"), (Ids{8948}));
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Encode, ByteSymbols) {  // REFERENCE §6.2: ids 0-255 are the single-byte symbols
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("\n"), (Ids{198}));
  EXPECT_EQ(tok.encode(" "), (Ids{220}));
  EXPECT_EQ(tok.encode("\t"), (Ids{197}));
  EXPECT_EQ(tok.encode("!"), (Ids{0}));
  EXPECT_EQ(tok.encode("~"), (Ids{93}));
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, char(b));
    EXPECT_EQ(tok.token_text(vocab_id(tok, one)), testing::gpt2_encode(one));
    EXPECT_LT(vocab_id(tok, one), 256);
  }
}

TEST(Encode, EnglishWordsAreSingleTokens) {
  const Tokenizer& tok = qwen2();
  const std::vector<std::string> words = {"The", " quick", " brown", " fox", " jumps", " over",
                                          " the", " lazy", " dog", "."};
  Ids expected;
  std::string text;
  for (const auto& w : words) {
    const int32_t id = vocab_id(tok, w);
    ASSERT_GE(id, 0) << w;
    expected.push_back(id);
    text += w;
  }
  EXPECT_EQ(tok.encode(text), expected);
  expect_words(words);
}

TEST(Encode, CodeWithTabsAndIndentation) {
  // ":" takes the newline after it; a tab before letters is the optional prefix of a letter run;
  // a whitespace run before a word leaves its last character to that word.
  expect_words({"def", " f", "(x", "):\n", "\tif", " x", ":\n", "\t", "\treturn", " ", "1", "\n",
                "   ", " else", ":\n", "       ", " return", " ", "2", "\n"});
  expect_words({"int", " main", "()", " {\n", "   ", " printf", "(\"%", "d", "\\n", "\",", " ", "4",
                "2", ");\n", "}\n"});
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("    Hello\n    Hello"), (Ids{262, 21927, 198, 262, 21927}));
}

TEST(Encode, RunsOfSpacesAndNewlines) {
  const Tokenizer& tok = qwen2();
  expect_words({"a", " ", " b"});
  expect_words({"a", " \n\n", " b"});         // \s*[\r\n]+ ends after the last newline
  expect_words({"x", "   "});                 // at the end the whole run is one word
  expect_words({"x", "\r\n", "y"});
  expect_words({"x", " \n \n", "\t", " y"});  // run " \n \n\t " : up to the last \n, then "\t", " y"
  expect_words({"a", "\xC2\xA0", " b"});      // NO-BREAK SPACE is whitespace
  expect_words({"a", "\xE2\x80\xA8" "b"});     // LINE SEPARATOR is not CR/LF: it prefixes the letters
  // runs of spaces map to the multi-space tokens of the vocabulary
  for (int n = 1; n <= 16; ++n) {
    const std::string sp(size_t(n), ' ');
    const int32_t id = vocab_id(tok, sp);
    if (id >= 0) {
      EXPECT_EQ(tok.encode(sp), (Ids{id})) << n << " spaces";
    }
    const Ids ids = tok.encode(sp + "x");
    EXPECT_EQ(tok.decode(ids), sp + "x");
    EXPECT_EQ(ids.back(), vocab_id(tok, " x"));
  }
  const std::string nl(40, '\n');
  EXPECT_EQ(tok.decode(tok.encode(nl)), nl);
}

TEST(Encode, DigitsAreSplitOnePerToken) {
  const Tokenizer& tok = qwen2();
  const std::string num = "12345678901234567890";
  Ids expected;
  for (char c : num) expected.push_back(15 + (c - '0'));  // '0' is byte symbol 0x30 - 0x21
  EXPECT_EQ(tok.encode(num), expected);
  EXPECT_EQ(tok.encode("3.14"), (Ids{18, 13, 16, 19}));
  EXPECT_EQ(tok.encode("3333333"), (Ids(7, 18)));  // FIXTURES.md
  expect_words({"x", "1", "2", " ", "3", "\xC2\xBD"});            // ½ (No) is a number on its own
  expect_words({"\xD9\xA1", "\xD9\xA2", "\xD9\xA3"});             // Arabic-Indic digits (Nd)
  expect_words({"\xE2\x85\xAB", "\xE2\x85\xA0"});                 // Roman numerals (Nl)
  expect_words({"v", "2", ".", "0"});
}

TEST(Encode, ContractionsInAllCases) {
  for (const char* c : {"'s", "'S", "'t", "'T", "'m", "'M", "'d", "'D"}) {
    expect_words({"it", c, " ok"});
  }
  for (const char* c : {"'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'Ve", "'ll", "'LL", "'lL"}) {
    expect_words({"we", c, " ok"});
  }
  expect_words({"I", "'m"});
  expect_words({"don", "'t", " stop"});
  expect_words({"'x"});                     // not a contraction: the apostrophe prefixes the letters
  expect_words({"rock", " '", "n", "'\n"});
  expect_words({"don", "\xE2\x80\x99t"});   // a typographic apostrophe is not a contraction
  const Tokenizer& tok = qwen2();
  EXPECT_EQ(tok.encode("'s"), (Ids{vocab_id(tok, "'s")}));
  EXPECT_EQ(tok.encode("'ll"), (Ids{vocab_id(tok, "'ll")}));
}

TEST(Encode, Scripts) {
  // CJK letters and Latin letters form one letter run; CJK punctuation prefixes the next run.
  expect_words({"\xE6\x88\x91\xE6\x83\xB3\xE5\x9C\xA8" "apple" "\xE5\xB7\xA5\xE4\xBD\x9C"});
  expect_words({"\xE6\x9D\xB1\xE4\xBA\xAC", "\xE3\x80\x81\xE5\xA4\xA7\xE9\x98\xAA", "\xE3\x80\x82"});
  expect_words({"\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4", " \xED\x85\x8C\xEC\x8A\xA4\xED\x8A\xB8"});
  // Arabic
  expect_words({"\xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7",
                " \xD8\xA8\xD8\xA7\xD9\x84\xD8\xB9\xD8\xA7\xD9\x84\xD9\x85"});
  // Hindi: vowel signs and virama are marks, not letters, so letter runs stop at them
  // नमस्ते दुनिया -> नमस | ्त | े | " द" | ुन | िय | ा
  expect_words({"\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8", "\xE0\xA5\x8D\xE0\xA4\xA4", "\xE0\xA5\x87",
                " \xE0\xA4\xA6", "\xE0\xA5\x81\xE0\xA4\xA8", "\xE0\xA4\xBF\xE0\xA4\xAF",
                "\xE0\xA4\xBE"});
  // Cyrillic
  expect_words({"\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82", ",", " \xD0\xBC\xD0\xB8\xD1\x80",
                "!"});
}

TEST(Encode, EmojiSequences) {
  const Tokenizer& tok = qwen2();
  const std::string family = "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7";
  const std::string thumbs_medium = "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD";  // U+1F44D U+1F3FD
  const std::string flag = "\xF0\x9F\x87\xAB\xF0\x9F\x87\xB7";            // regional indicators F R
  // Emoji, ZWJ and skin-tone modifiers are all non-letter symbols: one symbol run each.
  expect_words({"hi", " " + family, " " + thumbs_medium + "!!", " ok"});
  expect_words({"x", flag + "\xF0\x9F\x98\xB6\xE2\x80\x8D\xF0\x9F\x8C\xAB\xEF\xB8\x8F", "\n"});
  for (const std::string& e : {family, thumbs_medium, flag}) EXPECT_EQ(tok.decode(tok.encode(e)), e);
  const int32_t check = vocab_id(tok, "\xE2\x9C\x85");  // ✅ has a token of its own
  ASSERT_GE(check, 0);
  EXPECT_EQ(tok.encode("\xE2\x9C\x85"), (Ids{check}));
  EXPECT_EQ(tok.encode(" \xF0\x9F\xA6\x99"), (Ids{11162, 99, 247}));  // llama.cpp's vectors (" 🦙")
}

TEST(Encode, CombiningMarksAreNotNormalized) {
  const Tokenizer& tok = qwen2();
  const std::string nfc = "caf\xC3\xA9";     // é precomposed
  const std::string nfd = "cafe\xCC\x81";    // e + COMBINING ACUTE ACCENT
  EXPECT_NE(tok.encode(nfc), tok.encode(nfd));
  EXPECT_EQ(tok.decode(tok.encode(nfd)), nfd);
  expect_words({"cafe", "\xCC\x81"});
  expect_words({"cafe", "\xCC\x81s"});  // the mark is the optional prefix of the next letter run
  expect_words({"a", "\xCC\x81\xCC\x82\xCC\x83", " b"});
}

TEST(Encode, InvalidUtf8BecomesReplacementCharacter) {
  const Tokenizer& tok = qwen2();
  const std::string fffd = "\xEF\xBF\xBD";
  const std::pair<std::string, std::string> cases[] = {
      {"a\xFF" "b", "a" + fffd + "b"},
      {"\xE4\xB8", fffd + fffd},                          // truncated 3-byte sequence
      {"\xE4\xB8" "A", fffd + fffd + "A"},
      {"\xC0\x80", fffd + fffd},                          // overlong NUL
      {"\xED\xA0\x80", fffd + fffd + fffd},               // UTF-16 surrogate
      {"\xF4\x90\x80\x80", fffd + fffd + fffd + fffd},    // above U+10FFFF
      {"\x80\x80 x", fffd + fffd + " x"},                 // stray continuation bytes
      {"ok \xF0\x9F\xA6", "ok " + fffd + fffd + fffd},    // cut emoji
  };
  for (const auto& [bad, good] : cases) {
    EXPECT_EQ(tok.encode(bad), tok.encode(good)) << testing::replace_invalid(bad);
    EXPECT_EQ(tok.decode(tok.encode(bad)), good);
  }
}

TEST(Encode, IdsOutsideTheVocabularyAreRejected) {
  const Tokenizer& tok = qwen2();
  EXPECT_THROW(tok.piece(-1), Error);
  EXPECT_THROW(tok.piece(tok.n_vocab()), Error);
  const Ids bad = {9707, 151936};
  EXPECT_THROW(tok.decode(bad), Error);
  EXPECT_FALSE(tok.is_eog(-1));
  EXPECT_FALSE(tok.is_eog(1 << 30));
}

}  // namespace
}  // namespace moe::tok
