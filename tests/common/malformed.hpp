// Shared by the malformed-file suites (tests/gguf, tests/model): run a loader on bytes, catch the
// moe::Error, and check category, message and the largest allocation.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "alloc_tracker.hpp"
#include "gguf_image.hpp"
#include "moe/error.hpp"

namespace gguf_test {

inline const std::vector<uint8_t>& q8_fixture() {
  static std::vector<uint8_t> b = read_file(std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q8_0.gguf");
  return b;
}

struct Outcome {
  bool threw = false;
  moe::Exit code = moe::Exit::ok;
  std::string message;
  size_t largest_alloc = 0;
};

// Runs `load` (which parses the bytes) and reports the first moe::Error.
inline Outcome attempt(const std::function<void()>& load) {
  Outcome o;
  alloc_tracker::arm();
  try {
    load();
  } catch (const moe::Error& e) {
    o.threw = true;
    o.code = e.code();
    o.message = e.what();
  }
  o.largest_alloc = alloc_tracker::disarm();
  return o;
}

inline void expect_rejected(const Outcome& o, size_t file_size, moe::Exit code, const std::string& needle) {
  ASSERT_TRUE(o.threw) << "accepted a malformed file (expected: " << needle << ")";
  EXPECT_EQ(static_cast<int>(o.code), static_cast<int>(code)) << o.message;
  EXPECT_NE(o.message.find(needle), std::string::npos) << "message: " << o.message;
  EXPECT_EQ(o.message.find('\n'), std::string::npos) << "one line: " << o.message;
  // No request is sized by an unchecked count: the largest is the index of a string array, 16 bytes
  // (a string_view) per string that occupies at least 8 bytes of the file, so at most 2x the file.
  EXPECT_LE(o.largest_alloc, 2 * file_size + 4096) << o.message;
}

}  // namespace gguf_test
