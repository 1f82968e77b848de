// The CUDA forward on a real model file, and its main kernels in GB/s beside the device-to-device
// copy bandwidth measured in the same run.
//
//   MOE_BENCH_MODEL=model.gguf bench_cuda [--benchmark_filter=...]
//
// Counters: tok_per_s (decode at depth 0 and 4096, pp512), weights_GBps (bytes of weights read per
// second: decode counts the attention/router/LM-head weights plus the 8 chosen experts of every
// layer), copy_GBps (cudaMemcpy device to device, bytes read + written).
#include <benchmark/benchmark.h>

#if defined(MOE_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "launch.cuh"
#include "trace.cuh"
#include "moe/cuda.hpp"
#include "moe/model.hpp"
#include "moe/sampler.hpp"
#include "moe/quant.hpp"

namespace {

using moe::gguf::Type;
namespace k = moe::cuda::k;

void ck(cudaError_t e) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

// ---- copy bandwidth -------------------------------------------------------------------------------
void BM_CopyBandwidth(benchmark::State& st) {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  ck(cudaMalloc(&a, bytes));
  ck(cudaMalloc(&b, bytes));
  ck(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0));
  ck(cudaEventCreate(&e1));
  ck(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  double total_ms = 0;
  for (auto _ : st) {
    ck(cudaEventRecord(e0));
    ck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    ck(cudaEventRecord(e1));
    ck(cudaEventSynchronize(e1));
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3);
    total_ms += ms;
  }
  st.counters["copy_GBps"] = 2.0 * bytes * st.iterations() / (total_ms / 1e3) / 1e9;
  cudaFree(a);
  cudaFree(b);
}
BENCHMARK(BM_CopyBandwidth)->UseManualTime()->Iterations(20)->Unit(benchmark::kMillisecond);

