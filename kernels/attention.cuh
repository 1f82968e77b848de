// Device parts of the attention kernels shared by attention.cu and the persistent decode kernel
// (decode_persist.cu): RoPE angles, the online-softmax loop over cache rows, the per-head Q/K norm +
// RoPE, and one (kv head, slice) item of decode attention. Included by .cu files only.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"
#include "mma.cuh"
#include "trace.cuh"

namespace moe::cuda::k::att {
using namespace dev;

// cos and sin (times mscale) of RoPE pair i at position pos. Not inlined: the double-precision sincos is
// large code, and the decode kernels call it once per pair.
static __device__ __noinline__ void rope_cos_sin(int i, int pos, const Rope& rope, float& c, float& s) {
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

constexpr int kMaxSplit = kAttMaxSplit;
constexpr int kMergeMax = 64;  // inputs of one merge_slices (two per lane); more slices merge in two levels
// Decode slices are at least kDecMinChunk positions: one round of a block's loads (8 warps x 4
// positions) at short contexts.
constexpr int kDecMinChunk = 32;

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

// A block's K and V rows of groups of 32 positions go to shared memory by cp.async (no registers held),
// into a ring of kKvRing slots: the first kKvRing groups of a slice are issued before the block's wait
// (cache rows of earlier positions do not depend on the previous kernel), and each later group as soon as
// its slot is consumed, so that up to kKvRing - 1 groups are in flight while one is scored. A slot is 64
// rows of HD + 8 halves (K rows 0-31, V rows 32-63; padded for ldmatrix). Two slots: with three (66 KB
// blocks) every other decode kernel ran slower beside the attention's blocks (BM_Decode/0 580 vs 604 tok/s,
// /4096 440 vs 490; docs/PERFORMANCE.md version 18), with two (49 KB) the attention gains alone.
constexpr int kKvRing = 2;
constexpr int kv_slot_halves(int HD) { return 64 * (HD + 8); }
// Issues rows base .. base + 31 of K and V into slot (zeros past c1; nothing for `cur`, the position this
// token writes, whose row kv_cur_row fills from kn/vn); the caller commits the group.
template <int D, int NW>
__device__ __forceinline__ void kv_group_issue(__half* slot, const __half* kc, const __half* vc, int kv_dim,
                                               int64_t off, int base, int c1, int cur, uint64_t pol = 0) {
  constexpr int CH = D * 4, KS = D * 32 + 8, N = 2 * 32 * CH;  // 16-byte pieces per row; pieces per group
  static_assert(N % (NW * 32) == 0, "whole pieces per thread");
#pragma unroll
  for (int k = 0; k < N / (NW * 32); ++k) {
    const int idx = threadIdx.x + k * NW * 32;
    const int kv = idx / (32 * CH), rem = idx - kv * 32 * CH, r = rem / CH, c = rem - r * CH, p = base + r;
    if (p == cur) continue;  // not even zeros: they could land after kv_cur_row's stores
    const bool ok = p < c1;
    const __half* src = (kv ? vc : kc) + (ok ? static_cast<int64_t>(p) * kv_dim + off + 8 * c : 0);
    cp_async16_zfill(slot + (idx / CH) * KS + 8 * c, src, ok, pol);
  }
}
// Row `cur` of the group at base (if it holds it) from kn/vn: fp16-rounded floats, as the cache holds them.
template <int HD>
__device__ __forceinline__ void kv_cur_row(__half* slot, int base, int c1, int cur, const float* kn, const float* vn) {
  constexpr int KS = HD + 8;
  if (cur < base || cur >= base + 32 || cur >= c1) return;  // uniform over the block
  const int r = cur - base;
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    slot[r * KS + i] = __float2half_rn(kn[i]);
    slot[(32 + r) * KS + i] = __float2half_rn(vn[i]);
  }
}

// The tensor-core scratch of the decode attention's block (attend_heads_block): q of the (up to) 8 query
// heads as fp16 hi + lo rows, the group's softmax weights P the same way, the two halves of S and the
// heads' rescaling factors. In floats.
constexpr int dec_tc_floats(int HD) { return 8 * (HD + 8) + 8 * 40 + 2 * 32 * 8 + 8; }

// Decode attention of the G (<= 8) query heads of one KV head over positions [c0, c1) (cache rows kv_dim
// halves apart, the head's dims at `off`) by a block of 8 warps, on the tensor cores. Per group of 32
// positions the block copies their K and V rows to shared memory (coalesced, all loads in flight at once;
// rows padded for ldmatrix), then
//   S = K q^T    (32 positions x 8 heads): warps 0-3, one 16-position tile and half of the dims each;
//   softmax      warp h for head h, lane j for position j (the running max m, sum l and rescale factor);
//   O^T += V^T P^T (head_dim x 8 heads): warp w for dims 16 w .. 16 w + 15, V^T by ldmatrix.trans;
// all on mma.sync m16n8k16 (f16 x f16 -> f32), q and P split into fp16 hi + lo (each product exact to
// ~2^-22, as in the prefill's flash attention; K and V are the fp16 cache values). Heads past G are zero
// rows of q and P. Why: with one query head per warp and a lane per position, the dot products (128
// FMAs, 64 conversions and 48 shared loads per lane and position) and the V accumulation made a group
// issue-bound at ~1.5-2 us (the trace: a slice of 3 groups took ~7 us at 4096 positions).
// Position `cur` (if any) comes from kn/vn (shared memory). ring: kKvRing slots of kv_slot_halves(HD)
// halves, the caller having issued (and committed, one cp.async group each, empty or not) the first
// kKvRing groups of c0 into slots 0, 1, ...; group i is in slot i % kKvRing. With `refill` each step i > 0
// commits one more group (the slot the previous step consumed, refilled with the group kKvRing - 1 ahead,
// or empty); without (the warm pass over the first group) nothing is issued or committed. tc:
// dec_tc_floats(HD) floats. Returns, for the warp's head (h = warp < G), the running max m, normaliser l
// and this lane's dims lane * D .. + D of the unnormalised output.
template <int D, int G, int NW>
__device__ __forceinline__ void attend_heads_block(const float* qs, const __half* kc, const __half* vc, int kv_dim,
                                                   int64_t off, int c0, int c1, int cur, const float* kn,
                                                   const float* vn, __half* ring, bool refill, float* tc,
                                                   float (&m)[1], float (&l)[1], float (&acc)[1][D],
                                                   uint64_t kv_pol = 0) {
  static_assert(G <= 8 && NW == 8, "one 8-column tile of query heads, 8 warps");
  constexpr int HD = D * 32, KS = HD + 8, QP = HD + 8, PP = 40, KSTEPS = HD / 16, KH = KSTEPS / 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  __half* qh = reinterpret_cast<__half*>(tc);  // [8][QP]
  __half* ql = qh + 8 * QP;
  __half* ph = ql + 8 * QP;                    // [8][PP]
  __half* pl = ph + 8 * PP;
  float* sp = reinterpret_cast<float*>(pl + 8 * PP);  // [2][32][8] S of the two dim halves
  float* corr = sp + 2 * 32 * 8;                       // [8]
  // q (scaled) as hi + lo; heads past G: zero rows of q and P, factor 1
  for (int i = threadIdx.x; i < 8 * HD / 2; i += NW * 32) {
    const int h = i / (HD / 2), d = 2 * (i - h * (HD / 2));
    const float2 v = h < G ? *reinterpret_cast<const float2*>(qs + h * HD + d) : make_float2(0.f, 0.f);
    const __half2 hi = __floats2half2_rn(v.x, v.y);
    const float2 r = __half22float2(hi);
    *reinterpret_cast<__half2*>(qh + h * QP + d) = hi;
    *reinterpret_cast<__half2*>(ql + h * QP + d) = __floats2half2_rn(v.x - r.x, v.y - r.y);
  }
  for (int i = threadIdx.x; i < (8 - G) * PP; i += NW * 32) {
    ph[G * PP + i] = __float2half_rn(0.f);
    pl[G * PP + i] = __float2half_rn(0.f);
  }
  if (threadIdx.x >= G && threadIdx.x < 8) corr[threadIdx.x] = 1.f;
  m[0] = -INFINITY;
  l[0] = 0.f;
  float o[4] = {0.f, 0.f, 0.f, 0.f};  // O^T: dims 16 warp + g (+ 8), heads 2t, 2t + 1
  constexpr int SLOT = kv_slot_halves(HD);
  for (int base = c0, i = 0; base < c1; base += 32, ++i) {  // uniform over the block
    __half* kt = ring + (i % kKvRing) * SLOT;
    // this thread's pieces of group i are in: the first kKvRing groups are commits 1 .. kKvRing, the one
    // step i > 0 issues is commit kKvRing + i (group i + kKvRing - 1)
    if (i == 0)
      cp_async_wait<kKvRing - 1>();
    else
      cp_async_wait<kKvRing - 2>();
    kv_cur_row<HD>(kt, base, c1, cur, kn, vn);
    // every piece of the group is in; the previous group's rows and weights are consumed (first: q is
    // written)
    __syncthreads();
    MOE_TRACE_MARK(4);
    if (refill && i > 0) {  // the previous step's slot, with the group kKvRing - 1 after this one
      const int nb = base + 32 * (kKvRing - 1);
      if (nb < c1)
        kv_group_issue<D, NW>(ring + ((i + kKvRing - 1) % kKvRing) * SLOT, kc, vc, kv_dim, off, nb, c1, cur, kv_pol);
      cp_async_commit();
    }
    const int n = min(32, c1 - base);
    if (warp < 4) {  // S: positions 16 (warp & 1) + .., dims of half warp >> 1
      const int mt = warp & 1, kh = warp >> 1;
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < KH; ++j) {
        const int kk = kh * KH + j;
        uint32_t a[4], b[4];
        dev::i8::ldsm_x4(a, kt + (mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * KS + kk * 16 + 8 * (lane >> 4));
        dev::i8::ldsm_x4(b, ((lane >> 4) ? ql : qh) + (lane & 7) * QP + kk * 16 + 8 * ((lane >> 3) & 1));
        h16::mma_f16(sa, a, b[0], b[1]);
        h16::mma_f16(sb, a, b[2], b[3]);
      }
      float* s = sp + (kh * 32 + mt * 16 + g) * 8 + 2 * t;
      *reinterpret_cast<float2*>(s) = make_float2(sa[0] + sb[0], sa[1] + sb[1]);
      *reinterpret_cast<float2*>(s + 64) = make_float2(sa[2] + sb[2], sa[3] + sb[3]);
    }
    __syncthreads();
    if (warp < G) {  // the online softmax of head `warp` over the group
      const bool ok = lane < n;
      const float s = ok ? sp[lane * 8 + warp] + sp[(32 + lane) * 8 + warp] : -INFINITY;
      const float mn = fmaxf(m[0], warp_max(s));  // finite: the group has a position
      const float pw = ok ? expf(s - mn) : 0.f;
      const float cr = expf(m[0] - mn);  // 0 on the first group (m = -inf)
      l[0] = l[0] * cr + warp_sum(pw);
      m[0] = mn;
      const __half hi = __float2half_rn(pw);
      ph[warp * PP + lane] = hi;
      pl[warp * PP + lane] = __float2half_rn(pw - __half2float(hi));
      if (lane == 0) corr[warp] = cr;
    }
    __syncthreads();
    MOE_TRACE_MARK(5);
    if (warp < HD / 16) {  // O^T += V^T P^T for dims 16 warp .. + 15
      const float r0 = corr[2 * t], r1 = corr[2 * t + 1];
      o[0] *= r0;
      o[1] *= r1;
      o[2] *= r0;
      o[3] *= r1;
      const __half* vt = kt + 32 * KS;  // the group's V rows
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[4], b[4];
        h16::ldsm_x4_trans(a, vt + (ks * 16 + (lane & 7) + 8 * (lane >> 4)) * KS + 16 * warp + 8 * ((lane >> 3) & 1));
        dev::i8::ldsm_x4(b, ((lane >> 4) ? pl : ph) + (lane & 7) * PP + ks * 16 + 8 * ((lane >> 3) & 1));
        h16::mma_f16(o, a, b[0], b[1]);
        h16::mma_f16(o, a, b[2], b[3]);
      }
    }
  }
  // O^T to the warp-per-head layout of the caller, through shared memory: q's rows in tc are consumed
  // (8 * (HD + 8) halves of hi and as many of lo, at least 8 * HD floats; P's rows after them are not
  // touched), while the ring still holds the first group's rows for the real pass after a warm one
  __syncthreads();
  float* ot = tc;  // [8][HD]
  if (warp < HD / 16) {
    const int d = 16 * warp + g;
    ot[(2 * t) * HD + d] = o[0];
    ot[(2 * t + 1) * HD + d] = o[1];
    ot[(2 * t) * HD + d + 8] = o[2];
    ot[(2 * t + 1) * HD + d + 8] = o[3];
  }
  __syncthreads();
  if (warp < G) {
#pragma unroll
    for (int d = 0; d < D; ++d) acc[0][d] = ot[warp * HD + lane * D + d];
  }
}

