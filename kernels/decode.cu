// The persistent decode kernel: one launch per token runs the embedding, every layer and the LM head,
// with a grid-wide barrier between phases instead of a kernel boundary.
//
// Why: measured on the H200, each of the seven kernels of a layer cost 7-14 us whatever its size
// (cold instruction and constant caches, launch and drain, a few dependent round trips to memory),
// so a token took ~70 us per layer against ~10 us of weight traffic. Here the code and constants stay
// hot across the 48 layers, and a barrier costs one round trip to L2.
//
// Per layer (every block takes part in every phase; work is handed out by block index):
//   P1 h = rmsnorm(x); q, k, v = W·h                      16-row tiles, tensor-core GEMV (tc.cuh)
//   P2 per (kv head, context slice): Q/K norm + RoPE, KV store, attention, merge of the slices
//   P3 x += W_o · o
//   P4 router logits of rmsnorm(x) (one warp per expert)
//   P5 every block: softmax + top-k of the logits (identical in all blocks); act = silu(G h) * (U h)
//   P6 x += Σ_j w_j D_j · act_j
// then the LM head and, for greedy decoding, the argmax. The blocks must all be resident at once: the
// launch asks for a cooperative launch, which fails rather than deadlocks when they are not.
#include <algorithm>
#include <cstdlib>

#include "decode.cuh"
#include "gemv_tc.cuh"
#include "tc.cuh"

namespace moe::cuda::k {
using namespace tc;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ---- grid barrier -----------------------------------------------------------------------------------
// bar[0] counts arrivals, bar[1] is the generation. Writes before the barrier are visible after it
// (fence, arrive; wait, fence), the pattern of cooperative groups' grid sync.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// bar[0] is the generation, bar[1 + b] the last generation block b arrived at. Each block publishes its
// own arrival (no contended atomic: 264 atomics on one word cost ~4.5 us on the H200), block 0 waits
// for all of them and releases the generation, the others wait for the release.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& gen, unsigned long long* times, int& phase) {
  ++gen;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    st_release(bar + 1 + blockIdx.x, gen);
  }
  if (blockIdx.x == 0) {
    for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += blockDim.x)
      while (ld_acquire(bar + 1 + b) != gen) __nanosleep(8);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      st_release(bar, gen);
      if (times) times[phase] = globaltimer();
    }
  } else if (threadIdx.x == 0) {
    while (ld_acquire(bar) != gen) __nanosleep(8);
    __threadfence();
  }
  ++phase;
  __syncthreads();
}

// ---- GEMV phases ----------------------------------------------------------------------------------------
// Reduces the warps' partial rows (part[warp][16]) of NG tile groups and hands row i of group gi to fn.
template <int NG, class Fn>
__device__ __forceinline__ void reduce_groups(const float (*part)[16], int lo, int n, Fn fn) {
  constexpr int WG = kWarps / NG;
  if (static_cast<int>(threadIdx.x) < 16 * NG) {
    const int gi = threadIdx.x >> 4, i = threadIdx.x & 15;
    float v = 0.f;
#pragma unroll
    for (int w = lo; w < lo + n; ++w) v += part[gi * WG + w][i];
    fn(gi, i, v);
  }
}

