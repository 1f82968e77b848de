// Per-head Q/K RMSNorm + NEOX RoPE + fp16 KV store, and causal GQA attention over the fp16 cache,
// split over the context (flash-decoding): each block runs an online softmax over its slice for the
// query heads of one KV head, and the last block of a (token, kv head) merges the slices.
#include "common.cuh"
#include "trace.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

// cos and sin (times mscale) of RoPE pair i at position pos.
__device__ __forceinline__ void rope_cos_sin(int i, int pos, const Rope& rope, float& c, float& s) {
  // theta as the CPU builds it: pos, multiplied by theta_scale once per pair
  float theta = static_cast<float>(pos);
  for (int j = 0; j < i; ++j) theta *= rope.theta_scale;
  float th = theta * rope.freq_scale;
  if (rope.yarn) {
    const float y = (static_cast<float>(i) - rope.corr_lo) / fmaxf(0.001f, rope.corr_hi - rope.corr_lo);
    const float ramp = 1.f - fminf(1.f, fmaxf(0.f, y));
    th = th * (1.f - ramp) + theta * ramp;
  }
  // double-precision sin/cos: --use_fast_math would otherwise give the approximate ones, which are
  // wrong far from zero (theta reaches the position count).
  double sd, cd;
  sincos(static_cast<double>(th), &sd, &cd);
  c = static_cast<float>(cd) * rope.mscale;
  s = static_cast<float>(sd) * rope.mscale;
}

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

// Positions c0 + first, c0 + first + NW, ... < c1 of one KV head (cache rows kv_dim halves apart, this lane's
// dims at `off`) through an online softmax for the G query heads of a lane (running max m, normaliser l,
// accumulated values acc of this lane's D dimensions), U positions at a time: their K/V loads are in
// flight together, their U x G warp reductions interleave, and one rescale covers all U.
// Position `cur` (if any) is taken from kn/vn (this lane's dims at lane * D) instead of the cache.
template <int D, int G, int NW>
__device__ __forceinline__ void attend_range(const float (&q)[G][D], const __half* kc, const __half* vc, int kv_dim,
                                             int64_t off, int first, int c1, int cur, const float* kn,
                                             const float* vn, float (&m)[G], float (&l)[G], float (&acc)[G][D]) {
  const int lane = threadIdx.x & 31;
  constexpr int U = 4;
  for (int p0 = first; p0 < c1; p0 += U * NW) {
    float kfu[U][D], vfu[U][D];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + u * NW;
      if (p == cur) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
          kfu[u][d] = kn[lane * D + d];
          vfu[u][d] = vn[lane * D + d];
        }
      } else if (p < c1) {
        load_halves<D>(kc + static_cast<int64_t>(p) * kv_dim + off, kfu[u]);
        load_halves<D>(vc + static_cast<int64_t>(p) * kv_dim + off, vfu[u]);
      } else {
#pragma unroll
        for (int d = 0; d < D; ++d) kfu[u][d] = vfu[u][d] = 0.f;
      }
    }
    float sc[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) s = fmaf(q[h][d], kfu[u][d], s);
        sc[u][h] = s;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < G; ++h) sc[u][h] += __shfl_xor_sync(0xffffffffu, sc[u][h], o);
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float mn = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (p0 + u * NW < c1) mn = fmaxf(mn, sc[u][h]);
      const float corr = expf(m[h] - mn);  // 0 on the first positions (m = -inf)
      l[h] *= corr;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[h][d] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (p0 + u * NW >= c1) break;
        const float pw = expf(sc[u][h] - mn);
        l[h] += pw;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[h][d] = fmaf(pw, vfu[u][d], acc[h][d]);
      }
      m[h] = mn;
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

