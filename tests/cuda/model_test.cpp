// The whole CUDA forward against the CPU exact (FP32-activation) forward: both fixtures and a
// moe-synth model of the Qwen3-30B-A3B layer geometry, prefill (logits at every position), decode
// through the graph, and greedy decoding.
//
// Margin rule: a position's logits must reach cosine >= 0.9999, except where the CPU's router margin
// (moe::cpu::Options::router_margins: the smallest log p_k - log p_(k+1) over the layers) is below
// kRouterTie: there the GPU's rounding may pick the other expert in one layer (seen once, cosine
// 0.99975 on a random-weight model), and the position must reach 0.999. Greedy tokens must be
// identical up to the first step whose CPU top-2 logit gap is below 1e-3 of the logit RMS (a near-tie
// that rounding may flip; after it the sequences may legitimately part).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "gpu.hpp"
#include "test_util.hpp"
#include "moe/cpu.hpp"
#include "moe/error.hpp"
#include "moe/model.hpp"
#include "moe/sampler.hpp"

namespace {

namespace fs = std::filesystem;
using namespace gpu_test;
using Model = std::shared_ptr<const moe::model::OwnedQuantizedModel>;

using test_util::cosine;

int32_t argmax(const float* v, int64_t n) {
  int64_t b = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[b]) b = i;
  return static_cast<int32_t>(b);
}

// Gap between the two largest logits, relative to the RMS of the row.
double top2_gap(const float* v, int64_t n) {
  double a = -1e300, b = -1e300, ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    ss += static_cast<double>(v[i]) * v[i];
    if (v[i] > a) {
      b = a;
      a = v[i];
    } else if (v[i] > b) {
      b = v[i];
    }
  }
  return (a - b) / std::sqrt(ss / static_cast<double>(n));
}

std::vector<int32_t> prompt(int n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int32_t> ids(n);
  for (int32_t& t : ids) t = static_cast<int32_t>(d(rng));
  return ids;
}

// Router logits differ between the two forwards by ~1e-5 (relative); a margin 10x that is a near-tie.
constexpr float kRouterTie = 1e-3f;

void compare_with_cpu(const Model& m, int n_prompt, int n_decode, int64_t n_ctx, const char* decode_path = nullptr) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  moe::quant::ThreadPool pool(static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency()))));
  moe::cpu::Options co;
  co.n_ctx = n_ctx;
  co.mode = moe::quant::ActMode::exact;
  co.pool = &pool;
  std::vector<float> margins;
  co.router_margins = &margins;
  auto cpu = moe::cpu::make_forward(m, co);
  moe::cuda::Options go;
  go.n_ctx = n_ctx;
  go.max_batch = 32;  // the prompt runs in several chunks
  moe::cuda::DeviceInfo info;
  auto gpu = moe::cuda::make_forward(m, go, &info);
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.vram_used_mib, 0u);
  if (decode_path) {
    ASSERT_EQ(info.decode_path, decode_path);
  }
  const int64_t V = gpu->n_vocab();
  ASSERT_EQ(V, cpu->n_vocab());

  const std::vector<int32_t> ids = prompt(n_prompt, V, seed);
  std::vector<float> lc, lg;
  cpu->eval(ids, true, lc);
  gpu->eval(ids, true, lg);
  ASSERT_EQ(lg.size(), static_cast<size_t>(n_prompt * V));
  ASSERT_EQ(margins.size(), static_cast<size_t>(n_prompt));
  double min_cos = 1;
  int ties = 0;
  for (int p = 0; p < n_prompt; ++p) {
    const double c = cosine(&lc[p * V], &lg[p * V], V);
    const bool tie = margins[p] < kRouterTie;
    ties += tie;
    if (!tie) min_cos = std::min(min_cos, c);
    EXPECT_GE(c, tie ? 0.999 : 0.9999) << "prefill position " << p << ", router margin " << margins[p];
  }
  std::printf("[          ] prefill %d positions: min cosine %.7f (%d router near-ties held to 0.999)\n", n_prompt,
              min_cos, ties);
  EXPECT_EQ(gpu->n_past(), n_prompt);

  // decode: logits through the graph, then greedy
  int32_t tok = argmax(&lc[(n_prompt - 1) * V], V);
  bool tied = top2_gap(&lc[(n_prompt - 1) * V], V) < 1e-3;
  min_cos = 1;
  int compared = 0;
  for (int s = 0; s < n_decode && !tied; ++s) {
    cpu->eval(std::span<const int32_t>(&tok, 1), false, lc);
    const bool tie = margins.back() < kRouterTie;
    // this step's own top-2 near-tie (or a router near-tie) may flip its token: its token is not compared;
    // after a top-2 near-tie the comparison ends (the sequences may part), after a router one it goes on
    const double gap = top2_gap(lc.data(), V);
    const bool same_token = gap >= 1e-3 && !tie;
    if (s % 2 == 0) {
      gpu->eval(std::span<const int32_t>(&tok, 1), false, lg);
      const double c = cosine(lc.data(), lg.data(), V);
      if (!tie) min_cos = std::min(min_cos, c);
      EXPECT_GE(c, tie ? 0.999 : 0.9999) << "decode step " << s << ", router margin " << margins.back();
      if (same_token) {
        EXPECT_EQ(argmax(lg.data(), V), argmax(lc.data(), V)) << "decode step " << s << ", gap " << gap;
      }
    } else {
      const int32_t g = gpu->eval_greedy(tok);
      if (same_token) {
        EXPECT_EQ(g, argmax(lc.data(), V)) << "greedy step " << s << ", gap " << gap;
      }
    }
    ++compared;
    tied = gap < 1e-3;
    tok = argmax(lc.data(), V);
  }
  std::printf("[          ] decode %d steps compared: min cosine %.7f\n", compared, min_cos);
  EXPECT_EQ(gpu->n_past(), cpu->n_past());

  // reset empties the cache: the same prompt gives the same logits again
  gpu->reset();
  std::vector<float> again;
  gpu->eval(std::span<const int32_t>(ids.data(), 5), false, again);
  std::vector<float> first;
  cpu->reset();
  cpu->eval(std::span<const int32_t>(ids.data(), 5), false, first);
  EXPECT_GE(cosine(first.data(), again.data(), V), 0.9999);
}