// Dense 16-row tiles of one matrix (type T) over the staged x; NG tiles per block at a time, each split
// over the K range by kWarps / NG warps. y (+)= W·x. Tile t goes to block (t / NG + shift) mod grid, so
// that consecutive matrices start on different blocks.
template <uint32_t T, int NG>
__device__ __noinline__ void dense_loop(const Mat& W, float* y, bool accumulate, int shift, const uint2* xb, const float* xsum,
                           float (*part)[16]) {
  constexpr int WG = kWarps / NG;
  const int warp = threadIdx.x >> 5, grp = warp / WG, wi = warp % WG, g = (threadIdx.x & 31) >> 2;
  const int total = (W.rows + 15) / 16;
  const int vb = (static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - shift % static_cast<int>(gridDim.x)) %
                 static_cast<int>(gridDim.x);
  for (int base = vb * NG; base < total; base += gridDim.x * NG) {
    const int tile = base + grp;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (tile < total) {
      const int r0 = tile * 16;
      const uint8_t* rg = W.data + min(r0 + g, W.rows - 1) * W.row_stride;
      const uint8_t* r8 = W.data + min(r0 + g + 8, W.rows - 1) * W.row_stride;
      tile16<T>([&](int, int i) { return i ? r8 : rg; }, [](int) { return 1.f; }, 1, W.cols / 256, wi, WG, xb, xsum,
                acc);
    }
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    reduce_groups<NG>(part, 0, WG, [&](int gi, int i, float v) {
      const int r = (base + gi) * 16 + i;
      if (base + gi >= total || r >= W.rows) return;
      y[r] = accumulate ? __ldcg(y + r) + v : v;
    });
    __syncthreads();
  }
}

template <int NG>
__device__ void dense_mat(const Mat& W, float* y, bool accumulate, int shift, const uint2* xb, const float* xsum,
                          float (*part)[16]) {
  switch (W.type) {
    case layout::Q4_K: dense_loop<layout::Q4_K, NG>(W, y, accumulate, shift, xb, xsum, part); break;
    case layout::Q5_K: dense_loop<layout::Q5_K, NG>(W, y, accumulate, shift, xb, xsum, part); break;
    case layout::Q6_K: dense_loop<layout::Q6_K, NG>(W, y, accumulate, shift, xb, xsum, part); break;
    default: break;
  }
}

// Pairs of 16-row tiles of the chosen experts' gate and up matrices (one type T): half of a group's
// warps take the gate rows, half the up rows. act[j][r] = silu(G_e.row(r)·h) * (U_e.row(r)·h).
template <uint32_t T, int NG>
__device__ __noinline__ void gate_up_loop(const Mat& G, const Mat& U, const int32_t* sid, int n_used, float* act,
                             const uint2* xb, const float* xsum, float (*part)[16]) {
  constexpr int WG = kWarps / NG, WH = WG / 2;
  const int warp = threadIdx.x >> 5, grp = warp / WG, wi = warp % WG, g = (threadIdx.x & 31) >> 2;
  const int per_e = (G.rows + 15) / 16, total = per_e * n_used;
  for (int base = blockIdx.x * NG; base < total; base += gridDim.x * NG) {
    const int tile = base + grp;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (tile < total) {
      const int j = tile / per_e, r0 = (tile - j * per_e) * 16;
      const Mat& M = wi >= WH ? U : G;
      const uint8_t* eb = M.data + sid[j] * M.expert_stride;
      const uint8_t* rg = eb + min(r0 + g, M.rows - 1) * M.row_stride;
      const uint8_t* r8 = eb + min(r0 + g + 8, M.rows - 1) * M.row_stride;
      tile16<T>([&](int, int i) { return i ? r8 : rg; }, [](int) { return 1.f; }, 1, M.cols / 256, wi % WH, WH, xb,
                xsum, acc);
    }
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < 16 * NG) {
      const int gi = threadIdx.x >> 4, i = threadIdx.x & 15, t = base + gi;
      if (t < total) {
        const int j = t / per_e, r = (t - j * per_e) * 16 + i;
        float gv = 0.f, uv = 0.f;
#pragma unroll
        for (int w = 0; w < WH; ++w) {
          gv += part[gi * WG + w][i];
          uv += part[gi * WG + WH + w][i];
        }
        if (r < G.rows) act[j * G.rows + r] = gv / (1.f + expf(-gv)) * uv;
      }
    }
    __syncthreads();
  }
}

