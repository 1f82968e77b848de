// A small JSON writer for the outputs of CLI.md (internal to src/run).
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace moe::run::json {

// A JSON string literal. Invalid UTF-8 bytes become U+FFFD so the output always parses.
std::string quote(std::string_view s);
// A JSON number; non-finite values (never valid JSON) become null.
inline std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  return fmt::format("{}", v);
}
inline std::string num(int64_t v) { return fmt::format("{}", v); }
inline std::string boolean(bool v) { return v ? "true" : "false"; }
inline std::string opt_num(const std::optional<double>& v) { return v ? num(*v) : "null"; }
inline std::string opt_int(const std::optional<int64_t>& v) { return v ? num(*v) : "null"; }
inline std::string opt_str(const std::optional<std::string>& v) { return v ? quote(*v) : "null"; }
std::string ids(std::span<const int32_t> v);

// Builds {"k": v, ...} from already-encoded values.
class Object {
 public:
  Object& raw(std::string_view key, std::string_view encoded) {
    s_ += s_.empty() ? "{" : ", ";
    s_ += quote(key);
    s_ += ": ";
    s_ += encoded;
    return *this;
  }
  Object& str(std::string_view key, std::string_view v) { return raw(key, quote(v)); }
  std::string done() const { return s_.empty() ? "{}" : s_ + "}"; }

 private:
  std::string s_;
};

}  // namespace moe::run::json