// Per-head RMSNorm (gain) and NEOX RoPE of one head by one warp; out = result * out_scale. Lane l holds
// elements l + 32k of the head in v (norm_rope_load: one load round trip); its RoPE pairs are
// (k, k + HD / 64). cs/sn: cos and sin of the HD / 2 pairs at this position (rope_table).
template <int HD>
__device__ __forceinline__ void norm_rope_load(const float* in, float (&v)[HD / 32]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < HD / 32; ++k) v[k] = __ldcg(in + lane + 32 * k);
}
template <int HD>
__device__ void norm_rope_vals(const float (&v)[HD / 32], const float* gain, const float* cs, const float* sn,
                               float eps, float out_scale, float* out) {
  constexpr int NV = HD / 32, HALF = HD / 2;
  const int lane = threadIdx.x & 31;
  float gw[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) gw[k] = gain[lane + 32 * k];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) ss += v[k] * v[k];
  ss = warp_sum(ss);
  const float scale = rsqrtf(ss / static_cast<float>(HD) + eps);
#pragma unroll
  for (int k = 0; k < NV / 2; ++k) {
    const int i = lane + 32 * k;
    const float a = v[k] * scale * gw[k], b = v[k + NV / 2] * scale * gw[k + NV / 2];
    const float c = cs[i], s = sn[i];
    out[i] = (a * c - b * s) * out_scale;
    out[i + HALF] = (a * s + b * c) * out_scale;
  }
}
template <int HD>
__device__ void norm_rope_warp(const float* in, const float* gain, const float* cs, const float* sn, float eps,
                               float out_scale, float* out) {
  float v[HD / 32];
  norm_rope_load<HD>(in, v);
  norm_rope_vals<HD>(v, gain, cs, sn, eps, out_scale, out);
}