// 16-row tiles of the down projection (type T), one per block at a time; the warps split the (expert,
// super-block) pairs. x[r] += Σ_j w_j D_e(j).row(r)·act_j.
template <uint32_t T>
__device__ __noinline__ void down_loop(const Mat& D, const int32_t* sid, const float* sw, int n_used, float* x, const uint2* xb,
                          const float* xsum, float (*part)[16]) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int total = (D.rows + 15) / 16;
  const int64_t es = D.expert_stride;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int r0 = tile * 16;
    const int64_t og = min(r0 + g, D.rows - 1) * D.row_stride, o8 = min(r0 + g + 8, D.rows - 1) * D.row_stride;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    tile16<T>([&](int s, int i) { return D.data + sid[s] * es + (i ? o8 : og); }, [&](int s) { return sw[s]; },
              n_used, D.cols / 256, warp, kWarps, xb, xsum, acc);
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    reduce_groups<1>(part, 0, kWarps, [&](int, int i, float v) {
      if (r0 + i < D.rows) x[r0 + i] = __ldcg(x + r0 + i) + v;
    });
    __syncthreads();
  }
}

#define MOE_KQ_DISPATCH(t, CALL)                          \
  switch (t) {                                            \
    case layout::Q4_K: { constexpr uint32_t T = layout::Q4_K; CALL; } break; \
    case layout::Q5_K: { constexpr uint32_t T = layout::Q5_K; CALL; } break; \
    case layout::Q6_K: { constexpr uint32_t T = layout::Q6_K; CALL; } break; \
    default: break;                                       \
  }

// The staged x of a phase (B fragments + group sums), kept out of line: inlined five times into the
// kernel its registers spilled.
__device__ __noinline__ void stage(const float* x, int n, const float* norm_w, float eps, uint2* xb, float* xsum,
                                   float* red) {
  stage_xb<4>(x, n, norm_w, eps, xb, xsum, red);
}

// ---- embedding, router ------------------------------------------------------------------------------
template <uint32_t T>
__device__ __forceinline__ void embed_groups(const uint8_t* row, int n_groups, float* out) {
  for (int gg = blockIdx.x * blockDim.x + threadIdx.x; gg < n_groups; gg += gridDim.x * blockDim.x) {
    float v[32];
    dequant32<T>(row, gg, v);
#pragma unroll
    for (int i = 0; i < 32; ++i) out[gg * 32 + i] = v[i];
  }
}

template <uint32_t T>
__device__ __forceinline__ void router_row(const uint8_t* row, int n, const float* x, const float* w, float scale,
                                           int lane, float& acc) {
  for (int gg = lane; gg < (n >> 5); gg += 32) {
    float v[32];
    dequant32<T>(row, gg, v);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc = fmaf(v[i], __ldcg(x + 32 * gg + i) * scale * w[32 * gg + i], acc);
  }
}