Model fixture(const char* stem) {
  return moe::model::OwnedQuantizedModel::open(std::string(MOE_TEST_DATA) + "/" + stem + ".gguf");
}

TEST(CudaModel, TinyQ8_0MatchesCpuExact) {
  REQUIRE_GPU();
  compare_with_cpu(fixture("tiny-qwen3moe-q8_0"), 77, 24, 256);
}

TEST(CudaModel, TinyQ4_K_MMatchesCpuExact) {
  REQUIRE_GPU();
  compare_with_cpu(fixture("tiny-qwen3moe-q4_k_m"), 77, 24, 256);
}

// A moe-synth model of the Qwen3-30B-A3B layer geometry with `layers` layers, written into dir (null
// and a test failure when moe-synth fails).
Model synth_qwen3(const fs::path& dir, int layers) {
  fs::create_directories(dir);
  const fs::path file = dir / "synth.gguf";
  const std::string cmd = std::string(MOE_BIN_DIR) + "/moe-synth -o " + file.string() +
                          " --preset qwen3-30b-a3b --layers " + std::to_string(layers) + " --type q4_k_m --vocab " +
                          MOE_TEST_DATA + "/ggml-vocab-qwen2.gguf --threads 8 > /dev/null";
  if (std::system(cmd.c_str()) != 0) {
    ADD_FAILURE() << cmd;
    return nullptr;
  }
  return moe::model::OwnedQuantizedModel::open(file.string());
}

// Full Qwen3-30B-A3B layer geometry (2048 wide, 32/4 heads of 128, 128 experts, 8 used, 768 expert
// FFN, the full vocabulary), two layers so the CPU reference stays quick.
TEST(CudaModel, SynthQwen3GeometryMatchesCpuExact) {
  REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / ("moe-cuda-test-" + std::to_string(getpid()));
  const Model m = synth_qwen3(dir, 2);
  ASSERT_TRUE(m);
  {
    SCOPED_TRACE("default decode: kernel graph");
    compare_with_cpu(m, 70, 16, 512, "kernel graph");
  }
  {
    SCOPED_TRACE("MOE_CUDA_FUSED_ROUTER=0: the router kernel");
    setenv("MOE_CUDA_FUSED_ROUTER", "0", 1);
    compare_with_cpu(m, 70, 16, 512, "kernel graph");
    unsetenv("MOE_CUDA_FUSED_ROUTER");
  }
  {
    SCOPED_TRACE("MOE_CUDA_PERSIST=1");
    setenv("MOE_CUDA_PERSIST", "1", 1);
    compare_with_cpu(m, 70, 16, 512, "persistent kernel");
    unsetenv("MOE_CUDA_PERSIST");
  }
  fs::remove_all(dir);
}

