// The persistent decode kernel: every layer of one decode token in a single launch (opt-in:
// MOE_CUDA_PERSIST=1; it measured slower than the per-kernel graph, docs/PERFORMANCE.md version 5).
//
// Why: a decode token of Qwen3-30B-A3B is ~290 small kernels, each latency-bound (its weights are
// 1-14 MB, a few microseconds at the H200's bandwidth), and each one pays for its launch, for the
// ramp of its first DRAM loads and for the drain of its last block; the per-block trace measured
// ~53 us a layer where the bytes take ~8. Here one 8-warp block per SM (co-resident: cooperative
// launch) runs the six phases of a layer separated by grid barriers (~1 us each, measured). A block
// copies the weight rows of its tiles into shared memory with cp.async and multiplies from there; the
// copies of a phase whose rows are known early are issued before the barrier that precedes it (O
// during attention, the next layer's QKV during the down projection), the experts' right after the
// routing. Router rows and the next layer's QKV rows are also sent to L2 ahead (bulk_prefetch_l2).
//
// Where it stands (per-block trace, tools/bench/trace_report.py P-* rows): the barriers are cheap, but
// with 8 warps per SM the multiplications from shared memory are latency-bound chains (gate/up ~5.5 us
// a layer against ~1 us of arithmetic), the experts' 22 MB arrive only after the routing (~7.5 us at
// full bandwidth, not overlapped with their multiplication yet) and attention's slices are few; ~75 us
// a layer against ~57 for the graph. What it needs next: producer/consumer warps so that tiles are
// multiplied as their copies land, more warps per SM, and the expert choice off the critical path.
//
// Phases of layer l (every block takes part in each; work item i of a phase goes to block i % grid):
//   A  qkv = [Wq; Wk; Wv] · (rmsnorm(x) * attn_norm)                       16-row tiles
//   B  per (kv head, context slice): Q/K norm + RoPE, KV store, attention  attention.cuh's item
//   C  x += Wo · o                                                          16-row tiles
//   D  router logits = R · (rmsnorm(x) * ffn_norm)                          one row per block
//   E  every block chooses the experts (same result everywhere); act = silu(G h) * (U h)
//   F  x += Σ_j w_j D_e(j) · act_j                                          16-row tiles
// The arithmetic of A, C, E and F is that of the tensor-core GEMVs (tc.cuh), so the results equal the
// per-kernel decode graph's bit for bit up to the order of additions within a tile.
//
// Data written in the kernel by one block and read by another is read through L2 (__ldcg, or the
// staging of tc.cuh, which does): L1 is not coherent between SMs.
#include <algorithm>
#include <cstdlib>

#include "attention.cuh"
#include "gemv_tc.cuh"
#include "tc.cuh"
#include "trace.cuh"

namespace moe::cuda::k {
using namespace tc;

namespace {

constexpr int kWarps = 8, kThreads = kWarps * 32;

// ---- grid barrier ----------------------------------------------------------------------------------------
// A counter (zeroed before the launch) that every block adds one to per barrier; barrier k completes
// when it reaches k * gridDim.x. Split in two so that a block can issue prefetches in between.
__device__ __forceinline__ uint64_t gtime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void grid_arrive(unsigned* bar, uint64_t* prof) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (prof) {
      prof[3 * blockIdx.x] = gtime();
      prof[3 * blockIdx.x + 2] = clock64();
    }
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
  }
}
// Spins with relaxed loads (an acquire load per iteration is slow), then one acquire fence.
__device__ __forceinline__ void grid_wait(const unsigned* bar, unsigned target, uint64_t* prof) {
  if (threadIdx.x == 0) {
    unsigned v;
    do {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
    } while (v < target);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    if (prof) prof[3 * blockIdx.x + 1] = gtime();
  }
  __syncthreads();
}