// logits[e] = R.row(e) · rmsnorm(x) * w. F32 routers: one block per expert, all loads issued at once;
// other types: one warp per expert.
__device__ __noinline__ void router_logits(const Mat& R, const float* x, const float* w, float eps, float* logits,
                                           float* red) {
  const int lane = threadIdx.x & 31;
  const int n4 = R.cols >> 2;
  if (R.type == layout::F32 && n4 <= 2 * kThreads) {
    for (int e = blockIdx.x; e < R.rows; e += gridDim.x) {
      const float4* r4 = reinterpret_cast<const float4*>(R.data + e * R.row_stride);
      const float4* x4 = reinterpret_cast<const float4*>(x);
      const float4* w4 = reinterpret_cast<const float4*>(w);
      float4 rv[2], xv[2], wv[2];
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = threadIdx.x + k * kThreads;
        if (i < n4) {
          rv[k] = __ldg(r4 + i);
          xv[k] = __ldcg(x4 + i);
          wv[k] = __ldg(w4 + i);
          ss += (xv[k].x * xv[k].x + xv[k].y * xv[k].y) + (xv[k].z * xv[k].z + xv[k].w * xv[k].w);
        }
      }
      ss = block_sum(ss, red);
      const float scale = rsqrtf(ss / static_cast<float>(R.cols) + eps);
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 2; ++k)
        if (threadIdx.x + k * kThreads < n4) {
          acc = fmaf(rv[k].x, xv[k].x * scale * wv[k].x, acc);
          acc = fmaf(rv[k].y, xv[k].y * scale * wv[k].y, acc);
          acc = fmaf(rv[k].z, xv[k].z * scale * wv[k].z, acc);
          acc = fmaf(rv[k].w, xv[k].w * scale * wv[k].w, acc);
        }
      acc = block_sum(acc, red);
      if (threadIdx.x == 0) logits[e] = acc;
      __syncthreads();
    }
    return;
  }
  const int e = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (e >= R.rows) return;
  float ss = 0.f;
  for (int i = lane; i < R.cols; i += 32) {
    const float v = __ldcg(x + i);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float scale = rsqrtf(ss / static_cast<float>(R.cols) + eps);
  float acc = 0.f;
  MOE_DISPATCH_TYPE(R.type, router_row, R.data + e * R.row_stride, R.cols, x, w, scale, lane, acc);
  acc = warp_sum(acc);
  if (lane == 0) logits[e] = acc;
}

// Every block makes the same choice of experts from the router logits (softmax_topk_block).
__device__ __noinline__ void topk_block(const float* logits, int n, int k, int32_t* sid, float* sw, float* prob,
                                        float* red) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) prob[i] = __ldcg(logits + i);
  softmax_topk_block(prob, n, k, sid, sw, red);
}

// ---- attention -------------------------------------------------------------------------------------
// Per-head RMSNorm (gain) and NEOX RoPE of `in` (hd floats) by one warp; out = result * out_scale.
__device__ void norm_rope_warp(const float* in, const float* gain, int hd, int pos, float eps, const Rope& rope,
                               float out_scale, float* out) {
  const int lane = threadIdx.x & 31, half_d = hd / 2;
  float ss = 0.f;
  for (int i = lane; i < hd; i += 32) {
    const float v = __ldcg(in + i);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float scale = rsqrtf(ss / static_cast<float>(hd) + eps);
  for (int i = lane; i < half_d; i += 32) {
    const float a = __ldcg(in + i) * scale * gain[i], b = __ldcg(in + i + half_d) * scale * gain[i + half_d];
    float theta = static_cast<float>(pos);
    for (int j = 0; j < i; ++j) theta *= rope.theta_scale;
    float th = theta * rope.freq_scale;
    if (rope.yarn) {
      const float y = (static_cast<float>(i) - rope.corr_lo) / fmaxf(0.001f, rope.corr_hi - rope.corr_lo);
      const float ramp = 1.f - fminf(1.f, fmaxf(0.f, y));
      th = th * (1.f - ramp) + theta * ramp;
    }
    double sd, cd;
    sincos(static_cast<double>(th), &sd, &cd);
    const float c = static_cast<float>(cd) * rope.mscale, s = static_cast<float>(sd) * rope.mscale;
    out[i] = (a * c - b * s) * out_scale;
    out[i + half_d] = (a * s + b * c) * out_scale;
  }
}

template <int D>
__device__ __forceinline__ void halves(const __half* p, float (&f)[D]) {
#pragma unroll
  for (int i = 0; i < D; i += 2) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(p + i));
    f[i] = v.x;
    f[i + 1] = v.y;
  }
}

constexpr int kMinChunk = 64;