// Address translation: one pointer-chasing thread visits one 8-byte word per 2 MiB page of a region of
// range(0) MiB (random page order, offsets within the pages spread over L2 sets) inside one 16 GiB
// allocation. After a first pass every line is in L2 (8,192 pages = 1 MiB of lines), so cycles per
// step = L2 latency + page-walk cost; a TLB reach smaller than the region shows as a step up.
// Measured on the H200 (2026-11-30, an ad-hoc version of this): 277-291 cycles from 16 MiB to 16 GiB,
// the same with 64 KiB strides over 1 GiB and in a cuMemCreate mapping: no page walks to speak of on
// the decode's working set. The 16 GiB stay allocated until the process ends (every range reuses
// them): on a GPU with less than ~40 GB run it on its own (--benchmark_filter=BM_PageWalk), since the
// model benchmarks after it need room for the model.
void BM_PageWalk(benchmark::State& st) {
  constexpr int64_t kTotal = int64_t{16} << 30, kPage = int64_t{2} << 20;
  static void* base = nullptr;
  if (!base && cudaMalloc(&base, kTotal) != cudaSuccess) {
    cudaGetLastError();
    st.SkipWithError("16 GiB not available");
    return;
  }
  const int64_t region = st.range(0) << 20;
  const int n = static_cast<int>(region / kPage);
  std::vector<int64_t> off(static_cast<size_t>(n));
  std::vector<int> perm(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
  std::mt19937 rng(1);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < n; ++i) {
    const int64_t p = perm[static_cast<size_t>(i)];
    off[static_cast<size_t>(i)] = p * kPage + (p * 4224 % (kPage / 2)) / 128 * 128;
  }
  void *doff_p = nullptr, *dcyc_p = nullptr;
  ck(cudaMalloc(&doff_p, off.size() * sizeof(int64_t)));
  ck(cudaMalloc(&dcyc_p, 2 * sizeof(long long)));
  auto* doff = static_cast<int64_t*>(doff_p);
  auto* dcyc = static_cast<long long*>(dcyc_p);
  ck(cudaMemcpy(doff, off.data(), off.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  ck(k::chain_links(base, doff, n, nullptr));
  ck(k::chase_links(base, off[0], n, dcyc, nullptr));  // every line into L2
  const int steps = std::min(n, 4096);
  double cycles = 0;
  for (auto _ : st) {
    ck(k::chase_links(base, off[0], steps, dcyc, nullptr));
    long long c[2];
    ck(cudaMemcpy(c, dcyc, sizeof(c), cudaMemcpyDeviceToHost));
    cycles += static_cast<double>(c[0]) / steps;
  }
  st.counters["cycles_per_step"] = cycles / static_cast<double>(st.iterations());
  st.counters["pages"] = n;
  cudaFree(doff);
  cudaFree(dcyc);
}
BENCHMARK(BM_PageWalk)->RangeMultiplier(4)->Range(16, 16384)->Iterations(3)->Unit(benchmark::kMillisecond);

// ---- kernels on random Q4_K weights of the Qwen3-30B-A3B shapes -------------------------------------
// `rows` rows of `cols` Q4_K elements, built from 64 quantized random rows repeated (quantizing
// hundreds of MB on the CPU would dominate the run).
struct DevMatrix {
  k::Mat m;
  void* p = nullptr;
  DevMatrix(Type t, int64_t rows, int64_t cols) {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> d(0.f, 1.f);
    const size_t rb = moe::gguf::row_bytes(t, cols);
    const size_t db = moe::cuda::device_bytes(t, cols, 1);
    std::vector<uint8_t> q(rb * 64), packed(db * 64);
    std::vector<float> src(cols);
    for (int r = 0; r < 64; ++r) {
      for (float& v : src) v = d(rng);
      moe::quant::quantize_row(t, src.data(), q.data() + r * rb, cols);
    }
    moe::cuda::repack_rows(t, q.data(), packed.data(), cols, 64);
    ck(cudaMalloc(&p, db * rows));
    for (int64_t r = 0; r < rows; r += 64)
      ck(cudaMemcpy(static_cast<uint8_t*>(p) + r * db, packed.data(), db * std::min<int64_t>(64, rows - r),
                    cudaMemcpyHostToDevice));
    m.data = static_cast<uint8_t*>(p);
    m.type = static_cast<uint32_t>(t);
    m.rows = static_cast<int32_t>(rows);
    m.cols = static_cast<int32_t>(cols);
    m.row_stride = static_cast<int64_t>(db);
    m.expert_stride = m.row_stride * rows;
  }
  ~DevMatrix() { cudaFree(p); }
};

float* dev_floats(size_t n) {
  float* p = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)));
  std::vector<float> h(n);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> d(0.f, 1.f);
  for (float& v : h) v = d(rng);
  ck(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

// Times `launch(stream)` as the decode runs it: kReps launches captured once into a CUDA graph and
// replayed, so that host launch overhead does not hide (or stand in for) the kernel's own time. The
// benchmarks that use it run a fixed kMicroIters replays: with the manual time of one launch (a few
// microseconds) against the wall time of a replay of kReps, Google Benchmark's default minimum time took
// ~50x its 0.5 s of wall time per benchmark (BM_AttentionDecode/1 alone ran past 30 s on the H200).
constexpr int kMicroIters = 40;
template <typename F>
void time_kernel(benchmark::State& st, double bytes_per_call, F&& launch) {
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0));
  ck(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) ck(launch(s));
  constexpr int kReps = 50;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kReps; ++i) ck(launch(s));
  ck(cudaStreamEndCapture(s, &graph));
  ck(cudaGraphInstantiate(&exec, graph, 0));
  ck(cudaGraphLaunch(exec, s));
  ck(cudaStreamSynchronize(s));
  double total_ms = 0;
  for (auto _ : st) {
    ck(cudaEventRecord(e0, s));
    ck(cudaGraphLaunch(exec, s));
    ck(cudaEventRecord(e1, s));
    ck(cudaEventSynchronize(e1));
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3 / kReps);
    total_ms += ms / kReps;
  }
  st.counters["weights_GBps"] = bytes_per_call * st.iterations() / (total_ms / 1e3) / 1e9;
  st.counters["us_per_call"] = total_ms * 1e3 / st.iterations();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
}

