// Prefill matrix kernels of the CPU forward that go beyond quant's per-row dot products
// (private to src/cpu). Each has the contract of quant::matmul_rows_fast and gives bit-identical
// results; matmul_rows picks one where it applies and falls back to quant otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moe/quant.hpp"

namespace moe::cpu {

// AVX-512 VNNI present (and not capped by MOE_ISA, nor turned off by MOE_CPU_GEMM=0).
bool gemm_kquant_available();
// Q4_K or Q6_K weights against Q8_K activations, 16 tokens at a time (the rest, and other types,
// through quant).
void gemm_kquant_rows(const quant::Matrix& w, int64_t r0, int64_t r1, const uint8_t* acts, size_t act_stride,
                      int64_t n_tok, float* y, int64_t y_stride);

// quant::matmul_rows_fast, with the kernels above where they apply.
inline void matmul_rows(const quant::Matrix& w, int64_t r0, int64_t r1, const uint8_t* acts, size_t act_stride,
                        int64_t n_tok, float* y, int64_t y_stride) {
  if (n_tok >= 16 && (w.type == quant::Type::Q4_K || w.type == quant::Type::Q6_K) && gemm_kquant_available()) {
    gemm_kquant_rows(w, r0, r1, acts, act_stride, n_tok, y, y_stride);
    return;
  }
  quant::matmul_rows_fast(w, r0, r1, acts, act_stride, n_tok, y, y_stride);
}

}  // namespace moe::cpu
