// Qwen2/Qwen3 byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata, a streaming
// detokenizer, and the ChatML prompt renderer (REFERENCE.md §6). Behaviour follows llama.cpp's
// `gpt2` vocabulary with the `qwen2` pre-tokenizer, including its special-token partition and its
// end-of-generation auto-detection from token text.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/error.hpp"
#include "moe/gguf.hpp"

namespace moe::tok {

// `tokenizer.ggml.token_type` values (gguf-py TokenType).
enum class TokenType : int32_t {
  undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6,
};

// Token attributes as llama.cpp derives them (a token can carry several after auto-detection).
enum TokenAttr : uint8_t {
  kAttrNormal = 1, kAttrUnknown = 2, kAttrControl = 4, kAttrUserDefined = 8, kAttrUnused = 16,
  kAttrByte = 32,
};

// Copies are cheap and share the loaded vocabulary (immutable; encode/decode are thread-safe). A
// default-constructed Tokenizer is empty: assign one from from_gguf() before use.
class Tokenizer {
 public:
  // From tokenizer.ggml.* metadata (model "gpt2", pre "qwen2" and its aliases). Throws
  // Exit::unsupported naming the key for anything missing/invalid (unknown tokenizer model or
  // pre-tokenizer, token_type shorter than the token list, special ids >= n_vocab, ...).
  static Tokenizer from_gguf(const gguf::File& f);

  // Tokenizes `text` (no BOS/EOS is ever added here: callers prepend bos_id() when add_bos()).
  // parse_special = true matches CONTROL/UNKNOWN/USER_DEFINED token texts; false still matches
  // USER_DEFINED ones, as llama.cpp does. Invalid UTF-8 bytes become U+FFFD before BPE.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Concatenated raw bytes of piece(id) (may be invalid UTF-8 when ids split a character).
  // Throws Exit::usage for an id outside [0, n_vocab).
  std::string decode(std::span<const int32_t> ids) const;
  std::string piece(int32_t id) const;         // bytes of one token (CONTROL: its text)
  const std::string& piece_ref(int32_t id) const;
  const std::string& token_text(int32_t id) const;  // the vocabulary string (byte-encoded form)
  uint8_t token_attr(int32_t id) const;             // TokenAttr bits

  int32_t n_vocab() const;
  size_t n_merges() const;
  const std::string& pre() const;  // tokenizer.ggml.pre as found in the file
  bool is_eog(int32_t id) const;   // end-of-generation set, REFERENCE §6.6
  const std::vector<int32_t>& eog_ids() const;  // sorted ascending
  bool add_bos() const;
  int32_t bos_id() const;  // -1 if none
  bool add_eos() const;
  int32_t eos_id() const;  // -1 if none
  const std::string* chat_template() const;  // nullptr if the GGUF has none
  std::string summary() const;               // one line for --inspect/--verbose

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Streaming detokenizer: never returns a partial UTF-8 sequence; holds incomplete bytes until they
// complete. Bytes that can never start or continue a valid sequence are returned as U+FFFD at once;
// finish() flushes what is left, an incomplete leftover becoming U+FFFD (one per byte).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok);
  std::string push(int32_t id);
  // Appends raw bytes (the piece of a token) and returns what is complete.
  std::string push_bytes(std::string_view bytes);
  std::string finish();

 private:
  Tokenizer tok_;  // a shared copy: the decoder does not depend on the caller's object living on
  std::string pending_;
};

struct ChatRequest {
  std::string user;
  std::optional<std::string> system;
  bool thinking = false;
};

// Is the template ChatML-like (uses <|im_start|>/<|im_end|> with role/content)?
bool template_is_chatml(std::string_view jinja_source);

// The ChatML prompt the Qwen3 template renders for one user message (+system), ending with the
// assistant prefix: "<|im_start|>system\n{system}<|im_end|>\n" (when given),
// "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", then, with thinking = false,
// "<think>\n\n</think>\n\n" (what Qwen3's template adds with enable_thinking = false). The user and
// system texts are inserted verbatim. Throws Exit::unsupported with a message when template_source
// is non-null and not ChatML-like; a null template_source (--chat on a GGUF without a template)
// renders the same ChatML form.
// Does the template have Qwen3's thinking switch (enable_thinking)? No template = the built-in Qwen3 form.
bool template_has_thinking(const std::string* template_source);
std::string render_chat(const std::string* template_source, const ChatRequest& req);

}  // namespace moe::tok
