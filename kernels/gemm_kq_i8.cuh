// The integer path of the K-quant prefill GEMMs (gemm_kq.cu, top comment): its shared memory, the
// activations' 24-bit digits (quant_x_i8) and the stage products on the integer MMA.
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

// Shared memory of shape S and type T: two stages of weight rows, two of staged activations (digit
// B registers, slice scales, for the minimums the slice sums), the activations' landing area, then
// the item table (3 n_e + 1 ints) and the dynamic walk's ring of 4 items.
template <class S, uint32_t T>
struct ISmem {
  using Q = QT<T>;
  static constexpr size_t W = static_cast<size_t>(S::BMV) * Q::PITCH;
  // KST: the slice scales are stored with their digit_offset (shapes of one block per SM; with two
  // blocks the 1 KB per stage does not fit, and the offsets are computed where used).
  static constexpr bool KST = S::MIN_BLOCKS == 1;
  // Slice scales: [slice][token] floats (KST: {ts, offset} pairs), rows TSP floats apart (two or four
  // more than needed, so the quantizing lanes of one token, one per slice, store to different banks,
  // and a lane's two tokens stay 8- or 16-byte aligned).
  static constexpr int TSP = KST ? 2 * S::BN + 4 : S::BN + 2;
  static constexpr size_t BQ = S::BN * 512, BC = S::BN * 256, TS = 8 * TSP * 4, XS = Q::MIN ? S::BN * 96 : 0;
  static constexpr size_t ACT = BQ + BC + TS + XS;
  static constexpr size_t LAND = S::BN * 1024;
  static constexpr size_t FIXED = 2 * W + 2 * ACT + LAND;
  static constexpr size_t bytes(int n_e) { return FIXED + (4 * (3 * static_cast<size_t>(n_e) + 1) + 16 + 15) / 16 * 16; }
  // The largest launch: the full item table (grouped) or one entry (dense).
  static constexpr size_t MAX = bytes(S::GROUPED ? 512 : 1);
  // sm_90: 227 KB per block, 228 KB per SM with 1 KB reserved per block.
  static_assert(MAX <= 232448 && S::MIN_BLOCKS * (MAX + 1024) <= 233472, "shared memory for MIN_BLOCKS blocks");
};

// The staged activations of one stage (see ISmem).
template <class S, uint32_t T>
struct ActView {
  using M = ISmem<S, T>;
  uint4* bq;   // digits a, b (bq_index)
  uint2* bc;   // digit c (bc_index)
  float* ts;   // slice scales [slice][token] (KST: {ts, offset} pairs)
  uint4* xs;   // minimums: slice sums hi, mid (xs_index)
  uint2* xs2;  // and lo
  __device__ __forceinline__ explicit ActView(const uint8_t* act)
      : bq(reinterpret_cast<uint4*>(const_cast<uint8_t*>(act))),
        bc(reinterpret_cast<uint2*>(const_cast<uint8_t*>(act) + M::BQ)),
        ts(reinterpret_cast<float*>(const_cast<uint8_t*>(act) + M::BQ + M::BC)),
        xs(reinterpret_cast<uint4*>(const_cast<uint8_t*>(act) + M::BQ + M::BC + M::TS)),
        xs2(reinterpret_cast<uint2*>(const_cast<uint8_t*>(act) + M::BQ + M::BC + M::TS + S::BN * 64)) {}
  // Tokens 8 n + 2t and + 1 of slice j: their scales ts and offsets k (digit_offset).
  __device__ __forceinline__ void scales(int j, int n, int t, float (&s)[2], float (&k)[2]) const {
    if constexpr (M::KST) {
      const float4 v = *reinterpret_cast<const float4*>(ts + j * M::TSP + 2 * (8 * n + 2 * t));
      s[0] = v.x, k[0] = v.y, s[1] = v.z, k[1] = v.w;
    } else {
      const float2 v = *reinterpret_cast<const float2*>(ts + j * M::TSP + 8 * n + 2 * t);
      s[0] = v.x, s[1] = v.y;
      k[0] = digit_offset(v.x), k[1] = digit_offset(v.y);
    }
  }
};

