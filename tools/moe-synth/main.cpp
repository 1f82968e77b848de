// moe-synth: command line. Flags are a contract (issue 6): scripts and tests use them.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <thread>

#include "moe/error.hpp"
#include "synth.hpp"

namespace {

using moe::Error;
using moe::Exit;
namespace fs = std::filesystem;

struct Preset {
  synth::Geometry g;
  uint32_t vocab_size;  // ordinary tokens kept from a vocabulary file; 0 = all
};

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = [] {
    std::map<std::string, Preset> m;
    // The fixture model's shape (tests/data/FIXTURES.md).
    m["tiny"] = Preset{synth::Geometry{}, 4096};
    synth::Geometry big;
    big.n_layer = 48;
    big.n_embd = 2048;
    big.n_head = 32;
    big.n_head_kv = 4;
    big.head_dim = 128;
    big.n_expert = 128;
    big.n_expert_used = 8;
    big.expert_ffn = 768;
    big.context_length = 40960;
    m["qwen3-30b-a3b"] = Preset{big, 0};
    return m;
  }();
  return p;
}

// The Qwen2 vocabulary of the test data, looked up from the working directory and from the binary's
// place in a build tree; a synthetic vocabulary when neither exists.
std::string default_vocab() {
  std::vector<fs::path> candidates = {"tests/data/ggml-vocab-qwen2.gguf"};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / "../../tests/data/ggml-vocab-qwen2.gguf");
    candidates.push_back(exe.parent_path() / "../tests/data/ggml-vocab-qwen2.gguf");
  }
  for (const auto& c : candidates)
    if (fs::is_regular_file(c, ec)) return fs::weakly_canonical(c, ec).string();
  return "";
}

void check_geometry(const synth::Geometry& g) {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw Error(Exit::usage, what);
  };
  need(g.n_layer >= 1 && g.n_layer <= 512, "--layers must be in [1, 512]");
  need(g.n_embd >= 1, "--embd must be positive");
  need(g.n_head >= 1 && g.n_head_kv >= 1, "--heads and --kv-heads must be positive");
  need(g.n_head % g.n_head_kv == 0, "--heads must be a multiple of --kv-heads");
  need(g.head_dim >= 2 && g.head_dim % 2 == 0, "--head-dim must be even (RoPE rotates pairs)");
  need(g.n_expert >= 1 && g.n_expert <= 1024, "--experts must be in [1, 1024]");
  need(g.n_expert_used >= 1 && g.n_expert_used <= g.n_expert, "--experts-used must be in [1, --experts]");
  need(g.expert_ffn >= 1, "--expert-ffn must be positive");
  need(g.context_length >= 1, "--context must be positive");
  need(g.rope_base > 0, "--rope-base must be positive");
  need(g.rms_eps > 0, "--eps must be positive");
}

