#include "options.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "moe/error.hpp"
#include "moe/guard.hpp"

namespace moe::cli {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string read_input(const std::string& path) {
  if (path == "-") {
    std::ostringstream ss;
    ss << std::cin.rdbuf();
    return ss.str();
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(Exit::usage, "-i {}: cannot read the prompt file: {}", path, std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) fail(Exit::usage, "-i {}: cannot read the prompt file", path);
  return s;
}

constexpr const char* kFooter = R"(Sampling order: repeat penalty -> (greedy if T = 0 or K = 1: argmax, lowest id on ties)
  -> temperature -> top-k -> top-p -> min-p -> draw. The draw uses std::mt19937 seeded with --seed
  and std::uniform_real_distribution<double>: the same seed and flags give the same tokens on the
  same backend; greedy never touches the RNG.
Environment:
  SKIP_PARITY_GATE=1   skip the F2 guard (a line says nothing was compared)
  MOE_FAULT=...        make the GPU path fail, to test the CPU fallback (--gpu: exit 14):
      gpu-init           CUDA initialization fails
      gpu-nan            every GPU logits row carries a NaN (the guard rejects it)
      gpu-perturb        GPU logits become noise of the same scale (the guard rejects it)
      gpu-kernel         a kernel fails mid-generation, after the guard accepted
  MOE_FAKE_GPU=1       (tests) a fast-mode CPU forward poses as the GPU
  MOE_ISA=scalar|avx2|avx512  cap the CPU SIMD level
Exit codes: 0 ok, 1 other, 2 usage, 3 model not found/unreadable, 4 not GGUF/corrupt,
  5 unsupported model, 6 resources/context, 8 inference failed, 9 --gpu without CUDA,
  14 --gpu and the GPU could not serve, 130 interrupted.)";

}  // namespace

int64_t parse_int(std::string_view flag, std::string_view text, int64_t lo, int64_t hi) {
  const std::string_view t = trim(text);
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || p != t.data() + t.size())
    fail(Exit::usage, "{} {}: not an integer", flag, text);
  if (v < lo || v > hi) fail(Exit::usage, "{} {}: must be between {} and {}", flag, text, lo, hi);
  return v;
}

double parse_float(std::string_view flag, std::string_view text, double lo, double hi) {
  const std::string s(trim(text));
  if (s.empty()) fail(Exit::usage, "{} '{}': not a number", flag, text);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v))
    fail(Exit::usage, "{} {}: not a finite number", flag, text);
  if (v < lo || v > hi) fail(Exit::usage, "{} {}: must be between {} and {}", flag, text, lo, hi);
  return v;
}

std::vector<int32_t> parse_ids(std::string_view flag, std::string_view text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    ids.push_back(static_cast<int32_t>(parse_int(flag, text.substr(start, comma - start), 0, INT32_MAX)));
    start = comma + 1;
  }
  if (ids.empty()) fail(Exit::usage, "{}: no token ids", flag);
  return ids;
}

