// Shared helpers of the moe-synth tests: run the binary, temp files, tensor lookups.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moe/gguf.hpp"

namespace synth_test {

namespace fs = std::filesystem;

inline std::string bin() { return std::string(MOE_BIN_DIR) + "/moe-synth"; }
inline std::string vocab_file() { return std::string(MOE_TEST_DATA) + "/ggml-vocab-qwen2.gguf"; }

// A per-process scratch folder, removed at exit.
inline const fs::path& tmp_dir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("moe-synth-test-" + std::to_string(::getpid()));
    fs::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(fs::temp_directory_path() / ("moe-synth-test-" + std::to_string(::getpid())), ec);
    });
    return d;
  }();
  return dir;
}

struct RunResult {
  int rc = -1;
  std::string err;  // stderr
};

// Runs moe-synth with `args` (already shell-quoted where needed); stdout is discarded.
inline RunResult run_synth(const std::string& args) {
  static int n = 0;
  const fs::path err = tmp_dir() / ("stderr-" + std::to_string(n++) + ".txt");
  std::string cmd;  // built by appending: GCC 12 warns falsely (-Wrestrict) on "'" + std::string
  cmd.append("'").append(bin()).append("' ").append(args).append(" >/dev/null 2>'").append(err.string()).append("'");
  const int st = std::system(cmd.c_str());
  RunResult r;
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  std::ifstream in(err);
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
}

// Writes a model with `args` into the scratch folder; fails the test when moe-synth fails.
inline std::string make_model(const std::string& name, const std::string& args) {
  const std::string path = (tmp_dir() / name).string();
  const RunResult r = run_synth("-o '" + path + "' --threads 2 " + args);
  EXPECT_EQ(r.rc, 0) << "moe-synth " << args << "\n" << r.err;
  return path;
}

inline std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::string type_of(const moe::gguf::File& f, const std::string& tensor) {
  const auto* t = f.tensor(tensor);
  return t ? moe::gguf::type_name(t->type) : std::string("<absent>");
}

}  // namespace synth_test
