// Per-head Q/K RMSNorm + NEOX RoPE + fp16 KV store, and causal GQA attention over the fp16 cache,
// split over the context (flash-decoding): each block runs an online softmax over its slice for the
// query heads of one KV head, and the last block of a (token, kv head) merges the slices.
#include "attention.cuh"

namespace moe::cuda::k {
using namespace dev;
using namespace att;

namespace {

// One block per (head, token); head_dim/2 threads, thread i owns the RoPE pair (i, i + head_dim/2).
__global__ void qk_norm_rope_store_kernel(float* qkv, const int32_t* pos0, const float* __restrict__ q_norm,
                                          const float* __restrict__ k_norm, int n_head, int n_head_kv, int hd,
                                          float eps, Rope rope, __half* kc, __half* vc) {
  __shared__ float red[32];
  pdl_sync();
  const int t = blockIdx.y, h = blockIdx.x, i = threadIdx.x, half_d = hd / 2;
  const int q_dim = n_head * hd, kv_dim = n_head_kv * hd;
  const int pos = pos0[0] + t;
  float* row = qkv + static_cast<int64_t>(t) * (q_dim + 2 * kv_dim);
  const bool is_q = h < n_head;
  float* v = is_q ? row + h * hd : row + q_dim + (h - n_head) * hd;
  const float* gain = is_q ? q_norm : k_norm;
  float a = v[i], b = v[i + half_d];
  float ss = block_sum(a * a + b * b, red);
  const float scale = rsqrtf(ss / static_cast<float>(hd) + eps);
  a = a * scale * gain[i];
  b = b * scale * gain[i + half_d];
  float c, s;
  rope_cos_sin(i, pos, rope, c, s);
  const float ra = a * c - b * s, rb = a * s + b * c;
  if (is_q) {
    v[i] = ra;
    v[i + half_d] = rb;
  } else {
    const int g = h - n_head;
    __half* kr = kc + static_cast<int64_t>(pos) * kv_dim + g * hd;
    __half* vr = vc + static_cast<int64_t>(pos) * kv_dim + g * hd;
    kr[i] = __float2half_rn(ra);
    kr[i + half_d] = __float2half_rn(rb);
    const float* vsrc = row + q_dim + kv_dim + g * hd;
    vr[i] = __float2half_rn(vsrc[i]);
    vr[i + half_d] = __float2half_rn(vsrc[i + half_d]);
  }
}

// grid (n_head_kv, n_split, n_tok), kAttnWarps warps. D = head_dim / 32 dims per lane, G query heads per kv head.
template <int D, int G>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const float* __restrict__ qkv, int qkv_stride,
                                                                    const int32_t* pos0, const __half* __restrict__ kc,
                                                                    const __half* __restrict__ vc, int n_head_kv,
                                                                    int n_split, float* partials, int* counters,
                                                                    float* out) {
  constexpr int HD = D * 32;
  constexpr int PS = HD + 2;  // one partial: acc[HD], m, l
  __shared__ float qs[G][HD];
  __shared__ float wm[kAttnWarps][G], wl[kAttnWarps][G];
  __shared__ float wacc[kAttnWarps][G][HD];
  __shared__ bool last;
  pdl_sync();
  const int g = blockIdx.x, split = blockIdx.y, t = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_head = n_head_kv * G;
  const int kv_dim = n_head_kv * HD;
  const int pos = pos0[0] + t;
  const int len = pos + 1;
  // Slices of at least kMinChunk positions: short contexts use fewer slices (often one, which then
  // writes the output itself) and the merge reads only the slices that ran.
  int chunk = (len + n_split - 1) / n_split;
  if (n_split > 1 && chunk < kMinChunk) chunk = kMinChunk;
  const int n_eff = (len + chunk - 1) / chunk;
  const int64_t out_row = static_cast<int64_t>(t) * n_head * HD + g * G * HD;
  float* part_base = partials + (static_cast<int64_t>(t) * n_head_kv + g) * n_split * G * PS;
  if (split >= n_eff) return;  // a slice past the context: only the n_eff slices that run are counted
  {
    const int c0 = split * chunk;
    const int c1 = min(len, c0 + chunk);
    const float scale = rsqrtf(static_cast<float>(HD));
    const float* qrow = qkv + static_cast<int64_t>(t) * qkv_stride + g * G * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) qs[i / HD][i % HD] = qrow[i] * scale;
    __syncthreads();

    float m[G], l[G], acc[G][D], q[G][D];
    softmax_start<D, G>(&qs[0][0], HD, m, l, acc, q);
    attend_range<D, G, kAttnWarps>(q, kc, vc, kv_dim, g * HD + lane * D, c0 + warp, c1, -1, nullptr, nullptr, m, l,
                                   acc);
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (lane == 0) {
        wm[warp][h] = m[h];
        wl[warp][h] = l[h];
      }
#pragma unroll
      for (int d = 0; d < D; ++d) wacc[warp][h][lane * D + d] = acc[h][d];
    }
    __syncthreads();
    // merge the warps: thread handles (head, dim) pairs
    float* part = part_base + split * G * PS;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
      const int h = i / HD, d = i % HD;
      float M = -INFINITY;
      for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, wm[w][h]);
      float L = 0.f, A = 0.f;
      for (int w = 0; w < kAttnWarps; ++w) {
        if (wm[w][h] == -INFINITY) continue;
        const float f = expf(wm[w][h] - M);
        L += wl[w][h] * f;
        A += wacc[w][h][d] * f;
      }
      if (n_eff == 1) {
        out[out_row + i] = A / L;
      } else {
        part[h * PS + d] = A;
        if (d == 0) {
          part[h * PS + HD] = M;
          part[h * PS + HD + 1] = L;
        }
      }
    }
  }
  if (n_eff == 1) return;  // the only slice wrote the output itself
  __threadfence();
  __syncthreads();
  int* counter = counters + t * n_head_kv + g;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == n_eff - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) *counter = 0;
  __threadfence();
  // weight of slice s for head h: exp(m_s - M) / L, computed once per (slice, head)
  __shared__ float fw[kMaxSplit][G];
  __shared__ float fM[G];
  for (int i = threadIdx.x; i < n_eff * G; i += blockDim.x) fw[i / G][i % G] = __ldcg(part_base + i * PS + HD);
  __syncthreads();
  if (threadIdx.x < G) {
    const int h = threadIdx.x;
    float M = -INFINITY;
    for (int sp = 0; sp < n_eff; ++sp) M = fmaxf(M, fw[sp][h]);
    fM[h] = M;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_eff * G; i += blockDim.x) {
    const int sp = i / G, h = i % G;
    fw[sp][h] = __ldcg(part_base + i * PS + HD + 1) * expf(fw[sp][h] - fM[h]);  // l_s * exp(m_s - M)
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int h = threadIdx.x;
    float L = 0.f;
    for (int sp = 0; sp < n_eff; ++sp) L += fw[sp][h];
    fM[h] = 1.f / L;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_eff * G; i += blockDim.x) {
    const int sp = i / G, h = i % G;
    const float lsp = __ldcg(part_base + i * PS + HD + 1);
    fw[sp][h] = lsp > 0.f ? fw[sp][h] / lsp * fM[h] : 0.f;  // exp(m_s - M) / L
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int h = i / HD, d = i % HD;
    float A = 0.f;
#pragma unroll 4
    for (int sp = 0; sp < n_eff; ++sp) A = fmaf(__ldcg(part_base + (sp * G + h) * PS + d), fw[sp][h], A);
    out[out_row + i] = A;
  }
}

