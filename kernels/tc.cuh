// Device building blocks of the tensor-core GEMVs (see gemv_tc.cu for the arithmetic): x staged as
// 16-bit integers split in two int8 MMA B columns, one super-block of two rows per lane, and 16-row
// tiles split over warps. Kept apart from the kernels (gemv_tc.cu) so that other kernels can build on them.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"
#include "mma.cuh"

namespace moe::cuda::k::tc {
using namespace dev;

// ---- x as int8 MMA B fragments ---------------------------------------------------------------------------
// x (or rmsnorm(x) * w) is quantized per group of 256 elements (one K-quant super-block) to integers
// X = rint(x / s), s = max|x| / kXMax (24 bits), written in three signed base-256 digits
// X = 65536 Xa + 256 Xb + Xc (each in [-128, 127]). Columns 0, 1, 2 of the MMA's B hold Xa, Xb, Xc, so
// one m16n8k32 integer MMA multiplies 16 rows x 32 quant codes by all three digits; the digit sums are
// weighted 65536 / 256 / 1 in fp32. Relative precision 2^-24 of the group's largest element: fp32-level.
constexpr float kXMax = 8323072.f;  // 127 * 65536: the top digit stays within [-127, 127]

// Shared-memory staging of x for n elements (n a multiple of 256).
struct XQ {
  uint2* q;      // [n/32][digit 0..2][t 0..3]: B registers (k = 4t.., k = 16 + 4t..) of 32-element group:
                 // elements 8t..8t+3 and 8t+4..8t+7 (load_sb: a lane's quant bytes of a group are consecutive)
  int* sum16;    // [n/16]: sums of X over 16 consecutive elements (the K-quant minimums, Q6_K's -32)
  float* scale;  // [n/256]: s of each group of 256
};
__host__ __device__ inline size_t xq_smem(int n) {
  return static_cast<size_t>(n) * 3 + static_cast<size_t>(n) / 4 + static_cast<size_t>(n) / 64;
}
__device__ __forceinline__ XQ carve_xq(void* smem, int n) {
  XQ x;
  x.q = static_cast<uint2*>(smem);
  x.sum16 = reinterpret_cast<int*>(x.q + 3 * n / 8);  // 16-byte aligned: 3n bytes
  x.scale = reinterpret_cast<float*>(x.sum16 + n / 16);
  return x;
}

// Quantizes float4 index i (elements 4i..4i+3, already normalised) given its group's 1/s; writes the
// B registers and the 16-element sums. Called by every lane of a warp together (the sums reduce over
// 4 consecutive lanes).
__device__ __forceinline__ void emit_xq(int i, float4 v, float inv, const XQ& xq) {
  int X[4] = {__float2int_rn(v.x * inv), __float2int_rn(v.y * inv), __float2int_rn(v.z * inv),
              __float2int_rn(v.w * inv)};
  // X + 0x808080 (in [0, 2^24) for |X| <= 8323072) holds the three signed base-256 digits + 128 in its
  // bytes 0 (Xc), 1 (Xb) and 2 (Xa), and a biased byte ^ 0x80 is the digit's int8 pattern: two byte
  // permutes per pair of elements gather a digit (a third of the instructions of peeling them off)
  uint32_t U[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    X[e] = max(-8323072, min(8323072, X[e]));
    U[e] = static_cast<uint32_t>(X[e] + 0x808080);
  }
  auto digit = [&](int b) { return i8::pack_byte(U[0], U[1], U[2], U[3], b) ^ 0x80808080u; };
  const int j = i >> 3, p = i & 7, t = p >> 1, half = p & 1;  // elements 32j + 8t + 4 half..
  uint32_t* q32 = reinterpret_cast<uint32_t*>(xq.q);
  q32[((j * 3 + 0) * 4 + t) * 2 + half] = digit(2);
  q32[((j * 3 + 1) * 4 + t) * 2 + half] = digit(1);
  q32[((j * 3 + 2) * 4 + t) * 2 + half] = digit(0);
  int s = (X[0] + X[1]) + (X[2] + X[3]);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  if ((i & 3) == 0) xq.sum16[i >> 2] = s;
}

// The staging of h = x (or rmsnorm(x) * norm_w) for n elements (n a multiple of 256) in two steps, so
// that a kernel can start other work in between: stage_load issues the loads of x and of the gains,
// stage_finish reduces, quantizes and writes the shared memory, ends with a barrier and returns
// rmsnorm's 1/rms (1 without norm_w; `given` > 0: that 1/rms, known to the caller, without the block's
// reduction). Group g of 256 elements (64 float4s) belongs to warp g % warps, whose lanes hold float4s
// lane and 32 + lane of it: a group's largest element is one warp reduction, with no barrier between
// finding it and quantizing (the groups past R / 2 per warp are read again through L2). Ordinary weight
// loads must not be in flight meanwhile: on an SM with DRAM misses outstanding the staging measured
// ~3 us slower (kernels prefetch their weights into L2 with bulk_prefetch_l2 instead).
template <int R>
struct XLoad {
  static_assert(R % 2 == 0, "two float4s per lane and group");
  float4 x[R], w[R];
};
template <int R>
__device__ __forceinline__ void stage_load(const float* __restrict__ x, int n, const float* __restrict__ norm_w,
                                           XLoad<R>& l) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  const int groups = n >> 8, nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int g = warp + (k >> 1) * nw, i = g * 64 + (k & 1) * 32 + lane;
    if (g < groups) {
      l.x[k] = __ldcg(x4 + i);  // written by other blocks: read through L2
      if (norm_w) l.w[k] = w4[i];
    }
  }
}

