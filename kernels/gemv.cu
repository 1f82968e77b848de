// Decode-time matrix-vector products: weights dequantized in registers against fp32 activations
// held in shared memory (the same arithmetic as the CPU's exact mode up to the order of the sums).
//
// Work is cut into "units" of 32 weights of one row (for the K-quants: 16 bytes of packed quants,
// i.e. two 16-element runs of two sub-blocks, plus the block header they need). A warp owns a tile
// of NR rows and its lanes walk the units of those rows; each lane issues the loads of all NR rows
// of a unit before doing any arithmetic, so a warp keeps NR x 32 loads of 16 bytes in flight. The
// quantized bytes stream through (ld.global.nc.L1::no_allocate); quants become floats with a byte
// permute into the mantissa of 2^23 and one subtraction (integer-to-float conversions issue at a
// quarter of the FMA rate on sm_90, and were the limit of the first version).
//
// Q4_K, Q5_K and Q6_K have such unit kernels; every other type runs through dequant32 (one 32-element
// group per unit, slower but exact).
#include <algorithm>
#include <cstdlib>

#include "common.cuh"
#include "trace.cuh"
#include "gemv_tc.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ---- activations in shared memory --------------------------------------------------------------------
// The float4 at logical index i lives at i ^ xor4(i). A unit reads four consecutive float4s starting at
// e/4 for two runs; within a quarter warp (the lanes whose 16-byte loads are served together) the
// Q4_K/Q5_K units differ in bits 2, 4, 5 of that index and the Q6_K units in bits 2, 3, 5: the xor
// folds bits 3^4 and 5 into bits 0-1 so that both patterns hit eight different 16-byte bank groups.
__device__ __forceinline__ int xor4(int i) { return (((i >> 3) ^ (i >> 4)) & 1) | ((i >> 4) & 2); }
__device__ __forceinline__ int phys4(int i) { return i ^ xor4(i); }

// Stages n floats (n a multiple of 16) of x into xs (as rmsnorm(x) * norm_w when norm_w is set) and
// the sums of each run of 16 into sum16 (the K-quant minimums multiply them). Vector loads, unrolled so
// that each pass over x is one round trip to memory.
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int n, const float* __restrict__ norm_w, float eps,
                                        float* xs, float* sum16, float* red) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
  float4* xs4 = reinterpret_cast<float4*>(xs);
  const int n4 = n >> 2;
  float scale = 1.f;
  if (norm_w) {
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      const float4 v = x4[i];
      ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
    }
    ss = block_sum(ss, red);
    scale = rsqrtf(ss / static_cast<float>(n) + eps);
  }
#pragma unroll 4
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    float4 v = x4[i];
    if (norm_w) {
      const float4 w = w4[i];
      v.x = v.x * scale * w.x;
      v.y = v.y * scale * w.y;
      v.z = v.z * scale * w.z;
      v.w = v.w * scale * w.w;
    }
    xs4[phys4(i)] = v;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < (n >> 4); r += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = xs4[phys4(4 * r + j)];
      s += (v.x + v.y) + (v.z + v.w);
    }
    sum16[r] = s;
  }
  __syncthreads();
}

// ---- units -------------------------------------------------------------------------------------------
__device__ __forceinline__ uint4 ldg_stream(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ldg_stream32(const uint8_t* p) {
  uint32_t r;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// Byte k of w (a value below 2^8) as a float, minus `bias`: the byte goes into the mantissa of 2^23.
__device__ __forceinline__ float byte_f(uint32_t w, int k, float bias) {
  return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7650 + k)) - bias;
}
__device__ __forceinline__ float small_u2f(uint32_t v) { return __int_as_float(0x4B000000u | v) - 8388608.f; }
__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w))); }
__device__ __forceinline__ float f16_hi(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16))); }

// Σ_i (byte i of q - bias) * x[e + i] over 16 bytes; e a multiple of 16.
__device__ __forceinline__ float dot16(const uint32_t (&q)[4], float bias, const float4* xs, int e) {
  const int i0 = e >> 2;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 x = xs[phys4(i0 + j)];
    s0 = fmaf(byte_f(q[j], 0, bias), x.x, s0);
    s1 = fmaf(byte_f(q[j], 1, bias), x.y, s1);
    s0 = fmaf(byte_f(q[j], 2, bias), x.z, s0);
    s1 = fmaf(byte_f(q[j], 3, bias), x.w, s1);
  }
  return s0 + s1;
}

