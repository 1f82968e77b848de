// Hardening of the moe-run binary against hostile inputs and environments (issue 9): resource
// limits are computed and checked before allocating (exit 6 with the numbers), sizes claimed by a
// file are checked against the file before anything is allocated from them, absurd hyperparameters
// are refused, unusable paths exit 3, and a closed stdout ends the run quietly. Every case must end
// with the documented exit code and one `error:` line, never a signal.
#include <gtest/gtest.h>

#include "test_util.hpp"

#include <fcntl.h>
#include <pwd.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gguf_image.hpp"

extern char** environ;

namespace {

const std::string kBin = std::string(MOE_BIN_DIR) + "/moe-run";
const std::string kData = MOE_TEST_DATA;
const std::string kTiny = kData + "/tiny-qwen3moe-q8_0.gguf";

struct Proc {
  int status = -1;  // exit code; -1 when ended by a signal
  int signal = 0;
  std::string out, err;
  int error_lines() const {
    int n = 0;
    std::istringstream is(err);
    for (std::string l; std::getline(is, l);) n += l.rfind("error: ", 0) == 0;
    return n;
  }
};

using test_util::slurp;

std::string temp_path(const std::string& name) { return test_util::temp_path("moe_hardening_", name); }

// Runs argv (stdin /dev/null, stdout/stderr captured through files). With run_as_uid >= 0 the
// child drops to that user first (root reads any file, so unreadability is tested as another user).
Proc run(std::vector<std::string> args, int run_as_uid = -1) {
  const std::string out = temp_path("stdout"), err = temp_path("stderr");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Proc p;
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork failed";
    return p;
  }
  if (pid == 0) {
    const int in = open("/dev/null", O_RDONLY);
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (in < 0 || o < 0 || e < 0) _exit(120);
    dup2(in, 0);
    dup2(o, 1);
    dup2(e, 2);
    if (run_as_uid >= 0 && (setgid(static_cast<gid_t>(run_as_uid)) != 0 || setuid(static_cast<uid_t>(run_as_uid)) != 0))
      _exit(121);
    execve(argv[0], argv.data(), environ);
    _exit(122);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  if (WIFEXITED(st)) p.status = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) p.signal = WTERMSIG(st);
  p.out = slurp(out);
  p.err = slurp(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  return p;
}

Proc moe(std::vector<std::string> args) {
  args.insert(args.begin(), kBin);
  return run(std::move(args));
}

void expect_exit(const Proc& p, int code, const std::vector<std::string>& needles = {}) {
  EXPECT_EQ(p.signal, 0) << "killed by a signal\n" << p.err;
  EXPECT_EQ(p.status, code) << p.err;
  EXPECT_EQ(p.error_lines(), 1) << p.err;
  for (const auto& n : needles) EXPECT_NE(p.err.find(n), std::string::npos) << "'" << n << "' missing in: " << p.err;
}

// A rejected model file: exit 4 (corrupt) or 5 (unsupported), one error line, no signal, and
// never exit 6, which would mean something was allocated from the claimed size first.
void expect_refused(const Proc& p, const std::string& needle) {
  EXPECT_EQ(p.signal, 0) << "killed by a signal\n" << p.err;
  EXPECT_TRUE(p.status == 4 || p.status == 5) << "exit " << p.status << ": " << p.err;
  EXPECT_EQ(p.error_lines(), 1) << p.err;
  EXPECT_NE(p.err.find(needle), std::string::npos) << "'" << needle << "' missing in: " << p.err;
}

gguf_test::Image tiny() { return gguf_test::Image::read(gguf_test::read_file(kTiny)); }

// Temporary files are removed when the test process ends.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    for (const auto& p : paths) std::remove(p.c_str());
  }
} g_temp;

std::string save(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = temp_path(name);
  g_temp.paths.push_back(path);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
  return path;
}

// ---- resource limits ------------------------------------------------------------------------------

TEST(Limits, ContextBeyondTheModelExit6WithTheNumbers) {
  expect_exit(moe({kTiny, "--ctx-size", "1000000000", "-p", "hi", "--no-gpu"}), 6, {"1000000000", "1024"});
  expect_exit(moe({kTiny, "--ctx-size", "2147483647", "-p", "hi", "--no-gpu"}), 6, {"2147483647", "1024"});
}