// Decode attention with the per-head Q/K norm, RoPE and KV store fused in: item (kv head g, slice sp)
// of the one new token at position pos0[0]. Every block normalises and rotates the query heads of g
// itself; slice 0 writes this position's K and V to the cache, and the slice that covers the position
// takes them from shared memory (fp16-rounded like the cache), so no block reads a cache row being
// written. Slices merge as in attention_kernel. Block: kDecWarps warps; dynamic shared memory
// dec_smem_floats(G, HD) floats.
constexpr int kDecWarps = 8;
// wacc: the attend phase's ring of K and V rows (kKvRing slots of 64 x (HD + 8) halves), then the merge's
// scratch (kMaxSplit * G floats)
constexpr int dec_wacc_floats(int G, int HD) {
  return kKvRing * kv_slot_halves(HD) / 2 > kMaxSplit * G ? kKvRing * kv_slot_halves(HD) / 2 : kMaxSplit * G;
}
constexpr int dec_smem_floats(int G, int HD) {
  return G * HD + 3 * HD + 2 * kDecWarps * G + dec_wacc_floats(G, HD) + dec_tc_floats(HD);
}
static_assert(kAttLeafMax <= kMergeMax && attention_leaf_groups(kMaxSplit) <= kMergeMax, "two levels merge any split");