// The raw bytes of one unit (fields unused by a type are dropped by the compiler).
struct Raw {
  uint4 a, b, c;
  uint32_t d;
  const uint8_t* row;  // generic path: dequant32 reads the row itself
};

template <uint32_t T>
__device__ __forceinline__ void load_unit(const uint8_t* row, int u, Raw& r) {
  using namespace layout;
  if constexpr (T == Q4_K) {
    const uint8_t* sb = row + (u >> 3) * 144;
    r.a = ldg_stream(sb + 16 + 16 * (u & 7));
    r.b = ldg_stream(sb);
  } else if constexpr (T == Q5_K) {
    const uint8_t* sb = row + (u >> 3) * 176;
    r.a = ldg_stream(sb + 48 + 16 * (u & 7));
    r.b = ldg_stream(sb);
    r.c = ldg_stream(sb + 16 + 16 * (u & 1));
  } else if constexpr (T == Q6_K) {
    const uint8_t* sb = row + (u >> 3) * 224;
    const int p = u & 7, n = p >> 2;
    r.a = ldg_stream(sb + 64 * n + 16 * (p & 3));
    r.b = ldg_stream(sb + 128 + 32 * n + 16 * (p & 1));
    r.c.x = ldg_stream32(sb + 192 + 8 * n);  // the int8 scales of this unit's two runs
    r.c.y = ldg_stream32(sb + 196 + 8 * n);
    r.d = ldg_stream32(sb + 208);
  } else {
    r.row = row;
  }
}

// Q4_K / Q5_K scale and min of the sub-block pair (2c, 2c + 1) from the 12 scale bytes (s0, s1, s2 words):
// returns (scale_lo | scale_hi << 8) and (min_lo | min_hi << 8).
__device__ __forceinline__ void k_pair(uint32_t s0, uint32_t s1, uint32_t s2, int c, uint32_t& sc, uint32_t& mn) {
  const int sh = 16 * (c & 1);
  const uint32_t a = s0 >> sh, b = s1 >> sh, w = s2 >> sh;
  if (c < 2) {
    sc = a & 0x3F3F;
    mn = b & 0x3F3F;
  } else {
    sc = (w & 0x0F0F) | ((a >> 2) & 0x3030);
    mn = ((w >> 4) & 0x0F0F) | ((b >> 2) & 0x3030);
  }
}

// This unit's contribution: Σ over its 32 weights of w * x, x taken at element offset xe.
template <uint32_t T>
__device__ __forceinline__ float dot_unit(const Raw& r, int u, const float4* xs, const float* sum16, int xe) {
  using namespace layout;
  if constexpr (T == Q4_K || T == Q5_K) {
    const int p = u & 7, c = p >> 1;
    const int e = xe + (u >> 3) * 256 + 64 * c + 16 * (p & 1);  // low nibbles; high nibbles at e + 32
    const uint32_t q[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
    uint32_t lo[4], hi[4];
    if constexpr (T == Q4_K) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo[j] = q[j] & 0x0F0F0F0Fu;
        hi[j] = (q[j] >> 4) & 0x0F0F0F0Fu;
      }
    } else {
      const uint32_t h[4] = {r.c.x, r.c.y, r.c.z, r.c.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo[j] = (q[j] & 0x0F0F0F0Fu) | (((h[j] >> (2 * c)) & 0x01010101u) << 4);
        hi[j] = ((q[j] >> 4) & 0x0F0F0F0Fu) | (((h[j] >> (2 * c + 1)) & 0x01010101u) << 4);
      }
    }
    const float sl = dot16(lo, 8388608.f, xs, e), sh = dot16(hi, 8388608.f, xs, e + 32);
    uint32_t sc, mn;
    k_pair(r.b.y, r.b.z, r.b.w, c, sc, mn);
    const float d = f16_lo(r.b.x), dmin = f16_hi(r.b.x);
    const float v = d * (small_u2f(sc & 0xFF) * sl + small_u2f(sc >> 8) * sh);
    return v - dmin * (small_u2f(mn & 0xFF) * sum16[e >> 4] + small_u2f(mn >> 8) * sum16[(e >> 4) + 2]);
  } else if constexpr (T == Q6_K) {
    const int p = u & 7, n = p >> 2, a = p & 1, kk = (p >> 1) & 1;
    const int e = xe + (u >> 3) * 256 + 128 * n + 32 * kk + 16 * a;  // high nibbles at e + 64
    const uint32_t q[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, h[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo[j] = (q[j] & 0x0F0F0F0Fu) | (((h[j] >> (2 * kk)) & 0x03030303u) << 4);
      hi[j] = ((q[j] >> 4) & 0x0F0F0F0Fu) | (((h[j] >> (2 * kk + 4)) & 0x03030303u) << 4);
    }
    const float sl = dot16(lo, 8388640.f, xs, e), sh = dot16(hi, 8388640.f, xs, e + 64);  // q - 32
    // int8 scales 8n + 2kk + a (low run) and + 4 (high run): words 2n and 2n + 1 (loaded as c.x, c.y),
    // byte 2kk + a
    const int sh8 = 8 * (2 * kk + a);
    const uint32_t wl = r.c.x, wh = r.c.y;
    const float scl = __int_as_float(0x4B000000u | (((wl >> sh8) & 0xFF) ^ 0x80)) - 8388736.f;
    const float sch = __int_as_float(0x4B000000u | (((wh >> sh8) & 0xFF) ^ 0x80)) - 8388736.f;
    return f16_lo(r.d) * (scl * sl + sch * sh);
  } else {
    float v[32];
    dequant32<T>(r.row, u, v);
    const int i0 = (xe >> 2) + 8 * u;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float4 x = xs[phys4(i0 + c)];
      s0 = fmaf(v[4 * c], x.x, s0);
      s1 = fmaf(v[4 * c + 1], x.y, s1);
      s0 = fmaf(v[4 * c + 2], x.z, s0);
      s1 = fmaf(v[4 * c + 3], x.w, s1);
    }
    return s0 + s1;
  }
}

