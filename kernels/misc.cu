// Small row-wise kernels: embedding lookup, RMSNorm, argmax, per-token expert choice, grouping the
// token/expert assignments for the prefill GEMMs, and the weighted combine of expert outputs.
#include "common.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

__global__ void embed_kernel(Mat W, const int32_t* ids, float* out) {
  const int t = blockIdx.x;
  int id = ids[t];
  if (id < 0 || id >= W.rows) id = 0;  // the host validates ids; never read outside the table
  const uint8_t* row = W.data + id * W.row_stride;
  float* o = out + static_cast<int64_t>(t) * W.cols;
  MOE_DISPATCH_TYPE(W.type, embed_t, row, W.cols >> 5, o);
}

__global__ void rmsnorm_kernel(const float* x, const float* w, int cols, int stride, float eps, float* out) {
  __shared__ float red[32];
  rmsnorm_row(x + static_cast<int64_t>(blockIdx.x) * stride, w, cols, eps, out + static_cast<int64_t>(blockIdx.x) * stride,
              red);
}

__device__ __forceinline__ void argmax_merge(float& best, int& idx, float ov, int oi) {
  if (ov > best || (ov == best && oi < idx)) {
    best = ov;
    idx = oi;
  }
}

// Block-wide argmax of (best, idx) pairs; thread 0 gets the result.
__device__ __forceinline__ void block_argmax(float& best, int& idx) {
  __shared__ float bv[32];
  __shared__ int bi[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    argmax_merge(best, idx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    best = lane < nw ? bv[lane] : -INFINITY;
    idx = lane < nw ? bi[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      argmax_merge(best, idx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  }
}

constexpr int kArgmaxBlocks = 128;

// Block b's slice of x: its best (value, index) to thread 0, and whether the slice holds a non-finite value
// (to every thread).
__device__ __forceinline__ void argmax_slice(const float* x, int n, float& best, int& idx, bool& bad) {
  const int per = (n + gridDim.x - 1) / gridDim.x;
  const int lo = blockIdx.x * per, hi = min(n, lo + per);
  best = -INFINITY;
  idx = 0x7fffffff;
  bad = false;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float v = x[i];
    bad |= !isfinite(v);
    argmax_merge(best, idx, v, i);
  }
  bad = __syncthreads_or(bad);
  block_argmax(best, idx);
}
// The merge of np partials (value, index with the sign bit set for a slice with a non-finite value) by one
// block (np <= blockDim.x; the same result whichever block merges). Thread 0 writes {argmax, non-finite} to
// out, or with `host` (mapped pinned memory, two such slots) to slot next_pos[0] & 1 there (the step's
// position: consecutive steps alternate slots), and the chained decode's next token and position.
__device__ __forceinline__ void argmax_merge_emit(const float* pv, const int* pi, int np, int32_t* out, int32_t* host,
                                                  int32_t* next_token, int32_t* next_pos) {
  float best = -INFINITY;
  int idx = 0x7fffffff;
  bool bad = false;
  for (int i = threadIdx.x; i < np; i += blockDim.x) {
    const int pii = __ldcg(pi + i);
    bad |= pii < 0;
    argmax_merge(best, idx, __ldcg(pv + i), pii & 0x7fffffff);
  }
  bad = __syncthreads_or(bad);
  block_argmax(best, idx);
  if (threadIdx.x == 0) {
    const int32_t r = idx == 0x7fffffff ? 0 : idx;
    int32_t* dst = host ? host + 2 * (next_pos[0] & 1) : out;
    dst[0] = r;
    dst[1] = bad ? 1 : 0;
    if (next_token) next_token[0] = r;
    if (next_pos) next_pos[0] += 1;
  }
}

// Each block reduces a contiguous slice to a partial; the last block to leave its partial (a counter, left at
// zero for the next launch) merges them. (One launch instead of a second kernel for the merge: the decode's
// greedy step measured 683.0-683.3 vs 683.1-683.4 tok/s, docs/PERFORMANCE.md version 28.)
__global__ void argmax_kernel(const float* x, int n, float* pv, int* pi, int* counter, int32_t* out, int32_t* host,
                              int32_t* next_token, int32_t* next_pos) {
  pdl_sync();
  float best;
  int idx;
  bool bad;
  argmax_slice(x, n, best, idx, bad);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    pv[blockIdx.x] = best;
    // a non-finite value in the slice sets the index's sign bit (indices are below 2^31)
    pi[blockIdx.x] = bad ? static_cast<int>(static_cast<unsigned>(idx) | 0x80000000u) : idx;
    __threadfence();
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) {
      __threadfence();
      *counter = 0;
    }
  }
  __syncthreads();
  if (!last) return;
  argmax_merge_emit(pv, pi, gridDim.x, out, host, next_token, next_pos);
}

// One warp per token.
__global__ void topk_kernel(const float* logits, int n_tok, int n_expert, int n_used, int32_t* ids, float* weights) {
  extern __shared__ float sm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  float* lg = sm + warp * 2 * n_expert;
  if (t >= n_tok) return;
  for (int i = lane; i < n_expert; i += 32) lg[i] = logits[static_cast<int64_t>(t) * n_expert + i];
  __syncwarp();
  softmax_topk_warp(lg, n_expert, n_used, ids + t * n_used, weights + t * n_used, lg + n_expert);
}