// The last slice block's merge of a KV head's n_eff slices (partials at part_base) into out ([G][HD]), or
// with rec into one record of the partials' form (the merged normalised output in fp16, the max M and the
// sum Σ_s L_s exp(m_s - M): a group of the two-level merge); fw: shared memory for kMaxSplit * G floats,
// wl: G. Not inlined: inlined into the item it made ptxas spill registers of the attend phase (the kernel
// is held to 80 registers: three blocks per SM).
template <int HD, int G>
__device__ __noinline__ void merge_slices(const float* part_base, float* out, int n_eff, float* fw, float* wl,
                                          float* rec = nullptr) {
  constexpr int PS = attention_partial_stride(HD), kWarps = kDecWarps;
  // out = Σ_s O_s L_s exp(m_s - M) / Σ_s L_s exp(m_s - M) (O_s the slice's normalised output), in
  // the operations and order of the O projection's merge (stage_load_slices), so that a deferred and a
  // non-deferred merge give the same floats. A thread takes four dims of one head (one 8-byte load per
  // slice), its first kMergeBatch slices' loads issued before the weights are known; a warp per head
  // ranks m_s and chains L_s in registers. (At 4096 positions, 64 slices, the former form, scalar loads
  // 16 at a time and serial loops over shared memory, took ~10 us per layer after the last slice.)
  constexpr int kMergeBatch = 16;
  const int n_items = G * HD / 4;  // at most kWarps * 32 (G <= 8, HD <= 128)
  const int item = threadIdx.x, mh = item / (HD / 4), md = 4 * (item - mh * (HD / 4));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const __half* mp = reinterpret_cast<const __half*>(part_base + mh * PS) + md;
  const int64_t mstride = static_cast<int64_t>(G) * PS * 2;  // halves from one slice to the next
  uint2 mv[kMergeBatch];
  auto merge_load = [&](int s0) {
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i)
      if (item < n_items && s0 + i < n_eff)
        mv[i] = __ldcg(reinterpret_cast<const uint2*>(mp + (s0 + i) * mstride));
  };
  merge_load(0);
  for (int h = warp; h < G; h += kWarps) {
    float m2[2], l2[2], w2[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // lane holds slices lane and lane + 32 (kMergeMax = 64)
      const int s = lane + 32 * u;
      m2[u] = s < n_eff ? __ldcg(part_base + (s * G + h) * PS + HD / 2) : -INFINITY;
      l2[u] = s < n_eff ? __ldcg(part_base + (s * G + h) * PS + HD / 2 + 1) : 0.f;
    }
    const float M = warp_max(fmaxf(m2[0], m2[1]));
#pragma unroll
    for (int u = 0; u < 2; ++u) w2[u] = lane + 32 * u < n_eff ? expf(m2[u] - M) : 0.f;
    float Ls = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_eff; ++s)  // the shuffles issue ahead of the chain
      Ls = fmaf(__shfl_sync(0xffffffffu, s < 32 ? l2[0] : l2[1], s & 31),
                __shfl_sync(0xffffffffu, s < 32 ? w2[0] : w2[1], s & 31), Ls);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (lane + 32 * u < n_eff) fw[(lane + 32 * u) * G + h] = w2[u] * l2[u];
    if (lane == 0) {
      wl[h] = 1.f / Ls;
      if (rec) {
        rec[h * PS + HD / 2] = M;
        rec[h * PS + HD / 2 + 1] = Ls;
      }
    }
  }
  static_assert(kMergeMax <= 64, "two slices per lane in the merge's weights");
  __syncthreads();
  if (item < n_items) {
    float4 a[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) a[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int full = n_eff & ~3;  // slices 4i + c to chain c, those past the last full four to chain 0
    for (int s0 = 0; s0 < n_eff; s0 += kMergeBatch) {
      if (s0) merge_load(s0);
#pragma unroll
      for (int i = 0; i < kMergeBatch; ++i) {
        const int s = s0 + i;
        if (s >= n_eff) break;
        const float ws = fw[s * G + mh];
        const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&mv[i].x));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&mv[i].y));
        auto add = [&](float4& t) {
          t.x = fmaf(lo.x, ws, t.x);
          t.y = fmaf(lo.y, ws, t.y);
          t.z = fmaf(hi.x, ws, t.z);
          t.w = fmaf(hi.y, ws, t.w);
        };
        if (s < full)  // s0 is a multiple of 4: static chain indices (a runtime index costs selects)
          add(a[i & 3]);
        else
          add(a[0]);
      }
    }
    const float inv = wl[mh];
    const float4 r =
        make_float4(((a[0].x + a[1].x) + (a[2].x + a[3].x)) * inv, ((a[0].y + a[1].y) + (a[2].y + a[3].y)) * inv,
                    ((a[0].z + a[1].z) + (a[2].z + a[3].z)) * inv, ((a[0].w + a[1].w) + (a[2].w + a[3].w)) * inv);
    if (rec) {
      const __half2 lo = __floats2half2_rn(r.x, r.y), hi = __floats2half2_rn(r.z, r.w);
      uint2 u;
      u.x = *reinterpret_cast<const uint32_t*>(&lo);
      u.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(reinterpret_cast<__half*>(rec + mh * PS) + md) = u;
    } else {
      *reinterpret_cast<float4*>(out + mh * HD + md) = r;
    }
  }
}

