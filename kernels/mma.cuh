// Tensor-core helpers for the prefill GEMMs (gemm_float.cu, gemm_kq.cu) and the prefill attention.
//
// 1. fp32 operands split into tf32 hi/lo pairs and the warp-level mma.sync m16n8k8 tf32 product
//    (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32). Fragment ownership, with g = lane >> 2 and
//    t = lane & 3 (row = M index, col = K index for A; row = K index, col = N index for B; row = M,
//    col = N for C/D):
//      A (16x8, row-major):  a0 (g, t)    a1 (g+8, t)    a2 (g, t+4)    a3 (g+8, t+4)
//      B (8x8, column-major): b0 (t, g)   b1 (t+4, g)
//      C/D (16x8):            c0 (g, 2t)  c1 (g, 2t+1)   c2 (g+8, 2t)   c3 (g+8, 2t+1)
//
// 2. The integer path (namespace i8): quant codes as 8-bit A operands of mma.sync m16n8k32 (u8 x s8)
//    and m16n8k16 (s8 x s8), activations as 24-bit integers split in three int8 B operands. Fragments,
//    each register holding 4 consecutive K elements (bytes, lowest K in the lowest byte):
//      m16n8k32 A: a0 row g, k 4t..4t+3   a1 row g+8, same k   a2 row g, k 16+4t..   a3 row g+8, k 16+4t..
//      m16n8k32 B: b0 k 4t..4t+3 of column g   b1 k 16+4t.. of column g
//      m16n8k16 A: a0 row g, k 4t..4t+3   a1 row g+8, same k;   B: b0 k 4t..4t+3 of column g
//      C/D as above (s32).
//    The pure parts (bit packing, code extraction, the exact int-to-float steps) are host-callable so
//    that tests/cuda/gemm_test.cpp can run them against a CPU model of the fragments.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe::cuda::dev {

#if defined(__CUDACC__)
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
#endif  // __CUDACC__

MOE_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MOE_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
// Correctly rounded a*b + c and a + b, never contracted or reassociated (the exactness arguments of
// the integer path depend on each rounding step).
MOE_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}
MOE_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// x = hi + lo with hi, lo as the mma reads them. The tensor cores take a tf32 operand from the top
// 19 bits of its register and ignore the low 13 (truncation), so: hi = x truncated (a mask; NaN
// stays NaN), lo = x - hi exactly (Sterbenz; |lo| < 2^-10 |x|), and lo's bits get half a tf32 ulp
// added so that the hardware truncation rounds it to nearest. Three instructions, where
// cvt.rna.tf32.f32 alone costs three. Together the pair carries x to ~2^-21 |x|.
MOE_HD void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = f2u(x) & 0xffffe000u;
  lo = f2u(x - u2f(hi)) + 0x1000u;
}

namespace i8 {

// Activations: per token and 32-column slice, X = rint(x / s) with |X| <= kXMax (23 bits and a sign),
// written in three signed base-256 digits X = 65536 Xa + 256 Xb + Xc (Xa in [-127, 127], Xb, Xc in
// [-128, 127]), one int8 B operand each (three MMAs per product, exact in int32).
constexpr float kXMax = 8323072.f;  // 127 * 65536
// Y = X + 0x8080 = 65536 Xa + 256 (Xb + 128) + (Xc + 128) comes from one fma and one conversion
// (rint_i32(fma(x, 1/s, kYOffset)); |Y| < 2^23, so the fma rounds at most to halves and X is off
// from rint(x / s) only at ties): byte 0 of Y is Xc + 128, byte 1 Xb + 128, byte 2 Xa (two's
// complement), so the digits are byte selections and one xor.
constexpr float kYOffset = 32896.f;  // 0x8080
constexpr int kYOffsetInt = 0x8080;
// The MMAs take a magic float as their C operand so that their int32 results read as floats
// directly (no int-to-float conversion, which issues at 1/8 of the fp32 rate): an integer D with
// |D| < 2^22 added to the bits of 1.5 * 2^(23+k) gives the float 1.5 * 2^(23+k) + 2^k D (the
// binade's spacing is 2^k). The digit MMAs use k = 16, 8, 0, so they read Ma + 65536 Da, Mb + 256 Db
// and Mc + Dc: the digit weights come for free.
constexpr uint32_t kMagicA = 0x53400000u, kMagicB = 0x4F400000u, kMagicC = 0x4B400000u;
constexpr uint32_t kMagicBits = kMagicC;
constexpr float kMagic = 12582912.f;          // 1.5 * 2^23 (kMagicC)
constexpr float kMagicSum = 827867529216.f;   // Ma + Mb + Mc = 1.5 (2^39 + 2^31 + 2^23) = 197379 * 2^22
// Scales keep kScaleBits significant bits (see slice_scale), so that s * kMagicSum is exact.
constexpr int kScaleBits = 6;

MOE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
// Round to the nearest integer, ties to even (cvt.rni.s32.f32); the host model maps NaN to 0 as
// the device does (the values are discarded then: their slice scale is NaN).
MOE_HD int rint_i32(float a) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(a);
#else
  return std::isnan(a) ? 0 : static_cast<int>(std::nearbyint(std::fmax(std::fmin(a, 2147483520.f), -2147483648.f)));
#endif
}
MOE_HD float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.f / a;
#endif
}

