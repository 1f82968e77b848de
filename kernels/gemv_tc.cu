// Decode matrix-vector products of the K-quant types (Q4_K, Q5_K, Q6_K) on the tensor cores.
//
// Why: dequantizing 4- to 6-bit weights to fp32 and multiplying on the FMA pipe costs ~4 instructions
// per weight, which made the SIMT GEMVs compute- and instruction-fetch-bound far below the memory
// bandwidth; a decode GEMV is a chain of dependent instructions per warp, so every instruction per
// weight costs latency. Here the quant codes go unscaled into an integer MMA (mma.m16n8k32 u8 x s8:
// 16 rows x 32 codes per instruction, the codes need only a mask and a shift), and the block scales
// are applied in int32 per sub-block and in fp32 per super-block.
//
// Accuracy: x is quantized per group of 256 to 24-bit integers split in three int8 B columns (tc.cuh),
// i.e. ~1.2e-7 of the group's largest element (fp32-level); the products and sums are exact in int32.
// That is 2^16 times finer than the 8-bit Q8_K activations llama.cpp multiplies K-quants with on the CPU.
//
// Layout of the work: a block owns 16 consecutive output rows (the MMA's M); its warps split the
// super-blocks of the (possibly segmented) input. Lane (g = lane / 4, t = lane % 4) loads rows g and
// g + 8; for each 32-element group the MMA's k positions 4t..4t+3 and 16+4t..16+4t+3 hold the lane's
// eight consecutive quant bytes 8t..8t+7 (one 8-byte load), and x is staged in the same order (tc.cuh).
#include <algorithm>
#include <cstdlib>

#include "gemv_tc.cuh"
#include "tc.cuh"
#include "trace.cuh"