std::optional<int> parse(int argc, const char* const* argv, Request& req, std::ostream& out) {
  CLI::App app{"moe-run: run a Qwen3-MoE GGUF model (CUDA first, checked by the F2 guard; CPU fallback)", "moe-run"};
  app.footer(kFooter);
  auto& c = req.cfg;
  std::string prompt_pos, prompt_flag, input, prompt_tokens, thinking, format, cpu_mode;
  std::string n_s, temp_s, topk_s, topp_s, minp_s, rp_s, rln_s, seed_s, ctx_s, dev_s, thr_s;
  bool chat = false, raw = false, no_gpu = false, gpu = false, json = false, stream = false, version = false;
  bool inspect = false, tokenize = false;

  app.add_option("MODEL", c.model_path, "GGUF model file")->type_name("MODEL.gguf");
  app.add_option("PROMPT", prompt_pos, "prompt text (or use -p / -i)");
  // Input
  app.add_option("-p,--prompt", prompt_flag, "the prompt text");
  app.add_option("-i,--input", input, "read the prompt from FILE (- = stdin)")->type_name("FILE");
  app.add_option("--prompt-tokens", prompt_tokens, "feed these token ids (ID,ID,...): no template, no BOS")->type_name("ID,ID,...");
  app.add_flag("--chat", chat, "force the chat template");
  app.add_flag("--raw", raw, "never apply the chat template");
  app.add_option("--system", c.system, "system message (with the chat template)");
  app.add_option("--thinking", thinking, "Qwen3 thinking mode: on|off (default off)")->type_name("on|off");
  // Generation
  app.add_option("-n,--max-tokens", n_s, "tokens to generate (default 32; 0 = evaluate the prompt only)")->type_name("N");
  app.add_option("--temperature", temp_s, "sampling temperature (default 0 = greedy)")->type_name("T");
  app.add_option("--top-k", topk_s, "top-k (default 40 when T > 0; 1 = greedy, 0 = off)")->type_name("K");
  app.add_option("--top-p", topp_s, "nucleus sampling p in [0, 1] (default 1 = off)")->type_name("P");
  app.add_option("--min-p", minp_s, "min-p in [0, 1] (default 0 = off)")->type_name("P");
  app.add_option("--repeat-penalty", rp_s, "repeat penalty (default 1 = off)")->type_name("R");
  app.add_option("--repeat-last-n", rln_s, "window of the repeat penalty (default 64, prompt included)")->type_name("N");
  app.add_option("--seed", seed_s, "RNG seed, 0..4294967295 (default 299792458; std::mt19937)")->type_name("S");
  app.add_option("--ctx-size", ctx_s, "KV-cache length (default prompt + max-tokens)")->type_name("N");
  app.add_option("--stop", c.stops, "extra stop string (repeatable)")->allow_extra_args(false);
  // Backend
  app.add_flag("--no-gpu,--cpu", no_gpu, "CPU only; CUDA is never initialised");
  app.add_flag("--gpu", gpu, "the GPU must serve (exit 14 otherwise)");
  app.add_option("--device", dev_s, "CUDA device index (default 0)")->type_name("N");
  app.add_option("--threads", thr_s, "CPU threads (default: all online CPUs)")->type_name("N");
  app.add_option("--cpu-mode", cpu_mode, "debug: CPU activations, fast (Q8, default) or exact (FP32)")->type_name("fast|exact");
  // Output
  app.add_flag("--json", json, "one JSON object on stdout at the end");
  app.add_option("-f,--format", format, "output format: text|json")->type_name("text|json");
  app.add_flag("--stream", stream, "NDJSON token events, then the final object");
  app.add_flag("-q,--quiet", c.quiet, "no banner or stats lines");
  app.add_flag("-v,--verbose", c.verbose, "model summary, template/tokenization details, timings");
  app.add_flag("--inspect", inspect, "print the model summary and exit");
  app.add_flag("--tokenize", tokenize, "print the prompt's token ids as a JSON array and exit");
  app.add_option("--dump-logits", c.dump_logits, "write every evaluated position's logits to FILE.npy")->type_name("FILE.npy");
  app.add_flag("--version", version, "print the version and exit");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    fail(Exit::usage, "{}", e.what());
  }
  if (version) {
    out << fmt::format("moe-run {} (git {}, CUDA {})\n", MOE_VERSION, MOE_GIT_HASH, run::build_has_cuda() ? "on" : "off");
    return 0;
  }

  auto given = [&](const char* name) { return app.count(name) > 0; };
  if (c.model_path.empty()) fail(Exit::usage, "MODEL is required (moe-run MODEL.gguf [PROMPT] [options]; --help)");
  // Input
  const int n_inputs = given("PROMPT") + given("--prompt") + given("--input") + given("--prompt-tokens");
  if (n_inputs > 1) fail(Exit::usage, "give the prompt once: PROMPT, -p/--prompt, -i/--input or --prompt-tokens");
  if (given("PROMPT")) c.prompt = prompt_pos;
  if (given("--prompt")) c.prompt = prompt_flag;
  if (given("--prompt-tokens")) c.prompt_tokens = parse_ids("--prompt-tokens", prompt_tokens);
  if (chat && raw) fail(Exit::usage, "--chat and --raw contradict each other");
  c.template_mode = chat ? run::TemplateMode::chat : raw ? run::TemplateMode::raw : run::TemplateMode::automatic;
  if (c.prompt_tokens && (chat || c.system || given("--thinking")))
    fail(Exit::usage, "--prompt-tokens feeds ids directly: --chat, --system and --thinking do not apply");
  if (given("--thinking")) {
    if (thinking == "on") c.thinking = true;
    else if (thinking == "off") c.thinking = false;
    else fail(Exit::usage, "--thinking {}: expected on or off", thinking);
  }
  // Generation
  auto& s = c.sampler;
  if (given("--max-tokens")) c.max_tokens = parse_int("--max-tokens", n_s, 0, int64_t{1} << 24);
  if (given("--temperature")) s.temperature = static_cast<float>(parse_float("--temperature", temp_s, 0.0, 1e6));
  if (given("--top-k")) s.top_k = static_cast<int32_t>(parse_int("--top-k", topk_s, 0, INT32_MAX));
  if (given("--top-p")) s.top_p = static_cast<float>(parse_float("--top-p", topp_s, 0.0, 1.0));
  if (given("--min-p")) s.min_p = static_cast<float>(parse_float("--min-p", minp_s, 0.0, 1.0));
  if (given("--repeat-penalty")) {
    s.repeat_penalty = static_cast<float>(parse_float("--repeat-penalty", rp_s, 0.0, 1e6));
    if (s.repeat_penalty <= 0) fail(Exit::usage, "--repeat-penalty {}: must be greater than 0", rp_s);
  }
  if (given("--repeat-last-n")) s.repeat_last_n = static_cast<int32_t>(parse_int("--repeat-last-n", rln_s, 0, INT32_MAX));
  if (given("--seed")) s.seed = static_cast<uint32_t>(parse_int("--seed", seed_s, 0, UINT32_MAX));
  if (given("--ctx-size")) c.ctx_size = parse_int("--ctx-size", ctx_s, 1, INT32_MAX);
  // Backend
  if (gpu && no_gpu) fail(Exit::usage, "--gpu and --no-gpu/--cpu contradict each other");
  c.backend = gpu ? run::Requested::gpu : no_gpu ? run::Requested::cpu : run::Requested::automatic;
  if (given("--device")) c.device = static_cast<int>(parse_int("--device", dev_s, 0, 1023));
  if (given("--threads")) c.threads = static_cast<int>(parse_int("--threads", thr_s, 1, 4096));
  if (given("--cpu-mode")) {
    if (cpu_mode == "fast") c.cpu_mode = quant::ActMode::fast;
    else if (cpu_mode == "exact") c.cpu_mode = quant::ActMode::exact;
    else fail(Exit::usage, "--cpu-mode {}: expected fast or exact", cpu_mode);
  }
  // Output
  if (given("--format")) {
    if (format == "json") json = true;
    else if (format != "text") fail(Exit::usage, "--format {}: expected text or json", format);
    else if (json) fail(Exit::usage, "--json and --format text contradict each other");
  }
  if (json && stream) fail(Exit::usage, "--json and --stream contradict each other (--stream ends with the JSON object)");
  c.output = stream ? run::OutputMode::stream : json ? run::OutputMode::json : run::OutputMode::text;
  if (c.quiet && c.verbose) fail(Exit::usage, "--quiet and --verbose contradict each other");
  if (inspect && tokenize) fail(Exit::usage, "--inspect and --tokenize contradict each other");
  if (given("--dump-logits") && c.dump_logits.empty()) fail(Exit::usage, "--dump-logits needs a file name");
  req.json = json;
  req.action = inspect ? Action::inspect : tokenize ? Action::tokenize : Action::generate;
  if (req.action == Action::inspect && n_inputs > 0) fail(Exit::usage, "--inspect takes no prompt");
  if (req.action != Action::inspect) {
    if (n_inputs == 0) fail(Exit::usage, "no prompt: give PROMPT, -p/--prompt, -i/--input or --prompt-tokens");
    if (given("--input")) c.prompt = read_input(input);
  }
  return std::nullopt;
}

}  // namespace moe::cli
