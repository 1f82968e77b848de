// Prefill GEMMs on the fp32 path (the host entry points in gemm.cu): every weight type except the
// K-quants that take the integer path (gemm_kq.cu), dense or grouped by expert.
//
// Tiles of dequantized values (or, for Q4_0, Q5_0, Q8_0, codes) one 32-column slice at a time, 3xTF32
// on mma.sync m16n8k8: every fp32 operand is split into a tf32 hi part and a tf32 lo remainder and a
// product is a_hi*b_hi + a_hi*b_lo + a_lo*b_hi with fp32 accumulation; the dropped a_lo*b_lo term is
// ~2^-22 relative. The tensor cores' fp32 accumulation truncates, so each slice is summed in fresh
// registers and added to the running total with an ordinary round-to-nearest add. Codes are exact in
// tf32, so for the code types only the activations are split (2 MMAs per product) and the slice's
// sums are scaled per row in fp32.
#include "common.cuh"
#include "gemm.cuh"
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
    cp_async_wait<0>();
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

// ---- small F32 matrices (the MoE router, 128 x 2,048) ------------------------------------------------
// Tiled for the tensor cores such a matrix gives a few row tiles whose K loops are latency chains
// (ncu: 106 us per layer at 1.38 GHz for a 512-token prefill, 8 % of the SMs' throughput). Plain fp32
// FMAs instead: a block = 64 rows x 8 tokens, the tokens' activations staged in shared memory 1,024
// columns at a time; warp w owns rows 8w..8w+7 of the block, its lanes split the columns (one float4
// each, eight rows' weights loaded together), and one butterfly per (row, token) ends it.
constexpr int kRowsRows = 64, kRowsTok = 8, kRowsK = 1024;

__global__ void __launch_bounds__(256) rows_f32_kernel(GemmArgs a) {
  __shared__ float4 xs[kRowsTok][kRowsK / 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.x * kRowsTok, r0 = blockIdx.y * kRowsRows + 8 * warp;
  const int K = a.W.cols;
  const float* rowp[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    rowp[i] = reinterpret_cast<const float*>(a.W.data + static_cast<int64_t>(min(r0 + i, a.W.rows - 1)) * a.W.row_stride);
  float acc[8][kRowsTok];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int t = 0; t < kRowsTok; ++t) acc[i][t] = 0.f;
  for (int k0 = 0; k0 < K; k0 += kRowsK) {
    const int kn = min(kRowsK, K - k0);
    __syncthreads();  // the previous chunk is no longer read
    for (int i = threadIdx.x; i < kRowsTok * (kn / 4); i += blockDim.x) {
      const int t = i / (kn / 4), c = i - t * (kn / 4);
      xs[t][c] = t0 + t < a.n_tok ? *reinterpret_cast<const float4*>(a.X + static_cast<int64_t>(t0 + t) * a.x_stride + k0 + 4 * c)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    for (int c = lane; c < kn / 4; c += 32) {
      float4 w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = __ldg(reinterpret_cast<const float4*>(rowp[i] + k0) + c);
#pragma unroll
      for (int t = 0; t < kRowsTok; ++t) {
        const float4 x = xs[t][c];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float v = acc[i][t];
          v = fmaf(w[i].x, x.x, v);
          v = fmaf(w[i].y, x.y, v);
          v = fmaf(w[i].z, x.z, v);
          v = fmaf(w[i].w, x.w, v);
          acc[i][t] = v;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int t = 0; t < kRowsTok; ++t) {
      const float v = warp_sum(acc[i][t]);
      if (lane == ((i * kRowsTok + t) & 31) && r0 + i < a.W.rows && t0 + t < a.n_tok) {
        float* y = a.Y + static_cast<int64_t>(t0 + t) * a.y_stride + r0 + i;
        *y = a.accumulate ? *y + v : v;
      }
    }
}

}  // namespace

cudaError_t gemm_float(GemmOp op, const GemmArgs& a, int n, cudaStream_t s) {
  switch (op) {
    case GemmOp::dense: {
      if (a.W.type == layout::F32 && a.W.rows <= 512 && a.W.cols % 4 == 0 && a.x_stride % 4 == 0 &&
          a.W.row_stride % 16 == 0 && reinterpret_cast<uintptr_t>(a.X) % 16 == 0) {
        const dim3 grid((n + kRowsTok - 1) / kRowsTok, (a.W.rows + kRowsRows - 1) / kRowsRows);
        rows_f32_kernel<<<grid, 256, 0, s>>>(a);
        return cudaGetLastError();
      }
      // The wide tile does half the dequantization per product, but only pays off with enough tiles
      // to keep every SM busy (~1.5 blocks each); otherwise the small tile's 4x more blocks win.
      const int wide = tiles<ShapeWide<false>>(a.W.rows, true) * tiles<ShapeWide<false>>(n, false);
      if (2 * wide >= 3 * sm_count())
        return launch_codes<ShapeWide>(is_code_type(a.W.type), a, tiles<ShapeWide<false>>(a.W.rows, true),
                                       tiles<ShapeWide<false>>(n, false), 1, s);
      const int small = tiles<ShapeSmall<false>>(a.W.rows, true) * tiles<ShapeSmall<false>>(n, false);
      if (small >= sm_count())
        return launch_codes<ShapeSmall>(is_code_type(a.W.type), a, tiles<ShapeSmall<false>>(a.W.rows, true),
                                        tiles<ShapeSmall<false>>(n, false), 1, s);
      return launch_codes<ShapeTiny>(is_code_type(a.W.type), a, tiles<ShapeTiny<false>>(a.W.rows, true),
                                     tiles<ShapeTiny<false>>(n, false), 1, s);
    }
    case GemmOp::gate_up:
      return launch_codes<ShapeGateUp>(is_code_type(a.W.type) && is_code_type(a.W2.type), a,
                                       tiles<ShapeGateUp<false>>(a.W.rows, true), tiles<ShapeGateUp<false>>(n, false),
                                       a.n_expert, s);
    case GemmOp::down:
      return launch_codes<ShapeDown>(is_code_type(a.W.type), a, tiles<ShapeDown<false>>(a.W.rows, true),
                                     tiles<ShapeDown<false>>(n, false), a.n_expert, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe::cuda::k
