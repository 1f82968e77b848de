// Shared device helpers: the swizzled activation vector in shared memory, block reductions, top-k.
#pragma once
#include "dequant.cuh"
#include "launch.cuh"

namespace moe::cuda::dev {

// Programmatic dependent launch (sm_90): kernels launched with launch_pdl may start while the
// previous kernel drains. Each such kernel calls pdl_wait() before touching activations (it returns
// once the previous kernel has finished and its writes are visible) and pdl_trigger() right after,
// so that when a kernel runs its pre-wait part the kernel two steps back is complete: weights and
// anything older may be prefetched before the wait.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_sync() {
  pdl_wait();
  pdl_trigger();
}
// The decode attention's cut of a context of len positions into slices (the attention and the O
// projection that merges deferred slices must agree): slices of `chunk` positions, at least min_chunk
// when there are several, and then a whole number of the blocks' 32-position groups (a slice of 65
// positions costs a block three rounds like one of 96, and 64 slices to merge instead of 43); returns how
// many hold positions.
__host__ __device__ __forceinline__ int dec_slices(int len, int n_split, int min_chunk, int& chunk) {
  chunk = (len + n_split - 1) / n_split;
  if (n_split > 1) chunk = chunk < min_chunk ? min_chunk : (chunk + 31) / 32 * 32;
  return (len + chunk - 1) / chunk;
}
// A release store at GPU scope (a flag that orders the writes before it).
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Pulls `bytes` at p into L2 (spread over the lanes of a warp).
__device__ __forceinline__ void prefetch_l2(const uint8_t* p, int64_t bytes, int lane) {
  for (int64_t off = static_cast<int64_t>(lane) * 128; off < bytes; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// Starts pulling [p, p + bytes) into L2 through the SM's TMA unit (sm_90; nothing before): no registers,
// and nothing comes back through L1, so loads this SM issues next are not queued behind the DRAM
// misses (a decode GEMV's staging of x measured ~3 us slower behind ordinary weight loads). p must be
// 16-byte aligned and bytes a multiple of 16 (device weight rows are, layout.cuh).
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// Sends an L2Hint's rows to L2 (launch.cuh), from the grid's last block (the first ones start on their
// weights first), in pieces of 128 KB over the lanes of its first warp.
__device__ __forceinline__ void send_hint_to_l2(const k::L2Hint& h) {
  if (h.pos == nullptr || blockIdx.x != gridDim.x - 1 || threadIdx.x >= 32) return;
  const int64_t bytes = static_cast<int64_t>(min(h.pos[0], h.max_rows)) * h.row_bytes;
  constexpr int64_t kPiece = 131072;  // the SM issues bulk prefetches one by one (~45 ns each)
  for (int64_t off = threadIdx.x * kPiece; off < 2 * bytes; off += 32 * kPiece) {
    const int r = off >= bytes;
    const int64_t o = off - r * bytes;
    bulk_prefetch_l2(static_cast<const uint8_t*>(h.base[r]) + o, static_cast<uint32_t>(min(kPiece, bytes - o)));
  }
}

// Asynchronous 16-byte copies global -> shared (sm_80+, L2 only). The zero-filling form writes 16
// zero bytes instead when ok is false (src is then not read). Groups: commit, then wait until at most
// N groups are still in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Bulk copies global -> shared through the SM's TMA unit, completed on an mbarrier in shared memory
// (sm_90): the block's thread(s) init the barrier with the number of arrivals a phase takes, each
// arrival announces the bytes its copies will bring (expect_tx), and a phase completes once every arrival
// is in and every byte has landed; waiters spin on the phase's parity. dst, src 16-byte aligned, bytes
// a multiple of 16. Nothing comes back through L1: loads the SM issues meanwhile do not queue behind the
// copies' DRAM misses.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the TMA unit
#endif
}
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}
// L2 eviction priority (MOE_CUDA_EVICT, launch.cuh): the decode's weight rows and cache rows are read
// once per token, so they go to L2 marked evict_first and leave room for what is read again soon (the
// next layer's Q/K/V rows sent ahead, the O projection's rows, the activations). l2_evict_first(on): the
// policy operand of the .L2::cache_hint forms below, or 0, for which they issue the plain forms.
__device__ __forceinline__ uint64_t l2_evict_first(bool on) {
  uint64_t p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (on) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!pol) {
    bulk_prefetch_l2(p, bytes);
    return;
  }
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(__cvta_generic_to_global(p)),
               "r"(bytes), "l"(pol)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!pol) {
    bulk_copy_g2s(dst, src, bytes, bar);
    return;
  }
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_addr(bar)), "l"(pol)
      : "memory");
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint64_t pol) {
  if (!pol) {
    cp_async16(dst, src);
    return;
  }
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool ok, uint64_t pol) {
  if (!pol) {
    cp_async16_zfill(dst, src, ok);
    return;
  }
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(ok ? 16 : 0), "l"(pol)
               : "memory");
}
// Whether the barrier's phase with this parity has completed (no wait).
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
#endif
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Activations live in shared memory as groups of 32 floats (8 float4 chunks). Chunk c of group g is
// stored at float4 index 8g + (c ^ (g & 7)): lanes of a warp read different groups at once, and
// without the xor 8 of them would hit the same 16-byte bank.
__device__ __forceinline__ int swz(int e) {
  int g = e >> 5, c = (e >> 2) & 7;
  return ((g * 8 + (c ^ (g & 7))) << 2) | (e & 3);
}

