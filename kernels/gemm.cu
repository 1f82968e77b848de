// Prefill matrix products on the tensor cores: Y[token][row] (+)= W.row(row) . X[token], dense or
// grouped by expert (every expert over the tokens routed to it; the gate/up form stacks the gate and
// up rows of a tile, one warp holding both, and writes silu(gate) * up). Two kernels:
//
// 1. Integer path (Q4_K, Q5_K, Q6_K; igemm_kernel). Weights stay quant codes, as 8-bit A operands of
//    mma.sync m16n8k32 u8 x s8 (Q4_K, Q5_K: codes < 32) or m16n8k16 s8 x s8 (Q6_K: codes - 32, whose
//    scale changes every 16 columns). Activations are quantized per token and 32-column slice to 24
//    bits (dev::i8): s = max|x| / (127 * 65536) rounded up to 6 significant bits, X = rint(x / s)
//    = 65536 Xa + 256 Xb + Xc with three int8 digits (one fma and one cvt.rni per element, the digits
//    are byte selections), so one slice of a 16x8 tile is three integer MMAs (same A, exact in int32).
//    Per slice each output adds
//      (row scale) * s * (65536 Da + 256 Db + Dc)          [row scale: d * sc of the sub-block]
//    in fp32. The MMAs take magic floats 1.5 * 2^39, 1.5 * 2^31, 1.5 * 2^23 as their accumulator
//    inputs, so their int32 results read as the floats Ma + 65536 Da, Mb + 256 Db, Mc + Dc (no
//    int-to-float conversion, which issues at 1/8 of the fp32 rate, and the digit weights for free);
//    s (65536 Da + 256 Db + Dc) is then three fmas with the slice's s and the constant -s (Ma + Mb + Mc)
//    (dev::i8::digit_value: the first is exact, so no magic offset larger than s Mc is left in what
//    the others round), and one more adds it into the accumulator: four fp32 instructions per output
//    and slice, as with the former two digits (Q6_K: eight, two halves). s and -s (Ma + Mb + Mc) come
//    from shared memory with the digits (ISmall, two blocks per SM, computes the latter where used).
//    Q4_K/Q5_K minimums, -dmin * m_j * s * (sum of X over slice j), go through three tf32 m16n8k8
//    MMAs per super-block (A: the 6-bit m_j, exact; B: the slice sums split in tf32 hi + mid + lo,
//    ~2^-32), scaled by dmin per row. The sums are of the quantized X, so that the result is the
//    product of the dequantized weights with the quantized activations (with sums of x, the rounding
//    of X would be weighted by d * sc * q, up to twice the weight).
//    Accuracy: X is off by at most ~s/2 (3/4 at ties), 2^-24 of the slice's largest element, and the
//    digit combination and everything after it are fp32 with round to nearest (2^-24 each): fp32
//    level. Against the kernel tests' bound of 1e-5 * sum|w x| + 1e-6, the CPU model in
//    tests/cuda/gemm_test.cpp gives worst / rms errors of ~0.01 / 0.0015 of the bound for Gaussian
//    and silu(g) * u activations, ~0.1 / 0.01 with four 100x outliers per token at K = 256 (an
//    outlier coarsens the other 31 elements of its slice, and its own weight may be ~0), and
//    ~0.4 / 0.02 with 1000x outliers. With the former 16-bit activations the Gaussian worst case was
//    0.75 and the device tests failed now and then; s per 256 columns would make outliers 2.8x worse.
//    Layout: a block owns BM weight rows (x2 for gate/up) x 32 tokens and walks K one super-block
//    (256 columns) per stage. The raw quant blocks of its rows land by cp.async in shared memory
//    (double buffered; codes are unpacked in registers after ldmatrix). The fp32 activations land by
//    cp.async in each thread's own slots two stages ahead and are quantized into the B-fragment
//    layout one stage ahead (double buffered), so one barrier per stage separates the three. Blocks
//    are persistent: each walks the list of (expert, row tile, token tile) items with a stride of the
//    grid, and the pipeline runs across item boundaries (the expert down projection has only three
//    stages per item). Shared memory (ISmem): 162-210 KB per block for the shapes of one block per
//    SM (Q4_K-Q6_K; 6 KB more for the grouped item table), 106-112 KB for ISmall.
//
//    MOE_CUDA_GEMM_I8=0 turns this path off (the K-quants then take the fp32 path).
//
// 2. fp32 path (every other type; gemm_kernel): tiles of dequantized values (or, for Q4_0, Q5_0,
//    Q8_0, codes) one 32-column slice at a time, 3xTF32 on mma.sync m16n8k8: every fp32 operand is
//    split into a tf32 hi part and a tf32 lo remainder and a product is a_hi*b_hi + a_hi*b_lo +
//    a_lo*b_hi with fp32 accumulation; the dropped a_lo*b_lo term is ~2^-22 relative. The tensor
//    cores' fp32 accumulation truncates, so each slice is summed in fresh registers and added to the
//    running total with an ordinary round-to-nearest add. Codes are exact in tf32, so for the code
//    types only the activations are split (2 MMAs per product) and the slice's sums are scaled per
//    row in fp32.
#include <cstdlib>

#include "common.cuh"
#include "mma.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

