// llama.cpp's own tokenizer vectors for this vocabulary (tests/data/ggml-vocab-qwen2.gguf.inp/.out,
// FIXTURES.md): produced by llama.cpp's test-tokenizer-0 (no BOS, special parsing off).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "tok_fixture.hpp"

namespace moe::tok {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Vector {
  std::string text;
  std::vector<int32_t> ids;
};

std::vector<Vector> load_vectors() {
  const std::string inp = read_all(testing::kVocabPath + ".inp");
  const std::string outp = read_all(testing::kVocabPath + ".out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t at = 0; at < inp.size();) {
    const size_t e = inp.find(sep, at);
    if (e == std::string::npos) break;
    texts.push_back(inp.substr(at, e - at));
    at = e + sep.size();
  }
  std::vector<Vector> v;
  std::istringstream lines(outp);
  std::string line;
  for (const auto& t : texts) {
    std::getline(lines, line);
    Vector x{t, {}};
    std::istringstream ids(line);
    int32_t id;
    while (ids >> id) x.ids.push_back(id);
    v.push_back(std::move(x));
  }
  return v;
}

TEST(LlamaVectors, AllMatch) {
  const auto vectors = load_vectors();
  ASSERT_EQ(vectors.size(), 46u);  // FIXTURES.md: the file holds 46 strings
  const Tokenizer& tok = testing::qwen2();
  size_t checked = 0;
  for (const auto& v : vectors) {
    EXPECT_EQ(tok.encode(v.text, false), v.ids) << "text: '" << v.text << "'";
    // The strings hold no special-token text, so parsing specials changes nothing.
    EXPECT_EQ(tok.encode(v.text, true), v.ids) << "text: '" << v.text << "'";
    EXPECT_EQ(tok.decode(v.ids), v.text);
    ++checked;
  }
  EXPECT_EQ(checked, 46u);
}

}  // namespace
}  // namespace moe::tok
