// libFuzzer target: tokenizer encode/decode on arbitrary bytes with the Qwen2 fixture vocabulary.
// The first input byte selects the mode; the rest is the text or the id sequence. Any moe::Error is
// an expected rejection (e.g. an id out of range); a crash, a sanitizer report or a broken
// round-trip on valid UTF-8 is a finding (abort).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/gguf.hpp"
#include "moe/tokenizer.hpp"

namespace {

const moe::tok::Tokenizer& vocab() {
  // Loaded once: the fixture is the real Qwen2 vocabulary (151k tokens, all the special tokens).
  static const moe::tok::Tokenizer t = [] {
    // The fixture beside this source (tests/data), unless MOE_TEST_DATA points elsewhere.
    std::string dir = std::getenv("MOE_TEST_DATA") ? std::getenv("MOE_TEST_DATA") : "";
    if (dir.empty()) {
      const std::string self = __FILE__;
      dir = self.substr(0, self.rfind("tools/fuzz/")) + "tests/data";
    }
    const std::string path = dir + "/ggml-vocab-qwen2.gguf";
    return moe::tok::Tokenizer::from_gguf(*moe::gguf::File::open(path));
  }();
  return t;
}

// Strict UTF-8 validity (no overlongs, no surrogates, <= U+10FFFF): only such text must round-trip,
// since invalid bytes are replaced by U+FFFD before BPE.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else return false;
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000)) return false;
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

[[noreturn]] void finding(const char* what, std::string_view in, std::string_view out) {
  std::fprintf(stderr, "%s\n  in  (%zu bytes): %.*s\n  out (%zu bytes): %.*s\n", what, in.size(),
               static_cast<int>(in.size()), in.data(), out.size(), static_cast<int>(out.size()), out.data());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)vocab();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& tok = vocab();
  const uint8_t mode = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (mode % 4) {
      case 0:
      case 1: {  // encode (parse_special on/off), then decode and stream-decode the ids
        const bool special = mode % 4 == 0;
        const std::vector<int32_t> ids = tok.encode(text, special);
        for (int32_t id : ids)
          if (id < 0 || id >= tok.n_vocab()) finding("encode returned an id outside the vocabulary", text, {});
        const std::string back = tok.decode(ids);
        moe::tok::StreamDecoder sd(tok);
        std::string streamed;
        for (int32_t id : ids) streamed += sd.push(id);
        streamed += sd.finish();
        if (valid_utf8(text)) {
          // Special-token texts decode to their own text, so the round-trip holds with both modes.
          if (back != text) finding("decode(encode(s)) != s", text, back);
          if (streamed != text) finding("stream decode(encode(s)) != s", text, streamed);
        }
        break;
      }
      case 2: {  // arbitrary raw bytes through the streaming decoder: output is always valid UTF-8
        moe::tok::StreamDecoder sd(tok);
        std::string out;
        // Feed in chunks whose lengths come from the data so split sequences are exercised.
        size_t i = 0;
        while (i < text.size()) {
          const size_t n = 1 + static_cast<uint8_t>(text[i]) % 5;
          out += sd.push_bytes(text.substr(i, n));
          i += n;
        }
        out += sd.finish();
        if (!valid_utf8(out)) finding("stream decoder returned invalid UTF-8", text, out);
        if (valid_utf8(text) && out != text) finding("stream decoder changed valid UTF-8", text, out);
        break;
      }
      case 3: {  // arbitrary id sequences (out-of-range ids must be an Error, never a crash)
        std::vector<int32_t> ids(text.size() / 4);
        std::memcpy(ids.data(), text.data(), ids.size() * 4);
        // Mostly in-range ids so decoding is reached; the raw value otherwise.
        for (auto& id : ids)
          if ((static_cast<uint32_t>(id) >> 31) == 0) id = static_cast<int32_t>(static_cast<uint32_t>(id) % (tok.n_vocab() + 16));
        (void)tok.decode(ids);
        moe::tok::StreamDecoder sd(tok);
        std::string out;
        for (int32_t id : ids) out += sd.push(id);
        out += sd.finish();
        if (!valid_utf8(out)) finding("stream decoder returned invalid UTF-8", text, out);
        for (int32_t id : ids) (void)tok.is_eog(id);
        break;
      }
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
