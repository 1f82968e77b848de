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
// are persistent: each walks the list of (expert, row tile, token tile) items, with a stride of the
// grid or (grouped, GemmArgs::ticket) drawing its next item from a counter shared by the grid (the
// items' costs differ with their token counts: with fixed shares ~15 % of the SM time was idle at
// the end), and the pipeline runs across item boundaries (the expert down projection has only three
// stages per item). Shared memory (ISmem): 162-210 KB per block for the shapes of one block per
// SM (Q4_K-Q6_K; 6 KB more for the grouped item table), 106-112 KB for ISmall. The fp16 path
// (HSmem) has no landing area: two stages of weight rows and of records, 150-198 KB (ISmall ~100).
//
// MOE_CUDA_GEMM_I8=0 turns both off (the K-quants then take the fp32 path).
//
// Code: gemm_kq_common.cuh (shapes, row geometry, what both paths read of a stage's headers),
// gemm_kq_i8.cuh (the integer path's staging and stage products), gemm_kq_h16.cuh (the fp16 path's
// split and stage products); this file: the kernel's item walk and pipeline, the launches and the
// host entry points.
#include <type_traits>

#include "common.cuh"
#include "gemm.cuh"
#include "gemm_kq_common.cuh"
#include "gemm_kq_h16.cuh"
#include "gemm_kq_i8.cuh"
#include "mma.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

using namespace dev::i8;

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
  int* ring = off_e + n_e;  // dynamic walk: the item of a block's i-th, at ring[i & 3]
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
  if (static_cast<int>(blockIdx.x) >= total) return;
  // A block's items: its first is blockIdx.x; then, statically, every gridDim.x-th, or (dynamic walk,
  // a.ticket) the next of a counter that all blocks draw from (items differ in cost with their token
  // count: a static share leaves SMs idle at the end). Item i's place in the walk, and whether it exists:
  const bool dyn = a.ticket != nullptr;
  auto walk_of = [&](int i) { return dyn ? ring[i & 3] : static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x); };
  // Stages are issued LEAD ahead of their products (the integer path's activations two), so the dynamic
  // walk draws item i >= 1 at the top of iteration i n_k - LEAD - 1 (before the loop when that is
  // negative) and the iteration's closing barrier publishes it before stage i n_k is first issued;
  // at iteration s the ring holds the items of stages s .. s + LEAD + 1 (at most 4).
  constexpr int LEAD = H ? 1 : 2;
  auto draw = [&](int i) {
    if (tid == 0) ring[i & 3] = static_cast<int>(gridDim.x) + atomicAdd(a.ticket, 1);
  };
  if (dyn) {
    if (tid == 0) ring[0] = static_cast<int>(blockIdx.x);
    for (int i = 1; i * n_k <= LEAD; ++i) draw(i);
    __syncthreads();
  }

  auto item_of = [&](int i) {
    const int w = walk_of(i);
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
    if (walk_of(cx.i) < total) {  // stage 1 exists
      issue_x(cx);
      cx.next(n_k);
    }
    cp_async_commit();
  }
  __syncthreads();

  int ci = -1;
  Item cit{};
  for (int s = 0;; ++s) {
    if (dyn && (s + LEAD + 1) % n_k == 0) draw((s + LEAD + 1) / n_k);
    const bool more = walk_of(cw.i) < total;  // stage s + 1 exists (cw: its cursor)
    if (more) {
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
      if (more) quant_x(s + 1);
      if (walk_of(cx.i) < total) {  // stage s + 2 exists
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
    // fp16 path: a full token tile (nj == NJ) runs Q4_K/Q5_K's stage as straight-line code, where the
    // next slice's A build overlaps this slice's MMAs (with a branch per token group in between ptxas
    // keeps them apart; the Q6_K stage's straight-line form spills, so it keeps the branches).
    if constexpr (H && T == layout::Q6_K) {
      stage_q6k_h<S>(Ws, act, nj, acc);
    } else if constexpr (H) {
      if (nj == S::NJ) stage_kq_h<S, T, true>(Ws, act, nj, acc);
      else stage_kq_h<S, T, false>(Ws, act, nj, acc);
    }
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
    if (!more) break;
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

cudaError_t rmsnorm_split_h16(const float* x, const float* w, int n, int cols, int stride, float eps, float* out,
                              void* rec, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  if (cols % KS != 0 || stride % 4 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) return cudaErrorInvalidValue;
  rmsnorm_split_kernel<<<n, 256, 0, s>>>(x, w, cols, stride, eps, out, static_cast<uint4*>(rec));
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