template <int R>
__device__ __forceinline__ float stage_finish(const float* __restrict__ x, int n, const float* __restrict__ norm_w,
                                             float eps, XLoad<R>& l, const XQ& xq, float* red, float given = 0.f) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  const int groups = n >> 8, nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto sq4 = [](float4 v) { return (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w); };
  float scale = norm_w && given > 0.f ? given : 1.f;
  if (norm_w && !(given > 0.f)) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (warp + (k >> 1) * nw < groups) ss += sq4(l.x[k]);
    for (int g = warp + (R / 2) * nw; g < groups; g += nw)
      ss += sq4(__ldcg(x4 + g * 64 + lane)) + sq4(__ldcg(x4 + g * 64 + 32 + lane));
    ss = block_sum(ss, red);
    scale = rsqrtf(ss / static_cast<float>(n) + eps);
  }
  auto norm = [&](float4 v, float4 w) {
    if (norm_w) {
      v.x *= scale * w.x;
      v.y *= scale * w.y;
      v.z *= scale * w.z;
      v.w *= scale * w.w;
    }
    return v;
  };
  auto amax4 = [](float4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); };
  // one group by the whole warp: its largest |h|, its scale, its B registers and 16-element sums
  auto emit_group = [&](int g, float4 a, float4 b) {
    const float m = warp_max(fmaxf(amax4(a), amax4(b)));
    if (lane == 0) xq.scale[g] = m / kXMax;
    const float inv = m > 0.f ? kXMax / m : 0.f;
    emit_xq(g * 64 + lane, a, inv, xq);
    emit_xq(g * 64 + 32 + lane, b, inv, xq);
  };
#pragma unroll
  for (int k = 0; k < R; k += 2) {
    const int g = warp + (k >> 1) * nw;
    if (g < groups) emit_group(g, norm(l.x[k], l.w[k]), norm(l.x[k + 1], l.w[k + 1]));
  }
  for (int g = warp + (R / 2) * nw; g < groups; g += nw) {
    const int i = g * 64 + lane;
    const float4 wa = norm_w ? w4[i] : float4{}, wb = norm_w ? w4[i + 32] : float4{};
    emit_group(g, norm(__ldcg(x4 + i), wa), norm(__ldcg(x4 + i + 32), wb));
  }
  __syncthreads();
  return scale;
}

// ---- the MMA ----------------------------------------------------------------------------------------
// d = A (16 x 32 unsigned codes) x B (32 x 8 int8), int32 accumulation from zero.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], const uint32_t (&a)[4], uint2 b) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "r"(0));
}

__device__ __forceinline__ uint32_t ldg32(const uint8_t* p) {
  uint32_t r;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ldg64(const uint8_t* p) {
  uint2 r;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ldg128(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// The same loads from shared memory (a generic pointer into it): weights staged by cp.async.
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return r;
}
__device__ __forceinline__ uint2 lds64(const uint8_t* p) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(r.x), "=r"(r.y)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return r;
}
__device__ __forceinline__ uint4 lds128(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return r;
}
template <bool kSm>
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) {
  if constexpr (kSm) return lds32(p); else return ldg32(p);
}
template <bool kSm>
__device__ __forceinline__ uint2 ld64(const uint8_t* p) {
  if constexpr (kSm) return lds64(p); else return ldg64(p);
}
template <bool kSm>
__device__ __forceinline__ uint4 ld128(const uint8_t* p) {
  if constexpr (kSm) return lds128(p); else return ldg128(p);
}