namespace moe::cuda::k {
using namespace tc;

namespace {

// ---- dense: up to three matrices sharing x ------------------------------------------------------------
// A block stages x once and then runs 16-row tiles blockIdx.x, + gridDim.x, ...: one tile per block for
// the per-layer matrices (their tile counts fit one wave), many for the LM head, whose 9,496 tiles would
// otherwise each pay for staging x.
// Eight warps per tile, one K-quant super-block each for the usual 2,048 columns: measured faster than
// four warps with the next super-block's loads pipelined (BM_Decode/0 332 vs 321 tok/s).
constexpr int NW = 8;

// The router's columns of one tile for the O projection with the routing (o_proj_router): thread c < n
// the 16 weights R[c][r0..r0+15], thread i < 16 the gain of row r0 + i. Weights: loaded before they are
// needed, while the tile's MMAs run.
struct RouterCols {
  float4 w[4];
  float gain;
};
__device__ __forceinline__ void load_router_cols(const GemvArgs& a, int rows, int r0, RouterCols& rc) {
  const int c = threadIdx.x;
  if (c < a.racc.n) {
    const float* p = a.router + c * a.router_stride + r0;
    if (r0 + 16 <= rows) {
#pragma unroll
      for (int q = 0; q < 4; ++q) rc.w[q] = __ldg(reinterpret_cast<const float4*>(p) + q);
    } else {
      float* f = reinterpret_cast<float*>(rc.w);
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = r0 + i < rows ? __ldg(p + i) : 0.f;
    }
  }
  if (c < 16) rc.gain = r0 + c < rows ? __ldg(a.router_norm + r0 + c) : 0.f;
}

// a.racc.acc[c] += the tile's Σ_i R[c][r0 + i] s_y[i] and acc[n] += Σ_i y_i² (y_i = the new x of the
// tile's rows, held by lanes 0-15 of warp 0), in fixed point (launch.cuh: units of 2^-32 ref and
// 2^-32 ref²). ref is read here, not at its load: its L2 round trip is then hidden behind the MMAs. The
// clamps keep a sum of up to 512 partials inside int64 whatever the input.
__device__ __forceinline__ long long to_fixed(float v) {
  return __float2ll_rn(fminf(fmaxf(v, -1.8e16f), 1.8e16f));  // 2^54 = 1.8e16
}
__device__ __forceinline__ void add_router_partial(const GemvArgs& a, const RouterCols& rc, const float* s_y,
                                                   float y, float ref) {
  ref = ref_or_one(ref);
  const float unit = kFixedUnit / ref;
  unsigned long long* acc = reinterpret_cast<unsigned long long*>(a.racc.acc);
  if (threadIdx.x < 32) {
    float q = threadIdx.x < 16 ? y * y : 0.f;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (threadIdx.x == 0) atomicAdd(acc + a.racc.n, static_cast<unsigned long long>(to_fixed(q * unit / ref)));
  }
  if (static_cast<int>(threadIdx.x) >= a.racc.n) return;
  const float* f = reinterpret_cast<const float*>(rc.w);
  float p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    p0 = fmaf(f[i], s_y[i], p0);
    p1 = fmaf(f[i + 1], s_y[i + 1], p1);
  }
  atomicAdd(acc + threadIdx.x, static_cast<unsigned long long>(to_fixed((p0 + p1) * unit)));
}

// The O projection's input from the decode attention's deferred slices (AttSlices, launch.cuh): how many
// slices the position's context has when the attention left them here (2 .. defer), else 0.
__device__ __forceinline__ int deferred_slices(const AttSlices& at, int pos) {
  if (at.defer < 2 || !at.partials) return 0;
  int chunk;
  const int n = dec_slices(pos + 1, at.n_split, at.min_chunk, chunk);
  return n >= 2 && n <= at.defer ? n : 0;
}
// stage_load's registers of x from the n slices: each float4 of x (a run of 32 lanes lies in one head:
// head_dim a multiple of 128, checked on the host) is Σ_s O_s L_s exp(m_s - M) / Σ_s L_s exp(m_s - M)
// (O_s: the slice's normalised output, fp16), with the same operations in the same order as the
// attention's merge (attention_decode_item), so the same floats. Lane s < n loads slice s's m and L;
// every slice's four fp16 values go out at once (one round trip).
// Where each float4 of x comes from in the slices (a head's first slice record, the element in the head):
// thread-index arithmetic with divisions, done before the wait (slice_at) rather than on the loads' path.
template <int R>
struct SliceAt {
  const float* p[R];  // null: past the columns
  int d[R];
};
template <int R>
__device__ __forceinline__ void slice_at(const AttSlices& at, int cols, SliceAt<R>& sa) {
  const int groups = cols >> 8, nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int HD = at.head_dim, G = at.group, PS = attention_partial_stride(HD);
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int g = warp + (k >> 1) * nw, e = 4 * (g * 64 + (k & 1) * 32 + lane);
    sa.p[k] = nullptr;
    sa.d[k] = 0;
    if (g < groups) {
      const int h = e / HD, kv = h / G, hl = h - kv * G;
      sa.d[k] = e - h * HD;
      sa.p[k] = at.partials + (static_cast<int64_t>(kv) * at.n_split * G + hl) * PS;
    }
  }
}
template <int R>
__device__ __forceinline__ void stage_load_slices(const AttSlices& at, int n, int cols, const SliceAt<R>& sa,
                                                  XLoad<R>& l) {
  constexpr int NM = kAttMaxDefer;
  const int lane = threadIdx.x & 31;
  const int HD = at.head_dim, G = at.group, PS = attention_partial_stride(HD);
  const int64_t ss = static_cast<int64_t>(G) * PS;  // slice stride
  float mv[R], lv[R];
  uint2 pv[R][NM];  // four fp16 values
#pragma unroll
  for (int k = 0; k < R; ++k) {
    mv[k] = -INFINITY;
    lv[k] = 0.f;
    if (sa.p[k]) {
      const float* p = sa.p[k];
      const int d = sa.d[k];
      if (lane < n) {
        mv[k] = __ldcg(p + lane * ss + HD / 2);
        lv[k] = __ldcg(p + lane * ss + HD / 2 + 1);
      }
#pragma unroll
      for (int s = 0; s < NM; ++s)
        if (s < n) pv[k][s] = __ldcg(reinterpret_cast<const uint2*>(reinterpret_cast<const __half*>(p + s * ss) + d));
    }
  }
#pragma unroll
  for (int k = 0; k < R; ++k) {
    if (!sa.p[k]) continue;  // past the columns (slice_at; uniform over the warp)
    const float M = warp_max(mv[k]);
    const float w = lane < n ? expf(mv[k] - M) : 0.f;
    float Ls = 0.f;
    for (int s = 0; s < n; ++s) Ls = fmaf(__shfl_sync(0xffffffffu, lv[k], s), __shfl_sync(0xffffffffu, w, s), Ls);
    const float inv = 1.f / Ls;
    const float cw = w * lv[k];  // slice `lane`'s weight exp(m - M) L
    float4 a[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) a[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [](float4& t, const uint2& h, float ws) {
      const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
      const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
      t.x = fmaf(lo.x, ws, t.x);
      t.y = fmaf(lo.y, ws, t.y);
      t.z = fmaf(hi.x, ws, t.z);
      t.w = fmaf(hi.y, ws, t.w);
    };
    // the attention's four chains: slices 4i + c to chain c, the slices past the last full four to chain 0
    const int full = n & ~3;
#pragma unroll
    for (int s = 0; s < NM; ++s) {
      if (s >= n) break;
      const float ws = __shfl_sync(0xffffffffu, cw, s);
      if (s < full)  // static indices: a runtime index into a[] costs selects (or local memory)
        add(a[s & 3], pv[k][s], ws);
      else
        add(a[0], pv[k][s], ws);
    }
    l.x[k] = make_float4(((a[0].x + a[1].x) + (a[2].x + a[3].x)) * inv, ((a[0].y + a[1].y) + (a[2].y + a[3].y)) * inv,
                         ((a[0].z + a[1].z) + (a[2].z + a[3].z)) * inv, ((a[0].w + a[1].w) + (a[2].w + a[3].w)) * inv);
  }
}

// kSm: the tile's rows are in shared memory at srows (16 rows' room, the tile's first row first).
template <uint32_t T, bool kPipe, int kW, bool kSm = false, bool kPad = false>
__device__ __forceinline__ void tc_gemv_tile(const GemvArgs& a, const Mat& W, float* y, int r0, const XQ& xq,
                                             float (*part)[16], bool route, const RouterCols& rc, float* s_y,
                                             float ref, const uint8_t* srows = nullptr, bool has_pre = false,
                                             float pre = 0.f) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const uint8_t* base = kSm ? srows : W.data;
  const int rel = kSm ? 0 : r0, last = kSm ? min(16, W.rows - r0) - 1 : W.rows - 1;
  const uint8_t* rg;
  const uint8_t* r8;
  if constexpr (kPad) {  // rows in shared memory at their padded stride (32-bit arithmetic)
    const int rs = rows_smem_stride(static_cast<int>(W.row_stride));
    rg = base + min(g, last) * rs;
    r8 = base + min(g + 8, last) * rs;
  } else {
    rg = base + min(rel + g, last) * W.row_stride;
    r8 = base + min(rel + g + 8, last) * W.row_stride;
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile16<T, kPipe, kSm>([&](int, int i) { return i ? r8 : rg; }, [](int) { return 1.f; }, 1, a.cols / 256, warp, kW,
                        xq, acc);
  MOE_TRACE_MARK(4);
  warp_rows_to_smem(acc, part[warp]);
  __syncthreads();
  float nv = 0.f;
  if (threadIdx.x < 16) {
    if (r0 + static_cast<int>(threadIdx.x) < W.rows) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kW; ++w) v += part[w][threadIdx.x];
      float* yr = y + r0 + threadIdx.x;
      nv = a.accumulate ? (has_pre ? pre : *yr) + v : v;
      *yr = nv;
    }
    if (route) s_y[threadIdx.x] = nv * rc.gain;
  }
  __syncthreads();  // part (and s_y) are reused by the next tile
  if (route) add_router_partial(a, rc, s_y, nv, ref);
}

