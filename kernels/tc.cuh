// Device building blocks of the tensor-core GEMVs (see gemv_tc.cu for the arithmetic): x staged as
// MMA B fragments, one super-block of two rows per lane, and 16-row tiles split over warps. Kept apart
// from the kernels (gemv_tc.cu) so that other kernels can build on them.
#pragma once
#include <cuda_bf16.h>

#include "common.cuh"

namespace moe::cuda::k::tc {
using namespace dev;


// ---- x as MMA B fragments ------------------------------------------------------------------------------
// For group s (32 elements): entries [h 0..1][part 0..3][t 0..3] of two 32-bit registers; part 3 is zero.
__device__ __forceinline__ int xb_index(int s, int h, int part, int t) { return ((s * 2 + h) * 4 + part) * 4 + t; }

__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void split3(float x, float (&p)[3]) {
  const float a = __bfloat162float(__float2bfloat16_rn(x));
  const float r = x - a;
  const float b = __bfloat162float(__float2bfloat16_rn(r));
  p[0] = a;
  p[1] = b;
  p[2] = r - b;  // rounded to bf16 when packed
}

// Writes the B fragments and the group sum of the four elements of float4 index i (already normalised).
// Called by every lane of a warp together (the group sums reduce over 8 consecutive lanes).
__device__ __forceinline__ void emit_xb(int i, float4 v, uint2* xb, float* xsum32) {
  const int s = i >> 3, h = (i >> 2) & 1, t = i & 3;  // elements 4i.. = 32s + 16h + 4t..
  float p0[3], p1[3], p2[3], p3[3];
  split3(v.x, p0);
  split3(v.y, p1);
  split3(v.z, p2);
  split3(v.w, p3);
#pragma unroll
  for (int part = 0; part < 3; ++part)
    xb[xb_index(s, h, part, t)] = make_uint2(bf16x2(p0[part], p2[part]), bf16x2(p1[part], p3[part]));
  xb[xb_index(s, h, 3, t)] = make_uint2(0u, 0u);
  float sum = (v.x + v.y) + (v.z + v.w);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);
  if ((i & 7) == 0) xsum32[s] = sum;
}

// Builds the B fragments of h = x (or rmsnorm(x) * norm_w) for n elements (n a multiple of 128) and the
// sums of h over each group of 32 (xsum32, for the K-quant minimums). The first R float4s per thread of x
// and of the gains are loaded at once, so the prologue costs one round trip to memory.
template <int R>
__device__ __forceinline__ void stage_xb(const float* __restrict__ x, int n, const float* __restrict__ norm_w,
                                         float eps, uint2* xb, float* xsum32, float* red) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  const int n4 = n >> 2, bd = blockDim.x;
  float4 xv[R], wv[R];
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int i = threadIdx.x + k * bd;
    if (i < n4) {
      xv[k] = __ldcg(x4 + i);  // written by other blocks: read through L2
      if (norm_w) wv[k] = w4[i];
    }
  }
  float scale = 1.f;
  if (norm_w) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (threadIdx.x + k * bd < n4) ss += (xv[k].x * xv[k].x + xv[k].y * xv[k].y) + (xv[k].z * xv[k].z + xv[k].w * xv[k].w);
    for (int i = threadIdx.x + R * bd; i < n4; i += bd) {
      const float4 v = __ldcg(x4 + i);
      ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
    }
    ss = block_sum(ss, red);
    scale = rsqrtf(ss / static_cast<float>(n) + eps);
  }
  auto norm = [&](float4 v, float4 w) {
    if (norm_w) {
      v.x = v.x * scale * w.x;
      v.y = v.y * scale * w.y;
      v.z = v.z * scale * w.z;
      v.w = v.w * scale * w.w;
    }
    return v;
  };
  // n4 and bd are multiples of 32: each warp is either wholly inside or wholly past n4
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int i = threadIdx.x + k * bd;
    if (i < n4) emit_xb(i, norm(xv[k], wv[k]), xb, xsum32);
  }
  for (int i = threadIdx.x + R * bd; i < n4; i += bd) emit_xb(i, norm(__ldcg(x4 + i), norm_w ? w4[i] : make_float4(0.f, 0.f, 0.f, 0.f)), xb, xsum32);
  __syncthreads();
}

