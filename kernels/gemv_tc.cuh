// Host entry points of the tensor-core decode GEMVs (gemv_tc.cu: the dense ones; experts_tc.cuh: the experts'),
// used by gemv.cu for the K-quant types. Plain C++.
#pragma once
#include "launch.cuh"

namespace moe::cuda::k {

// Q4_K, Q5_K and Q6_K have tensor-core GEMVs (rows of a multiple of 256 elements by construction).
bool tc_type(uint32_t type);
// MOE_CUDA_TC=0 sends every type through the SIMT kernels (read at each call: tests compare both).
bool tc_enabled();

// The arguments of a decode GEMV (gemv's): up to three matrices sharing x, cut into tiles of
// rows_per_tile rows (16 for the tensor-core kernel, 2 or 4 for the SIMT one).
struct GemvArgs {
  GemvOut outs[3];
  int tiles_before[4];  // prefix sums of the tiles of each matrix
  int n_outs;
  const float* x;
  const float* norm_w;
  float eps;
  int cols;
  int accumulate;
  L2Hint hint;
  RouterAcc prep;                 // Q/K/V: block 0 writes ref and zeroes acc (launch.cuh)
  RouterAcc racc;                 // O: the router's partial sums go to racc.acc (o_proj_router)
  const float* router = nullptr;  // F32, racc.n rows of the output's length, router_stride floats apart
  int64_t router_stride = 0;
  const float* router_norm = nullptr;
  int skip_prefetch = 0;          // the weights were sent to L2 by an earlier kernel (gemv's weights_in_l2)
  AttSlices att;                  // O: the attention's slices to merge while staging x (launch.cuh)
  int lm_pipe = 0;                // the warp-tile kernel (LM head): super-blocks through shared memory (tc_gemv);
                                  // 2: with the last round's tiles split over pairs of warps (LmOrder)
  int y_early = 0;                // y's rows of a block's first tile read before the wait (o_proj_router: x is
                                  // not written by the kernel just before it)
  int evict = 0;                  // l2_evict_mask()'s kEvictLmHead: the warp-tile kernel's rows evict_first in L2
};
GemvArgs gemv_args(const GemvOut* outs, int n_outs, const float* x, const float* norm_w, float eps, bool accumulate,
                   int rows_per_tile, const L2Hint* hint);

cudaError_t tc_init();          // the dense kernels' attributes, then tc_experts_init
cudaError_t tc_experts_init();  // the expert kernels' (experts_tc.cuh)
cudaError_t tc_gemv(const GemvArgs& a, cudaStream_t s);
cudaError_t tc_gate_up(const Mat& G, const Mat& U, const float* h, const float* logits, int n_expert, int n_used,
                       int32_t* ids, float* weights, float* act, cudaStream_t s);
cudaError_t tc_gate_up_acc(const Mat& G, const Mat& U, const float* x, const float* norm_w, float eps,
                           const RouterAcc& acc, int n_used, int32_t* ids, float* weights, float* act, cudaStream_t s,
                           const EarlyIds* early, const L2Ahead* ahead = nullptr);
cudaError_t tc_down(const Mat& D, const float* act, const int32_t* ids, const float* weights, int n_used, float* x,
                    cudaStream_t s, const L2Ahead* ahead, const EarlyIds* early);

}  // namespace moe::cuda::k