// Dot of group g of a row of type T with the swizzled activations xs.
template <uint32_t T>
__device__ __forceinline__ float dot_group(const uint8_t* row, int g, const float4* xs) {
  float v[32];
  dequant32<T>(row, g, v);
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float4 x = xs[g * 8 + (c ^ (g & 7))];
    acc = fmaf(v[4 * c], x.x, acc);
    acc = fmaf(v[4 * c + 1], x.y, acc);
    acc = fmaf(v[4 * c + 2], x.z, acc);
    acc = fmaf(v[4 * c + 3], x.w, acc);
  }
  return acc;
}

// This lane's share of row · xs over n_groups groups (not yet reduced over the warp).
template <uint32_t T>
__device__ __forceinline__ void lane_dot_t(const uint8_t* row, int n_groups, const float4* xs, int lane, float& acc) {
#pragma unroll 2
  for (int g = lane; g < n_groups; g += 32) acc += dot_group<T>(row, g, xs);
}
__device__ __forceinline__ float lane_dot(uint32_t type, const uint8_t* row, int n_groups, const float4* xs, int lane) {
  float acc = 0.f;
  MOE_DISPATCH_TYPE(type, lane_dot_t, row, n_groups, xs, lane, acc);
  return acc;
}

// Two rows of the same type at once: twice the loads in flight per lane.
template <uint32_t T>
__device__ __forceinline__ void lane_dot2_t(const uint8_t* r0, const uint8_t* r1, int n_groups, const float4* xs,
                                            int lane, float& a0, float& a1) {
#pragma unroll 2
  for (int g = lane; g < n_groups; g += 32) {
    a0 += dot_group<T>(r0, g, xs);
    a1 += dot_group<T>(r1, g, xs);
  }
}
__device__ __forceinline__ void lane_dot2(uint32_t t0, const uint8_t* r0, uint32_t t1, const uint8_t* r1, int n_groups,
                                          const float4* xs, int lane, float& a0, float& a1) {
  a0 = 0.f;
  a1 = 0.f;
  if (t0 == t1) {
    MOE_DISPATCH_TYPE(t0, lane_dot2_t, r0, r1, n_groups, xs, lane, a0, a1);
  } else {
    a0 = lane_dot(t0, r0, n_groups, xs, lane);
    a1 = lane_dot(t1, r1, n_groups, xs, lane);
  }
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : 0.f;
  return warp_sum(t);
}

// The prefill's RMSNorm of one row by the whole block: o[i] = xr[i] * rsqrt(mean(xr^2) + eps) * w[i]
// (rmsnorm_rows; rmsnorm_split_h16 adds the split of the written row).
__device__ __forceinline__ void rmsnorm_row(const float* xr, const float* w, int cols, float eps, float* o, float* red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, red);
  const float scale = rsqrtf(ss / static_cast<float>(cols) + eps);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// Loads n floats of x into swizzled shared memory, optionally as rmsnorm(x) * w.
__device__ __forceinline__ void load_act(const float* __restrict__ x, int n, const float* __restrict__ norm_w,
                                         float eps, float* xs, float* red) {
  float scale = 1.f;
  if (norm_w) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    scale = rsqrtf(ss / static_cast<float>(n) + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[swz(i)] = x[i] * scale * norm_w[i];
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[swz(i)] = x[i];
  }
  __syncthreads();
}