// ---- the MMA ----------------------------------------------------------------------------------------
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint2 b, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// bf16x2 of bytes 0 and 2 (k pair 2t, 2t+1) and bytes 1 and 3 (k pair 2t+8, 2t+9) of v (byte values
// below 128), each minus `off` (a bf16x2 constant): exact small integers.
__device__ __forceinline__ uint32_t bsub(uint32_t v, uint32_t off) {
  __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&v), b = *reinterpret_cast<const __nv_bfloat162*>(&off);
  __nv_bfloat162 r = __hsub2(a, b);
  return *reinterpret_cast<uint32_t*>(&r);
}
constexpr uint32_t kMagic = 0x43004300u;    // bf16 128.0 in both halves
constexpr uint32_t kOff128 = 0x43004300u;   // 128
constexpr uint32_t kOff160 = 0x43204320u;   // 128 + 32 (Q6_K's -32)

// A fragment of rows g (word wg) and g + 8 (word w8), bytes of value < 128.
__device__ __forceinline__ void a_frag(uint32_t wg, uint32_t w8, uint32_t off, uint32_t (&a)[4]) {
  a[0] = bsub((wg & 0x00FF00FFu) | kMagic, off);
  a[1] = bsub((w8 & 0x00FF00FFu) | kMagic, off);
  a[2] = bsub(((wg >> 8) & 0x00FF00FFu) | kMagic, off);
  a[3] = bsub(((w8 >> 8) & 0x00FF00FFu) | kMagic, off);
}

__device__ __forceinline__ uint32_t ldg32(const uint8_t* p) {
  uint32_t r;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ldg128(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// This lane's bytes of one super-block of rows g and g + 8.
struct SbRaw {
  uint32_t q[2][4][2];  // [row][chunk][h]: Q4_K/Q5_K qs words, Q6_K ql words
  uint32_t h[2][4][2];  // Q6_K qh words [row][chunk][h]; Q5_K qh words [row][0][h]
  uint4 hdr[2];         // Q4_K/Q5_K: d, dmin, 12 scale bytes; Q6_K: 16 int8 scales
  uint32_t d[2];        // Q6_K: d
};

template <uint32_t T>
__device__ __forceinline__ void load_sb(const uint8_t* rg, const uint8_t* r8, int t, SbRaw& r) {
  using namespace layout;
  const uint8_t* rows[2] = {rg, r8};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint8_t* b = rows[i];
    if constexpr (T == Q4_K || T == Q5_K) {
      constexpr int qs = T == Q4_K ? 16 : 48;
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) r.q[i][c][h] = ldg32(b + qs + 32 * c + 16 * h + 4 * t);
      r.hdr[i] = ldg128(b);
      if constexpr (T == Q5_K) {
#pragma unroll
        for (int h = 0; h < 2; ++h) r.h[i][0][h] = ldg32(b + 16 + 16 * h + 4 * t);
      }
    } else {  // Q6_K: chunk ch = 2n + kk
#pragma unroll
      for (int ch = 0; ch < 4; ++ch)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = ch >> 1, kk = ch & 1;
          r.q[i][ch][h] = ldg32(b + 64 * n + 32 * kk + 16 * h + 4 * t);
          r.h[i][ch][h] = ldg32(b + 128 + 32 * n + 16 * h + 4 * t);
        }
      r.hdr[i] = ldg128(b + 192);
      r.d[i] = ldg32(b + 208);
    }
  }
}

__device__ __forceinline__ float half_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w))); }
__device__ __forceinline__ float half_hi(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16)));
}
__device__ __forceinline__ float u8f(uint32_t v) { return static_cast<float>(v & 0xFF); }
__device__ __forceinline__ float s8f(uint32_t w, int byte) {
  return static_cast<float>(static_cast<int8_t>((w >> (8 * byte)) & 0xFF));
}

