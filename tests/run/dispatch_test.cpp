// The dispatcher without a GPU: fake "GPUs" (CPU forwards, failing factories, injected faults)
// check accept / reject / fallback / exit 14 / exit 9, and that every fallback answers exactly
// what a --no-gpu run answers, without repeating streamed text.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <unistd.h>
#include <sstream>

#include "../cli/mini_json.hpp"
#include "moe/cpu.hpp"
#include "moe/gguf.hpp"
#include "moe/error.hpp"
#include "moe/guard.hpp"
#include "moe/run.hpp"

namespace {

using namespace moe;
using run::Backends;
using run::RunConfig;

const std::string kModel = std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q8_0.gguf";

mini_json::Value read_json_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return mini_json::parse(ss.str());
}

std::vector<int32_t> golden_prompt(const std::string& run) {
  const auto j = read_json_file(std::string(MOE_TEST_DATA) + "/golden/tiny-qwen3moe-q8_0/" + run + ".json");
  std::vector<int32_t> ids;
  for (auto v : j["prompt_ids"].ints()) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

RunConfig base_config() {
  RunConfig c;
  c.model_path = kModel;
  c.prompt_tokens = golden_prompt("ids_len033");
  c.max_tokens = 12;
  c.threads = 2;
  c.output = run::OutputMode::json;
  return c;
}

struct Result {
  int rc = -1;
  std::string out, err;
  mini_json::Value j;
  int count(const std::string& needle) const {
    int n = 0;
    for (size_t p = err.find(needle); p != std::string::npos; p = err.find(needle, p + 1)) ++n;
    return n;
  }
};

Result generate(const RunConfig& c, const Backends& b) {
  std::ostringstream out, err;
  Result r;
  r.rc = run::generate(c, b, out, err);
  r.out = out.str();
  r.err = err.str();
  if (c.output == run::OutputMode::json) r.j = mini_json::parse(r.out);
  return r;
}

int g_factory_calls = 0;

// A "GPU" that is really a CPU forward (fast mode = what the CPU itself serves).
run::GpuFactory cpu_as_gpu(quant::ActMode mode) {
  return [mode](std::shared_ptr<const model::OwnedQuantizedModel> m, const run::GpuRequest& r, run::GpuInfo& info) {
    ++g_factory_calls;
    cpu::Options o;
    o.n_ctx = r.n_ctx;
    o.mode = mode;
    o.pool = r.pool;
    info.device = "test GPU";
    info.vram_total_mib = 1234;
    return cpu::make_forward(std::move(m), o);
  };
}

Backends fake(run::Fault f = run::Fault::none) {
  Backends b;
  b.gpu = cpu_as_gpu(quant::ActMode::fast);
  b.fault = f;
  return b;
}

const std::string kFallback = "qwen3moe: the CUDA forward did not serve this run, falling back to CPU: ";

Result cpu_reference(RunConfig c) {
  c.backend = run::Requested::cpu;
  return generate(c, Backends{});
}

TEST(Dispatch, CleanGpuIsAcceptedByTheGuard) {
  const auto c = base_config();
  const Result r = generate(c, fake());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.j["backend"]["ran"].s, "cuda");
  EXPECT_EQ(r.j["backend"]["requested"].s, "auto");
  EXPECT_FALSE(r.j["backend"]["fell_back"].b);
  EXPECT_EQ(r.j["backend"]["device"].s, "test GPU");
  const auto& g = r.j["guard"];
  EXPECT_TRUE(g["accepted"].b);
  EXPECT_FALSE(g["skipped"].b);
  EXPECT_EQ(g["positions"].n, 34);  // 33 prompt positions + the decode step
  EXPECT_GT(g["min_cosine"].n, 0.99);
  EXPECT_EQ(g["first_bad_pos"].kind, mini_json::Value::null);
  EXPECT_EQ(r.count("F2 guard: GPU matches the CPU forward on 34 positions (min cosine "), 1) << r.err;
  EXPECT_EQ(r.count("Backend: GPU (CUDA, test GPU, 1234 MiB VRAM)"), 1) << r.err;
  EXPECT_EQ(r.count(kFallback), 0);
  EXPECT_EQ(r.j["tokens"].ints(), cpu_reference(c).j["tokens"].ints());
  EXPECT_DOUBLE_EQ(r.j["timings"]["guard_ms"].n, g["ms"].n);
}

TEST(Dispatch, GuardUsesOnlyTheLast64PromptTokens) {
  auto c = base_config();
  c.prompt_tokens = golden_prompt("ids_len100");
  const Result r = generate(c, fake());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.j["guard"]["positions"].n, moe::guard::kProbeMax + 1);
}