// acc[rr] += Σ_s w(s) * row(s, rr) · x[s * seg_cols ...] for the NR rows of a tile (rows >= nvalid are
// skipped). A row is the concatenation of n_seg segments of seg_cols elements (n_seg = 1 except for the
// expert down projection, whose output row sums the chosen experts); rows(s, rr) gives the segment's
// row pointer and w(s) its weight.
template <uint32_t T, int NR, class RowFn, class WFn>
__device__ __forceinline__ void tile_dot(RowFn rows, WFn w, int n_seg, int seg_cols, int nvalid, const float4* xs,
                                         const float* sum16, int lane, float (&acc)[NR]) {
  const int nu = seg_cols >> 5;
  const int flat = n_seg * nu;
  auto step = [&](int it) {
    const int s = it / nu, u = it - s * nu;
    Raw r[NR];
#pragma unroll
    for (int rr = 0; rr < NR; ++rr)
      if (rr < nvalid) load_unit<T>(rows(s, rr), u, r[rr]);
    const float ws = w(s);
#pragma unroll
    for (int rr = 0; rr < NR; ++rr)
      if (rr < nvalid) acc[rr] = fmaf(ws, dot_unit<T>(r[rr], u, xs, sum16, s * seg_cols), acc[rr]);
  };
  if constexpr ((T == layout::Q4_K || T == layout::Q5_K || T == layout::Q6_K) && NR <= 2) {
    // keep four units of loads in flight per lane (more costs registers, hence occupancy)
    for (int it = lane; it < flat; it += 64) {
      step(it);
      if (it + 32 < flat) step(it + 32);
    }
  } else {
#pragma unroll 1
    for (int it = lane; it < flat; it += 32) step(it);
  }
}

// Calls tile_dot<T> for the runtime type t.
template <int NR, class RowFn, class WFn>
__device__ __forceinline__ void tile_dot_any(uint32_t t, RowFn rows, WFn w, int n_seg, int seg_cols, int nvalid,
                                             const float4* xs, const float* sum16, int lane, float (&acc)[NR]) {
  using namespace layout;
  switch (t) {
#define MOE_TILE_CASE(TT) \
  case TT: tile_dot<TT, NR>(rows, w, n_seg, seg_cols, nvalid, xs, sum16, lane, acc); break;
    MOE_TILE_CASE(F32) MOE_TILE_CASE(F16) MOE_TILE_CASE(BF16) MOE_TILE_CASE(Q4_0) MOE_TILE_CASE(Q4_1)
    MOE_TILE_CASE(Q5_0) MOE_TILE_CASE(Q5_1) MOE_TILE_CASE(Q8_0) MOE_TILE_CASE(Q2_K) MOE_TILE_CASE(Q3_K)
    MOE_TILE_CASE(Q4_K) MOE_TILE_CASE(Q5_K) MOE_TILE_CASE(Q6_K)
#undef MOE_TILE_CASE
    default: break;
  }
}

