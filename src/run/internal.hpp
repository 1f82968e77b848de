// Shared between the files of src/run (not a public header).
#pragma once
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "moe/run.hpp"
#include "moe/tokenizer.hpp"

namespace moe::run {

using Clock = std::chrono::steady_clock;
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct PreparedPrompt {
  std::vector<int32_t> ids;
  bool templated = false;
  std::string text;  // what was tokenized (after the template)
};
// --prompt-tokens as given; otherwise the text through the chat template (auto/--chat/--raw),
// tokenized with special tokens parsed, BOS prepended when the vocabulary asks for it.
// Exit::usage for an empty prompt, --system/--thinking without a template, ids out of range.
PreparedPrompt prepare_prompt(const RunConfig& cfg, const tok::Tokenizer* tok, int64_t n_vocab);

// Online CPUs (the --threads default).
int default_threads();

// Human model summary (--inspect, --verbose).
void write_summary(const gguf::File& f, std::ostream& os);

}  // namespace moe::run
