// The fp16 path of the K-quant prefill GEMMs (gemm_kq.cu, top comment; h16 in mma.cuh): its shared
// memory, the split of the activations into records (split_record, split_h16_kernel) and the stage
// products on the fp16 MMA.
// Included by gemm_kq.cu only (its definitions live in an anonymous namespace).
#pragma once
#include "common.cuh"
#include "gemm.cuh"
#include "gemm_kq_common.cuh"
#include "mma.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

using namespace dev::i8;

// Shared memory of the fp16 path (Q4_K, Q5_K, Q6_K; shapes where it fits): as ISmem, with a stage's
// activations as the tokens' split records (h16::kRec4, kPitch4 apart) and no landing area.
template <class S, uint32_t T>
struct HSmem {
  using Q = QT<T>;
  static constexpr size_t W = static_cast<size_t>(S::BMV) * Q::PITCH;
  static constexpr size_t ACT = static_cast<size_t>(S::BN) * h16::kPitch4 * 16;
  static constexpr size_t LAND = 0;
  static constexpr size_t FIXED = 2 * W + 2 * ACT;
  static constexpr size_t bytes(int n_e) { return FIXED + (4 * (3 * static_cast<size_t>(n_e) + 1) + 16 + 15) / 16 * 16; }
  static constexpr size_t MAX = bytes(S::GROUPED ? 512 : 1);
};
// Whether HSmem<S, T> fits S::MIN_BLOCKS blocks per SM (sm_90: 227 KB per block, 228 KB per SM with
// 1 KB reserved per block).
template <class S, uint32_t T>
constexpr bool h_fits = HSmem<S, T>::MAX <= 232448 && S::MIN_BLOCKS * (HSmem<S, T>::MAX + 1024) <= 233472;

// The fp16 path's products of one stage (one super-block of every row) of Q4_K/Q5_K into acc (see
// h16 in mma.cuh): A = (q - o) sc per sub-block, o = 8 (Q4_K) or 16 (Q5_K) so that the codes are
// centred (the tensor cores truncate their fp32 sums: with codes of one sign the running sum, and
// its error, would grow with the sum of |x|), from the magic pair by two exact f16x2 steps; the
// eight slices accumulate in D through the MMAs (lo part first); then per output
// acc += (d D + o d Ds - dmin Dm) / f of the token, with Ds = sum_j sc_j S_j and Dm = sum_j m_j S_j
// over the slice sums S_j by tf32 MMAs as in stage_kq.
// FULL: nj == S::NJ (straight-line code, no branch between the A builds and the MMAs).
template <class S, uint32_t T, bool FULL>
__device__ __forceinline__ void stage_kq_h(const uint8_t* Ws, const uint8_t* act, int nj, float (&acc)[S::MT][S::NJ][4]) {
  using Q = QT<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint4* bh = reinterpret_cast<const uint4*>(act);
  auto rec = [&](int n) { return bh + n * h16::kPitch4; };
  const uint8_t* lrow[S::MT];
  uint32_t scw[S::MT][2][2];  // rows g, g + 8: 6-bit scales of sub-blocks 0-3 and 4-7 as bytes
  float dd[S::MT][2];
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    lrow[i] = Ws + (S::vrow(warp, i) + ldsm_row(lane)) * Q::PITCH + ldsm_byte(lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 hd = *reinterpret_cast<const uint4*>(Ws + (S::vrow(warp, i) + g + 8 * h) * Q::PITCH);
      uint32_t mn[2];
      kq_scales(hd.y, hd.z, hd.w, scw[i][h], mn);
      dd[i][h] = half_lo(hd.x);
    }
  }
  uint32_t qh[S::MT][4] = {};
  if constexpr (T == layout::Q5_K) {
#pragma unroll
    for (int i = 0; i < S::MT; ++i) ldsm_x4(qh[i], lrow[i] + Q::QH);
  }
  float D[S::MT][S::NJ][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int n = 0; n < S::NJ; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) D[i][n][e] = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {  // 32 bytes of codes: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    uint32_t qw[S::MT][4];
#pragma unroll
    for (int i = 0; i < S::MT; ++i) ldsm_x4(qw[i], lrow[i] + Q::QS + 32 * c);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int j = 2 * c + hi;
      uint32_t A[S::MT][2][4];  // [tile][16-column step][register]
#pragma unroll
      for (int i = 0; i < S::MT; ++i) {
        uint32_t sc2[2];  // rows g, g + 8: (sc, sc) (Q4_K high nibbles: sc / 16)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t s2 = h16::hsub2_u(h16::magic_scale2(scw[i][h][j >> 2], j & 3), 0x64006400u);
          sc2[h] = T == layout::Q4_K && hi ? h16::hmul2_u(s2, 0x2C002C00u) : s2;  // 1/16
        }
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          uint32_t w[2];  // rows g, g + 8: columns 16 st + 4t..+3 of the slice
          uint32_t mask;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (T == layout::Q4_K) w[h] = qw[i][2 * st + h];
            else w[h] = q5k_codes(qw[i][2 * st + h], qh[i][2 * st + h], j, hi);
          }
          uint32_t off;  // the magic pair of the middle code: 1024 + 8, 1024 + 16 * 8, 1024 + 16
          if constexpr (T == layout::Q4_K) mask = hi ? 0x00F000F0u : 0x000F000Fu, off = hi ? 0x64806480u : 0x64086408u;
          else mask = 0x001F001Fu, off = 0x64106410u;
          A[i][st][0] = h16::hmul2_u(h16::hsub2_u(h16::magic_pair(w[0], mask), off), sc2[0]);
          A[i][st][1] = h16::hmul2_u(h16::hsub2_u(h16::magic_pair(w[1], mask), off), sc2[1]);
          A[i][st][2] = h16::hmul2_u(h16::hsub2_u(h16::magic_pair(w[0] >> 8, mask), off), sc2[0]);
          A[i][st][3] = h16::hmul2_u(h16::hsub2_u(h16::magic_pair(w[1] >> 8, mask), off), sc2[1]);
        }
      }