// This lane's bytes of one super-block of rows g and g + 8 (in global memory, or with kSm in shared).
struct SbRaw {
  uint32_t q[2][4][2];  // [row][chunk][h]: Q4_K/Q5_K qs words, Q6_K ql words
  uint32_t h[2][4][2];  // Q6_K qh words [row][chunk][h]; Q5_K qh words [row][0][h]
  uint4 hdr[2];         // Q4_K/Q5_K: d, dmin, 12 scale bytes; Q6_K: 16 int8 scales
  uint32_t d[2];        // Q6_K: d
};

template <uint32_t T, bool kSm = false>
__device__ __forceinline__ void load_sb(const uint8_t* rg, const uint8_t* r8, int t, SbRaw& r) {
  using namespace layout;
  const uint8_t* rows[2] = {rg, r8};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint8_t* b = rows[i];
    if constexpr (T == Q4_K || T == Q5_K) {
      constexpr int qs = T == Q4_K ? 16 : 48;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint2 w = ld64<kSm>(b + qs + 32 * c + 8 * t);
        r.q[i][c][0] = w.x;
        r.q[i][c][1] = w.y;
      }
      r.hdr[i] = ld128<kSm>(b);
      if constexpr (T == Q5_K) {
        const uint2 w = ld64<kSm>(b + 16 + 8 * t);
        r.h[i][0][0] = w.x;
        r.h[i][0][1] = w.y;
      }
    } else {  // Q6_K: chunk ch = 2n + kk
#pragma unroll
      for (int ch = 0; ch < 4; ++ch) {
        const int n = ch >> 1, kk = ch & 1;
        const uint2 q = ld64<kSm>(b + 64 * n + 32 * kk + 8 * t);
        r.q[i][ch][0] = q.x;
        r.q[i][ch][1] = q.y;
        if (kk == 0) {  // one qh run per 128 elements, shared by chunks 2n and 2n + 1
          const uint2 h = ld64<kSm>(b + 128 + 32 * n + 8 * t);
          r.h[i][ch][0] = r.h[i][ch + 1][0] = h.x;
          r.h[i][ch][1] = r.h[i][ch + 1][1] = h.y;
        }
      }
      r.hdr[i] = ld128<kSm>(b + 192);
      r.d[i] = ld32<kSm>(b + 208);
    }
  }
}

__device__ __forceinline__ float half_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w))); }
__device__ __forceinline__ float half_hi(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16)));
}
__device__ __forceinline__ int u8_at(uint32_t w, int byte) { return static_cast<int>((w >> (8 * byte)) & 0xFFu); }
__device__ __forceinline__ int s8_at(uint32_t w, int shift) { return static_cast<int8_t>(w >> shift); }
// prmt's selector that moves byte b (0-3, known only at run time) of a word to byte 0, sign-extended: one
// instruction per extraction (s8_sel), where a shift by a register and a sign extension take two.
__device__ __forceinline__ uint32_t s8_selector(int b) {
  const uint32_t c = 8u | static_cast<uint32_t>(b);
  return static_cast<uint32_t>(b) | c << 4 | c << 8 | c << 12;
}
__device__ __forceinline__ int s8_sel(uint32_t w, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(w), "r"(sel));
  return static_cast<int>(r);
}

// The eight 6-bit scales (sc[0]: sub-blocks 0-3, sc[1]: 4-7) and minimums of a Q4_K/Q5_K header.
__device__ __forceinline__ void kq_scales(const uint4& hd, uint32_t (&sc)[2], uint32_t (&mn)[2]) {
  sc[0] = hd.y & 0x3F3F3F3Fu;
  mn[0] = hd.z & 0x3F3F3F3Fu;
  sc[1] = (hd.w & 0x0F0F0F0Fu) | ((hd.y >> 2) & 0x30303030u);
  mn[1] = ((hd.w >> 4) & 0x0F0F0F0Fu) | ((hd.z >> 2) & 0x30303030u);
}

