// Decode kernels of the experts on the tensor cores (the arithmetic of gemv_tc.cu, the building blocks of
// tc.cuh): the choice of the experts from o_proj_router's sums, gate + up + SwiGLU over the chosen
// experts in one launch, and the down projection with the weighted sum into the residual. Included once,
// at the end of gemv_tc.cu: one module with the dense kernels (as a translation unit of its own, decode
// measured 0.3-0.6 % slower, docs/PERFORMANCE.md version 21).
#pragma once
#include <algorithm>

#include "gemv_tc.cuh"
#include "tc.cuh"
#include "trace.cuh"

namespace moe::cuda::k {
using namespace tc;

namespace {

// ---- the choice from o_proj_router's sums (the gate/up kernel) --------------------------------------
// sums_load issues the loads of the sums (thread c < n: sum c; thread 0 also the sum of squares and the
// unit), choose_from_sums ranks them once they are in:
struct SumsLoad {
  long long v = 0, ss = 0;
  float ref = 0.f;
};
__device__ __forceinline__ void sums_load(const long long* __restrict__ racc, const float* __restrict__ ref, int n,
                                          SumsLoad& l) {
  if (static_cast<int>(threadIdx.x) < n) l.v = __ldcg(racc + threadIdx.x);  // n <= blockDim.x (the host checks)
  if (threadIdx.x == 0) {
    l.ref = __ldcg(ref);
    l.ss = __ldcg(racc + n);
  }
}
// s_logit[c] = the sums as floats (their unit cancels in the ranking), the n_used best in rank order to
// s_id and their sums to s_w (rank_experts), *s_scale = rmsnorm's 1/rms of x from Σ x² (x of n_x
// elements) and *s_unit = 2^-32 ref, the sums' unit: the logits are s_w * s_unit * s_scale. Ends with
// a barrier.
__device__ __forceinline__ void choose_from_sums(const SumsLoad& l, int n, int n_used, int n_x, float eps,
                                                 float* s_logit, int32_t* s_id, float* s_w, float* s_scale,
                                                 float* s_unit) {
  if (threadIdx.x == 0) {
    const float rf = ref_or_one(l.ref);
    const float ss = __ll2float_rn(l.ss) * kFixedUnitInv * rf * rf;
    *s_scale = rsqrtf(ss / static_cast<float>(n_x) + eps);
    *s_unit = rf * kFixedUnitInv;
  }
  if (static_cast<int>(threadIdx.x) < n) s_logit[threadIdx.x] = __ll2float_rn(l.v);
  if (static_cast<int>(threadIdx.x) < n_used) s_id[threadIdx.x] = -1;  // rank_experts' free slots
  __syncthreads();
  MOE_TRACE_MARK(6);
  rank_experts(s_logit, n, n_used, s_id, s_w);
}

// ---- experts ------------------------------------------------------------------------------------------
// Block = 16 rows of one chosen expert; warps 0-3 the gate rows, 4-7 the up rows, two super-blocks each,
// one after the other (the rows were sent to L2 by the block's bulk prefetch; the second super-block's
// loads issued before the first was multiplied needed two register sets, and at three blocks per SM
// (80 registers) the kernel spilled: BM_Decode/0 512.3-512.8 vs 498.9-503.9 tok/s without). Three
// blocks per SM: 48 tiles x 8 experts of Qwen3-30B-A3B fit the H200's 132 SMs in one wave.
// The Mat parameters are __grid_constant__: a kernel that takes a reference to a by-value struct
// parameter (M = up ? U : G) otherwise gets a copy of it in local memory, written by every thread at
// its start (104 bytes of stack here; without it BM_Decode/0 389-390 vs 376-379 tok/s, same call).
// kAcc: the logits come as o_proj_router's fixed-point sums (launch.cuh) and h = rmsnorm(x) * norm_w is
// staged here, with rmsnorm's 1/rms from the sums' Σ x² (no block reduction); that scale multiplies the
// logits for the weights only (the ranking does not depend on it).
template <bool kAcc>
__global__ void __launch_bounds__(256, 3) tc_gate_up_kernel(const __grid_constant__ Mat G, const __grid_constant__ Mat U,
                                                         const float* __restrict__ h, const float* __restrict__ norm_w,
                                                         float eps, const float* __restrict__ logits,
                                                         const long long* __restrict__ racc,
                                                         const float* __restrict__ ref, int n_expert, int n_used,
                                                         int32_t* ids_out, float* w_out, float* act,
                                                         const __grid_constant__ EarlyIds early,
                                                         const __grid_constant__ L2Ahead ahead, int evict) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red[32];
  __shared__ float part[8][16];
  __shared__ __align__(16) float s_logit[kMaxExperts];
  __shared__ float s_w[64];
  __shared__ int32_t s_id[64];
  MOE_TRACE_SCOPE(2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int tiles = (G.rows + 15) / 16;
  const int j = blockIdx.x / tiles, r0 = (blockIdx.x - j * tiles) * 16;
  const XQ xq = carve_xq(smem, G.cols);
  if (threadIdx.x < 3) send_ahead_share(ahead, threadIdx.x);  // the next layer's Q/K/V (launch.cuh: L2Ahead)
  pdl_sync();  // the router logits and h come from the previous kernel
  // kAcc: the sums' loads go out before x's, so that the ranking does not wait behind x (BM_Decode/0
  // +0.5 %, trace: the choice 2.65 vs 2.88 us)
  SumsLoad sl;
  if (kAcc) sums_load(racc, ref, n_expert, sl);
  XLoad<2> xl;
  stage_load<2>(h, G.cols, kAcc ? norm_w : nullptr, xl);
  MOE_TRACE_MARK(1);
  __shared__ float s_scale, s_unit;  // kAcc: rmsnorm's 1/rms from the sum of squares, the sums' unit 2^-32 ref
  if constexpr (kAcc) {
    choose_from_sums(sl, n_expert, n_used, G.cols, eps, s_logit, s_id, s_w, &s_scale, &s_unit);
    if (blockIdx.x == 0) {
      if (static_cast<int>(threadIdx.x) < n_used) ids_out[threadIdx.x] = s_id[threadIdx.x];
      if (early.tag) {  // the down kernel's early hint (EarlyIds): the ids, then the tag
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence();
          st_release_gpu(early.tag, early_ids_tag(__ldcg(early.pos), early.layer));
        }
      }
    }
  } else {
    choose_experts(logits, n_expert, n_used, s_logit, s_id, s_w, blockIdx.x == 0);
    if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < n_used) {  // for the down kernel
      ids_out[threadIdx.x] = s_id[threadIdx.x];
      w_out[threadIdx.x] = s_w[threadIdx.x];
    }
  }
  MOE_TRACE_MARK(2);
  const int e = s_id[j];
  // the tile's gate rows (lane 0) and up rows (lane 1), each one bulk prefetch: 32 of one row each took
  // 1.4 us to issue (trace), two 0.4 us (BM_Decode/0 +1 %)
  if (warp == 0 && lane < 2) {
    const Mat& P = lane == 0 ? G : U;
    bulk_prefetch_l2(P.data + e * P.expert_stride + r0 * P.row_stride,
                     static_cast<uint32_t>(min(16, P.rows - r0) * P.row_stride), l2_evict_first(evict & kEvictGateUp));
  }
  MOE_TRACE_MARK(3);
  stage_finish<2>(h, G.cols, kAcc ? norm_w : nullptr, eps, xl, xq, red, kAcc ? s_scale : 0.f);
  if (kAcc && blockIdx.x == 0 && warp == 0) expert_weights_warp(s_w, n_used, s_unit * s_scale, w_out);
  MOE_TRACE_MARK(4);
  const bool up = warp >= 4;
  const Mat& M = up ? U : G;
  const uint8_t* base = M.data + e * M.expert_stride;
  const uint8_t* rg = base + min(r0 + g, M.rows - 1) * M.row_stride;
  const uint8_t* r8 = base + min(r0 + g + 8, M.rows - 1) * M.row_stride;
  auto rows = [&](int, int i) { return i ? r8 : rg; };
  auto one = [](int) { return 1.f; };
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  switch (M.type) {
    case layout::Q4_K: tile16<layout::Q4_K, false>(rows, one, 1, M.cols / 256, warp & 3, 4, xq, acc); break;
    case layout::Q5_K: tile16<layout::Q5_K, false>(rows, one, 1, M.cols / 256, warp & 3, 4, xq, acc); break;
    case layout::Q6_K: tile16<layout::Q6_K, false>(rows, one, 1, M.cols / 256, warp & 3, 4, xq, acc); break;
    default: break;
  }
  MOE_TRACE_MARK(5);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  if (threadIdx.x < 16 && r0 + static_cast<int>(threadIdx.x) < G.rows) {
    const int i = threadIdx.x;
    const float gv = (part[0][i] + part[1][i]) + (part[2][i] + part[3][i]);
    const float uv = (part[4][i] + part[5][i]) + (part[6][i] + part[7][i]);
    act[j * G.rows + r0 + i] = gv / (1.f + expf(-gv)) * uv;
  }
}

