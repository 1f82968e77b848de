// What the two paths of the K-quant prefill GEMMs (gemm_kq.cu) share: the stage width, the quant
// types' row geometry in shared memory, the block shapes, the header helpers, the minimums' tf32
// operands and the walk over a Q6_K stage's groups.
// Included by gemm_kq.cu only (its definitions live in an anonymous namespace).
#pragma once
#include "common.cuh"
#include "gemm.cuh"
#include "mma.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

using namespace dev::i8;

constexpr int KS = 256;  // columns per stage: one K-quant super-block

// A weight row of a stage is the raw super-block, copied as is into a row of PITCH bytes. PITCH / 16
// is odd, so the 8 rows that one phase of an ldmatrix (or of a header load) reads fall in 8 different
// 16-byte bank groups.
template <uint32_t T>
struct QT;
template <>
struct QT<layout::Q4_K> {
  static constexpr int BB = 144, PITCH = 144, QS = 16;  // QS: offset of the nibbles
  static constexpr bool MIN = true;
};
template <>
struct QT<layout::Q5_K> {
  static constexpr int BB = 176, PITCH = 176, QS = 48, QH = 16;  // QH: offset of the fifth bits
  static constexpr bool MIN = true;
};
template <>
struct QT<layout::Q6_K> {
  static constexpr int BB = 224, PITCH = 240, QL = 0, QH = 128, SC = 192, D = 208;
  static constexpr bool MIN = false;
};

// Block shape: WM warps, each owning MT m16 tiles (rows) x NJ n8 tiles (all of the block's BN = 8 NJ
// tokens: warps split rows only, so an expert with few tokens leaves no warp idle). For gate/up
// (MT = 2) a warp's first tile holds 16 gate rows and its second the same 16 up rows.
template <int WM_, int MT_, int NJ_, bool GROUPED_, bool GATEUP_, int MIN_BLOCKS_>
struct IShape {
  static constexpr int WM = WM_, MT = MT_, NJ = NJ_, MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr bool GROUPED = GROUPED_, GATEUP = GATEUP_;
  static constexpr int H = GATEUP ? MT / 2 : MT;     // m16 tiles per warp per matrix
  static constexpr int THREADS = 32 * WM;
  static constexpr int BMV = 16 * MT * WM;           // virtual rows (gate/up: gate rows, then up rows)
  static constexpr int BM = GATEUP ? BMV / 2 : BMV;  // weight rows per item
  static constexpr int BN = 8 * NJ;                  // tokens per item
  static constexpr int XPW = BN / WM;                // tokens each warp quantizes per stage
  static_assert(BN % WM == 0 && XPW <= 32, "whole tokens per warp");
  static_assert(THREADS % BMV == 0, "whole rows per copying thread group");
  static_assert(!GATEUP || MT == 2, "gate/up: one gate and one up tile per warp");
  // First virtual row of m16 tile i of warp w.
  static __device__ __forceinline__ int vrow(int w, int i) {
    return GATEUP ? (i / H) * BM + w * 16 * H + 16 * (i % H) : w * 16 * MT + 16 * i;
  }
};

// gate/up: 128 gate + 128 up rows x 32 tokens (a 512-token prefill routes ~32 tokens per expert).
using IGateUp = IShape<8, 2, 4, true, true, 1>;
// down: 256 rows x 32 tokens.
using IDown = IShape<8, 2, 4, true, false, 1>;
// dense, many tiles: 256 rows x 32 tokens.
using IWide = IShape<8, 2, 4, false, false, 1>;
// dense, few rows (at 512 tokens: k, v): 64 rows x 32 tokens, 4x the items of IWide.
using ISmall = IShape<4, 1, 4, false, false, 2>;

__device__ __forceinline__ float half_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w))); }
__device__ __forceinline__ float half_hi(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16)));
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// The Q4_K/Q5_K minimums of a stage as tf32 A operands (the 6-bit m_j, exact: a0 row g k = t, a1
// row g + 8, a2 row g k = t + 4, a3 row g + 8) and each row's dmin (rows g, g + 8).
template <class S, uint32_t T>
__device__ __forceinline__ void min_operands(const uint8_t* Ws, uint32_t (&am)[S::MT][4], float (&dmin)[S::MT][2]) {
  using Q = QT<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < S::MT; ++i) {
    uint32_t m[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 hd = *reinterpret_cast<const uint4*>(Ws + (S::vrow(warp, i) + g + 8 * h) * Q::PITCH);
      uint32_t sc[2];
      kq_scales(hd.y, hd.z, hd.w, sc, m[h]);
      dmin[i][h] = half_hi(hd.x);
    }
    am[i][0] = f2u(small_u2f(byte_u(m[0][0], t)));
    am[i][1] = f2u(small_u2f(byte_u(m[1][0], t)));
    am[i][2] = f2u(small_u2f(byte_u(m[0][1], t)));
    am[i][3] = f2u(small_u2f(byte_u(m[1][1], t)));
  }
}

// Walks a Q6_K stage: for each half n_ (128 columns) and 32-column group j = 4 n_ + k, f(n_, k, hi, ql,
// qh) with the tile rows' ldmatrix words of the group's low nibbles (ql, nibble hi) and high bits (qh).
template <class S, class F>
__device__ __forceinline__ void q6k_walk(const uint8_t* const (&lrow)[S::MT], F&& f) {
  using Q = QT<layout::Q6_K>;
#pragma unroll
  for (int n_ = 0; n_ < 2; ++n_) {
    uint32_t qh[S::MT][4];
#pragma unroll
    for (int i = 0; i < S::MT; ++i) ldsm_x4(qh[i], lrow[i] + Q::QH + 32 * n_);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t ql[S::MT][4];
#pragma unroll
      for (int i = 0; i < S::MT; ++i) ldsm_x4(ql[i], lrow[i] + Q::QL + 64 * n_ + 32 * kk);
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) f(n_, kk + 2 * hi, hi, ql, qh);
    }
  }
}

}  // namespace
}  // namespace moe::cuda::k