// out[i] = cos, out[hd / 2 + i] = sin of RoPE pair i at position pos0[0] (one per token: every layer's
// decode attention reads it instead of evaluating double-precision sincos per block).
__global__ void rope_table_kernel(const int32_t* pos0, Rope rope, int hd, float* out) {
  pdl_sync();
  const int i = threadIdx.x;
  if (i < hd / 2) rope_cos_sin(i, pos0[0], rope, out[i], out[hd / 2 + i]);
}

template <int D, int G>
__global__ void __launch_bounds__(kDecWarps * 32) attention_decode_kernel(const float* __restrict__ qkv,
                                                                          const int32_t* pos0, const float* q_norm,
                                                                          const float* k_norm, float eps, Rope rope,
                                                                          __half* kc, __half* vc, int n_head_kv,
                                                                          int n_split, float* partials,
                                                                          int* counters, float* out_all,
                                                                          const float* rope_cs) {
  extern __shared__ float sm[];
  MOE_TRACE_SCOPE(4);
  pdl_sync();
  attention_decode_item<D, G>(blockIdx.x, blockIdx.y, qkv, pos0, q_norm, k_norm, eps, rope, kc, vc, n_head_kv, n_split,
                              partials, counters, out_all, rope_cs, sm);
}

template <int D, int G>
cudaError_t launch_attention(const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* kc,
                             const void* vc, int n_head_kv, int n_split, float* partials, int* counters, float* out,
                             cudaStream_t s) {
  dim3 grid(n_head_kv, n_split, n);
  return launch_pdl(attention_kernel<D, G>, grid, dim3(kAttnWarps * 32), 0, s, qkv, qkv_stride, pos0,
                    static_cast<const __half*>(kc), static_cast<const __half*>(vc), n_head_kv, n_split, partials,
                    counters, out);
}

