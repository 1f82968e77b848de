// The host's per-token work of a sampled decode step on a Qwen2/Qwen3-sized vocabulary (151,936 logits,
// normal with sd 3, as the benchmark of docs/PERFORMANCE.md version 28): the candidate set for top-k 40,
// for top-p alone and for min-p alone (temperature 0.7), and the engine's check of the logits for
// non-finite values. No model needed.
//   build/bin/bench_sampler
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "../../src/run/engine.hpp"
#include "moe/sampler.hpp"

namespace {

std::vector<float> vocab_logits() {
  std::mt19937 g(1);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> v(151936);
  for (float& x : v) x = d(g);
  return v;
}

void BM_CandidateSet(benchmark::State& st) {
  const std::vector<float> l = vocab_logits();
  moe::run::SamplerParams p;
  p.temperature = 0.7f;
  p.top_k = static_cast<int>(st.range(0));
  if (st.range(1) == 1) p.top_p = 0.9f;
  if (st.range(1) == 2) p.min_p = 0.05f;
  for (auto _ : st) benchmark::DoNotOptimize(moe::run::candidate_set(l, p));
}
// (top_k, 0 | 1 top-p 0.9 | 2 min-p 0.05)
BENCHMARK(BM_CandidateSet)->Args({40, 0})->Args({0, 1})->Args({0, 2})->Unit(benchmark::kMicrosecond);

void BM_FirstNonFinite(benchmark::State& st) {
  const std::vector<float> l = vocab_logits();
  for (auto _ : st) benchmark::DoNotOptimize(moe::run::first_non_finite(l));
}
BENCHMARK(BM_FirstNonFinite)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
