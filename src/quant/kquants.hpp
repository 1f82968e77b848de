// Reference quantizers of the K-quant super-blocks (quantize_k.cpp).
#pragma once
#include "internal.hpp"

namespace moe::quant::detail {

void quant_q2_k(const float* x, BlockQ2_K* b);
void quant_q3_k(const float* x, BlockQ3_K* b);
void quant_q4_k(const float* x, BlockQ4_K* b);
void quant_q5_k(const float* x, BlockQ5_K* b);
void quant_q6_k(const float* x, BlockQ6_K* b);
void quantize_q8_k(const float* x, void* dst, int64_t n);

// Weighted least-squares fits of one sub-block, exposed for the tests.
// x ≈ scale·L with L in [-nmax, nmax-1]; returns the scale (0 for an all-zero block).
float fit_symmetric(int n, int nmax, const float* x, const float* w, int8_t* L);
// x ≈ scale·L − min with L in [0, nmax] and min ≥ 0 (the formats store a non-negative min that is
// subtracted, so a sub-block whose values are all positive gets min 0).
void fit_affine(int n, int nmax, const float* x, const float* w, uint8_t* L, float& scale, float& min);

}  // namespace moe::quant::detail
