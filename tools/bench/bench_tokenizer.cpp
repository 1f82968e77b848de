// Encode throughput of the Qwen2 tokenizer on one core: English prose (the license texts Debian
// ships in /usr/share/common-licenses) and C++ code (this repository's src/ and include/).
// Run: build/bin/bench_tokenizer [--benchmark_filter=...]; MB/s is reported as bytes_per_second.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moe/gguf.hpp"
#include "moe/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = fs::path(__FILE__).parent_path().parent_path().parent_path();

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every regular file under `dir` whose extension is in `exts` (all files when empty), sorted by
// path so that the corpus is the same from run to run.
std::string corpus(const fs::path& dir, const std::vector<std::string>& exts) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const auto ext = it->path().extension().string();
    if (exts.empty() || std::find(exts.begin(), exts.end(), ext) != exts.end()) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  std::string all;
  for (const auto& f : files) all += read_file(f);
  return all;
}

const moe::tok::Tokenizer& tokenizer() {
  static const moe::tok::Tokenizer tok = [] {
    const auto f = moe::gguf::File::open((kRepo / "tests/data/ggml-vocab-qwen2.gguf").string());
    return moe::tok::Tokenizer::from_gguf(*f);
  }();
  return tok;
}

const std::string& prose() {
  static const std::string s = corpus("/usr/share/common-licenses", {});
  return s;
}

const std::string& code() {
  static const std::string s = [] {
    return corpus(kRepo / "src", {".cpp", ".hpp", ".cu", ".h"}) + corpus(kRepo / "include", {".hpp"});
  }();
  return s;
}

// The whole text in one encode call (the per-call word cache sees the whole corpus).
void run_whole(benchmark::State& state, const std::string& text) {
  if (text.empty()) {
    state.SkipWithError("corpus not found");
    return;
  }
  const auto& tok = tokenizer();
  size_t n_tokens = 0;
  for (auto _ : state) {
    auto ids = tok.encode(text);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.counters["corpus_bytes"] = double(text.size());
  state.counters["tokens"] = double(n_tokens);
}

// The same text cut into prompt-sized chunks, each its own encode call (little cache reuse).
void run_chunks(benchmark::State& state, const std::string& text) {
  if (text.empty()) {
    state.SkipWithError("corpus not found");
    return;
  }
  const auto& tok = tokenizer();
  const size_t chunk = size_t(state.range(0));
  for (auto _ : state) {
    for (size_t at = 0; at < text.size(); at += chunk) {
      auto ids = tok.encode(std::string_view(text).substr(at, chunk));
      benchmark::DoNotOptimize(ids.data());
    }
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
}

void BM_EncodeProse(benchmark::State& s) { run_whole(s, prose()); }
void BM_EncodeCode(benchmark::State& s) { run_whole(s, code()); }
void BM_EncodeProseChunks(benchmark::State& s) { run_chunks(s, prose()); }
void BM_EncodeCodeChunks(benchmark::State& s) { run_chunks(s, code()); }

void BM_Decode(benchmark::State& state) {
  const auto& tok = tokenizer();
  const auto ids = tok.encode(prose());
  for (auto _ : state) {
    auto s = tok.decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(prose().size()));
}

void BM_Load(benchmark::State& state) {
  const auto f = moe::gguf::File::open((kRepo / "tests/data/ggml-vocab-qwen2.gguf").string());
  for (auto _ : state) {
    auto tok = moe::tok::Tokenizer::from_gguf(*f);
    benchmark::DoNotOptimize(&tok);
  }
}

}  // namespace

BENCHMARK(BM_EncodeProse)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCode)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeProseChunks)->Arg(256)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCodeChunks)->Arg(256)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
