// Opt-in per-block timestamps of the decode kernels (build with -DMOE_TRACE; compiled out otherwise).
// Each traced kernel opens a MOE_TRACE_SCOPE(kind) and marks up to six inner points; when the block
// exits, thread 0 appends {kind, block, SM, %globaltimer at entry / marks 1-6 / exit} to a
// device buffer attached by the host (k::trace_attach_all in bench_cuda's BM_DecodeTrace). Used to see
// where a kernel's time goes inside a captured decode graph, which profilers serialise.
#pragma once
#include <cstdint>

namespace moe::cuda::dev {
struct TraceRec {
  uint32_t kind, block, sm, pad;
  uint64_t t[8];  // entry, marks 1-6 (0 when not reached), exit
};
constexpr uint32_t kTraceCap = 1u << 20;
}  // namespace moe::cuda::dev

#if defined(MOE_TRACE) && defined(__CUDACC__)
static __device__ moe::cuda::dev::TraceRec* g_trace_buf = nullptr;
static __device__ unsigned* g_trace_count = nullptr;

namespace moe::cuda::dev {
__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t* trace_slots() {
  __shared__ uint64_t s[7];
  return s;
}
struct TraceScope {
  uint32_t kind;
  __device__ explicit TraceScope(uint32_t k) : kind(k) {
    if (threadIdx.x == 0) {
      trace_slots()[0] = gtimer();
      for (int i = 1; i < 7; ++i) trace_slots()[i] = 0;
    }
  }
  __device__ ~TraceScope() {
    if (threadIdx.x != 0 || !g_trace_buf) return;
    const uint64_t end = gtimer();
    const unsigned i = atomicAdd(g_trace_count, 1u);
    if (i >= kTraceCap) return;
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    TraceRec& r = g_trace_buf[i];
    r.kind = kind;
    r.block = blockIdx.x + blockIdx.y * gridDim.x;
    r.sm = sm;
    for (int k = 0; k < 7; ++k) r.t[k] = trace_slots()[k];
    r.t[7] = end;
  }
};
}  // namespace moe::cuda::dev
#define MOE_TRACE_SCOPE(k) ::moe::cuda::dev::TraceScope moe_trace_scope_(k)
#define MOE_TRACE_MARK(i) \
  do {                    \
    if (threadIdx.x == 0) ::moe::cuda::dev::trace_slots()[i] = ::moe::cuda::dev::gtimer(); \
  } while (0)
#define MOE_TRACE_TU(name)                                                            \
  namespace moe::cuda::k {                                                            \
  cudaError_t trace_attach_##name(void* buf, void* count) {                           \
    cudaError_t e = cudaMemcpyToSymbol(g_trace_buf, &buf, sizeof(buf));                \
    return e ? e : cudaMemcpyToSymbol(g_trace_count, &count, sizeof(count));           \
  }                                                                                   \
  }
#else
#define MOE_TRACE_SCOPE(k)
#define MOE_TRACE_MARK(i)
#define MOE_TRACE_TU(name)
#endif