TEST(Limits, KvCacheAndScratchAreCheckedBeforeAllocating) {
  // A model that allows a context of two billion positions: the KV cache alone would take
  // 2 (K,V) * 2 bytes * 2 layers * 2e9 * 128 = 2 TB, which no test machine has. The run must say
  // so with the numbers instead of failing an allocation or being killed.
  auto img = tiny();
  img.set_u32("qwen3moe.context_length", 2000000000u);
  const std::string path = save("huge_ctx.gguf", img.write());
  const Proc p = moe({path, "--ctx-size", "2000000000", "-p", "hi", "--no-gpu", "--threads", "1"});
  expect_exit(p, 6, {"MiB", "2000000000"});
  EXPECT_EQ(p.err.find("out of memory"), std::string::npos) << p.err;
}

// ---- sizes claimed by the file ---------------------------------------------------------------------

TEST(Limits, VocabularyCountClaimedByTheHeaderIsCheckedAgainstTheFile) {
  for (uint64_t count : {uint64_t{1} << 31, uint64_t{1} << 62, ~uint64_t{0}}) {
    auto img = tiny();
    gguf_test::Kv* kv = img.find("tokenizer.ggml.tokens");
    ASSERT_NE(kv, nullptr);
    gguf_test::poke<uint64_t>(kv->value, 4, count);  // after the u32 element type
    const std::string path = save("huge_vocab.gguf", img.write());
    expect_refused(moe({path, "-p", "hi", "--no-gpu"}), "tokenizer.ggml.tokens");
  }
}

TEST(Limits, HeaderCountsAndStringLengthsAreCheckedAgainstTheFile) {
  const auto bytes = gguf_test::read_file(kTiny);
  auto many_tensors = bytes;
  gguf_test::poke<uint64_t>(many_tensors, 8, uint64_t{1} << 40);
  expect_refused(moe({save("many_tensors.gguf", many_tensors), "-p", "hi", "--no-gpu"}), "tensors");
  auto many_kvs = bytes;
  gguf_test::poke<uint64_t>(many_kvs, 16, uint64_t{1} << 40);
  expect_refused(moe({save("many_kvs.gguf", many_kvs), "-p", "hi", "--no-gpu"}), "metadata");
  auto long_key = bytes;
  gguf_test::poke<uint64_t>(long_key, 24, uint64_t{1} << 60);  // length of the first key
  expect_refused(moe({save("long_key.gguf", long_key), "-p", "hi", "--no-gpu"}), "offset");
}

TEST(Limits, TensorsBeyondTheFileAreRefusedBeforeUse) {
  {
    auto img = tiny();
    auto* t = img.tensor("blk.1.ffn_down_exps.weight");
    ASSERT_NE(t, nullptr);
    t->offset = img.data.size() + 4096;  // aligned, same file size
    t->offset -= t->offset % 32;
    expect_refused(moe({save("tensor_past_end.gguf", img.write()), "-p", "hi", "--no-gpu"}),
                   "blk.1.ffn_down_exps.weight");
  }
  {
    auto img = tiny();
    auto* t = img.tensor("token_embd.weight");
    ASSERT_NE(t, nullptr);
    t->ne[1] = int64_t{1} << 40;  // a vocabulary of 2^40 rows claimed by the shape
    expect_refused(moe({save("huge_shape.gguf", img.write()), "-p", "hi", "--no-gpu"}), "token_embd.weight");
  }
  {
    // The file cut inside the last tensor's data.
    auto bytes = gguf_test::read_file(kTiny);
    bytes.resize(bytes.size() - 1000);
    expect_refused(moe({save("cut.gguf", bytes), "-p", "hi", "--no-gpu"}), "tensor");
  }
}

