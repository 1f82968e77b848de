#include <unistd.h>

#include <thread>

#include "internal.hpp"
#include "moe/error.hpp"

namespace moe::run {

int default_threads() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n > 0) return static_cast<int>(n);
  const unsigned h = std::thread::hardware_concurrency();
  return h > 0 ? static_cast<int>(h) : 1;
}

PreparedPrompt prepare_prompt(const RunConfig& cfg, const tok::Tokenizer* tok, int64_t n_vocab) {
  PreparedPrompt p;
  if (cfg.prompt_tokens) {
    p.ids = *cfg.prompt_tokens;
  } else {
    if (!tok) fail(Exit::unsupported, "{}: the GGUF has no tokenizer; pass --prompt-tokens", cfg.model_path);
    if (!cfg.prompt) fail(Exit::usage, "no prompt: give PROMPT, -p/--prompt, -i/--input or --prompt-tokens");
    const std::string* tpl = tok->chat_template();
    p.templated = cfg.template_mode == TemplateMode::chat ||
                  (cfg.template_mode == TemplateMode::automatic && tpl != nullptr);
    if (!p.templated && cfg.system)
      fail(Exit::usage, "--system needs the chat template ({})",
           cfg.template_mode == TemplateMode::raw ? "--raw was given" : "the model has none; --chat forces ChatML");
    if (!p.templated && cfg.thinking)
      fail(Exit::usage, "--thinking needs the chat template ({})",
           cfg.template_mode == TemplateMode::raw ? "--raw was given" : "the model has none; --chat forces ChatML");
    if (p.templated) {
      tok::ChatRequest req;
      req.user = *cfg.prompt;
      req.system = cfg.system;
      req.thinking = cfg.thinking.value_or(false);
      p.text = tok::render_chat(tpl, req);
    } else {
      p.text = *cfg.prompt;
    }
    p.ids = tok->encode(p.text, true);
    if (tok->add_bos() && tok->bos_id() >= 0 && (p.ids.empty() || p.ids.front() != tok->bos_id()))
      p.ids.insert(p.ids.begin(), tok->bos_id());
  }
  if (p.ids.empty()) fail(Exit::usage, "the prompt is empty (it has no tokens)");
  for (size_t i = 0; i < p.ids.size(); ++i)
    if (p.ids[i] < 0 || p.ids[i] >= n_vocab)
      fail(Exit::usage, "prompt token {} (index {}) is outside the vocabulary [0, {})", p.ids[i], i, n_vocab);
  return p;
}

}  // namespace moe::run