// Bytes `sel` (0, 1 or 2) of four words, packed low to high.
MOE_HD uint32_t pack_byte(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3, int sel) {
#if defined(__CUDA_ARCH__)
  if (sel == 2) {
    const uint32_t lo = __byte_perm(b0, b1, 0x7632), hi = __byte_perm(b2, b3, 0x7632);  // high halves
    return __byte_perm(lo, hi, 0x6420);
  }
  const uint32_t lo = __byte_perm(b0, b1, 0x5410), hi = __byte_perm(b2, b3, 0x5410);  // low halves
  return __byte_perm(lo, hi, sel ? 0x7531 : 0x6420);
#else
  const int s = 8 * sel;
  return ((b0 >> s) & 0xFF) | (((b1 >> s) & 0xFF) << 8) | (((b2 >> s) & 0xFF) << 16) | (((b3 >> s) & 0xFF) << 24);
#endif
}

// A slice's scale s (ts) and 1 / s from the bits of max|x| over the slice: s = max|x| / kXMax rounded
// up to kScaleBits significant bits (at most 3% coarser than needed), so that the products of
// digit_value and the constant ts * kMagicSum are exact. A slice with max|x| < 2^-64 counts as zero
// (an error below 2^-59 |w|); an infinite or NaN element makes s NaN, and the outputs with it.
struct Scale {
  float ts, inv;
};
MOE_HD Scale slice_scale(uint32_t amax_bits) {
  if (amax_bits >= 0x7F800000u) return {u2f(0x7FFFFFFFu), 0.f};
  if (amax_bits < 0x1F800000u) return {0.f, 0.f};
  constexpr uint32_t kDrop = (1u << (23 - (kScaleBits - 1))) - 1u;  // mantissa bits cleared
  const float s = mul_rn(u2f(amax_bits), 1.f / kXMax);
  const float ts = u2f((f2u(s) + kDrop) & ~kDrop);
  return {ts, rcp_rn(ts)};
}
// The exact constant of digit_value: -ts * kMagicSum (kScaleBits + 18 bits).
MOE_HD float digit_offset(float ts) { return mul_rn(-ts, kMagicSum); }