// Scale and min of sub-blocks 2c and 2c + 1 (Q4_K/Q5_K) from a header; c is a compile-time constant.
__device__ __forceinline__ void kq_scales(const uint4& hd, int c, float (&sc)[2], float (&mn)[2]) {
  const int sh = 16 * (c & 1);
  const uint32_t a = hd.y >> sh, b = hd.z >> sh, w = hd.w >> sh;
  uint32_t s, m;
  if (c < 2) {
    s = a & 0x3F3F;
    m = b & 0x3F3F;
  } else {
    s = (w & 0x0F0F) | ((a >> 2) & 0x3030);
    m = ((w >> 4) & 0x0F0F) | ((b >> 2) & 0x3030);
  }
  const float d = half_lo(hd.x), dmin = half_hi(hd.x);
  sc[0] = d * u8f(s);
  sc[1] = d * u8f(s >> 8);
  mn[0] = dmin * u8f(m);
  mn[1] = dmin * u8f(m >> 8);
}

// acc (D layout: rows g, g, g+8, g+8) += w * (this super-block of rows g, g+8) · x, where the
// super-block's first 32-element group is s0 in the staged x.
template <uint32_t T>
__device__ __forceinline__ void mma_sb(const SbRaw& r, int s0, float w, const uint2* xb, const float* xsum32, int g,
                                       int t, float (&acc)[4]) {
  using namespace layout;
  const int part = g < 3 ? g : 3;
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (T == Q4_K || T == Q5_K) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float scg[2], mng[2], sc8[2], mn8[2];
      kq_scales(r.hdr[0], c, scg, mng);
      kq_scales(r.hdr[1], c, sc8, mn8);
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // sub-block 2c + hi: low or high nibbles
        const int s = s0 + 2 * c + hi;
        float d[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t vg = (r.q[0][c][h] >> (4 * hi)) & 0x0F0F0F0Fu, v8 = (r.q[1][c][h] >> (4 * hi)) & 0x0F0F0F0Fu;
          if constexpr (T == Q5_K) {
            const int bit = 2 * c + hi;
            vg |= ((r.h[0][0][h] >> bit) & 0x01010101u) << 4;
            v8 |= ((r.h[1][0][h] >> bit) & 0x01010101u) << 4;
          }
          uint32_t a[4];
          a_frag(vg, v8, kOff128, a);
          if (h == 0)
            mma_bf16(d, a, xb[xb_index(s, 0, part, t)], zero);
          else
            mma_bf16(d, a, xb[xb_index(s, 1, part, t)], d);
        }
        const float sg = w * scg[hi], s8 = w * sc8[hi];
        acc[0] = fmaf(sg, d[0], acc[0]);
        acc[1] = fmaf(sg, d[1], acc[1]);
        acc[2] = fmaf(s8, d[2], acc[2]);
        acc[3] = fmaf(s8, d[3], acc[3]);
        if (t == 0) {
          const float xs = w * xsum32[s];
          acc[0] = fmaf(-mng[hi], xs, acc[0]);
          acc[2] = fmaf(-mn8[hi], xs, acc[2]);
        }
      }
    }
  } else {  // Q6_K
    const float dg = w * half_lo(r.d[0]), d8 = w * half_lo(r.d[1]);
    const uint32_t scw_g[4] = {r.hdr[0].x, r.hdr[0].y, r.hdr[0].z, r.hdr[0].w};
    const uint32_t scw_8[4] = {r.hdr[1].x, r.hdr[1].y, r.hdr[1].z, r.hdr[1].w};
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) {
      const int n = ch >> 1, kk = ch & 1;
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // k' = kk + 2 hi: low or high nibbles
        const int kp = kk + 2 * hi;
        const int s = s0 + 4 * n + kp;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t vg = ((r.q[0][ch][h] >> (4 * hi)) & 0x0F0F0F0Fu) | (((r.h[0][ch][h] >> (2 * kp)) & 0x03030303u) << 4);
          const uint32_t v8 = ((r.q[1][ch][h] >> (4 * hi)) & 0x0F0F0F0Fu) | (((r.h[1][ch][h] >> (2 * kp)) & 0x03030303u) << 4);
          uint32_t a[4];
          a_frag(vg, v8, kOff160, a);
          float d[4];
          mma_bf16(d, a, xb[xb_index(s, h, part, t)], zero);
          const int si = 8 * n + 2 * kp + h;  // int8 scale of these 16 elements
          const float sg = dg * s8f(scw_g[si >> 2], si & 3), s8 = d8 * s8f(scw_8[si >> 2], si & 3);
          acc[0] = fmaf(sg, d[0], acc[0]);
          acc[1] = fmaf(sg, d[1], acc[1]);
          acc[2] = fmaf(s8, d[2], acc[2]);
          acc[3] = fmaf(s8, d[3], acc[3]);
        }
      }
    }
  }
}