// One block of kGroupThreads threads (n_expert <= kGroupThreads). Assignment a = t * n_used + j goes
// to slot offset[e] + (number of earlier assignments to the same expert e), so slots within an expert
// follow token order and the result does not depend on scheduling.
//   1. count: shared-memory atomics (one per distinct expert of a warp), 2. exclusive scan of the
//   counts, 3. placement, kGroupThreads assignments at a time in order: an assignment's rank among
//   the chunk's assignments to its expert is its rank within its warp (match_any) plus the counts
//   of the earlier warps (a [warp][expert] table), and each expert's cursor then moves past the chunk.
constexpr int kGroupThreads = 1024, kGroupWarps = kGroupThreads / 32;

__global__ void __launch_bounds__(kGroupThreads) group_kernel(const int32_t* ids, int n_assign, int n_used,
                                                              int n_expert, int* count, int* offset,
                                                              int32_t* token_of_slot, int32_t* slot_of) {
  extern __shared__ int sh[];
  int* cur = sh;                                                           // n_expert: count, then cursor
  int* wsum = sh + n_expert;                                               // kGroupWarps: scan partials
  uint8_t* wc = reinterpret_cast<uint8_t*>(sh + n_expert + kGroupWarps);  // [kGroupWarps][n_expert]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;
  for (int e = tid; e < n_expert; e += kGroupThreads) cur[e] = 0;
  for (int i = tid; i < kGroupWarps * n_expert; i += kGroupThreads) wc[i] = 0;
  __syncthreads();

  // Expert of assignment a, or -1 (past the end, or an id out of range: such an assignment gets no slot).
  auto expert_of = [&](int a) {
    const int e = a < n_assign ? ids[a] : -1;
    return e >= 0 && e < n_expert ? e : -1;
  };
  for (int a0 = 0; a0 < n_assign; a0 += kGroupThreads) {
    const int e = expert_of(a0 + tid);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && (same & below) == 0) atomicAdd(&cur[e], __popc(same));
  }
  __syncthreads();

  // Exclusive scan of the counts, one expert per thread.
  const int c = tid < n_expert ? cur[tid] : 0;
  int incl = c;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = wsum[lane];  // kGroupWarps == 32
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += v;
    }
    wsum[lane] = w - wsum[lane];  // exclusive
  }
  __syncthreads();
  if (tid < n_expert) {
    const int excl = wsum[warp] + incl - c;
    count[tid] = c;
    offset[tid] = excl;
    cur[tid] = excl;
  }
  __syncthreads();

  for (int a0 = 0; a0 < n_assign; a0 += kGroupThreads) {
    const int a = a0 + tid;
    const int e = expert_of(a);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const bool first = (same & below) == 0, last = (same >> lane) == 1u;
    if (e >= 0 && first) wc[warp * n_expert + e] = static_cast<uint8_t>(__popc(same));
    __syncthreads();
    int slot = 0;
    if (e >= 0) {
      slot = cur[e] + __popc(same & below);
      for (int w = 0; w < warp; ++w) slot += wc[w * n_expert + e];
      token_of_slot[slot] = a / n_used;
      slot_of[a] = slot;
    }
    __syncthreads();  // every cursor and table entry read
    if (e >= 0) {
      if (last) atomicMax(&cur[e], slot + 1);
      if (first) wc[warp * n_expert + e] = 0;
    }
    __syncthreads();
  }
}

// x[t] += Σ_j w_j out[slot_j], j in rank order (fmaf from 0, then one add). The token's slots and
// weights are read once into shared memory (through x's stores the compiler reloaded them for every
// element), and with cols a multiple of 4 each thread takes four columns per load (the same operations
// per element: the same floats).
__global__ void combine_kernel(const float* __restrict__ out, const int32_t* __restrict__ slot_of,
                               const float* __restrict__ weights, int n_used, int cols, float* __restrict__ x) {
  extern __shared__ int s_comb[];
  int* s_slot = s_comb;
  float* s_w = reinterpret_cast<float*>(s_comb + n_used);
  const int t = blockIdx.x;
  for (int j = threadIdx.x; j < n_used; j += blockDim.x) {
    s_slot[j] = slot_of[t * n_used + j];
    s_w[j] = weights[t * n_used + j];
  }
  __syncthreads();
  float* xr = x + static_cast<int64_t>(t) * cols;
  if (cols % 4 == 0) {  // rows of out and x 16-byte aligned (the callers' buffers are)
    for (int d = 4 * threadIdx.x; d < cols; d += 4 * blockDim.x) {
      float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int j = 0; j < n_used; ++j) {
        const float4 o = __ldg(reinterpret_cast<const float4*>(out + static_cast<int64_t>(s_slot[j]) * cols + d));
        const float w = s_w[j];
        y.x = fmaf(w, o.x, y.x);
        y.y = fmaf(w, o.y, y.y);
        y.z = fmaf(w, o.z, y.z);
        y.w = fmaf(w, o.w, y.w);
      }
      float4 v = *reinterpret_cast<float4*>(xr + d);
      v.x += y.x;
      v.y += y.y;
      v.z += y.z;
      v.w += y.w;
      *reinterpret_cast<float4*>(xr + d) = v;
    }
  } else {
    for (int d = threadIdx.x; d < cols; d += blockDim.x) {
      float y = 0.f;
      for (int j = 0; j < n_used; ++j) y = fmaf(s_w[j], out[static_cast<int64_t>(s_slot[j]) * cols + d], y);
      xr[d] += y;
    }
  }
}

