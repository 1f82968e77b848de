// The decode step's token drawn on the device: the sampler of src/run/sampler.cpp (repeat penalty ->
// greedy, or temperature -> top-k -> top-p -> min-p -> draw) for top-k up to kSampleMaxK, so that a sampled
// decode step can run one step ahead like a greedy one (the host only supplies the step's uniform).
//
// One launch: block b turns its chunk of the vocabulary into 64-bit keys (the tempered value's bits in an order
// that sorts like the floats, then the complement of the id: the key order is the host's candidate order, larger
// logit first, lower id on ties) and leaves its first kp (64 or 128) sorted: a threshold from block counts cuts
// the chunk to those and the few that tie with them, which are sorted in shared memory (block_first). The last
// block to finish merges the blocks' lists pairwise in its warps' registers (bitonic merges keeping the first
// kp) and then, in one warp, runs the host's top-p, min-p and draw on the first top_k keys in double precision,
// in the host's order of additions, so that the same logits and uniform give the same token as Sampler::sample.
// Greedy with a repeat penalty takes the first key. ~18-26 us a launch on the H200 over 151,936 logits
// (bench_cuda BM_SampleVocab); a step sampled on the host cost ~155 us more (its logits back, the host's pass).
#include <cmath>

#include "common.cuh"

namespace moe::cuda::k {
using namespace dev;

namespace {

constexpr int kSampleThreads = 1024;

__device__ __forceinline__ uint64_t sample_key(float v, int id) {
  uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);  // -0 ties with +0, as the host's comparison has it
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(b) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ float key_value(uint64_t key) {
  const uint32_t b = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}
__device__ __forceinline__ int key_id(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// A bitonic sort of the block's E * blockDim keys, descending, thread t holding the E consecutive keys E t ..
// E t + E - 1 in registers: stages of distance j < E inside a thread, j < 32 E between the lanes of a warp
// (shuffles), only the longer ones through shared memory `a` (two barriers each).
template <int E, int J>
__device__ __forceinline__ void stage_in_thread(uint64_t (&v)[E], int k) {
#pragma unroll
  for (int r = 0; r < E; ++r)
    if ((r & J) == 0) {
      const bool desc = ((E * static_cast<int>(threadIdx.x) + r) & k) == 0;
      const uint64_t x = v[r], y = v[r | J];
      if (desc ? x < y : x > y) {
        v[r] = y;
        v[r | J] = x;
      }
    }
}

template <int E>
__device__ void sort_desc(uint64_t (&v)[E], uint64_t* a) {
  const int t = threadIdx.x, n = E * static_cast<int>(blockDim.x);
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j < E) {
        if (j == 1) stage_in_thread<E, 1>(v, k);
        if constexpr (E > 2) if (j == 2) stage_in_thread<E, 2>(v, k);
        if constexpr (E > 4) if (j == 4) stage_in_thread<E, 4>(v, k);
        continue;
      }
      const bool lower = (t & (j / E)) == 0;  // this thread's keys have bit j clear: the first of each pair
      if (j < 32 * E) {
#pragma unroll
        for (int r = 0; r < E; ++r) {
          const uint64_t y = __shfl_xor_sync(0xffffffffu, v[r], j / E);
          const bool larger = lower == (((E * t + r) & k) == 0);
          v[r] = larger ? max(v[r], y) : min(v[r], y);
        }
        continue;
      }
#pragma unroll
      for (int r = 0; r < E; ++r) a[E * t + r] = v[r];
      __syncthreads();
#pragma unroll
      for (int r = 0; r < E; ++r) {
        const uint64_t y = a[(E * t + r) ^ j];
        const bool larger = lower == (((E * t + r) & k) == 0);
        v[r] = larger ? max(v[r], y) : min(v[r], y);
      }
      __syncthreads();
    }
}

// Sorts a[0..n) descending in shared memory (n a power of two), every thread of the block taking part.
__device__ void sort_smem(uint64_t* a, int n) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
        const int i = ((t & ~(j - 1)) << 1) | (t & (j - 1)), l = i + j;  // the pair's first has bit j clear
        const uint64_t x = a[i], y = a[l];
        if ((i & k) == 0 ? x < y : x > y) {
          a[i] = y;
          a[l] = x;
        }
      }
      __syncthreads();
    }
}

