// Prefill GEMMs of the K-quants (Q4_K, Q5_K, Q6_K) on the tensor cores (igemm_kernel), dense or
// grouped by expert; the host entry points are in gemm.cu, the other types take the fp32 path
// (gemm_float.cu). Two paths share the kernel's pipeline and item walk:
//
// fp16 path (H, the default when the caller passes the input split by split_h16; see h16 in
// mma.cuh): the activations are split once per GEMM input into per-(token, super-block) records
// (x * 2^e as fp16 hi + lo, the slice sums, 1 / 2^e) that the blocks copy as they are; the weights
// become fp16 A operands of mma.m16n8k16 holding the centred codes times their 6-bit sub-block
// scales (Q4_K, Q5_K: exact below 2048, so a super-block accumulates inside the MMAs and only d,
// dmin and the codes' offsets are applied per super-block) or the centred codes alone (Q6_K: its
// int8 scale is applied per 16 columns in fp32). Two MMAs per product, no per-slice epilogue and no
// activation quantization inside the GEMM: ~25 % fewer instructions than the integer path for the
// grouped gate/up and 30-35 % for Q6_K.
//
// Integer path (MOE_CUDA_GEMM_H16=0, or no split input): weights stay quant codes, as 8-bit A operands of mma.sync m16n8k32 u8 x s8 (Q4_K, Q5_K: codes < 32)
// or m16n8k16 s8 x s8 (Q6_K: codes - 32, whose scale changes every 16 columns). Activations are
// quantized per token and 32-column slice to 24 bits (dev::i8): s = max|x| / (127 * 65536) rounded
// up to 6 significant bits, X = rint(x / s) = 65536 Xa + 256 Xb + Xc with three int8 digits (one fma
// and one cvt.rni per element, the digits are byte selections), so one slice of a 16x8 tile is three
// integer MMAs (same A, exact in int32). Per slice each output adds
//   (row scale) * s * (65536 Da + 256 Db + Dc)          [row scale: d * sc of the sub-block]
// in fp32. The MMAs take magic floats 1.5 * 2^39, 1.5 * 2^31, 1.5 * 2^23 as their accumulator
// inputs, so their int32 results read as the floats Ma + 65536 Da, Mb + 256 Db, Mc + Dc (no
// int-to-float conversion, which issues at 1/8 of the fp32 rate, and the digit weights for free);
// s (65536 Da + 256 Db + Dc) is then three fmas with the slice's s and the constant -s (Ma + Mb + Mc)
// (dev::i8::digit_value: the first is exact, so no magic offset larger than s Mc is left in what
// the others round), and one more adds it into the accumulator: four fp32 instructions per output
// and slice, as with the former two digits (Q6_K: eight, two halves). s and -s (Ma + Mb + Mc) come
// from shared memory with the digits (ISmall, two blocks per SM, computes the latter where used).
// Q4_K/Q5_K minimums, -dmin * m_j * s * (sum of X over slice j), go through three tf32 m16n8k8
// MMAs per super-block (A: the 6-bit m_j, exact; B: the slice sums split in tf32 hi + mid + lo,
// ~2^-32), scaled by dmin per row. The sums are of the quantized X, so that the result is the
// product of the dequantized weights with the quantized activations (with sums of x, the rounding
// of X would be weighted by d * sc * q, up to twice the weight).
// Accuracy: X is off by at most ~s/2 (3/4 at ties), 2^-24 of the slice's largest element, and the
// digit combination and everything after it are fp32 with round to nearest (2^-24 each): fp32
// level. Against the kernel tests' bound of 1e-5 * sum|w x| + 1e-6, the CPU model in
// tests/cuda/gemm_test.cpp gives worst / rms errors of ~0.01 / 0.0015 of the bound for Gaussian
// and silu(g) * u activations, ~0.1 / 0.01 with four 100x outliers per token at K = 256 (an
// outlier coarsens the other 31 elements of its slice, and its own weight may be ~0), and
// ~0.4 / 0.02 with 1000x outliers. With the former 16-bit activations the Gaussian worst case was
// 0.75 and the device tests failed now and then; s per 256 columns would make outliers 2.8x worse.
// Layout: a block owns BM weight rows (x2 for gate/up) x 32 tokens and walks K one super-block
// (256 columns) per stage. The raw quant blocks of its rows land by cp.async in shared memory
// (double buffered; codes are unpacked in registers after ldmatrix). The fp32 activations land by
// cp.async in each thread's own slots two stages ahead and are quantized into the B-fragment
// layout one stage ahead (double buffered), so one barrier per stage separates the three. Blocks
// are persistent: each walks the list of (expert, row tile, token tile) items with a stride of the
// grid, and the pipeline runs across item boundaries (the expert down projection has only three
// stages per item). Shared memory (ISmem): 162-210 KB per block for the shapes of one block per
// SM (Q4_K-Q6_K; 6 KB more for the grouped item table), 106-112 KB for ISmall. The fp16 path
// (HSmem) has no landing area: two stages of weight rows and of records, 150-198 KB (ISmall ~100).
//
// MOE_CUDA_GEMM_I8=0 turns both off (the K-quants then take the fp32 path).
#include <type_traits>

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

