// GGUF block layout -> device block layout (kernels/layout.cuh): fields moved so that the bytes the
// kernels read with vector loads are aligned, blocks padded to the device block size.
#include <cstring>

#include "layout.cuh"
#include "moe/cuda.hpp"
#include "moe/gguf.hpp"

namespace moe::cuda {

namespace {

void repack_block(uint32_t t, const uint8_t* s, uint8_t* d) {
  using namespace layout;
  const uint32_t db = dev_block_bytes(t);
  std::memset(d, 0, db);
  switch (t) {
    case Q4_0:  // d qs16 -> qs16 d
      std::memcpy(d, s + 2, 16);
      std::memcpy(d + 16, s, 2);
      break;
    case Q4_1:  // d m qs16 -> qs16 d m
      std::memcpy(d, s + 4, 16);
      std::memcpy(d + 16, s, 4);
      break;
    case Q5_0:  // d qh4 qs16 -> qs16 qh4 d
      std::memcpy(d, s + 6, 16);
      std::memcpy(d + 16, s + 2, 4);
      std::memcpy(d + 20, s, 2);
      break;
    case Q5_1:  // d m qh4 qs16 -> qs16 qh4 d m
      std::memcpy(d, s + 8, 16);
      std::memcpy(d + 16, s + 4, 4);
      std::memcpy(d + 20, s, 4);
      break;
    case Q8_0:  // d qs32 -> qs32 d
      std::memcpy(d, s + 2, 32);
      std::memcpy(d + 32, s, 2);
      break;
    case Q2_K:  // scales16 qs64 d dmin -> qs64 scales16 d dmin
      std::memcpy(d, s + 16, 64);
      std::memcpy(d + 64, s, 16);
      std::memcpy(d + 80, s + 80, 4);
      break;
    default:  // same field order, padded
      std::memcpy(d, s, gguf::type_traits(t).block_bytes);
      break;
  }
}

bool same_layout(uint32_t t) {
  using namespace layout;
  return t == F32 || t == F16 || t == BF16 || t == Q4_K || t == Q5_K;
}

}  // namespace

uint64_t device_bytes(gguf::Type t, int64_t cols, int64_t rows) {
  const uint32_t ti = static_cast<uint32_t>(t);
  if (!layout::supported(ti) || cols % 32 != 0 || cols % layout::block_elems(ti) != 0) return 0;
  return static_cast<uint64_t>(layout::dev_row_bytes(ti, cols)) * static_cast<uint64_t>(rows);
}

void repack_rows(gguf::Type t, const uint8_t* src, uint8_t* dst, int64_t cols, int64_t rows) {
  const uint32_t ti = static_cast<uint32_t>(t);
  const size_t src_row = gguf::row_bytes(t, cols);
  const size_t dst_row = layout::dev_row_bytes(ti, cols);
  if (same_layout(ti)) {
    std::memcpy(dst, src, src_row * static_cast<size_t>(rows));
    return;
  }
  const uint32_t sb = gguf::type_traits(t).block_bytes, db = layout::dev_block_bytes(ti);
  const int64_t nb = cols / layout::block_elems(ti);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + static_cast<size_t>(r) * src_row;
    uint8_t* d = dst + static_cast<size_t>(r) * dst_row;
    for (int64_t b = 0; b < nb; ++b) repack_block(ti, s + b * sb, d + b * db);
  }
}

}  // namespace moe::cuda