// Block = 16 output rows; kDownWarps warps split the (expert, super-block) pairs (24 for Qwen3-30B-A3B:
// one each, loaded at once; 12 warps with two each and the second's loads pipelined measured the same or
// slower: 496.1-496.7 vs 496.2-499.7 tok/s with the 16-warp O projection); x[r] += Σ_j w_j D_e(j).row(r)·act_j.
// One block per SM (the grid is 2,048 / 16 = 128), 77 registers.
// kSm: the tile's rows of each chosen expert (16 consecutive rows, one piece per expert) come into shared
// memory by bulk copies (bulk_copy_g2s) as soon as the block knows the ids, before its wait when the
// early hint names them, and the MMAs read them there; otherwise (rows too large for shared memory, or
// MOE_CUDA_DOWN_SMEM=0) the rows go to L2 (bulk_prefetch_l2) and the MMAs load them from global memory.
constexpr int kDownWarps = 24;
template <uint32_t T, bool kSm>
__device__ __forceinline__ void tc_down_body(const Mat& D, const float* act, const int32_t* ids, const float* weights,
                                             int n_used, float* x, const XQ& xq, uint8_t* srows, uint64_t* bar,
                                             float* red, float (*part)[16], int32_t* sid, float* sw,
                                             const EarlyIds& early, bool x_early, int evict) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, tid = threadIdx.x;
  const int r0 = blockIdx.x * 16, nr = min(16, D.rows - r0);
  const int n = D.cols * n_used;
  const int64_t es = D.expert_stride;
  const int64_t og = min(r0 + g, D.rows - 1) * D.row_stride, o8 = min(r0 + g + 8, D.rows - 1) * D.row_stride;
  const int n_sb = D.cols / 256;
  const uint32_t tile_bytes = static_cast<uint32_t>(nr * D.row_stride);
  const int64_t slot_bytes = 16 * D.row_stride;
  // this block's rows of expert id: to L2, or (kSm) into shared-memory slot s (an arrival on the barrier
  // announcing the bytes, then the copy)
  const uint64_t pol = l2_evict_first(evict & kEvictDown);
  auto prefetch_rows = [&](int id) { bulk_prefetch_l2(D.data + id * es + r0 * D.row_stride, tile_bytes, pol); };
  auto fetch_rows = [&](int s, int id) {
    mbar_arrive_tx(bar, tile_bytes);
    bulk_copy_g2s(srows + s * slot_bytes, D.data + id * es + r0 * D.row_stride, tile_bytes, bar, pol);
  };
  __shared__ int s_refetch;
  if constexpr (kSm) {
    if (tid == 0) {
      mbar_init(bar, n_used);  // a phase: one arrival per chosen expert
      s_refetch = 0;
    }
    __syncthreads();
  }
  // the gate/up kernel's ids, if its block 0 wrote them for this token and layer (EarlyIds): their rows
  // now, before the wait. The tag, the position and the id in one round trip (a block that starts only
  // as the gate/up grid ends must not wait for three); an id read before its tag can only be older, and
  // a wrong hint costs a copy.
  int early_id = -1;
  if (early.tag && tid < n_used) {
    const int tag = __ldcg(early.tag), p = __ldcg(early.pos), id = __ldcg((early.hint ? early.hint : ids) + tid);
    if (tag == early_ids_tag(p, early.layer) && id >= 0) {
      early_id = id;
      if constexpr (kSm) fetch_rows(tid, id); else prefetch_rows(id);
    }
  }
  // x_early: the block's rows of x, read before the wait (the O projection two kernels back wrote them and
  // is complete) rather than after the MMAs
  float x_pre = 0.f;
  if (x_early && tid < 16 && r0 + tid < D.rows) x_pre = __ldcg(x + r0 + tid);
  pdl_sync();