// 336 dependent empty kernels (7 launches x 48 layers, the decode graph of version 3) replayed from one graph: the
// per-kernel floor of launch + drain, with range(0) blocks of 128 threads each.
void BM_LaunchChain(benchmark::State& st) {
  const int blocks = static_cast<int>(st.range(0));
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 336; ++i) ck(k::noop(blocks, 128, s));
  ck(cudaStreamEndCapture(s, &graph));
  ck(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0));
  ck(cudaEventCreate(&e1));
  ck(cudaGraphLaunch(exec, s));
  ck(cudaStreamSynchronize(s));
  double total_ms = 0;
  for (auto _ : st) {
    ck(cudaEventRecord(e0, s));
    ck(cudaGraphLaunch(exec, s));
    ck(cudaEventRecord(e1, s));
    ck(cudaEventSynchronize(e1));
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3);
    total_ms += ms;
  }
  st.counters["us_per_kernel"] = total_ms * 1e3 / st.iterations() / 336;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
}
BENCHMARK(BM_LaunchChain)
    ->Arg(1)
    ->Arg(132)
    ->Arg(320)
    ->Arg(1024)
    ->Iterations(kMicroIters)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_GemvLmHeadQ6K(benchmark::State& st) {
  DevMatrix W(Type::Q6_K, 151936, 2048);
  float* x = dev_floats(2048);
  float* y = dev_floats(151936);
  k::GemvOut o{W.m, y};
  time_kernel(st, static_cast<double>(W.m.row_stride) * W.m.rows,
              [&](cudaStream_t s) { return k::gemv(&o, 1, x, nullptr, 0.f, false, s); });
  cudaFree(x);
  cudaFree(y);
}
BENCHMARK(BM_GemvLmHeadQ6K)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GemvQkvQ4K(benchmark::State& st) {
  DevMatrix Wq(Type::Q4_K, 4096, 2048), Wk(Type::Q4_K, 512, 2048), Wv(Type::Q6_K, 512, 2048);
  float* x = dev_floats(2048);
  float* w = dev_floats(2048);
  float* y = dev_floats(5120);
  k::GemvOut o[3] = {{Wq.m, y}, {Wk.m, y + 4096}, {Wv.m, y + 4608}};
  const double bytes = static_cast<double>(Wq.m.row_stride) * 4096 + Wk.m.row_stride * 512.0 + Wv.m.row_stride * 512.0;
  time_kernel(st, bytes, [&](cudaStream_t s) { return k::gemv(o, 3, x, w, 1e-6f, false, s); });
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
}
BENCHMARK(BM_GemvQkvQ4K)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ExpertGateUpQ4K(benchmark::State& st) {
  DevMatrix G(Type::Q4_K, 128 * 768, 2048), U(Type::Q4_K, 128 * 768, 2048);
  G.m.rows = U.m.rows = 768;
  G.m.expert_stride = U.m.expert_stride = G.m.row_stride * 768;
  float* h = dev_floats(2048);
  float* act = dev_floats(8 * 768);
  // router logits that pick experts 3, 17, 40, 77, 90, 101, 115, 127
  std::vector<float> hl(128, 0.f);
  for (int e : {3, 17, 40, 77, 90, 101, 115, 127}) hl[e] = 1.f + 0.01f * e;
  float* logits = dev_floats(128);
  ck(cudaMemcpy(logits, hl.data(), 128 * sizeof(float), cudaMemcpyHostToDevice));
  float* wt = dev_floats(8);
  int32_t* ids = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&ids), 32));
  time_kernel(st, 2.0 * 8 * 768 * G.m.row_stride,
              [&](cudaStream_t s) { return k::expert_gate_up(G.m, U.m, h, logits, 128, 8, ids, wt, act, s); });
  for (float* p : {h, act, logits, wt}) cudaFree(p);
  cudaFree(ids);
}
BENCHMARK(BM_ExpertGateUpQ4K)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ExpertDownQ6K(benchmark::State& st) {
  DevMatrix D(Type::Q6_K, 128 * 2048, 768);
  D.m.rows = 2048;
  D.m.expert_stride = D.m.row_stride * 2048;
  float* act = dev_floats(8 * 768);
  float* x = dev_floats(2048);
  float* w = dev_floats(8);
  int32_t* ids = nullptr;
  std::vector<int32_t> hid = {3, 17, 40, 77, 90, 101, 115, 127};
  ck(cudaMalloc(reinterpret_cast<void**>(&ids), 32));
  ck(cudaMemcpy(ids, hid.data(), 32, cudaMemcpyHostToDevice));
  time_kernel(st, 8.0 * 2048 * D.m.row_stride, [&](cudaStream_t s) { return k::expert_down_add(D.m, act, ids, w, 8, x, s); });
  cudaFree(act);
  cudaFree(x);
  cudaFree(w);
  cudaFree(ids);
}
BENCHMARK(BM_ExpertDownQ6K)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GemvOutProjQ4K(benchmark::State& st) {
  DevMatrix W(Type::Q4_K, 2048, 4096);
  float* x = dev_floats(4096);
  float* y = dev_floats(2048);
  k::GemvOut o{W.m, y};
  time_kernel(st, static_cast<double>(W.m.row_stride) * W.m.rows,
              [&](cudaStream_t s) { return k::gemv(&o, 1, x, nullptr, 0.f, true, s); });
  cudaFree(x);
  cudaFree(y);
}
BENCHMARK(BM_GemvOutProjQ4K)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_RouteF32(benchmark::State& st) {
  DevMatrix R(Type::F32, 128, 2048);
  float* x = dev_floats(2048);
  float* w = dev_floats(2048);
  float* h = dev_floats(2048);
  float* logits = dev_floats(128);
  time_kernel(st, 128.0 * 2048 * 4, [&](cudaStream_t s) { return k::route_token(x, w, 1e-6f, R.m, h, logits, s); });
  for (float* p : {x, w, h, logits}) cudaFree(p);
}
BENCHMARK(BM_RouteF32)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Decode attention (32 query heads, 4 KV heads of 128; norm + RoPE + store of the new row included) over
// a cache of depth range(0).
void BM_AttentionDecode(benchmark::State& st) {
  const int depth = static_cast<int>(st.range(0)), Hq = 32, Hkv = 4, hd = 128, splits = 64;
  const int stride = (Hq + 2 * Hkv) * hd;
  void *kc = nullptr, *vc = nullptr;
  const size_t cache = static_cast<size_t>(depth + 1) * Hkv * hd * 2;
  ck(cudaMalloc(&kc, cache));
  ck(cudaMalloc(&vc, cache));
  ck(cudaMemset(kc, 0x3c, cache));  // fp16 ~1.0x
  ck(cudaMemset(vc, 0x3a, cache));
  float* qkv = dev_floats(stride);
  float* gains = dev_floats(hd);
  float* out = dev_floats(Hq * hd);
  // the slices' records and the two-level merge's group records, and their counters
  float* part = dev_floats(k::attention_partials_floats(Hkv, splits, Hq / Hkv, hd));
  int *counters = nullptr, *pos = nullptr;
  const size_t n_counters = static_cast<size_t>(k::attention_counter_ints(Hkv, splits)) * sizeof(int);
  ck(cudaMalloc(reinterpret_cast<void**>(&counters), n_counters));
  ck(cudaMemset(counters, 0, n_counters));
  ck(cudaMalloc(reinterpret_cast<void**>(&pos), 4));
  ck(cudaMemcpy(pos, &depth, 4, cudaMemcpyHostToDevice));
  k::Rope rope;
  rope.theta_scale = std::pow(1e6f, -2.0f / hd);
  time_kernel(st, 2.0 * cache, [&](cudaStream_t s) {
    return k::attention_decode(qkv, pos, gains, gains, 1e-6f, rope, kc, vc, Hq, Hkv, hd, splits, part, counters, out,
                               nullptr, s);
  });
  for (float* p : {qkv, gains, out, part}) cudaFree(p);
  cudaFree(kc);
  cudaFree(vc);
  cudaFree(counters);
  cudaFree(pos);
}
BENCHMARK(BM_AttentionDecode)
    ->Arg(1)
    ->Arg(4096)
    ->Iterations(kMicroIters)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// Prefill attention of range(0) new tokens after range(1) cached ones (32 query heads, 4 KV heads of 128);