// Columns per k-slice: one dequant32 group per row, and cols is always a multiple of 32 (no tail).
constexpr int BK = 32;
// Row pitch (floats) of a weight row in shared memory. Lane (g, t) reads float4s at row g, element
// 8t (+4); with a pitch of 36 (= 9 float4s) the 8 lanes of a quarter-warp hit 8 different 16-byte
// bank groups, and so do the dequantizing threads, each storing one row.
constexpr int LDA = BK + 4;
// An activation row holds 32 tf32 hi words, then 32 tf32 lo words (split once when staged rather
// than by every warp that reads it), padded like LDA for the same conflict-free float4 reads.
constexpr int LDX = 2 * BK + 4;

struct GemmArgs {
  Mat W, W2;
  int be, bb, be2, bb2;   // elements and bytes per quant block of W and W2 (for the L1 prefetch)
  const float* X;
  int x_stride;
  const int32_t* x_rows;  // slot -> X row (nullptr: the slot itself)
  float* Y;
  int y_stride;
  int accumulate;
  int n_tok;              // dense: token count
  const int* count;       // grouped: tokens per expert (nullptr: dense)
  int n_expert;           // grouped
  const int* offset;
};

// Block shape: WM x WN warps, each owning 2 m16 tiles (32 virtual rows) x NJ n8 tiles (8 NJ tokens).
// Virtual rows are weight rows; for gate/up the first BM are gate rows and the next BM the same up
// rows, and a warp's first m16 tile is gate, its second the matching up tile.
// CODES: the A tile holds quant codes, and a stage also holds their scale per row (top comment).
template <int WM_, int WN_, int NJ_, bool GROUPED_, bool GATEUP_, int MIN_BLOCKS_, bool CODES_>
struct Shape {
  static constexpr int WM = WM_, WN = WN_, NJ = NJ_, MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr bool GROUPED = GROUPED_, GATEUP = GATEUP_, CODES = CODES_;
  static constexpr int MT = 2;                  // m16 tiles per warp
  static constexpr int H = GATEUP ? MT / 2 : MT;  // m16 tiles per warp per matrix
  static constexpr int THREADS = 32 * WM * WN;
  static constexpr int BMV = 16 * MT * WM;        // virtual rows per block
  static constexpr int BM = GATEUP ? BMV / 2 : BMV;  // weight rows per block
  static constexpr int BN = 8 * NJ * WN;          // tokens per block
  static constexpr int A_FLOATS = BMV * LDA, X_FLOATS = BN * LDX;
  static constexpr int S_FLOATS = CODES ? BMV : 0;  // CODES: the slice's scale per virtual row
  static constexpr int STAGE = A_FLOATS + X_FLOATS + S_FLOATS;
  static constexpr int X_JOBS = BN * BK / 4;      // float4 chunks of activations per slice
  static constexpr int X_PER = X_JOBS / THREADS;
  // Two stages plus the landing area of the raw activations (cp.async, each thread its own chunks).
  static constexpr size_t SMEM = (2 * STAGE + 4 * X_JOBS) * sizeof(float);
  static_assert(BMV <= THREADS, "one dequantized row per thread at most");
  static_assert(X_JOBS % THREADS == 0, "activation chunks spread evenly");
};

// gate/up: 128 rows x 32 tokens (the typical expert load of a 512-token prefill is ~32 tokens).
template <bool C>
using ShapeGateUp = Shape<8, 1, 4, true, true, 2, C>;
// down: 256 rows x 32 tokens.
template <bool C>
using ShapeDown = Shape<8, 1, 4, true, false, 2, C>;
// dense, many tiles: 128 rows x 64 tokens (half the dequantization per product of ShapeDown).
template <bool C>
using ShapeWide = Shape<4, 2, 4, false, false, 2, C>;
// dense, otherwise (at 512 tokens: k, v, o, router): 64 rows x 32 tokens, 4 warps, 4x the blocks of
// ShapeWide so that the grid fills the GPU.
template <bool C>
using ShapeSmall = Shape<2, 2, 2, false, false, 4, C>;
// dense, few rows (the F32 router: 128 rows): 32 rows x 16 tokens, 2 warps, 4x the blocks of
// ShapeSmall (measured 123 us per layer with ShapeSmall's 32 blocks at 512 tokens).
template <bool C>
using ShapeTiny = Shape<1, 2, 1, false, false, 8, C>;

// Where a slice's columns sit in a shared-memory row (weights and activations alike): the 4-column
// chunk c at chunk pos(c) = 2 (c % 4) + c / 4. Lane t of a warp reads chunks 2t + h (h = 0, 1; see the
// main loop), which thus hold columns 16h + 4t + [0, 4): all the columns of the mma steps of half h
// lie in [16h, 16h + 16).
__device__ __forceinline__ constexpr int chunk_pos(int c) { return 2 * (c & 3) + (c >> 2); }

__device__ __forceinline__ void store_row(const float (&v)[32], float* dst) {
#pragma unroll
  for (int c = 0; c < 8; ++c)
    *reinterpret_cast<float4*>(dst + 4 * chunk_pos(c)) =
        make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
}

// Dequantizes group g of a row into a shared-memory row.
template <uint32_t T>
__device__ __forceinline__ void deq_row(const uint8_t* row, int g, float* dst) {
  float v[32];
  dequant32<T>(row, g, v);
  store_row(v, dst);
}

// The fp32 path's code types: their codes (tf32-exact) go into the A tile as they are. The K-quants
// take the integer path (is_i8_type) where it applies (gate and up of one type, at most
// kMaxItemExperts experts, MOE_CUDA_GEMM_I8 not 0) and are dequantized here otherwise.
constexpr bool is_code_type(uint32_t t) {
  using namespace layout;
  return t == Q4_0 || t == Q5_0 || t == Q8_0;
}