// acc[0] (row g) and acc[2] (row g + 8) += w * (this super-block of the two rows) · x, where the
// super-block is the sbg-th group of 256 of the staged x.
//
// Per 32 codes the MMA gives, in lane t, columns 2t and 2t + 1 of rows g and g + 8 (digit products;
// lanes past the used columns hold zeros). Each lane sums its two columns in int32 times the
// sub-block's integer scale, and weights them by their digit's 65536 / 256 / 1 once per super-block
// in fp32; the minimum (Q4_K/Q5_K) or -32 offset (Q6_K) terms come from the 16-element sums of X, split
// over the four t lanes. Bounds: |Σ_j sc_j · (codes · digit)| <= 8 · 63 · 32 · 63 · 128 < 2^31.
template <uint32_t T>
__device__ __forceinline__ void mma_sb(const SbRaw& r, int sbg, float w, const XQ& xq, int g, int t,
                                       float (&acc)[4]) {
  using namespace layout;
  const int s0 = sbg * 8;  // first 32-element group
  const float f = w * xq.scale[sbg];
  const int4 xs = *reinterpret_cast<const int4*>(xq.sum16 + s0 * 2 + 4 * t);
  // this lane's B registers of the super-block's first group (digit min(g, 2), t); group j's are 12 uint2
  // further: a compile-time offset (indexing xq.q with the whole expression cost ~5 instructions a load)
  const uint2* xb = xq.q + (s0 * 3 + min(g, 2)) * 4 + t;
  int va[2] = {0, 0}, vb[2] = {0, 0};  // [row]: this lane's columns 2t and 2t + 1
  int ha[2] = {0, 0}, hb[2] = {0, 0};  // Q4_K: the high-nibble sub-blocks' sums, 16x
  if constexpr (T == Q4_K || T == Q5_K) {
    uint32_t sc[2][2], mn[2][2];
    kq_scales(r.hdr[0], sc[0], mn[0]);
    kq_scales(r.hdr[1], sc[1], mn[1]);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // sub-block j = 2c + hi: low or high nibbles
        const int j = 2 * c + hi;
        // Q4_K's high nibbles stay in place (16x the code, < 256): their products are 16x, summed apart
        // and divided by 16 exactly (a shift) at the end; the mask alone, no shift per register
        constexpr bool kH16 = T == Q4_K;
        const uint32_t m = kH16 && hi ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
        const int sh = kH16 ? 0 : 4 * hi;
        uint32_t a[4] = {(r.q[0][c][0] >> sh) & m, (r.q[1][c][0] >> sh) & m, (r.q[0][c][1] >> sh) & m,
                         (r.q[1][c][1] >> sh) & m};
        if constexpr (T == Q5_K) {
          a[0] |= ((r.h[0][0][0] >> j) & 0x01010101u) << 4;
          a[1] |= ((r.h[1][0][0] >> j) & 0x01010101u) << 4;
          a[2] |= ((r.h[0][0][1] >> j) & 0x01010101u) << 4;
          a[3] |= ((r.h[1][0][1] >> j) & 0x01010101u) << 4;
        }
        const uint2 b = g < 3 ? xb[j * 12] : make_uint2(0u, 0u);
        int d[4];
        mma_u8s8(d, a, b);
        const int sg = u8_at(sc[0][c >> 1], j & 3), s8 = u8_at(sc[1][c >> 1], j & 3);
        int(&ua)[2] = kH16 && hi ? ha : va;
        int(&ub)[2] = kH16 && hi ? hb : vb;
        ua[0] += sg * d[0];
        ub[0] += sg * d[1];
        ua[1] += s8 * d[2];
        ub[1] += s8 * d[3];
      }
    }
    if constexpr (T == Q4_K) {  // |16x sums| <= 4 * 63 * 32 * 240 * 128 < 2^31; multiples of 16
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        va[i] += ha[i] >> 4;
        vb[i] += hb[i] >> 4;
      }
    }
    // lane 0 holds digits a, b (columns 0, 1), lane 1 digit c (column 2)
    const float wa = t == 0 ? 65536.f : 1.f, wb = t == 0 ? 256.f : 0.f;
    // minimums of this lane's sub-blocks 2t and 2t + 1
    const float x0 = static_cast<float>(xs.x + xs.y), x1 = static_cast<float>(xs.z + xs.w);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t mw = (t < 2 ? mn[i][0] : mn[i][1]) >> (16 * (t & 1));
      const float m = static_cast<float>(u8_at(mw, 0)) * x0 + static_cast<float>(u8_at(mw, 1)) * x1;
      const float d = half_lo(r.hdr[i].x), dmin = half_hi(r.hdr[i].x);
      acc[2 * i] += f * (d * (wa * static_cast<float>(va[i]) + wb * static_cast<float>(vb[i])) - dmin * m);
    }
  } else {  // Q6_K: columns 0-2 hold the digits of the first 16 elements of a group, 3-5 of the last 16
    const uint32_t hw[2][4] = {{r.hdr[0].x, r.hdr[0].y, r.hdr[0].z, r.hdr[0].w},
                               {r.hdr[1].x, r.hdr[1].y, r.hdr[1].z, r.hdr[1].w}};
    // column c = 2t (+1) is half c / 3 of the group (its scale byte) and digit c % 3 (its weight)
    const int ha = min((2 * t) / 3, 1), hb = min((2 * t + 1) / 3, 1);
    const uint32_t sla[2] = {s8_selector(ha), s8_selector(2 + ha)};  // by kp & 1
    const uint32_t slb[2] = {s8_selector(hb), s8_selector(2 + hb)};
    // the first 16 elements are in lanes t = 0, 1 (8t..8t+7), the last 16 in t = 2, 3: lanes g < 3 load
    // digit g of the first, lanes 3 <= g < 6 digit g - 3 of the last
    const bool use_b = g < 6 && (g < 3) == (t < 2);
    const uint2* xb6 = xq.q + (s0 * 3 + (g < 3 ? g : min(g - 3, 2))) * 4 + t;
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) {
      const int n = ch >> 1, kk = ch & 1;
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // k' = kk + 2 hi: low or high nibbles
        const int kp = kk + 2 * hi;
        auto code = [&](uint32_t q, uint32_t h) {
          return ((q >> (4 * hi)) & 0x0F0F0F0Fu) | (((h >> (2 * kp)) & 0x03030303u) << 4);
        };
        const uint32_t a[4] = {code(r.q[0][ch][0], r.h[0][ch][0]), code(r.q[1][ch][0], r.h[1][ch][0]),
                               code(r.q[0][ch][1], r.h[0][ch][1]), code(r.q[1][ch][1], r.h[1][ch][1])};
        const uint2 b = use_b ? xb6[(4 * n + kp) * 12] : make_uint2(0u, 0u);
        int d[4];
        mma_u8s8(d, a, b);
        // scale of 16 elements 8n + 2kp + half: word 2n + hi, byte 2kk + half
        const uint32_t wg = hw[0][2 * n + hi], w8 = hw[1][2 * n + hi];
        va[0] += s8_sel(wg, sla[kk]) * d[0];
        vb[0] += s8_sel(wg, slb[kk]) * d[1];
        va[1] += s8_sel(w8, sla[kk]) * d[2];
        vb[1] += s8_sel(w8, slb[kk]) * d[3];
      }
    }
    // digit weights of columns 2t and 2t + 1: (a, b), (c, a), (b, c)
    const float wa = t == 0 ? 65536.f : t == 1 ? 1.f : 256.f, wb = t == 0 ? 256.f : t == 1 ? 65536.f : 1.f;
    // -32 offsets of this lane's 16-element sub-blocks 4t .. 4t + 3
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t sw = t == 0 ? hw[i][0] : t == 1 ? hw[i][1] : t == 2 ? hw[i][2] : hw[i][3];
      const float o = static_cast<float>(s8_at(sw, 0)) * static_cast<float>(xs.x) +
                      static_cast<float>(s8_at(sw, 8)) * static_cast<float>(xs.y) +
                      static_cast<float>(s8_at(sw, 16)) * static_cast<float>(xs.z) +
                      static_cast<float>(s8_at(sw, 24)) * static_cast<float>(xs.w);
      const float d = half_lo(r.d[i]);
      acc[2 * i] += f * d * (wa * static_cast<float>(va[i]) + wb * static_cast<float>(vb[i]) - 32.f * o);
    }
  }
}