// ---- dense GEMV phases -----------------------------------------------------------------------------------
// Up to three matrices sharing x, cut into 16-row tiles numbered across the matrices.
// (Scalar fields and selects, no arrays: an indexed array would live in local memory.)
struct Dense {
  const Mat *W0, *W1, *W2;
  float *y0, *y1, *y2;
  int b1, b2, total;  // tiles before matrix 1, before matrix 2, in all
};
__device__ __forceinline__ Dense dense(const Mat* a, float* ya, const Mat* b = nullptr, float* yb = nullptr,
                                       const Mat* c = nullptr, float* yc = nullptr) {
  Dense d{a, b, c, ya, yb, yc, 0, 0, 0};
  d.b1 = (a->rows + 15) / 16;
  d.b2 = d.b1 + (b ? (b->rows + 15) / 16 : 0);
  d.total = d.b2 + (c ? (c->rows + 15) / 16 : 0);
  return d;
}
// First row of a tile, and its matrix and output.
__device__ __forceinline__ int dense_find(const Dense& d, int tile, const Mat*& W, float*& y) {
  if (tile >= d.b2) {
    W = d.W2;
    y = d.y2;
    return (tile - d.b2) * 16;
  }
  if (tile >= d.b1) {
    W = d.W1;
    y = d.y1;
    return (tile - d.b1) * 16;
  }
  W = d.W0;
  y = d.y0;
  return tile * 16;
}

// Warps per tile: all eight when every tile has a block, else fewer so that a block runs several tiles
// at once (its warp groups), at least `min_w`.
__device__ __forceinline__ int warps_per_tile(int tiles, int min_w) {
  int w = kWarps;
  while (w > min_w && tiles > static_cast<int>(gridDim.x) * (kWarps / w)) w >>= 1;
  return w;
}

// The 16 rows of each tile this block will run (tiles blockIdx.x + k gridDim.x) to L2.
__device__ __forceinline__ void prefetch_dense(const Dense& d) {
  for (int i = threadIdx.x;; i += blockDim.x) {
    const int tile = blockIdx.x + (i >> 4) * gridDim.x;
    if (tile >= d.total) break;
    const Mat* Wp;
    float* y;
    const int r = dense_find(d, tile, Wp, y) + (i & 15);
    const Mat& W = *Wp;
    if (r < W.rows) bulk_prefetch_l2(W.data + r * W.row_stride, tc_row_bytes(W.type, W.cols));
  }
}

// ---- weights staged in shared memory ---------------------------------------------------------------------
// A block copies the rows of its tiles into shared memory with cp.async (no registers held while the
// bytes are in flight, so a phase's copies can be issued before the barrier that precedes it) and
// multiplies from there. Rows are sm_stride bytes apart: the row bytes, plus 16 when that is a multiple
// of 32 bytes, so that the lanes' words of the eight rows of an MMA fall in different banks.
__host__ __device__ __forceinline__ int sm_stride(uint32_t type, int cols) {
  const int rb = static_cast<int>(cols / 256) * (type == layout::Q4_K ? 144 : type == layout::Q5_K ? 176 : 224);
  return ((rb >> 2) & 7) == 0 ? rb + 16 : rb;
}
// Rows r0 .. r0 + 15 (clamped to rows - 1) of a matrix whose rows start at base, rs bytes apart.
__device__ __forceinline__ void copy_rows16(uint8_t* dst, int ds, const uint8_t* base, int64_t rs, int r0, int rows,
                                            int row_bytes) {
  const int chunks = row_bytes >> 4;
  for (int i = threadIdx.x; i < 16 * chunks; i += blockDim.x) {
    const int r = i / chunks, c = i - r * chunks;
    cp_async16(dst + r * ds + c * 16, base + min(r0 + r, rows - 1) * rs + c * 16);
  }
}

// Shared-memory bytes of a dense tile.
__device__ __forceinline__ int dense_tile_bytes(const Mat& W) { return 16 * sm_stride(W.type, W.cols); }