#pragma unroll
      for (int st = 0; st < 2; ++st) {
        uint4 b[S::NJ];
#pragma unroll
        for (int n = 0; n < S::NJ; ++n)
          if (FULL || n < nj) b[n] = bh[h16::bh_index(8 * n + g, st, j, t)];
        // The lo parts of every tile, then the hi parts: an accumulator's next MMA is MT * nj - 1
        // MMAs later (each accumulator still sees lo before hi, step 0 before step 1).
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int n = 0; n < S::NJ; ++n) {
            if (!FULL && n >= nj) break;
#pragma unroll
            for (int i = 0; i < S::MT; ++i)
              h16::mma_f16(D[i][n], A[i][st], p ? b[n].x : b[n].z, p ? b[n].y : b[n].w);
          }
      }
    }
  }
  // The codes' offsets and the minimums: Ds = sum_j sc_j S_j and Dm = sum_j m_j S_j over the slice
  // sums S_j, each by three tf32 MMAs (A exact: 6-bit integers).
  uint32_t am[S::MT][4], as[S::MT][4];
  float dmin[S::MT][2];
  min_operands<S, T>(Ws, am, dmin);
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    as[i][0] = f2u(small_u2f(byte_u(scw[i][0][0], t)));
    as[i][1] = f2u(small_u2f(byte_u(scw[i][1][0], t)));
    as[i][2] = f2u(small_u2f(byte_u(scw[i][0][1], t)));
    as[i][3] = f2u(small_u2f(byte_u(scw[i][1][1], t)));
  }
  constexpr float kOff = T == layout::Q4_K ? 8.f : 16.f;
#pragma unroll
  for (int n = 0; n < S::NJ; ++n) {
    if (!FULL && n >= nj) break;
    const uint4 x = rec(8 * n + g)[h16::kRecXs + t];
    const uint2 x2 = reinterpret_cast<const uint2*>(reinterpret_cast<const float*>(rec(8 * n + g)) + h16::kRecXs2)[t];
    const float2 ti = make_float2(reinterpret_cast<const float*>(rec(8 * n + 2 * t))[h16::kRecInv],
                                  reinterpret_cast<const float*>(rec(8 * n + 2 * t + 1))[h16::kRecInv]);
#pragma unroll
    for (int i = 0; i < S::MT; ++i) {
      float Dm[4] = {0.f, 0.f, 0.f, 0.f}, Ds[4] = {0.f, 0.f, 0.f, 0.f};
      mma_tf32(Dm, am[i], x2.x, x2.y);
      mma_tf32(Dm, am[i], x.z, x.w);
      mma_tf32(Dm, am[i], x.x, x.y);
      mma_tf32(Ds, as[i], x2.x, x2.y);
      mma_tf32(Ds, as[i], x.z, x.w);
      mma_tf32(Ds, as[i], x.x, x.y);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float d = dd[i][e >> 1];
        const float v = fma_rn(d, D[i][n][e], fma_rn(kOff * d, Ds[e], mul_rn(-dmin[i][e >> 1], Dm[e])));
        acc[i][n][e] = fma_rn(v, (e & 1) ? ti.y : ti.x, acc[i][n][e]);
      }
    }
  }
}