template <uint32_t T>
constexpr int sb_bytes() {
  return T == layout::Q4_K ? 144 : T == layout::Q5_K ? 176 : 224;
}

// Bytes of a row of `cols` elements of a tensor-core type (a multiple of 16).
__device__ __forceinline__ uint32_t tc_row_bytes(uint32_t type, int cols) {
  return static_cast<uint32_t>(cols / 256) * (type == layout::Q4_K ? 144u : type == layout::Q5_K ? 176u : 224u);
}

// Runs this warp's share of a 16-row tile: super-blocks f = first, first + step, ... of the flat index
// over n_seg segments of sb_per_seg super-blocks (the flat index is also the group of 256 of the staged
// x). row(seg, i) gives the segment's row pointer of this lane's row i (0: g, 1: g + 8), wgt(seg) its
// weight. With kPipe the next super-block's loads are issued before the current one is multiplied
// (twice the registers: for warps with several super-blocks); without, other warps hide the latency.
template <uint32_t T, bool kPipe, bool kSm = false, class RowFn, class WFn>
__device__ __forceinline__ void tile16(RowFn row, WFn wgt, int n_seg, int sb_per_seg, int first, int step,
                                       const XQ& xq, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int total = n_seg * sb_per_seg;
  constexpr int BB = sb_bytes<T>();
  // the segment of flat index f (no division for one segment: ~20 instructions a super-block)
  auto seg_of = [&](int f) { return n_seg > 1 ? f / sb_per_seg : 0; };
  auto load = [&](int f, int seg, SbRaw& r) {
    const int sb = f - seg * sb_per_seg;
    load_sb<T, kSm>(row(seg, 0) + sb * BB, row(seg, 1) + sb * BB, t, r);
  };
  int f = first;
  if constexpr (kPipe) {
    SbRaw cur, nxt;
    int seg = f < total ? seg_of(f) : 0;
    if (f < total) load(f, seg, cur);
    for (; f < total; f += step) {
      const int fn = f + step, segn = fn < total ? seg_of(fn) : 0;
      if (fn < total) load(fn, segn, nxt);
      mma_sb<T>(cur, f, wgt(seg), xq, g, t, acc);
      cur = nxt;
      seg = segn;
    }
  } else {
    for (; f < total; f += step) {
      const int seg = seg_of(f);
      SbRaw cur;
      load(f, seg, cur);
      mma_sb<T>(cur, f, wgt(seg), xq, g, t, acc);
    }
  }
}