int run(int argc, char** argv) {
  CLI::App app{"moe-synth: write a synthetic qwen3moe GGUF of any geometry"};
  std::string out, preset_name = "tiny", vocab_path, type_name = "q4_k_m";
  std::vector<std::string> override_specs;
  std::optional<uint32_t> layers, embd, heads, kv_heads, head_dim, experts, experts_used, expert_ffn, vocab_size,
      context;
  std::optional<float> rope_base, eps;
  bool tied = false;
  uint64_t seed = 1;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // A later flag wins, so scripts can append to a base command line.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("-o,--output", out, "output GGUF file")->required();
  app.add_option("--preset", preset_name, "geometry defaults: tiny | qwen3-30b-a3b")
      ->check(CLI::IsMember({"tiny", "qwen3-30b-a3b"}));
  app.add_option("--layers", layers, "block_count");
  app.add_option("--embd", embd, "embedding_length");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--kv-heads", kv_heads, "key/value heads");
  app.add_option("--head-dim", head_dim, "head dimension");
  app.add_option("--experts", experts, "experts per layer");
  app.add_option("--experts-used", experts_used, "experts used per token");
  app.add_option("--expert-ffn", expert_ffn, "expert feed-forward length");
  app.add_option("--vocab", vocab_path,
                 "vocabulary GGUF to copy the tokenizer from, or 'synthetic' "
                 "(default: tests/data/ggml-vocab-qwen2.gguf when found, else synthetic)");
  app.add_option("--vocab-size", vocab_size, "keep the first N ordinary tokens (0 = all)");
  app.add_option("--context", context, "context_length");
  app.add_option("--rope-base", rope_base, "rope.freq_base");
  app.add_option("--eps", eps, "RMSNorm epsilon");
  app.add_flag("--tied", tied, "no output.weight: the token embedding is the LM head");
  app.add_option("--type", type_name, "q4_k_m | q5_k_m | q6_k | q8_0 | bf16 | f16 | f32");
  app.add_option("--type-override", override_specs, "REGEX=TYPE: tensors whose name matches get TYPE (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--seed", seed, "weights seed");
  app.add_option("--threads", threads, "worker threads")->check(CLI::Range(1, 1024));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s\n", e.what());
    return static_cast<int>(Exit::usage);
  }

  const Preset& preset = presets().at(preset_name);
  synth::Geometry g = preset.g;
  g.n_layer = layers.value_or(g.n_layer);
  g.n_embd = embd.value_or(g.n_embd);
  g.n_head = heads.value_or(g.n_head);
  g.n_head_kv = kv_heads.value_or(g.n_head_kv);
  g.head_dim = head_dim.value_or(g.head_dim);
  g.n_expert = experts.value_or(g.n_expert);
  g.n_expert_used = experts_used.value_or(g.n_expert_used);
  g.expert_ffn = expert_ffn.value_or(g.expert_ffn);
  g.context_length = context.value_or(g.context_length);
  g.rope_base = rope_base.value_or(g.rope_base);
  g.rms_eps = eps.value_or(g.rms_eps);
  g.tied = tied;
  check_geometry(g);

  const auto mix = synth::parse_mix(type_name);
  if (!mix) throw Error(Exit::usage, fmt::format("--type {}: expected q4_k_m, q5_k_m, q6_k, q8_0, bf16, f16 or f32", type_name));
  std::vector<synth::TypeOverride> overrides;
  for (const auto& spec : override_specs) {
    const size_t eq = spec.rfind('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(Exit::usage, fmt::format("--type-override {}: expected PATTERN=TYPE", spec));
    const auto t = synth::parse_type(spec.substr(eq + 1));
    if (!t) throw Error(Exit::usage, fmt::format("--type-override {}: unknown type '{}'", spec, spec.substr(eq + 1)));
    try {
      overrides.push_back({spec.substr(0, eq), std::regex(spec.substr(0, eq)), *t});
    } catch (const std::regex_error& e) {
      throw Error(Exit::usage, fmt::format("--type-override {}: bad pattern: {}", spec, e.what()));
    }
  }

  if (vocab_path.empty()) vocab_path = default_vocab();
  synth::Vocab vocab;
  if (vocab_path.empty() || vocab_path == "synthetic") {
    vocab = synth::synthetic_vocab(vocab_size.value_or(0));
    vocab_path = "synthetic";
  } else {
    vocab = synth::load_vocab(vocab_path, vocab_size.value_or(preset.vocab_size));
  }
  const auto n_vocab = static_cast<uint32_t>(vocab.tokens.size());

  auto tensors = synth::plan_tensors(g, n_vocab, *mix, overrides);
  synth::WriteOptions opt;
  opt.path = out;
  opt.seed = seed;
  opt.threads = threads;
  opt.progress = ::isatty(STDERR_FILENO) != 0;
  opt.mix = *mix;
  opt.name = fmt::format("moe-synth {} L{} E{} X{}", preset_name, g.n_layer, g.n_embd, g.n_expert);
  const auto st = synth::write_model(g, vocab, tensors, opt);
  std::fprintf(stderr,
               "moe-synth: wrote %s (%s, %u layers, n_embd %u, %u/%u heads of %u, %u experts of %u, %u used, "
               "n_vocab %u from %s, %zu tensors, %.3f GiB) in %.1f s with %d threads\n",
               out.c_str(), synth::mix_name(*mix), g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_dim,
               g.n_expert, g.expert_ffn, g.n_expert_used, n_vocab, vocab_path.c_str(), tensors.size(),
               st.file_bytes / 1073741824.0, st.seconds, threads);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return static_cast<int>(Exit::other);
  }
}
