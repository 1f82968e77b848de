// GEMV throughput of the quant kernels in GB/s of weights read, beside the memory bandwidth of the
// same machine measured in the same run (memcpy and a plain read).
//
//   bench_quant [--benchmark_filter=...]   (counters: weights_GBps / copy_GBps / read_GBps)
//   bench_quant --benchmark_repetitions=8 --benchmark_report_aggregates_only=true
//     adds a "max" row per benchmark: the best repetition's rate, the figure least disturbed by
//     other work on a shared machine (compare it with the memcpy/read "max" rows).
//
// Every benchmark cycles through enough copies of its matrix (>= 256 MiB) that the weights come from
// DRAM, not the 32 MiB L3, as they do when a model runs.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moe/quant.hpp"

using moe::gguf::Type;
namespace q = moe::quant;

namespace {

constexpr size_t kWorkingSet = size_t{256} << 20;

struct AlignedBuf {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit AlignedBuf(size_t bytes) : n(bytes) {
    p = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    std::memset(p, 1, bytes);  // touch every page
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
};

int all_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

q::ThreadPool& pool_of(int n) {
  static std::map<int, std::unique_ptr<q::ThreadPool>> pools;
  auto& p = pools[n];
  if (!p) p = std::make_unique<q::ThreadPool>(n);
  return *p;
}

// Each thread copies / reads its own slice, so the figure is the machine's bandwidth for n threads.
void BM_Memcpy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  AlignedBuf src(kWorkingSet), dst(kWorkingSet);
  q::ThreadPool& pool = pool_of(threads);
  const int64_t chunks = 64;
  const size_t per = kWorkingSet / chunks;
  for (auto _ : state) {
    pool.run(chunks, [&](int64_t c, int) { std::memcpy(dst.p + c * per, src.p + c * per, per); });
    benchmark::ClobberMemory();
  }
  state.counters["copy_GBps"] =
      benchmark::Counter(static_cast<double>(kWorkingSet) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Read(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  AlignedBuf src(kWorkingSet);
  q::ThreadPool& pool = pool_of(threads);
  const int64_t chunks = 64;
  const size_t per = kWorkingSet / chunks;
  std::vector<uint64_t> sums(chunks);
  for (auto _ : state) {
    pool.run(chunks, [&](int64_t c, int) {
      const uint64_t* p = reinterpret_cast<const uint64_t*>(src.p + c * per);
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (size_t i = 0; i < per / 8; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
      sums[c] = s0 + s1 + s2 + s3;
    });
    benchmark::DoNotOptimize(sums.data());
  }
  state.counters["read_GBps"] =
      benchmark::Counter(static_cast<double>(kWorkingSet) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

size_t row_bytes_of(Type t, int64_t cols) {
  // Block bytes per block elements, REFERENCE.md §1.6.
  switch (t) {
    case Type::F32: return cols * 4;
    case Type::F16: case Type::BF16: return cols * 2;
    case Type::Q4_0: return cols / 32 * 18;
    case Type::Q4_1: return cols / 32 * 20;
    case Type::Q5_0: return cols / 32 * 22;
    case Type::Q5_1: return cols / 32 * 24;
    case Type::Q8_0: return cols / 32 * 34;
    case Type::Q2_K: return cols / 256 * 84;
    case Type::Q3_K: return cols / 256 * 110;
    case Type::Q4_K: return cols / 256 * 144;
    case Type::Q5_K: return cols / 256 * 176;
    case Type::Q6_K: return cols / 256 * 210;
    default: return 0;
  }
}

// A matrix quantized from Gaussian values: 64 distinct rows quantized once, repeated to fill the
// working set (the kernels' speed does not depend on the values).
struct Weights {
  std::unique_ptr<AlignedBuf> buf;
  size_t matrix_bytes = 0;
  int64_t copies = 0;
};

const Weights& weights_of(Type t, int64_t rows, int64_t cols) {
  static std::map<std::tuple<int, int64_t, int64_t>, Weights> cache;
  auto key = std::make_tuple(static_cast<int>(t), rows, cols);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cache.clear();  // one set at a time keeps memory bounded
  Weights w;
  const size_t rb = row_bytes_of(t, cols);
  w.matrix_bytes = rb * static_cast<size_t>(rows);
  w.copies = std::max<int64_t>(1, static_cast<int64_t>(kWorkingSet / w.matrix_bytes));
  w.buf = std::make_unique<AlignedBuf>(w.matrix_bytes * static_cast<size_t>(w.copies));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::vector<float> row(static_cast<size_t>(cols));
  const int64_t distinct = std::min<int64_t>(64, rows);
  for (int64_t r = 0; r < distinct; ++r) {
    for (auto& v : row) v = nd(rng);
    q::quantize_row(t, row.data(), w.buf->p + r * rb, cols);
  }
  for (int64_t r = distinct; r < rows * w.copies; ++r) std::memcpy(w.buf->p + r * rb, w.buf->p + (r % distinct) * rb, rb);
  return cache.emplace(key, std::move(w)).first->second;
}

void BM_Gemv(benchmark::State& state, Type t, int64_t rows, int64_t cols, int threads, q::ActMode mode) {
  const Weights& w = weights_of(t, rows, cols);
  std::vector<float> x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(rng);
  q::ThreadPool& pool = pool_of(threads);
  int64_t i = 0;
  for (auto _ : state) {
    q::Matrix m{w.buf->p + static_cast<size_t>(i % w.copies) * w.matrix_bytes, t, cols, rows, row_bytes_of(t, cols)};
    q::matmul(m, x.data(), cols, 1, y.data(), rows, mode, pool);
    benchmark::DoNotOptimize(y.data());
    ++i;
  }
  state.counters["weights_GBps"] =
      benchmark::Counter(static_cast<double>(w.matrix_bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(q::isa_name());
}

// Compute ceiling: one 64-row matrix that stays in L2, one thread; weights GB/s when memory is not
// the limit (the DRAM figures above approach this on a quiet machine only if it is well above them).
void BM_GemvHot(benchmark::State& state, Type t, q::ActMode mode) {
  const int64_t rows = 64, cols = 2048;
  const size_t rb = row_bytes_of(t, cols);
  std::vector<uint8_t> w(rb * rows);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::vector<float> row(static_cast<size_t>(cols)), x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = nd(rng);
    q::quantize_row(t, row.data(), w.data() + r * rb, cols);
  }
  for (auto& v : x) v = nd(rng) * 20.f;
  q::ThreadPool& pool = pool_of(1);
  const q::Matrix m{w.data(), t, cols, rows, rb};
  for (auto _ : state) {
    q::matmul(m, x.data(), cols, 1, y.data(), rows, mode, pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["weights_GBps"] =
      benchmark::Counter(static_cast<double>(rb * rows) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Prefill-style: 32 tokens against one matrix (weights reused from cache across tokens).
void BM_Gemm32(benchmark::State& state, Type t, int threads, q::ActMode mode) {
  const int64_t rows = 2048, cols = 2048, ntok = 32;
  const Weights& w = weights_of(t, rows, cols);
  std::vector<float> x(static_cast<size_t>(cols * ntok)), y(static_cast<size_t>(rows * ntok));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(rng);
  q::ThreadPool& pool = pool_of(threads);
  int64_t i = 0;
  for (auto _ : state) {
    q::Matrix m{w.buf->p + static_cast<size_t>(i % w.copies) * w.matrix_bytes, t, cols, rows, row_bytes_of(t, cols)};
    q::matmul(m, x.data(), cols, ntok, y.data(), rows, mode, pool);
    benchmark::DoNotOptimize(y.data());
    ++i;
  }
  state.counters["GMAC_per_s"] = benchmark::Counter(static_cast<double>(rows * cols * ntok) * 1e-9,
                                                    benchmark::Counter::kIsIterationInvariantRate);
}

const char* tname(Type t) {
  switch (t) {
    case Type::F32: return "F32"; case Type::F16: return "F16"; case Type::BF16: return "BF16";
    case Type::Q4_0: return "Q4_0"; case Type::Q4_1: return "Q4_1"; case Type::Q5_0: return "Q5_0";
    case Type::Q5_1: return "Q5_1"; case Type::Q8_0: return "Q8_0"; case Type::Q2_K: return "Q2_K";
    case Type::Q3_K: return "Q3_K"; case Type::Q4_K: return "Q4_K"; case Type::Q5_K: return "Q5_K";
    case Type::Q6_K: return "Q6_K"; default: return "?";
  }
}

}  // namespace

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

int main(int argc, char** argv) {
  const int nt = all_threads();
  std::vector<int> thread_counts = {1};
  if (nt > 1) thread_counts.push_back(nt);
  for (int th : thread_counts) {
    benchmark::RegisterBenchmark("memcpy", BM_Memcpy)->Arg(th)->UseRealTime()->Unit(benchmark::kMillisecond)->ComputeStatistics("max", max_of);
    benchmark::RegisterBenchmark("read", BM_Read)->Arg(th)->UseRealTime()->Unit(benchmark::kMillisecond)->ComputeStatistics("max", max_of);
  }
  const Type types[] = {Type::Q4_K, Type::Q6_K, Type::Q8_0, Type::Q5_K, Type::Q4_0, Type::Q2_K, Type::Q3_K,
                        Type::Q4_1, Type::Q5_0, Type::Q5_1, Type::F16, Type::BF16, Type::F32};
  const std::pair<int64_t, int64_t> shapes[] = {{2048, 2048}, {768, 2048}};
  for (Type t : types)
    for (auto [rows, cols] : shapes)
      for (int th : thread_counts)
        for (q::ActMode mode : {q::ActMode::fast, q::ActMode::exact}) {
          std::string name = std::string("gemv/") + tname(t) + "/" + std::to_string(rows) + "x" + std::to_string(cols) +
                             "/threads:" + std::to_string(th) + (mode == q::ActMode::fast ? "/fast" : "/exact");
          benchmark::RegisterBenchmark(name.c_str(), BM_Gemv, t, rows, cols, th, mode)
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond)
              ->ComputeStatistics("max", max_of);
        }
  for (Type t : {Type::Q4_K, Type::Q5_K, Type::Q6_K, Type::Q8_0, Type::Q4_0, Type::F32})
    for (q::ActMode mode : {q::ActMode::fast, q::ActMode::exact}) {
      std::string name = std::string("gemv_hot/") + tname(t) + "/64x2048" + (mode == q::ActMode::fast ? "/fast" : "/exact");
      benchmark::RegisterBenchmark(name.c_str(), BM_GemvHot, t, mode)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond)
          ->ComputeStatistics("max", max_of);
    }
  for (Type t : {Type::Q4_K, Type::Q6_K, Type::Q8_0})
    for (int th : thread_counts)
      for (q::ActMode mode : {q::ActMode::fast, q::ActMode::exact}) {
        std::string name = std::string("gemm32/") + tname(t) + "/2048x2048/threads:" + std::to_string(th) +
                           (mode == q::ActMode::fast ? "/fast" : "/exact");
        benchmark::RegisterBenchmark(name.c_str(), BM_Gemm32, t, th, mode)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->ComputeStatistics("max", max_of);
      }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
