// Prefill matrix products on the tensor cores: Y[token][row] (+)= W.row(row) . X[token], dense or
// grouped by expert (every expert over the tokens routed to it; the gate/up form stacks the gate and
// up rows of a tile, one warp holding both, and writes silu(gate) * up). Two kernels:
//
// 1. K-quant path (Q4_K, Q5_K, Q6_K; igemm_kernel in gemm_kq.cu): with the input split by split_h16
//    (the caller's xh / hh / acth), fp16 MMAs on the centred codes (times their sub-block scales for
//    Q4_K/Q5_K) against the activations in fp16 hi + lo; otherwise the codes as 8-bit A operands of
//    the integer MMA against activations quantized per token and 32-column slice to 24 bits (three
//    int8 digits, three MMAs per product; fp32 epilogue per slice). Where it applies: gate and up of
//    one type, at most kMaxItemExperts experts, MOE_CUDA_GEMM_I8 not 0.
// 2. fp32 path (every other type; gemm_kernel in gemm_float.cu): 3xTF32 on dequantized values, 2xTF32
//    on the codes of Q4_0, Q5_0, Q8_0.
//
// This file holds the host entry points of launch.cuh: they fill the kernels' GemmArgs (gemm.cuh)
// and pick the path.
#include <cstdlib>

#include "gemm.cuh"

namespace moe::cuda::k {

namespace {

// MOE_CUDA_GEMM_I8=0 sends the K-quants (is_i8_type) to the fp32 path too (comparisons, bisecting).
bool i8_enabled() {
  return env_switch("MOE_CUDA_GEMM_I8", true);
}

// Elements and bytes per quant block, for the fp32 path's L1 prefetch (prefetch_group).
void set_geometry(const Mat& M, int& be, int& bb) {
  be = static_cast<int>(layout::block_elems(M.type));
  bb = static_cast<int>(layout::dev_block_bytes(M.type));
  if (be == 0) be = 1;  // unsupported types are rejected on the host; keep the arithmetic defined
}

}  // namespace

cudaError_t gemm(const Mat& W, const float* X, int x_stride, int n_tok, float* Y, int y_stride, bool accumulate,
                 cudaStream_t s, const void* xh) {
  GemmArgs a{};
  a.W = W;
  set_geometry(W, a.be, a.bb);
  a.X = X;
  a.x_stride = x_stride;
  a.Y = Y;
  a.y_stride = y_stride;
  a.accumulate = accumulate;
  a.n_tok = n_tok;
  a.XH = static_cast<const uint4*>(xh);
  if (is_i8_type(W.type) && i8_enabled()) return gemm_i8(GemmOp::dense, a, n_tok, s);
  return gemm_float(GemmOp::dense, a, n_tok, s);
}

cudaError_t expert_gate_up_grouped(const Mat& G, const Mat& U, const float* h, int h_stride, const int* count,
                                   const int* offset, const int32_t* token_of_slot, int n_expert, int max_count,
                                   float* act, cudaStream_t s, const void* hh, int* ticket) {
  GemmArgs a{};
  a.W = G;
  a.W2 = U;
  set_geometry(G, a.be, a.bb);
  set_geometry(U, a.be2, a.bb2);
  a.X = h;
  a.x_stride = h_stride;
  a.x_rows = token_of_slot;
  a.Y = act;
  a.y_stride = G.rows;
  a.count = count;
  a.offset = offset;
  a.n_expert = n_expert;
  a.XH = static_cast<const uint4*>(hh);
  a.ticket = ticket;
  if (G.type == U.type && is_i8_type(G.type) && n_expert <= kMaxItemExperts && i8_enabled())
    return gemm_i8(GemmOp::gate_up, a, max_count, s);
  return gemm_float(GemmOp::gate_up, a, max_count, s);
}

cudaError_t expert_down_grouped(const Mat& D, const float* act, const int* count, const int* offset, int n_expert,
                                int max_count, float* out, cudaStream_t s, const void* acth, int* ticket) {
  GemmArgs a{};
  a.W = D;
  set_geometry(D, a.be, a.bb);
  a.X = act;
  a.x_stride = D.cols;
  a.Y = out;
  a.y_stride = D.rows;
  a.count = count;
  a.offset = offset;
  a.n_expert = n_expert;
  a.XH = static_cast<const uint4*>(acth);
  a.ticket = ticket;
  if (is_i8_type(D.type) && n_expert <= kMaxItemExperts && i8_enabled()) return gemm_i8(GemmOp::down, a, max_count, s);
  return gemm_float(GemmOp::down, a, max_count, s);
}

}  // namespace moe::cuda::k
