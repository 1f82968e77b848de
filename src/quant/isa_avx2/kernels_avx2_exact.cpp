// AVX2 exact-mode fallbacks: every block type dequantized one block at a time into a stack buffer by
// the plain per-block loops (vectorized here by the compiler), then an FMA dot product; also the row
// dequantizers used by exact-mode prefill.
#include <immintrin.h>

#include "../dequant_blocks.hpp"
#include "../internal.hpp"
#include "simd_avx2.hpp"

namespace moe::quant::detail {
namespace {
using namespace avx2;

template <int kElems, int kBytes, void (*Deq)(const void*, float*)>
float exact_generic(const void* w, const float* x, int64_t n) {
  auto* p = static_cast<const uint8_t*>(w);
  alignas(32) float buf[kElems];
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / kElems; ++b, x += kElems) {
    Deq(p + b * kBytes, buf);
    for (int i = 0; i < kElems; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_load_ps(buf + i), _mm256_loadu_ps(x + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_load_ps(buf + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
    }
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

template <int kElems, int kBytes, void (*Deq)(const void*, float*)>
void deq_row(const void* w, float* y, int64_t n) {
  auto* p = static_cast<const uint8_t*>(w);
  for (int64_t b = 0; b < n / kElems; ++b) Deq(p + b * kBytes, y + b * kElems);
}

}  // namespace

void fill_avx2_exact_kernels(Kernels& k) {
  auto i = [](Type t) { return static_cast<size_t>(t); };
  k.dot_exact[i(Type::Q4_1)] = exact_generic<32, 20, deq_q4_1>;
  k.dot_exact[i(Type::Q5_0)] = exact_generic<32, 22, deq_q5_0>;
  k.dot_exact[i(Type::Q5_1)] = exact_generic<32, 24, deq_q5_1>;
  k.dot_exact[i(Type::Q2_K)] = exact_generic<256, 84, deq_q2_k>;
  k.dot_exact[i(Type::Q3_K)] = exact_generic<256, 110, deq_q3_k>;
  k.dequant_row[i(Type::Q4_0)] = deq_row<32, 18, deq_q4_0>;
  k.dequant_row[i(Type::Q4_1)] = deq_row<32, 20, deq_q4_1>;
  k.dequant_row[i(Type::Q5_0)] = deq_row<32, 22, deq_q5_0>;
  k.dequant_row[i(Type::Q5_1)] = deq_row<32, 24, deq_q5_1>;
  k.dequant_row[i(Type::Q8_0)] = deq_row<32, 34, deq_q8_0>;
  k.dequant_row[i(Type::Q2_K)] = deq_row<256, 84, deq_q2_k>;
  k.dequant_row[i(Type::Q3_K)] = deq_row<256, 110, deq_q3_k>;
  k.dequant_row[i(Type::Q4_K)] = deq_row<256, 144, deq_q4_k>;
  k.dequant_row[i(Type::Q5_K)] = deq_row<256, 176, deq_q5_k>;
  k.dequant_row[i(Type::Q6_K)] = deq_row<256, 210, deq_q6_k>;
}

}  // namespace moe::quant::detail