// Group g of a row of a code type as q[0..32) and the scale s such that dequant32 gives s * q[l]
// (the same bits and the same fp32 scale as dequant32).
template <uint32_t T>
__device__ __forceinline__ void codes32(const uint8_t* row, int g, float (&q)[32], float& s) {
  using namespace layout;
  if constexpr (T == Q8_0) {
    const uint8_t* b = row + g * 36;
    s = half_at(b + 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = ld4(b + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) q[4 * i + j] = static_cast<float>(static_cast<int8_t>(w >> (8 * j)));
    }
  } else if constexpr (T == Q4_0 || T == Q5_0) {
    constexpr bool five = T == Q5_0;
    const uint8_t* b = row + g * (five ? 24 : 20);
    const uint32_t h = five ? ld4(b + 16) : 0u;
    s = half_at(b + (five ? 20 : 16));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = ld4(b + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int l = 4 * i + j, x = (w >> (8 * j)) & 0xFF;
        int lo = x & 0xF, hi = x >> 4;
        if constexpr (five) {
          lo |= ((h >> l) & 1) << 4;
          hi |= ((h >> (l + 16)) & 1) << 4;
        }
        q[l] = static_cast<float>(lo - (five ? 16 : 8));
        q[l + 16] = static_cast<float>(hi - (five ? 16 : 8));
      }
    }
  }
}

// Codes of group g of a row into a shared-memory row, its scale into *sc.
template <uint32_t T>
__device__ __forceinline__ void code_row(const uint8_t* row, int g, float* dst, float* sc) {
  if constexpr (is_code_type(T)) {
    float q[32];
    codes32<T>(row, g, q, *sc);
    store_row(q, dst);
  } else {  // not reached (the host picks codes only for code types); zeros rather than stale data
    const float z[32] = {};
    store_row(z, dst);
    *sc = 0.f;
  }
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Asks L1 for the quant blocks that dequant32(row, g) reads: the block(s) holding elements
// [32g, 32g+32). A hint only; the data are read normally later.
__device__ __forceinline__ void prefetch_group(const uint8_t* row, int be, int bb, int g) {
  const int64_t start = static_cast<int64_t>(32 * g / be) * bb;
  const int64_t len = static_cast<int64_t>(be < 32 ? 32 / be : 1) * bb;
  uintptr_t p = reinterpret_cast<uintptr_t>(row + start) & ~static_cast<uintptr_t>(127);
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + start + len);
  for (; p < end; p += 128) asm volatile("prefetch.L1 [%0];" ::"l"(p));
}

