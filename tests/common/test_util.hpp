// Small helpers shared by several test suites (header only).
#pragma once
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace test_util {

// Cosine of two float vectors, accumulated in double (independent of src/guard's own).
inline double cosine(const float* a, const float* b, int64_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

// The whole file as bytes ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A path in the test temp dir, unique per process: ctest runs tests as parallel processes.
inline std::string temp_path(const std::string& prefix, const std::string& name) {
  return testing::TempDir() + "/" + prefix + std::to_string(getpid()) + "_" + name;
}

}  // namespace test_util