struct FaultCase {
  run::Fault fault;
  const char* reason;
};

TEST(Dispatch, EveryInjectedFaultFallsBackAndAnswersLikeTheCpu) {
  const auto c = base_config();
  const Result ref = cpu_reference(c);
  for (const auto& fc : {FaultCase{run::Fault::gpu_init, "CUDA initialization failed: injected fault"},
                         FaultCase{run::Fault::gpu_nan, "non-finite logit"},
                         FaultCase{run::Fault::gpu_perturb, "GPU output diverges from CPU at position 1 (argmax "},
                         FaultCase{run::Fault::gpu_kernel, "a CUDA kernel failed at decode position 34"}}) {
    SCOPED_TRACE(fc.reason);
    const Result r = generate(c, fake(fc.fault));
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(r.count(kFallback), 1) << r.err;
    EXPECT_NE(r.err.find(fc.reason), std::string::npos) << r.err;
    EXPECT_EQ(r.j["backend"]["ran"].s, "cpu");
    EXPECT_TRUE(r.j["backend"]["fell_back"].b);
    EXPECT_NE(r.j["backend"]["reason"].s.find(fc.reason), std::string::npos);
    EXPECT_EQ(r.j["tokens"].ints(), ref.j["tokens"].ints());
    EXPECT_EQ(r.j["text"].s, ref.j["text"].s);
    if (fc.fault == run::Fault::gpu_perturb) {
      EXPECT_FALSE(r.j["guard"]["accepted"].b);
      EXPECT_EQ(r.j["guard"]["first_bad_pos"].n, 1);
    }
    if (fc.fault == run::Fault::gpu_kernel) {
      EXPECT_TRUE(r.j["guard"]["accepted"].b);  // failed after serving
    }
  }
}

TEST(Dispatch, MidGenerationFailureDoesNotRepeatStreamedText) {
  auto c = base_config();
  c.output = run::OutputMode::text;
  const Result ref = cpu_reference(c);
  const Result r = generate(c, fake(run::Fault::gpu_kernel));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.count(kFallback), 1);
  EXPECT_EQ(r.out, ref.out);
  // NDJSON: every index once, in order, the same events as the CPU's.
  c.output = run::OutputMode::stream;
  const Result s = generate(c, fake(run::Fault::gpu_kernel));
  const Result sref = cpu_reference(c);
  auto events = [](const std::string& out) {
    std::vector<std::string> lines;
    std::istringstream is(out);
    for (std::string l; std::getline(is, l);) {
      auto v = mini_json::parse(l);
      if (v["event"].s == "token") lines.push_back(l);
    }
    return lines;
  };
  EXPECT_EQ(events(s.out), events(sref.out));
}

TEST(Dispatch, ForcedGpuNeverFallsBack) {
  auto c = base_config();
  c.backend = run::Requested::gpu;
  for (auto f : {run::Fault::gpu_init, run::Fault::gpu_perturb, run::Fault::gpu_kernel, run::Fault::gpu_nan}) {
    try {
      generate(c, fake(f));
      ADD_FAILURE() << "no error for fault " << static_cast<int>(f);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Exit::gpu_failed);
      EXPECT_NE(std::string(e.what()).find("--gpu"), std::string::npos);
    }
  }
  // A CPU-only build: exit 9.
  try {
    generate(c, Backends{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::no_cuda);
  }
  // And a clean GPU serves it.
  const Result ok = generate(c, fake());
  EXPECT_EQ(ok.j["backend"]["ran"].s, "cuda");
  EXPECT_EQ(ok.j["backend"]["requested"].s, "gpu");
}

TEST(Dispatch, NoGpuNeverCallsTheFactory) {
  auto c = base_config();
  c.backend = run::Requested::cpu;
  g_factory_calls = 0;
  const Result r = generate(c, fake(run::Fault::gpu_perturb));
  EXPECT_EQ(g_factory_calls, 0);
  EXPECT_EQ(r.count(kFallback), 0);
  EXPECT_EQ(r.j["guard"].kind, mini_json::Value::null);
  EXPECT_EQ(r.j["backend"]["requested"].s, "cpu");
  EXPECT_EQ(r.j["backend"]["device"].kind, mini_json::Value::null);
  EXPECT_EQ(r.count("Backend: CPU (2 threads, "), 1);
}

