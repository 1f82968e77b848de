// Per-head Q/K RMSNorm + NEOX RoPE + fp16 KV store; causal GQA attention over the fp16 cache for a
// prefill (tensor cores, flash-attention style) and for one decode token (split over the context:
// each block runs an online softmax over its slice for the query heads of one KV head, and the last
// block of the KV head merges the slices; the item itself is in attention.cuh).
#include <algorithm>
#include <cstdlib>

#include "attention.cuh"
#include "mma.cuh"

namespace moe::cuda::k {
using namespace dev;
using namespace att;

namespace {

// One warp per (token, head), eight per block; lane l owns the RoPE pairs (i, i + head_dim/2) for
// i = l + 32 v, v < V = head_dim / 64 (at most 4). The sum of squares is added in the order of the
// former one-block-per-head form (a warp sum per 32 pairs, then those V sums as a block sum adds
// them), so the outputs are the same floats; ~18,000 two-warp blocks per 512-token layer were bound by
// block launches (25 us at base clocks for ~20 MB of traffic).
constexpr int kQkWarps = 8;
__global__ void __launch_bounds__(32 * kQkWarps) qk_norm_rope_store_kernel(
    float* qkv, int n_tok, const int32_t* pos0, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    int n_head, int n_head_kv, int hd, float eps, const __grid_constant__ Rope rope, __half* kc, __half* vc,
    const float* rope_cs) {
  pdl_sync();
  const int lane = threadIdx.x & 31, heads = n_head + n_head_kv, half_d = hd / 2, V = half_d / 32;
  const int p = blockIdx.x * kQkWarps + (threadIdx.x >> 5);
  if (p >= n_tok * heads) return;
  const int t = p / heads, h = p - t * heads;
  const int q_dim = n_head * hd, kv_dim = n_head_kv * hd;
  const int pos = pos0[0] + t;
  float* row = qkv + static_cast<int64_t>(t) * (q_dim + 2 * kv_dim);
  const bool is_q = h < n_head;
  float* v = is_q ? row + h * hd : row + q_dim + (h - n_head) * hd;
  const float* gain = is_q ? q_norm : k_norm;
  float a[4], b[4], ss[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    if (u >= V) break;
    a[u] = v[lane + 32 * u];
    b[u] = v[lane + 32 * u + half_d];
    ss[u] = warp_sum(fmaf(a[u], a[u], b[u] * b[u]));  // as the former form compiled a * a + b * b
  }
#pragma unroll
  for (int o = 2; o >= 1; o >>= 1)
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (u < o && u + o < V) ss[u] = ss[u] + ss[u + o];
  const float scale = rsqrtf(ss[0] / static_cast<float>(hd) + eps);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    if (u >= V) break;
    const int i = lane + 32 * u;
    const float x = a[u] * scale * gain[i], y = b[u] * scale * gain[i + half_d];
    float c, sn;
    if (rope_cs) {
      c = rope_cs[t * hd + i];
      sn = rope_cs[t * hd + half_d + i];
    } else {
      rope_cos_sin(i, pos, rope, c, sn);
    }
    const float ra = x * c - y * sn, rb = x * sn + y * c;
    if (is_q) {
      v[i] = ra;
      v[i + half_d] = rb;
    } else {
      const int g = h - n_head;
      __half* kr = kc + static_cast<int64_t>(pos) * kv_dim + g * hd;
      __half* vr = vc + static_cast<int64_t>(pos) * kv_dim + g * hd;
      kr[i] = __float2half_rn(ra);
      kr[i + half_d] = __float2half_rn(rb);
      const float* vsrc = row + q_dim + kv_dim + g * hd;
      vr[i] = __float2half_rn(vsrc[i]);
      vr[i + half_d] = __float2half_rn(vsrc[i + half_d]);
    }
  }
}

// ---- prefill: causal GQA attention on the tensor cores (flash-attention style) ----------------------
// A block takes one KV head and TQ = 64 / G consecutive tokens: its 64 query rows (row R = token
// R / G, head R % G of the group; 16 per warp) share every K/V tile. Tiles of 64 cache positions
// go to shared memory by cp.async (two stages); S = Q K^T and O += P V run on mma.sync m16n8k16
// (f16 x f16 -> f32) with an online softmax in between. Precision: K and V are the fp16 cache
// values (exact operands); Q (fp32, times 1/sqrt(head_dim) and log2 e) and P (fp32 in [0, 1]) are
// each split into an fp16 pair hi + lo, so both products are exact to ~2^-22 before the fp32
// accumulation (one fp16 operand would leave ~1e-3 relative errors in the logits and weights).
constexpr int kFlashWarps = 4;
constexpr int kFlashRows = 16 * kFlashWarps;  // query rows per block
constexpr int kFlashKeys = 64;                // cache positions per tile

using h16::ldsm_x4_trans;
using h16::mma_f16;
using h16::pack_h2;

// hi = fp16(a, b); lo = fp16 of what hi leaves out.
__device__ __forceinline__ void split_h2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(a, b);
  const float2 r = __half22float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack_h2(a - r.x, b - r.y);
}