// Sums a warp's acc over its four t lanes and writes the 16 row totals to red16[0..16).
__device__ __forceinline__ void warp_rows_to_smem(float (&acc)[4], float* red16) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float rg = acc[0] + acc[1], r8 = acc[2] + acc[3];
  rg += __shfl_xor_sync(0xffffffffu, rg, 1);
  rg += __shfl_xor_sync(0xffffffffu, rg, 2);
  r8 += __shfl_xor_sync(0xffffffffu, r8, 1);
  r8 += __shfl_xor_sync(0xffffffffu, r8, 2);
  if (t == 0) {
    red16[g] = rg;
    red16[g + 8] = r8;
  }
}

// ---- shared by the decode kernels (gemv_tc.cu, experts_tc.cuh) --------------------------------------------
// Shared memory of the kernels with weight rows in shared memory: the staged input (n elements), then
// the rows.
__host__ __device__ inline size_t rows_smem_offset(int n) { return (xq_smem(n) + 127) / 128 * 128; }
// The stride of weight rows in shared memory: the global row stride padded to 32 bytes past a multiple of
// 128, so that the rows g = 0..7 a warp's lanes load (8 bytes at 8t of the same chunk) start 8 banks apart
// and a half warp's 16 loads hit 32 distinct banks. With the global stride (a multiple of 128 bytes for
// 2,048 columns of Q4_K or Q6_K) all eight rows start in the same bank: 8-way conflicts on every load.
__host__ __device__ inline int rows_smem_stride(int row_stride) {
  return row_stride + ((32 - (row_stride & 127)) & 127);
}
constexpr size_t kTcMaxSmem = 200 * 1024;  // tc_init's and tc_experts_init's MaxDynamicSharedMemorySize

// This block's 1/gridDim share of region i of an L2Ahead to L2 (one bulk prefetch).
__device__ __forceinline__ void send_ahead_share(const L2Ahead& ahead, int i) {
  if (!ahead.base[i]) return;
  const int64_t bytes = ahead.bytes[i];
  const int64_t chunk = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~int64_t{15};
  const int64_t o = blockIdx.x * chunk;
  if (o < bytes)
    bulk_prefetch_l2(static_cast<const uint8_t*>(ahead.base[i]) + o, static_cast<uint32_t>(min(chunk, bytes - o)));
}

// The router's sums in fixed point (o_proj_router's partials, the gate/up kernel's choice; launch.cuh):
// a sum's value is acc * 2^-32 ref, ref the layer input's RMS (1 when it is not a positive finite number).
constexpr float kFixedUnit = 4294967296.f;                // 2^32
constexpr float kFixedUnitInv = 2.3283064365386963e-10f;  // 2^-32
__device__ __forceinline__ float ref_or_one(float ref) { return ref > 0.f && ref < INFINITY ? ref : 1.f; }

}  // namespace moe::cuda::k::tc