// The block's first kp keys (of the E per thread), sorted, to out[0..kp), zeros past its numbers. Sorting all
// of them cost ~16 us a launch at 2,048 keys (the bitonic sort's 66 stages are instruction-bound at one block per
// SM; docs/PERFORMANCE.md version 29), so: the largest tau whose step (the key's upper 16 bits) at least
// min(kp, numbers) keys reach, found bit by bit from block counts (a key below it has that many above it, so
// it is not among the first), then only the keys at or above tau (kp plus those sharing its step, at most
// kSampleCap) sorted in shared memory `a`; with more (ties) all of them are sorted.
constexpr int kSampleCap = 1024;
template <int E>
__device__ void block_first(uint64_t (&key)[E], uint64_t* a, int kp, uint64_t* out) {
  __shared__ int warp_count[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int numbers = 0;  // block counts by the barrier's own reduction (a shared counter's atomics serialise)
#pragma unroll
  for (int r = 0; r < E; ++r) numbers += __syncthreads_count(key[r] != 0);
  const int want = min(kp, numbers);
  uint32_t tau = 0;
  int count = 0;
  // the upper 16 bits only (sign, exponent, 7 mantissa bits: values within 2^-7 of each other share a step), half
  // the barriers of the full search for a few more candidates
  for (int bit = 31; bit >= 16 && want > 0; --bit) {
    const uint32_t trial = tau | (1u << bit);
    int c = 0;
#pragma unroll
    for (int r = 0; r < E; ++r) c += __syncthreads_count(static_cast<uint32_t>(key[r] >> 32) >= trial);
    if (c >= want) {
      tau = trial;
      count = c;
    }
  }
  if (want > 0 && count <= kSampleCap) {
    // the candidates to a[0..count) in thread order (ballots and the warps' counts), zeros up to np
    int np = 1;
    while (np < max(count, kp)) np <<= 1;
    unsigned ballot[E];
    int in_warp = 0;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      ballot[r] = __ballot_sync(0xffffffffu, key[r] != 0 && static_cast<uint32_t>(key[r] >> 32) >= tau);
      in_warp += __popc(ballot[r]);
    }
    if (lane == 0) warp_count[warp] = in_warp;
    for (int i = count + static_cast<int>(threadIdx.x); i < np; i += blockDim.x) a[i] = 0;
    __syncthreads();
    int at = 0;
    for (int w = 0; w < warp; ++w) at += warp_count[w];
    const unsigned below = (1u << lane) - 1;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      if (ballot[r] >> lane & 1) a[at + __popc(ballot[r] & below)] = key[r];
      at += __popc(ballot[r]);
    }
    __syncthreads();
    sort_smem(a, np);
    for (int i = threadIdx.x; i < kp; i += blockDim.x) out[i] = a[i];
    return;
  }
  sort_desc<E>(key, a);
#pragma unroll
  for (int r = 0; r < E; ++r)
    if (E * static_cast<int>(threadIdx.x) + r < kp) out[E * threadIdx.x + r] = key[r];
}

// Two sorted lists of 32 KL keys to the first 32 KL of both, sorted, in one warp's registers (lane l holds
// keys KL l .. KL l + KL - 1 of each): a[i] = max(A[i], B[n - 1 - i]) holds them as a bitonic sequence, which
// half-cleaners of distance n/2 .. 1 sort (between lanes by shuffles, the last inside a lane).
template <int KL>
__device__ __forceinline__ void merge_pair(uint64_t (&a)[KL], const uint64_t (&b)[KL]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < KL; ++r) a[r] = max(a[r], __shfl_sync(0xffffffffu, b[KL - 1 - r], 31 - lane));
#pragma unroll
  for (int j = 16 * KL; j >= KL; j >>= 1) {
    const bool lower = (lane & (j / KL)) == 0;
#pragma unroll
    for (int r = 0; r < KL; ++r) {
      const uint64_t y = __shfl_xor_sync(0xffffffffu, a[r], j / KL);
      a[r] = lower ? max(a[r], y) : min(a[r], y);
    }
  }
#pragma unroll
  for (int j = KL / 2; j > 0; j >>= 1)
#pragma unroll
    for (int r = 0; r < KL; ++r)
      if ((r & j) == 0 && a[r] < a[r | j]) {
        const uint64_t x = a[r];
        a[r] = a[r | j];
        a[r | j] = x;
      }
}

