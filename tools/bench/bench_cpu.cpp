// CPU forward throughput on a model given by MOE_BENCH_MODEL (skipped when unset):
//   read_bandwidth  the machine's memory read bandwidth, measured by streaming the model's own
//                   mapping with the same threads (the ceiling of a memory-bound decode)
//   prefill_512     512-token prompt from an empty cache, last row's logits only (llama-bench pp512)
//   decode          one token at a time over positions 0..127 (llama-bench tg128)
// Then a summary with the decode's achieved weight bandwidth, peak RSS against the budget
// (mapped file + KV cache + 64 MiB) and, when LLAMA_BENCH names llama.cpp's llama-bench, rounds that
// alternate moe-run and llama-bench on the same file and thread count, with the ratios of the bests.
// Environment: MOE_BENCH_MODEL, MOE_BENCH_THREADS (default 2), MOE_BENCH_MODE (fast | exact),
// LLAMA_BENCH (path of llama-bench), LLAMA_BENCH_ROUNDS (alternating rounds, default 3).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../src/cpu/gemm.hpp"
#include "moe/cpu.hpp"
#include "moe/model.hpp"

namespace {

struct Ctx {
  std::shared_ptr<const moe::model::OwnedQuantizedModel> model;
  std::unique_ptr<moe::quant::ThreadPool> pool;
  int threads = 2;
  moe::quant::ActMode mode = moe::quant::ActMode::fast;
  int64_t n_ctx = 1024;
  double bandwidth_gbs = 0, prefill_tps = 0, decode_tps = 0;
};
Ctx g;

constexpr int64_t kPrompt = 512, kGen = 128;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// Bytes a decode step reads: every dense weight, the router, n_used experts' gate/up/down (the
// average expert: experts of one tensor have the same size), the LM head and one embedding row.
double decode_bytes(const moe::model::OwnedQuantizedModel& m) {
  const auto& c = m.config;
  double b = static_cast<double>(m.token_embd.row_bytes) + static_cast<double>(m.output.matrix_bytes);
  for (const moe::model::Layer& L : m.layers) {
    for (const moe::model::Tensor* t : {&L.attn_q, &L.attn_k, &L.attn_v, &L.attn_output, &L.ffn_gate_inp})
      b += static_cast<double>(t->matrix_bytes);
    b += static_cast<double>(c.n_expert_used) *
         static_cast<double>(L.ffn_gate_exps.matrix_bytes + L.ffn_up_exps.matrix_bytes + L.ffn_down_exps.matrix_bytes);
  }
  return b;
}

__attribute__((target("avx2"))) uint64_t sum_bytes_avx2(const uint8_t* p, size_t n) {
  __m256i acc = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    const __m256i b = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    acc = _mm256_add_epi64(acc, _mm256_xor_si256(a, b));
  }
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc);
  uint64_t s = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < n; ++i) s += p[i];
  return s;
}

