// Tensor-core helpers for the prefill GEMMs: fp32 operands split into tf32 hi/lo pairs and the
// warp-level mma.sync m16n8k8 tf32 product (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32).
//
// Fragment ownership, with g = lane >> 2 and t = lane & 3 (row = M index, col = K index for A;
// row = K index, col = N index for B; row = M, col = N for C/D):
//   A (16x8, row-major):  a0 (g, t)    a1 (g+8, t)    a2 (g, t+4)    a3 (g+8, t+4)
//   B (8x8, column-major): b0 (t, g)   b1 (t+4, g)
//   C/D (16x8):            c0 (g, 2t)  c1 (g, 2t+1)   c2 (g+8, 2t)   c3 (g+8, 2t+1)
#pragma once
#include <cstdint>

namespace moe::cuda::dev {

// x = hi + lo with hi, lo as the mma reads them. The tensor cores take a tf32 operand from the top
// 19 bits of its register and ignore the low 13 (truncation), so: hi = x truncated (a mask; NaN
// stays NaN), lo = x - hi exactly (Sterbenz; |lo| < 2^-10 |x|), and lo's bits get half a tf32 ulp
// added so that the hardware truncation rounds it to nearest. Three instructions, where
// cvt.rna.tf32.f32 alone costs three. Together the pair carries x to ~2^-21 |x|.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) + 0x1000u;
}

// d += A * B for one m16n8k8 tile, fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 3xTF32: d += A_hi*B_hi + A_hi*B_lo + A_lo*B_hi. Only A_lo*B_lo (< 2^-20, typically ~2^-22 of
// |a*b|) is dropped, so the products keep fp32-level accuracy; the two small terms go first so
// that they meet d before the big one has grown it.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                           uint32_t b0_hi, uint32_t b1_hi, uint32_t b0_lo, uint32_t b1_lo) {
  mma_tf32(d, a_lo, b0_hi, b1_hi);
  mma_tf32(d, a_hi, b0_lo, b1_lo);
  mma_tf32(d, a_hi, b0_hi, b1_hi);
}

// 2xTF32 for an A that tf32 holds exactly (small integers such as quant codes): d += A*B_hi + A*B_lo,
// the small term first. The only error left is B's split (~2^-21 |b|), as with 3xTF32.
__device__ __forceinline__ void mma_2xtf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0_hi, uint32_t b1_hi,
                                           uint32_t b0_lo, uint32_t b1_lo) {
  mma_tf32(d, a, b0_lo, b1_lo);
  mma_tf32(d, a, b0_hi, b1_hi);
}

}  // namespace moe::cuda::dev
