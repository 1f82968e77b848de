// Per-block dequantizers shared by dequantize_row and the scalar exact-mode dot products.
#pragma once
#include "internal.hpp"

namespace moe::quant::detail {

using DequantBlockFn = void (*)(const void* block, float* y);
// The block dequantizer of a block type (nullptr for F32/F16/BF16 and unknown types).
DequantBlockFn dequant_block_fn(Type t);

}  // namespace moe::quant::detail