// Copies this block's tiles of d into buf (in tile order) as one cp.async group.
__device__ __forceinline__ void copy_dense(const Dense& d, uint8_t* buf) {
  int off = 0;
  for (int tile = blockIdx.x; tile < d.total; tile += gridDim.x) {
    const Mat* Wp;
    float* y;
    const int r0 = dense_find(d, tile, Wp, y);
    const Mat& W = *Wp;
    copy_rows16(buf + off, sm_stride(W.type, W.cols), W.data, W.row_stride, r0, W.rows, tc_row_bytes(W.type, W.cols));
    off += dense_tile_bytes(W);
  }
  cp_async_commit();
}

// One 16-row tile in shared memory: n_seg segments of 16 rows (segment s, row i at tile + (16 s + i) ds)
// weighted by seg_w[s] (1 without), against x groups seg * n_sb + sb.
template <uint32_t T>
__device__ __forceinline__ float4 smem_tile(const uint8_t* tile, int ds, int n_seg, int n_sb, const float* seg_w,
                                         int first, int step, XQ xq) {
  const int g = (threadIdx.x & 31) >> 2;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile16<T, false, true>([&](int s, int i) { return tile + (s * 16 + g + 8 * i) * ds; },
                         [&](int s) { return seg_w ? seg_w[s] : 1.f; }, n_seg, n_sb, first, step, xq, acc);
  return make_float4(acc[0], acc[1], acc[2], acc[3]);
}
__device__ __forceinline__ void mat_tile(uint32_t type, const uint8_t* tile, int ds, int n_seg, int n_sb,
                                         const float* seg_w, int first, int step, const XQ& xq, float (&acc)[4]) {
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  switch (type) {
    case layout::Q4_K: r = smem_tile<layout::Q4_K>(tile, ds, n_seg, n_sb, seg_w, first, step, xq); break;
    case layout::Q5_K: r = smem_tile<layout::Q5_K>(tile, ds, n_seg, n_sb, seg_w, first, step, xq); break;
    case layout::Q6_K: r = smem_tile<layout::Q6_K>(tile, ds, n_seg, n_sb, seg_w, first, step, xq); break;
    default: break;
  }
  acc[0] = r.x;
  acc[1] = r.y;
  acc[2] = r.z;
  acc[3] = r.w;
}

// stage_finish of the kernel's x staging area.
__device__ __forceinline__ void stage_x(const float* x, int n, const float* norm_w, float eps, XLoad<2> l, uint8_t* X,
                                     float* red) {
  stage_finish<2>(x, n, norm_w, eps, l, carve_xq(X, n), red);
}

// y (+)= W · h for the tiles of this block (weights in buf as copy_dense put them), h staged in xq.
__device__ __forceinline__ void dense_phase(const Dense& d, const uint8_t* buf, const XQ& xq, bool accumulate,
                                            float (*part)[16]) {
  const int total = d.total;
  const int W = warps_per_tile(total, 1), gpb = kWarps / W;
  const int warp = threadIdx.x >> 5, grp = warp / W;
  for (int base = blockIdx.x; base < total; base += gridDim.x * gpb) {
    const int tile = base + gridDim.x * grp;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (tile < total) {
      const Mat* Mp;
      float* y;
      int off = 0;  // the block's earlier tiles come first in buf
      for (int t = blockIdx.x; t < tile; t += gridDim.x) {
        dense_find(d, t, Mp, y);
        off += dense_tile_bytes(*Mp);
      }
      dense_find(d, tile, Mp, y);
      const Mat& M = *Mp;
      mat_tile(M.type, buf + off, sm_stride(M.type, M.cols), 1, M.cols / 256, nullptr, warp % W, W, xq, acc);
    }
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < 16 * gpb) {
      const int gi = threadIdx.x >> 4, i = threadIdx.x & 15, t = base + gridDim.x * gi;
      if (t < total) {
        const Mat* Mp;
        float* y;
        const int r = dense_find(d, t, Mp, y) + i;
        if (r < Mp->rows) {
          float v = 0.f;
          for (int w = 0; w < W; ++w) v += part[gi * W + w][i];
          y += r;
          *y = accumulate ? __ldcg(y) + v : v;
        }
      }
    }
    __syncthreads();
  }
}