TEST(Dispatch, CpuOnlyBuildSaysSoOnce) {
  const Result r = generate(base_config(), Backends{});
  ASSERT_EQ(r.rc, 0);
  EXPECT_EQ(r.count(kFallback + "this build of moe-run has no CUDA"), 1) << r.err;
  EXPECT_EQ(r.j["backend"]["ran"].s, "cpu");
  // Printed even with --quiet; the banner and stats are not.
  auto q = base_config();
  q.quiet = true;
  const Result rq = generate(q, Backends{});
  EXPECT_EQ(rq.err, kFallback + "this build of moe-run has no CUDA\n");
}

TEST(Dispatch, SkipParityGate) {
  Backends b = fake(run::Fault::gpu_perturb);  // would be rejected if compared
  b.skip_guard = true;
  const Result r = generate(base_config(), b);
  EXPECT_EQ(r.count("F2 guard: SKIP_PARITY_GATE=1 \u2014 nothing was compared on this run"), 1) << r.err;
  EXPECT_TRUE(r.j["guard"]["skipped"].b);
  EXPECT_EQ(r.j["backend"]["ran"].s, "cuda");
}

TEST(Dispatch, OneTokenPromptJudgesNothing) {
  auto c = base_config();
  c.prompt_tokens = std::vector<int32_t>{42};
  const Result r = generate(c, fake());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.count("F2 guard: a 1-token prompt has no real position to compare; nothing was judged"), 1) << r.err;
  EXPECT_EQ(r.j["guard"]["min_cosine"].kind, mini_json::Value::null);
  EXPECT_TRUE(r.j["guard"]["accepted"].b);
}

TEST(Dispatch, ExactModeGpuMatchesTheReferenceClosely) {
  Backends b;
  b.gpu = cpu_as_gpu(quant::ActMode::exact);
  const Result r = generate(base_config(), b);
  EXPECT_GT(r.j["guard"]["min_cosine"].n, 0.999999);
}

TEST(Dispatch, FactoryExceptionIsAFallbackReason) {
  Backends b;
  b.gpu = [](auto, const run::GpuRequest&, run::GpuInfo&) -> std::unique_ptr<Forward> {
    throw Error(Exit::gpu_failed, "the CUDA model would not build: out of device memory");
  };
  const Result r = generate(base_config(), b);
  EXPECT_EQ(r.count(kFallback + "the CUDA model would not build: out of device memory"), 1) << r.err;
}

// ---- generation behaviour -------------------------------------------------------------------

TEST(Generate, MaxTokensZeroEvaluatesThePromptOnly) {
  auto c = base_config();
  c.max_tokens = 0;
  const Result r = generate(c, Backends{});
  EXPECT_TRUE(r.j["tokens"].a.empty());
  EXPECT_EQ(r.j["finish_reason"].s, "length");
}

TEST(Generate, EndOfContextStopsGeneration) {
  auto c = base_config();
  c.ctx_size = 33 + 3;
  c.max_tokens = 10;
  c.backend = run::Requested::cpu;
  const Result r = generate(c, Backends{});
  // Positions 33..35 take the first three generated tokens; the fourth is sampled from the last row.
  EXPECT_EQ(r.j["tokens"].a.size(), 4u);
  EXPECT_EQ(r.j["finish_reason"].s, "length");
}

TEST(Generate, ContextErrorsNameBothNumbers) {
  auto c = base_config();
  c.ctx_size = 10;
  try {
    generate(c, Backends{});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::resources);
    EXPECT_NE(std::string(e.what()).find("33"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("10"), std::string::npos);
  }
  c.ctx_size = 0;
  c.max_tokens = 2000;
  try {
    generate(c, Backends{});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::resources);
    EXPECT_NE(std::string(e.what()).find("1024"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("2033"), std::string::npos);
  }
}

TEST(Generate, StopStringCutsTheText) {
  auto c = base_config();
  c.max_tokens = 24;
  c.backend = run::Requested::cpu;
  const Result full = generate(c, Backends{});
  const std::string text = full.j["text"].s;
  ASSERT_GE(text.size(), 12u);
  // A stop string taken from the middle of the text: everything before its first occurrence.
  const std::string stop = text.substr(text.size() / 2, 3);
  c.stops = {stop};
  const Result r = generate(c, Backends{});
  EXPECT_EQ(r.j["text"].s, text.substr(0, text.find(stop)));
  EXPECT_EQ(r.j["finish_reason"].s, "stop");
  // Text mode prints the same text, then one newline.
  c.output = run::OutputMode::text;
  EXPECT_EQ(generate(c, Backends{}).out, text.substr(0, text.find(stop)) + "\n");
}

