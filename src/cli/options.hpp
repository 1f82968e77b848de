// Command line -> RunConfig (CLI.md). Numeric values are parsed strictly here (no trailing text,
// no NaN/Inf, ranges checked) so a bad value is a usage error (exit 2), never a crash.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string_view>
#include <vector>

#include "moe/run.hpp"

namespace moe::cli {

enum class Action { generate, inspect, tokenize };

struct Request {
  run::RunConfig cfg;
  Action action = Action::generate;
  bool json = false;  // --json / -f json (for --inspect too)
};

// Parses argv. Returns an exit code when the process should end now (--help/--version: 0, after
// printing to `out`); throws moe::Error(Exit::usage) for usage errors.
std::optional<int> parse(int argc, const char* const* argv, Request& req, std::ostream& out);

// Strict parsers for flag values; throw moe::Error(Exit::usage) naming the flag.
int64_t parse_int(std::string_view flag, std::string_view text, int64_t lo, int64_t hi);
double parse_float(std::string_view flag, std::string_view text, double lo, double hi);
std::vector<int32_t> parse_ids(std::string_view flag, std::string_view text);

}  // namespace moe::cli