// One output tile: weight rows [row_tile * BM, +BM) x tokens [tok_tile * BN, +BN) of expert e (of the
// dense matrix for shapes that are not grouped). Every thread of the block calls it (it has barriers).
template <class S>
__device__ __forceinline__ void gemm_tile(const GemmArgs& a, float* smem, int row_tile, int tok_tile, int e) {
  int cnt = a.n_tok, off = 0;
  const uint8_t* w1 = a.W.data;
  const uint8_t* w2 = a.W2.data;
  if constexpr (S::GROUPED) {
    cnt = a.count[e];
    off = a.offset[e];
    w1 += e * a.W.expert_stride;
    if (S::GATEUP) w2 += e * a.W2.expert_stride;
  }
  const int tok0 = tok_tile * S::BN;
  if (tok0 >= cnt) return;
  const int row0 = row_tile * S::BM;
  const int rows = a.W.rows, n_k = a.W.cols / BK;
  // What the epilogue needs waits in shared memory rather than in registers through the main loop
  // (read after the prologue's barrier; the caller's barrier keeps the next tile from overwriting it).
  __shared__ int epi[4];
  if (threadIdx.x == 0) {
    epi[0] = row0;
    epi[1] = rows - row0;  // valid rows in the tile
    epi[2] = off + tok0;   // output row of the tile's first token
    epi[3] = cnt - tok0;   // valid tokens in the tile
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = S::WN == 1 ? warp : warp % S::WM, wn = S::WN == 1 ? 0 : warp / S::WM;
  // Dequantization role: thread tid < BMV owns virtual row tid (nullptr past the last weight row).
  // Here and below, values that are cheap to re-derive (from tid or the kernel parameters) are
  // re-derived where used: the main loop must fit in 128 registers for two blocks per SM.
  const bool second = S::GATEUP && tid >= S::BM;
  const uint8_t* drow = nullptr;
  if (tid < S::BMV) {
    const int r = second ? tid - S::BM : tid;
    if (row0 + r < rows)
      drow = (second ? w2 : w1) + static_cast<int64_t>(row0 + r) * (second ? a.W2.row_stride : a.W.row_stride);
  }
  // stage: a stage's base (weights, then activations, then for CODES the scale per virtual row).
  auto stage_a = [&](int kt, float* stage) {
    if (tid >= S::BMV) return;
    float* dst = stage + tid * LDA;
    float* sc = stage + S::A_FLOATS + S::X_FLOATS + tid;
    if (drow) {
      if constexpr (S::CODES) {
        MOE_DISPATCH_TYPE(second ? a.W2.type : a.W.type, code_row, drow, kt, dst, sc);
      } else {
        MOE_DISPATCH_TYPE(second ? a.W2.type : a.W.type, deq_row, drow, kt, dst);
      }
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) *reinterpret_cast<float4*>(dst + 4 * c) = make_float4(0.f, 0.f, 0.f, 0.f);
      if constexpr (S::CODES) sc[0] = 0.f;
    }
  };
  auto prefetch_a = [&](int kt) {
    if (drow) prefetch_group(drow, second ? a.be2 : a.be, second ? a.bb2 : a.bb, kt);
  };

  // Activation role: X_PER float4 chunks (token n = job / 8, chunk c = job % 8) of each slice, from
  // X row xrow[q] (-1 past the token count). They land by cp.async in this thread's own slots (so no
  // barrier is needed between landing and reading them), then are split into tf32 hi/lo and stored
  // for the warps.
  int xrow[S::X_PER];
#pragma unroll
  for (int q = 0; q < S::X_PER; ++q) {
    const int n = (tid + q * S::THREADS) >> 3;
    xrow[q] = -1;
    if (tok0 + n < cnt) {
      const int slot = off + tok0 + n;
      xrow[q] = a.x_rows ? a.x_rows[slot] : slot;
    }
  }
  float* xland = smem + 2 * S::STAGE + 4 * tid;
  auto fetch_x = [&](int kt) {
#pragma unroll
    for (int q = 0; q < S::X_PER; ++q)
      if (xrow[q] >= 0)
        cp_async16(xland + 4 * q * S::THREADS,
                   a.X + static_cast<int64_t>(xrow[q]) * a.x_stride + kt * BK + 4 * (tid & 7));
    cp_async_commit();
  };
  auto store_x = [&](float* stage) {
    float* Xs = stage + S::A_FLOATS;
    cp_async_wait_all();
#pragma unroll
    for (int q = 0; q < S::X_PER; ++q) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (xrow[q] >= 0) v = *reinterpret_cast<const float4*>(xland + 4 * q * S::THREADS);
      uint4 hi, lo;
      split_tf32(v.x, hi.x, lo.x);
      split_tf32(v.y, hi.y, lo.y);
      split_tf32(v.z, hi.z, lo.z);
      split_tf32(v.w, hi.w, lo.w);
      const int job = tid + q * S::THREADS, dst = (job >> 3) * LDX + 4 * chunk_pos(job & 7);
      *reinterpret_cast<uint4*>(Xs + dst) = hi;
      *reinterpret_cast<uint4*>(Xs + dst + BK) = lo;
    }
  };

  // Warp tile: virtual rows vrow(i) + [0, 16) for m16 tile i, tokens nb + [0, 8 NJ). n8 tiles wholly
  // past the token count are skipped (their activations are zero anyway): experts often fill only
  // part of a tile.
  const int nb = wn * 8 * S::NJ;
  const int rem = cnt - tok0 - nb;
  const int nj = rem <= 0 ? 0 : min(S::NJ, (rem + 7) >> 3);
  auto vrow = [](int wm_, int i) { return (i / S::H) * S::BM + wm_ * 16 * S::H + 16 * (i % S::H); };

  float acc[S::MT][S::NJ][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int j = 0; j < S::NJ; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  fetch_x(0);
  if (n_k > 1) prefetch_a(1);
  stage_a(0, smem);
  store_x(smem);
  __syncthreads();

  for (int kt = 0; kt < n_k; ++kt) {
    float* cur = smem + (kt & 1) * S::STAGE;
    float* nxt = smem + ((kt + 1) & 1) * S::STAGE;
    const bool more = kt + 1 < n_k;
    if (more) {
      fetch_x(kt + 1);
      if (kt + 2 < n_k) prefetch_a(kt + 2);
    }

    // The slice's products, summed apart from acc (see the top comment).
    float part[S::MT][S::NJ][4];
#pragma unroll
    for (int i = 0; i < S::MT; ++i)
#pragma unroll
      for (int j = 0; j < S::NJ; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;

    // k order within a slice: mma step s (0..3) pairs its k indices t and t+4 with the elements at
    // 8t+2s and 8t+2s+1 of the shared rows (for A and B alike, so the sum is unchanged); a lane then
    // finds steps 2h and 2h+1 in one float4 at 8t+4h of its rows, holding columns 16h+4t+[0, 4)
    // (chunk_pos).
    const float* As = cur;
    const float* Xs = cur + S::A_FLOATS;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (S::CODES) {
        uint32_t aq[S::MT][2][4];  // codes: exact in tf32
#pragma unroll
        for (int i = 0; i < S::MT; ++i) {
          const float* p = As + (vrow(wm, i) + g) * LDA + 8 * t + 4 * h;
          const float4 r0 = *reinterpret_cast<const float4*>(p);            // row g
          const float4 r1 = *reinterpret_cast<const float4*>(p + 8 * LDA);  // row g + 8
          aq[i][0][0] = __float_as_uint(r0.x);
          aq[i][0][1] = __float_as_uint(r1.x);
          aq[i][0][2] = __float_as_uint(r0.y);
          aq[i][0][3] = __float_as_uint(r1.y);
          aq[i][1][0] = __float_as_uint(r0.z);
          aq[i][1][1] = __float_as_uint(r1.z);
          aq[i][1][2] = __float_as_uint(r0.w);
          aq[i][1][3] = __float_as_uint(r1.w);
        }
#pragma unroll
        for (int j = 0; j < S::NJ; ++j) {
          if (j >= nj) break;
          const float* q = Xs + (nb + 8 * j + g) * LDX + 8 * t + 4 * h;
          const uint4 bh = *reinterpret_cast<const uint4*>(q);
          const uint4 bl = *reinterpret_cast<const uint4*>(q + BK);
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            mma_2xtf32(part[i][j], aq[i][0], bh.x, bh.y, bl.x, bl.y);
            mma_2xtf32(part[i][j], aq[i][1], bh.z, bh.w, bl.z, bl.w);
          }
        }
        // Scale the slice's code sums into acc once both halves are in.
        if (h == 1) {
          const float* sc = Xs + S::X_FLOATS;
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            const float s_top = sc[vrow(wm, i) + g], s_bot = sc[vrow(wm, i) + g + 8];
#pragma unroll
            for (int j = 0; j < S::NJ; ++j)
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                acc[i][j][c] = fmaf(c < 2 ? s_top : s_bot, part[i][j][c], acc[i][j][c]);
                part[i][j][c] = 0.f;
              }
          }
        }
      } else {
        uint32_t ahi[S::MT][2][4], alo[S::MT][2][4];  // [m16 tile][step 2h + s2][a0..a3]
#pragma unroll
        for (int i = 0; i < S::MT; ++i) {
          const float* p = As + (vrow(wm, i) + g) * LDA + 8 * t + 4 * h;
          const float4 r0 = *reinterpret_cast<const float4*>(p);            // row g
          const float4 r1 = *reinterpret_cast<const float4*>(p + 8 * LDA);  // row g + 8
          split_tf32(r0.x, ahi[i][0][0], alo[i][0][0]);
          split_tf32(r1.x, ahi[i][0][1], alo[i][0][1]);
          split_tf32(r0.y, ahi[i][0][2], alo[i][0][2]);
          split_tf32(r1.y, ahi[i][0][3], alo[i][0][3]);
          split_tf32(r0.z, ahi[i][1][0], alo[i][1][0]);
          split_tf32(r1.z, ahi[i][1][1], alo[i][1][1]);
          split_tf32(r0.w, ahi[i][1][2], alo[i][1][2]);
          split_tf32(r1.w, ahi[i][1][3], alo[i][1][3]);
        }
#pragma unroll
        for (int j = 0; j < S::NJ; ++j) {
          if (j >= nj) break;
          const float* q = Xs + (nb + 8 * j + g) * LDX + 8 * t + 4 * h;
          const uint4 bh = *reinterpret_cast<const uint4*>(q);       // token g, tf32 hi
          const uint4 bl = *reinterpret_cast<const uint4*>(q + BK);  // token g, tf32 lo
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            mma_3xtf32(part[i][j], ahi[i][0], alo[i][0], bh.x, bh.y, bl.x, bl.y);
            mma_3xtf32(part[i][j], ahi[i][1], alo[i][1], bh.z, bh.w, bl.z, bl.w);
          }
        }
      }
    }
    if constexpr (!S::CODES) {
#pragma unroll
      for (int i = 0; i < S::MT; ++i)
#pragma unroll
        for (int j = 0; j < S::NJ; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[i][j][c] += part[i][j][c];
    }

    if (more) {
      stage_a(kt + 1, nxt);
      store_x(nxt);
      __syncthreads();
    }
  }

  // c0..c3 of tile (i, j): rows g, g, g+8, g+8 and tokens 2t, 2t+1, 2t, 2t+1 of the tile.
  const int e_row0 = epi[0], e_rows = epi[1], e_slot0 = epi[2], e_toks = epi[3];