// The products of slice j of a stage (sub-block j of every row; the warp's codes in A) with the
// activations of its first nj n8 token tiles, into acc: per m16 x n8 tile the three digit MMAs, then
// per output acc = fma(row scale, digit_value, acc) (see the top comment). NH: row scales per slice,
// one for Q4_K/Q5_K (k32 MMAs on all 32 columns), two for Q6_K (k16 MMAs on the halves, columns
// [0, 16) in A[i][0..1] and [16, 32) in A[i][2..3]; the halves are added into acc in that order).
// rs[i][h][f]: the row scale of row g + 8h of tile i for half f.
template <class S, uint32_t T, int NH = (T == layout::Q6_K ? 2 : 1)>
__device__ __forceinline__ void slice_products(const ActView<S, T>& av, int j, int nj, const uint32_t (&A)[S::MT][4],
                                               const float (&rs)[S::MT][2][NH], float (&acc)[S::MT][S::NJ][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < S::NJ; ++n) {
    if (n >= nj) break;
    const uint4 b = av.bq[bq_index(8 * n + g, j, t)];
    const uint2 bc = av.bc[bc_index(8 * n + g, j, t)];
    float ts[2], k[2];
    av.scales(j, n, t, ts, k);
#pragma unroll
    for (int i = 0; i < S::MT; ++i) {
      uint32_t da[NH][4], db[NH][4], dc[NH][4];
      if constexpr (NH == 1) {
        mma_k32(da[0], A[i], b.x, b.y, kMagicA);
        mma_k32(db[0], A[i], b.z, b.w, kMagicB);
        mma_k32(dc[0], A[i], bc.x, bc.y, kMagicC);
      } else {
        mma_k16(da[0], A[i][0], A[i][1], b.x, kMagicA);
        mma_k16(db[0], A[i][0], A[i][1], b.z, kMagicB);
        mma_k16(dc[0], A[i][0], A[i][1], bc.x, kMagicC);
        mma_k16(da[1], A[i][2], A[i][3], b.y, kMagicA);
        mma_k16(db[1], A[i][2], A[i][3], b.w, kMagicB);
        mma_k16(dc[1], A[i][2], A[i][3], bc.y, kMagicC);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = acc[i][n][e];
#pragma unroll
        for (int f = 0; f < NH; ++f)
          v = fma_rn(rs[i][e >> 1][f], digit_value(da[f][e], db[f][e], dc[f][e], ts[e & 1], k[e & 1]), v);
        acc[i][n][e] = v;
      }
    }
  }
}

// The products of one stage (one super-block of every row) of Q4_K/Q5_K into acc.
template <class S, uint32_t T>
__device__ __forceinline__ void stage_kq(const uint8_t* Ws, const uint8_t* act, int nj, float (&acc)[S::MT][S::NJ][4]) {
  using Q = QT<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const ActView<S, T> av(act);
  const uint8_t* lrow[S::MT];  // this lane's ldmatrix row
  uint32_t scw[S::MT][2][2];   // rows g, g + 8: 6-bit scales of sub-blocks 0-3 and 4-7 as bytes
  float dd[S::MT][2], nd[S::MT][2];
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    lrow[i] = Ws + (S::vrow(warp, i) + ldsm_row(lane)) * Q::PITCH + ldsm_byte(lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 hd = *reinterpret_cast<const uint4*>(Ws + (S::vrow(warp, i) + g + 8 * h) * Q::PITCH);
      uint32_t mn[2];
      kq_scales(hd.y, hd.z, hd.w, scw[i][h], mn);
      dd[i][h] = half_lo(hd.x);
      nd[i][h] = -dd[i][h] * kMagic;
    }
  }
  uint32_t qh[S::MT][4] = {};  // Q5_K: the fifth bits (bit j of byte l: element l of sub-block j)
  if constexpr (T == layout::Q5_K) {
#pragma unroll
    for (int i = 0; i < S::MT; ++i) ldsm_x4(qh[i], lrow[i] + Q::QH);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {  // 32 bytes of nibbles: sub-blocks 2c (low) and 2c + 1 (high)
    uint32_t qw[S::MT][4];
#pragma unroll
    for (int i = 0; i < S::MT; ++i) ldsm_x4(qw[i], lrow[i] + Q::QS + 32 * c);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int j = 2 * c + hi;  // the sub-block, and the activations' slice
      uint32_t A[S::MT][4];
      float rs[S::MT][2][1];  // d * sc of rows g, g + 8 (exact small integer sc, one rounding)
#pragma unroll
      for (int i = 0; i < S::MT; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if constexpr (T == layout::Q4_K) A[i][r] = q4k_codes(qw[i][r], hi);
          else A[i][r] = q5k_codes(qw[i][r], qh[i][r], j, hi);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
          rs[i][h][0] = scaled_int(dd[i][h], kMagicBits + byte_u(scw[i][h][j >> 2], j & 3), nd[i][h]);
      }
      slice_products(av, j, nj, A, rs, acc);
    }
  }
  // The minimums: acc -= dmin * sum_j m_j * s_j * (sum of X over slice j), the sum over j by tf32
  // MMAs with A = m (exact) and B = the slice sums split in hi + mid + lo.
  uint32_t am[S::MT][4];
  float dmin[S::MT][2];
  min_operands<S, T>(Ws, am, dmin);
