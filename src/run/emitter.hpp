// Turns sampled tokens into output: UTF-8-safe detokenization, --stop strings (the text up to the
// stop string is printed, the rest is not), streamed text or NDJSON token events.
#pragma once
#include <iosfwd>
#include <string>
#include <vector>

#include "moe/run.hpp"
#include "moe/tokenizer.hpp"

namespace moe::run {

class Emitter {
 public:
  Emitter(const tok::Tokenizer& tok, OutputMode mode, std::vector<std::string> stops, std::ostream& out);
  // Handles one generated token (index = its position among the generated tokens). An
  // end-of-generation token adds no text. `last`: no token follows, so everything held back is
  // released with this one (its NDJSON event then carries it). Returns true when a stop string
  // has been reached.
  bool push(int32_t id, bool eog, int64_t index, bool last = false);
  // Releases the text still held back (bytes of an unfinished character, a partial stop string).
  void finish();
  // stdout failed (closed pipe): the run should end quietly.
  bool broken() const { return broken_; }
  const std::string& text() const { return text_; }

 private:
  std::string take_releasable();
  void write(const std::string& s);

  tok::StreamDecoder dec_;
  OutputMode mode_;
  std::vector<std::string> stops_;
  std::ostream& out_;
  std::string pending_;  // decoded, not yet released (may be the start of a stop string)
  std::string text_;     // released text
  bool stopped_ = false;
  bool broken_ = false;
};

}  // namespace moe::run