// ---- routing --------------------------------------------------------------------------------------------
// logits[r] = R.row(r) · (rmsnorm(x) * norm_w) for rows r = blockIdx.x + k gridDim.x (F32 router).
__device__ __forceinline__ void route_phase(const Mat& R, const float* x, const float* norm_w, float eps, int n,
                                            float* logits, float* hs, float* red) {
  if (static_cast<int>(blockIdx.x) >= R.rows) return;
  float ss = 0.f;
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = __ldcg(x + i);
    hs[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss, red);  // its barriers also make hs visible
  const float scale = rsqrtf(ss / static_cast<float>(n) + eps);
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += blockDim.x) hs[i] *= scale * norm_w[i];
  __syncthreads();
  const float4* h4 = reinterpret_cast<const float4*>(hs);
  for (int r = blockIdx.x; r < R.rows; r += gridDim.x) {
    const float4* row = reinterpret_cast<const float4*>(R.data + r * R.row_stride);
    float acc = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {  // the loads of a thread's float4s in flight together
      const float4 w = __ldg(row + i), h = h4[i];
      acc = fmaf(w.x, h.x, fmaf(w.y, h.y, fmaf(w.z, h.z, fmaf(w.w, h.w, acc))));
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) logits[r] = acc;
  }
}

// ---- experts --------------------------------------------------------------------------------------------
// Tile t of the gate/up phase: expert slot t / tiles, rows (t % tiles) * 16; in shared memory each of the
// block's tiles holds its 16 gate rows, then its 16 up rows.
__device__ __forceinline__ int gate_up_tile_bytes(const Mat& G, const Mat& U) {
  return 16 * (sm_stride(G.type, G.cols) + sm_stride(U.type, U.cols));
}
__device__ __forceinline__ void copy_gate_up(const Mat& G, const Mat& U, const int32_t* sid, int n_used, uint8_t* buf) {
  const int tiles = (G.rows + 15) / 16, total = tiles * n_used, sg = sm_stride(G.type, G.cols);
  uint8_t* dst = buf;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int j = tile / tiles, r0 = (tile - j * tiles) * 16;
    copy_rows16(dst, sg, G.data + sid[j] * G.expert_stride, G.row_stride, r0, G.rows, tc_row_bytes(G.type, G.cols));
    copy_rows16(dst + 16 * sg, sm_stride(U.type, U.cols), U.data + sid[j] * U.expert_stride, U.row_stride, r0, U.rows,
                tc_row_bytes(U.type, U.cols));
    dst += gate_up_tile_bytes(G, U);
  }
  cp_async_commit();
}
// Each down tile: n_used experts' 16 rows.
__device__ __forceinline__ void copy_down(const Mat& D, const int32_t* sid, int n_used, uint8_t* buf) {
  const int total = (D.rows + 15) / 16, ds = sm_stride(D.type, D.cols), rb = tc_row_bytes(D.type, D.cols);
  uint8_t* dst = buf;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x)
    for (int j = 0; j < n_used; ++j, dst += 16 * ds)
      copy_rows16(dst, ds, D.data + sid[j] * D.expert_stride, D.row_stride, tile * 16, D.rows, rb);
  cp_async_commit();
}
// act[j][r] = silu(G_e.row(r)·h) * (U_e.row(r)·h), e = sid[j]; a tile's warps split into gate and up halves.
__device__ __forceinline__ void gate_up_phase(const Mat& G, const Mat& U, int n_used, const uint8_t* buf,
                                              const XQ& xq, float* act, float (*part)[16]) {
  const int tiles = (G.rows + 15) / 16, total = tiles * n_used;
  const int W = warps_per_tile(total, 2), gpb = kWarps / W, half = W / 2;
  const int warp = threadIdx.x >> 5, grp = warp / W, wl = warp % W;
  const int tb = gate_up_tile_bytes(G, U), sg = sm_stride(G.type, G.cols);
  for (int base = blockIdx.x, k = grp; base < total; base += gridDim.x * gpb, k += gpb) {
    const int tile = base + gridDim.x * grp;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (tile < total) {
      const bool up = wl >= half;
      const Mat& M = up ? U : G;
      mat_tile(M.type, buf + k * tb + (up ? 16 * sg : 0), sm_stride(M.type, M.cols), 1, M.cols / 256, nullptr,
               wl % half, half, xq, acc);
    }
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < 16 * gpb) {
      const int gi = threadIdx.x >> 4, i = threadIdx.x & 15, t = base + gridDim.x * gi;
      if (t < total) {
        const int j = t / tiles, r = (t - j * tiles) * 16 + i;
        if (r < G.rows) {
          float gv = 0.f, uv = 0.f;
          for (int w = 0; w < half; ++w) {
            gv += part[gi * W + w][i];
            uv += part[gi * W + half + w][i];
          }
          act[j * G.rows + r] = gv / (1.f + expf(-gv)) * uv;
        }
      }
    }
    __syncthreads();
  }
}