#pragma unroll
  for (int i = 0; i < S::H; ++i) {
    const int rt = wm * 16 * S::H + 16 * i + g;  // row within the tile
#pragma unroll
    for (int j = 0; j < S::NJ; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = rt + 8 * (c >> 1);
        const int tk = nb + 8 * j + 2 * t + (c & 1);  // token within the tile
        if (r >= e_rows || tk >= e_toks) continue;
        float val;
        if constexpr (S::GATEUP) {
          const float gv = acc[i][j][c];
          val = gv / (1.f + expf(-gv)) * acc[i + S::H][j][c];
        } else {
          val = acc[i][j][c];
        }
        float* y = a.Y + static_cast<int64_t>(e_slot0 + tk) * a.y_stride + e_row0 + r;
        *y = a.accumulate ? *y + val : val;
      }
    }
  }
}

// Dense: one tile per block (grid rows x tokens). Grouped: the token tiles of the experts are known
// only on the device, so a grid sized for what is resident walks the list of (expert, token tile,
// row tile) work items instead of launching max_count / BN tiles for every expert, most of which
// would be empty blocks. Consecutive items share the expert and token tile, so the activations they
// read are hot in L2.
template <class S>
__global__ void __launch_bounds__(S::THREADS, S::MIN_BLOCKS) gemm_kernel(GemmArgs a) {
  extern __shared__ __align__(16) float smem[];
  if constexpr (!S::GROUPED) {
    gemm_tile<S>(a, smem, blockIdx.x, blockIdx.y, 0);
  } else {
    const int row_tiles = (a.W.rows + S::BM - 1) / S::BM;
    int e = 0, first = 0;  // expert e's items are [first, first + its item count)
    for (int w = blockIdx.x;; w += gridDim.x) {
      // Items only grow, so the walk over the experts resumes where the previous one stopped.
      while (e < a.n_expert) {
        const int items = (a.count[e] + S::BN - 1) / S::BN * row_tiles;
        if (w < first + items) break;
        first += items;
        ++e;
      }
      if (e == a.n_expert) return;
      const int rem = w - first;
      gemm_tile<S>(a, smem, rem % row_tiles, rem / row_tiles, e);
      __syncthreads();  // the next tile's prologue overwrites the stage the slowest warps may still read
    }
  }
}

// ==== integer path (Q4_K, Q5_K, Q6_K; see the top comment) ==========================================

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