// Shared memory of shape S and type T: two stages of weight rows, two of staged activations (digit
// B registers, slice scales, for the minimums the slice sums), the activations' landing area, then
// the item table (3 (n_e + 1) ints).
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
  static constexpr size_t bytes(int n_e) { return FIXED + (12 * static_cast<size_t>(n_e + 1) + 15) / 16 * 16; }
  // The largest launch: the full item table (grouped) or one entry (dense).
  static constexpr size_t MAX = bytes(S::GROUPED ? 512 : 1);
  // sm_90: 227 KB per block, 228 KB per SM with 1 KB reserved per block.
  static_assert(MAX <= 232448 && S::MIN_BLOCKS * (MAX + 1024) <= 233472, "shared memory for MIN_BLOCKS blocks");
};

// Shared memory of the fp16 path (Q4_K, Q5_K, Q6_K; shapes where it fits): as ISmem, with a stage's
// activations as the tokens' split records (h16::kRec4, kPitch4 apart) and no landing area.
template <class S, uint32_t T>
struct HSmem {
  using Q = QT<T>;
  static constexpr size_t W = static_cast<size_t>(S::BMV) * Q::PITCH;
  static constexpr size_t ACT = static_cast<size_t>(S::BN) * h16::kPitch4 * 16;
  static constexpr size_t LAND = 0;
  static constexpr size_t FIXED = 2 * W + 2 * ACT;
  static constexpr size_t bytes(int n_e) { return FIXED + (12 * static_cast<size_t>(n_e + 1) + 15) / 16 * 16; }
  static constexpr size_t MAX = bytes(S::GROUPED ? 512 : 1);
};
// Whether HSmem<S, T> fits S::MIN_BLOCKS blocks per SM (sm_90: 227 KB per block, 228 KB per SM with
// 1 KB reserved per block).
template <class S, uint32_t T>
constexpr bool h_fits = HSmem<S, T>::MAX <= 232448 && S::MIN_BLOCKS * (HSmem<S, T>::MAX + 1024) <= 233472;