// Sums each acc[rr] over the warp; lane rr ends with row rr's total in acc[0].
template <int NR>
__device__ __forceinline__ float warp_sums(float (&acc)[NR], int lane) {
  float mine = 0.f;
#pragma unroll
  for (int rr = 0; rr < NR; ++rr) {
    const float v = warp_sum(acc[rr]);
    if (lane == rr) mine = v;
  }
  return mine;
}

// ---- dense GEMV (up to three matrices sharing x) ---------------------------------------------------------
template <int NR>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(GemvArgs a) {
  extern __shared__ float4 smem4[];
  __shared__ float red[32];
  float* xs = reinterpret_cast<float*>(smem4);
  float* sum16 = xs + a.cols;
  const int lane = threadIdx.x & 31;
  const int n_tiles = a.tiles_before[a.n_outs];
  const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
  send_hint_to_l2(a.hint);
  if (first < n_tiles) {  // weights do not depend on the previous kernel: start pulling them into L2
    int m = 0;
    while (first >= a.tiles_before[m + 1]) ++m;
    const Mat& W = a.outs[m].W;
    const int r0 = (first - a.tiles_before[m]) * NR;
    const int nr = min(NR, W.rows - r0);
    prefetch_l2(W.data + r0 * W.row_stride, nr * W.row_stride, lane);
  }
  pdl_sync();
  stage_x(a.x, a.cols, a.norm_w, a.eps, xs, sum16, red);
  for (int tile = first; tile < n_tiles; tile += gridDim.x * kWarps) {
    int m = 0;
    while (tile >= a.tiles_before[m + 1]) ++m;
    const Mat& W = a.outs[m].W;
    const int r0 = (tile - a.tiles_before[m]) * NR;
    const int nvalid = min(NR, W.rows - r0);
    const uint8_t* base = W.data + r0 * W.row_stride;
    const int64_t stride = W.row_stride;
    float acc[NR] = {};
    tile_dot_any<NR>(
        W.type, [&](int, int rr) { return base + rr * stride; }, [](int) { return 1.f; }, 1, a.cols, nvalid, smem4,
        sum16, lane, acc);
    const float v = warp_sums<NR>(acc, lane);
    if (lane < nvalid) {
      float* y = a.outs[m].y + r0 + lane;
      *y = a.accumulate ? *y + v : v;
    }
  }
}

// ---- MoE routing -------------------------------------------------------------------------------------
constexpr int kRouteThreads = 128;
constexpr int kRouteRegs = 4;  // float4s of an F32 router row held per thread (rows up to 2048)

template <uint32_t T>
__device__ __forceinline__ void route_dot_t(const uint8_t* row, int n_groups, const float* x, const float* w,
                                            float scale, float& acc) {
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
    float v[32];
    dequant32<T>(row, g, v);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc = fmaf(v[i], x[32 * g + i] * scale * w[32 * g + i], acc);
  }
}

// One block per router row (an F32 row is loaded into registers before waiting on the previous
// kernel). The choice of experts is left to the expert kernel's blocks (choose_experts).
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const float* __restrict__ x,
                                                              const float* __restrict__ norm_w, float eps, Mat R,
                                                              float* h_out, float* logits) {
  __shared__ float red[32];
  MOE_TRACE_SCOPE(5);
  const int r = blockIdx.x;
  const int n4 = R.cols >> 2;
  const bool in_regs = R.type == layout::F32 && n4 <= kRouteRegs * kRouteThreads;
  const float4* row4 = reinterpret_cast<const float4*>(R.data + r * R.row_stride);
  float4 wr[kRouteRegs];
  if (in_regs) {
#pragma unroll
    for (int k = 0; k < kRouteRegs; ++k) {
      const int i = threadIdx.x + k * kRouteThreads;
      if (i < n4) wr[k] = __ldg(row4 + i);
    }
  }
  pdl_sync();
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* g4 = reinterpret_cast<const float4*>(norm_w);
  float4 xr[kRouteRegs], gr[kRouteRegs];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kRouteRegs; ++k) {
    const int i = threadIdx.x + k * kRouteThreads;
    if (i < n4) {
      xr[k] = x4[i];
      gr[k] = g4[i];
    }
  }
