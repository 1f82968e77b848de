// Decode matrix-vector products of the K-quant types (Q4_K, Q5_K, Q6_K) on the tensor cores.
//
// Why: dequantizing 4- to 6-bit weights to fp32 and multiplying on the FMA pipe costs ~4 instructions
// per weight, which made the SIMT GEMVs compute- and instruction-fetch-bound far below the memory
// bandwidth. Here the quants go into bf16 registers unscaled (small integers, exact), one
// mma.m16n8k16 multiplies 16 rows x 16 elements, and the block scales are applied to the fp32 results.
//
// Accuracy: x is split into three bf16 parts (x = x0 + x1 + x2 up to ~2^-24 |x|) which fill the MMA's
// B columns 0, 1, 2 (columns 3-7 are zero), so W·x is formed from exact products with fp32
// accumulation: the same result as the fp32 SIMT path up to the order of the sums.
//
// Layout of the work: a block owns 16 consecutive output rows (the MMA's M); its warps split the
// super-blocks of the (possibly segmented) input. Lane (g = lane / 4, t = lane % 4) loads rows g and
// g + 8; for each 32-element group s and half h of it, the MMA's k positions (2t, 2t+1, 2t+8, 2t+9)
// hold elements 16h + 4t + (0, 2, 1, 3) of the group, i.e. bytes 0, 2, 1, 3 of the lane's 32-bit word
// of packed quants. The B fragments of x in that order are built once per block in shared memory.
#include <cstdlib>

#include "gemv_tc.cuh"
#include "tc.cuh"

namespace moe::cuda::k {
using namespace tc;

namespace {

// ---- dense: up to three matrices sharing x ------------------------------------------------------------
constexpr int kDenseWarps = 4;

template <uint32_t T>
__device__ __forceinline__ void tc_gemv_body(const GemvArgs& a, const Mat& W, float* y, int r0, uint2* xb,
                                             float* red, float (*part)[16]) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  float* xsum32 = reinterpret_cast<float*>(xb + (a.cols / 32) * 32);
  const uint8_t* rg = W.data + min(r0 + g, W.rows - 1) * W.row_stride;
  const uint8_t* r8 = W.data + min(r0 + g + 8, W.rows - 1) * W.row_stride;
  auto rows = [&](int, int i) { return i ? r8 : rg; };
  const int n_sb = a.cols / 256;
  // the weights do not depend on the previous kernel: this warp's first super-block is loaded before
  // waiting for it (with programmatic dependent launch that overlaps the previous kernel's tail)
  SbRaw pre;
  if (warp < n_sb) tile16_preload<T>(rows, n_sb, warp, pre);
  pdl_sync();
  stage_xb<4>(a.x, a.cols, a.norm_w, a.eps, xb, xsum32, red);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile16<T>(rows, [](int) { return 1.f; }, 1, n_sb, warp, kDenseWarps, xb, xsum32, acc, pre, warp < n_sb);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  if (threadIdx.x < 16 && r0 + static_cast<int>(threadIdx.x) < W.rows) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kDenseWarps; ++w) v += part[w][threadIdx.x];
    float* yr = y + r0 + threadIdx.x;
    *yr = a.accumulate ? *yr + v : v;
  }
}

__global__ void __launch_bounds__(kDenseWarps * 32, 4) tc_gemv_kernel(GemvArgs a) {
  extern __shared__ uint2 xb[];
  __shared__ float red[32];
  __shared__ float part[kDenseWarps][16];
  int m = 0;
  while (static_cast<int>(blockIdx.x) >= a.tiles_before[m + 1]) ++m;
  const Mat& W = a.outs[m].W;
  const int r0 = (blockIdx.x - a.tiles_before[m]) * 16;
  switch (W.type) {
    case layout::Q4_K: tc_gemv_body<layout::Q4_K>(a, W, a.outs[m].y, r0, xb, red, part); break;
    case layout::Q5_K: tc_gemv_body<layout::Q5_K>(a, W, a.outs[m].y, r0, xb, red, part); break;
    case layout::Q6_K: tc_gemv_body<layout::Q6_K>(a, W, a.outs[m].y, r0, xb, red, part); break;
    default: break;
  }
}