__device__ __forceinline__ float half_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<uint16_t>(w))); }
__device__ __forceinline__ float half_hi(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16)));
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// One work item: a tile of BM rows x up to BN tokens of expert e.
struct Item {
  int e, row0, cnt, slot0;  // cnt: valid tokens; slot0: X/Y row (slot) of the first
};
// A position in a block's stages: its item i (the i-th of the block) and super-block kt.
struct Cursor {
  int i = 0, kt = 0;
  __device__ __forceinline__ void next(int n_k) {
    if (++kt == n_k) {
      kt = 0;
      ++i;
    }
  }
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

// The fp16 path's products of one stage (one super-block of every row) of Q4_K/Q5_K into acc (see
// h16 in mma.cuh): A = (q - o) sc per sub-block, o = 8 (Q4_K) or 16 (Q5_K) so that the codes are
// centred (the tensor cores truncate their fp32 sums: with codes of one sign the running sum, and
// its error, would grow with the sum of |x|), from the magic pair by two exact f16x2 steps; the
// eight slices accumulate in D through the MMAs (lo part first); then per output
// acc += (d D + o d Ds - dmin Dm) / f of the token, with Ds = sum_j sc_j S_j and Dm = sum_j m_j S_j
// over the slice sums S_j by tf32 MMAs as in stage_kq.
template <class S, uint32_t T>
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
      for (int n = 0; n < S::NJ; ++n) {
        if (n >= nj) break;
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          const uint4 b = bh[h16::bh_index(8 * n + g, st, j, t)];
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            h16::mma_f16(D[i][n], A[i][st], b.z, b.w);
            h16::mma_f16(D[i][n], A[i][st], b.x, b.y);
          }
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
    if (n >= nj) break;
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
#pragma unroll
          for (int n = 0; n < S::NJ; ++n) {
            if (n >= nj) break;
            const uint4 b = bh[h16::bh_index(8 * n + g, st, j, t)];
#pragma unroll
            for (int i = 0; i < S::MT; ++i) {
              float D[4] = {0.f, 0.f, 0.f, 0.f};
              h16::mma_f16(D, A[i], b.z, b.w);
              h16::mma_f16(D, A[i], b.x, b.y);
#pragma unroll
              for (int e = 0; e < 4; ++e) Ds[i][n][e] = fma_rn(sc[i][e >> 1], D[e], Ds[i][n][e]);
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

template <class S, uint32_t T, bool H>
__global__ void __launch_bounds__(S::THREADS, S::MIN_BLOCKS) igemm_kernel(GemmArgs a) {
  using Q = QT<T>;
  using M = std::conditional_t<H, HSmem<S, T>, ISmem<S, T>>;
  extern __shared__ __align__(16) uint8_t sm[];
  uint8_t* wbuf = sm;                 // 2 x M::W
  uint8_t* abuf = sm + 2 * M::W;      // 2 x M::ACT
  float4* land = reinterpret_cast<float4*>(abuf + 2 * M::ACT);
  const int n_e = S::GROUPED ? a.n_expert : 1;
  int* pre = reinterpret_cast<int*>(abuf + 2 * M::ACT + M::LAND);  // items before expert e
  int* cnt_e = pre + n_e + 1;
  int* off_e = cnt_e + n_e;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row_tiles = (a.W.rows + S::BM - 1) / S::BM, n_k = a.W.cols / KS;

  // The item list: expert by expert, row tile by row tile, token tile fastest (consecutive items,
  // running at once on neighbouring blocks, share their weights in L2).
  for (int e = tid; e < n_e; e += S::THREADS) {
    const int c = S::GROUPED ? a.count[e] : a.n_tok;
    cnt_e[e] = c;
    off_e[e] = S::GROUPED ? a.offset[e] : 0;
    pre[e + 1] = (c + S::BN - 1) / S::BN * row_tiles;
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < n_e; base += 32) {
      const int e = base + lane;
      int v = e < n_e ? pre[e + 1] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
      }
      if (e < n_e) pre[e + 1] = v + carry;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) pre[0] = 0;
  }
  __syncthreads();
  const int total = pre[n_e];
  const int mine = total > static_cast<int>(blockIdx.x) ? (total - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const int n_st = mine * n_k;  // this block's stages, item by item
  if (n_st == 0) return;

  auto item_of = [&](int i) {
    const int w = blockIdx.x + i * gridDim.x;
    int lo = 0, hi = n_e - 1;  // the last expert starting at or before w (never an empty one)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (pre[mid] <= w) lo = mid;
      else hi = mid - 1;
    }
    const int c = cnt_e[lo], tt = (c + S::BN - 1) / S::BN, rem = w - pre[lo];
    const int tok0 = rem % tt * S::BN;
    return Item{lo, rem / tt * S::BM, min(S::BN, c - tok0), off_e[lo] + tok0};
  };

  // Weight copies: the stage's BMV x CPR 16-byte chunks, numbered row by row, go to the threads in
  // turn, so that a warp reads whole runs of consecutive bytes (each row's super-block).
  // Each thread's chunks (at most NCH) keep their source address of super-block 0 while an item lasts.
  constexpr int CPR = Q::BB / 16, CHUNKS = S::BMV * CPR, NCH = (CHUNKS + S::THREADS - 1) / S::THREADS;
  int wi = -1;
  const uint8_t* wsrc[NCH];
  uint32_t wok = 0;  // bit k: chunk k is a row of the matrix (past the last row: zeros)
  auto issue_w = [&](int s, const Cursor& c) {
    if (c.i != wi) {
      wi = c.i;
      const Item wit = item_of(wi);
      wok = 0;
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int q = tid + k * S::THREADS, v = q / CPR, ch = q - v * CPR;  // virtual row, chunk
        const bool up = S::GATEUP && v >= S::BM;
        const Mat& wm = up ? a.W2 : a.W;
        const int r = wit.row0 + (up ? v - S::BM : v);
        const bool ok = q < CHUNKS && r < a.W.rows;
        wsrc[k] = wm.data + (S::GROUPED ? wit.e * wm.expert_stride : 0) + static_cast<int64_t>(ok ? r : 0) * wm.row_stride +
                  16 * ch;
        wok |= static_cast<uint32_t>(ok) << k;
      }
    }
    uint8_t* dst = wbuf + (s & 1) * M::W;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int q = tid + k * S::THREADS, v = q / CPR, ch = q - v * CPR;
      if (q < CHUNKS) cp_async16_zfill(dst + v * Q::PITCH + 16 * ch, wsrc[k] + c.kt * Q::BB, wok >> k & 1);
    }
  };

  // Activation copies: warp w stages tokens w, w + WM, ...; lane 4 j + t copies the 8 floats its
  // quantization needs (columns 4t.. and 16 + 4t.. of slice j) into its own landing slots.
  int xi = -1;
  int xrow[S::XPW];
  uint32_t xmask = 0;  // which of this thread's tokens the last issue_x copied (the others are zero)
  auto issue_x = [&](const Cursor& c) {
    if (c.i != xi) {
      xi = c.i;
      const Item it = item_of(xi);
      xmask = 0;
#pragma unroll
      for (int m = 0; m < S::XPW; ++m) {
        const int n = warp + S::WM * m;
        xrow[m] = -1;
        if (n < it.cnt) xrow[m] = a.x_rows ? a.x_rows[it.slot0 + n] : it.slot0 + n;
        if (xrow[m] >= 0) xmask |= 1u << m;
      }
    }
    const int col = c.kt * KS + 32 * (lane >> 2) + 4 * (lane & 3);
#pragma unroll
    for (int m = 0; m < S::XPW; ++m) {
      if (!(xmask >> m & 1)) continue;
      const float* src = a.X + static_cast<int64_t>(xrow[m]) * a.x_stride + col;
      float4* dst = land + (warp + S::WM * m) * 64 + lane;
      cp_async16_zfill(dst, src, true);
      cp_async16_zfill(dst + 32, src + 16, true);
    }
  };
  // Quantizes (integer path) or splits (fp16 path) the landed activations of stage s into its B operands.
  auto quant_x = [&](int s) {
#pragma unroll
    for (int m = 0; m < S::XPW; ++m) {
      const int n = warp + S::WM * m;
      float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (xmask >> m & 1) {
        const float4 v0 = land[n * 64 + lane], v1 = land[n * 64 + 32 + lane];
        x[0] = v0.x, x[1] = v0.y, x[2] = v0.z, x[3] = v0.w, x[4] = v1.x, x[5] = v1.y, x[6] = v1.z, x[7] = v1.w;
      }
      if constexpr (!H) quant_x_i8<S, T>(abuf + (s & 1) * M::ACT, n, x);
    }
  };

  // fp16 path: the stage's split records (GemmArgs::XH, h16::kRec4 uint4 per token and super-block)
  // copied whole, BN x kRec4 16-byte chunks numbered token by token; each thread's chunks keep their
  // token's record row while an item lasts (-1: past the item's tokens, zeros).
  constexpr int RCH = S::BN * h16::kRec4, NRC = (RCH + S::THREADS - 1) / S::THREADS;
  int hrow[H ? NRC : 1];
  auto issue_xh = [&](int s, const Cursor& c) {
    if (c.i != xi) {
      xi = c.i;
      const Item it = item_of(xi);
#pragma unroll
      for (int k = 0; k < NRC; ++k) {
        const int q = tid + k * S::THREADS, n = q / h16::kRec4;
        hrow[k] = q < RCH && n < it.cnt ? (a.x_rows ? a.x_rows[it.slot0 + n] : it.slot0 + n) : -1;
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(abuf + (s & 1) * M::ACT);
#pragma unroll
    for (int k = 0; k < NRC; ++k) {
      const int q = tid + k * S::THREADS, n = q / h16::kRec4, cc = q - n * h16::kRec4;
      if (q >= RCH) continue;
      const uint4* src = a.XH + (static_cast<int64_t>(max(hrow[k], 0)) * n_k + c.kt) * h16::kRec4 + cc;
      cp_async16_zfill(dst + n * h16::kPitch4 + cc, src, hrow[k] >= 0);
    }
  };

  float acc[S::MT][S::NJ][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int n = 0; n < S::NJ; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;

  // The pipeline. Integer path: iteration s multiplies stage s while stage s + 1's weights land and
  // stage s + 1's activations (landed during iteration s - 1) are quantized; stage s + 2's activations
  // are issued once this thread has read its slots. cp.async groups, oldest first: ..., X(s+1), W(s+1),
  // X(s+2). fp16 path: stage s + 1's weights and records land while stage s is multiplied (one group).
  Cursor cw, cx, cs;  // the next stage to issue weights for, to issue activations for, to multiply
  issue_w(0, cw);
  cw.next(n_k);
  if constexpr (H) {
    issue_xh(0, cx);
    cx.next(n_k);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    cp_async_commit();
    issue_x(cx);
    cx.next(n_k);
    cp_async_commit();
    cp_async_wait<0>();
    quant_x(0);
    if (n_st > 1) {
      issue_x(cx);
      cx.next(n_k);
    }
    cp_async_commit();
  }
  __syncthreads();

  int ci = -1;
  Item cit{};
  for (int s = 0; s < n_st; ++s) {
    if (s + 1 < n_st) {
      issue_w(s + 1, cw);
      cw.next(n_k);
      if constexpr (H) {
        issue_xh(s + 1, cx);
        cx.next(n_k);
      }
    }
    cp_async_commit();
    if constexpr (!H) {
      cp_async_wait<1>();  // X(s + 1)
      if (s + 1 < n_st) quant_x(s + 1);
      if (s + 2 < n_st) {
        issue_x(cx);
        cx.next(n_k);
      }
      cp_async_commit();
    }

    if (cs.i != ci) {
      ci = cs.i;
      cit = item_of(ci);
    }
    const int nj = min(S::NJ, (cit.cnt + 7) >> 3);
    const uint8_t* Ws = wbuf + (s & 1) * M::W;
    const uint8_t* act = abuf + (s & 1) * M::ACT;
    if constexpr (H && T == layout::Q6_K) stage_q6k_h<S>(Ws, act, nj, acc);
    else if constexpr (H) stage_kq_h<S, T>(Ws, act, nj, acc);
    else if constexpr (T == layout::Q6_K) stage_q6k<S>(Ws, act, nj, acc);
    else stage_kq<S, T>(Ws, act, nj, acc);

    if (cs.kt == n_k - 1) {  // the item's last stage: write its tile
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int i = 0; i < S::H; ++i)
#pragma unroll
        for (int n = 0; n < S::NJ; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = cit.row0 + S::vrow(warp, i) + g + 8 * (e >> 1), tk = 8 * n + 2 * t + (e & 1);
            if (r >= a.W.rows || tk >= cit.cnt) continue;
            float v = acc[i][n][e];
            if constexpr (S::GATEUP) v = v / (1.f + expf(-v)) * acc[i + S::H][n][e];
            float* y = a.Y + static_cast<int64_t>(cit.slot0 + tk) * a.y_stride + r;
            *y = a.accumulate ? *y + v : v;
          }
#pragma unroll
      for (int i = 0; i < S::MT; ++i)
#pragma unroll
        for (int n = 0; n < S::NJ; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;
    }
    cs.next(n_k);
    if constexpr (H) cp_async_wait<0>();  // W(s + 1), X(s + 1)
    else cp_async_wait<1>();              // W(s + 1)
    __syncthreads();
  }
}

int64_t ceil_div(int64_t n, int64_t b) { return (n + b - 1) / b; }

// The integer kernel for shape S and type T over at most max_items work items (grouped: the counts
// are on the device, so the grid is what is resident and blocks without items exit at once).
template <class S, uint32_t T, bool H>
cudaError_t launch_i8_t(const GemmArgs& a, int64_t max_items, cudaStream_t s) {
  using M = std::conditional_t<H, HSmem<S, T>, ISmem<S, T>>;
  const int n_e = S::GROUPED ? a.n_expert : 1;
  if (max_items <= 0 || n_e <= 0) return cudaSuccess;
  // Once per instantiation: the shared-memory limit and the residency at the largest item table.
  static_assert(M::MAX == M::bytes(S::GROUPED ? kMaxItemExperts : 1), "ISmem::MAX");
  constexpr size_t kMaxSmem = M::MAX;
  static const cudaError_t attr = cudaFuncSetAttribute(igemm_kernel<S, T, H>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(kMaxSmem));
  if (attr != cudaSuccess) return attr;
  static int per_sm = 0;
  static const cudaError_t occ =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, igemm_kernel<S, T, H>, S::THREADS, kMaxSmem);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
  const unsigned grid = static_cast<unsigned>(max_items < resident ? max_items : resident);
  igemm_kernel<S, T, H><<<grid, S::THREADS, M::bytes(n_e), s>>>(a);
  return cudaGetLastError();
}


// MOE_CUDA_GEMM_H16=0 keeps Q4_K and Q5_K on the integer MMA (comparisons, bisecting).
bool h16_enabled() {
  static const bool on = env_switch("MOE_CUDA_GEMM_H16", true);
  return on;
}

// Q4_K and Q5_K take the fp16 path in the shapes of one block per SM when the caller split the
// activations (GemmArgs::XH).
template <class S>
cudaError_t launch_i8(const GemmArgs& a, int64_t max_items, cudaStream_t s) {
  constexpr bool kH = h_fits<S, layout::Q6_K>;  // the widest rows
  const bool h = a.XH != nullptr && h16_enabled();
  switch (a.W.type) {
    case layout::Q4_K:
      if (kH && h) return launch_i8_t<S, layout::Q4_K, kH>(a, max_items, s);
      return launch_i8_t<S, layout::Q4_K, false>(a, max_items, s);
    case layout::Q5_K:
      if (kH && h) return launch_i8_t<S, layout::Q5_K, kH>(a, max_items, s);
      return launch_i8_t<S, layout::Q5_K, false>(a, max_items, s);
    case layout::Q6_K:
      if (kH && h) return launch_i8_t<S, layout::Q6_K, kH>(a, max_items, s);
      return launch_i8_t<S, layout::Q6_K, false>(a, max_items, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool split_h16_wanted(const Mat& W) {
  return is_i8_type(W.type) && W.cols % KS == 0 && h16_enabled();
}

size_t split_h16_bytes(int rows, int cols) {
  return static_cast<size_t>(rows) * (cols / KS) * h16::kRec4 * 16;
}

cudaError_t split_h16(const float* X, int x_stride, int rows, int cols, void* out, cudaStream_t s) {
  if (rows <= 0) return cudaSuccess;
  if (cols % KS != 0) return cudaErrorInvalidValue;
  const int64_t recs = static_cast<int64_t>(rows) * (cols / KS);
  split_h16_kernel<<<static_cast<unsigned>((recs + 7) / 8), 256, 0, s>>>(X, x_stride, rows, cols, static_cast<uint4*>(out));
  return cudaGetLastError();
}

cudaError_t gemm_i8(GemmOp op, const GemmArgs& a, int n, cudaStream_t s) {
  switch (op) {
    case GemmOp::dense: {
      // The wide tile quantizes each activation for 4x the rows, but needs enough items to fill the GPU.
      const int64_t wide = ceil_div(a.W.rows, IWide::BM) * ceil_div(n, IWide::BN);
      if (4 * wide >= 3 * sm_count()) return launch_i8<IWide>(a, wide, s);
      return launch_i8<ISmall>(a, ceil_div(a.W.rows, ISmall::BM) * ceil_div(n, ISmall::BN), s);
    }
    case GemmOp::gate_up:
      return launch_i8<IGateUp>(a, a.n_expert * ceil_div(a.W.rows, IGateUp::BM) * ceil_div(n, IGateUp::BN), s);
    case GemmOp::down:
      return launch_i8<IDown>(a, a.n_expert * ceil_div(a.W.rows, IDown::BM) * ceil_div(n, IDown::BN), s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe::cuda::k
