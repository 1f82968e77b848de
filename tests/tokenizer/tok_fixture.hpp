// Shared by the tokenizer tests: the Qwen2 vocabulary fixture, loaded once.
#pragma once
#include <memory>
#include <string>

#include "moe/gguf.hpp"
#include "moe/tokenizer.hpp"

namespace moe::tok::testing {

inline const std::string kVocabPath = std::string(MOE_TEST_DATA) + "/ggml-vocab-qwen2.gguf";

inline const Tokenizer& qwen2() {
  static const Tokenizer tok = [] {
    const auto f = gguf::File::open(kVocabPath);
    return Tokenizer::from_gguf(*f);
  }();
  return tok;
}

}  // namespace moe::tok::testing
