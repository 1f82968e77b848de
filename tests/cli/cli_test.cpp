// End-to-end tests of the moe-run binary: stdout/stderr split, JSON/NDJSON shapes of CLI.md, exit
// codes, process behaviour (closed stdout, SIGINT), and greedy output against llama.cpp's goldens.
#include <gtest/gtest.h>

#include "test_util.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "mini_json.hpp"
#if defined(MOE_HAVE_CUDA)
#include "moe/cuda.hpp"
#endif

extern char** environ;

namespace {

const std::string kBin = std::string(MOE_BIN_DIR) + "/moe-run";
const std::string kData = MOE_TEST_DATA;
const std::string kTiny = kData + "/tiny-qwen3moe-q8_0.gguf";
const std::string kVocab = kData + "/ggml-vocab-qwen2.gguf";

#if defined(MOE_HAVE_CUDA)
constexpr bool kCuda = true;
#else
constexpr bool kCuda = false;
#endif

struct Proc {
  int status = -1;  // exit code; -1 if killed by a signal
  int signal = 0;
  std::string out, err;
  int count_err(const std::string& needle) const {
    int n = 0;
    for (size_t p = err.find(needle); p != std::string::npos; p = err.find(needle, p + 1)) ++n;
    return n;
  }
  // CLI.md: every error prints exactly one line `error: ...`.
  bool one_error_line() const {
    int n = 0;
    std::istringstream is(err);
    for (std::string l; std::getline(is, l);) n += l.rfind("error: ", 0) == 0;
    return n == 1;
  }
};

using test_util::slurp;

std::string temp_path(const std::string& name) { return test_util::temp_path("moe_cli_", name); }

// Runs argv with extra environment entries; stdout/stderr captured through files.
Proc run(std::vector<std::string> args, std::map<std::string, std::string> env = {}, const std::string& stdin_path = "/dev/null") {
  const std::string out = temp_path("stdout"), err = temp_path("stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, stdin_path.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string k = kv.substr(0, kv.find('='));
    // The test controls these: an inherited value must not change what is tested.
    if (k == "MOE_FAULT" || k == "MOE_FAKE_GPU" || k == "SKIP_PARITY_GATE" || env.count(k)) continue;
    envs.push_back(kv);
  }
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  Proc p;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "cannot spawn " << args[0];
    return p;
  }
  int st = 0;
  waitpid(pid, &st, 0);
  if (WIFEXITED(st)) p.status = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) p.signal = WTERMSIG(st);
  p.out = slurp(out);
  p.err = slurp(err);
  return p;
}

Proc moe(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), kBin);
  return run(std::move(args), std::move(env));
}

Proc shell(const std::string& script) { return run({"/bin/bash", "-c", script}); }

