// What the prefill GEMMs share (gemm.cu): the kernels' argument block, and the host entry points of
// the two paths, gemm_float.cu (3xTF32/2xTF32, every type) and gemm_kq.cu (integer MMA, the K-quants).
// Plain C++.
#pragma once
#include "launch.cuh"
#include "layout.cuh"

namespace moe::cuda::k {

// The arguments of every prefill GEMM kernel: Y[slot][r] (+)= W.row(r) . X[x_rows[slot]], dense
// (slots 0 .. n_tok) or grouped by expert (expert e's slots offset[e] + [0, count[e])). Gate/up:
// W = gate, W2 = up, Y = silu(gate) * up.
struct GemmArgs {
  Mat W, W2;
  int be, bb, be2, bb2;   // elements and bytes per quant block of W and W2 (for the L1 prefetch)
  const float* X;
  int x_stride;
  const int32_t* x_rows;  // slot -> X row (nullptr: the slot itself)
  float* Y;
  int y_stride;
  int accumulate;
  int n_tok;              // dense: token count
  const int* count;       // grouped: tokens per expert (nullptr: dense)
  int n_expert;           // grouped
  const int* offset;
  const uint4* XH;        // X split for the fp16 path (split_h16; nullptr: the integer path)
  int* ticket;            // grouped K-quant path: a zeroed counter for the dynamic item walk (nullptr: static)
};

// The types of the integer path.
constexpr bool is_i8_type(uint32_t t) { return t == layout::Q4_K || t == layout::Q5_K || t == layout::Q6_K; }
constexpr int kMaxItemExperts = 512;  // the item table's capacity (larger expert counts: fp32 path; ISmem::MAX)

// Which product: dense (k::gemm), grouped gate/up (W, W2) or grouped down.
enum class GemmOp { dense, gate_up, down };

// The two paths. n: the token count (dense) or the largest expert's (grouped; bounds the tile grid).
// gemm_i8 takes only is_i8_type weights (gate/up: both of one type) and at most kMaxItemExperts experts.
cudaError_t gemm_float(GemmOp op, const GemmArgs& a, int n, cudaStream_t s);
cudaError_t gemm_i8(GemmOp op, const GemmArgs& a, int n, cudaStream_t s);

}  // namespace moe::cuda::k