std::vector<float> read_npy(const std::string& path, int64_t& rows, int64_t& cols) {
  std::ifstream f(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(all.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t hlen = static_cast<unsigned char>(all[8]) | (static_cast<unsigned char>(all[9]) << 8);
  const std::string header = all.substr(10, hlen);
  EXPECT_EQ((10 + hlen) % 64, 0u);
  EXPECT_NE(header.find("'descr': '<f4'"), std::string::npos);
  EXPECT_NE(header.find("'fortran_order': False"), std::string::npos);
  const size_t s = header.find("'shape': (");
  rows = std::stoll(header.substr(s + 10));
  cols = std::stoll(header.substr(header.find(',', s + 10) + 1));
  std::vector<float> v(static_cast<size_t>(rows * cols));
  EXPECT_EQ(all.size(), 10 + hlen + v.size() * 4);
  std::memcpy(v.data(), all.data() + 10 + hlen, v.size() * 4);
  return v;
}

TEST(Generate, DumpLogitsRowsAreEveryEvaluatedPosition) {
  auto c = base_config();
  c.backend = run::Requested::cpu;
  c.prompt_tokens = golden_prompt("ids_len007");
  c.max_tokens = 6;
  c.dump_logits = testing::TempDir() + "/moe_dump_" + std::to_string(getpid()) + ".npy";
  const Result r = generate(c, Backends{});
  int64_t rows = 0, cols = 0;
  const auto v = read_npy(c.dump_logits, rows, cols);
  EXPECT_EQ(cols, 4099);
  EXPECT_EQ(rows, 7 + 6 - 1);
  const auto toks = r.j["tokens"].ints();
  for (size_t s = 0; s < toks.size(); ++s) {
    const float* row = v.data() + (6 + s) * 4099;
    EXPECT_EQ(std::max_element(row, row + 4099) - row, toks[s]) << "step " << s;
  }
  // Anchored on llama.cpp's logits for the same positions (rows of the golden .npy).
  int64_t grows = 0, gcols = 0;
  const auto g = read_npy(std::string(MOE_TEST_DATA) + "/golden/tiny-qwen3moe-q8_0/ids_len007.npy", grows, gcols);
  ASSERT_EQ(gcols, 4099);
  for (int64_t p = 0; p < rows; ++p) {
    double d = 0, na = 0, nb = 0;
    for (int64_t i = 0; i < 4099; ++i) {
      d += static_cast<double>(v[p * 4099 + i]) * g[p * 4099 + i];
      na += static_cast<double>(v[p * 4099 + i]) * v[p * 4099 + i];
      nb += static_cast<double>(g[p * 4099 + i]) * g[p * 4099 + i];
    }
    EXPECT_GT(d / std::sqrt(na * nb), 0.99) << "position " << p;
  }
}

// A "GPU" that wraps another forward; subclasses change eval().
class Wrapping : public Forward {
 public:
  explicit Wrapping(std::unique_ptr<Forward> in) : in_(std::move(in)) {}
  int64_t n_past() const override { return in_->n_past(); }
  int64_t n_ctx() const override { return in_->n_ctx(); }
  int64_t n_vocab() const override { return in_->n_vocab(); }
  void reset() override { in_->reset(); }
  std::string name() const override { return "cuda"; }

 protected:
  std::unique_ptr<Forward> in_;
};

// A forward that raises the SIGINT flag on its n-th eval.
class Interrupting : public Wrapping {
 public:
  Interrupting(std::unique_ptr<Forward> in, int at) : Wrapping(std::move(in)), at_(at) {}
  void eval(std::span<const int32_t> t, bool all, std::vector<float>& l) override {
    if (++calls_ == at_) run::request_interrupt();
    in_->eval(t, all, l);
  }

 private:
  int at_;
  int calls_ = 0;
};

TEST(Generate, SigintDuringLoadingSkipsThePrefill) {
  auto c = base_config();
  c.backend = run::Requested::cpu;
  run::clear_interrupt();
  run::request_interrupt();
  const Result r = generate(c, Backends{});
  run::clear_interrupt();
  EXPECT_EQ(r.rc, 130);
  EXPECT_TRUE(r.j["tokens"].a.empty());
  EXPECT_EQ(r.j["prompt_tokens"].a.size(), 33u);
}

TEST(Generate, SigintStopsWithinOneTokenWithPartialStats) {
  Backends b;
  b.skip_guard = true;
  b.gpu = [](std::shared_ptr<const model::OwnedQuantizedModel> m, const run::GpuRequest& r, run::GpuInfo&) {
    cpu::Options o;
    o.n_ctx = r.n_ctx;
    o.pool = r.pool;
    return std::unique_ptr<Forward>(std::make_unique<Interrupting>(cpu::make_forward(std::move(m), o), 3));
  };
  auto c = base_config();
  c.max_tokens = 20;
  c.output = run::OutputMode::text;
  run::clear_interrupt();
  const Result r = generate(c, b);
  run::clear_interrupt();
  EXPECT_EQ(r.rc, 130);
  // eval 1 = prefill, 2 and 3 = the first two generated tokens fed back: the flag rises during
  // eval 3, and the loop stops before sampling another token.
  EXPECT_NE(r.err.find("generated 2 tok"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("interrupted"), std::string::npos);
}

}  // namespace

namespace {

// A copy of the tiny model whose final norm weights are NaN: every logit is NaN.
std::string nan_model() {
  const std::string path = testing::TempDir() + "/moe_nan_model_" + std::to_string(getpid()) + ".gguf";
  std::vector<char> bytes;
  {
    std::ifstream f(kModel, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  auto file = gguf::File::open(kModel);
  const auto* t = file->tensor("output_norm.weight");
  EXPECT_NE(t, nullptr);
  EXPECT_EQ(t->type, gguf::Type::F32);
  const float nan = std::nanf("");
  for (int64_t i = 0; i < t->nelements(); ++i)
    std::memcpy(bytes.data() + t->file_offset + static_cast<size_t>(i) * 4, &nan, 4);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

TEST(Generate, NonFiniteCpuLogitsAreAnInferenceError) {
  auto c = base_config();
  c.model_path = nan_model();
  c.backend = run::Requested::cpu;
  try {
    generate(c, Backends{});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::inference);
    EXPECT_NE(std::string(e.what()).find("position"), std::string::npos) << e.what();
  }
  // Through the guard (the CPU reference is NaN too) it is the same error, not a GPU fallback.
  c.backend = run::Requested::automatic;
  try {
    generate(c, fake());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Exit::inference);
  }
}

}  // namespace

namespace {

// Wraps a forward and, once `from` positions are in its cache, makes `boost` the clear argmax.
class Boosting : public Wrapping {
 public:
  Boosting(std::unique_ptr<Forward> in, int64_t from, int32_t boost) : Wrapping(std::move(in)), from_(from), boost_(boost) {}
  void eval(std::span<const int32_t> t, bool all, std::vector<float>& l) override {
    in_->eval(t, all, l);
    if (in_->n_past() >= from_) l[l.size() - static_cast<size_t>(in_->n_vocab()) + static_cast<size_t>(boost_)] = 1e4f;
  }

 private:
  int64_t from_;
  int32_t boost_;
};

TEST(Generate, EndOfGenerationTokenStopsAndIsNotPrinted) {
  auto c = base_config();
  const int64_t n_prompt = static_cast<int64_t>(c.prompt_tokens->size());
  Backends b;
  b.skip_guard = true;
  b.gpu = [n_prompt](std::shared_ptr<const model::OwnedQuantizedModel> m, const run::GpuRequest& r, run::GpuInfo&) {
    cpu::Options o;
    o.n_ctx = r.n_ctx;
    o.pool = r.pool;
    // <|im_end|> (id 4098, an end-of-generation token of the fixture) wins the third step.
    return std::unique_ptr<Forward>(std::make_unique<Boosting>(cpu::make_forward(std::move(m), o), n_prompt + 2, 4098));
  };
  const Result r = generate(c, b);
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto toks = r.j["tokens"].ints();
  ASSERT_EQ(toks.size(), 3u);
  EXPECT_EQ(toks[2], 4098);
  EXPECT_EQ(r.j["finish_reason"].s, "stop");
  auto two = base_config();
  two.max_tokens = 2;
  const Result ref = cpu_reference(two);
  EXPECT_EQ(std::vector<int64_t>(toks.begin(), toks.begin() + 2), ref.j["tokens"].ints());
  EXPECT_EQ(r.j["text"].s, ref.j["text"].s);  // the end token adds no text
  EXPECT_EQ(r.j["text"].s.find("<|im_end|>"), std::string::npos);
}

TEST(Dispatch, FallbackKeepsTheSamplerState) {
  // Sampling with a seed: the CPU must continue the GPU's RNG stream, not restart it.
  auto c = base_config();
  c.max_tokens = 16;
  c.sampler.temperature = 1.2f;
  c.sampler.seed = 7;
  const Result ref = cpu_reference(c);
  const Result r = generate(c, fake(run::Fault::gpu_kernel));
  ASSERT_EQ(r.count(kFallback), 1) << r.err;
  EXPECT_EQ(r.j["tokens"].ints(), ref.j["tokens"].ints());
  auto other = c;
  other.sampler.seed = 8;
  EXPECT_NE(cpu_reference(other).j["tokens"].ints(), ref.j["tokens"].ints());  // the seed matters here
}

}  // namespace