#ifdef MOE_TRACE
  if (kSm && tid == 0 && mbar_test(bar, 0)) MOE_TRACE_MARK(6);  // mark 6: every early copy in by the wait
#endif
  XLoad<2> xl;
  stage_load<2>(act, n, nullptr, xl);
  MOE_TRACE_MARK(1);
  // the routing comes from the gate/up kernel (its block 0): the rows of each chosen expert not fetched
  // yet go out now. (Each block making the choice itself from o_proj_router's sums before the wait
  // measured slower: 461-464 vs 476-477 tok/s.) kSm: a slot whose early copy holds another expert's rows
  // (a stale hint) is fetched again once the first copies are in (below).
  if (tid < n_used) {
    const int id = ids[tid];
    sid[tid] = id;
    sw[tid] = weights[tid];
    if (id != early_id) {
      if constexpr (!kSm) prefetch_rows(id);
      else if (early_id < 0) fetch_rows(tid, id);
      else s_refetch = 1;
    }
  }
  MOE_TRACE_MARK(2);
  stage_finish<2>(act, n, nullptr, 0.f, xl, xq, red);  // ends with a barrier: sid/sw (and s_refetch) visible
  MOE_TRACE_MARK(3);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (kSm) {
    uint32_t parity = 0;
    if (s_refetch) {  // block-uniform; rare (a stale hint): every slot's first copy in, then a second phase
      if (tid < n_used) {
        mbar_wait(bar, 0);
        if (sid[tid] != early_id) fetch_rows(tid, sid[tid]); else mbar_arrive(bar);
      }
      parity = 1;
    }
    mbar_wait(bar, parity);
    MOE_TRACE_MARK(5);
    const int64_t sg = min(g, nr - 1) * D.row_stride, s8 = min(g + 8, nr - 1) * D.row_stride;
    tile16<T, false, true>([&](int s, int i) { return srows + s * slot_bytes + (i ? s8 : sg); },
                           [&](int s) { return sw[s]; }, n_used, n_sb, warp, kDownWarps, xq, acc);
  } else {
    tile16<T, false>([&](int s, int i) { return D.data + sid[s] * es + (i ? o8 : og); }, [&](int s) { return sw[s]; },
                     n_used, n_sb, warp, kDownWarps, xq, acc);
  }
  MOE_TRACE_MARK(4);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  if (tid < 16 && r0 + tid < D.rows) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kDownWarps; ++w) v += part[w][tid];
    x[r0 + tid] = (x_early ? x_pre : x[r0 + tid]) + v;
  }
}