void BM_ReadBandwidth(benchmark::State& st) {
  const moe::gguf::File& f = *g.model->file;
  const uint8_t* base = f.bytes() + f.data_offset();
  const size_t n = static_cast<size_t>(f.file_size() - f.data_offset());
  constexpr size_t kChunk = size_t{1} << 20;
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (auto _ : st) {
    const double t0 = now_s();
    g.pool->run(chunks, [&](int64_t c, int) {
      const size_t at = static_cast<size_t>(c) * kChunk;
      sink.fetch_add(sum_bytes_avx2(base + at, std::min(kChunk, n - at)), std::memory_order_relaxed);
    });
    best = std::max(best, static_cast<double>(n) / (now_s() - t0) / 1e9);
  }
  benchmark::DoNotOptimize(sink.load());
  g.bandwidth_gbs = best;
  st.counters["GB/s"] = best;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(std::min<int64_t>(vocab, 151643) - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = d(rng);
  return ids;
}

moe::cpu::Options options() {
  moe::cpu::Options o;
  o.n_ctx = g.n_ctx;
  o.mode = g.mode;
  o.pool = g.pool.get();
  return o;
}

void BM_Prefill512(benchmark::State& st) {
  auto f = moe::cpu::make_forward(g.model, options());
  const std::vector<int32_t> ids = random_tokens(kPrompt, f->n_vocab());
  std::vector<float> logits;
  double best = 0;
  for (auto _ : st) {
    f->reset();
    const double t0 = now_s();
    f->eval(ids, false, logits);
    best = std::max(best, static_cast<double>(kPrompt) / (now_s() - t0));
  }
  g.prefill_tps = best;
  st.counters["tok/s"] = best;
}

void BM_Decode(benchmark::State& st) {
  auto f = moe::cpu::make_forward(g.model, options());
  const std::vector<int32_t> ids = random_tokens(kGen, f->n_vocab());
  double best = 0;
  for (auto _ : st) {
    f->reset();
    const double t0 = now_s();
    for (int64_t i = 0; i < kGen; ++i) benchmark::DoNotOptimize(f->eval_greedy(ids[static_cast<size_t>(i)]));
    best = std::max(best, static_cast<double>(kGen) / (now_s() - t0));
  }
  g.decode_tps = best;
  st.counters["tok/s"] = g.decode_tps;
  st.counters["weights GB/s"] = g.decode_tps * decode_bytes(*g.model) / 1e9;
}

// One token through the LM head alone (quant::matmul on the pool): the weight stream of the
// largest decode matrix, to tell kernel speed from bandwidth.
void BM_HeadGemv(benchmark::State& st) {
  const moe::quant::Matrix w = g.model->output.matrix();
  std::vector<float> x(static_cast<size_t>(w.cols)), y(static_cast<size_t>(w.rows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  double best = 0;
  for (auto _ : st) {
    const double t0 = now_s();
    moe::quant::matmul(w, x.data(), w.cols, 1, y.data(), w.rows, g.mode, *g.pool);
    best = std::max(best, static_cast<double>(g.model->output.matrix_bytes) / (now_s() - t0) / 1e9);
  }
  st.counters["GB/s"] = best;
}

// Prefill kernel throughput on one thread: 64 tokens against the first expert's gate rows (Q4_K
// in a Q4_K_M file), through quant::matmul_rows_fast (quant) or the forward's dispatch (forward).
void BM_ExpertGemm(benchmark::State& st, bool forward_kernels) {
  const moe::quant::Matrix w = g.model->layers[0].ffn_gate_exps.expert(0);
  constexpr int64_t kTok = 64;
  const size_t stride = moe::quant::act_row_bytes(w.type, w.cols);
  std::vector<uint8_t> acts(stride * kTok);
  std::vector<float> x(static_cast<size_t>(w.cols)), y(static_cast<size_t>(w.rows * kTok));
  for (int64_t t = 0; t < kTok; ++t) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i * (t + 1)));
    moe::quant::quantize_act(w.type, x.data(), acts.data() + t * stride, w.cols);
  }
  for (auto _ : st) {
    if (forward_kernels) {
      moe::cpu::matmul_rows(w, 0, w.rows, acts.data(), stride, kTok, y.data(), w.rows);
    } else {
      moe::quant::matmul_rows_fast(w, 0, w.rows, acts.data(), stride, kTok, y.data(), w.rows);
    }
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GMAC/s"] = benchmark::Counter(static_cast<double>(w.rows * w.cols * kTok) / 1e9,
                                             benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(moe::gguf::type_name(w.type));
}

// llama-bench's best sample tok/s for (n_prompt, n_gen) from its JSON output; 0 when absent.
double llama_ts(const std::string& json, int n_prompt, int n_gen) {
  size_t at = 0;
  while ((at = json.find('{', at)) != std::string::npos) {
    const size_t end = json.find('}', at);
    const std::string obj = json.substr(at, end == std::string::npos ? std::string::npos : end - at);
    auto num = [&obj](const char* key) {
      const size_t k = obj.find(std::string("\"") + key + "\"");
      if (k == std::string::npos) return -1.0;
      return std::atof(obj.c_str() + obj.find(':', k) + 1);
    };
    if (num("n_prompt") == n_prompt && num("n_gen") == n_gen) {
      const size_t k = obj.find("\"samples_ts\"");
      if (k == std::string::npos) return num("avg_ts");
      double best = 0;
      const char* c = obj.c_str() + obj.find('[', k) + 1;
      while (*c && *c != ']') {
        char* e = nullptr;
        const double v = std::strtod(c, &e);
        if (e == c) break;
        best = std::max(best, v);
        c = e;
        while (*c == ',' || *c == ' ' || *c == '\n') ++c;
      }
      return best;
    }
    at = end == std::string::npos ? json.size() : end;
  }
  return 0;
}

// One llama-bench run (pp512 + tg128, one repetition each); false when it failed.
bool llama_once(const std::string& llama_bench, const std::string& model, double& pp, double& tg) {
  const std::string cmd = llama_bench + " -m '" + model + "' -t " + std::to_string(g.threads) + " -p " +
                          std::to_string(kPrompt) + " -n " + std::to_string(kGen) + " -r 1 -o json 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return false;
  std::string out;
  char buf[4096];
  size_t k;
  while ((k = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, k);
  const int rc = pclose(p);
  pp = llama_ts(out, static_cast<int>(kPrompt), 0);
  tg = llama_ts(out, 0, static_cast<int>(kGen));
  if (rc != 0 || pp <= 0 || tg <= 0) {
    std::printf("llama-bench failed (exit %d): %s\noutput:\n%s\n", rc, cmd.c_str(), out.c_str());
    return false;
  }
  return true;
}

// Rounds that alternate moe-run and llama-bench on the same file and thread count, best of each:
// on a shared machine the load changes by the second, and alternating keeps both sides under the
// same conditions.
void compare_llama(const std::string& llama_bench, const std::string& model) {
  const char* r = std::getenv("LLAMA_BENCH_ROUNDS");
  const int rounds = r ? std::max(1, std::atoi(r)) : 3;
  std::printf("\ncomparison: %d alternating rounds of moe-run and %s (-t %d, pp%lld, tg%lld), best of each\n", rounds,
              llama_bench.c_str(), g.threads, static_cast<long long>(kPrompt), static_cast<long long>(kGen));
  auto f = moe::cpu::make_forward(g.model, options());
  const std::vector<int32_t> prompt = random_tokens(kPrompt, f->n_vocab()), gen = random_tokens(kGen, f->n_vocab());
  std::vector<float> logits;
  double our_pp = 0, our_tg = 0, ll_pp = 0, ll_tg = 0;
  for (int i = 0; i < rounds; ++i) {
    f->reset();
    double t0 = now_s();
    f->eval(prompt, false, logits);
    our_pp = std::max(our_pp, static_cast<double>(kPrompt) / (now_s() - t0));
    f->reset();
    t0 = now_s();
    for (int64_t j = 0; j < kGen; ++j) benchmark::DoNotOptimize(f->eval_greedy(gen[static_cast<size_t>(j)]));
    our_tg = std::max(our_tg, static_cast<double>(kGen) / (now_s() - t0));
    double pp = 0, tg = 0;
    if (!llama_once(llama_bench, model, pp, tg)) return;
    ll_pp = std::max(ll_pp, pp);
    ll_tg = std::max(ll_tg, tg);
    std::printf("  round %d: moe-run pp %.1f tg %.2f | llama.cpp pp %.1f tg %.2f tok/s\n", i + 1, our_pp, our_tg, pp, tg);
    std::fflush(stdout);
  }
  const double db = decode_bytes(*g.model);
  std::printf("moe-run    prefill pp%lld: %8.2f tok/s   decode tg%lld: %7.2f tok/s (%.0f %% of read bandwidth)\n",
              static_cast<long long>(kPrompt), our_pp, static_cast<long long>(kGen), our_tg,
              100.0 * our_tg * db / 1e9 / g.bandwidth_gbs);
  std::printf("llama.cpp  prefill pp%lld: %8.2f tok/s   decode tg%lld: %7.2f tok/s (%.0f %% of read bandwidth)\n",
              static_cast<long long>(kPrompt), ll_pp, static_cast<long long>(kGen), ll_tg,
              100.0 * ll_tg * db / 1e9 / g.bandwidth_gbs);
  std::printf("moe-run / llama.cpp:  prefill %.2fx (target >= 1.5)   decode %.2fx (target >= 1.1)\n", our_pp / ll_pp,
              our_tg / ll_tg);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const char* path = std::getenv("MOE_BENCH_MODEL");
  if (!path || !*path) {
    std::printf("bench_cpu: MOE_BENCH_MODEL is not set; skipping (see the file's header)\n");
    return 0;
  }
  if (const char* t = std::getenv("MOE_BENCH_THREADS")) g.threads = std::max(1, std::atoi(t));
  if (const char* m = std::getenv("MOE_BENCH_MODE"); m && std::strcmp(m, "exact") == 0) g.mode = moe::quant::ActMode::exact;
  try {
    g.model = moe::model::OwnedQuantizedModel::open(path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  g.pool = std::make_unique<moe::quant::ThreadPool>(g.threads);
  std::printf("model %s, %d threads, %s activations, ISA %s\n", path, g.threads,
              g.mode == moe::quant::ActMode::fast ? "fast (Q8)" : "exact (FP32)", moe::quant::isa_name());

  benchmark::RegisterBenchmark("read_bandwidth", BM_ReadBandwidth)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("lm_head_gemv", BM_HeadGemv)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("expert_gemm_quant", BM_ExpertGemm, false)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("expert_gemm_forward", BM_ExpertGemm, true)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("prefill_512", BM_Prefill512)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("decode_128", BM_Decode)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
  try {
    benchmark::RunSpecifiedBenchmarks();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  benchmark::Shutdown();

  const double db = decode_bytes(*g.model);
  const double file_mib = static_cast<double>(g.model->file->file_size()) / 1048576.0;
  const double kv_mib = static_cast<double>(moe::cpu::kv_bytes(g.model->config, g.n_ctx)) / 1048576.0;
  std::printf("\nmoe-run    prefill pp%lld: %8.2f tok/s   decode tg%lld: %7.2f tok/s\n", static_cast<long long>(kPrompt),
              g.prefill_tps, static_cast<long long>(kGen), g.decode_tps);
  std::printf("read bandwidth %.1f GB/s; decode reads %.1f MB/token -> %.1f GB/s = %.0f %% of it\n", g.bandwidth_gbs,
              db / 1e6, g.decode_tps * db / 1e9, 100.0 * g.decode_tps * db / 1e9 / g.bandwidth_gbs);
  std::printf("peak RSS %.0f MiB; budget = file %.0f + KV %.1f + 64 = %.0f MiB (%s)\n", peak_rss_mib(), file_mib, kv_mib,
              file_mib + kv_mib + 64, peak_rss_mib() <= file_mib + kv_mib + 64 ? "within" : "OVER");
  if (const char* lb = std::getenv("LLAMA_BENCH"); lb && *lb) compare_llama(lb, path);
  return 0;
}