// counter TFLOPs: attention TFLOP/s (QK^T and PV over the visible positions).
void BM_AttentionPrefill(benchmark::State& st) {
  const int n = static_cast<int>(st.range(0)), past = static_cast<int>(st.range(1)), Hq = 32, Hkv = 4, hd = 128;
  const int stride = (Hq + 2 * Hkv) * hd;
  void *kc = nullptr, *vc = nullptr;
  const size_t cache = static_cast<size_t>(past + n) * Hkv * hd * 2;
  ck(cudaMalloc(&kc, cache));
  ck(cudaMalloc(&vc, cache));
  ck(cudaMemset(kc, 0x3c, cache));
  ck(cudaMemset(vc, 0x3a, cache));
  float* qkv = dev_floats(static_cast<size_t>(n) * stride);
  float* out = dev_floats(static_cast<size_t>(n) * Hq * hd);
  int* pos = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&pos), 4));
  ck(cudaMemcpy(pos, &past, 4, cudaMemcpyHostToDevice));
  time_kernel(st, 0.0, [&](cudaStream_t s) { return k::attention(qkv, stride, n, pos, kc, vc, Hq, Hkv, hd, out, s); });
  double pairs = 0;
  for (int t = 0; t < n; ++t) pairs += past + t + 1;
  st.counters["TFLOPs"] = 4.0 * Hq * hd * pairs / (st.counters["us_per_call"] * 1e-6) / 1e12;
  for (float* p : {qkv, out}) cudaFree(p);
  cudaFree(kc);
  cudaFree(vc);
  cudaFree(pos);
}
// (fixed iterations: each one replays 50 calls, and the manual time counts one)
BENCHMARK(BM_AttentionPrefill)->Args({512, 0})->Args({512, 3584})->Iterations(40)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ArgmaxVocab(benchmark::State& st) {
  float* x = dev_floats(151936);
  float* scratch = dev_floats(k::kArgmaxScratch);
  ck(cudaMemset(scratch, 0, k::kArgmaxScratch * sizeof(float)));  // the one-launch merge's counter starts at zero
  int32_t* out = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(int32_t)));  // {argmax, non-finite}
  time_kernel(st, 151936.0 * 4, [&](cudaStream_t s) { return k::argmax(x, 151936, scratch, out, s); });
  cudaFree(x);
  cudaFree(scratch);
  cudaFree(out);
}
BENCHMARK(BM_ArgmaxVocab)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The device sampler over a Qwen vocabulary: top-k range(0) at temperature 0.7 with a repeat penalty over 64
// tokens (range(0) = 1: greedy with the penalty).
void BM_SampleVocab(benchmark::State& st) {
  const int V = 151936;
  float* x = dev_floats(V);
  std::vector<float> h(V);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (float& v : h) v = nd(rng);
  ck(cudaMemcpy(x, h.data(), V * sizeof(float), cudaMemcpyHostToDevice));
  void* scratch = nullptr;
  ck(cudaMalloc(&scratch, k::kSampleScratchBytes));
  ck(cudaMemset(scratch, 0, k::kSampleScratchBytes));  // its counters start at zero
  int32_t *hist = nullptr, *out = nullptr, *chain = nullptr;
  double* u = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&hist), 8192 * sizeof(int32_t)));
  ck(cudaMemset(hist, 0, 8192 * sizeof(int32_t)));
  ck(cudaMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(int32_t)));
  ck(cudaMalloc(reinterpret_cast<void**>(&chain), 2 * sizeof(int32_t)));
  ck(cudaMemset(chain, 0, 2 * sizeof(int32_t)));
  const double half[2] = {0.5, 0.5};
  ck(cudaMalloc(reinterpret_cast<void**>(&u), sizeof(half)));
  ck(cudaMemcpy(u, half, sizeof(half), cudaMemcpyHostToDevice));
  k::SampleParams p;
  p.temperature = 0.7f;
  p.top_k = static_cast<int>(st.range(0));
  p.greedy = p.top_k == 1;
  p.penalty = 1.1f;
  p.last_n = 64;
  // the position grows by one each launch; the window stays inside hist (8192 > the replays' launches)
  time_kernel(st, V * 4.0, [&](cudaStream_t s) { return k::sample(x, V, p, scratch, hist, 8192, u, out, nullptr, chain, chain + 1, s); });
  for (void* q : {static_cast<void*>(x), scratch, static_cast<void*>(hist), static_cast<void*>(out),
                  static_cast<void*>(chain), static_cast<void*>(u)})
    cudaFree(q);
}
BENCHMARK(BM_SampleVocab)->Arg(40)->Arg(128)->Arg(1)->Iterations(kMicroIters)->UseManualTime()->Unit(benchmark::kMicrosecond);

