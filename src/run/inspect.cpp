// --inspect (model summary) and --tokenize (prompt ids; needs only the vocabulary).
#include <map>
#include <optional>
#include <ostream>

#include <fmt/format.h>

#include "internal.hpp"
#include "json.hpp"
#include "moe/error.hpp"
#include "moe/gguf.hpp"
#include "moe/model.hpp"
#include "moe/tokenizer.hpp"

namespace moe::run {

namespace {

const char* rope_scaling_name(model::RopeScalingType t) {
  switch (t) {
    case model::RopeScalingType::linear: return "linear";
    case model::RopeScalingType::yarn: return "yarn";
    default: return "none";
  }
}

// (name, value) pairs of every hyperparameter, values already JSON-encoded.
std::vector<std::pair<std::string, std::string>> hyperparameters(const model::ModelConfig& c) {
  using json::num;
  return {
      {"n_layer", num(int64_t{c.n_layer})},
      {"n_embd", num(int64_t{c.n_embd})},
      {"n_head", num(int64_t{c.n_head})},
      {"n_head_kv", num(int64_t{c.n_head_kv})},
      {"head_dim", num(int64_t{c.head_dim})},
      {"n_expert", num(int64_t{c.n_expert})},
      {"n_expert_used", num(int64_t{c.n_expert_used})},
      {"expert_ffn", num(int64_t{c.expert_ffn})},
      {"feed_forward_length", num(int64_t{c.feed_forward_length})},
      {"context_length", num(int64_t{c.context_length})},
      {"n_vocab", num(int64_t{c.n_vocab})},
      {"rms_eps", num(static_cast<double>(c.rms_eps))},
      {"rope_base", num(static_cast<double>(c.rope_base))},
      {"rope_scaling", json::quote(rope_scaling_name(c.rope_scaling))},
      {"rope_freq_scale", num(static_cast<double>(c.rope_freq_scale))},
      {"rope_n_ctx_orig", num(int64_t{c.rope_n_ctx_orig})},
      {"rope_attn_factor", num(static_cast<double>(c.rope_attn_factor))},
      {"tied_output", json::boolean(c.tied_output)},
  };
}

struct TensorStats {
  size_t count = 0;
  uint64_t bytes = 0;
  std::map<std::string, size_t> by_type;
};

TensorStats tensor_stats(const gguf::File& f) {
  TensorStats s;
  for (const auto& t : f.tensors()) {
    ++s.count;
    s.bytes += t.nbytes;
    ++s.by_type[gguf::type_name(t.type)];
  }
  return s;
}

std::string architecture(const gguf::File& f) {
  const auto a = f.opt_string("general.architecture");
  return a ? std::string(*a) : std::string("(none)");
}

// The config, or nothing (with the reason) for a file that is not a runnable model, e.g. a
// vocabulary-only GGUF: --inspect still describes it.
std::optional<model::ModelConfig> try_config(const gguf::File& f, std::string& why) {
  try {
    return model::ModelConfig::from_gguf(f);
  } catch (const Error& e) {
    if (e.code() != Exit::unsupported) throw;
    why = e.what();
    return std::nullopt;
  }
}

}  // namespace

void write_summary(const gguf::File& f, std::ostream& os) {
  const auto ts = tensor_stats(f);
  os << fmt::format("model: {}\n", f.path());
  os << fmt::format("file: {} bytes ({:.2f} MiB), GGUF v{}\n", f.file_size(),
                    static_cast<double>(f.file_size()) / (1024.0 * 1024.0), f.version());
  os << fmt::format("architecture: {}\n", architecture(f));
  std::string why;
  if (auto c = try_config(f, why)) {
    os << "hyperparameters:\n";
    for (const auto& [k, v] : hyperparameters(*c)) os << fmt::format("  {:<20} {}\n", k, v);
  } else {
    os << "hyperparameters: unavailable, this is not a model moe-run can run: " << why << '\n';
  }
  std::string types;
  for (const auto& [name, n] : ts.by_type) types += fmt::format("{}{} x{}", types.empty() ? "" : ", ", name, n);
  os << fmt::format("tensors: {} ({} bytes, {:.2f} MiB): {}\n", ts.count, ts.bytes,
                    static_cast<double>(ts.bytes) / (1024.0 * 1024.0), types);
  try {
    const auto tk = tok::Tokenizer::from_gguf(f);
    os << "tokenizer: " << tk.summary() << '\n';
    os << "chat template: " << (tk.chat_template() ? "present" : "absent") << '\n';
  } catch (const Error& e) {
    os << "tokenizer: unusable (" << e.what() << ")\n";
    os << "chat template: " << (f.has("tokenizer.chat_template") ? "present" : "absent") << '\n';
  }
}

int inspect(const RunConfig& cfg, bool as_json, std::ostream& out) {
  auto file = gguf::File::open(cfg.model_path);
  if (!as_json) {
    write_summary(*file, out);
    out.flush();
    return 0;
  }
  std::string why;
  const auto c = try_config(*file, why);
  const auto ts = tensor_stats(*file);
  json::Object hp;
  if (c)
    for (const auto& [k, v] : hyperparameters(*c)) hp.raw(k, v);
  json::Object types;
  for (const auto& [name, n] : ts.by_type) types.raw(name, json::num(static_cast<int64_t>(n)));
  json::Object tokj;
  bool has_template = file->has("tokenizer.chat_template");
  try {
    const auto tk = tok::Tokenizer::from_gguf(*file);
    has_template = tk.chat_template() != nullptr;
    tokj.str("summary", tk.summary())
        .raw("n_vocab", json::num(int64_t{tk.n_vocab()}))
        .raw("n_merges", json::num(static_cast<int64_t>(tk.n_merges())))
        .str("pre", tk.pre())
        .raw("bos_id", json::num(int64_t{tk.bos_id()}))
        .raw("eos_id", json::num(int64_t{tk.eos_id()}))
        .raw("add_bos", json::boolean(tk.add_bos()))
        .raw("eog_ids", json::ids(tk.eog_ids()));
  } catch (const Error& e) {
    tokj.str("error", e.what());
  }
  out << json::Object()
             .str("model", cfg.model_path)
             .raw("file_size", json::num(static_cast<int64_t>(file->file_size())))
             .raw("gguf_version", json::num(int64_t{file->version()}))
             .str("arch", c ? c->arch : architecture(*file))
             .raw("supported", json::boolean(c.has_value()))
             .raw("unsupported_reason", c ? std::string("null") : json::quote(why))
             .raw("hyperparameters", c ? hp.done() : std::string("null"))
             .raw("tensors", json::Object()
                                 .raw("count", json::num(static_cast<int64_t>(ts.count)))
                                 .raw("bytes", json::num(static_cast<int64_t>(ts.bytes)))
                                 .raw("by_type", types.done())
                                 .done())
             .raw("tokenizer", tokj.done())
             .raw("chat_template", json::boolean(has_template))
             .done()
      << '\n';
  out.flush();
  return 0;
}

int tokenize(const RunConfig& cfg, std::ostream& out, std::ostream& err) {
  auto file = gguf::File::open(cfg.model_path);
  std::vector<int32_t> ids;
  if (cfg.prompt_tokens) {
    ids = *cfg.prompt_tokens;
  } else {
    const auto tk = tok::Tokenizer::from_gguf(*file);
    const PreparedPrompt p = prepare_prompt(cfg, &tk, tk.n_vocab());
    if (cfg.verbose) err << "[verbose] formatted prompt: " << json::quote(p.text) << '\n';
    ids = p.ids;
  }
  out << json::ids(ids) << '\n';
  out.flush();
  return 0;
}

}  // namespace moe::run
