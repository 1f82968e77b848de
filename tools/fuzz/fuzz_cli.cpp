// libFuzzer target: the CLI's argument parsing and flag-value validation on arbitrary argument
// vectors (moe::cli::parse, which main() calls before anything runs). The input is split at NUL
// bytes into arguments. A bad value must be moe::Error(Exit::usage); any other exception, a
// crash or a sanitizer report is a finding. A parsed config is checked against the documented
// ranges so a value that slipped through validation is a finding too.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "moe/error.hpp"
// The CLI is an executable, not a library: its option parser is compiled into this target.
#include "../../src/cli/options.cpp"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::abort();
}

// -i/--input reads a file or stdin; the fuzzer must not read /dev/zero or block on stdin. Any
// argument that could name it (long prefix or a short-option cluster holding 'i') is skipped.
bool reads_input(std::string_view a) {
  if (a.size() >= 3 && a.substr(0, 3) == "--i") return true;
  if (a.size() >= 2 && a[0] == '-' && a[1] != '-' && a.find('i') != std::string_view::npos) return true;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args{"moe-run"};
  size_t start = 0;
  while (start <= in.size() && args.size() < 64) {
    size_t end = in.find('\0', start);
    if (end == std::string_view::npos) end = in.size();
    args.emplace_back(in.substr(start, end - start));
    if (reads_input(args.back())) return 0;
    start = end + 1;
  }
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  moe::cli::Request req;
  std::ostringstream out;
  try {
    if (moe::cli::parse(static_cast<int>(argv.size()), argv.data(), req, out)) return 0;
  } catch (const moe::Error& e) {
    if (e.code() != moe::Exit::usage) finding("a flag error that is not a usage error");
    return 0;
  }
  const auto& c = req.cfg;
  const auto& s = c.sampler;
  if (c.model_path.empty()) finding("accepted without a model path");
  if (c.max_tokens < 0 || c.max_tokens > (int64_t{1} << 24)) finding("--max-tokens out of range");
  if (!(std::isfinite(s.temperature) && s.temperature >= 0)) finding("--temperature not finite or negative");
  if (!(s.top_p >= 0 && s.top_p <= 1) || !(s.min_p >= 0 && s.min_p <= 1)) finding("--top-p/--min-p outside [0, 1]");
  if (!(std::isfinite(s.repeat_penalty) && s.repeat_penalty > 0)) finding("--repeat-penalty not positive");
  if (s.top_k < 0 || s.repeat_last_n < 0) finding("negative --top-k/--repeat-last-n");
  if (c.threads < 0 || c.device < 0) finding("negative --threads/--device");
  if (c.prompt_tokens)
    for (int32_t id : *c.prompt_tokens)
      if (id < 0) finding("negative id in --prompt-tokens");
  return 0;
}