constexpr bool is_i8_type(uint32_t t) { return t == layout::Q4_K || t == layout::Q5_K || t == layout::Q6_K; }
// MOE_CUDA_GEMM_I8=0 sends these types to the fp32 path too (comparisons, bisecting).
bool i8_enabled() {
  const char* v = std::getenv("MOE_CUDA_GEMM_I8");
  return !(v && v[0] == '0');
}

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
constexpr int kMaxItemExperts = 512;  // the item table's capacity (larger expert counts: fp32 path; ISmem::MAX)

__device__ __forceinline__ void cp_async16z(void* dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

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
      float rs[S::MT][2];  // d * sc of rows g, g + 8 (exact small integer sc, one rounding)
#pragma unroll
      for (int i = 0; i < S::MT; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if constexpr (T == layout::Q4_K) A[i][r] = q4k_codes(qw[i][r], hi);
          else A[i][r] = q5k_codes(qw[i][r], qh[i][r], j, hi);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) rs[i][h] = scaled_int(dd[i][h], kMagicBits + byte_u(scw[i][h][j >> 2], j & 3), nd[i][h]);
      }
#pragma unroll
      for (int n = 0; n < S::NJ; ++n) {
        if (n >= nj) break;
        const uint4 b = av.bq[bq_index(8 * n + g, j, t)];
        const uint2 bc = av.bc[bc_index(8 * n + g, j, t)];
        float ts[2], k[2];
        av.scales(j, n, t, ts, k);
#pragma unroll
        for (int i = 0; i < S::MT; ++i) {
          uint32_t da[4], db[4], dc[4];
          mma_k32(da, A[i], b.x, b.y, kMagicA);
          mma_k32(db, A[i], b.z, b.w, kMagicB);
          mma_k32(dc, A[i], bc.x, bc.y, kMagicC);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[i][n][e] = fma_rn(rs[i][e >> 1], digit_value(da[e], db[e], dc[e], ts[e & 1], k[e & 1]), acc[i][n][e]);
        }
      }
    }
  }
  // The minimums: acc -= dmin * sum_j m_j * s_j * (sum of X over slice j), the sum over j by tf32
  // MMAs with A = m (exact) and B = the slice sums split in hi + mid + lo.
  uint32_t am[S::MT][4];
  float dmin[S::MT][2];
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
    am[i][0] = f2u(small_u2f(byte_u(m[0][0], t)));  // row g, k = t
    am[i][1] = f2u(small_u2f(byte_u(m[1][0], t)));  // row g + 8, k = t
    am[i][2] = f2u(small_u2f(byte_u(m[0][1], t)));  // row g, k = t + 4
    am[i][3] = f2u(small_u2f(byte_u(m[1][1], t)));  // row g + 8, k = t + 4
  }
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
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
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
      for (int hi = 0; hi < 2; ++hi) {
        const int k = kk + 2 * hi, j = 4 * n_ + k;
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
#pragma unroll
        for (int n = 0; n < S::NJ; ++n) {
          if (n >= nj) break;
          const uint4 b = av.bq[bq_index(8 * n + g, j, t)];
          const uint2 bc = av.bc[bc_index(8 * n + g, j, t)];
          float ts[2], kk2[2];
          av.scales(j, n, t, ts, kk2);
#pragma unroll
          for (int i = 0; i < S::MT; ++i) {
            uint32_t da0[4], db0[4], dc0[4], da1[4], db1[4], dc1[4];
            mma_k16(da0, A[i][0], A[i][1], b.x, kMagicA);
            mma_k16(db0, A[i][0], A[i][1], b.z, kMagicB);
            mma_k16(dc0, A[i][0], A[i][1], bc.x, kMagicC);
            mma_k16(da1, A[i][2], A[i][3], b.y, kMagicA);
            mma_k16(db1, A[i][2], A[i][3], b.w, kMagicB);
            mma_k16(dc1, A[i][2], A[i][3], bc.y, kMagicC);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float s = ts[e & 1], o = kk2[e & 1];
              const float v0 = fma_rn(rs[i][e >> 1][0], digit_value(da0[e], db0[e], dc0[e], s, o), acc[i][n][e]);
              acc[i][n][e] = fma_rn(rs[i][e >> 1][1], digit_value(da1[e], db1[e], dc1[e], s, o), v0);
            }
          }
        }
      }
    }
  }
}