// ---- the whole forward ---------------------------------------------------------------------------------
struct Loaded {
  std::shared_ptr<const moe::model::OwnedQuantizedModel> model;
  std::unique_ptr<moe::Forward> fwd;
  double bytes_per_token = 0;
};
Loaded* loaded() {
  static std::unique_ptr<Loaded> l;
  if (l) return l.get();
  const char* path = std::getenv("MOE_BENCH_MODEL");
  if (!path) return nullptr;
  l = std::make_unique<Loaded>();
  l->model = moe::model::OwnedQuantizedModel::open(path);
  moe::cuda::Options o;
  o.n_ctx = 8192;
  moe::cuda::DeviceInfo info;
  l->fwd = moe::cuda::make_forward(l->model, o, &info);
  std::fprintf(stderr, "model %s on %s: %lu MiB VRAM, resident in %.0f ms, decode by the %s\n", path,
               info.name.c_str(), static_cast<unsigned long>(info.vram_used_mib), info.upload_ms,
               info.decode_path.c_str());
  const auto& c = l->model->config;
  double b = static_cast<double>(l->model->output.info->nbytes);
  for (const auto& L : l->model->layers) {
    b += L.attn_q.info->nbytes + L.attn_k.info->nbytes + L.attn_v.info->nbytes + L.attn_output.info->nbytes +
         L.ffn_gate_inp.info->nbytes;
    b += (static_cast<double>(L.ffn_gate_exps.info->nbytes) + L.ffn_up_exps.info->nbytes + L.ffn_down_exps.info->nbytes) *
         c.n_expert_used / c.n_expert;
  }
  l->bytes_per_token = b;
  return l.get();
}