// One lane's B registers of a 32-column slice: x[0..4) are the slice's columns 4t..4t+3 and x[4..8)
// columns 16+4t..16+4t+3; inv = 1 / s (slice_scale). Gives the digits {Xa b0, Xa b1}, {Xb b0, Xb b1},
// {Xc b0, Xc b1} and the sum of the eight X (for the K-quant minimums).
struct Digits {
  uint32_t a0, a1, b0, b1, c0, c1;
  int sum;
};
MOE_HD Digits quant8(const float (&x)[8], float inv) {
  uint32_t w[8];
  int sum = 0;
  for (int e = 0; e < 8; ++e) {
    const int y = rint_i32(fma_rn(x[e], inv, kYOffset));
    w[e] = static_cast<uint32_t>(y);
    sum += y;
  }
  return {pack_byte(w[0], w[1], w[2], w[3], 2),
          pack_byte(w[4], w[5], w[6], w[7], 2),
          pack_byte(w[0], w[1], w[2], w[3], 1) ^ 0x80808080u,
          pack_byte(w[4], w[5], w[6], w[7], 1) ^ 0x80808080u,
          pack_byte(w[0], w[1], w[2], w[3], 0) ^ 0x80808080u,
          pack_byte(w[4], w[5], w[6], w[7], 0) ^ 0x80808080u,
          sum - 8 * kYOffsetInt};
}
// |x| as ordered bits: an unsigned max over them is max|x|, NaN above +inf (so NaN propagates).
MOE_HD uint32_t abs_bits(float x) { return f2u(x) & 0x7fffffffu; }

// ts (65536 Da + 256 Db + Dc) from the three digit MMAs' results (C operands kMagicA, kMagicB,
// kMagicC), with k = digit_offset(ts): three fmas, the first exact (ts has kScaleBits bits and
// ts (Ma + 65536 Da) - ts kMagicSum = ts 65536 (Da - 49344) needs 18 more), so no magic offset is
// left larger than ts Mc in what the other two round: they add 2^-24 of the result and of ts Mc,
// i.e. 0.75 units of ts, far below the rounding of X itself.
MOE_HD float digit_value(uint32_t da, uint32_t db, uint32_t dc, float ts, float k) {
  return fma_rn(ts, u2f(dc), fma_rn(ts, u2f(db), fma_rn(ts, u2f(da), k)));
}

// x = hi + mid + lo as the tf32 MMA reads them (split_tf32 twice): ~2^-32 |x|.
MOE_HD void split3_tf32(float x, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  hi = f2u(x) & 0xffffe000u;
  const float r = add_rn(x, -u2f(hi));  // exact
  split_tf32(r, mid, lo);
}

// Small non-negative integer (< 2^23) to float: exact, and cheaper than the conversion instruction.
MOE_HD float small_u2f(uint32_t v) { return u2f(0x4B000000u | v) - 8388608.f; }
// d * q for an integer q in [-2^22, 2^22) given as the bits kMagicBits + q: one rounding, as d * (float)q.
MOE_HD float scaled_int(float d, uint32_t magic_q, float neg_d_magic) { return fma_rn(d, u2f(magic_q), neg_d_magic); }

// ---- quant codes as A registers (each word: 4 consecutive elements of one row) -----------------
// Q4_K: the 32 elements of sub-block 2c + hi are the low (hi = 0) or high nibbles of qs[32c..32c+32).
MOE_HD uint32_t q4k_codes(uint32_t qs, int hi) { return (qs >> (4 * hi)) & 0x0F0F0F0Fu; }
// Q5_K: plus bit j (the sub-block) of qh[0..32) as bit 4.
MOE_HD uint32_t q5k_codes(uint32_t qs, uint32_t qh, int j, int hi) {
  return q4k_codes(qs, hi) | (((qh >> j) & 0x01010101u) << 4);
}
// Q6_K: group 4n + k (32 elements) is nibble k >> 1 of ql[64n + 32(k & 1)..] with bits 2k, 2k+1 of
// qh[32n..] on top, minus 32, as int8: q + 96 has no carry out of a byte (q < 64), and flipping
// bit 7 subtracts 128 mod 256.
MOE_HD uint32_t q6k_codes(uint32_t ql, uint32_t qh, int k, int hi) {
  const uint32_t q = ((ql >> (4 * hi)) & 0x0F0F0F0Fu) | (((qh >> (2 * k)) & 0x03030303u) << 4);
  return (q + 0x60606060u) ^ 0x80808080u;
}