template <class S, uint32_t T>
__global__ void __launch_bounds__(S::THREADS, S::MIN_BLOCKS) igemm_kernel(GemmArgs a) {
  using Q = QT<T>;
  using M = ISmem<S, T>;
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
  constexpr int CPR = Q::BB / 16, CHUNKS = S::BMV * CPR;
  int wi = -1;
  Item wit{};
  auto issue_w = [&](int s, const Cursor& c) {
    if (c.i != wi) {
      wi = c.i;
      wit = item_of(wi);
    }
    uint8_t* dst = wbuf + (s & 1) * M::W;
#pragma unroll
    for (int q = tid; q < CHUNKS; q += S::THREADS) {
      const int v = q / CPR, ch = q - v * CPR;  // virtual row, chunk
      const bool up = S::GATEUP && v >= S::BM;
      const Mat& wm = up ? a.W2 : a.W;
      const int r = wit.row0 + (up ? v - S::BM : v);
      const bool ok = r < a.W.rows;  // past the last row: zeros
      const uint8_t* src = wm.data + (S::GROUPED ? wit.e * wm.expert_stride : 0) +
                           static_cast<int64_t>(ok ? r : 0) * wm.row_stride + c.kt * Q::BB + 16 * ch;
      cp_async16z(dst + v * Q::PITCH + 16 * ch, src, ok);
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
      cp_async16z(dst, src, true);
      cp_async16z(dst + 32, src + 16, true);
    }
  };
  // Quantizes the landed activations of stage s into its B registers (see dev::i8 and the top comment).
  auto quant_x = [&](int s) {
    const ActView<S, T> av(abuf + (s & 1) * M::ACT);
    const int j = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < S::XPW; ++m) {
      const int n = warp + S::WM * m;
      float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (xmask >> m & 1) {
        const float4 v0 = land[n * 64 + lane], v1 = land[n * 64 + 32 + lane];
        x[0] = v0.x, x[1] = v0.y, x[2] = v0.z, x[3] = v0.w, x[4] = v1.x, x[5] = v1.y, x[6] = v1.z, x[7] = v1.w;
      }
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
  };

  float acc[S::MT][S::NJ][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int n = 0; n < S::NJ; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;

  // The pipeline. Iteration s multiplies stage s while stage s + 1's weights land and stage s + 1's
  // activations (landed during iteration s - 1) are quantized; stage s + 2's activations are issued
  // once this thread has read its slots. cp.async groups, oldest first: ..., X(s+1), W(s+1), X(s+2).
  Cursor cw, cx, cs;  // the next stage to issue weights for, to issue activations for, to multiply
  issue_w(0, cw);
  cw.next(n_k);
  cp_async_commit();
  issue_x(cx);
  cx.next(n_k);
  cp_async_commit();
  cp_async_wait_all();
  quant_x(0);
  if (n_st > 1) {
    issue_x(cx);
    cx.next(n_k);
  }
  cp_async_commit();
  __syncthreads();

  int ci = -1;
  Item cit{};
  for (int s = 0; s < n_st; ++s) {
    if (s + 1 < n_st) {
      issue_w(s + 1, cw);
      cw.next(n_k);
    }
    cp_async_commit();
    cp_async_wait_1();  // X(s + 1)
    if (s + 1 < n_st) quant_x(s + 1);
    if (s + 2 < n_st) {
      issue_x(cx);
      cx.next(n_k);
    }
    cp_async_commit();

    if (cs.i != ci) {
      ci = cs.i;
      cit = item_of(ci);
    }
    const int nj = min(S::NJ, (cit.cnt + 7) >> 3);
    const uint8_t* Ws = wbuf + (s & 1) * M::W;
    const uint8_t* act = abuf + (s & 1) * M::ACT;
    if constexpr (T == layout::Q6_K) stage_q6k<S>(Ws, act, nj, acc);
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
    cp_async_wait_1();  // W(s + 1)
    __syncthreads();
  }
}

// Elements and bytes per quant block, for prefetch_group.
void set_geometry(const Mat& M, int& be, int& bb) {
  be = static_cast<int>(layout::block_elems(M.type));
  bb = static_cast<int>(layout::dev_block_bytes(M.type));
  if (be == 0) be = 1;  // unsupported types are rejected on the host; keep the arithmetic defined
}

template <class S>
cudaError_t launch(const GemmArgs& a, int row_tiles, int tok_tiles, int n_expert, cudaStream_t s) {
  if (row_tiles <= 0 || tok_tiles <= 0 || n_expert <= 0) return cudaSuccess;
  // Once per instantiation: allow the dynamic shared memory above the default 48 KiB.
  static const cudaError_t attr =
      cudaFuncSetAttribute(gemm_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::SMEM));
  if (attr != cudaSuccess) return attr;
  dim3 grid(row_tiles, tok_tiles, 1);
  if (S::GROUPED) {
    // Grouped: as many blocks as fit on the GPU at once (so none waits for a second wave), and no
    // more than there can be work items.
    static int per_sm = 0;
    static const cudaError_t occ =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemm_kernel<S>, S::THREADS, S::SMEM);
    if (occ != cudaSuccess) return occ;
    const int64_t items = static_cast<int64_t>(row_tiles) * tok_tiles * n_expert;
    const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
    grid = dim3(static_cast<unsigned>(items < resident ? items : resident), 1, 1);
  }
  gemm_kernel<S><<<grid, S::THREADS, S::SMEM, s>>>(a);
  return cudaGetLastError();
}

// The codes form of shape SH where the weights allow it (the tile sizes do not depend on it).
template <template <bool> class SH>
cudaError_t launch_codes(bool codes, const GemmArgs& a, int row_tiles, int tok_tiles, int n_expert, cudaStream_t s) {
  return codes ? launch<SH<true>>(a, row_tiles, tok_tiles, n_expert, s)
               : launch<SH<false>>(a, row_tiles, tok_tiles, n_expert, s);
}

template <class S>
int tiles(int n, bool rows_dim) {
  const int b = rows_dim ? S::BM : S::BN;
  return (n + b - 1) / b;
}

int64_t ceil_div(int64_t n, int64_t b) { return (n + b - 1) / b; }