std::vector<int32_t> some_tokens(int n, int64_t vocab) {
  std::mt19937_64 rng(1234);
  std::uniform_int_distribution<int64_t> d(0, std::min<int64_t>(vocab, 150000) - 1);
  std::vector<int32_t> v(n);
  for (int32_t& t : v) t = static_cast<int32_t>(d(rng));
  return v;
}

void BM_Decode(benchmark::State& st) {
  Loaded* l = loaded();
  if (!l) {
    st.SkipWithError("MOE_BENCH_MODEL is not set");
    return;
  }
  const int depth = static_cast<int>(st.range(0));
  l->fwd->reset();
  std::vector<float> logits;
  if (depth > 0) l->fwd->eval(some_tokens(depth, l->fwd->n_vocab()), false, logits);
  int32_t tok = 1000;
  const int64_t start = l->fwd->n_past();
  for (auto _ : st) {
    if (l->fwd->n_past() >= start + 256) {  // stay near the depth asked for
      st.PauseTiming();
      l->fwd->reset();
      if (depth > 0) l->fwd->eval(some_tokens(depth, l->fwd->n_vocab()), false, logits);
      st.ResumeTiming();
    }
    tok = l->fwd->eval_greedy(tok);
  }
  st.counters["tok_per_s"] = benchmark::Counter(static_cast<double>(st.iterations()), benchmark::Counter::kIsRate);
  st.counters["weights_GBps"] =
      benchmark::Counter(l->bytes_per_token * st.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)->Arg(0)->Arg(4096)->Iterations(256)->Unit(benchmark::kMicrosecond);

// Sampled decoding (temperature 0.7, top-k 40, the CLI's default when sampling) as BM_Decode: the draw on the
// device, one step ahead (Forward::eval_sample); the sampler's graph is captured before the timed loop.
void BM_DecodeSampled(benchmark::State& st) {
  Loaded* l = loaded();
  if (!l) {
    st.SkipWithError("MOE_BENCH_MODEL is not set");
    return;
  }
  moe::run::SamplerParams p;
  p.temperature = 0.7f;
  if (!l->fwd->samples_on_device(p)) {
    st.SkipWithError("no sampler on the device (MOE_CUDA_DEVICE_SAMPLER=0?)");
    return;
  }
  moe::run::Sampler sampler(p);
  const std::function<double()> uniform = [&sampler] { return sampler.uniform(); };
  const int depth = static_cast<int>(st.range(0));
  std::vector<int32_t> hist;
  auto restart = [&] {
    l->fwd->reset();
    hist = depth > 0 ? some_tokens(depth, l->fwd->n_vocab()) : std::vector<int32_t>{};
    std::vector<float> logits;
    if (depth > 0) l->fwd->eval(hist, false, logits);
    hist.push_back(1000);
  };
  restart();
  hist.push_back(l->fwd->eval_sample(hist, p, uniform));
  const size_t start = hist.size();
  for (auto _ : st) {
    if (hist.size() >= start + 256) {
      st.PauseTiming();
      restart();
      st.ResumeTiming();
    }
    hist.push_back(l->fwd->eval_sample(hist, p, uniform));
  }
  st.counters["tok_per_s"] = benchmark::Counter(static_cast<double>(st.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DecodeSampled)->Arg(0)->Iterations(256)->Unit(benchmark::kMicrosecond);

#ifdef MOE_TRACE
// Per-block timestamps of two decode tokens (trace.cuh), written as CSV to $MOE_TRACE_OUT: after 8 greedy
// tokens from an empty context (/0: positions 8-9), or after a prompt of range(0) tokens (/136: positions
// 144-145, where the CLI's usual measurement decodes; /4096: 4104-4105; written to $MOE_TRACE_OUT.<n>).
void BM_DecodeTrace(benchmark::State& st) {
  Loaded* l = loaded();
  const char* out = std::getenv("MOE_TRACE_OUT");
  if (!l || !out) {
    st.SkipWithError("MOE_BENCH_MODEL and MOE_TRACE_OUT must be set");
    return;
  }
  namespace k = moe::cuda::k;
  using moe::cuda::dev::TraceRec;
  void* buf = nullptr;
  unsigned* count = nullptr;
  cudaMalloc(&buf, sizeof(TraceRec) * moe::cuda::dev::kTraceCap);
  cudaMalloc(reinterpret_cast<void**>(&count), sizeof(unsigned));
  k::trace_attach_gemv_tc(buf, count);
  k::trace_attach_gemv(buf, count);
  k::trace_attach_attention(buf, count);
  k::trace_attach_decode_persist(buf, count);
  const int depth = static_cast<int>(st.range(0));
  int32_t tok = 1000;
  for (auto _ : st) {
    l->fwd->reset();
    if (depth > 0) {
      std::vector<float> logits;
      l->fwd->eval(some_tokens(depth, l->fwd->n_vocab()), false, logits);
    }
    for (int i = 0; i < 8; ++i) tok = l->fwd->eval_greedy(tok);
    cudaMemset(count, 0, sizeof(unsigned));
    cudaDeviceSynchronize();
    for (int i = 0; i < 2; ++i) tok = l->fwd->eval_greedy(tok);
    cudaDeviceSynchronize();
  }
  unsigned n = 0;
  cudaMemcpy(&n, count, sizeof(n), cudaMemcpyDeviceToHost);
  n = std::min(n, moe::cuda::dev::kTraceCap);
  std::vector<TraceRec> recs(n);
  cudaMemcpy(recs.data(), buf, sizeof(TraceRec) * n, cudaMemcpyDeviceToHost);
  k::trace_attach_gemv_tc(nullptr, nullptr);
  k::trace_attach_gemv(nullptr, nullptr);
  k::trace_attach_attention(nullptr, nullptr);
  k::trace_attach_decode_persist(nullptr, nullptr);
  cudaFree(buf);
  cudaFree(count);
  const std::string path = depth > 0 ? std::string(out) + "." + std::to_string(depth) : std::string(out);
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "kind,block,sm,t0,t1,t2,t3,t4,t5,t6,t7\n");
    for (const TraceRec& r : recs) {
      std::fprintf(f, "%u,%u,%u", r.kind, r.block, r.sm);
      for (uint64_t t : r.t) std::fprintf(f, ",%llu", static_cast<unsigned long long>(t));
      std::fprintf(f, "\n");
    }
    std::fclose(f);
  }
  st.counters["records"] = n;
}
BENCHMARK(BM_DecodeTrace)->Arg(0)->Arg(136)->Arg(4096)->Iterations(1)->Unit(benchmark::kMillisecond);
#endif

void BM_Prefill(benchmark::State& st) {
  Loaded* l = loaded();
  if (!l) {
    st.SkipWithError("MOE_BENCH_MODEL is not set");
    return;
  }
  const int n = static_cast<int>(st.range(0));
  const std::vector<int32_t> ids = some_tokens(n, l->fwd->n_vocab());
  std::vector<float> logits;
  l->fwd->reset();
  l->fwd->eval(ids, false, logits);  // warm-up
  for (auto _ : st) {
    l->fwd->reset();
    l->fwd->eval(ids, false, logits);
  }
  st.counters["tok_per_s"] = benchmark::Counter(static_cast<double>(st.iterations()) * n, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill)->Arg(512)->Iterations(5)->Unit(benchmark::kMillisecond);

}  // namespace
#endif

BENCHMARK_MAIN();