// The warp-tile kernel's (kWarpTiles: the LM head) stream of super-blocks through shared memory: each warp
// walks its tiles' super-blocks (16 rows each) with kLmStages of them in flight by cp.async into its own
// ring (no registers held while they travel: with loads into registers a warp had one super-block in
// flight, ~56 KB per SM, too little for the DRAM's latency), the first ones issued before the kernel's
// wait (weights do not depend on the previous kernel). All matrices of one type T (the host checks).
constexpr int kLmStages = 3;
__host__ __device__ inline size_t lm_ring_offset(int cols) { return (xq_smem(cols) + 15) / 16 * 16; }
__host__ __device__ constexpr size_t lm_ring_bytes(int warps) {  // room for the largest super-block (Q6_K)
  return static_cast<size_t>(warps) * kLmStages * 16 * sb_bytes<layout::Q6_K>();
}
// The first row of tile `tile` of a GemvArgs' matrices, and in m the matrix it belongs to.
__device__ __forceinline__ int tile_row0(const GemvArgs& a, int tile, int& m) {
  m = 0;
  while (tile >= a.tiles_before[m + 1]) ++m;
  return (tile - a.tiles_before[m]) * 16;
}
// The named barrier 1 + p of warps 2p and 2p + 1 (immediate ids: with an id in a register ptxas reserves
// all 16 of the block's barriers).
__device__ __forceinline__ void pair_barrier(int p) {
  switch (p) {
    case 0: asm volatile("bar.sync 1, 64;" ::: "memory"); break;
    case 1: asm volatile("bar.sync 2, 64;" ::: "memory"); break;
    case 2: asm volatile("bar.sync 3, 64;" ::: "memory"); break;
    case 3: asm volatile("bar.sync 4, 64;" ::: "memory"); break;
    case 4: asm volatile("bar.sync 5, 64;" ::: "memory"); break;
    case 5: asm volatile("bar.sync 6, 64;" ::: "memory"); break;
    case 6: asm volatile("bar.sync 7, 64;" ::: "memory"); break;
    default: asm volatile("bar.sync 8, 64;" ::: "memory"); break;
  }
}
// The order of a warp's super-blocks: its whole tiles w, w + W, ... (W warps in the grid), and with
// `halves` its share of the tiles left over by the last round. Those (lc of them, lc <= W / 2) are not
// each a whole tile of lc warps, which kept those warps one tile longer than the rest (LM head: 9,496
// tiles over 2,112 warps, 1,048 of them doing 5 and the others 4, ~15 us of a 75 us kernel after the
// median block had ended, trace): each goes to a pair of warps of one block (warps 2p and 2p + 1, p <
// kW / 2), the first half of its super-blocks to the even warp, the rest to the odd one, and the pair
// adds its two partial sums (named barrier 1 + p), the even warp's first: the same bits run to run.
// LM head 71.8 vs 76.7 us (trace), BM_Decode/0 +0.5 % (MOE_CUDA_LM_HALVES=0: whole tiles).
struct LmOrder {
  int total, full_end, stride, nsb, half_tile, sb0, sb1;
  __device__ LmOrder(int tiles, int n_sb, int kw, bool allow) : total(tiles), stride(gridDim.x * kw), nsb(n_sb) {
    const int warp = threadIdx.x >> 5, lc = tiles % stride;
    const bool halves = allow && kw % 2 == 0 && kw <= 16 && n_sb >= 2 && lc > 0 && 2 * lc <= stride;
    full_end = halves ? tiles - lc : tiles;
    const int pair_tile = blockIdx.x * (kw / 2) + warp / 2;
    half_tile = halves && pair_tile < lc ? full_end + pair_tile : -1;
    sb0 = warp & 1 ? n_sb / 2 : 0;
    sb1 = warp & 1 ? n_sb : n_sb / 2;
  }
  __device__ void first(int& tile, int& sb) const {
    const int gw = blockIdx.x * (stride / gridDim.x) + (threadIdx.x >> 5);
    tile = gw < full_end ? gw : half_tile >= 0 ? half_tile : total;
    sb = tile == half_tile ? sb0 : 0;
  }
  __device__ int end_sb(int tile) const { return tile == half_tile ? sb1 : nsb; }
  __device__ void next(int& tile, int& sb) const {
    if (tile >= total || ++sb < end_sb(tile)) return;
    if (tile == half_tile) {
      tile = total;
      return;
    }
    tile += stride;
    if (tile >= full_end) tile = half_tile >= 0 ? half_tile : total;
    sb = tile == half_tile ? sb0 : 0;
  }
};
template <uint32_t T, int kW>
struct LmPipe {
  static constexpr int BB = sb_bytes<T>();  // bytes of a row's super-block (a multiple of 16)
  const GemvArgs& a;
  uint8_t* ring;  // this warp's kLmStages x 16 rows x BB bytes
  LmOrder order;
  int it_tile, it_sb, slot;  // the next super-block to issue and its ring slot
  __device__ LmPipe(const GemvArgs& args, uint8_t* smem_base, int tiles)
      : a(args), order(tiles, args.cols / 256, kW, args.lm_pipe == 2), slot(0) {
    const int warp = threadIdx.x >> 5;
    ring = smem_base + lm_ring_offset(args.cols) + static_cast<size_t>(warp) * kLmStages * 16 * BB;
    order.first(it_tile, it_sb);
  }
  // issues the next super-block's copies (an empty group past the warp's last tile: the counts stay uniform)
  __device__ void issue() {
    if (it_tile < order.total) {
      const uint64_t pol = l2_evict_first(a.evict & kEvictLmHead);
      int m;
      const int r0 = tile_row0(a, it_tile, m);
      const Mat& W = a.outs[m].W;
      uint8_t* dst = ring + slot * 16 * BB;
      for (int c = threadIdx.x & 31; c < BB; c += 32) {  // BB 16-byte pieces: 16 rows of BB / 16
        const int rr = c / (BB / 16), cc = c - rr * (BB / 16);
        cp_async16(dst + rr * BB + cc * 16, W.data + min(r0 + rr, W.rows - 1) * W.row_stride + it_sb * BB + cc * 16,
                   pol);
      }
    }
    cp_async_commit();
    advance();
  }
  __device__ void advance() {
    order.next(it_tile, it_sb);
    slot = slot + 1 == kLmStages ? 0 : slot + 1;
  }
  // before the kernel's wait: the first kLmStages - 1 super-blocks
  __device__ void prologue() {
    for (int i = 0; i < kLmStages - 1; ++i) issue();
  }
  // after the staging of x: the rest (a fresh LmPipe: the prologue's super-blocks are skipped, not issued).
  // part16: this warp's 16 floats of shared memory, the next warp's right after them (LmOrder's pairs).
  __device__ void run(const XQ& xq, float* part16) {
    for (int i = 0; i < kLmStages - 1; ++i) advance();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    int tile, sb, cur = 0;
    order.first(tile, sb);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    while (tile < order.total) {
      cp_async_wait<kLmStages - 2>();  // this lane's copies of super-block `cur` have landed
      __syncwarp();                    // and every lane's; the slot issued next was read one step ago
      issue();
      const uint8_t* st = ring + cur * 16 * BB;
      SbRaw r;
      load_sb<T, true>(st + g * BB, st + (g + 8) * BB, t, r);
      mma_sb<T>(r, sb, 1.f, xq, g, t, acc);
      cur = cur + 1 == kLmStages ? 0 : cur + 1;
      if (sb + 1 == order.end_sb(tile)) {
        int m;
        const int r0 = tile_row0(a, tile, m);
        warp_rows_to_smem(acc, part16);
        __syncwarp();
        const bool half = tile == order.half_tile;
        if (half) pair_barrier(warp / 2);  // the pair's partials
        if ((!half || (warp & 1) == 0) && lane < 16 && r0 + lane < a.outs[m].W.rows) {
          float* yr = a.outs[m].y + r0 + lane;
          const float v = half ? part16[lane] + part16[16 + lane] : part16[lane];
          *yr = a.accumulate ? *yr + v : v;
        }
        __syncwarp();  // part16 is reused by the next tile (a half tile is a warp's last)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = 0.f;
      }
      order.next(tile, sb);
    }
    cp_async_wait<0>();
  }
};