// Q4_K/Q5_K header words 1..3 (bytes 4..15: the packed 6-bit scales and mins) -> the eight scales
// and mins as bytes: sc[0] sub-blocks 0-3, sc[1] 4-7 (REFERENCE.md §5.7).
MOE_HD void kq_scales(uint32_t w1, uint32_t w2, uint32_t w3, uint32_t (&sc)[2], uint32_t (&mn)[2]) {
  sc[0] = w1 & 0x3F3F3F3Fu;
  mn[0] = w2 & 0x3F3F3F3Fu;
  sc[1] = (w3 & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
  mn[1] = ((w3 >> 4) & 0x0F0F0F0Fu) | ((w2 >> 2) & 0x30303030u);
}
MOE_HD uint32_t byte_u(uint32_t w, int b) { return (w >> (8 * b)) & 0xFFu; }
MOE_HD int byte_s(uint32_t w, int b) { return static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * b))); }

// ---- shared-memory layout of one stage's activations (gemm_kq.cu) ------------------------------
// Digits a and b: token n, slice j, lane t at uint4 {Xa b0, Xa b1, Xb b0, Xb b1} index
// n * 32 + 4 (j ^ (n & 1)) + t. A warp's 128-bit loads read tokens g = 0..7 in pairs; flipping the
// slice of odd tokens puts the pair in different halves of the banks (a row of 512 bytes would
// otherwise map both onto the same banks).
MOE_HD int bq_index(int n, int j, int t) { return n * 32 + 4 * (j ^ (n & 1)) + t; }
// Digit c: uint2 {Xc b0, Xc b1} at n * 32 + 4 (j ^ (n & 3)) + t: the 64-bit loads of a half warp
// (tokens g = 0..3 or 4..7, rows of 256 bytes) then cover the 32 banks once.
MOE_HD int bc_index(int n, int j, int t) { return n * 32 + 4 * (j ^ (n & 3)) + t; }
// The slice sums s * sum(X) for the minimums' tf32 MMAs, split in hi + mid + lo: token n, lane t at
// uint4 index 4 n + t holds {hi(slice t), hi(slice t + 4), mid(t), mid(t + 4)}, and at uint2 index
// 4 n + t of a second array {lo(t), lo(t + 4)} (B fragments of m16n8k8).
MOE_HD int xs_index(int n, int t) { return 4 * n + t; }
MOE_HD int xs_word(int j, int mid) { return 4 * (j & 3) + (j >> 2) + 2 * mid; }  // word within the token's 16
MOE_HD int xs2_word(int j) { return 2 * (j & 3) + (j >> 2); }                   // word within the token's 8
// ldmatrix .x4 row addresses: lane L gives row (L & 7) + 8 ((L >> 3) & 1) of the m16 tile at byte
// 16 (L >> 4) of the 32-byte K chunk, so that its four 8x8 matrices are a0..a3 of the A fragment.
MOE_HD int ldsm_row(int lane) { return (lane & 7) + 8 * ((lane >> 3) & 1); }
MOE_HD int ldsm_byte(int lane) { return 16 * (lane >> 4); }

}  // namespace i8

// ---- the fp16 path of the prefill GEMMs (Q4_K, Q5_K) ------------------------------------------
// Weights as fp16 A operands of mma.sync m16n8k16 (fp32 accumulate) holding (q - o) * sc, the
// centred quant code times its 6-bit sub-block scale: an integer of magnitude at most 16 * 63, exact
// in fp16, so a whole super-block (256 columns, eight sub-blocks) accumulates in the MMA and only d,
// dmin and the offsets' sum are applied per super-block. Activations: per token and super-block x' = x * 2^e with max|x'| in
// [2^14, 2^15), split in fp16 hi + lo (x' - hi), ~2^-22 |x'| (finer than the 24-bit digits for all
// but the slice's largest elements); two MMAs per product.
// Fragments (PTX "m16n8k16" .f16, g = lane >> 2, t = lane & 3): A a0 (row g, k 2t, 2t+1), a1 (g+8),
// a2 (g, k 2t+8, 2t+9), a3 (g+8); B b0 (k 2t, 2t+1, column g), b1 (k 2t+8, 2t+9). The k order within
// a 16-column step is free when A and B agree: lane t's raw code bytes are columns 4t..4t+3 (the
// ldmatrix words of the integer path), and the pair (bytes 0, 2) plays k (2t, 2t+1), the pair
// (bytes 1, 3) plays k (2t+8, 2t+9); the activations are staged in the same order.
namespace h16 {

// The power-of-two factor of a token's super-block and its inverse, from the bits of max|x|: the
// biased exponent E of max|x| (at least 27, i.e. 2^-100: anything smaller counts as that small)
// gives f = 2^(141 - E - 127) so that max|x * f| < 2^15; inf/NaN (E = 255) give finite factors and
// the NaN or inf propagates through the products.
struct TokScale {
  float f, inv;
};
MOE_HD TokScale token_scale(uint32_t amax_bits) {
  uint32_t e = amax_bits >> 23;
  if (e < 27u) e = 27u;
  return {u2f((268u - e) << 23), u2f((e - 14u) << 23)};
}
// The magic pairs of one code word (four bytes, columns 4t..4t+3): bits `mask` of bytes 0 and 2
// (or 1 and 3 after w >> 8) under the fp16 exponent of 1024, i.e. the halves 1024 + code (mask
// 0x000F000F / 0x001F001F) or 1024 + 16 code (0x00F000F0, Q4_K's high nibbles); subtracting
// 1024 + o (or 1024 + 16 o) is exact. On the device one lop3 (written out: the compiler's and + or
// took two, the exponent pair then lives in a register).
MOE_HD uint32_t magic_pair(uint32_t w, uint32_t mask) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "r"(mask), "r"(0x64006400u));  // (a & b) | c
  return d;