// `lists` sorted lists of kp = 32 KL keys at a + m kp to one, in a[0..kp): pairs merged by the warps (one
// barrier a level); an odd list at the end of a level waits for the next.
template <int KL>
__device__ void merge_lists(uint64_t* a, int lists) {
  constexpr int kp = 32 * KL;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int s = 1; s < lists; s <<= 1) {
    const int pairs = (lists + s - 1) / s / 2;
    for (int q = warp; q < pairs; q += warps) {
      uint64_t* A = a + static_cast<size_t>(2 * q) * s * kp;
      const uint64_t* B = A + static_cast<size_t>(s) * kp;
      uint64_t x[KL], y[KL];
#pragma unroll
      for (int r = 0; r < KL; ++r) {
        x[r] = A[KL * lane + r];
        y[r] = B[KL * lane + r];
      }
      merge_pair<KL>(x, y);
#pragma unroll
      for (int r = 0; r < KL; ++r) A[KL * lane + r] = x[r];
    }
    __syncthreads();
  }
}

// The host's candidate cut and draw on the sorted keys c[0..n) (n >= 1), by warp 0; lane 0 returns the token.
// e[i] = exp(v_i - top) in double as the host computes it; every sum runs in the host's order on lane 0.
__device__ int draw_from(const uint64_t* c, int n, const SampleParams& p, double u, double* e) {
  const int lane = threadIdx.x & 31;
  const double top = key_value(c[0]);
  for (int i = lane; i < n; i += 32) e[i] = exp(static_cast<double>(key_value(c[i])) - top);
  __syncwarp();
  int token = key_id(c[0]);
  if (lane == 0) {
    if (p.top_p < 1.0f) {
      double sum = 0;
      for (int i = 0; i < n; ++i) sum += e[i];
      double cum = 0;
      int keep = n;
      for (int i = 0; i < n; ++i) {
        cum += e[i] / sum;
        if (cum >= p.top_p) {  // the token that crosses p is kept
          keep = i + 1;
          break;
        }
      }
      n = keep;
    }
    if (p.min_p > 0.0f) {
      const double floor = top + log(static_cast<double>(p.min_p));
      int keep = 1;
      while (keep < n && static_cast<double>(key_value(c[keep])) >= floor) ++keep;
      n = keep;
    }
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += e[i];
    if (sum > 0 && isfinite(sum)) {
      const double target = u * sum;
      double cum = 0;
      token = key_id(c[n - 1]);
      for (int i = 0; i < n; ++i) {
        cum += e[i];
        if (cum >= target) {
          token = key_id(c[i]);
          break;
        }
      }
    }
  }
  return token;
}

template <int E>  // chunk = E * kSampleThreads
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const float* x, int n, SampleParams p, int chunk, int kp,
                                                               uint64_t* part, int* counter, int32_t* hist, int n_ctx,
                                                               const double* u, int32_t* out, int32_t* host,
                                                               int32_t* next_token, int32_t* next_pos) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int win[kSampleMaxWindow];
  __shared__ bool last;
  const int lists = static_cast<int>(gridDim.x);  // the merge's: one per block
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  float* vals = reinterpret_cast<float*>(smem + static_cast<size_t>(max(chunk, lists * kp)) * 8);
  pdl_sync();
  const int pos = next_pos[0];
  const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
  bool bad = false;
  for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
    const float v = lo + i < hi ? x[lo + i] : 0.0f;
    bad |= !isfinite(v);
    vals[i] = v;
  }
  // the repeat penalty on this chunk's share of the window hist[pos + 1 - m .. pos] (each id once)
  const int m = p.penalty != 1.0f && p.last_n > 0 ? min(pos + 1, min(p.last_n, kSampleMaxWindow)) : 0;
  for (int j = threadIdx.x; j < m; j += blockDim.x) win[j] = hist[pos + 1 - m + j];
  __syncthreads();
  for (int j = threadIdx.x; j < m; j += blockDim.x) {
    const int id = win[j];
    if (id < lo || id >= hi) continue;
    bool first = true;
    for (int q = 0; q < j && first; ++q) first = win[q] != id;
    if (!first) continue;
    const float l = vals[id - lo];
    vals[id - lo] = l > 0 ? static_cast<float>(static_cast<double>(l) / p.penalty) : __fmul_rn(l, p.penalty);
  }
  __syncthreads();
  // l / t correctly rounded (the double quotient of two floats rounds to the float one); NaN never a candidate
  const double t = p.greedy ? 1.0 : static_cast<double>(p.temperature);
  uint64_t key[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const int i = E * static_cast<int>(threadIdx.x) + r;
    const float v = vals[i];
    key[r] = lo + i < hi && !isnan(v) ? sample_key(static_cast<float>(static_cast<double>(v) / t), lo + i) : 0;
  }
  block_first<E>(key, keys, kp, part + static_cast<size_t>(blockIdx.x) * kp);
  __threadfence();
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    if (bad) atomicOr(counter + 1, 1);
    __threadfence();
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const double draw = threadIdx.x == 0 && !p.greedy ? *reinterpret_cast<const volatile double*>(u + (pos & 1)) : 0.0;
  for (int i = threadIdx.x; i < lists * kp; i += blockDim.x) keys[i] = __ldcg(part + i);
  __syncthreads();
  if (kp == 64)
    merge_lists<2>(keys, lists);
  else
    merge_lists<4>(keys, lists);
  if (threadIdx.x >= 32) return;
  const int want = p.greedy ? 1 : min(p.top_k, kp);
  int nc = 0;  // the candidates: keys past the last number are 0
  for (int i = threadIdx.x; i < want; i += 32) nc += keys[i] != 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) nc += __shfl_xor_sync(0xffffffffu, nc, o);
  int token = 0;  // no number at all: the host's argmax answers 0
  if (nc > 0) token = p.greedy ? key_id(keys[0]) : draw_from(keys, nc, p, __shfl_sync(0xffffffffu, draw, 0), reinterpret_cast<double*>(vals));
  if (threadIdx.x == 0) {
    const int flagged = atomicExch(counter + 1, 0);
    counter[0] = 0;  // for the next launch
    int32_t* dst = host ? host + 2 * (pos & 1) : out;
    dst[0] = token;
    dst[1] = flagged ? 1 : 0;
    if (pos + 1 < n_ctx) hist[pos + 1] = token;
    next_token[0] = token;
    next_pos[0] = pos + 1;
  }
}

