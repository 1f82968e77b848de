// Prefill matrix products: 64x64 output tiles, weights dequantized into shared memory 32 columns at a
// time, fp32 FMA (the same arithmetic as the CPU's exact mode, so the F2 guard compares like with
// like). The grouped form runs every expert over the tokens routed to it; the gate/up form keeps
// both products of a tile and writes silu(gate) * up.
#include "common.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

constexpr int BM = 64, BN = 64, BK = 32, NT = 256, LD = BM + 4;

struct GemmArgs {
  Mat W, W2;
  const float* X;
  int x_stride;
  const int32_t* x_rows;  // slot -> X row (nullptr: the slot itself)
  float* Y;
  int y_stride;
  int accumulate;
  int n_tok;              // dense: token count
  const int* count;       // grouped: tokens per expert (nullptr: dense)
  const int* offset;
};

template <uint32_t T>
__device__ __forceinline__ void deq_col(const uint8_t* row, int g, float* col) {
  float v[32];
  dequant32<T>(row, g, v);
#pragma unroll
  for (int i = 0; i < 32; ++i) col[i * LD] = v[i];
}

template <bool GATEUP>
__global__ void __launch_bounds__(NT) gemm_kernel(GemmArgs a) {
  __shared__ __align__(16) float Ws[GATEUP ? 2 : 1][BK][LD];
  __shared__ __align__(16) float Xs[BK][BN + 4];
  const int e = blockIdx.z;
  int cnt = a.n_tok, off = 0;
  const uint8_t* w1 = a.W.data;
  const uint8_t* w2 = a.W2.data;
  if (a.count) {
    cnt = a.count[e];
    off = a.offset[e];
    w1 += e * a.W.expert_stride;
    if (GATEUP) w2 += e * a.W2.expert_stride;
  }
  const int tok0 = blockIdx.y * BN;
  if (tok0 >= cnt) return;
  const int row0 = blockIdx.x * BM;
  const int rows = a.W.rows, cols = a.W.cols;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;

  // this thread's X row for the tile loads
  const int xi = tid >> 2, xq = tid & 3;
  const float* xrow = nullptr;
  if (tok0 + xi < cnt) {
    const int slot = off + tok0 + xi;
    xrow = a.X + static_cast<int64_t>(a.x_rows ? a.x_rows[slot] : slot) * a.x_stride;
  }

  float acc[GATEUP ? 2 : 1][4][4] = {};
  for (int k0 = 0; k0 < cols; k0 += BK) {
    if (tid < (GATEUP ? 2 * BM : BM)) {
      const int which = tid / BM, r = tid % BM;
      float* col = &Ws[which][0][r];
      if (row0 + r < rows) {
        const Mat& M = which ? a.W2 : a.W;
        const uint8_t* row = (which ? w2 : w1) + static_cast<int64_t>(row0 + r) * M.row_stride;
        MOE_DISPATCH_TYPE(M.type, deq_col, row, k0 >> 5, col);
      } else {
#pragma unroll
        for (int i = 0; i < BK; ++i) col[i * LD] = 0.f;
      }
    }
    {
      float4 u = make_float4(0.f, 0.f, 0.f, 0.f), v = u;
      if (xrow) {
        u = *reinterpret_cast<const float4*>(xrow + k0 + 8 * xq);
        v = *reinterpret_cast<const float4*>(xrow + k0 + 8 * xq + 4);
      }
      Xs[8 * xq + 0][xi] = u.x; Xs[8 * xq + 1][xi] = u.y; Xs[8 * xq + 2][xi] = u.z; Xs[8 * xq + 3][xi] = u.w;
      Xs[8 * xq + 4][xi] = v.x; Xs[8 * xq + 5][xi] = v.y; Xs[8 * xq + 6][xi] = v.z; Xs[8 * xq + 7][xi] = v.w;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < BK; ++k) {
      const float4 b = *reinterpret_cast<const float4*>(&Xs[k][ty * 4]);
      const float bb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int w = 0; w < (GATEUP ? 2 : 1); ++w) {
        const float4 av = *reinterpret_cast<const float4*>(&Ws[w][k][tx * 4]);
        const float aa[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[w][i][j] = fmaf(aa[i], bb[j], acc[w][i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tk = tok0 + ty * 4 + j;
    if (tk >= cnt) continue;
    float* y = a.Y + static_cast<int64_t>(off + tk) * a.y_stride;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + tx * 4 + i;
      if (r >= rows) continue;
      float val;
      if constexpr (GATEUP) {
        const float g = acc[0][i][j];
        val = g / (1.f + expf(-g)) * acc[1][i][j];
      } else {
        val = acc[0][i][j];
      }
      y[r] = a.accumulate ? y[r] + val : val;
    }
  }
}

}  // namespace

cudaError_t gemm(const Mat& W, const float* X, int x_stride, int n_tok, float* Y, int y_stride, bool accumulate,
                 cudaStream_t s) {
  GemmArgs a{};
  a.W = W;
  a.X = X;
  a.x_stride = x_stride;
  a.Y = Y;
  a.y_stride = y_stride;
  a.accumulate = accumulate;
  a.n_tok = n_tok;
  dim3 grid((W.rows + BM - 1) / BM, (n_tok + BN - 1) / BN, 1);
  gemm_kernel<false><<<grid, NT, 0, s>>>(a);
  return cudaGetLastError();
}

cudaError_t expert_gate_up_grouped(const Mat& G, const Mat& U, const float* h, int h_stride, const int* count,
                                   const int* offset, const int32_t* token_of_slot, int n_expert, int max_count,
                                   float* act, cudaStream_t s) {
  GemmArgs a{};
  a.W = G;
  a.W2 = U;
  a.X = h;
  a.x_stride = h_stride;
  a.x_rows = token_of_slot;
  a.Y = act;
  a.y_stride = G.rows;
  a.count = count;
  a.offset = offset;
  dim3 grid((G.rows + BM - 1) / BM, (max_count + BN - 1) / BN, n_expert);
  gemm_kernel<true><<<grid, NT, 0, s>>>(a);
  return cudaGetLastError();
}

cudaError_t expert_down_grouped(const Mat& D, const float* act, const int* count, const int* offset, int n_expert,
                                int max_count, float* out, cudaStream_t s) {
  GemmArgs a{};
  a.W = D;
  a.X = act;
  a.x_stride = D.cols;
  a.Y = out;
  a.y_stride = D.rows;
  a.count = count;
  a.offset = offset;
  dim3 grid((D.rows + BM - 1) / BM, (max_count + BN - 1) / BN, n_expert);
  gemm_kernel<false><<<grid, NT, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace moe::cuda::k