// Softmax over the n logits in shared memory, then the top k (lowest index on ties), weights
// renormalised over the chosen set (clamped as llama.cpp does). Run by one warp.
// prob[i] = softmax(logits)[i] for i < n, by one warp (logits and prob may be the same array).
__device__ __forceinline__ void softmax_warp(const float* logits, int n, float* prob) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int i = lane; i < n; i += 32) mx = fmaxf(mx, logits[i]);
  mx = warp_max(mx);
  float sum = 0.f;
  for (int i = lane; i < n; i += 32) {
    const float p = expf(logits[i] - mx);
    prob[i] = p;
    sum += p;
  }
  sum = warp_sum(sum);
  const float inv = 1.f / sum;
  for (int i = lane; i < n; i += 32) prob[i] *= inv;
  __syncwarp();
}

__device__ __forceinline__ void softmax_topk_warp(const float* logits, int n, int k, int32_t* ids, float* weights,
                                                  float* prob /* n floats of scratch */) {
  const int lane = threadIdx.x & 31;
  softmax_warp(logits, n, prob);
  float chosen_sum = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = -1.f;
    int bi = 0x7fffffff;
    for (int i = lane; i < n; i += 32) {
      float p = prob[i];
      if (p > best || (p == best && i < bi)) { best = p; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float ob = __shfl_xor_sync(0xffffffffu, best, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
    if (lane == 0) {
      ids[j] = bi;
      weights[j] = best;
      prob[bi] = -2.f;  // taken
    }
    chosen_sum += best;
    __syncwarp();
  }
  const float denom = fmaxf(chosen_sum, 6.103515625e-5f);
  if (lane < k) weights[lane] = weights[lane] / denom;
  __syncwarp();
}

constexpr int kMaxExperts = 1024;
// The rankings' count: two lanes per element of s_logit[0..n) split the comparisons with the others (four
// running counts each, so that the adds do not form one long chain) and the pair's first lane calls
// f(i, s_logit[i], count) for each element i < n. kExact: count = the elements ranked before i (above it,
// or equal with a lower index: its rank); else the elements strictly above it, four per float4 load
// (s_logit 16-byte aligned).
template <bool kExact, typename F>
__device__ __forceinline__ void count_before(const float* s_logit, int n, F&& f) {
  const int half = kExact ? (n + 1) >> 1 : ((n + 7) >> 3) << 2;  // else a multiple of 4: aligned float4 loads
  const float4* q4 = reinterpret_cast<const float4*>(s_logit);
  for (int base = 0; base < 2 * n; base += blockDim.x) {
    const int i2 = base + static_cast<int>(threadIdx.x), i = i2 >> 1, h = i2 & 1;
    int r[4] = {0, 0, 0, 0};
    float p = 0.f;
    if (i < n) {
      p = s_logit[i];
      const int j0 = h * half, j1 = min(n, j0 + half);
      int j = j0;
      for (; j + 4 <= j1; j += 4) {
        if constexpr (kExact) {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float q = s_logit[j + u];
            r[u] += (q > p) || (q == p && j + u < i);
          }
        } else {
          const float4 q = q4[j >> 2];
          r[0] += q.x > p;
          r[1] += q.y > p;
          r[2] += q.z > p;
          r[3] += q.w > p;
        }
      }
      for (; j < j1; ++j) {
        const float q = s_logit[j];
        r[0] += kExact ? (q > p) || (q == p && j < i) : q > p;
      }
    }
    int count = (r[0] + r[1]) + (r[2] + r[3]);
    count += __shfl_xor_sync(0xffffffffu, count, 1);
    if (i < n && h == 0) f(i, p, count);
  }
}
// The exact ranking (rank_experts' fallback): s_logit[0..n) in shared memory (visible: written before a
// barrier), s_id[0..k) holding valid ids (a NaN logit is never ranked). Writes s_id and s_w (the chosen
// logits) in rank order and ends with a barrier.
__device__ __forceinline__ void rank_experts_exact(const float* s_logit, int n, int k, int32_t* s_id, float* s_w) {
  count_before<true>(s_logit, n, [&](int i, float p, int rank) {
    // a NaN compares false with every logit, so its count is 0 whatever the others: it would race the best
    // logit for slot 0. NaNs are left out; the others' counts never include them (their ranks among the
    // logits that are numbers), and the slots past those stay 0.
    if (rank < k && p == p) {
      s_id[rank] = i;
      s_w[rank] = p;  // the logit, in rank order
    }
  });
  __syncthreads();
}
// The ranking: s_logit[0..n) in shared memory (visible: written before a barrier), s_id[0..k) set to -1
// before that barrier. Writes s_id and s_w (the chosen logits) in rank order, ties to the lower id, and
// ends with a barrier; s_id always holds valid ids (a NaN logit is never ranked).
// Each element counts only the logits strictly above it (two lanes per element, four per shared load:
// ~2 instructions per comparison, a third of the exact count's; every block of the gate/up grid ranks,
// and the ranking was 30 % of that kernel's instructions, ncu). That count is the element's rank unless
// it ties with another (or is NaN); an element counting fewer than k above it claims that rank's slot
// of s_id, and a tie (or NaN) among the k best shows up as two elements claiming one slot: no
// claim clashes exactly when every one of the k best is unique, and the slots are then the exact ranks.
// On a clash the block ranks again exactly.
__device__ __forceinline__ void rank_experts(const float* s_logit, int n, int k, int32_t* s_id, float* s_w) {
  bool clash = k > n || (reinterpret_cast<uintptr_t>(s_logit) & 15) != 0;  // block-uniform
  if (!clash) {
    count_before<false>(s_logit, n, [&](int i, float p, int above) {
      if (above < k) {
        clash = clash || atomicExch(s_id + above, i) != -1;
        s_w[above] = p;
      }
    });
    if (!__syncthreads_or(clash)) return;
  }
  if (static_cast<int>(threadIdx.x) < k) s_id[threadIdx.x] = 0;  // valid ids even for NaN logits
  __syncthreads();
  rank_experts_exact(s_logit, n, k, s_id, s_w);
}
// The weights of the chosen (one warp, k <= 64): out[j] = exp(c (l_j - l_0)) / Σ_j' exp(c (l_j' - l_0))
// for the chosen logits l in rank order in s_w; c > 0 scales every logit (1 when they are final). out may
// be s_w itself.
__device__ __forceinline__ void expert_weights_warp(const float* s_w, int k, float c, float* out) {
  const int lane = threadIdx.x & 31;
  const float top = s_w[0];
  const float e0 = lane < k ? expf(c * (s_w[lane] - top)) : 0.f;
  const float e1 = lane + 32 < k ? expf(c * (s_w[lane + 32] - top)) : 0.f;
  const float inv = 1.f / warp_sum(e0 + e1);
  __syncwarp();
  if (lane < k) out[lane] = e0 * inv;
  if (lane + 32 < k) out[lane + 32] = e1 * inv;
}
// The experts of one token chosen by a whole block (blockDim a multiple of 64, >= 64) from its router
// logits in global memory (n <= kMaxExperts, written by the previous kernel; s_logit holds n floats of
// shared memory): each expert's rank among the logits counted in parallel (ties to the lower id), the k
// best in rank order to s_id; with `weights` (block-uniform) also their weights to s_w: the softmax
// over all n renormalised over the chosen k, i.e. exp(l_j - l_max) / Σ_chosen exp(l - l_max) (the
// softmax's denominator cancels; llama.cpp's clamp of the chosen sum at 2^-14 cannot apply, as the
// largest probability is at least 1/n). On return (after a barrier) every thread sees s_id[0..k) (and
// s_w). Ranking the logits themselves orders exactly as double-precision probabilities do (float ones
// can round two different logits to a tie); each block of the expert kernels runs it itself: no block
// has to wait for a last one (a last block's tail measured slower, docs/PERFORMANCE.md version 8).
__device__ __forceinline__ void choose_experts(const float* logits, int n, int k, float* s_logit, int32_t* s_id,
                                               float* s_w, bool weights) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) s_logit[i] = __ldcg(logits + i);
  if (static_cast<int>(threadIdx.x) < k) s_id[threadIdx.x] = -1;  // rank_experts' free slots
  __syncthreads();
  rank_experts(s_logit, n, k, s_id, s_w);
  if (!weights) return;
  if (threadIdx.x < 32) expert_weights_warp(s_w, k, 1.f, s_w);
  __syncthreads();
}

}  // namespace moe::cuda::dev

namespace moe::cuda::k {
bool pdl_enabled();  // on unless MOE_CUDA_PDL=0 (see gemv.cu)
int carveout_pref();  // MOE_CUDA_CARVEOUT=N (0..100): every kernel's preferred shared-memory carveout; -1 none

// cudaLaunchKernelEx with at most one launch attribute (none when attr is null).
template <typename... KArgs, typename... Args>
cudaError_t launch_with(const cudaLaunchAttribute* attr, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                        cudaStream_t s, Args... args) {
  if (const int c = carveout_pref(); c >= 0)
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, c);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute a[1];
  if (attr) a[0] = *attr;
  cfg.attrs = a;
  cfg.numAttrs = attr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

// Launches with the programmatic-stream-serialization attribute (see pdl_wait).
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(pdl_enabled() ? &attr : nullptr, kernel, grid, block, smem, s, args...);
}
}  // namespace moe::cuda::k