// The persistent decode kernel against the per-kernel decode graph on the same model and tokens:
// the same arithmetic in other launches, so the logits agree to rounding at every step (a longer run
// than compare_with_cpu's, with contexts past one attention slice).
TEST(CudaModel, PersistentDecodeMatchesKernelGraph) {
  REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / ("moe-cuda-test-p" + std::to_string(getpid()));
  const Model m = synth_qwen3(dir, 3);
  ASSERT_TRUE(m);
  moe::cuda::Options go;
  go.n_ctx = 1024;
  moe::cuda::DeviceInfo ip, ig;
  setenv("MOE_CUDA_PERSIST", "1", 1);
  auto per = moe::cuda::make_forward(m, go, &ip);
  unsetenv("MOE_CUDA_PERSIST");
  auto graph = moe::cuda::make_forward(m, go, &ig);
  ASSERT_EQ(ip.decode_path, "persistent kernel");
  ASSERT_EQ(ig.decode_path, "kernel graph");
  const int64_t V = per->n_vocab();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<int32_t> ids = prompt(150, V, seed);
  std::vector<float> a, b;
  per->eval(ids, false, a);
  graph->eval(ids, false, b);
  int32_t tok = argmax(a.data(), V);
  double min_cos = 1;
  for (int s = 0; s < 200; ++s) {  // positions 150 .. 349: 3 to 6 slices of 64
    per->eval(std::span<const int32_t>(&tok, 1), false, a);
    graph->eval(std::span<const int32_t>(&tok, 1), false, b);
    const double c = cosine(a.data(), b.data(), V);
    min_cos = std::min(min_cos, c);
    ASSERT_GE(c, 0.99999) << "decode step " << s;
    tok = argmax(b.data(), V);  // both continue with the same token
  }
  std::printf("[          ] persistent vs graph, 200 decode steps: min cosine %.8f\n", min_cos);
  // greedy through the persistent graph equals the argmax of its logits
  const int32_t g = per->eval_greedy(tok);
  graph->eval(std::span<const int32_t>(&tok, 1), false, b);
  if (top2_gap(b.data(), V) > 1e-3) {
    EXPECT_EQ(g, argmax(b.data(), V));
  }
  fs::remove_all(dir);
}

// Greedy decoding one step ahead (eval_greedy chains the next step on the device) against the same
// forward with MOE_CUDA_CHAIN=0 (one step, one wait): the same kernels on the same inputs, so every
// token and every logit must be identical -- through runs of greedy steps, a greedy call with another
// token than the one already running (the step ahead is abandoned), logits in between, reset, and the
// end of the context (no step ahead past it; the next call is refused as for the unchained forward).
TEST(CudaModel, GreedyOneStepAheadMatchesStepByStep) {
  REQUIRE_GPU();
  Model m = fixture("tiny-qwen3moe-q4_k_m");
  moe::cuda::Options go;
  go.n_ctx = 96;
  auto chained = moe::cuda::make_forward(m, go, nullptr);
  setenv("MOE_CUDA_CHAIN", "0", 1);
  auto plain = moe::cuda::make_forward(m, go, nullptr);
  unsetenv("MOE_CUDA_CHAIN");
  const int64_t V = plain->n_vocab();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<int32_t> ids = prompt(20, V, seed);
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<float> a, b;
    chained->eval(ids, false, a);
    plain->eval(ids, false, b);
    ASSERT_EQ(a, b);
    int32_t tok = argmax(a.data(), V);
    for (int s = 0; s < 30; ++s) {  // the chained forward's step ahead is used every time
      const int32_t x = chained->eval_greedy(tok), y = plain->eval_greedy(tok);
      ASSERT_EQ(x, y) << "greedy step " << s;
      tok = x;
    }
    // another token than the one the step ahead is running with, then logits, then greedy again
    tok = (tok + 1) % static_cast<int32_t>(V);
    ASSERT_EQ(chained->eval_greedy(tok), plain->eval_greedy(tok)) << "greedy with another token";
    chained->eval(std::span<const int32_t>(&tok, 1), false, a);
    plain->eval(std::span<const int32_t>(&tok, 1), false, b);
    ASSERT_EQ(a, b) << "logits after an abandoned step";
    tok = argmax(a.data(), V);
    while (plain->n_past() < go.n_ctx) {  // to the end of the context
      const int32_t x = chained->eval_greedy(tok), y = plain->eval_greedy(tok);
      ASSERT_EQ(x, y) << "greedy at position " << plain->n_past() - 1;
      tok = x;
    }
    EXPECT_EQ(chained->n_past(), go.n_ctx);
    EXPECT_THROW(chained->eval_greedy(tok), moe::Error);
    EXPECT_THROW(plain->eval_greedy(tok), moe::Error);
    chained->reset();
    plain->reset();
  }
}