#pragma unroll
  for (int k = 0; k < kRouteRegs; ++k)
    if (threadIdx.x + k * kRouteThreads < n4) {
      const float4 v = xr[k];
      ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
    }
  for (int i = threadIdx.x + kRouteRegs * kRouteThreads; i < n4; i += kRouteThreads) {  // rows past the registers
    const float4 v = x4[i];
    ss += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
  }
  ss = block_sum(ss, red);
  MOE_TRACE_MARK(1);
  const float scale = rsqrtf(ss / static_cast<float>(R.cols) + eps);
  float acc = 0.f;
  if (in_regs) {
#pragma unroll
    for (int k = 0; k < kRouteRegs; ++k)
      if (threadIdx.x + k * kRouteThreads < n4) {
        const float4 v = xr[k], g = gr[k], w = wr[k];
        acc = fmaf(w.x, v.x * scale * g.x, acc);
        acc = fmaf(w.y, v.y * scale * g.y, acc);
        acc = fmaf(w.z, v.z * scale * g.z, acc);
        acc = fmaf(w.w, v.w * scale * g.w, acc);
      }
  } else {
    MOE_DISPATCH_TYPE(R.type, route_dot_t, R.data + r * R.row_stride, R.cols >> 5, x, norm_w, scale, acc);
  }
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < R.cols; i += blockDim.x) h_out[i] = x[i] * scale * norm_w[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) logits[r] = acc;
  MOE_TRACE_MARK(2);
}

// ---- experts -----------------------------------------------------------------------------------------
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Tiles of two output rows of one chosen expert: gate rows r0, r0 + 1 and up rows r0, r0 + 1.
__global__ void __launch_bounds__(kThreads, 2) expert_gate_up_kernel(Mat G, Mat U, const float* __restrict__ h,
                                                                  const float* __restrict__ logits, int n_expert,
                                                                  int n_used, int32_t* ids_out, float* w_out,
                                                                  float* act) {
  extern __shared__ float4 smem4[];
  __shared__ float red[32];
  __shared__ __align__(16) float s_logit[kMaxExperts];
  __shared__ float s_w[64];
  __shared__ int32_t ids[64];
  float* xs = reinterpret_cast<float*>(smem4);
  float* sum16 = xs + G.cols;
  const int lane = threadIdx.x & 31;
  pdl_sync();  // the router logits come from the previous kernel
  choose_experts(logits, n_expert, n_used, s_logit, ids, s_w, blockIdx.x == 0);
  if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < n_used) {
    ids_out[threadIdx.x] = ids[threadIdx.x];
    w_out[threadIdx.x] = s_w[threadIdx.x];
  }
  stage_x(h, G.cols, nullptr, 0.f, xs, sum16, red);
  const int tiles_per_expert = (G.rows + 1) >> 1;
  const int n_tiles = tiles_per_expert * n_used;
  for (int tile = blockIdx.x * kWarps + (threadIdx.x >> 5); tile < n_tiles; tile += gridDim.x * kWarps) {
    const int j = tile / tiles_per_expert;
    const int r0 = 2 * (tile - j * tiles_per_expert);
    const int nvalid = min(2, G.rows - r0);
    const int e = ids[j];
    const uint8_t* gb = G.data + e * G.expert_stride + r0 * G.row_stride;
    const uint8_t* ub = U.data + e * U.expert_stride + r0 * U.row_stride;
    const int64_t gs = G.row_stride, us = U.row_stride;
    auto one = [](int) { return 1.f; };
    float g[2] = {}, u[2] = {};
    if (G.type == U.type) {
      float acc[4] = {};
      // rows 0, 1: gate; rows 2, 3: up (nvalid 1: rows 0 and 2 only, so use 4 and mask row 1/3 below)
      tile_dot_any<4>(
          G.type, [&](int, int rr) { return rr < 2 ? gb + min(rr, nvalid - 1) * gs : ub + min(rr - 2, nvalid - 1) * us; },
          one, 1, G.cols, 4, smem4, sum16, lane, acc);
      g[0] = acc[0]; g[1] = acc[1]; u[0] = acc[2]; u[1] = acc[3];
    } else {
      tile_dot_any<2>(G.type, [&](int, int rr) { return gb + rr * gs; }, one, 1, G.cols, nvalid, smem4, sum16, lane, g);
      tile_dot_any<2>(U.type, [&](int, int rr) { return ub + rr * us; }, one, 1, U.cols, nvalid, smem4, sum16, lane, u);
    }
    const float g0 = warp_sum(g[0]), g1 = warp_sum(g[1]), u0 = warp_sum(u[0]), u1 = warp_sum(u[1]);
    if (lane == 0) {
      act[j * G.rows + r0] = silu(g0) * u0;
      if (nvalid > 1) act[j * G.rows + r0 + 1] = silu(g1) * u1;
    }
  }
}