// The fp16 path's products of one stage of Q6_K into acc: A = q - 32 (exact; q6k codes under the
// fp16 exponent of 1024, then one exact subtraction), the 16-column step's two MMAs (lo, hi) from
// zero, then Ds += sc * D per step in fp32 (sc, an int8 per 16 columns, times q - 32 would not always
// fit fp16's 11 bits); per output acc += d Ds / f of the token.
template <class S>
__device__ __forceinline__ void stage_q6k_h(const uint8_t* Ws, const uint8_t* act, int nj, float (&acc)[S::MT][S::NJ][4]) {
  using Q = QT<layout::Q6_K>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint4* bh = reinterpret_cast<const uint4*>(act);
  const uint8_t* lrow[S::MT];
  uint4 scv[S::MT][2];  // rows g, g + 8: the 16 int8 scales
  float dd[S::MT][2];
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    lrow[i] = Ws + (S::vrow(warp, i) + ldsm_row(lane)) * Q::PITCH + ldsm_byte(lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* row = Ws + (S::vrow(warp, i) + g + 8 * h) * Q::PITCH;
      scv[i][h] = *reinterpret_cast<const uint4*>(row + Q::SC);
      dd[i][h] = half_lo(*reinterpret_cast<const uint32_t*>(row + Q::D));
    }
  }
  float Ds[S::MT][S::NJ][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int n = 0; n < S::NJ; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) Ds[i][n][e] = 0.f;
  q6k_walk<S>(lrow, [&](int n_, int k, int hi, const uint32_t (&ql)[S::MT][4], const uint32_t (&qh)[S::MT][4]) {
        const int j = 4 * n_ + k;
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          uint32_t A[S::MT][4];
          float sc[S::MT][2];  // rows g, g + 8: the step's scale
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            uint32_t w[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t q = ((ql[i][2 * st + h] >> (4 * hi)) & 0x0F0F0F0Fu) | (((qh[i][2 * st + h] >> (2 * k)) & 0x03030303u) << 4);
              w[h] = q;
              const int si = 8 * n_ + 2 * k + st;
              sc[i][h] = static_cast<float>(byte_s(word_of(scv[i][h], si >> 2), si & 3));
            }
            A[i][0] = h16::hsub2_u(h16::magic_pair(w[0], 0x003F003Fu), 0x64206420u);
            A[i][1] = h16::hsub2_u(h16::magic_pair(w[1], 0x003F003Fu), 0x64206420u);
            A[i][2] = h16::hsub2_u(h16::magic_pair(w[0] >> 8, 0x003F003Fu), 0x64206420u);
            A[i][3] = h16::hsub2_u(h16::magic_pair(w[1] >> 8, 0x003F003Fu), 0x64206420u);
          }
          // Tiles in groups of NG: each tile's lo part, then the hi parts, then the scale (independent
          // MMAs side by side; NG bounds the live accumulators).
          constexpr int NG = S::NJ < 2 ? S::NJ : 2;
#pragma unroll
          for (int n0 = 0; n0 < S::NJ; n0 += NG) {
            if (n0 >= nj) break;
            uint4 b[NG];
            float D[S::MT][NG][4];
#pragma unroll
            for (int u = 0; u < NG; ++u) {
              if (n0 + u < nj) b[u] = bh[h16::bh_index(8 * (n0 + u) + g, st, j, t)];
#pragma unroll
              for (int i = 0; i < S::MT; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) D[i][u][e] = 0.f;
            }
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
              for (int u = 0; u < NG; ++u) {
                if (n0 + u >= nj) break;
#pragma unroll
                for (int i = 0; i < S::MT; ++i) h16::mma_f16(D[i][u], A[i], p ? b[u].x : b[u].z, p ? b[u].y : b[u].w);
              }
#pragma unroll
            for (int u = 0; u < NG; ++u) {
              if (n0 + u >= nj) break;
#pragma unroll
              for (int i = 0; i < S::MT; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) Ds[i][n0 + u][e] = fma_rn(sc[i][e >> 1], D[i][u][e], Ds[i][n0 + u][e]);
            }
          }
        }
  });
#pragma unroll
  for (int n = 0; n < S::NJ; ++n) {
    if (n >= nj) break;
    const uint4* r0 = bh + (8 * n + 2 * t) * h16::kPitch4;
    const float ti0 = reinterpret_cast<const float*>(r0)[h16::kRecInv];
    const float ti1 = reinterpret_cast<const float*>(r0 + h16::kPitch4)[h16::kRecInv];
#pragma unroll
    for (int i = 0; i < S::MT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[i][n][e] = fma_rn(mul_rn(dd[i][e >> 1], Ds[i][n][e]), (e & 1) ? ti1 : ti0, acc[i][n][e]);
  }
}