int sample_lists(int n_vocab, int chunk) { return (n_vocab + chunk - 1) / chunk; }

// the keys each block leaves for the merge (its first 64 or 128: the warps merge lists of 32 KL keys)
int sample_kp(const SampleParams& p) { return !p.greedy && p.top_k > 64 ? 128 : 64; }

size_t sample_smem(int chunk, int lists, int kp) {
  return static_cast<size_t>(std::max(chunk, lists * kp)) * 8 + static_cast<size_t>(chunk) * 4;
}

}  // namespace

int sample_chunk(const SampleParams& p, int n_vocab) {
  const int kp = sample_kp(p);
  for (int chunk = 2048; chunk <= kSampleMaxChunk; chunk <<= 1)
    if (static_cast<size_t>(sample_lists(n_vocab, chunk)) * kp * 8 <= kSampleScratchBytes - 16) return chunk;
  return 0;
}

bool sample_supported(const SampleParams& p, int n_vocab) {
  if (n_vocab < 1) return false;
  if (!p.greedy && (p.top_k < 1 || p.top_k > kSampleMaxK || !(p.temperature > 0.0f) || !std::isfinite(p.temperature)))
    return false;
  if (p.penalty != 1.0f && p.last_n > kSampleMaxWindow) return false;
  return sample_chunk(p, n_vocab) > 0;
}

cudaError_t sample(const float* logits, int n, const SampleParams& p, void* scratch, int32_t* hist, int n_ctx,
                   const double* u, int32_t* out, int32_t* host, int32_t* next_token, int32_t* next_pos,
                   cudaStream_t s) {
  if (!sample_supported(p, n) || !hist || !next_token || !next_pos || (!p.greedy && !u) || (!out && !host))
    return cudaErrorInvalidValue;
  const int chunk = sample_chunk(p, n), kp = sample_kp(p), lists = sample_lists(n, chunk);
  const size_t smem = sample_smem(chunk, lists, kp);
  const int shape = chunk == 2 * kSampleThreads ? 0 : chunk == 4 * kSampleThreads ? 1 : 2;
  auto* kernel = shape == 0 ? sample_kernel<2> : shape == 1 ? sample_kernel<4> : sample_kernel<8>;
  // this launch's shared memory (38-55 KB for a 151,936-token vocabulary), granted per shape as it grows: a device
  // with less than a shape needs reports the error here, and the caller samples on the host
  static size_t granted[3] = {0, 0, 0};
  size_t& g = granted[shape];
  if (smem > g) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    g = smem;
  }
  int* counter = static_cast<int*>(scratch);
  uint64_t* part = reinterpret_cast<uint64_t*>(static_cast<unsigned char*>(scratch) + 16);
  return launch_pdl(kernel, dim3((n + chunk - 1) / chunk), dim3(kSampleThreads), smem, s, logits, n, p, chunk, kp, part,
                    counter, hist, n_ctx, u, out, host, next_token, next_pos);
}

}  // namespace moe::cuda::k