// Every kernel here first has the SM's TMA pull its weight rows into L2 (bulk_prefetch_l2: the loads of
// x behind them are not delayed), stages x, and then loads the weights, by then on their way to L2.

// R: float4s of x per thread held in registers while staging (2: up to 2,048 columns, three blocks per
// SM; 4: up to 4,096 — the O projection, whose 128 tiles leave one block per SM, so its warps can
// afford to load their second super-block while multiplying the first).
// kRoute: the O projection with the router's partial sums (o_proj_router; a.router set), one block per
// SM (its tiles, n_embd / 16, fit one wave) so that the router's columns have registers.
// kWarpTiles: matrices of many more tiles than a wave of blocks (the LM head): each warp owns whole
// tiles (tile16 over all of a tile's super-blocks) and writes its 16 rows itself, so no block barrier
// waits for a block's slowest warp between tiles; one wave of two blocks per SM, no L2 prefetch: each
// warp streams its super-blocks through shared memory, three in flight (LmPipe; MOE_CUDA_LM_PIPE=0: one
// in registers). LM head 100-106 vs 112-113 us per token (trace), then ~76 with LmPipe.
// kW: warps per block: 16 for the O projection with the routing (one super-block each of its 4,096
// columns, staging and tail shorter: BM_Decode/0 496.2-499.7 vs 492.5-494.8 tok/s with 8 warps).
// kSm: the block's first tile comes into shared memory by one bulk copy before the wait (instead of its
// bulk prefetch to L2), and its MMAs read it there (tc_gemv: when it fits; MOE_CUDA_GEMV_SMEM=0 off).
// kPad (with kSm): one bulk copy per row, each to rows_smem_stride (tc.cuh): at the global stride of 2,048
// columns every row starts in the same bank and the MMAs' loads from shared memory were 8-way bank
// conflicts (trace: the Q/K/V tile's MMAs 1.26 -> 0.74-0.79 us; MOE_CUDA_ROWS_PAD=0 off).
template <int R, bool kRoute, bool kWarpTiles = false, int kW = NW, bool kSm = false, bool kPad = false>
__global__ void __launch_bounds__(kW * 32, kWarpTiles ? 2 : R == 2 && !kRoute ? 3 : 1) tc_gemv_kernel(GemvArgs a) {
  static_assert(kSm || !kPad, "kPad lays out the shared-memory tile");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[32];
  __shared__ float part[kW][16];
  __shared__ float s_y[16];
  MOE_TRACE_SCOPE(1);
  const XQ xq = carve_xq(smem, a.cols);
  const int total = a.tiles_before[a.n_outs];
  auto find = [&](int tile, int& m) { return tile_row0(a, tile, m); };
  // A tile's rows are consecutive: one bulk prefetch (the SM issues bulk prefetches one after another,
  // ~45 ns each: one per row kept the gate/up kernel's warp 0 issuing for 1.4 us, see tc_gate_up_kernel).
  auto prefetch = [&](int tile) {
    if (kWarpTiles || tile >= total || threadIdx.x != 0 || a.skip_prefetch) return;
    int m;
    const int r = find(tile, m);
    const Mat& W = a.outs[m].W;
    bulk_prefetch_l2(W.data + r * W.row_stride, static_cast<uint32_t>(min(16, W.rows - r) * W.row_stride));
  };
  // o_proj_router (one matrix): the router's columns of the first tile are loaded before the wait
  constexpr bool route = kRoute;
  RouterCols rc;
  if (route && blockIdx.x < total) load_router_cols(a, a.outs[0].W.rows, blockIdx.x * 16, rc);
  // the weights and the KV-cache rows of earlier positions do not depend on the previous kernel: with
  // programmatic dependent launch they go to L2 while it runs
  __shared__ uint64_t bar;
  uint8_t* srows = smem + rows_smem_offset(a.cols);
  if (kSm && threadIdx.x == 0 && blockIdx.x < total) {  // the others wait on it after barriers
    int m;
    const int r = find(blockIdx.x, m);
    const Mat& W = a.outs[m].W;
    const int nr = min(16, W.rows - r);
    const uint32_t bytes = static_cast<uint32_t>(nr * W.row_stride);
    mbar_init(&bar, 1);
    mbar_arrive_tx(&bar, bytes);
    if constexpr (!kPad) {
      bulk_copy_g2s(srows, W.data + r * W.row_stride, bytes, &bar);
    } else {  // a copy per row, to the padded stride (kPad: rows_smem_stride)
      const int rs = static_cast<int>(W.row_stride), ps = rows_smem_stride(rs);
      const uint8_t* src = W.data + r * W.row_stride;
      for (int i = 0; i < nr; ++i) bulk_copy_g2s(srows + i * ps, src + i * rs, static_cast<uint32_t>(rs), &bar);
    }
  }
  if (!kSm) prefetch(blockIdx.x);
  send_hint_to_l2(a.hint);
  // the warp-tile kernel's first super-blocks go to shared memory now (LmPipe)
  const uint32_t lm_type = kWarpTiles && a.lm_pipe ? a.outs[0].W.type : 0u;
  if constexpr (kWarpTiles) {
    switch (lm_type) {
      case layout::Q4_K: LmPipe<layout::Q4_K, kW>(a, smem, total).prologue(); break;
      case layout::Q5_K: LmPipe<layout::Q5_K, kW>(a, smem, total).prologue(); break;
      case layout::Q6_K: LmPipe<layout::Q6_K, kW>(a, smem, total).prologue(); break;
      default: break;
    }
  }
  // the decode position (for the attention's deferred slices) does not come from the previous kernel
  // (deferred slices only up to 4,096 columns, R = 2: o_proj_router; the merge's code stays out of R = 4)
  const int slices = kRoute && R == 2 && a.att.defer > 1 ? deferred_slices(a.att, __ldcg(a.att.pos)) : 0;
  SliceAt<R> sa;
  if (slices) slice_at<R>(a.att, a.cols, sa);
  // y_early: the rows of y to accumulate into for the block's first tile, read now rather than after the
  // MMAs (an L2 round trip on the epilogue's path); the kernel two steps back wrote them and is complete
  float y_pre = 0.f;
  const bool pre = !kWarpTiles && a.y_early && a.accumulate && blockIdx.x < total;
  if (pre && threadIdx.x < 16) {
    int m;
    const int r = find(blockIdx.x, m) + static_cast<int>(threadIdx.x);
    if (r < a.outs[m].W.rows) y_pre = __ldcg(a.outs[m].y + r);
  }
  pdl_sync();
#ifdef MOE_TRACE
  // mark 6: the tile's copy seen complete right after the wait, or else before the staging (kSm). (Mark 5,
  // thread 0 past the mbarrier after the staging, lags the copy: its try_wait queues behind the other warps'
  // shared-memory loads of the MMA phase; docs/PERFORMANCE.md version 24.)
  bool tile_seen = false;
  if (kSm && threadIdx.x == 0 && blockIdx.x < total && mbar_test(&bar, 0)) {
    MOE_TRACE_MARK(6);
    tile_seen = true;
  }
#endif
  XLoad<R> xl;
  if constexpr (R == 2) {
    if (slices)
      stage_load_slices<R>(a.att, slices, a.cols, sa, xl);
    else
      stage_load<R>(a.x, a.cols, a.norm_w, xl);
  } else {
    stage_load<R>(a.x, a.cols, a.norm_w, xl);
  }
  const float ref = kRoute ? __ldcg(a.racc.ref) : 0.f;  // the unit of the router's sums (used after the MMAs)
  MOE_TRACE_MARK(1);
  prefetch(blockIdx.x + gridDim.x);
  MOE_TRACE_MARK(2);
#ifdef MOE_TRACE
  if (kSm && threadIdx.x == 0 && blockIdx.x < total && !tile_seen && mbar_test(&bar, 0)) MOE_TRACE_MARK(6);
#endif
  const float scale = stage_finish<R>(a.x, a.cols, a.norm_w, a.eps, xl, xq, red);
  if (a.prep.acc && blockIdx.x == 0) {  // the O projection's router sums start from zero (launch.cuh)
    for (int c = threadIdx.x; c <= a.prep.n; c += blockDim.x) a.prep.acc[c] = 0;
    if (threadIdx.x == 0) *a.prep.ref = 1.f / scale;
  }
  MOE_TRACE_MARK(3);
  if constexpr (kWarpTiles) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, stride = gridDim.x * kW;
    switch (lm_type) {
      case layout::Q4_K: LmPipe<layout::Q4_K, kW>(a, smem, total).run(xq, part[warp]); break;
      case layout::Q5_K: LmPipe<layout::Q5_K, kW>(a, smem, total).run(xq, part[warp]); break;
      case layout::Q6_K: LmPipe<layout::Q6_K, kW>(a, smem, total).run(xq, part[warp]); break;
      default: break;
    }
    for (int tile = blockIdx.x * kW + warp; tile < (lm_type ? 0 : total); tile += stride) {
      int m;
      const int r0 = find(tile, m);
      const Mat& W = a.outs[m].W;
      const uint8_t* rg = W.data + min(r0 + g, W.rows - 1) * W.row_stride;
      const uint8_t* r8 = W.data + min(r0 + g + 8, W.rows - 1) * W.row_stride;
      auto rows = [&](int, int i) { return i ? r8 : rg; };
      auto one = [](int) { return 1.f; };
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      switch (W.type) {
        case layout::Q4_K: tile16<layout::Q4_K, true>(rows, one, 1, a.cols / 256, 0, 1, xq, acc); break;
        case layout::Q5_K: tile16<layout::Q5_K, true>(rows, one, 1, a.cols / 256, 0, 1, xq, acc); break;
        case layout::Q6_K: tile16<layout::Q6_K, false>(rows, one, 1, a.cols / 256, 0, 1, xq, acc); break;
        default: break;
      }
      warp_rows_to_smem(acc, part[warp]);
      __syncwarp();
      if (lane < 16 && r0 + lane < W.rows) {
        float* yr = a.outs[m].y + r0 + lane;
        *yr = a.accumulate ? *yr + part[warp][lane] : part[warp][lane];
      }
      __syncwarp();  // part[warp] is reused by the warp's next tile
    }
  } else {
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      prefetch(tile + 2 * gridDim.x);
      int m;
      const int r0 = find(tile, m);
      const Mat& W = a.outs[m].W;
      if (route && tile != blockIdx.x) load_router_cols(a, W.rows, r0, rc);
      float* y = a.outs[m].y;
      if (kSm && tile == blockIdx.x) {
        mbar_wait(&bar, 0);
        MOE_TRACE_MARK(5);
        switch (W.type) {
          case layout::Q4_K:
            tc_gemv_tile<layout::Q4_K, (R > 2), kW, true, kPad>(a, W, y, r0, xq, part, route, rc, s_y, ref, srows,
                                                         pre, y_pre);
            break;
          case layout::Q5_K:
            tc_gemv_tile<layout::Q5_K, (R > 2), kW, true, kPad>(a, W, y, r0, xq, part, route, rc, s_y, ref, srows,
                                                         pre, y_pre);
            break;
          case layout::Q6_K:
            tc_gemv_tile<layout::Q6_K, (R > 2), kW, true, kPad>(a, W, y, r0, xq, part, route, rc, s_y, ref, srows,
                                                         pre, y_pre);
            break;
          default: break;
        }
        continue;
      }
      switch (W.type) {
        case layout::Q4_K:
          tc_gemv_tile<layout::Q4_K, (R > 2), kW>(a, W, y, r0, xq, part, route, rc, s_y, ref, nullptr,
                                                  pre && tile == blockIdx.x, y_pre);
          break;
        case layout::Q5_K:
          tc_gemv_tile<layout::Q5_K, (R > 2), kW>(a, W, y, r0, xq, part, route, rc, s_y, ref, nullptr,
                                                  pre && tile == blockIdx.x, y_pre);
          break;
        case layout::Q6_K:
          tc_gemv_tile<layout::Q6_K, (R > 2), kW>(a, W, y, r0, xq, part, route, rc, s_y, ref, nullptr,
                                                  pre && tile == blockIdx.x, y_pre);
          break;
        default: break;
      }
    }
  }
}

}  // namespace