const std::vector<std::string> kGen = {"-n", "8", "--threads", "2"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---- help and version -----------------------------------------------------------------------------

TEST(Cli, VersionNamesGitHashAndCuda) {
  const Proc p = moe({"--version"});
  EXPECT_EQ(p.status, 0);
  EXPECT_TRUE(std::regex_search(p.out, std::regex(R"(^moe-run \d+\.\d+\.\d+ \(git [0-9a-z]+, CUDA (on|off)\)\n$)"))) << p.out;
  EXPECT_NE(p.out.find(kCuda ? "CUDA on" : "CUDA off"), std::string::npos);
}

TEST(Cli, HelpListsEveryFlagOfTheContract) {
  const Proc p = moe({"--help"});
  EXPECT_EQ(p.status, 0);
  for (const char* f : {"--prompt", "--input", "--prompt-tokens", "--chat", "--raw", "--system", "--thinking",
                        "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty",
                        "--repeat-last-n", "--seed", "--ctx-size", "--stop", "--no-gpu", "--cpu", "--gpu",
                        "--device", "--threads", "--json", "--format", "--stream", "--quiet", "--verbose",
                        "--inspect", "--tokenize", "--dump-logits", "--cpu-mode", "SKIP_PARITY_GATE", "MOE_FAULT"})
    EXPECT_NE(p.out.find(f), std::string::npos) << f;
}

// ---- text, JSON, NDJSON ---------------------------------------------------------------------------------

TEST(Cli, TextGoesToStdoutEverythingElseToStderr) {
  const Proc t = moe(with({kTiny, "Hello", "--no-gpu"}, kGen));
  ASSERT_EQ(t.status, 0) << t.err;
  const Proc j = moe(with({kTiny, "Hello", "--no-gpu", "--json"}, kGen));
  ASSERT_EQ(j.status, 0) << j.err;
  const auto v = mini_json::parse(j.out);
  EXPECT_EQ(t.out, v["text"].s + "\n");
  EXPECT_EQ(v["tokens"].a.size(), 8u);
  EXPECT_EQ(t.count_err("Backend: CPU (2 threads, "), 1) << t.err;
  EXPECT_TRUE(std::regex_search(
      t.err, std::regex(R"(prompt \d+ tok in [0-9.]+ ms \([0-9.]+ tok/s\) \| generated 8 tok in [0-9.]+ ms \([0-9.]+ tok/s\) \| backend cpu)")))
      << t.err;
  EXPECT_EQ(t.count_err("falling back"), 0);
  // --quiet: nothing on stderr for a CPU run.
  const Proc q = moe(with({kTiny, "Hello", "--no-gpu", "-q"}, kGen));
  EXPECT_EQ(q.err, "");
  EXPECT_EQ(q.out, t.out);
}

TEST(Cli, DefaultRunOnACpuOnlyBuildSaysSoOnce) {
  if (kCuda) GTEST_SKIP() << "CUDA build";
  const Proc p = moe(with({kTiny, "Hello"}, kGen));
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(p.count_err("qwen3moe: the CUDA forward did not serve this run, falling back to CPU: this build of moe-run has no CUDA\n"), 1) << p.err;
}

TEST(Cli, JsonObjectHasExactlyTheContractKeys) {
  const Proc p = moe(with({kTiny, "Hello", "--json"}, kGen), {{"MOE_FAKE_GPU", "1"}});
  ASSERT_EQ(p.status, 0) << p.err;
  const auto v = mini_json::parse(p.out);
  EXPECT_EQ(v.keys(), (std::vector<std::string>{"model", "arch", "backend", "guard", "prompt_tokens", "tokens", "text",
                                                "finish_reason", "timings", "memory"}));
  EXPECT_EQ(v["backend"].keys(), (std::vector<std::string>{"requested", "ran", "fell_back", "reason", "device"}));
  EXPECT_EQ(v["guard"].keys(),
            (std::vector<std::string>{"skipped", "positions", "min_cosine", "accepted", "first_bad_pos", "ms"}));
  EXPECT_EQ(v["timings"].keys(), (std::vector<std::string>{"load_ms", "guard_ms", "prefill_ms", "decode_ms", "ttft_ms",
                                                           "prefill_tok_s", "decode_tok_s"}));
  EXPECT_EQ(v["memory"].keys(), (std::vector<std::string>{"peak_rss_mib", "vram_mib"}));
  EXPECT_EQ(v["model"].s, kTiny);
  EXPECT_EQ(v["arch"].s, "qwen3moe");
  EXPECT_EQ(v["backend"]["ran"].s, "cuda");
  EXPECT_TRUE(v["guard"]["accepted"].b);
  EXPECT_EQ(v["finish_reason"].s, "length");
  EXPECT_GT(v["memory"]["peak_rss_mib"].n, 1.0);
  // TTFT includes the guard and the prefill.
  EXPECT_GE(v["timings"]["ttft_ms"].n, v["timings"]["guard_ms"].n + v["timings"]["prefill_ms"].n - 1e-6);
  // A CPU run: guard null, device null.
  const auto c = mini_json::parse(moe(with({kTiny, "Hello", "--json", "--no-gpu"}, kGen)).out);
  EXPECT_EQ(c["guard"].kind, mini_json::Value::null);
  EXPECT_EQ(c["backend"]["device"].kind, mini_json::Value::null);
  EXPECT_EQ(c["backend"]["requested"].s, "cpu");
  // -f json is --json.
  EXPECT_EQ(mini_json::parse(moe(with({kTiny, "Hello", "-f", "json", "--no-gpu"}, kGen)).out)["tokens"].ints(),
            c["tokens"].ints());
}

TEST(Cli, StreamEventsInOrderThenFinal) {
  const Proc p = moe(with({kTiny, "Hello", "--stream", "--no-gpu"}, kGen));
  ASSERT_EQ(p.status, 0) << p.err;
  std::vector<mini_json::Value> ev;
  std::istringstream is(p.out);
  for (std::string l; std::getline(is, l);) ev.push_back(mini_json::parse(l));
  ASSERT_EQ(ev.size(), 9u);
  std::string text;
  std::vector<int64_t> ids;
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(ev[i].keys(), (std::vector<std::string>{"event", "index", "token_id", "text"}));
    EXPECT_EQ(ev[i]["event"].s, "token");
    EXPECT_EQ(ev[i]["index"].n, static_cast<double>(i));
    text += ev[i]["text"].s;
    ids.push_back(static_cast<int64_t>(ev[i]["token_id"].n));
  }
  const auto& fin = ev.back();
  EXPECT_EQ(fin["event"].s, "final");
  EXPECT_EQ(fin.keys().size(), 11u);
  EXPECT_EQ(fin["text"].s, text);
  EXPECT_EQ(fin["tokens"].ints(), ids);
}