// Tiles of NR output rows; each row sums the n_used chosen experts' rows weighted by the router.
template <int NR>
__global__ void __launch_bounds__(kThreads, 2) expert_down_kernel(Mat D, const float* __restrict__ act,
                                                               const int32_t* __restrict__ ids,
                                                               const float* __restrict__ weights, int n_used,
                                                               float* x) {
  extern __shared__ float4 smem4[];
  __shared__ float red[32];
  __shared__ int32_t sid[64];
  __shared__ float sw[64];
  float* xs = reinterpret_cast<float*>(smem4);
  float* sum16 = xs + D.cols * n_used;
  const int lane = threadIdx.x & 31;
  const int n_tiles = (D.rows + NR - 1) / NR;
  // the routing comes from the previous kernel (the gate/up kernel's block 0): only after the wait
  pdl_sync();
  if (threadIdx.x < n_used) {
    sid[threadIdx.x] = ids[threadIdx.x];
    sw[threadIdx.x] = weights[threadIdx.x];
  }
  __syncthreads();
  const int first = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (first < n_tiles) {
    const int r0 = first * NR, nr = min(NR, D.rows - r0);
    for (int j = 0; j < n_used; ++j)
      prefetch_l2(D.data + sid[j] * D.expert_stride + r0 * D.row_stride, nr * D.row_stride, lane);
  }
  stage_x(act, D.cols * n_used, nullptr, 0.f, xs, sum16, red);
  for (int tile = first; tile < n_tiles; tile += gridDim.x * kWarps) {
    const int r0 = tile * NR;
    const int nvalid = min(NR, D.rows - r0);
    const uint8_t* base = D.data + r0 * D.row_stride;
    const int64_t es = D.expert_stride, rs = D.row_stride;
    float acc[NR] = {};
    tile_dot_any<NR>(
        D.type, [&](int s, int rr) { return base + sid[s] * es + rr * rs; }, [&](int s) { return sw[s]; }, n_used,
        D.cols, nvalid, smem4, sum16, lane, acc);
    const float v = warp_sums<NR>(acc, lane);
    if (lane < nvalid) x[r0 + lane] += v;
  }
}

int g_sm_count = 0;

// Blocks of a kernel that fit on one SM (cached per kernel and shared-memory size).
template <typename K>
int blocks_per_sm(K kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

int grid_for(int n_tiles, int per_sm) {
  const int want = (n_tiles + kWarps - 1) / kWarps;
  const int cap = sm_count() * per_sm;
  return want < cap ? want : cap;
}

size_t x_smem(int n) { return static_cast<size_t>(n + n / 16) * sizeof(float); }

}  // namespace

// On by default (MOE_CUDA_PDL=0 turns it off): BM_Decode/0 476-477 vs 450 tok/s without (same binary,
// same call). It was off until the SIMT expert down kernel stopped reading the routing before its wait
// (the choice had moved into the gate/up kernel, one step back, so PDL raced there). The "hang" of
// an expert benchmark that kept it off was the benchmark's host-side setup (no kernel was running).
bool pdl_enabled() {
  static const bool on = env_switch("MOE_CUDA_PDL", true);
  return on;
}

int carveout_pref() {
  static const int v = env_int("MOE_CUDA_CARVEOUT", -1, 0, 100);
  return v;
}

int sm_count() {
  if (g_sm_count == 0) {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
      g_sm_count = n;
    else
      return 1;
  }
  return g_sm_count;
}

