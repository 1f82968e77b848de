// Dequantization of one block / one row for every CPU block format (REFERENCE.md §5).
#include "dequant.hpp"
#include "dequant_blocks.hpp"

#include "moe/error.hpp"

namespace moe::quant {
namespace detail {

DequantBlockFn dequant_block_fn(Type t) {
  switch (t) {
    case Type::Q4_0: return deq_q4_0;
    case Type::Q4_1: return deq_q4_1;
    case Type::Q5_0: return deq_q5_0;
    case Type::Q5_1: return deq_q5_1;
    case Type::Q8_0: return deq_q8_0;
    case Type::Q8_1: return deq_q8_1;
    case Type::Q2_K: return deq_q2_k;
    case Type::Q3_K: return deq_q3_k;
    case Type::Q4_K: return deq_q4_k;
    case Type::Q5_K: return deq_q5_k;
    case Type::Q6_K: return deq_q6_k;
    case Type::Q8_K: return deq_q8_k;
    default: return nullptr;
  }
}

}  // namespace detail

void dequantize_row(Type t, const void* src, float* dst, int64_t n) {
  using namespace detail;
  int64_t nb = blocks_in_row(t, n);
  auto* p = static_cast<const uint8_t*>(src);
  switch (t) {
    case Type::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case Type::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = fp16_to_f32(h);
      }
      return;
    case Type::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    default:
      break;
  }
  DequantBlockFn fn = dequant_block_fn(t);
  if (!fn) unsupported_type(t, "for dequantization");
  BlockInfo bi = block_info(t);
  for (int64_t b = 0; b < nb; ++b) fn(p + b * bi.bytes, dst + b * bi.elems);
}

}  // namespace moe::quant
