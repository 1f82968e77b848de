// One generation run: load, prompt, dispatch, prefill, sample/decode loop, outputs.
#include <algorithm>
#include <ostream>

#include <fmt/format.h>

#include "emitter.hpp"
#include "engine.hpp"
#include "internal.hpp"
#include "json.hpp"
#include "moe/error.hpp"
#include "moe/gguf.hpp"
#include "moe/model.hpp"
#include "moe/tokenizer.hpp"

namespace moe::run {

namespace {

struct Timings {
  double load = 0, guard = 0, prefill = 0, decode = 0, ttft = 0;
};

int64_t context_for(const RunConfig& cfg, int64_t n_prompt, int64_t context_length) {
  int64_t n_ctx;
  if (cfg.ctx_size > 0) {
    if (cfg.ctx_size > context_length)
      fail(Exit::resources, "--ctx-size {} exceeds the model's context_length {}", cfg.ctx_size, context_length);
    n_ctx = cfg.ctx_size;
  } else {
    n_ctx = n_prompt + cfg.max_tokens;
    if (n_ctx > context_length)
      fail(Exit::resources,
           "the prompt ({} tokens) plus --max-tokens {} needs a context of {} tokens; the model's context_length is {}",
           n_prompt, cfg.max_tokens, n_ctx, context_length);
  }
  if (n_prompt > n_ctx)
    fail(Exit::resources, "the prompt has {} tokens but the context holds only {} (--ctx-size)", n_prompt, n_ctx);
  return n_ctx;
}

std::string final_object(const RunConfig& cfg, const model::ModelConfig& mc, const BackendReport& br,
                         const std::vector<int32_t>& prompt, const std::vector<int32_t>& tokens,
                         const std::string& text, const std::string& finish, const Timings& t, int64_t n_gen) {
  using namespace json;
  std::string guard = "null";
  if (br.guard_ran) {
    guard = Object()
                .raw("skipped", boolean(br.guard_skipped))
                .raw("positions", num(br.guard_positions))
                .raw("min_cosine", opt_num(br.guard_min_cosine))
                .raw("accepted", boolean(br.guard_accepted))
                .raw("first_bad_pos", opt_int(br.guard_first_bad))
                .raw("ms", num(br.guard_ms))
                .done();
  }
  const double prefill_tps = t.prefill > 0 ? static_cast<double>(prompt.size()) * 1000.0 / t.prefill : 0.0;
  const double decode_tps = (n_gen > 1 && t.decode > 0) ? static_cast<double>(n_gen - 1) * 1000.0 / t.decode : 0.0;
  return Object()
      .str("model", cfg.model_path)
      .str("arch", mc.arch)
      .raw("backend", Object()
                          .str("requested", br.requested)
                          .str("ran", br.ran)
                          .raw("fell_back", boolean(br.fell_back))
                          .raw("reason", opt_str(br.reason))
                          .raw("device", opt_str(br.device))
                          .done())
      .raw("guard", guard)
      .raw("prompt_tokens", ids(prompt))
      .raw("tokens", ids(tokens))
      .str("text", text)
      .str("finish_reason", finish)
      .raw("timings", Object()
                          .raw("load_ms", num(t.load))
                          .raw("guard_ms", num(t.guard))
                          .raw("prefill_ms", num(t.prefill))
                          .raw("decode_ms", num(t.decode))
                          .raw("ttft_ms", num(t.ttft))
                          .raw("prefill_tok_s", num(prefill_tps))
                          .raw("decode_tok_s", num(decode_tps))
                          .done())
      .raw("memory", Object()
                         .raw("peak_rss_mib", num(peak_rss_mib()))
                         .raw("vram_mib", num(static_cast<int64_t>(br.vram_mib)))
                         .done())
      .done();
}

}  // namespace

int generate(const RunConfig& cfg, const Backends& backends, std::ostream& out, std::ostream& err) {
  const auto t_start = Clock::now();
  auto file = gguf::File::open(cfg.model_path);
  auto model = model::OwnedQuantizedModel::load(file);
  const auto& mc = model->config;
  auto tokenizer = tok::Tokenizer::from_gguf(*file);
  if (cfg.verbose) write_summary(*file, err);

  const PreparedPrompt pp = prepare_prompt(cfg, &tokenizer, mc.n_vocab);
  const std::vector<int32_t>& prompt = pp.ids;
  if (cfg.verbose) {
    err << fmt::format("[verbose] chat template applied: {}\n", pp.templated ? "yes" : "no");
    if (!cfg.prompt_tokens) err << "[verbose] formatted prompt: " << json::quote(pp.text) << '\n';
    err << fmt::format("[verbose] {} prompt tokens: {}\n", prompt.size(), json::ids(prompt));
  }
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  const int64_t n_ctx = context_for(cfg, n_prompt, mc.context_length);
  const int n_threads = cfg.threads > 0 ? cfg.threads : default_threads();
  quant::ThreadPool pool(n_threads);

  Engine engine(cfg, backends, model, pool, n_threads, n_ctx, err);
  engine.start(prompt);
  Timings t;
  const auto t_loaded = Clock::now();
  const BackendReport& br = engine.report();
  t.guard = br.guard_ms;
  // Building the serving forward (GPU upload included) is loading; the guard is timed on its own.
  t.load = ms_between(t_start, t_loaded) - t.guard;

  Emitter emit(tokenizer, cfg.output, cfg.stops, out);
  const bool dump = !cfg.dump_logits.empty();
  const int64_t nv = mc.n_vocab;
  std::vector<float> dumped;
  std::vector<float> logits;
  std::vector<int32_t> history = prompt;
  std::vector<int32_t> generated;
  std::string finish = "length";
  // A SIGINT during loading skips the prefill too.
  bool interrupted = interrupt_requested();

  Sampler sampler(cfg.sampler);
  // Plain greedy decoding on the GPU keeps the logits on the device (only the argmax comes back);
  // any logit-dependent feature (a repeat penalty, sampling, dumps) takes the full row.
  const bool device_greedy = sampler.greedy() && !dump &&
                             (cfg.sampler.repeat_penalty == 1.0f || cfg.sampler.repeat_last_n == 0);
  // Sampling (or greedy with a repeat penalty) likewise where the GPU draws the token itself (top-k 1..128); its
  // graph is captured before the prefill, outside the decode's timing.
  const bool device_sample = !device_greedy && !dump && engine.samples_on_device(cfg.sampler);
  if (device_sample && !interrupted) engine.prepare_sample(cfg.sampler);

  const auto t_prefill = Clock::now();
  if (!interrupted) {
    engine.eval(prompt, history, dump, logits);
    if (dump) dumped.insert(dumped.end(), logits.begin(), logits.end());
  }
  const auto t_prefilled = Clock::now();
  t.prefill = ms_between(t_prefill, t_prefilled);
  Clock::time_point t_first = t_prefilled, t_last = t_prefilled;

  const size_t last_row = dump ? static_cast<size_t>((n_prompt - 1) * nv) : 0;
  std::span<float> row(logits.data() + (interrupted ? 0 : last_row), interrupted ? 0 : static_cast<size_t>(nv));
  int32_t next = -1;  // the next token when the device already picked it
  while (!interrupted && static_cast<int64_t>(generated.size()) < cfg.max_tokens) {
    if (interrupt_requested()) {
      interrupted = true;
      break;
    }
    const int32_t id = next >= 0 ? next : sampler.sample(row, history);
    generated.push_back(id);
    history.push_back(id);
    t_last = Clock::now();
    if (generated.size() == 1) t_first = t_last;
    const bool eog = tokenizer.is_eog(id);
    // Known before the text is released: the budget, the context or an end token ends the run here.
    const bool last = eog || static_cast<int64_t>(generated.size()) >= cfg.max_tokens || engine.n_past() >= n_ctx;
    const bool stop = emit.push(id, eog, static_cast<int64_t>(generated.size()) - 1, last);
    if (emit.broken()) return 0;  // stdout is gone (e.g. `| head -c 10`): end quietly
    if (eog || stop) {
      finish = "stop";
      break;
    }
    if (static_cast<int64_t>(generated.size()) >= cfg.max_tokens) break;
    if (engine.n_past() >= n_ctx) break;  // end of context
    if (interrupt_requested()) {
      interrupted = true;
      break;
    }
    if (device_greedy && engine.on_gpu()) {
      next = engine.eval_greedy(history.back(), history);
      continue;
    }
    if (device_sample && engine.samples_on_device(cfg.sampler)) {  // false once the GPU is gone, or its sampler
      next = engine.eval_sample(history, sampler);
      continue;
    }
    next = -1;
    engine.eval(std::span<const int32_t>(&history.back(), 1), history, false, logits);
    if (dump) dumped.insert(dumped.end(), logits.begin(), logits.end());
    row = std::span<float>(logits.data(), static_cast<size_t>(nv));
  }
  if (interrupted) finish = "stop";
  emit.finish();
  if (emit.broken()) return 0;
  t.decode = ms_between(t_first, t_last);
  t.ttft = generated.empty() ? t.guard + t.prefill : t.guard + ms_between(t_prefill, t_first);

  if (dump) write_npy(cfg.dump_logits, dumped, static_cast<int64_t>(dumped.size()) / nv, nv);

  const int64_t n_gen = static_cast<int64_t>(generated.size());
  if (cfg.output == OutputMode::text) {
    out << '\n';
    out.flush();
  } else {
    const std::string obj = final_object(cfg, mc, br, prompt, generated, emit.text(), finish, t, n_gen);
    if (cfg.output == OutputMode::stream) out << R"({"event": "final", )" << obj.substr(1) << '\n';
    else out << obj << '\n';
    out.flush();
  }
  if (!out) return 0;
  if (!cfg.quiet) {
    const double ptps = t.prefill > 0 ? static_cast<double>(n_prompt) * 1000.0 / t.prefill : 0.0;
    const double dtps = (n_gen > 1 && t.decode > 0) ? static_cast<double>(n_gen - 1) * 1000.0 / t.decode : 0.0;
    err << fmt::format("prompt {} tok in {:.1f} ms ({:.1f} tok/s) | generated {} tok in {:.1f} ms ({:.1f} tok/s) | backend {}\n",
                       n_prompt, t.prefill, ptps, n_gen, t.decode, dtps, engine.on_gpu() ? "cuda" : "cpu");
    if (cfg.verbose)
      err << fmt::format("[verbose] load {:.1f} ms | guard {:.1f} ms | prefill {:.1f} ms | decode {:.1f} ms | "
                         "ttft {:.1f} ms | peak RSS {:.1f} MiB\n",
                         t.load, t.guard, t.prefill, t.decode, t.ttft, peak_rss_mib());
    if (interrupted) err << "interrupted: generation stopped after " << n_gen << " tokens\n";
  }
  return interrupted ? static_cast<int>(Exit::interrupted) : 0;
}

}  // namespace moe::run
