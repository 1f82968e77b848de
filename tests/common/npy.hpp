// Reader of NumPy .npy files (format versions 1-3, little-endian float32/int32/float64/int64, C order)
// for comparing with the llama.cpp goldens in tests/data/golden.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace npy {

struct Array {
  std::string descr;           // "<f4", "<i4", ...
  std::vector<int64_t> shape;  // empty for a scalar
  std::vector<uint8_t> bytes;  // the raw data, C order

  int64_t size() const;  // number of elements
  // The elements converted to float / int64 (any supported dtype).
  std::vector<float> as_f32() const;
  std::vector<int64_t> as_i64() const;
};

// Throws std::runtime_error naming the file and what is wrong.
Array load(const std::string& path);

}  // namespace npy