// x[r] += Σ_j sw[j] D_e(j).row(r) · act_j for the down tiles of this block (all warps on one tile).
__device__ __forceinline__ void down_phase(const Mat& D, const float* sw, int n_used, const uint8_t* buf, float* x,
                                           const XQ& xq, float (*part)[16]) {
  const int warp = threadIdx.x >> 5;
  const int total = (D.rows + 15) / 16, ds = sm_stride(D.type, D.cols);
  const uint8_t* tb = buf;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x, tb += n_used * 16 * ds) {
    const int r0 = tile * 16;
    float acc[4];
    mat_tile(D.type, tb, ds, n_used, D.cols / 256, sw, warp, kWarps, xq, acc);
    warp_rows_to_smem(acc, part[warp]);
    __syncthreads();
    if (threadIdx.x < 16 && r0 + static_cast<int>(threadIdx.x) < D.rows) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += part[w][threadIdx.x];
      x[r0 + threadIdx.x] = __ldcg(x + r0 + threadIdx.x) + v;
    }
    __syncthreads();
  }
}

// ---- the kernel -----------------------------------------------------------------------------------------
template <int D, int G>
__global__ void __launch_bounds__(kThreads, 1) persist_kernel(PersistArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red[32];
  __shared__ float part[kWarps][16];
  __shared__ float s_w[64];
  __shared__ int32_t s_id[64];
  uint8_t* X = smem;              // x staging (xq); choose_experts' scratch before it
  uint8_t* Wb = smem + a.smem_x;  // weights (see persist_plan); attention's and the router's scratch
  const int E = a.n_embd, Q = a.n_head * a.head_dim, KV = a.n_head_kv * a.head_dim;
  unsigned* bar = a.barrier;
  unsigned target = 0;
  int n_bar = 0;  // barriers passed: the profile record of the next one is a.profile[n_bar][block][3]
  auto prof = [&] { return a.profile ? a.profile + static_cast<int64_t>(n_bar) * 3 * gridDim.x : nullptr; };
  auto arrive = [&] { grid_arrive(bar, prof()); };
  auto wait = [&] {
    target += gridDim.x;
    grid_wait(bar, target, prof());
    ++n_bar;
  };
  auto sync = [&] {
    arrive();
    wait();
  };
  float* q = a.qkv;
  float* kk = a.qkv + Q;
  float* v = a.qkv + Q + KV;
  auto qkv_of = [&](const PersistLayer& L) { return dense(&L.q, q, &L.k, kk, &L.v, v); };
  // the layer table entries live in shared memory: their fields are read all through each phase
  __shared__ PersistLayer s_layer[2];
  auto load_layer = [&](int l) {
    constexpr int kWords = sizeof(PersistLayer) / 4;
    static_assert(sizeof(PersistLayer) % 4 == 0 && kWords <= kThreads, "layer table entry");
    if (threadIdx.x < kWords)
      reinterpret_cast<uint32_t*>(&s_layer[l & 1])[threadIdx.x] =
          __ldg(reinterpret_cast<const uint32_t*>(a.layers + l) + threadIdx.x);
  };
  load_layer(0);
  __syncthreads();
  copy_dense(qkv_of(s_layer[0]), Wb);
  for (int l = 0; l < a.n_layers; ++l) {
    const PersistLayer& L = s_layer[l & 1];
    const PersistLayer& N = s_layer[(l + 1) & 1];  // loaded during phase D
    const bool has_next = l + 1 < a.n_layers;
    // A: QKV (weights copied during the previous layer's down phase)
    {
      MOE_TRACE_SCOPE(11);
      XLoad<2> xl;
      stage_load<2>(a.x, E, L.attn_norm, xl);
      cp_async_wait<0>();
      MOE_TRACE_MARK(1);
      stage_x(a.x, E, L.attn_norm, a.eps, xl, X, red);
      MOE_TRACE_MARK(2);
      dense_phase(qkv_of(L), Wb, carve_xq(X, E), false, part);
    }
    // the O rows land in shared memory and the router rows in L2 while attention runs
    const Dense o = dense(&L.o, a.x);
    copy_dense(o, Wb + a.off_o);
    arrive();
    for (int r = blockIdx.x; r < L.router.rows; r += gridDim.x)  // 4 KiB pieces, one per thread
      for (int64_t off = 4096 * static_cast<int64_t>(threadIdx.x); off < L.router.row_stride; off += 4096 * blockDim.x)
        bulk_prefetch_l2(L.router.data + r * L.router.row_stride + off,
                         static_cast<uint32_t>(L.router.row_stride - off < 4096 ? L.router.row_stride - off : 4096));
    wait();
    // B: attention
    for (int item = blockIdx.x; item < a.n_head_kv * a.n_split; item += gridDim.x) {
      MOE_TRACE_SCOPE(9);
      att::attention_decode_item<D, G>(item % a.n_head_kv, item / a.n_head_kv, a.qkv, a.pos, L.q_norm, L.k_norm,
                                       a.eps, a.rope, static_cast<__half*>(L.k_cache), static_cast<__half*>(L.v_cache),
                                       a.n_head_kv, a.n_split, a.partials, a.counters, a.o, a.rope_cs,
                                       reinterpret_cast<float*>(Wb), false);
    }
    sync();
    // C: x += Wo · o
    {
      MOE_TRACE_SCOPE(12);
      XLoad<2> xl;
      stage_load<2>(a.o, Q, nullptr, xl);
      cp_async_wait<0>();
      MOE_TRACE_MARK(1);
      stage_x(a.o, Q, nullptr, 0.f, xl, X, red);
      MOE_TRACE_MARK(2);
      dense_phase(o, Wb + a.off_o, carve_xq(X, Q), true, part);
    }
    sync();
    // D: router logits
    if (has_next) load_layer(l + 1);  // visible after the barriers below
    {
      MOE_TRACE_SCOPE(13);
      route_phase(L.router, a.x, L.ffn_norm, a.eps, E, a.logits, reinterpret_cast<float*>(Wb), red);
    }
    sync();
    // E: every block chooses the experts, copies its gate/up and down rows, and sends the next layer's
    // QKV rows to L2; gate/up
    {
      MOE_TRACE_SCOPE(10);
      float* s_logit = reinterpret_cast<float*>(X);
      choose_experts(a.logits, a.n_expert, a.n_used, s_logit, s_id, s_w, true);
      MOE_TRACE_MARK(1);
      copy_gate_up(L.gate, L.up, s_id, a.n_used, Wb);
      copy_down(L.down, s_id, a.n_used, Wb + a.off_down);
      if (has_next) prefetch_dense(qkv_of(N));
      MOE_TRACE_MARK(2);
      XLoad<2> xl;
      stage_load<2>(a.x, E, L.ffn_norm, xl);
      cp_async_wait<1>();  // gate/up landed (down may still be in flight)
      MOE_TRACE_MARK(3);
      stage_x(a.x, E, L.ffn_norm, a.eps, xl, X, red);
      MOE_TRACE_MARK(4);
      gate_up_phase(L.gate, L.up, a.n_used, Wb, carve_xq(X, E), a.act, part);
    }
    sync();
    // F: x += Σ_j w_j D_e(j) · act_j; the next layer's QKV rows copied meanwhile
    {
      MOE_TRACE_SCOPE(14);
      const int n = L.down.cols * a.n_used;
      XLoad<2> xl;
      stage_load<2>(a.act, n, nullptr, xl);
      const bool early = has_next && a.early_qkv;
      if (early) {
        copy_dense(qkv_of(N), Wb);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      MOE_TRACE_MARK(1);
      stage_x(a.act, n, nullptr, 0.f, xl, X, red);
      MOE_TRACE_MARK(2);
      down_phase(L.down, s_w, a.n_used, Wb + a.off_down, a.x, carve_xq(X, n), part);
      if (has_next && !early) copy_dense(qkv_of(N), Wb);
    }
    sync();
  }
}

using KernelFn = void (*)(PersistArgs);
KernelFn pick(int D, int G) {
#define MOE_PERSIST(DD, GG) \
  if (D == DD && G == GG) return persist_kernel<DD, GG>;
  MOE_PERSIST(2, 1) MOE_PERSIST(2, 2) MOE_PERSIST(2, 4) MOE_PERSIST(2, 8)
  MOE_PERSIST(4, 1) MOE_PERSIST(4, 2) MOE_PERSIST(4, 4) MOE_PERSIST(4, 8)
#undef MOE_PERSIST
  return nullptr;
}

bool tc_mat(const Mat& m) { return tc_type(m.type) && m.cols % 256 == 0 && m.rows > 0; }

}  // namespace

