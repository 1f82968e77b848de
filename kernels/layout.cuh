// Device layout of quantized weights. Blocks keep their ggml fields but some are repacked or padded
// so that every field the kernels read with vector loads is aligned (ggml's 210-byte Q6_K or 34-byte
// Q8_0 blocks would otherwise force byte loads). Plain C++: included by the .cu files and by host code.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moe::cuda::layout {

// ggml type ids (same numbers as moe::gguf::Type; repeated here so device code needs no host header).
enum : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// Elements per block (32 for the small blocks, 256 for K-quants, 1 for float types).
constexpr uint32_t block_elems(uint32_t t) {
  switch (t) {
    case F32: case F16: case BF16: return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
  }
}

// Bytes of one block on the device (after repacking).
//   Q4_0 [qs16][d][pad2]      Q4_1 [qs16][d][m]      Q5_0 [qs16][qh4][d][pad2]   Q5_1 [qs16][qh4][d][m]
//   Q8_0 [qs32][d][pad2]      Q2_K [qs64][scales16][d][dmin][pad12]
//   Q3_K, Q4_K, Q5_K, Q6_K: ggml order, padded to a multiple of 16 bytes.
constexpr uint32_t dev_block_bytes(uint32_t t) {
  switch (t) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: case Q4_1: return 20;
    case Q5_0: case Q5_1: return 24;
    case Q8_0: return 36;
    case Q2_K: return 96;
    case Q3_K: return 112;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 224;
    default: return 0;
  }
}

constexpr bool supported(uint32_t t) { return block_elems(t) != 0; }

// Bytes of a device row of `cols` elements; cols must be a multiple of 32 (checked by the host).
constexpr size_t dev_row_bytes(uint32_t t, int64_t cols) {
  return static_cast<size_t>(cols / block_elems(t)) * dev_block_bytes(t);
}

}  // namespace moe::cuda::layout