cudaError_t init_kernels() {
  const int big = 200 * 1024;
  cudaError_t e;
  if ((e = cudaFuncSetAttribute(gemv_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(gemv_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(expert_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(expert_down_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  return tc_init();
}

GemvArgs gemv_args(const GemvOut* outs, int n_outs, const float* x, const float* norm_w, float eps, bool accumulate,
                   int rows_per_tile, const L2Hint* hint) {
  GemvArgs a{};
  if (hint && hint->pos && hint->row_bytes > 0 && hint->row_bytes % 16 == 0 && hint->max_rows > 0) a.hint = *hint;
  a.n_outs = n_outs;
  for (int i = 0; i < n_outs; ++i) {
    a.outs[i] = outs[i];
    a.tiles_before[i + 1] = a.tiles_before[i] + (outs[i].W.rows + rows_per_tile - 1) / rows_per_tile;
  }
  for (int i = n_outs + 1; i < 4; ++i) a.tiles_before[i] = a.tiles_before[n_outs];
  a.x = x;
  a.norm_w = norm_w;
  a.eps = eps;
  a.cols = outs[0].W.cols;
  a.accumulate = accumulate ? 1 : 0;
  a.evict = l2_evict_mask() & kEvictLmHead;
  return a;
}

// Kernel attributes (shared-memory limits) set once, for callers that did not call init_kernels.
cudaError_t ensure_init() {
  static const cudaError_t e = init_kernels();
  return e;
}

cudaError_t gemv(const GemvOut* outs, int n_outs, const float* x, const float* norm_w, float eps, bool accumulate,
                 cudaStream_t s, const L2Hint* hint, const RouterAcc* prep, bool weights_in_l2) {
  if (n_outs < 1 || n_outs > 3) return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_init()) return e;
  bool tc = tc_enabled();
  int rows_total = 0;
  for (int i = 0; i < n_outs; ++i) {
    tc = tc && tc_type(outs[i].W.type);
    rows_total += outs[i].W.rows;
  }
  if (prep && (!tc || !norm_w || !prep->acc || !prep->ref || prep->n < 0)) return cudaErrorInvalidValue;
  if (tc) {
    GemvArgs a = gemv_args(outs, n_outs, x, norm_w, eps, accumulate, 16, hint);
    if (prep) a.prep = *prep;
    a.skip_prefetch = weights_in_l2 ? 1 : 0;
    return tc_gemv(a, s);
  }
  // four rows per warp when that still gives every SM about eight warps, else two
  const bool four = rows_total / 4 >= 8 * sm_count();
  const GemvArgs a = gemv_args(outs, n_outs, x, norm_w, eps, accumulate, four ? 4 : 2, hint);
  const size_t smem = x_smem(a.cols);
  const int n_tiles = a.tiles_before[n_outs];
  if (four) {
    static const int per_sm = blocks_per_sm(gemv_kernel<4>, kThreads, x_smem(4096));
    return launch_pdl(gemv_kernel<4>, dim3(grid_for(n_tiles, per_sm)), dim3(kThreads), smem, s, a);
  }
  static const int per_sm = blocks_per_sm(gemv_kernel<2>, kThreads, x_smem(4096));
  return launch_pdl(gemv_kernel<2>, dim3(grid_for(n_tiles, per_sm)), dim3(kThreads), smem, s, a);
}

cudaError_t route_token(const float* x, const float* norm_w, float eps, const Mat& R, float* h_out, float* logits,
                        cudaStream_t s) {
  if (cudaError_t e = ensure_init()) return e;
  return launch_pdl(route_kernel, dim3(R.rows), dim3(kRouteThreads), 0, s, x, norm_w, eps, R, h_out, logits);
}

namespace {
bool o_router_ok(const Mat& O, const Mat& R) {
  return tc_enabled() && tc_type(O.type) && R.type == layout::F32 && R.cols == O.rows && R.rows >= 1 &&
         R.rows <= 256 && R.row_stride % 16 == 0;
}
// An early-ids hint (EarlyIds) is absent or complete, with a layer its tag can hold.
bool early_ids_ok(const EarlyIds* e) { return !e || !e->tag || (e->pos && e->layer >= 0 && e->layer < 1024); }
}  // namespace

bool router_in_o_proj_supported(const LayerWeights& L, int n_used) {
  return o_router_ok(L.o, L.router) && tc_type(L.q.type) && tc_type(L.k.type) && tc_type(L.v.type) &&
         tc_type(L.gate.type) && tc_type(L.up.type) && L.gate.rows == L.up.rows && L.gate.cols == L.up.cols &&
         L.gate.cols == L.o.rows && L.q.cols == L.o.rows && n_used >= 1 && n_used <= 64 && n_used <= L.router.rows;
}

cudaError_t o_proj_router(const Mat& O, const float* o, float* x, const Mat& R, const float* norm_w,
                          const RouterAcc& acc, cudaStream_t s, const AttSlices* att) {
  if (!o_router_ok(O, R) || acc.n != R.rows || !acc.acc || !acc.ref || !norm_w)
    return cudaErrorInvalidValue;
  // deferred slices: every float4 run of a warp in one head (head_dim a multiple of 128), and all of x in
  // the staging's registers (tc_gemv: up to 4,096 columns)
  if (att && att->defer > 0 &&
      (!att->partials || !att->pos || att->defer > kAttMaxDefer || att->head_dim % 128 != 0 || att->group < 1 ||
       att->n_head_kv < 1 || att->n_split < 1 || att->min_chunk < 1 ||
       O.cols != att->n_head_kv * att->group * att->head_dim || O.cols > 4096))
    return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_init()) return e;
  const GemvOut out{O, x};
  GemvArgs a = gemv_args(&out, 1, o, nullptr, 0.f, true, 16, nullptr);
  a.racc = acc;
  a.router = reinterpret_cast<const float*>(R.data);
  a.router_stride = R.row_stride / 4;
  a.router_norm = norm_w;
  a.y_early = env_switch("MOE_CUDA_X_EARLY", true) ? 1 : 0;
  if (att && att->defer > 0) a.att = *att;
  return tc_gemv(a, s);
}

cudaError_t expert_gate_up_acc(const Mat& G, const Mat& U, const float* x, const float* norm_w, float eps,
                               const RouterAcc& acc, int n_used, int32_t* ids, float* weights, float* act,
                               cudaStream_t s, const EarlyIds* early, const L2Ahead* ahead) {
  if (acc.n < 1 || acc.n > 256 || n_used < 1 || n_used > 64 || n_used > acc.n || !acc.acc || !acc.ref || !norm_w ||
      !tc_enabled() || !tc_type(G.type) || !tc_type(U.type) || G.cols != U.cols || G.rows != U.rows)
    return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_init()) return e;
  if (!early_ids_ok(early)) return cudaErrorInvalidValue;
  return tc_gate_up_acc(G, U, x, norm_w, eps, acc, n_used, ids, weights, act, s, early, ahead);
}

cudaError_t expert_gate_up(const Mat& G, const Mat& U, const float* h, const float* logits, int n_expert, int n_used,
                           int32_t* ids, float* weights, float* act, cudaStream_t s) {
  if (n_expert < 1 || n_expert > dev::kMaxExperts || n_used < 1 || n_used > 64 || n_used > n_expert)
    return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_init()) return e;
  if (tc_enabled() && tc_type(G.type) && tc_type(U.type) && G.cols == U.cols && G.rows == U.rows)
    return tc_gate_up(G, U, h, logits, n_expert, n_used, ids, weights, act, s);
  const int n_tiles = (G.rows + 1) / 2 * n_used;
  static const int per_sm = blocks_per_sm(expert_gate_up_kernel, kThreads, x_smem(4096));
  return launch_pdl(expert_gate_up_kernel, dim3(grid_for(n_tiles, per_sm)), dim3(kThreads), x_smem(G.cols), s, G, U,
                    h, logits, n_expert, n_used, ids, weights, act);
}

bool expert_down_sends_ahead(const Mat& D) { return tc_enabled() && tc_type(D.type); }

cudaError_t expert_down_add(const Mat& D, const float* act, const int32_t* ids, const float* weights, int n_used,
                            float* x, cudaStream_t s, const L2Ahead* ahead, const EarlyIds* early) {
  if (n_used > 64) return cudaErrorInvalidValue;
  if (!early_ids_ok(early)) return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_init()) return e;
  if (tc_enabled() && tc_type(D.type)) return tc_down(D, act, ids, weights, n_used, x, s, ahead, early);
  const int n_tiles = (D.rows + 1) / 2;
  static const int per_sm = blocks_per_sm(expert_down_kernel<2>, kThreads, x_smem(8 * 768));
  return launch_pdl(expert_down_kernel<2>, dim3(grid_for(n_tiles, per_sm)), dim3(kThreads),
                    x_smem(D.cols * n_used), s, D, act, ids, weights, n_used, x);
}

}  // namespace moe::cuda::k

MOE_TRACE_TU(gemv)