#else
  return (w & mask) | 0x64006400u;
#endif
}
// Byte b of w (a 6-bit scale) under the exponent of 1024, twice: the half2 (1024 + sc, 1024 + sc)
// (one byte permutation on the device).
MOE_HD uint32_t magic_scale2(uint32_t w, int b) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w, 0x64646464u, static_cast<uint32_t>(b | 4 << 4 | b << 8 | 4 << 12));
#else
  const uint32_t s = (w >> (8 * b)) & 0xFFu;
  return s | (s << 16) | 0x64006400u;
#endif
}

// The split activations of one token and super-block, a record of kRec4 uint4 (split_h16 writes them
// to global memory before the GEMM, which copies them whole into shared memory): uint4 {hi b0, hi b1,
// lo b0, lo b1} of 16-column step s, slice j, lane t at 32 s + 4 j + t; then 1 / f (float kRecInv),
// the slice sums in the layout of the minimums' B fragments (i8::xs_index / xs_word: uint4 kRecXs + t)
// and their lo parts (xs2_word: floats from kRecXs2).
constexpr int kRec4 = 72, kRecInv = 256, kRecXs = 65, kRecXs2 = 276;
// In shared memory a token's record sits kPitch4 uint4 after the previous one, so that a reading phase
// (tokens g, g + 1, lanes t) spans two rows 16 banks apart.
constexpr int kPitch4 = 76;
MOE_HD int bh_index(int n, int s, int j, int t) { return n * kPitch4 + 32 * s + 4 * j + t; }

}  // namespace h16

#if defined(__CUDACC__)
namespace i8 {
// d = A (16 x 32 u8) B (32 x 8 s8) + c (the same c in every element).
__device__ __forceinline__ void mma_k32(uint32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                        uint32_t c) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c));
}
// d = A (16 x 16 s8) B (16 x 8 s8) + c.
__device__ __forceinline__ void mma_k16(uint32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0, uint32_t c) {
  asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(b0), "r"(c));
}
// Four 8x8 b16 matrices from shared memory (row addresses as ldsm_row / ldsm_byte).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
}  // namespace i8

namespace h16 {
// Four 8x8 b16 matrices from shared memory, each transposed: lane (g, t) gets elements [2t][g] and
// [2t + 1][g] of matrix i (row addresses from lanes 8i .. 8i + 7).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// d += A (16 x 16 f16) B (16 x 8 f16), fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// mul / sub .rn.f16x2 on raw registers: exact where used (small integers, powers of two).
__device__ __forceinline__ uint32_t hmul2_u(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hsub2_u(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// The fp16 pair {a (low half), b (high)}, rounded to nearest even.
__device__ __forceinline__ uint32_t pack_h2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_h2(uint32_t w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
}  // namespace h16
#endif  // __CUDACC__

}  // namespace moe::cuda::dev