// Per-head RMSNorm (gain) and NEOX RoPE of `in` (HD floats) by one warp; out = result * out_scale.
// Lane l holds elements l + 32k (one load round trip); its RoPE pairs are (k, k + HD / 64).
template <int HD>
__device__ void norm_rope_warp(const float* in, const float* gain, int pos, float eps, const Rope& rope,
                               float out_scale, float* out) {
  constexpr int NV = HD / 32, HALF = HD / 2;
  const int lane = threadIdx.x & 31;
  float v[NV], gw[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    v[k] = __ldcg(in + lane + 32 * k);
    gw[k] = gain[lane + 32 * k];
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) ss += v[k] * v[k];
  ss = warp_sum(ss);
  const float scale = rsqrtf(ss / static_cast<float>(HD) + eps);
#pragma unroll
  for (int k = 0; k < NV / 2; ++k) {
    const int i = lane + 32 * k;
    const float a = v[k] * scale * gw[k], b = v[k + NV / 2] * scale * gw[k + NV / 2];
    float c, s;
    rope_cos_sin(i, pos, rope, c, s);
    out[i] = (a * c - b * s) * out_scale;
    out[i + HALF] = (a * s + b * c) * out_scale;
  }
}

// Decode attention with the per-head Q/K norm, RoPE and KV store fused in: block (kv head g, slice sp)
// of the one new token at position pos0[0]. Every block normalises and rotates the query heads of g
// itself; slice 0 writes this position's K and V to the cache, and the slice that covers the position
// takes them from shared memory (fp16-rounded like the cache), so no block reads a cache row being
// written. Slices merge as in attention_kernel. Block: kDecWarps warps; dynamic shared memory
// dec_smem_floats(G, HD) floats.
constexpr int kDecWarps = 8;
constexpr int dec_smem_floats(int G, int HD) { return G * HD + 2 * HD + 2 * kDecWarps * G + kDecWarps * G * HD; }

template <int D, int G>
__global__ void __launch_bounds__(kDecWarps * 32) attention_decode_kernel(const float* __restrict__ qkv,
                                                                          const int32_t* pos0, const float* q_norm,
                                                                          const float* k_norm, float eps, Rope rope,
                                                                          __half* kc, __half* vc, int n_head_kv,
                                                                          int n_split, float* partials,
                                                                          int* counters, float* out_all) {
  constexpr int HD = D * 32, PS = HD + 2, kWarps = kDecWarps;
  extern __shared__ float sm[];
  const int g = blockIdx.x, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_head = n_head_kv * G, q_dim = n_head * HD, kv_dim = n_head_kv * HD;
  MOE_TRACE_SCOPE(4);
  pdl_sync();
  const int pos = pos0[0];
  MOE_TRACE_MARK(1);
  const int len = pos + 1;
  int chunk = (len + n_split - 1) / n_split;
  if (n_split > 1 && chunk < kMinChunk) chunk = kMinChunk;
  const int n_eff = (len + chunk - 1) / chunk;
  if (sp >= n_eff) return;  // uniform over the block
  float* qs = sm;                   // [G][HD], scaled by 1/sqrt(HD)
  float* kn = qs + G * HD;          // this position's K and V (fp16-rounded, as the cache holds them)
  float* vn = kn + HD;
  float* wm = vn + HD;              // [kWarps][G]
  float* wl = wm + kWarps * G;      // [kWarps][G]
  float* wacc = wl + kWarps * G;    // [kWarps][G][HD]
  __shared__ bool last;
  const float* row = qkv;
  for (int h = warp; h < G; h += kWarps)
    norm_rope_warp<HD>(row + (g * G + h) * HD, q_norm, pos, eps, rope, rsqrtf(static_cast<float>(HD)), qs + h * HD);
  if (warp == kWarps - 1) {
    norm_rope_warp<HD>(row + q_dim + g * HD, k_norm, pos, eps, rope, 1.f, kn);
    __syncwarp();
    for (int i = lane; i < HD; i += 32) {
      const __half kh = __float2half_rn(kn[i]), vh = __float2half_rn(__ldcg(row + q_dim + kv_dim + g * HD + i));
      kn[i] = __half2float(kh);
      vn[i] = __half2float(vh);
      if (sp == 0) {
        kc[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = kh;
        vc[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = vh;
      }
    }
  }
  __syncthreads();
  MOE_TRACE_MARK(2);
  const int c0 = sp * chunk, c1 = min(len, c0 + chunk);
  float m[G], l[G], acc[G][D], q[G][D];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      acc[h][d] = 0.f;
      q[h][d] = qs[h * HD + lane * D + d];
    }
  }
  attend_range<D, G, kWarps>(q, kc, vc, kv_dim, g * HD + lane * D, c0 + warp, c1, pos, kn, vn, m, l, acc);
  MOE_TRACE_MARK(3);
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) {
      wm[warp * G + h] = m[h];
      wl[warp * G + h] = l[h];
    }