template <int D>
cudaError_t attention_g(int G, const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* kc,
                        const void* vc, int n_head_kv, int n_split, float* partials, int* counters, float* out,
                        cudaStream_t s) {
  switch (G) {
    case 1: return launch_attention<D, 1>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, n_split, partials, counters, out, s);
    case 2: return launch_attention<D, 2>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, n_split, partials, counters, out, s);
    case 4: return launch_attention<D, 4>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, n_split, partials, counters, out, s);
    case 8: return launch_attention<D, 8>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, n_split, partials, counters, out, s);
    default: return cudaErrorInvalidValue;
  }
}

template <int D, int G>
cudaError_t launch_attention_decode(const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm,
                                    float eps, Rope rope, void* kc, void* vc, int n_head_kv, int n_split,
                                    float* partials, int* counters, float* out, const float* rope_cs, cudaStream_t s) {
  const size_t smem = static_cast<size_t>(dec_smem_floats(G, D * 32)) * sizeof(float);
  return launch_pdl(attention_decode_kernel<D, G>, dim3(n_head_kv, n_split), dim3(kDecWarps * 32), smem, s, qkv, pos0,
                    q_norm, k_norm, eps, rope, static_cast<__half*>(kc), static_cast<__half*>(vc), n_head_kv, n_split,
                    partials, counters, out, rope_cs);
}

template <int D>
cudaError_t attention_decode_g(int G, const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               float eps, Rope rope, void* kc, void* vc, int n_head_kv, int n_split, float* partials,
                               int* counters, float* out, const float* rope_cs, cudaStream_t s) {
  switch (G) {
#define MOE_ATT_DEC(GG)                                                                                              \
  case GG:                                                                                                           \
    return launch_attention_decode<D, GG>(qkv, pos0, q_norm, k_norm, eps, rope, kc, vc, n_head_kv, n_split, partials, \
                                          counters, out, rope_cs, s);
    MOE_ATT_DEC(1) MOE_ATT_DEC(2) MOE_ATT_DEC(4) MOE_ATT_DEC(8)
#undef MOE_ATT_DEC
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool attention_supported(int n_head, int n_head_kv, int head_dim) {
  if (n_head_kv <= 0 || n_head % n_head_kv != 0) return false;
  const int G = n_head / n_head_kv;
  return (head_dim == 64 || head_dim == 128) && (G == 1 || G == 2 || G == 4 || G == 8);
}

cudaError_t qk_norm_rope_store(float* qkv, int n, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               int n_head, int n_head_kv, int head_dim, float eps, Rope rope, void* k_cache,
                               void* v_cache, cudaStream_t s) {
  dim3 grid(n_head + n_head_kv, n);
  return launch_pdl(qk_norm_rope_store_kernel, grid, dim3(head_dim / 2), 0, s, qkv, pos0, q_norm, k_norm, n_head,
                    n_head_kv, head_dim, eps, rope, static_cast<__half*>(k_cache), static_cast<__half*>(v_cache));
}

cudaError_t attention(const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* k_cache,
                      const void* v_cache, int n_head, int n_head_kv, int head_dim, int n_split, float* partials,
                      int* counters, float* out, cudaStream_t s) {
  if (!attention_supported(n_head, n_head_kv, head_dim) || n_split < 1 || n_split > kMaxSplit)
    return cudaErrorInvalidValue;
  const int G = n_head / n_head_kv;
  if (head_dim == 64)
    return attention_g<2>(G, qkv, qkv_stride, n, pos0, k_cache, v_cache, n_head_kv, n_split, partials, counters, out, s);
  return attention_g<4>(G, qkv, qkv_stride, n, pos0, k_cache, v_cache, n_head_kv, n_split, partials, counters, out, s);
}

cudaError_t attention_decode(const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm, float eps,
                             Rope rope, void* k_cache, void* v_cache, int n_head, int n_head_kv, int head_dim,
                             int n_split, float* partials, int* counters, float* out, const float* rope_cs,
                             cudaStream_t s) {
  if (!attention_supported(n_head, n_head_kv, head_dim) || n_split < 1 || n_split > kMaxSplit)
    return cudaErrorInvalidValue;
  const int G = n_head / n_head_kv;
  if (head_dim == 64)
    return attention_decode_g<2>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split,
                                 partials, counters, out, rope_cs, s);
  return attention_decode_g<4>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split, partials,
                               counters, out, rope_cs, s);
}

cudaError_t rope_table(const int32_t* pos0, Rope rope, int head_dim, float* out, cudaStream_t s) {
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > 2048) return cudaErrorInvalidValue;
  return launch_pdl(rope_table_kernel, dim3(1), dim3((head_dim / 2 + 31) / 32 * 32), 0, s, pos0, rope, head_dim, out);
}

}  // namespace moe::cuda::k

MOE_TRACE_TU(attention)
