// One project error type. Library code throws moe::Error with an exit-code category and a message
// that names the file, key, tensor or offset; only the CLI maps it to a process exit code.
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace moe {

// Exit codes of docs/CLI.md.
enum class Exit : int {
  ok = 0,
  other = 1,
  usage = 2,
  not_found = 3,    // model file missing or unreadable
  bad_file = 4,     // not a GGUF, corrupt or truncated
  unsupported = 5,  // architecture, tensor type, missing/invalid metadata
  resources = 6,    // out of memory, context too long
  inference = 8,    // non-finite logits on the CPU, ...
  no_cuda = 9,      // --gpu on a CPU-only build
  gpu_failed = 14,  // --gpu and the GPU could not serve
  interrupted = 130,
};

class Error : public std::runtime_error {
 public:
  Error(Exit code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  Exit code() const noexcept { return code_; }

 private:
  Exit code_;
};

template <typename... Args>
[[noreturn]] inline void fail(Exit code, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(code, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace moe