// ahead: before its wait, block b sends its share of the next layer's Q/K/V rows to L2 (launch.cuh).
template <bool kSm>
__global__ void __launch_bounds__(kDownWarps * 32, 1) tc_down_kernel(const __grid_constant__ Mat D,
                                                                     const float* __restrict__ act,
                                                                     const int32_t* __restrict__ ids,
                                                                     const float* __restrict__ weights, int n_used,
                                                                     float* x, const __grid_constant__ L2Ahead ahead,
                                                                     const __grid_constant__ EarlyIds early,
                                                                     bool x_early, int evict) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[32];
  __shared__ float part[kDownWarps][16];
  __shared__ int32_t sid[64];
  __shared__ float sw[64];
  __shared__ uint64_t bar;
  MOE_TRACE_SCOPE(3);
  if (threadIdx.x < 3) send_ahead_share(ahead, threadIdx.x);
  const XQ xq = carve_xq(smem, D.cols * n_used);
  uint8_t* srows = smem + rows_smem_offset(D.cols * n_used);
  switch (D.type) {
    case layout::Q4_K:
      tc_down_body<layout::Q4_K, kSm>(D, act, ids, weights, n_used, x, xq, srows, &bar, red, part, sid, sw, early,
                                       x_early, evict);
      break;
    case layout::Q5_K:
      tc_down_body<layout::Q5_K, kSm>(D, act, ids, weights, n_used, x, xq, srows, &bar, red, part, sid, sw, early,
                                       x_early, evict);
      break;
    case layout::Q6_K:
      tc_down_body<layout::Q6_K, kSm>(D, act, ids, weights, n_used, x, xq, srows, &bar, red, part, sid, sw, early,
                                       x_early, evict);
      break;
    default: break;
  }
}

}  // namespace