// The integer kernel for shape S and type T over at most max_items work items (grouped: the counts
// are on the device, so the grid is what is resident and blocks without items exit at once).
template <class S, uint32_t T>
cudaError_t launch_i8_t(const GemmArgs& a, int64_t max_items, cudaStream_t s) {
  using M = ISmem<S, T>;
  const int n_e = S::GROUPED ? a.n_expert : 1;
  if (max_items <= 0 || n_e <= 0) return cudaSuccess;
  // Once per instantiation: the shared-memory limit and the residency at the largest item table.
  static_assert(M::MAX == M::bytes(S::GROUPED ? kMaxItemExperts : 1), "ISmem::MAX");
  constexpr size_t kMaxSmem = M::MAX;
  static const cudaError_t attr = cudaFuncSetAttribute(igemm_kernel<S, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(kMaxSmem));
  if (attr != cudaSuccess) return attr;
  static int per_sm = 0;
  static const cudaError_t occ =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, igemm_kernel<S, T>, S::THREADS, kMaxSmem);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
  const unsigned grid = static_cast<unsigned>(max_items < resident ? max_items : resident);
  igemm_kernel<S, T><<<grid, S::THREADS, M::bytes(n_e), s>>>(a);
  return cudaGetLastError();
}

template <class S>
cudaError_t launch_i8(const GemmArgs& a, int64_t max_items, cudaStream_t s) {
  switch (a.W.type) {
    case layout::Q4_K: return launch_i8_t<S, layout::Q4_K>(a, max_items, s);
    case layout::Q5_K: return launch_i8_t<S, layout::Q5_K>(a, max_items, s);
    case layout::Q6_K: return launch_i8_t<S, layout::Q6_K>(a, max_items, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t gemm(const Mat& W, const float* X, int x_stride, int n_tok, float* Y, int y_stride, bool accumulate,
                 cudaStream_t s) {
  GemmArgs a{};
  a.W = W;
  set_geometry(W, a.be, a.bb);
  a.X = X;
  a.x_stride = x_stride;
  a.Y = Y;
  a.y_stride = y_stride;
  a.accumulate = accumulate;
  a.n_tok = n_tok;
  if (is_i8_type(W.type) && i8_enabled()) {
    // The wide tile quantizes each activation for 4x the rows, but needs enough items to fill the GPU.
    const int64_t wide = ceil_div(W.rows, IWide::BM) * ceil_div(n_tok, IWide::BN);
    if (4 * wide >= 3 * sm_count()) return launch_i8<IWide>(a, wide, s);
    return launch_i8<ISmall>(a, ceil_div(W.rows, ISmall::BM) * ceil_div(n_tok, ISmall::BN), s);
  }
  // The wide tile does half the dequantization per product, but only pays off with enough tiles to
  // keep every SM busy (~1.5 blocks each); otherwise the small tile's 4x more blocks win.
  const int wide = tiles<ShapeWide<false>>(W.rows, true) * tiles<ShapeWide<false>>(n_tok, false);
  if (2 * wide >= 3 * sm_count())
    return launch_codes<ShapeWide>(is_code_type(W.type), a, tiles<ShapeWide<false>>(W.rows, true),
                                   tiles<ShapeWide<false>>(n_tok, false), 1, s);
  const int small = tiles<ShapeSmall<false>>(W.rows, true) * tiles<ShapeSmall<false>>(n_tok, false);
  if (small >= sm_count())
    return launch_codes<ShapeSmall>(is_code_type(W.type), a, tiles<ShapeSmall<false>>(W.rows, true),
                                    tiles<ShapeSmall<false>>(n_tok, false), 1, s);
  return launch_codes<ShapeTiny>(is_code_type(W.type), a, tiles<ShapeTiny<false>>(W.rows, true),
                                 tiles<ShapeTiny<false>>(n_tok, false), 1, s);
}

cudaError_t expert_gate_up_grouped(const Mat& G, const Mat& U, const float* h, int h_stride, const int* count,
                                   const int* offset, const int32_t* token_of_slot, int n_expert, int max_count,
                                   float* act, cudaStream_t s) {
  GemmArgs a{};
  a.W = G;
  a.W2 = U;
  set_geometry(G, a.be, a.bb);
  set_geometry(U, a.be2, a.bb2);
  a.X = h;
  a.x_stride = h_stride;
  a.x_rows = token_of_slot;
  a.Y = act;
  a.y_stride = G.rows;
  a.count = count;
  a.offset = offset;
  a.n_expert = n_expert;
  if (G.type == U.type && is_i8_type(G.type) && n_expert <= kMaxItemExperts && i8_enabled())
    return launch_i8<IGateUp>(a, n_expert * ceil_div(G.rows, IGateUp::BM) * ceil_div(max_count, IGateUp::BN), s);
  return launch_codes<ShapeGateUp>(is_code_type(G.type) && is_code_type(U.type), a,
                                   tiles<ShapeGateUp<false>>(G.rows, true), tiles<ShapeGateUp<false>>(max_count, false),
                                   n_expert, s);
}

cudaError_t expert_down_grouped(const Mat& D, const float* act, const int* count, const int* offset, int n_expert,
                                int max_count, float* out, cudaStream_t s) {
  GemmArgs a{};
  a.W = D;
  set_geometry(D, a.be, a.bb);
  a.X = act;
  a.x_stride = D.cols;
  a.Y = out;
  a.y_stride = D.rows;
  a.count = count;
  a.offset = offset;
  a.n_expert = n_expert;
  if (is_i8_type(D.type) && n_expert <= kMaxItemExperts && i8_enabled())
    return launch_i8<IDown>(a, n_expert * ceil_div(D.rows, IDown::BM) * ceil_div(max_count, IDown::BN), s);
  return launch_codes<ShapeDown>(is_code_type(D.type), a, tiles<ShapeDown<false>>(D.rows, true),
                                 tiles<ShapeDown<false>>(max_count, false), n_expert, s);
}

}  // namespace moe::cuda::k