// Opt-in: measured slower than the per-kernel graph (docs/PERFORMANCE.md, version 5).
bool persist_enabled() {
  return env_switch("MOE_CUDA_PERSIST", false) && tc_enabled();
}

namespace {
size_t align16(size_t v) { return (v + 15) / 16 * 16; }
}  // namespace

cudaError_t persist_plan(PersistArgs& a, const PersistLayer* host_layers, size_t* smem, int* blocks) {
  if (!attention_supported(a.n_head, a.n_head_kv, a.head_dim)) return cudaErrorNotSupported;
  if (a.n_expert < 1 || a.n_expert > dev::kMaxExperts || a.n_used < 1 || a.n_used > 64 || a.n_used > a.n_expert)
    return cudaErrorNotSupported;
  if (a.n_embd % 256 != 0 || (a.n_head * a.head_dim) % 256 != 0 || a.n_split < 1 || a.n_split > att::kMaxSplit ||
      a.n_layers < 1)
    return cudaErrorNotSupported;
  const int grid = sm_count();
  const int G = a.n_head / a.n_head_kv;
  auto tile_bytes = [](const Mat& m) { return static_cast<size_t>(16) * sm_stride(m.type, m.cols); };
  auto per_block = [&](int tiles) { return static_cast<size_t>((tiles + grid - 1) / grid); };
  size_t s_qkv = 0, s_o = 0, s_gu = 0, s_down = 0, s_x = 0;
  for (int l = 0; l < a.n_layers; ++l) {
    const PersistLayer& L = host_layers[l];
    for (const Mat* m : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
      if (!tc_mat(*m)) return cudaErrorNotSupported;
    if (L.router.type != layout::F32 || L.router.cols != a.n_embd || L.router.rows != a.n_expert ||
        L.q.cols != a.n_embd || L.k.cols != a.n_embd || L.v.cols != a.n_embd || L.o.cols != a.n_head * a.head_dim ||
        L.q.rows != a.n_head * a.head_dim || L.k.rows != a.n_head_kv * a.head_dim || L.v.rows != L.k.rows ||
        L.gate.cols != a.n_embd || L.up.cols != a.n_embd || L.gate.rows != L.up.rows || L.down.cols != L.gate.rows ||
        L.down.rows != a.n_embd || L.o.rows != a.n_embd)
      return cudaErrorNotSupported;
    // QKV: the tiles of block b are b, b + grid, ... across [q; k; v]
    const Mat* qkv[3] = {&L.q, &L.k, &L.v};
    const int tq = (L.q.rows + 15) / 16, tk = (L.k.rows + 15) / 16, tv = (L.v.rows + 15) / 16;
    for (int b = 0; b < grid; ++b) {
      size_t bytes = 0;
      for (int t = b; t < tq + tk + tv; t += grid) bytes += tile_bytes(*qkv[t < tq ? 0 : t < tq + tk ? 1 : 2]);
      s_qkv = std::max(s_qkv, bytes);
    }
    s_o = std::max(s_o, per_block((L.o.rows + 15) / 16) * tile_bytes(L.o));
    s_gu = std::max(s_gu, per_block((L.gate.rows + 15) / 16 * a.n_used) * (tile_bytes(L.gate) + tile_bytes(L.up)));
    s_down = std::max(s_down, per_block((L.down.rows + 15) / 16) * a.n_used * tile_bytes(L.down));
    s_x = std::max(s_x, xq_smem(L.down.cols * a.n_used));
  }
  s_x = std::max({s_x, xq_smem(a.n_embd), xq_smem(a.n_head * a.head_dim),
                  static_cast<size_t>(2 * a.n_expert) * sizeof(float)});
  const size_t s_att = static_cast<size_t>(att::dec_smem_floats(G, a.head_dim)) * sizeof(float);
  const size_t s_hs = static_cast<size_t>(a.n_embd) * sizeof(float);
  const size_t off_o = align16(std::max(s_qkv, s_att));
  const size_t w = std::max({off_o + s_o, s_gu + s_down, s_hs, s_att});
  const size_t total = align16(s_x) + w;
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  if (total + 2048 > static_cast<size_t>(optin)) return cudaErrorNotSupported;  // 2 KiB: static shared memory
  a.smem_x = static_cast<int>(align16(s_x));
  a.off_o = static_cast<int>(off_o);
  a.off_down = static_cast<int>(s_gu);
  a.early_qkv = s_qkv <= s_gu ? 1 : 0;
  KernelFn f = pick(a.head_dim / 32, G);
  if (!f) return cudaErrorNotSupported;
  if ((e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(total))))
    return e;
  int per_sm = 0;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, kThreads, total))) return e;
  if (per_sm < 1) return cudaErrorNotSupported;
  *smem = total;
  *blocks = grid;
  return cudaSuccess;
}

cudaError_t decode_persist(const PersistArgs& a, size_t smem, int blocks, cudaStream_t s) {
  KernelFn f = pick(a.head_dim / 32, a.n_head / a.n_head_kv);
  if (!f) return cudaErrorInvalidValue;
  cudaError_t e = cudaMemsetAsync(a.barrier, 0, sizeof(unsigned), s);
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute coop;  // every block resident at once: the grid barriers need it
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  return launch_with(&coop, f, dim3(blocks), dim3(kThreads), smem, s, a);
}

}  // namespace moe::cuda::k

MOE_TRACE_TU(decode_persist)