template <uint32_t T>
constexpr int sb_bytes() {
  return T == layout::Q4_K ? 144 : T == layout::Q5_K ? 176 : 224;
}

// Runs this warp's share of a 16-row tile: super-blocks f = first, first + step, ... of the flat index
// over n_seg segments of sb_per_seg super-blocks. row(seg, i) gives the segment's row pointer of this
// lane's row i (0: g, 1: g + 8), wgt(seg) its weight. The next super-block's loads are issued before the
// current one is multiplied; `pre`, when has_pre, holds the first one (f = first, loaded by tile16_preload).
template <uint32_t T, class RowFn, class WFn>
__device__ __forceinline__ void tile16(RowFn row, WFn wgt, int n_seg, int sb_per_seg, int first, int step,
                                       const uint2* xb, const float* xsum32, float (&acc)[4],
                                       const SbRaw& pre = SbRaw{}, bool has_pre = false) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int total = n_seg * sb_per_seg;
  constexpr int BB = sb_bytes<T>();
  auto load = [&](int f, SbRaw& r) {
    const int seg = f / sb_per_seg, sb = f - seg * sb_per_seg;
    load_sb<T>(row(seg, 0) + sb * BB, row(seg, 1) + sb * BB, t, r);
  };
  SbRaw cur, nxt;
  int f = first;
  if (has_pre)
    cur = pre;  // loaded by the caller before it waited on the previous kernel
  else if (f < total)
    load(f, cur);
  for (; f < total; f += step) {  // the next super-block's loads are issued before this one is multiplied
    const int fn = f + step;
    if (fn < total) load(fn, nxt);
    const int seg = f / sb_per_seg, sb = f - seg * sb_per_seg;
    mma_sb<T>(cur, (seg * sb_per_seg + sb) * 8, wgt(seg), xb, xsum32, g, t, acc);
    cur = nxt;
  }
}

// Loads the first super-block tile16<T> will multiply (f = first), for callers that issue it early.
template <uint32_t T, class RowFn>
__device__ __forceinline__ void tile16_preload(RowFn row, int sb_per_seg, int first, SbRaw& r) {
  const int seg = first / sb_per_seg, sb = first - seg * sb_per_seg;
  load_sb<T>(row(seg, 0) + sb * sb_bytes<T>(), row(seg, 1) + sb * sb_bytes<T>(), threadIdx.x & 3, r);
}

template <class RowFn, class WFn>
__device__ __forceinline__ void tile16_any(uint32_t type, RowFn row, WFn wgt, int n_seg, int sb_per_seg, int first,
                                           int step, const uint2* xb, const float* xsum32, float (&acc)[4]) {
  using namespace layout;
  switch (type) {
    case Q4_K: tile16<Q4_K>(row, wgt, n_seg, sb_per_seg, first, step, xb, xsum32, acc); break;
    case Q5_K: tile16<Q5_K>(row, wgt, n_seg, sb_per_seg, first, step, xb, xsum32, acc); break;
    case Q6_K: tile16<Q6_K>(row, wgt, n_seg, sb_per_seg, first, step, xb, xsum32, acc); break;
    default: break;
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

inline size_t xb_smem(int n) { return static_cast<size_t>(n / 32) * 256 + static_cast<size_t>(n / 32) * sizeof(float); }

}  // namespace moe::cuda::k::tc