// Sampled decoding with the draw on the device (eval_sample, chained one step ahead) against the host's sampler
// on the same forward's copied logits: the same tokens for the same seed, through an abandoned step ahead, a
// change of parameters (a new graph), greedy with a repeat penalty, and to the end of the context.
TEST(CudaModel, SampledOnTheDeviceMatchesTheHostSampler) {
  REQUIRE_GPU();
  Model m = fixture("tiny-qwen3moe-q4_k_m");
  moe::cuda::Options go;
  go.n_ctx = 120;
  auto dev = moe::cuda::make_forward(m, go, nullptr);
  auto ref = moe::cuda::make_forward(m, go, nullptr);
  const int64_t V = ref->n_vocab();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  moe::run::SamplerParams a;
  a.temperature = 0.9f;
  a.repeat_penalty = 1.3f;
  a.repeat_last_n = 16;
  a.seed = static_cast<uint32_t>(seed);
  moe::run::SamplerParams b = a;
  b.temperature = 1.7f;
  b.top_k = 128;
  b.top_p = 0.8f;
  b.min_p = 0.01f;
  b.repeat_last_n = 200;
  moe::run::SamplerParams g = a;
  g.temperature = 0.f;
  ASSERT_TRUE(dev->samples_on_device(a));
  ASSERT_TRUE(dev->samples_on_device(b));
  ASSERT_TRUE(dev->samples_on_device(g));
  moe::run::SamplerParams off = a;
  off.top_k = 0;
  EXPECT_FALSE(dev->samples_on_device(off));
  std::vector<int32_t> hist = prompt(12, V, seed);
  std::vector<float> la, lb;
  dev->eval(hist, false, la);
  ref->eval(hist, false, lb);
  ASSERT_EQ(la, lb);
  dev->prepare_sample(a);  // the graph captured ahead (eval_sample would capture it itself)
  moe::run::Sampler sd(a), sr(a);
  hist.push_back(sr.sample(lb, hist));
  sd.uniform();  // the first token came from the host on both sides
  auto steps = [&](moe::run::Sampler& d, moe::run::Sampler& r, const moe::run::SamplerParams& p, int n) {
    for (int s = 0; s < n && ref->n_past() < go.n_ctx; ++s) {
      const int32_t x = dev->eval_sample(hist, p, [&d] { return d.uniform(); });
      std::vector<float> l;
      ref->eval(std::span<const int32_t>(&hist.back(), 1), false, l);
      const int32_t y = r.sample(l, hist);
      ASSERT_EQ(x, y) << "position " << hist.size() - 1;
      hist.push_back(x);
    }
  };
  steps(sd, sr, a, 30);
  // another token than the step ahead runs with: that step and its uniform are dropped (the host's sampler skips one)
  hist.back() = (hist.back() + 1) % static_cast<int32_t>(V);
  sr.uniform();
  steps(sd, sr, a, 10);
  moe::run::Sampler sd2(b), sr2(b);
  steps(sd2, sr2, b, 30);  // new parameters: a new graph, the window from the host again
  moe::run::Sampler sd3(g), sr3(g);
  steps(sd3, sr3, g, 20);  // greedy with the penalty: no uniforms at all
  sr.uniform();  // the step ahead of the last run with `a` was dropped by the change of parameters
  steps(sd, sr, a, 1000);  // to the end of the context
  EXPECT_EQ(dev->n_past(), go.n_ctx);
  EXPECT_THROW(dev->eval_sample(hist, a, [&sd] { return sd.uniform(); }), moe::Error);
  std::vector<int32_t> wrong(hist.begin(), hist.begin() + 5);
  dev->reset();
  EXPECT_THROW(dev->eval_sample(wrong, a, [&sd] { return sd.uniform(); }), moe::Error) << "a history not up to n_past";
}

TEST(CudaModel, FailuresAreErrorsNamingTheStep) {
  REQUIRE_GPU();
  Model m = fixture("tiny-qwen3moe-q8_0");
  moe::cuda::Options o;
  o.device = moe::cuda::device_count() + 3;
  try {
    moe::cuda::make_forward(m, o, nullptr);
    FAIL() << "a missing device must throw";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::gpu_failed);
    EXPECT_NE(std::string(e.what()).find("CUDA initialization failed"), std::string::npos) << e.what();
  }
  o.device = 0;
  o.n_ctx = int64_t{1} << 40;  // a KV cache no GPU holds
  try {
    moe::cuda::make_forward(m, o, nullptr);
    FAIL() << "an oversized cache must throw";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::gpu_failed);
    EXPECT_NE(std::string(e.what()).find("does not fit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MiB"), std::string::npos) << e.what();
  }
  o.n_ctx = 8;
  auto f = moe::cuda::make_forward(m, o, nullptr);
  std::vector<float> l;
  std::vector<int32_t> ids(9, 1);
  EXPECT_THROW(f->eval(ids, false, l), moe::Error);  // past n_ctx
  std::vector<int32_t> bad = {1, static_cast<int32_t>(f->n_vocab())};
  EXPECT_THROW(f->eval(bad, false, l), moe::Error);
}

}  // namespace