// Work item (kv head g, slice sp) of the attention of the token at `pos`. Shared memory: sm.
template <int D, int G>
__device__ void attention_item(const DecodeArgs& a, const DecLayer& L, int g, int sp, int pos, float* sm) {
  constexpr int HD = D * 32, PS = HD + 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_head = a.n_head_kv * G, q_dim = n_head * HD, kv_dim = a.n_head_kv * HD;
  const int len = pos + 1, n_split = a.n_split;
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
  const float* row = a.qkv;
  for (int h = warp; h < G; h += kWarps)
    norm_rope_warp(row + (g * G + h) * HD, L.q_norm, HD, pos, a.eps, a.rope, rsqrtf(static_cast<float>(HD)), qs + h * HD);
  if (warp == kWarps - 1) {
    norm_rope_warp(row + q_dim + g * HD, L.k_norm, HD, pos, a.eps, a.rope, 1.f, kn);
    __syncwarp();
    for (int i = lane; i < HD; i += 32) {
      const __half kh = __float2half_rn(kn[i]), vh = __float2half_rn(__ldcg(row + q_dim + kv_dim + g * HD + i));
      kn[i] = __half2float(kh);
      vn[i] = __half2float(vh);
      if (sp == 0) {
        L.k_cache[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = kh;
        L.v_cache[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = vh;
      }
    }
  }
  __syncthreads();
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
  // positions c0 + warp + kWarps * i, four at a time: their K/V loads are in flight together
  constexpr int U = 4;
  for (int p0 = c0 + warp; p0 < c1; p0 += U * kWarps) {
    float kfu[U][D], vfu[U][D];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + u * kWarps;
      if (p == pos) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
          kfu[u][d] = kn[lane * D + d];
          vfu[u][d] = vn[lane * D + d];
        }
      } else if (p < c1) {
        halves<D>(L.k_cache + static_cast<int64_t>(p) * kv_dim + g * HD + lane * D, kfu[u]);
        halves<D>(L.v_cache + static_cast<int64_t>(p) * kv_dim + g * HD + lane * D, vfu[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
    if (p0 + u * kWarps >= c1) break;
    const float(&kf)[D] = kfu[u];
    const float(&vf)[D] = vfu[u];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float s = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) s = fmaf(q[h][d], kf[d], s);
      s = warp_sum(s);
      const float mn = fmaxf(m[h], s);
      const float corr = expf(m[h] - mn);
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
      wm[warp * G + h] = m[h];
      wl[warp * G + h] = l[h];
    }
#pragma unroll
    for (int d = 0; d < D; ++d) wacc[(warp * G + h) * HD + lane * D + d] = acc[h][d];
  }
  __syncthreads();
  float* part_base = a.partials + static_cast<int64_t>(g) * n_split * G * PS;
  float* part = part_base + sp * G * PS;
  float* out = a.o + g * G * HD;
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
  if (n_eff == 1) {
    __syncthreads();
    return;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.counters + g, 1) == n_eff - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) a.counters[g] = 0;
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
__device__ __noinline__ void attention_phase_t(const DecodeArgs& a, const DecLayer& L, int pos, float* sm) {
  const int items = a.n_head_kv * a.n_split;
  for (int it = blockIdx.x; it < items; it += gridDim.x) attention_item<D, G>(a, L, it / a.n_split, it % a.n_split, pos, sm);
}

__device__ void attention_phase(const DecodeArgs& a, const DecLayer& L, int pos, float* sm) {
  const int G = a.n_head / a.n_head_kv;
  if (a.head_dim == 128) {
    switch (G) {
      case 1: attention_phase_t<4, 1>(a, L, pos, sm); break;
      case 2: attention_phase_t<4, 2>(a, L, pos, sm); break;
      case 4: attention_phase_t<4, 4>(a, L, pos, sm); break;
      case 8: attention_phase_t<4, 8>(a, L, pos, sm); break;
      default: break;
    }
  } else {
    switch (G) {
      case 1: attention_phase_t<2, 1>(a, L, pos, sm); break;
      case 2: attention_phase_t<2, 2>(a, L, pos, sm); break;
      case 4: attention_phase_t<2, 4>(a, L, pos, sm); break;
      case 8: attention_phase_t<2, 8>(a, L, pos, sm); break;
      default: break;
    }
  }
}

// ---- argmax --------------------------------------------------------------------------------------------
__device__ __forceinline__ void amax_merge(float& best, int& idx, float ov, int oi) {
  if (ov > best || (ov == best && oi < idx)) {
    best = ov;
    idx = oi;
  }
}
__device__ void block_amax(float& best, int& idx, float* rv, int* ri) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    amax_merge(best, idx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    rv[warp] = best;
    ri[warp] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) amax_merge(best, idx, rv[w], ri[w]);
  }
  __syncthreads();
}