template <int D, int G>
__device__ __forceinline__ void attention_decode_item(int g, int sp, const float* qkv, const int32_t* pos0,
                                                      const float* q_norm, const float* k_norm, float eps,
                                                      const Rope& rope, __half* kc, __half* vc, int n_head_kv,
                                                      int n_split, float* partials, int* counters, float* out_all,
                                                      const float* rope_cs, float* sm, bool wait_prev,
                                                      int min_chunk = kDecMinChunk, int defer = 0,
                                                      bool warm_pass = false, int tree_min = 0, int leaf = 8,
                                                      int kv_evict = 0) {
  constexpr int HD = D * 32, PS = attention_partial_stride(HD), kWarps = kDecWarps;
  static_assert(HD <= kWarps * 32, "a thread per RoPE table entry");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_head = n_head_kv * G, q_dim = n_head * HD, kv_dim = n_head_kv * HD;
  const int pos = pos0[0];
  const int len = pos + 1;
  int chunk;
  const int n_eff = dec_slices(len, n_split, min_chunk, chunk);
  if (sp >= n_eff) return;  // uniform over the block
  // 2 .. defer slices: the O projection merges them (AttSlices, launch.cuh)
  const bool deferred = n_eff > 1 && n_eff <= defer;
  const int c0 = sp * chunk, c1 = min(len, c0 + chunk);
  float* qs = sm;                   // [G][HD], scaled by 1/sqrt(HD)
  float* kn = qs + G * HD;          // this position's K and V (fp16-rounded, as the cache holds them)
  float* vn = kn + HD;
  float* wm = vn + HD;              // [kWarps][G]
  float* wl = wm + kWarps * G;      // [kWarps][G]
  float* wacc = wl + kWarps * G;    // the attend phase's ring of K and V rows, then the merge's scratch
  float* cs = wacc + dec_wacc_floats(G, HD);  // RoPE cos, sin of the HD / 2 pairs (every head uses the same)
  float* sn = cs + HD / 2;
  float* tc = sn + HD / 2;          // the tensor-core scratch (dec_tc_floats; 16-byte aligned: offsets in fours)
  // the token's RoPE table (rope_table) into a register first: loads issued after the ring's copies wait
  // behind their DRAM misses
  const float rc = rope_cs && static_cast<int>(threadIdx.x) < HD ? __ldcg(rope_cs + threadIdx.x) : 0.f;
  // the slice's first kKvRing groups of K/V rows: their copies overlap the norm and RoPE below (and, with
  // programmatic dependent launch, the previous kernel's tail)
  __half* ring = reinterpret_cast<__half*>(wacc);
  const uint64_t kv_pol = l2_evict_first(kv_evict);  // the cache rows evict_first in L2 (kEvictKv)
  for (int s = 0; s < kKvRing; ++s) {
    if (c0 + 32 * s < c1)
      kv_group_issue<D, kWarps>(ring + s * kv_slot_halves(HD), kc, vc, kv_dim, static_cast<int64_t>(g) * HD,
                                c0 + 32 * s, c1, pos, kv_pol);
    cp_async_commit();
  }
  __shared__ bool last;
  const float* row = qkv;
  if (rope_cs) {  // the token's table (rc above; HD <= blockDim)
    if (static_cast<int>(threadIdx.x) < HD) cs[threadIdx.x] = rc;
  } else {
    for (int i = threadIdx.x; i < HD / 2; i += blockDim.x) rope_cos_sin(i, pos, rope, cs[i], sn[i]);
  }
  // everything above reads what was complete before the previous kernel started (the position, the
  // cache rows of earlier positions, the token's RoPE table): with programmatic dependent launch it
  // overlaps the previous kernel's tail; q, k, v below are that kernel's output.
  // Warm pass: before the wait the block runs the same code once over the first group on stale q/k/v
  // (results discarded, nothing written to global memory), so that the instructions are in this SM's
  // caches when the real pass starts (a block of this kernel runs on a cold SM in every layer). One loop
  // body, not a second inlined copy: the same instructions must run twice. Only the first 8 slices of each
  // KV head warm up: the grid's first blocks, which start while the previous kernel runs; at long
  // contexts later ones may start only after it, when a warm pass would delay them.
  constexpr int HPW = (G + kWarps - 1) / kWarps;
  float m[HPW], l[HPW], acc[HPW][D];
  const bool kv_warp = warp == kWarps - 1;
#pragma unroll 1
  for (int pass = wait_prev && warm_pass && sp < 8 ? 0 : 1; pass < 2; ++pass) {
    const bool warm = pass == 0;
    if (!warm) {
      if (wait_prev) pdl_sync();
      MOE_TRACE_MARK(1);
    }
    __syncthreads();
    // the last warp also normalises and stores this position's K and V: their loads go out with its query
    // head's, so that the warp waits for one round trip, not three
    float kv_k[HD / 32], kv_v[HD / 32];
    if (kv_warp) {
      norm_rope_load<HD>(row + q_dim + g * HD, kv_k);
      norm_rope_load<HD>(row + q_dim + kv_dim + g * HD, kv_v);
    }
    for (int h = warp; h < G; h += kWarps)
      norm_rope_warp<HD>(row + (g * G + h) * HD, q_norm, cs, sn, eps, rsqrtf(static_cast<float>(HD)), qs + h * HD);
    if (kv_warp) {
      norm_rope_vals<HD>(kv_k, k_norm, cs, sn, eps, 1.f, kn);
      __syncwarp();
#pragma unroll
      for (int c = 0; c < HD / 32; ++c) {
        const int i = lane + 32 * c;
        const __half kh = __float2half_rn(kn[i]), vh = __float2half_rn(kv_v[c]);
        kn[i] = __half2float(kh);
        vn[i] = __half2float(vh);
        if (sp == 0 && !warm) {
          kc[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = kh;
          vc[static_cast<int64_t>(pos) * kv_dim + g * HD + i] = vh;
        }
      }
    }
    __syncthreads();
    MOE_TRACE_MARK(2);
    // the warm pass covers the first group only and issues or commits nothing: the ring still holds the
    // first group's rows (its `cur` row rewritten) for the real pass
    attend_heads_block<D, G, kWarps>(qs, kc, vc, kv_dim, g * HD, c0, warm ? min(c1, c0 + 32) : c1, pos, kn, vn, ring,
                                     !warm, tc, m, l, acc, kv_pol);
  }
  float* part_base = partials + static_cast<int64_t>(g) * n_split * G * PS;
  float* part = part_base + sp * G * PS;
  float* out = out_all + g * G * HD;
#pragma unroll
  for (int hi = 0; hi < HPW; ++hi) {
    const int h = warp + kWarps * hi;
    if (h >= G) break;
    if (n_eff == 1) {
#pragma unroll
      for (int d = 0; d < D; ++d) out[h * HD + lane * D + d] = acc[hi][d] / l[hi];
    } else {  // the normalised output in fp16, then m and L (launch.cuh: AttSlices)
      __half* ph = reinterpret_cast<__half*>(part + h * PS) + lane * D;
      const float il = 1.f / l[hi];
#pragma unroll
      for (int d = 0; d < D; d += 2)
        *reinterpret_cast<__half2*>(ph + d) = __floats2half2_rn(acc[hi][d] * il, acc[hi][d + 1] * il);
      if (lane == 0) {
        part[h * PS + HD / 2] = m[hi];
        part[h * PS + HD / 2 + 1] = l[hi];
      }
    }
  }
  MOE_TRACE_MARK(3);
  if (n_eff == 1 || deferred) {
    __syncthreads();
    return;
  }
  // every thread's partials, then one acquire-release add by thread 0 (the barrier orders the block's
  // writes before it; the last block's barrier orders its reads after it): a gpu-scope fence in every
  // thread before the add, and another in the last block, cost ~1 us per block (trace at 4096)
  __syncthreads();
  // thread 0's add to counter c of n arrivals: whether this block is the last (which resets it)
  auto arrive = [&](int* c, int n) {
    if (threadIdx.x == 0) {
      int prev;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(c) : "memory");
      last = prev == n - 1;
      if (last) *c = 0;  // every block of the launch has added
    }
    __syncthreads();
    return last;
  };
  if ((tree_min > 0 && n_eff >= tree_min) || n_eff > kMergeMax) {  // two levels (launch.cuh: attention_leaf)
    const int lg = attention_leaf_groups(n_split), n_grp = (n_eff + leaf - 1) / leaf;
    const int q = sp / leaf, s0 = q * leaf;
    float* grp_base = partials + (static_cast<int64_t>(n_head_kv) * n_split + static_cast<int64_t>(g) * lg) * G * PS;
    if (!arrive(counters + n_head_kv + g * lg + q, min(leaf, n_eff - s0))) return;
    merge_slices<HD, G>(part_base + static_cast<int64_t>(s0) * G * PS, nullptr, min(leaf, n_eff - s0), wacc, wl,
                        grp_base + static_cast<int64_t>(q) * G * PS);
    __syncthreads();  // the group's record is written (before thread 0's release)
    if (!arrive(counters + g, n_grp)) return;
    merge_slices<HD, G>(grp_base, out, n_grp, wacc, wl);
    __syncthreads();
    return;
  }
  if (!arrive(counters + g, n_eff)) return;
  merge_slices<HD, G>(part_base, out, n_eff, wacc, wl);
  __syncthreads();
}

}  // namespace moe::cuda::k::att
