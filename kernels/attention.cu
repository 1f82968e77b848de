// Per-head Q/K RMSNorm + NEOX RoPE + fp16 KV store, and causal GQA attention over the fp16 cache,
// split over the context (flash-decoding): each block runs an online softmax over its slice for the
// query heads of one KV head, and the last block of a (token, kv head) merges the slices.
#include "common.cuh"

namespace moe::cuda::k {
using namespace dev;

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
  // theta as the CPU builds it: pos, multiplied by theta_scale once per pair
  float theta = static_cast<float>(pos);
  for (int j = 0; j < i; ++j) theta *= rope.theta_scale;
  float th = theta * rope.freq_scale;
  if (rope.yarn) {
    float y = (static_cast<float>(i) - rope.corr_lo) / fmaxf(0.001f, rope.corr_hi - rope.corr_lo);
    float ramp = 1.f - fminf(1.f, fmaxf(0.f, y));
    th = th * (1.f - ramp) + theta * ramp;
  }
  // double-precision sin/cos: --use_fast_math would otherwise give the approximate ones, which are
  // wrong far from zero (theta reaches the position count).
  double sd, cd;
  sincos(static_cast<double>(th), &sd, &cd);
  const float c = static_cast<float>(cd) * rope.mscale, s = static_cast<float>(sd) * rope.mscale;
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

constexpr int kAttnWarps = 4;
constexpr int kMaxSplit = 64;
constexpr int kMinChunk = 64;

template <int D>
__device__ __forceinline__ void load_halves(const __half* p, float (&f)[D]) {
  if constexpr (D == 2) {
    float2 a = __half22float2(*reinterpret_cast<const __half2*>(p));
    f[0] = a.x; f[1] = a.y;
  } else if constexpr (D == 4) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(*reinterpret_cast<__half2*>(&u.x));
    float2 b = __half22float2(*reinterpret_cast<__half2*>(&u.y));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < D; i += 4) {
      float t[4];
      load_halves<4>(p + i, t);
#pragma unroll
      for (int j = 0; j < 4; ++j) f[i + j] = t[j];
    }
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
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        acc[h][d] = 0.f;
        q[h][d] = qs[h][lane * D + d];
      }
    }
    // positions c0 + warp + kAttnWarps * i, four at a time: their K/V loads are in flight together
    constexpr int U = 4;
    for (int p0 = c0 + warp; p0 < c1; p0 += U * kAttnWarps) {
      float kfu[U][D], vfu[U][D];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u * kAttnWarps;
        if (p < c1) {
          load_halves<D>(kc + static_cast<int64_t>(p) * kv_dim + g * HD + lane * D, kfu[u]);
          load_halves<D>(vc + static_cast<int64_t>(p) * kv_dim + g * HD + lane * D, vfu[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
      if (p0 + u * kAttnWarps >= c1) break;
      const float(&kf)[D] = kfu[u];
      const float(&vf)[D] = vfu[u];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) s = fmaf(q[h][d], kf[d], s);
        s = warp_sum(s);
        const float mn = fmaxf(m[h], s);
        const float corr = expf(m[h] - mn);  // 0 on the first position (m = -inf)
        const float pw = expf(s - mn);
        l[h] = l[h] * corr + pw;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[h][d] = acc[h][d] * corr + pw * vf[d];
        m[h] = mn;
      }
      }
    }
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

}  // namespace moe::cuda::k