// ---- the kernel --------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(DecodeArgs a) {
  extern __shared__ __align__(16) uint8_t dsm[];
  __shared__ float red[32];
  __shared__ float part[kWarps][16];
  __shared__ int32_t sid[64];
  __shared__ float sw[64];
  __shared__ int ri[kWarps];
  __shared__ float rv[kWarps];
  uint2* xb = reinterpret_cast<uint2*>(dsm);
  const int E = a.n_embd, HD = a.head_dim;
  const int Q = a.n_head * HD, KV = a.n_head_kv * HD;
  const int pos = *a.pos;
  int phase = 1;
  unsigned gen = ld_acquire(a.barrier);  // the same in every block: it only moves inside a launch
  if (a.times && blockIdx.x == 0 && threadIdx.x == 0) a.times[0] = globaltimer();
  {  // embedding
    int tok = *a.token;
    if (tok < 0 || tok >= a.embd.rows) tok = 0;
    MOE_DISPATCH_TYPE(a.embd.type, embed_groups, a.embd.data + tok * a.embd.row_stride, E >> 5, a.x);
  }
  grid_sync(a.barrier, gen, a.times, phase);
  for (int l = 0; l < a.n_layer; ++l) {
    const DecLayer& L = a.layers[l];
    {  // P1: q, k, v
      float* xsum = reinterpret_cast<float*>(xb + (E / 32) * 32);
      stage(a.x, E, L.attn_norm, a.eps, xb, xsum, red);
      const int tq = (L.q.rows + 15) / 16, tk = (L.k.rows + 15) / 16;
      dense_mat<2>(L.q, a.qkv, false, 0, xb, xsum, part);
      dense_mat<2>(L.k, a.qkv + Q, false, (tq + 1) / 2, xb, xsum, part);
      dense_mat<2>(L.v, a.qkv + Q + KV, false, (tq + 1) / 2 + (tk + 1) / 2, xb, xsum, part);
    }
    grid_sync(a.barrier, gen, a.times, phase);
    attention_phase(a, L, pos, reinterpret_cast<float*>(dsm));  // P2
    grid_sync(a.barrier, gen, a.times, phase);
    {  // P3: x += W_o o
      float* xsum = reinterpret_cast<float*>(xb + (Q / 32) * 32);
      stage(a.o, Q, nullptr, 0.f, xb, xsum, red);
      dense_mat<1>(L.o, a.x, true, 0, xb, xsum, part);
    }
    grid_sync(a.barrier, gen, a.times, phase);
    router_logits(L.router, a.x, L.ffn_norm, a.eps, a.router_logits, red);  // P4
    grid_sync(a.barrier, gen, a.times, phase);
    {  // P5: experts chosen by every block; gate/up
      topk_block(a.router_logits, a.n_expert, a.n_used, sid, sw, reinterpret_cast<float*>(dsm), red);
      float* xsum = reinterpret_cast<float*>(xb + (E / 32) * 32);
      stage(a.x, E, L.ffn_norm, a.eps, xb, xsum, red);
      MOE_KQ_DISPATCH(L.gate.type, (gate_up_loop<T, 2>(L.gate, L.up, sid, a.n_used, a.act, xb, xsum, part)));
    }
    grid_sync(a.barrier, gen, a.times, phase);
    {  // P6: x += Σ w_j D_j act_j
      const int n = L.down.cols * a.n_used;
      float* xsum = reinterpret_cast<float*>(xb + (n / 32) * 32);
      stage(a.act, n, nullptr, 0.f, xb, xsum, red);
      MOE_KQ_DISPATCH(L.down.type, (down_loop<T>(L.down, sid, sw, a.n_used, a.x, xb, xsum, part)));
    }
    grid_sync(a.barrier, gen, a.times, phase);
  }
  {  // LM head
    float* xsum = reinterpret_cast<float*>(xb + (E / 32) * 32);
    stage(a.x, E, a.out_norm, a.eps, xb, xsum, red);
    dense_mat<2>(a.output, a.logits, false, 0, xb, xsum, part);
  }
  if (!a.greedy) return;
  grid_sync(a.barrier, gen, a.times, phase);
  const int V = a.output.rows;
  {
    const int per = (V + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per, hi = min(V, lo + per);
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) amax_merge(best, idx, __ldcg(a.logits + i), i);
    block_amax(best, idx, rv, ri);
    if (threadIdx.x == 0) {
      a.amax_val[blockIdx.x] = best;
      a.amax_idx[blockIdx.x] = idx;
    }
  }
  grid_sync(a.barrier, gen, a.times, phase);
  if (blockIdx.x != 0) return;
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += blockDim.x)
    amax_merge(best, idx, __ldcg(a.amax_val + b), __ldcg(a.amax_idx + b));
  block_amax(best, idx, rv, ri);
  if (threadIdx.x == 0) *a.argmax_out = idx == 0x7fffffff ? 0 : idx;
}

}  // namespace