// The fp16 path's split of one token's super-block into its record rec (see h16 in mma.cuh), by a
// whole warp: lane 4 j + t holds columns 4t..4t+3 and 16+4t..16+4t+3 of slice j in x; the factor
// comes from the super-block's max|x| (all 32 lanes), each pair of columns (4t, 4t+2), (4t+1, 4t+3)
// goes out as fp16 hi and lo, the slice's sum of hi + lo (for the minimums and the codes' offsets) as
// three tf32 parts, and 1 / f.
__device__ __forceinline__ void split_record(uint4* rec, const float (&x)[8]) {
  const int lane = threadIdx.x & 31, j = lane >> 2, t = lane & 3;
  uint32_t mb = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) mb = max(mb, abs_bits(x[e]));
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  const h16::TokScale f = h16::token_scale(mb);
  float sum = 0.f;
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    float y[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) y[e] = mul_rn(x[4 * st + e], f.f);
    const uint32_t h0 = h16::pack_h2(y[0], y[2]), h1 = h16::pack_h2(y[1], y[3]);
    const float2 u0 = h16::unpack_h2(h0), u1 = h16::unpack_h2(h1);
    const uint32_t l0 = h16::pack_h2(add_rn(y[0], -u0.x), add_rn(y[2], -u0.y));
    const uint32_t l1 = h16::pack_h2(add_rn(y[1], -u1.x), add_rn(y[3], -u1.y));
    const float2 v0 = h16::unpack_h2(l0), v1 = h16::unpack_h2(l1);
    sum = add_rn(sum, add_rn(add_rn(u0.x, v0.x), add_rn(u1.x, v1.x)));
    sum = add_rn(sum, add_rn(add_rn(u0.y, v0.y), add_rn(u1.y, v1.y)));
    rec[32 * st + 4 * j + t] = make_uint4(h0, h1, l0, l1);
  }
  sum = add_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
  sum = add_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
  float* rf = reinterpret_cast<float*>(rec);
  if (t == 0) {
    uint32_t hi, mid, lo;
    split3_tf32(sum, hi, mid, lo);
    rf[4 * h16::kRecXs + xs_word(j, 0)] = u2f(hi);
    rf[4 * h16::kRecXs + xs_word(j, 1)] = u2f(mid);
    rf[h16::kRecXs2 + xs2_word(j)] = u2f(lo);
  }
  if (lane == 0) rf[h16::kRecInv] = f.inv;
}

// X (rows x cols, cols a multiple of 256) into records [row][super-block]: one warp per record.
__global__ void __launch_bounds__(256) split_h16_kernel(const float* X, int x_stride, int rows, int cols, uint4* out) {
  const int n_sb = cols / KS;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (w >= static_cast<int64_t>(rows) * n_sb) return;
  const int r = static_cast<int>(w / n_sb), sb = static_cast<int>(w % n_sb), lane = threadIdx.x & 31;
  const float* src = X + static_cast<int64_t>(r) * x_stride + sb * KS + 32 * (lane >> 2) + 4 * (lane & 3);
  const float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 16);
  const float x[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
  split_record(out + w * h16::kRec4, x);
}

// rmsnorm_rows's output (same floats: same loop and block sum) and its split records, one row per
// block of 256 threads; warp w splits super-blocks w, w + 8, ... of the row from the written output
// (visible to the block after the barrier).
__global__ void __launch_bounds__(256) rmsnorm_split_kernel(const float* x, const float* w, int cols, int stride, float eps,
                                                            float* out, uint4* rec) {
  __shared__ float red[32];
  float* o = out + static_cast<int64_t>(blockIdx.x) * stride;
  rmsnorm_row(x + static_cast<int64_t>(blockIdx.x) * stride, w, cols, eps, o, red);
  __syncthreads();
  const int n_sb = cols / KS, lane = threadIdx.x & 31;
  for (int sb = threadIdx.x >> 5; sb < n_sb; sb += blockDim.x >> 5) {
    const float* src = o + sb * KS + 32 * (lane >> 2) + 4 * (lane & 3);
    const float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 16);
    const float xv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    split_record(rec + (static_cast<int64_t>(blockIdx.x) * n_sb + sb) * h16::kRec4, xv);
  }
}

}  // namespace
}  // namespace moe::cuda::k