// ---- experts ------------------------------------------------------------------------------------------
// Block = 16 rows of one chosen expert; warps 0-3 the gate rows, 4-7 the up rows.
__global__ void __launch_bounds__(256, 2) tc_gate_up_kernel(Mat G, Mat U, const float* __restrict__ h,
                                                         const int32_t* __restrict__ ids, float* act) {
  extern __shared__ uint2 xb[];
  __shared__ float red[32];
  __shared__ float part[8][16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int tiles = (G.rows + 15) / 16;
  const int j = blockIdx.x / tiles, r0 = (blockIdx.x - j * tiles) * 16;
  float* xsum32 = reinterpret_cast<float*>(xb + (G.cols / 32) * 32);
  pdl_sync();  // the expert ids come from the previous kernel
  const int e = ids[j];
  stage_xb<2>(h, G.cols, nullptr, 0.f, xb, xsum32, red);
  const bool up = warp >= 4;
  const Mat& M = up ? U : G;
  const uint8_t* base = M.data + e * M.expert_stride;
  const uint8_t* rg = base + min(r0 + g, M.rows - 1) * M.row_stride;
  const uint8_t* r8 = base + min(r0 + g + 8, M.rows - 1) * M.row_stride;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile16_any(
      M.type, [&](int, int i) { return i ? r8 : rg; }, [](int) { return 1.f; }, 1, M.cols / 256, warp & 3, 4, xb,
      xsum32, acc);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  if (threadIdx.x < 16 && r0 + static_cast<int>(threadIdx.x) < G.rows) {
    const int i = threadIdx.x;
    const float gv = (part[0][i] + part[1][i]) + (part[2][i] + part[3][i]);
    const float uv = (part[4][i] + part[5][i]) + (part[6][i] + part[7][i]);
    act[j * G.rows + r0 + i] = gv / (1.f + expf(-gv)) * uv;
  }
}

// Block = 16 output rows; 8 warps split the (expert, super-block) pairs; x[r] += Σ_j w_j D_e(j).row(r)·act_j.
template <uint32_t T>
__device__ __forceinline__ void tc_down_body(const Mat& D, const float* act, const int32_t* ids, const float* weights,
                                             int n_used, float* x, uint2* xb, float* red, float (*part)[16],
                                             int32_t* sid, float* sw) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int r0 = blockIdx.x * 16;
  const int n = D.cols * n_used;
  float* xsum32 = reinterpret_cast<float*>(xb + (n / 32) * 32);
  const int64_t es = D.expert_stride;
  const int64_t og = min(r0 + g, D.rows - 1) * D.row_stride, o8 = min(r0 + g + 8, D.rows - 1) * D.row_stride;
  const int n_sb = D.cols / 256;
  // the routing (two kernels back) is complete: read it, and load this warp's first super-block, before
  // waiting for the gate/up kernel
  if (static_cast<int>(threadIdx.x) < n_used) {
    sid[threadIdx.x] = ids[threadIdx.x];
    sw[threadIdx.x] = weights[threadIdx.x];
  }
  SbRaw pre;
  const bool have = warp < n_sb * n_used;
  if (have)
    tile16_preload<T>([&](int s, int i) { return D.data + __ldg(ids + s) * es + (i ? o8 : og); }, n_sb, warp, pre);
  pdl_sync();
  stage_xb<6>(act, n, nullptr, 0.f, xb, xsum32, red);  // ends with a barrier: sid/sw visible
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile16<T>([&](int s, int i) { return D.data + sid[s] * es + (i ? o8 : og); }, [&](int s) { return sw[s]; }, n_used,
            n_sb, warp, 8, xb, xsum32, acc, pre, have);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  if (threadIdx.x < 16 && r0 + static_cast<int>(threadIdx.x) < D.rows) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) v += part[w][threadIdx.x];
    x[r0 + threadIdx.x] += v;
  }
}

__global__ void __launch_bounds__(256, 2) tc_down_kernel(Mat D, const float* __restrict__ act,
                                                      const int32_t* __restrict__ ids,
                                                      const float* __restrict__ weights, int n_used, float* x) {
  extern __shared__ uint2 xb[];
  __shared__ float red[32];
  __shared__ float part[8][16];
  __shared__ int32_t sid[64];
  __shared__ float sw[64];
  switch (D.type) {
    case layout::Q4_K: tc_down_body<layout::Q4_K>(D, act, ids, weights, n_used, x, xb, red, part, sid, sw); break;
    case layout::Q5_K: tc_down_body<layout::Q5_K>(D, act, ids, weights, n_used, x, xb, red, part, sid, sw); break;
    case layout::Q6_K: tc_down_body<layout::Q6_K>(D, act, ids, weights, n_used, x, xb, red, part, sid, sw); break;
    default: break;
  }
}

}  // namespace

bool tc_type(uint32_t t) { return t == layout::Q4_K || t == layout::Q5_K || t == layout::Q6_K; }

bool tc_enabled() {
  const char* v = std::getenv("MOE_CUDA_TC");
  return !(v && v[0] == '0');
}

cudaError_t tc_init() {
  const int big = 200 * 1024;
  cudaError_t e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  return cudaSuccess;
}

cudaError_t tc_gemv(const GemvArgs& a, cudaStream_t s) {
  static const cudaError_t init = tc_init();
  if (init != cudaSuccess) return init;
  return launch_pdl(tc_gemv_kernel, dim3(a.tiles_before[a.n_outs]), dim3(kDenseWarps * 32), xb_smem(a.cols), s, a);
}

cudaError_t tc_gate_up(const Mat& G, const Mat& U, const float* h, const int32_t* ids, int n_used, float* act,
                       cudaStream_t s) {
  static const cudaError_t init = tc_init();
  if (init != cudaSuccess) return init;
  const int tiles = (G.rows + 15) / 16;
  return launch_pdl(tc_gate_up_kernel, dim3(tiles * n_used), dim3(256), xb_smem(G.cols), s, G, U, h, ids, act);
}

cudaError_t tc_down(const Mat& D, const float* act, const int32_t* ids, const float* weights, int n_used, float* x,
                    cudaStream_t s) {
  static const cudaError_t init = tc_init();
  if (init != cudaSuccess) return init;
  return launch_pdl(tc_down_kernel, dim3((D.rows + 15) / 16), dim3(256), xb_smem(D.cols * n_used), s, D, act, ids,
                    weights, n_used, x);
}

}  // namespace moe::cuda::k