cudaError_t tc_experts_init() {
  const int big = static_cast<int>(kTcMaxSmem);
  cudaError_t e;
  if ((e = cudaFuncSetAttribute(tc_gate_up_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gate_up_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_down_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_down_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  return cudaSuccess;
}

cudaError_t tc_gate_up(const Mat& G, const Mat& U, const float* h, const float* logits, int n_expert, int n_used,
                       int32_t* ids, float* weights, float* act, cudaStream_t s) {
  static const cudaError_t init = tc_experts_init();
  if (init != cudaSuccess) return init;
  const int tiles = (G.rows + 15) / 16;
  return launch_pdl(tc_gate_up_kernel<false>, dim3(tiles * n_used), dim3(256), xq_smem(G.cols), s, G, U, h,
                    static_cast<const float*>(nullptr), 0.f, logits, static_cast<const long long*>(nullptr),
                    static_cast<const float*>(nullptr), n_expert, n_used, ids, weights, act, EarlyIds{}, L2Ahead{}, 0);
}

namespace {
// An L2Ahead for a kernel: regions whose size is not a positive multiple of 16 dropped (bulk prefetches take
// multiples of 16).
L2Ahead checked_ahead(const L2Ahead* ahead) {
  L2Ahead ah = ahead ? *ahead : L2Ahead{};
  for (int i = 0; i < 3; ++i)
    if (ah.bytes[i] <= 0 || ah.bytes[i] % 16 != 0) ah.base[i] = nullptr;
  return ah;
}
}  // namespace

cudaError_t tc_gate_up_acc(const Mat& G, const Mat& U, const float* x, const float* norm_w, float eps,
                           const RouterAcc& acc, int n_used, int32_t* ids, float* weights, float* act, cudaStream_t s,
                           const EarlyIds* early, const L2Ahead* ahead) {
  static const cudaError_t init = tc_experts_init();
  if (init != cudaSuccess) return init;
  const int tiles = (G.rows + 15) / 16;
  return launch_pdl(tc_gate_up_kernel<true>, dim3(tiles * n_used), dim3(256), xq_smem(G.cols), s, G, U, x, norm_w, eps,
                    static_cast<const float*>(nullptr), static_cast<const long long*>(acc.acc),
                    static_cast<const float*>(acc.ref), acc.n, n_used, ids, weights, act,
                    early ? *early : EarlyIds{}, checked_ahead(ahead), l2_evict_mask());
}

cudaError_t tc_down(const Mat& D, const float* act, const int32_t* ids, const float* weights, int n_used, float* x,
                    cudaStream_t s, const L2Ahead* ahead, const EarlyIds* early) {
  static const cudaError_t init = tc_experts_init();
  if (init != cudaSuccess) return init;
  const L2Ahead ah = checked_ahead(ahead);
  // the rows through shared memory when they fit (MOE_CUDA_DOWN_SMEM=0: through L2, read at capture)
  const int n = D.cols * n_used;
  const size_t rows = static_cast<size_t>(n_used) * 16 * static_cast<size_t>(D.row_stride);
  const size_t with_rows = rows_smem_offset(n) + rows;
  const bool sm = env_switch("MOE_CUDA_DOWN_SMEM", true) && with_rows <= kTcMaxSmem;
  return launch_pdl(sm ? tc_down_kernel<true> : tc_down_kernel<false>, dim3((D.rows + 15) / 16),
                    dim3(kDownWarps * 32), sm ? with_rows : xq_smem(n), s, D, act, ids, weights, n_used, x, ah,
                    early ? *early : EarlyIds{}, env_switch("MOE_CUDA_X_EARLY", true),
                    l2_evict_mask());
}

}  // namespace moe::cuda::k