TEST(Limits, AbsurdHyperparametersAreRefused) {
  // The message names the key, or the tensor whose shape contradicts it.
  struct Case {
    const char* key;
    uint32_t value;
    const char* names;
  };
  for (const Case c : {Case{"qwen3moe.block_count", 0x7fffffffu, "block_count"},
                       Case{"qwen3moe.block_count", 0u, "block_count"},
                       Case{"qwen3moe.embedding_length", 0x80000000u, "token_embd.weight"},
                       Case{"qwen3moe.embedding_length", 0u, "embedding_length"},
                       Case{"qwen3moe.attention.head_count", 0u, "head_count"},
                       Case{"qwen3moe.attention.head_count", 0xffffffffu, "head_count"},
                       Case{"qwen3moe.attention.head_count_kv", 0u, "head_count_kv"},
                       Case{"qwen3moe.attention.key_length", 0u, "key_length"},
                       Case{"qwen3moe.attention.key_length", 0x40000000u, "key length 1073741824"},
                       Case{"qwen3moe.expert_count", 0x80000000u, "expert_count"},
                       Case{"qwen3moe.expert_count", 0u, "expert_count"},
                       Case{"qwen3moe.expert_used_count", 0u, "expert_used_count"},
                       Case{"qwen3moe.expert_used_count", 9u, "expert_used_count"},
                       Case{"qwen3moe.expert_feed_forward_length", 0x40000000u, "ffn_gate_exps"},
                       Case{"qwen3moe.context_length", 0u, "context_length"}}) {
    SCOPED_TRACE(std::string(c.key) + " = " + std::to_string(c.value));
    auto img = tiny();
    img.set_u32(c.key, c.value);
    expect_refused(moe({save("hparam.gguf", img.write()), "-p", "hi", "--no-gpu"}), c.names);
  }
}

// ---- paths -------------------------------------------------------------------------------------------

TEST(Paths, MissingDirectoryAndNotADirectoryExit3) {
  expect_exit(moe({kData + "/no-such.gguf", "-p", "hi"}), 3, {"no-such.gguf"});
  expect_exit(moe({kData, "-p", "hi"}), 3, {kData});
  expect_exit(moe({kTiny + "/inner.gguf", "-p", "hi"}), 3, {"inner.gguf"});
}

TEST(Paths, UnreadableFileExit3) {
  const std::string locked = temp_path("locked.gguf");
  g_temp.paths.push_back(locked);
  {
    const auto bytes = gguf_test::read_file(kTiny);
    std::ofstream(locked, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), 4096);
  }
  ASSERT_EQ(chmod(locked.c_str(), 0), 0);
  if (geteuid() != 0) {
    expect_exit(moe({locked, "-p", "hi"}), 3, {"locked.gguf"});
    return;
  }
  // Root reads any file: run as 'nobody', who can execute moe-run but not read the file.
  const passwd* nobody = getpwnam("nobody");
  if (!nobody) GTEST_SKIP() << "running as root and there is no user 'nobody'";
  const Proc p = run({kBin, locked, "-p", "hi"}, static_cast<int>(nobody->pw_uid));
  if (p.status == 122 || p.status == 121 || p.status == 120)
    GTEST_SKIP() << "'nobody' cannot run " << kBin << " here (exit " << p.status << ")";
  expect_exit(p, 3, {"locked.gguf"});
}

// ---- process behaviour ---------------------------------------------------------------------------------

TEST(Process, ClosedStdoutEndsQuietlyWithTheBannerOn) {
  // Not quiet: stats and banners still go to stderr, and the closed pipe adds no noise to them.
  for (const char* extra : {"", "--stream"}) {
    const std::string errf = temp_path("pipe_err");
    g_temp.paths.push_back(errf);
    const std::string cmd = "'" + kBin + "' '" + kTiny + "' --prompt-tokens 1,2,3 -n 600 --ctx-size 700 --no-gpu " +
                            "--threads 1 " + extra + " 2>'" + errf + "' | head -c 10 >/dev/null; echo ${PIPESTATUS[0]}";
    const Proc p = run({"/bin/bash", "-c", cmd});
    EXPECT_EQ(p.out, "0\n") << extra;
    const std::string e = slurp(errf);
    EXPECT_EQ(e.find("Broken pipe"), std::string::npos) << e;
    EXPECT_EQ(e.find("error"), std::string::npos) << e;
  }
}

}  // namespace