bool tc_type(uint32_t t) { return t == layout::Q4_K || t == layout::Q5_K || t == layout::Q6_K; }

bool tc_enabled() {
  return env_switch("MOE_CUDA_TC", true);  // read each time: tests switch it
}

cudaError_t tc_init() {
  const int big = static_cast<int>(kTcMaxSmem);
  cudaError_t e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<4, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, true, false, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, big))) return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, false, false, NW, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                big)))
    return e;
  if ((e = cudaFuncSetAttribute(tc_gemv_kernel<2, false, false, NW, true, true>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, big)))
    return e;
  return tc_experts_init();
}

cudaError_t tc_gemv(const GemvArgs& a, cudaStream_t s) {
  static const cudaError_t init = tc_init();
  if (init != cudaSuccess) return init;
  // at most two waves of blocks (three per SM); matrices of more tiles (the LM head) go to the warp-tile
  // kernel, one wave of two blocks per SM
  const int tiles = a.tiles_before[a.n_outs];
  const dim3 grid(std::min(tiles, 2 * 3 * sm_count()));
  const size_t smem = xq_smem(a.cols);
  const bool two = a.cols <= 2 * 4 * NW * 32;
  const dim3 block(NW * 32);
  if (!a.router && tiles > static_cast<int>(grid.x)) {
    // the super-blocks through shared memory (LmPipe) when all matrices have one type; MOE_CUDA_LM_PIPE=0 off
    GemvArgs b = a;
    // 2: the tiles left by the last round split over pairs of warps (LmOrder; MOE_CUDA_LM_HALVES=0: whole)
    b.lm_pipe = env_switch("MOE_CUDA_LM_PIPE", true) ? (env_switch("MOE_CUDA_LM_HALVES", true) ? 2 : 1) : 0;
    for (int i = 1; i < a.n_outs; ++i)
      if (a.outs[i].W.type != a.outs[0].W.type) b.lm_pipe = 0;
    const size_t sm = b.lm_pipe ? lm_ring_offset(a.cols) + lm_ring_bytes(NW) : smem;
    return launch_pdl(two ? tc_gemv_kernel<2, false, true> : tc_gemv_kernel<4, false, true>, dim3(2 * sm_count()),
                      block, sm, s, b);
  }
  if (a.router && !two && a.cols <= 4096)  // 16 warps, one super-block each (see tc_gemv_kernel's kW)
    return launch_pdl(tc_gemv_kernel<2, true, false, 16>, grid, dim3(16 * 32), smem, s, a);
  if (a.router) return launch_pdl(two ? tc_gemv_kernel<2, true> : tc_gemv_kernel<4, true>, grid, block, smem, s, a);
  // one tile per block (the Q/K/V GEMV): its rows through shared memory when they fit (MOE_CUDA_GEMV_SMEM=0:
  // through L2). Not the O projection with the routing (the same measured 628.6-629.3 vs 628.0-628.3 tok/s
  // from context 0 and 527.7-528.0 vs 521.2-521.7 at depth 4096 without), nor the R = 4 kernels (two
  // register sets per warp already: they spill with both paths).
  // The rows at a padded stride there (rows_smem_stride: one copy per row, no bank conflicts); with
  // MOE_CUDA_ROWS_PAD=0 the tile in one copy at the global stride.
  if (two && env_switch("MOE_CUDA_GEMV_SMEM", true)) {  // two: rows of at most 2,048 columns
    const bool pad = env_switch("MOE_CUDA_ROWS_PAD", true);
    int64_t stride = 0;
    for (int i = 0; i < a.n_outs; ++i) {
      const int64_t rs = a.outs[i].W.row_stride;
      stride = std::max(stride, pad ? static_cast<int64_t>(rows_smem_stride(static_cast<int>(rs))) : rs);
    }
    const size_t with_rows = rows_smem_offset(a.cols) + 16 * static_cast<size_t>(stride);
    if (with_rows <= kTcMaxSmem)
      return launch_pdl(pad ? tc_gemv_kernel<2, false, false, NW, true, true>
                            : tc_gemv_kernel<2, false, false, NW, true>,
                        grid, block, with_rows, s, a);
  }
  return launch_pdl(two ? tc_gemv_kernel<2, false> : tc_gemv_kernel<4, false>, grid, block, smem, s, a);
}

}  // namespace moe::cuda::k

#include "experts_tc.cuh"  // the expert kernels, in this module

MOE_TRACE_TU(gemv_tc)