// Dynamic shared memory: the largest staged x (B fragments + group sums) or the attention scratch.
static size_t smem_for(const DecodeArgs& a, int down_cols) {
  const int HD = a.head_dim, G = a.n_head / a.n_head_kv;
  const int n_max = std::max({a.n_embd, a.n_head * HD, down_cols * a.n_used});
  const size_t xbb = xb_smem(n_max);
  const size_t att = static_cast<size_t>(G * HD + 2 * HD + 2 * kWarps * G + kWarps * G * HD) * sizeof(float);
  const size_t topk = static_cast<size_t>(a.n_expert) * sizeof(float);
  return std::max({xbb, att, topk});
}

namespace {
size_t g_smem = 0;  // of the model decode_supported last accepted
}  // namespace

bool decode_supported(const DecodeArgs& a, const DecLayer& L) {
  const int G = a.n_head_kv > 0 ? a.n_head / a.n_head_kv : 0;
  if (a.n_head_kv <= 0 || a.n_head % a.n_head_kv != 0 || !(G == 1 || G == 2 || G == 4 || G == 8)) return false;
  if (!(a.head_dim == 64 || a.head_dim == 128)) return false;
  if (a.n_used < 1 || a.n_used > 64 || a.n_expert > 4096) return false;
  if (a.n_split < 1 || a.n_split * G > kWarps * G * a.head_dim) return false;
  for (const Mat* m : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down, &a.output})
    if (!tc_type(m->type) || m->cols % 256 != 0) return false;
  if (L.gate.type != L.up.type) return false;
  // opt-in: on the H200 it is not yet faster than the per-kernel graph (docs/PERFORMANCE.md)
  const char* env = std::getenv("MOE_CUDA_PERSISTENT");
  if (!env || env[0] != '1') return false;
  g_smem = smem_for(a, L.down.cols);
  return g_smem <= 200 * 1024;
}

int decode_grid(const DecodeArgs& a) {
  (void)a;
  if (cudaFuncSetAttribute(decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024) != cudaSuccess)
    return 0;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel, kThreads, g_smem) != cudaSuccess)
    return 0;
  return per_sm * sm_count();
}

cudaError_t decode_token(const DecodeArgs& a, int grid, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = g_smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, decode_kernel, a);
}

}  // namespace moe::cuda::k