// Does nothing: the launch-overhead floor of a kernel in a captured graph (bench_cuda BM_LaunchChain).
__global__ void noop_kernel() {}

__global__ void chain_links_kernel(uint8_t* base, const int64_t* offsets, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    *reinterpret_cast<int64_t*>(base + offsets[i]) = offsets[i + 1 < n ? i + 1 : 0];
}

__global__ void chase_links_kernel(const uint8_t* base, int64_t first, int steps, long long* cycles) {
  int64_t o = first;
  const long long t0 = clock64();
  for (int i = 0; i < steps; ++i) o = __ldcg(reinterpret_cast<const int64_t*>(base + o));
  const long long t1 = clock64();
  cycles[0] = t1 - t0;
  cycles[1] = o;  // keeps the chain live
}

}  // namespace

cudaError_t embed_rows(const Mat& W, const int32_t* ids, int n, float* out, cudaStream_t s) {
  embed_kernel<<<n, 128, 0, s>>>(W, ids, out);
  return cudaGetLastError();
}

cudaError_t rmsnorm_rows(const float* x, const float* w, int n, int cols, int stride, float eps, float* out,
                         cudaStream_t s) {
  rmsnorm_kernel<<<n, 256, 0, s>>>(x, w, cols, stride, eps, out);
  return cudaGetLastError();
}

cudaError_t argmax(const float* x, int n, float* scratch, int32_t* out, cudaStream_t s, int32_t* next_token,
                   int32_t* next_pos, int32_t* host) {
  if (host && !next_pos) return cudaErrorInvalidValue;
  float* pv = scratch;
  int* pi = reinterpret_cast<int*>(scratch + kArgmaxBlocks);
  return launch_pdl(argmax_kernel, dim3(kArgmaxBlocks), dim3(256), 0, s, x, n, pv, pi,
                    reinterpret_cast<int*>(scratch + 2 * kArgmaxBlocks), out, host, next_token, next_pos);
}

cudaError_t topk_rows(const float* logits, int n_tok, int n_expert, int n_used, int32_t* ids, float* weights,
                      cudaStream_t s) {
  constexpr int warps = 4;
  size_t smem = static_cast<size_t>(warps) * 2 * n_expert * sizeof(float);
  topk_kernel<<<(n_tok + warps - 1) / warps, warps * 32, smem, s>>>(logits, n_tok, n_expert, n_used, ids, weights);
  return cudaGetLastError();
}

cudaError_t group_by_expert(const int32_t* ids, int n_tok, int n_used, int n_expert, int* count, int* offset,
                            int32_t* token_of_slot, int32_t* slot_of, cudaStream_t s) {
  if (n_expert <= 0 || n_expert > kGroupThreads) return cudaErrorInvalidValue;
  // At most 4 KiB + 32 KiB + 128 bytes at 1024 experts: under the default 48 KiB.
  const size_t smem = static_cast<size_t>(n_expert + kGroupWarps) * sizeof(int) + static_cast<size_t>(kGroupWarps) * n_expert;
  group_kernel<<<1, kGroupThreads, smem, s>>>(ids, n_tok * n_used, n_used, n_expert, count, offset, token_of_slot,
                                              slot_of);
  return cudaGetLastError();
}

cudaError_t combine_experts(const float* out, const int32_t* slot_of, const float* weights, int n_tok, int n_used,
                            int cols, float* x, cudaStream_t s) {
  if (n_tok <= 0) return cudaSuccess;
  if (n_used <= 0 || n_used > 4096 ||
      (cols % 4 == 0 && (reinterpret_cast<uintptr_t>(out) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)))
    return cudaErrorInvalidValue;
  combine_kernel<<<n_tok, 256, static_cast<size_t>(n_used) * 8, s>>>(out, slot_of, weights, n_used, cols, x);
  return cudaGetLastError();
}

cudaError_t chain_links(void* base, const int64_t* offsets, int n, cudaStream_t s) {
  chain_links_kernel<<<256, 256, 0, s>>>(static_cast<uint8_t*>(base), offsets, n);
  return cudaGetLastError();
}

cudaError_t chase_links(const void* base, int64_t first, int steps, long long* cycles, cudaStream_t s) {
  chase_links_kernel<<<1, 1, 0, s>>>(static_cast<const uint8_t*>(base), first, steps, cycles);
  return cudaGetLastError();
}

cudaError_t noop(int blocks, int threads, cudaStream_t s) {
  noop_kernel<<<blocks, threads, 0, s>>>();
  return cudaGetLastError();
}

}  // namespace moe::cuda::k