#pragma unroll
    for (int d = 0; d < D; ++d) wacc[(warp * G + h) * HD + lane * D + d] = acc[h][d];
  }
  __syncthreads();
  MOE_TRACE_MARK(4);
  float* part_base = partials + static_cast<int64_t>(g) * n_split * G * PS;
  float* part = part_base + sp * G * PS;
  float* out = out_all + g * G * HD;
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int h = i / HD, d = i % HD;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w * G + h]);
    float Lsum = 0.f, A = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      if (wm[w * G + h] == -INFINITY) continue;
      const float f = expf(wm[w * G + h] - M);
      Lsum += wl[w * G + h] * f;
      A += wacc[(w * G + h) * HD + d] * f;
    }
    if (n_eff == 1) {
      out[i] = A / Lsum;
    } else {
      part[h * PS + d] = A;
      if (d == 0) {
        part[h * PS + HD] = M;
        part[h * PS + HD + 1] = Lsum;
      }
    }
  }
  MOE_TRACE_MARK(5);
  if (n_eff == 1) {
    __syncthreads();
    return;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + g, 1) == n_eff - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) counters[g] = 0;
  __threadfence();
  // merge: out = Σ_s A_s exp(m_s - M) / Σ_s L_s exp(m_s - M)
  float* fw = wacc;  // reuse: [n_eff][G] exp(m_s - M)
  float* fM = wm;    // [G] M, then 1 / L
  for (int i = threadIdx.x; i < n_eff * G; i += blockDim.x) fw[i] = __ldcg(part_base + i * PS + HD);
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < G) {
    const int h = threadIdx.x;
    float M = -INFINITY;
    for (int s = 0; s < n_eff; ++s) M = fmaxf(M, fw[s * G + h]);
    fM[h] = M;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_eff * G; i += blockDim.x) fw[i] = expf(fw[i] - fM[i % G]);
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < G) {
    const int h = threadIdx.x;
    float Ls = 0.f;
    for (int s = 0; s < n_eff; ++s) Ls = fmaf(__ldcg(part_base + (s * G + h) * PS + HD + 1), fw[s * G + h], Ls);
    wl[h] = 1.f / Ls;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int h = i / HD, d = i % HD;
    float A = 0.f;
    for (int s = 0; s < n_eff; ++s) A = fmaf(__ldcg(part_base + (s * G + h) * PS + d), fw[s * G + h], A);
    out[i] = A * wl[h];
  }
  __syncthreads();
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
                                    float* partials, int* counters, float* out, cudaStream_t s) {
  const size_t smem = static_cast<size_t>(dec_smem_floats(G, D * 32)) * sizeof(float);
  return launch_pdl(attention_decode_kernel<D, G>, dim3(n_head_kv, n_split), dim3(kDecWarps * 32), smem, s, qkv, pos0,
                    q_norm, k_norm, eps, rope, static_cast<__half*>(kc), static_cast<__half*>(vc), n_head_kv, n_split,
                    partials, counters, out);
}

template <int D>
cudaError_t attention_decode_g(int G, const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               float eps, Rope rope, void* kc, void* vc, int n_head_kv, int n_split, float* partials,
                               int* counters, float* out, cudaStream_t s) {
  switch (G) {
#define MOE_ATT_DEC(GG)                                                                                              \
  case GG:                                                                                                           \
    return launch_attention_decode<D, GG>(qkv, pos0, q_norm, k_norm, eps, rope, kc, vc, n_head_kv, n_split, partials, \
                                          counters, out, s);
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
                             int n_split, float* partials, int* counters, float* out, cudaStream_t s) {
  if (!attention_supported(n_head, n_head_kv, head_dim) || n_split < 1 || n_split > kMaxSplit)
    return cudaErrorInvalidValue;
  const int G = n_head / n_head_kv;
  if (head_dim == 64)
    return attention_decode_g<2>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split,
                                 partials, counters, out, s);
  return attention_decode_g<4>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split, partials,
                               counters, out, s);
}

}  // namespace moe::cuda::k

MOE_TRACE_TU(attention)
