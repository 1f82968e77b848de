// The ChatML prompt of the Qwen3 chat template for one user turn (REFERENCE §6.9). The template is
// not interpreted: a ChatML-like template is recognised and its fixed output form is produced.
#include "internal.hpp"

namespace moe::tok {

bool template_is_chatml(std::string_view src) {
  return src.find("<|im_start|>") != std::string_view::npos &&
         src.find("<|im_end|>") != std::string_view::npos &&
         src.find("role") != std::string_view::npos && src.find("content") != std::string_view::npos;
}

bool template_has_thinking(const std::string* template_source) {
  if (!template_source) return true;  // the built-in form is Qwen3's
  return template_source->find("enable_thinking") != std::string::npos;
}

std::string render_chat(const std::string* template_source, const ChatRequest& req) {
  if (template_source && !template_is_chatml(*template_source))
    fail(Exit::unsupported,
         "the GGUF chat template ('tokenizer.chat_template') is not ChatML-like (no "
         "<|im_start|>/<|im_end|> role/content turns); use --raw to send the prompt as is");
  std::string out;
  out.reserve(req.user.size() + (req.system ? req.system->size() : 0) + 96);
  if (req.system) {
    out += "<|im_start|>system\n";
    out += *req.system;
    out += "<|im_end|>\n";
  }
  out += "<|im_start|>user\n";
  out += req.user;
  out += "<|im_end|>\n<|im_start|>assistant\n";
  // The empty think block is what a Qwen3 template renders with enable_thinking = false; a ChatML
  // template without that switch (Qwen2, Qwen3 Instruct-2507) renders none, so none is added there.
  if (!req.thinking && template_has_thinking(template_source)) out += "<think>\n\n</think>\n\n";
  return out;
}

}  // namespace moe::tok