template <int HD>
struct FlashShape {
  static constexpr int PITCH = HD + 8;  // halves per smem row: 8 ldmatrix rows hit 8 different 16-byte bank groups
  static constexpr int TILE = kFlashKeys * PITCH;  // halves of one K or V tile
  static constexpr size_t SMEM = 2 * 2 * TILE * sizeof(__half);  // K and V, two stages
};

// grid (ceil(n / (64 / G)), n_head_kv), kFlashWarps warps.
template <int HD, int G>
__global__ void __launch_bounds__(kFlashWarps * 32) flash_attention_kernel(const float* __restrict__ qkv, int qkv_stride,
                                                                           int n, const int32_t* pos0,
                                                                           const __half* __restrict__ kc,
                                                                           const __half* __restrict__ vc, int n_head_kv,
                                                                           float* __restrict__ out) {
  using S = FlashShape<HD>;
  constexpr int TQ = kFlashRows / G;  // tokens per block
  constexpr int KS = HD / 16;         // k-steps of Q K^T
  constexpr int CH = HD / 8;          // 16-byte chunks per cache row
  extern __shared__ __align__(16) __half fsm[];
  pdl_sync();
  const int g = blockIdx.y, t0 = blockIdx.x * TQ;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, tc = lane & 3;
  const int p0 = pos0[0];
  const int kv_dim = n_head_kv * HD;
  const int kv_end = p0 + min(t0 + TQ, n);  // cache positions [0, kv_end) are read
  const int n_tiles = (kv_end + kFlashKeys - 1) / kFlashKeys;

  auto load_tile = [&](int j, int stage) {
    __half* sk = fsm + stage * 2 * S::TILE;
    __half* sv = sk + S::TILE;
    for (int i = threadIdx.x; i < kFlashKeys * CH; i += kFlashWarps * 32) {
      const int r = i / CH, c = i - r * CH;
      const int p = j * kFlashKeys + r;
      const bool ok = p < kv_end;  // rows past the context are zeros (never NaN garbage times p = 0)
      const int64_t off = static_cast<int64_t>(ok ? p : 0) * kv_dim + g * HD + c * 8;
      cp_async16_zfill(sk + r * S::PITCH + c * 8, kc + off, ok);
      cp_async16_zfill(sv + r * S::PITCH + c * 8, vc + off, ok);
    }
    cp_async_commit();
  };
  load_tile(0, 0);

  // this thread's two rows (gr and gr + 8 of the warp's 16): token and head
  int tok[2], head[2], lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int R = warp * 16 + gr + 8 * i;
    tok[i] = t0 + R / G;
    head[i] = g * G + R % G;
    lim[i] = p0 + min(tok[i], n - 1);  // last visible position (rows past n mirror the last token, unwritten)
  }
  // Q fragments, scaled, split into fp16 hi + lo
  uint32_t qh[KS][4], ql[KS][4];
  {
    const float sc = rsqrtf(static_cast<float>(HD)) * 1.4426950408889634f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float* q = qkv + static_cast<int64_t>(min(tok[i], n - 1)) * qkv_stride + head[i] * HD;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 v = *reinterpret_cast<const float2*>(q + kk * 16 + hf * 8 + 2 * tc);
          split_h2(v.x * sc, v.y * sc, qh[kk][i + 2 * hf], ql[kk][i + 2 * hf]);
        }
      }
    }
  }
  float o[HD / 8][4];
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // the warp's smallest and largest limits (warp-uniform: mma.sync needs every lane)
  const int first_lim = p0 + min(t0 + (warp * 16) / G, n - 1);
  const int last_lim = p0 + min(t0 + (warp * 16 + 15) / G, n - 1);

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      load_tile(j + 1, (j + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __half* sk = fsm + (j & 1) * 2 * S::TILE;
    const __half* sv = sk + S::TILE;
    const int key0 = j * kFlashKeys;
    if (key0 <= last_lim) {  // a tile past all of the warp's rows is skipped
      float s[kFlashKeys / 8][4];
#pragma unroll
      for (int nt = 0; nt < kFlashKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int np = 0; np < kFlashKeys / 16; ++np) {
          uint32_t b[4];
          const int key = np * 16 + (lane & 7) + 8 * (lane >> 4);
          dev::i8::ldsm_x4(b, sk + key * S::PITCH + kk * 16 + 8 * ((lane >> 3) & 1));
          mma_f16(s[2 * np], qh[kk], b[0], b[1]);
          mma_f16(s[2 * np], ql[kk], b[0], b[1]);
          mma_f16(s[2 * np + 1], qh[kk], b[2], b[3]);
          mma_f16(s[2 * np + 1], ql[kk], b[2], b[3]);
        }
      }
      // causal mask (only tiles that reach past the warp's first row need it)
      if (key0 + kFlashKeys - 1 > first_lim) {
#pragma unroll
        for (int nt = 0; nt < kFlashKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key0 + nt * 8 + 2 * tc + (e & 1) > lim[e >> 1]) s[nt][e] = -INFINITY;
      }
      // online softmax (base 2: Q carries log2 e)
      float alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = m[i];
#pragma unroll
        for (int nt = 0; nt < kFlashKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[i] = exp2f(m[i] - mx);  // m = -inf at the first tile: 0 (mx is finite: position 0 is always visible)
        m[i] = mx;
        l[i] *= alpha[i];
      }
#pragma unroll
      for (int d = 0; d < HD / 8; ++d) {
        o[d][0] *= alpha[0];
        o[d][1] *= alpha[0];
        o[d][2] *= alpha[1];
        o[d][3] *= alpha[1];
      }
#pragma unroll
      for (int nt = 0; nt < kFlashKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = exp2f(s[nt][e] - m[e >> 1]);
          l[e >> 1] += s[nt][e];
        }
      // O += P V, P split into fp16 hi + lo A fragments (the S accumulators of two key octets)
#pragma unroll
      for (int ks = 0; ks < kFlashKeys / 16; ++ks) {
        uint32_t ph[4], pl[4];
        split_h2(s[2 * ks][0], s[2 * ks][1], ph[0], pl[0]);
        split_h2(s[2 * ks][2], s[2 * ks][3], ph[1], pl[1]);
        split_h2(s[2 * ks + 1][0], s[2 * ks + 1][1], ph[2], pl[2]);
        split_h2(s[2 * ks + 1][2], s[2 * ks + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          uint32_t b[4];
          const int key = ks * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
          ldsm_x4_trans(b, sv + key * S::PITCH + dp * 16 + 8 * (lane >> 4));
          mma_f16(o[2 * dp], ph, b[0], b[1]);
          mma_f16(o[2 * dp], pl, b[0], b[1]);
          mma_f16(o[2 * dp + 1], ph, b[2], b[3]);
          mma_f16(o[2 * dp + 1], pl, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration's load
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const int n_head = n_head_kv * G;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (tok[i] >= n) continue;
    const float inv = 1.f / l[i];
    float* orow = out + static_cast<int64_t>(tok[i]) * n_head * HD + head[i] * HD;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
      *reinterpret_cast<float2*>(orow + d * 8 + 2 * tc) = make_float2(o[d][2 * i] * inv, o[d][2 * i + 1] * inv);
  }
}

// Row t: out[i] = cos, out[hd / 2 + i] = sin of RoPE pair i at position pos0[0] + t (once per decode
// token or prefill chunk: every layer's attention reads it instead of evaluating double-precision
// sincos per block).
__global__ void rope_table_kernel(const int32_t* pos0, const __grid_constant__ Rope rope, int hd, float* out) {
  pdl_sync();
  const int i = threadIdx.x, t = blockIdx.x;
  float* row = out + static_cast<int64_t>(t) * hd;
  if (i < hd / 2) rope_cos_sin(i, pos0[0] + t, rope, row[i], row[hd / 2 + i]);
}

// A decode token's first kernel, embed_rows (one row) and rope_table (one position) in one launch: block 0
// the token's embedding row into x, block 1 its position's RoPE table (the same code, so the same floats).
__global__ void token_start_kernel(const __grid_constant__ Mat W, const int32_t* ids, float* x, const int32_t* pos0,
                                   const __grid_constant__ Rope rope, int hd, float* rope_out) {
  pdl_sync();  // the first kernel of a graph: no wait; its dependents may launch at once
  if (blockIdx.x == 0) {
    int id = ids[0];
    if (id < 0 || id >= W.rows) id = 0;  // the host validates ids; never read outside the table
    MOE_DISPATCH_TYPE(W.type, embed_t, W.data + id * W.row_stride, W.cols >> 5, x);
  } else {
    for (int i = threadIdx.x; i < hd / 2; i += blockDim.x)
      rope_cos_sin(i, pos0[0], rope, rope_out[i], rope_out[hd / 2 + i]);
  }
}

// The Rope parameters are __grid_constant__ in these kernels: rope_cos_sin takes them by reference, and a
// by-value struct parameter is then copied to local memory by every thread at the kernel's start.
template <int D, int G>
__global__ void __launch_bounds__(kDecWarps * 32, 3) attention_decode_kernel(const float* __restrict__ qkv,
                                                                          const int32_t* pos0, const float* q_norm,
                                                                          const float* k_norm, float eps,
                                                                          const __grid_constant__ Rope rope,
                                                                          __half* kc, __half* vc, int n_head_kv,
                                                                          int n_split, float* partials,
                                                                          int* counters, float* out_all,
                                                                          const float* rope_cs, int min_chunk,
                                                                          int defer, int warm, int tree_min,
                                                                          int leaf, int kv_evict) {
  extern __shared__ float sm[];
  MOE_TRACE_SCOPE(4);
  attention_decode_item<D, G>(blockIdx.x, blockIdx.y, qkv, pos0, q_norm, k_norm, eps, rope, kc, vc, n_head_kv, n_split,
                              partials, counters, out_all, rope_cs, sm, true, min_chunk, defer, warm != 0,
                              tree_min, leaf, kv_evict);  // waits after its first loads
}

template <int HD, int G>
cudaError_t launch_flash(const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* kc, const void* vc,
                         int n_head_kv, float* out, cudaStream_t s) {
  using S = FlashShape<HD>;
  static const cudaError_t attr = cudaFuncSetAttribute(flash_attention_kernel<HD, G>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(S::SMEM));
  if (attr != cudaSuccess) return attr;
  const dim3 grid((n + kFlashRows / G - 1) / (kFlashRows / G), n_head_kv);
  return launch_pdl(flash_attention_kernel<HD, G>, grid, dim3(kFlashWarps * 32), S::SMEM, s, qkv, qkv_stride, n, pos0,
                    static_cast<const __half*>(kc), static_cast<const __half*>(vc), n_head_kv, out);
}

template <int HD>
cudaError_t flash_g(int G, const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* kc,
                    const void* vc, int n_head_kv, float* out, cudaStream_t s) {
  switch (G) {
    case 1: return launch_flash<HD, 1>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, out, s);
    case 2: return launch_flash<HD, 2>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, out, s);
    case 4: return launch_flash<HD, 4>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, out, s);
    case 8: return launch_flash<HD, 8>(qkv, qkv_stride, n, pos0, kc, vc, n_head_kv, out, s);
    default: return cudaErrorInvalidValue;
  }
}

// The decode attention's warm pass before its wait (attention_decode_item); MOE_CUDA_ATT_WARM=0 off.
bool attention_warm_pass() {
  static const bool v = env_switch("MOE_CUDA_ATT_WARM", true);
  return v;
}

template <int D, int G>
cudaError_t launch_attention_decode(const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm,
                                    float eps, Rope rope, void* kc, void* vc, int n_head_kv, int n_split,
                                    float* partials, int* counters, float* out, const float* rope_cs, cudaStream_t s,
                                    int defer) {
  const size_t smem = static_cast<size_t>(dec_smem_floats(G, D * 32)) * sizeof(float);  // over 48 KB with the ring
  static const cudaError_t attr = cudaFuncSetAttribute(attention_decode_kernel<D, G>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  return launch_pdl(attention_decode_kernel<D, G>, dim3(n_head_kv, n_split), dim3(kDecWarps * 32), smem, s, qkv, pos0,
                    q_norm, k_norm, eps, rope, static_cast<__half*>(kc), static_cast<__half*>(vc), n_head_kv, n_split,
                    partials, counters, out, rope_cs, attention_min_chunk(), defer, attention_warm_pass() ? 1 : 0,
                    attention_tree_min(), attention_leaf(), (l2_evict_mask() & kEvictKv) ? 1 : 0);
}

template <int D>
cudaError_t attention_decode_g(int G, const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               float eps, Rope rope, void* kc, void* vc, int n_head_kv, int n_split, float* partials,
                               int* counters, float* out, const float* rope_cs, cudaStream_t s, int defer) {
  switch (G) {
#define MOE_ATT_DEC(GG)                                                                                              \
  case GG:                                                                                                           \
    return launch_attention_decode<D, GG>(qkv, pos0, q_norm, k_norm, eps, rope, kc, vc, n_head_kv, n_split, partials, \
                                          counters, out, rope_cs, s, defer);
    MOE_ATT_DEC(1) MOE_ATT_DEC(2) MOE_ATT_DEC(4) MOE_ATT_DEC(8)
#undef MOE_ATT_DEC
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool attention_supported(int n_head, int n_head_kv, int head_dim) {
  if (n_head_kv <= 0 || n_head % n_head_kv != 0) return false;
  const int G = n_head / n_head_kv;
  return (head_dim == 64 || head_dim == 128) && (G == 1 || G == 2 || G == 4 || G == 8);
}

cudaError_t qk_norm_rope_store(float* qkv, int n, const int32_t* pos0, const float* q_norm, const float* k_norm,
                               int n_head, int n_head_kv, int head_dim, float eps, Rope rope, void* k_cache,
                               void* v_cache, const float* rope_cs, cudaStream_t s) {
  if (head_dim % 64 != 0 || head_dim > 256 || n < 1 || n_head < 1 || n_head_kv < 1) return cudaErrorInvalidValue;
  const int64_t warps = static_cast<int64_t>(n) * (n_head + n_head_kv);
  return launch_pdl(qk_norm_rope_store_kernel, dim3(static_cast<unsigned>((warps + kQkWarps - 1) / kQkWarps)),
                    dim3(32 * kQkWarps), 0, s, qkv, n, pos0, q_norm, k_norm, n_head, n_head_kv, head_dim, eps, rope,
                    static_cast<__half*>(k_cache), static_cast<__half*>(v_cache), rope_cs);
}

cudaError_t attention(const float* qkv, int qkv_stride, int n, const int32_t* pos0, const void* k_cache,
                      const void* v_cache, int n_head, int n_head_kv, int head_dim, float* out, cudaStream_t s) {
  if (!attention_supported(n_head, n_head_kv, head_dim) || n < 1) return cudaErrorInvalidValue;
  const int G = n_head / n_head_kv;
  if (head_dim == 64) return flash_g<64>(G, qkv, qkv_stride, n, pos0, k_cache, v_cache, n_head_kv, out, s);
  return flash_g<128>(G, qkv, qkv_stride, n, pos0, k_cache, v_cache, n_head_kv, out, s);
}

cudaError_t attention_decode(const float* qkv, const int32_t* pos0, const float* q_norm, const float* k_norm, float eps,
                             Rope rope, void* k_cache, void* v_cache, int n_head, int n_head_kv, int head_dim,
                             int n_split, float* partials, int* counters, float* out, const float* rope_cs,
                             cudaStream_t s, int defer) {
  if (!attention_supported(n_head, n_head_kv, head_dim) || n_split < 1 || n_split > kMaxSplit || defer < 0 ||
      defer > kAttMaxDefer)
    return cudaErrorInvalidValue;
  const int G = n_head / n_head_kv;
  if (head_dim == 64)
    return attention_decode_g<2>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split,
                                 partials, counters, out, rope_cs, s, defer);
  return attention_decode_g<4>(G, qkv, pos0, q_norm, k_norm, eps, rope, k_cache, v_cache, n_head_kv, n_split, partials,
                               counters, out, rope_cs, s, defer);
}

int attention_tree_min() {
  static const int v = env_int("MOE_CUDA_ATT_TREE", 17, 0, 1 << 20);
  return v;
}

int attention_leaf() {
  static const int v = env_int("MOE_CUDA_ATT_LEAF", 8, kAttLeafMin, kAttLeafMax);
  return v;
}

int attention_min_chunk() {
  static const int v = env_int("MOE_CUDA_ATT_CHUNK", kDecMinChunk, 1, 1 << 20);
  return v;
}

cudaError_t token_start(const Mat& embd, const int32_t* token, float* x, const int32_t* pos, Rope rope, int head_dim,
                        float* rope_out, cudaStream_t s) {
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > 2048) return cudaErrorInvalidValue;
  return launch_pdl(token_start_kernel, dim3(2), dim3(128), 0, s, embd, token, x, pos, rope, head_dim, rope_out);
}

cudaError_t rope_table(const int32_t* pos0, int n, Rope rope, int head_dim, float* out, cudaStream_t s) {
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > 2048 || n < 1) return cudaErrorInvalidValue;
  return launch_pdl(rope_table_kernel, dim3(n), dim3((head_dim / 2 + 31) / 32 * 32), 0, s, pos0, rope, head_dim, out);
}

}  // namespace moe::cuda::k

MOE_TRACE_TU(attention)