#pragma unroll
  for (int n = 0; n < S::NJ; ++n) {
    if (n >= nj) break;
    const uint4 x = av.xs[xs_index(8 * n + g, t)];
    const uint2 x2 = av.xs2[xs_index(8 * n + g, t)];
#pragma unroll
    for (int i = 0; i < S::MT; ++i) {
      float D[4] = {0.f, 0.f, 0.f, 0.f};
      mma_tf32(D, am[i], x2.x, x2.y);
      mma_tf32(D, am[i], x.z, x.w);
      mma_tf32(D, am[i], x.x, x.y);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][n][e] = fma_rn(-dmin[i][e >> 1], D[e], acc[i][n][e]);
    }
  }
}

// The products of one stage of Q6_K into acc. Group j = 4 n_ + k of the super-block (32 columns) has
// two scales, for its columns [0, 16) and [16, 32): k16 MMAs, three per digit register pair.
template <class S>
__device__ __forceinline__ void stage_q6k(const uint8_t* Ws, const uint8_t* act, int nj, float (&acc)[S::MT][S::NJ][4]) {
  using Q = QT<layout::Q6_K>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  const ActView<S, layout::Q6_K> av(act);
  const uint8_t* lrow[S::MT];
  uint4 scv[S::MT][2];  // rows g, g + 8: the 16 int8 scales
  float dd[S::MT][2], nd[S::MT][2];
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    lrow[i] = Ws + (S::vrow(warp, i) + ldsm_row(lane)) * Q::PITCH + ldsm_byte(lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* row = Ws + (S::vrow(warp, i) + g + 8 * h) * Q::PITCH;
      scv[i][h] = *reinterpret_cast<const uint4*>(row + Q::SC);
      dd[i][h] = half_lo(*reinterpret_cast<const uint32_t*>(row + Q::D));
      nd[i][h] = -dd[i][h] * kMagic;
    }
  }
  q6k_walk<S>(lrow, [&](int n_, int k, int hi, const uint32_t (&ql)[S::MT][4], const uint32_t (&qh)[S::MT][4]) {
        const int j = 4 * n_ + k;
        uint32_t A[S::MT][4];
        float rs[S::MT][2][2];  // [tile][row g, g + 8][columns 0-15, 16-31]: d * scale
#pragma unroll
        for (int i = 0; i < S::MT; ++i) {
#pragma unroll
          for (int r = 0; r < 4; ++r) A[i][r] = q6k_codes(ql[i][r], qh[i][r], k, hi);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int f = 0; f < 2; ++f) {
              const int si = 8 * n_ + 2 * k + f;
              rs[i][h][f] = scaled_int(dd[i][h], kMagicBits + static_cast<uint32_t>(byte_s(word_of(scv[i][h], si >> 2), si & 3)),
                                       nd[i][h]);
            }
        }
        slice_products(av, j, nj, A, rs, acc);
  });
}

// The integer path's staging of one token n of a stage: lane 4 j + t quantizes its eight columns of
// slice j (see dev::i8 and the top comment).
template <class S, uint32_t T>
__device__ __forceinline__ void quant_x_i8(uint8_t* act, int n, const float (&x)[8]) {
  using Q = QT<T>;
  using M = ISmem<S, T>;
  const int lane = threadIdx.x & 31, j = lane >> 2, t = lane & 3;
  const ActView<S, T> av(act);
  uint32_t mb = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) mb = max(mb, abs_bits(x[e]));
  mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
  mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
  const Scale sc = slice_scale(mb);
  const Digits q = quant8(x, sc.inv);
  av.bq[bq_index(n, j, t)] = make_uint4(q.a0, q.a1, q.b0, q.b1);
  av.bc[bc_index(n, j, t)] = make_uint2(q.c0, q.c1);
  if (t == 0) {
    if constexpr (M::KST) *reinterpret_cast<float2*>(av.ts + j * M::TSP + 2 * n) = make_float2(sc.ts, digit_offset(sc.ts));
    else av.ts[j * M::TSP + n] = sc.ts;
  }
  if constexpr (Q::MIN) {
    // The quantized slice's sum, so that the minimums meet the same activations as the codes
    // (with the exact sum the rounding errors of X would be weighted by d * sc * q, up to twice
    // the weight itself, instead of by the weight).
    int sum = q.sum;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (t == 0) {
      uint32_t hi, mid, lo;
      split3_tf32(mul_rn(static_cast<float>(sum), sc.ts), hi, mid, lo);
      float* xs = reinterpret_cast<float*>(av.xs) + 16 * n;
      xs[xs_word(j, 0)] = u2f(hi);
      xs[xs_word(j, 1)] = u2f(mid);
      reinterpret_cast<float*>(av.xs2)[8 * n + xs2_word(j)] = u2f(lo);
    }
  }
}

}  // namespace
}  // namespace moe::cuda::k
