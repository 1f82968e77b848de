// libFuzzer target: chat-template recognition and ChatML rendering on arbitrary strings.
// The input is split at NUL bytes into template / user / system (a missing part: no template, no
// system). A non-ChatML template must be an Error (Exit::unsupported); a rendered prompt must hold
// the user and system texts verbatim in ChatML order.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/tokenizer.hpp"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (parts.size() < 3) {
    const size_t nul = in.find('\0', start);
    if (nul == std::string_view::npos) { parts.push_back(in.substr(start)); break; }
    parts.push_back(in.substr(start, nul - start));
    start = nul + 1;
  }
  const bool has_template = parts.size() >= 2;  // "user" alone: no template (--chat without one)
  const std::string tpl(has_template ? parts[0] : std::string_view{});
  moe::tok::ChatRequest req;
  req.user = std::string(has_template ? parts[1] : parts[0]);
  if (parts.size() >= 3) req.system = std::string(parts[2]);
  req.thinking = size > 0 && (data[size - 1] & 1);

  const bool chatml = moe::tok::template_is_chatml(tpl);
  (void)moe::tok::template_has_thinking(has_template ? &tpl : nullptr);
  std::string out;
  try {
    out = moe::tok::render_chat(has_template ? &tpl : nullptr, req);
  } catch (const moe::Error& e) {
    if (!has_template || chatml) finding("render_chat refused a ChatML template or no template");
    if (e.code() != moe::Exit::unsupported) finding("render_chat refused with a code other than unsupported");
    return 0;
  }
  if (has_template && !chatml) finding("render_chat accepted a template that is not ChatML-like");
  size_t pos = 0;
  if (req.system) {
    const std::string head = "<|im_start|>system\n" + *req.system + "<|im_end|>\n";
    if (out.compare(0, head.size(), head) != 0) finding("system turn missing or altered");
    pos = head.size();
  }
  const std::string user = "<|im_start|>user\n" + req.user + "<|im_end|>\n<|im_start|>assistant\n";
  if (out.compare(pos, user.size(), user) != 0) finding("user turn missing or altered");
  return 0;
}
