#include "emitter.hpp"

#include <ostream>

#include "json.hpp"

namespace moe::run {

Emitter::Emitter(const tok::Tokenizer& tok, OutputMode mode, std::vector<std::string> stops, std::ostream& out)
    : dec_(tok), mode_(mode), out_(out) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

void Emitter::write(const std::string& s) {
  if (broken_ || s.empty() || mode_ != OutputMode::text) return;
  out_ << s;
  out_.flush();
  if (!out_) broken_ = true;
}

// A stop string can only begin inside pending_ (a released suffix is never the start of one), so
// scanning pending_ is enough. Returns the text that can be released now.
std::string Emitter::take_releasable() {
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

bool Emitter::push(int32_t id, bool eog, int64_t index, bool last) {
  if (stopped_) return true;
  if (!eog) pending_ += dec_.push(id);
  std::string released = take_releasable();
  if (last && !stopped_) {
    // Nothing follows: a partial stop string can no longer complete; unfinished bytes become U+FFFD.
    pending_ += dec_.finish();
    released += pending_;
    pending_.clear();
  }
  text_ += released;
  if (mode_ == OutputMode::stream && !broken_) {
    out_ << json::Object()
                .str("event", "token")
                .raw("index", json::num(index))
                .raw("token_id", json::num(static_cast<int64_t>(id)))
                .raw("text", json::quote(released))
                .done()
         << '\n';
    out_.flush();
    if (!out_) broken_ = true;
  } else {
    write(released);
  }
  return stopped_;
}

void Emitter::finish() {
  if (stopped_) return;
  pending_ += dec_.finish();
  text_ += pending_;
  write(pending_);
  pending_.clear();
}

}  // namespace moe::run