TEST(Cli, StreamEventTextsAddUpToTheFinalText) {
  // Whatever is held back at the end (bytes of an unfinished character, the start of a stop
  // string that can no longer complete) is released with the last token's event.
  int checked = 0;
  for (const char* prompt : {"Hello", "Über café, 東京", "def f(x):", "1 2 3 4"}) {
    for (const char* n : {"3", "17"}) {
      const std::vector<std::string> a = {kTiny, prompt, "--no-gpu", "-n", n, "--threads", "2"};
      const auto plain = mini_json::parse(moe(with(a, {"--json"})).out);
      const std::string full = plain["text"].s;
      ASSERT_FALSE(full.empty());
      // A stop string that begins with the text's last byte and cannot complete: that byte is held
      // back until the run ends.
      const std::string stop = full.substr(full.size() - 1) + "\x01";
      const Proc p = moe(with(a, {"--stream", "--stop", stop}));
      ASSERT_EQ(p.status, 0) << p.err;
      std::istringstream is(p.out);
      std::string text;
      mini_json::Value fin;
      for (std::string l; std::getline(is, l);) {
        auto v = mini_json::parse(l);
        if (v["event"].s == "token") text += v["text"].s;
        else fin = v;
      }
      EXPECT_EQ(fin["text"].s, full) << prompt << " -n " << n;
      EXPECT_EQ(text, full) << prompt << " -n " << n;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8);
}

// ---- exit codes ------------------------------------------------------------------------------------------

void expect_exit(const Proc& p, int code, const std::string& needle = "") {
  EXPECT_EQ(p.signal, 0) << "killed by signal";
  EXPECT_EQ(p.status, code) << p.err;
  EXPECT_TRUE(p.one_error_line()) << p.err;
  if (!needle.empty()) {
    EXPECT_NE(p.err.find(needle), std::string::npos) << p.err;
  }
}

TEST(Cli, UsageErrorsExit2) {
  expect_exit(moe({kTiny, "x", "--top-p", "1.5"}), 2, "--top-p");
  expect_exit(moe({kTiny, "x", "--threads", "0"}), 2, "--threads");
  expect_exit(moe({kTiny, "x", "--gpu", "--no-gpu"}), 2, "--gpu");
  expect_exit(moe({kTiny, "x", "--gpu", "--cpu"}), 2);
  expect_exit(moe({kTiny, "x", "--thinking", "maybe"}), 2, "--thinking");
  expect_exit(moe({kTiny, "x", "--temperature", "nan"}), 2, "--temperature");
  expect_exit(moe({kTiny, "x", "--temperature", "-1"}), 2);
  expect_exit(moe({kTiny, "x", "-n", "-3"}), 2);
  expect_exit(moe({kTiny, "x", "-n", "12abc"}), 2);
  expect_exit(moe({kTiny, "x", "--seed", "-1"}), 2);
  expect_exit(moe({kTiny, "x", "--min-p", "2"}), 2);
  expect_exit(moe({kTiny, "x", "--no-such-flag"}), 2);
  expect_exit(moe({kTiny, "x", "--json", "--stream"}), 2);
  expect_exit(moe({kTiny, "x", "--chat", "--raw"}), 2);
  expect_exit(moe({kTiny, "x", "-p", "y"}), 2);
  expect_exit(moe({kTiny}), 2, "prompt");
  expect_exit(moe({}), 2, "MODEL");
  expect_exit(moe({kTiny, "--prompt-tokens", "1,,2"}), 2);
  expect_exit(moe({kTiny, "--prompt-tokens", "5000", "--no-gpu"}), 2, "vocabulary");
  expect_exit(moe({kTiny, "x", "-f", "yaml"}), 2);
  expect_exit(moe({kTiny, "x", "--cpu-mode", "turbo"}), 2);
  expect_exit(moe({kTiny, "x", "--raw", "--system", "be brief"}), 2, "--system");
  expect_exit(moe({kTiny, "x", "--no-gpu"}, {{"MOE_FAULT", "gpu-bogus"}}), 2, "MOE_FAULT");
}

TEST(Cli, MissingOrUnreadableModelExit3) {
  expect_exit(moe({kData + "/no-such-model.gguf", "x"}), 3, "no-such-model.gguf");
  expect_exit(moe({kData, "x"}), 3);  // a directory
  expect_exit(moe({kData + "/no-such-model.gguf", "--inspect"}), 3);
  if (geteuid() != 0) {  // root reads any file
    const std::string locked = temp_path("locked.gguf");
    std::ofstream(locked) << "GGUF";
    chmod(locked.c_str(), 0);
    expect_exit(moe({locked, "x"}), 3);
  }
}

TEST(Cli, NotAGgufExit4) {
  const std::string path = temp_path("not-a-model.gguf");
  std::ofstream(path) << "this is plain text, not a GGUF file at all\n";
  expect_exit(moe({path, "x"}), 4);
  const std::string trunc = temp_path("truncated.gguf");
  const std::string bytes = slurp(kTiny);
  std::ofstream(trunc, std::ios::binary) << bytes.substr(0, 100000);
  expect_exit(moe({trunc, "x", "--no-gpu"}), 4);
}

TEST(Cli, VocabularyOnlyGgufCannotGenerateExit5) {
  expect_exit(moe({kVocab, "hello", "--no-gpu"}), 5, "qwen2");
}

TEST(Cli, ContextErrorsExit6) {
  expect_exit(moe({kTiny, "a longer prompt than the context allows", "--ctx-size", "4", "--raw", "--no-gpu"}), 6);
  expect_exit(moe({kTiny, "x", "-n", "5000", "--no-gpu"}), 6, "1024");
  expect_exit(moe({kTiny, "x", "--ctx-size", "4096", "--no-gpu"}), 6, "1024");
}

TEST(Cli, ForcedGpuOnCpuOnlyBuildExit9) {
  if (kCuda) GTEST_SKIP() << "CUDA build";
  expect_exit(moe(with({kTiny, "x", "--gpu"}, kGen)), 9, "no CUDA");
}

TEST(Cli, ForcedGpuThatCannotServeExit14) {
  for (const char* f : {"gpu-init", "gpu-perturb", "gpu-nan", "gpu-kernel"}) {
    const Proc p = moe(with({kTiny, "Hello there, how are you", "--gpu"}, kGen), {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", f}});
    expect_exit(p, 14);
    EXPECT_EQ(p.count_err("falling back"), 0) << f;
  }
}

// ---- backend selection through the binary (MOE_FAKE_GPU: a CPU forward poses as the GPU) -------------

TEST(Cli, FaultsFallBackAndAnswerLikeNoGpu) {
  const std::vector<std::string> a = with({kTiny, "Tell me a story about a dragon"}, {"-n", "16", "--threads", "2"});
  const Proc ref = moe(with(a, {"--no-gpu"}));
  ASSERT_EQ(ref.status, 0);
  const Proc clean = moe(a, {{"MOE_FAKE_GPU", "1"}});
  EXPECT_EQ(clean.count_err("F2 guard: GPU matches the CPU forward on "), 1) << clean.err;
  EXPECT_NE(clean.err.find("| backend cuda"), std::string::npos);
  for (const char* f : {"gpu-init", "gpu-nan", "gpu-perturb", "gpu-kernel"}) {
    const Proc p = moe(a, {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", f}});
    EXPECT_EQ(p.status, 0) << f << p.err;
    EXPECT_EQ(p.count_err("qwen3moe: the CUDA forward did not serve this run, falling back to CPU: "), 1) << f << p.err;
    EXPECT_EQ(p.out, ref.out) << f;
    // The fallback line prints even with --quiet.
    const Proc q = moe(with(a, {"-q"}), {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", f}});
    EXPECT_EQ(q.count_err("falling back to CPU"), 1) << f;
  }
  // --no-gpu never reaches the GPU path, fault or not.
  const Proc n = moe(with(a, {"--no-gpu"}), {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", "gpu-init"}});
  EXPECT_EQ(n.count_err("falling back"), 0);
  EXPECT_EQ(n.count_err("F2 guard"), 0);
  // SKIP_PARITY_GATE=1.
  const Proc s = moe(a, {{"MOE_FAKE_GPU", "1"}, {"SKIP_PARITY_GATE", "1"}});
  EXPECT_EQ(s.count_err("F2 guard: SKIP_PARITY_GATE=1 \u2014 nothing was compared on this run"), 1) << s.err;
}

TEST(Cli, FakeGpuSamplesThroughTheDevicePathAndFallsBack) {
  // The fake GPU draws sampled tokens through Forward::eval_sample like the real one (the same sampler on its CPU
  // logits): the engine's device-sampling loop gives the host path's tokens, and its failure falls back.
  for (const std::vector<std::string>& f : std::vector<std::vector<std::string>>{
           {"--temperature", "0.8", "--seed", "5"}, {"--temperature", "1.3", "--top-k", "0", "--top-p", "0.9"},
           {"--repeat-penalty", "1.4", "--repeat-last-n", "6"}}) {
    const std::vector<std::string> a = with({kTiny, "Tell me a story about a dragon", "--json", "-n", "24"}, f);
    const Proc d = moe(a, {{"MOE_FAKE_GPU", "1"}});
    const Proc h = moe(a, {{"MOE_FAKE_GPU", "1"}, {"MOE_CUDA_DEVICE_SAMPLER", "0"}});
    ASSERT_EQ(d.status, 0) << d.err;
    ASSERT_EQ(h.status, 0) << h.err;
    EXPECT_EQ(mini_json::parse(d.out)["tokens"].ints(), mini_json::parse(h.out)["tokens"].ints()) << f[0] << " " << f[1];
    EXPECT_EQ(mini_json::parse(d.out)["backend"]["ran"].s, "cuda");
  }
  const std::vector<std::string> a =
      with({kTiny, "Tell me a story about a dragon", "--json", "-n", "16"}, {"--temperature", "0.8"});
  const Proc f = moe(a, {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", "gpu-kernel"}});
  ASSERT_EQ(f.status, 0) << f.err;
  EXPECT_EQ(f.count_err("falling back to CPU: a CUDA kernel failed at decode position"), 1) << f.err;
  EXPECT_EQ(mini_json::parse(f.out)["backend"]["ran"].s, "cpu");
  EXPECT_EQ(mini_json::parse(f.out)["tokens"].ints().size(), 16u);
  expect_exit(moe(with(a, {"--gpu"}), {{"MOE_FAKE_GPU", "1"}, {"MOE_FAULT", "gpu-kernel"}}), 14, "injected fault");
}

// ---- a CUDA build: the real GPU path (on a machine with a device) or its fallback (without) -----

TEST(Cli, CudaBuildServesOrFallsBackWithTheCudaError) {
#if !defined(MOE_HAVE_CUDA)
  GTEST_SKIP() << "CPU-only build";
#else
  const std::vector<std::string> a = with({kTiny, "Tell me a story about a dragon"}, {"-n", "16", "--threads", "2"});
  const Proc ref = moe(with(a, {"--no-gpu"}));
  const Proc p = moe(with(a, {"--json"}));
  ASSERT_EQ(p.status, 0) << p.err;
  const auto v = mini_json::parse(p.out);
  if (moe::cuda::device_count() == 0) {
    EXPECT_EQ(p.count_err("qwen3moe: the CUDA forward did not serve this run, falling back to CPU: CUDA initialization failed"), 1) << p.err;
    EXPECT_EQ(v["backend"]["ran"].s, "cpu");
    EXPECT_EQ(v["text"].s + "\n", ref.out);
    expect_exit(moe(with(a, {"--gpu"})), 14, "CUDA initialization failed");
    return;
  }
  // A device: the guard accepts the real CUDA forward, and every injected fault falls back to the
  // answer of a --no-gpu run (gpu-kernel: after two GPU tokens, which agree on this model).
  EXPECT_EQ(p.count_err("F2 guard: GPU matches the CPU forward on "), 1) << p.err;
  EXPECT_EQ(v["backend"]["ran"].s, "cuda");
  EXPECT_TRUE(v["guard"]["accepted"].b);
  EXPECT_GT(v["guard"]["min_cosine"].n, 0.99);
  std::cerr << "real GPU guard: " << p.err;
  for (const char* f : {"gpu-init", "gpu-nan", "gpu-perturb", "gpu-kernel"}) {
    const Proc q = moe(a, {{"MOE_FAULT", f}});
    EXPECT_EQ(q.status, 0) << f << q.err;
    EXPECT_EQ(q.count_err("qwen3moe: the CUDA forward did not serve this run, falling back to CPU: "), 1) << f << q.err;
    EXPECT_EQ(q.out, ref.out) << f;
    expect_exit(moe(with(a, {"--gpu"}), {{"MOE_FAULT", f}}), 14);
  }
  const Proc s = moe(a, {{"SKIP_PARITY_GATE", "1"}});
  EXPECT_EQ(s.count_err("F2 guard: SKIP_PARITY_GATE=1"), 1) << s.err;
  const Proc one = moe({kTiny, "--prompt-tokens", "42", "-n", "4"});
  EXPECT_EQ(one.count_err("F2 guard: a 1-token prompt has no real position to compare; nothing was judged"), 1) << one.err;
#endif
}

// Sampled decoding on a device: the draw on the GPU (the default) gives the tokens of the host's sampler on the
// copied logits (MOE_CUDA_DEVICE_SAMPLER=0) for the same seed, with and without a repeat penalty, and greedy
// with a penalty; top-k 0 is drawn on the host either way.
TEST(Cli, CudaSampledDecodeDrawsOnTheDeviceAsOnTheHost) {
#if !defined(MOE_HAVE_CUDA)
  GTEST_SKIP() << "CPU-only build";
#else
  if (moe::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::vector<std::string>> flags = {
      {"--temperature", "0.8", "--seed", "11"},
      {"--temperature", "1.4", "--top-k", "128", "--top-p", "0.9", "--min-p", "0.02", "--repeat-penalty", "1.2"},
      {"--repeat-penalty", "1.5", "--repeat-last-n", "8"},
      {"--temperature", "0.8", "--top-k", "0", "--top-p", "0.95"}};
  for (const auto& f : flags) {
    const std::vector<std::string> a =
        with(with({kTiny, "Tell me a story about a dragon", "--json"}, {"-n", "40", "--threads", "2"}), f);
    const Proc d = moe(a), h = moe(a, {{"MOE_CUDA_DEVICE_SAMPLER", "0"}});
    ASSERT_EQ(d.status, 0) << d.err;
    ASSERT_EQ(h.status, 0) << h.err;
    const auto vd = mini_json::parse(d.out), vh = mini_json::parse(h.out);
    EXPECT_EQ(vd["backend"]["ran"].s, "cuda");
    EXPECT_EQ(vd["tokens"].ints(), vh["tokens"].ints()) << f[0] << " " << f[1];
    EXPECT_FALSE(vd["tokens"].ints().empty());  // 40 unless an end token comes first: the same on both sides
  }
  // a failing GPU step of the device sampler falls back to the CPU (which samples on the host), or exits 14
  const std::vector<std::string> a = with({kTiny, "Tell me a story about a dragon", "--json", "-n", "16"}, flags[0]);
  const Proc f = moe(a, {{"MOE_FAULT", "gpu-kernel"}});
  ASSERT_EQ(f.status, 0) << f.err;
  EXPECT_EQ(f.count_err("qwen3moe: the CUDA forward did not serve this run, falling back to CPU: a CUDA kernel failed"), 1)
      << f.err;
  EXPECT_EQ(mini_json::parse(f.out)["backend"]["ran"].s, "cpu");
  expect_exit(moe(with(a, {"--gpu"}), {{"MOE_FAULT", "gpu-kernel"}}), 14, "injected fault");
#endif
}

// ---- --inspect, --tokenize ------------------------------------------------------------------------------

TEST(Cli, InspectJsonReportsTheGeometry) {
  const Proc p = moe({kTiny, "--inspect", "--json"});
  ASSERT_EQ(p.status, 0) << p.err;
  const auto v = mini_json::parse(p.out);
  // The fixture's geometry as FIXTURES.md documents it.
  const auto& h = v["hyperparameters"];
  EXPECT_EQ(v["arch"].s, "qwen3moe");
  EXPECT_EQ(h["n_layer"].n, 2);
  EXPECT_EQ(h["n_embd"].n, 256);
  EXPECT_EQ(h["n_head"].n, 4);
  EXPECT_EQ(h["n_head_kv"].n, 2);
  EXPECT_EQ(h["head_dim"].n, 64);
  EXPECT_EQ(h["n_expert"].n, 8);
  EXPECT_EQ(h["n_expert_used"].n, 2);
  EXPECT_EQ(h["expert_ffn"].n, 256);
  EXPECT_EQ(h["feed_forward_length"].n, 768);
  EXPECT_EQ(h["context_length"].n, 1024);
  EXPECT_EQ(h["n_vocab"].n, 4099);
  EXPECT_EQ(h["rope_base"].n, 1000000);
  EXPECT_NEAR(h["rms_eps"].n, 1e-6, 1e-12);
  EXPECT_FALSE(h["tied_output"].b);
  EXPECT_EQ(v["file_size"].n, 6137696);
  EXPECT_EQ(v["tensors"]["count"].n, 27);
  EXPECT_EQ(v["tensors"]["by_type"]["F32"].n, 11);
  EXPECT_EQ(v["tensors"]["by_type"]["Q8_0"].n, 16);
  EXPECT_TRUE(v["chat_template"].b);
  EXPECT_EQ(v["tokenizer"]["n_vocab"].n, 4099);
  const auto q4 = mini_json::parse(moe({kData + "/tiny-qwen3moe-q4_k_m.gguf", "--inspect", "--json"}).out);
  EXPECT_EQ(q4["tensors"]["by_type"]["Q4_K"].n, 8);
  EXPECT_EQ(q4["tensors"]["by_type"]["Q5_K"].n, 2);
  EXPECT_EQ(q4["tensors"]["by_type"]["Q6_K"].n, 2);
  EXPECT_EQ(q4["tensors"]["by_type"]["Q8_0"].n, 4);
  // Human form names the same facts.
  const Proc hp = moe({kTiny, "--inspect"});
  EXPECT_NE(hp.out.find("architecture: qwen3moe"), std::string::npos);
  EXPECT_NE(hp.out.find("chat template: present"), std::string::npos);
  EXPECT_NE(hp.out.find("Q8_0 x16"), std::string::npos);
}

TEST(Cli, TokenizeOnTheVocabularyOnlyGgufMatchesLlamaCpp) {
  const std::string inp = slurp(kVocab + ".inp"), outp = slurp(kVocab + ".out");
  std::vector<std::string> strings;
  const std::string sep = "\n__ggml_vocab_test__\n";
  for (size_t s = 0, e; (e = inp.find(sep, s)) != std::string::npos; s = e + sep.size())
    strings.push_back(inp.substr(s, e - s));
  std::vector<std::string> expected;
  std::istringstream os(outp);
  for (std::string l; std::getline(os, l);) expected.push_back(l);
  ASSERT_EQ(strings.size(), expected.size());
  int checked = 0;
  // Every fourth vector through the binary (the tokenizer's own tests run all of them in process;
  // here the point is the -i file path, --raw and the output format).
  for (size_t i = 0; i < strings.size(); i += 4) {
    if (expected[i].empty()) continue;  // the empty prompt is a usage error (below)
    const std::string f = temp_path("prompt.txt");
    std::ofstream(f, std::ios::binary) << strings[i];
    const Proc p = moe({kVocab, "--tokenize", "--raw", "-i", f});
    ASSERT_EQ(p.status, 0) << p.err;
    std::string ids = expected[i];
    std::string want = "[";
    std::istringstream is(ids);
    bool first = true;
    for (std::string id; is >> id; first = false) want += (first ? "" : ", ") + id;
    EXPECT_EQ(p.out, want + "]\n") << "string " << i;
    ++checked;
  }
  EXPECT_GE(checked, 8);
  // With the GGUF's ChatML template (auto): <|im_start|>user\n ... <|im_start|>assistant\n
  const Proc t = moe({kVocab, "--tokenize", "Hi"});
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_EQ(t.out.rfind("[151644, 872, 198, ", 0), 0u) << t.out;
  EXPECT_NE(t.out.find("151645, 198, 151644, 77091, 198"), std::string::npos) << t.out;
  const std::string empty = temp_path("empty.txt");
  std::ofstream(empty).flush();
  expect_exit(moe({kVocab, "--tokenize", "--raw", "-i", empty}), 2, "empty");
}

TEST(Cli, RepeatedStopsDoNotSwallowThePrompt) {
  const Proc a = moe({kTiny, "--stop", "x", "--stop", "y", "Hello there", "--tokenize"});
  const Proc b = moe({kTiny, "Hello there", "--tokenize"});
  EXPECT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
}

TEST(Cli, PromptFromStdinEqualsPromptFlag) {
  const std::string f = temp_path("stdin.txt");
  std::ofstream(f, std::ios::binary) << "Hello from stdin";
  const Proc a = run({kBin, kTiny, "--tokenize", "-i", "-"}, {}, f);
  const Proc b = moe({kTiny, "--tokenize", "-p", "Hello from stdin"});
  EXPECT_EQ(a.status, 0);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out.rfind("[4097, ", 0), 0u) << a.out;  // the template's <|im_start|>
  EXPECT_NE(moe({kTiny, "--tokenize", "--raw", "-p", "Hello from stdin"}).out.rfind("[4097", 0), 0u);
}

// ---- greedy output against llama.cpp ------------------------------------------------------------------

TEST(Cli, GreedyTokensMatchTheGoldensUpToTheFirstLowMarginStep) {
  size_t total = 0;
  for (const char* model : {"tiny-qwen3moe-q8_0", "tiny-qwen3moe-q4_k_m"}) {
    for (const char* runname : {"ids_len001", "ids_len007", "ids_len033", "ids_len100", "text_0", "text_1", "text_2"}) {
      SCOPED_TRACE(std::string(model) + "/" + runname);
      const auto g = mini_json::parse(slurp(kData + "/golden/" + model + "/" + runname + ".json"));
      const auto prompt = g["prompt_ids"].ints();
      const auto gen = g["generated_ids"].ints();
      const auto margin = g["row_top2_margin"].a;
      std::string ids;
      for (auto id : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(id);
      const Proc p = moe({kData + "/" + model + ".gguf", "--prompt-tokens", ids, "-n", std::to_string(gen.size()),
                          "--json", "--no-gpu", "--threads", "2"});
      ASSERT_EQ(p.status, 0) << p.err;
      const auto got = mini_json::parse(p.out)["tokens"].ints();
      size_t compared = 0;
      for (size_t s = 0; s < gen.size(); ++s) {
        // Step s is decided by the row at position n_prompt - 1 + s.
        if (margin[prompt.size() - 1 + s].n < 0.3) break;
        ASSERT_LT(s, got.size());
        EXPECT_EQ(got[s], gen[s]) << "step " << s;
        ++compared;
      }
      RecordProperty(std::string(model) + "_" + runname, static_cast<int>(compared));
      total += compared;
    }
  }
  EXPECT_GT(total, 50u);  // the criterion must leave real steps to compare
}

// ---- process behaviour -----------------------------------------------------------------------------------

TEST(Cli, ClosedStdoutEndsQuietly) {
  for (const char* extra : {"", "--stream", "--json"}) {
    const std::string base = "'" + kBin + "' '" + kTiny + "' --prompt-tokens 1,2,3 -n 1000 --ctx-size 1000 --no-gpu -q " + extra;
    const Proc h = shell(base + " 2>" + temp_path("pipe_err") + " | head -c 10 >/dev/null; echo ${PIPESTATUS[0]}");
    EXPECT_EQ(h.out, "0\n") << extra;
    EXPECT_EQ(slurp(temp_path("pipe_err")), "") << extra;
    const Proc t = shell(base + " 2>" + temp_path("pipe_err") + " | true; echo ${PIPESTATUS[0]}");
    EXPECT_EQ(t.out, "0\n") << extra;
    EXPECT_EQ(slurp(temp_path("pipe_err")), "") << extra;
  }
}

// Starts moe-run with stdout into a 4 KiB pipe it fills at once (it then blocks in write until the
// test reads) and stderr into a file. Returns the pid; *read_fd is the pipe's read end.
pid_t spawn_blocking_stream(int* read_fd, const std::string& err) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fcntl(fds[1], F_SETPIPE_SZ, 4096);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> args = {kBin, kTiny, "--prompt-tokens", "1,2,3", "-n", "1000", "--ctx-size", "1000",
                                   "--stream", "--no-gpu", "--threads", "1"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  *read_fd = fds[0];
  return pid;
}

TEST(Cli, SecondSigintEndsAtOnceWithExit130) {
  int rfd = -1;
  const pid_t pid = spawn_blocking_stream(&rfd, temp_path("sigint2_err"));
  ASSERT_GT(pid, 0);
  char buf[512];
  ASSERT_GT(read(rfd, buf, sizeof buf), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // blocked in write by now
  kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(pid, SIGINT);
  int st = 0;
  waitpid(pid, &st, 0);  // no reading: only the second signal can end it
  close(rfd);
  ASSERT_TRUE(WIFEXITED(st)) << "killed by a signal";
  EXPECT_EQ(WEXITSTATUS(st), 130);
}

TEST(Cli, SigintStopsWithPartialStatsAndExit130) {
  const std::string err = temp_path("sigint_err");
  int rfd = -1;
  const pid_t pid = spawn_blocking_stream(&rfd, err);
  ASSERT_GT(pid, 0);
  char buf[512];
  ASSERT_GT(read(rfd, buf, sizeof buf), 0);  // generation has started
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(pid, SIGINT);
  std::string out(buf, 0);
  for (ssize_t n; (n = read(rfd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(rfd);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << "killed by a signal";
  EXPECT_EQ(WEXITSTATUS(st), 130);
  const std::string e = slurp(err);
  EXPECT_NE(e.find("| generated "), std::string::npos) << e;
  EXPECT_NE(e.find("interrupted"), std::string::npos) << e;
  EXPECT_NE(out.find("{\"event\": \"final\""), std::string::npos);
  EXPECT_EQ(out.find("\"index\": 999"), std::string::npos);  // stopped before the budget
}

}  // namespace
