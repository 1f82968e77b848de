// Shared by the tokenizer tests: the Qwen2 vocabulary fixture (loaded once), an independent
// GPT-2 byte encoder and vocabulary index (so expectations never come from the code under test),
// a strict UTF-8 checker, and helpers that rewrite tokenizer metadata in a GGUF image.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "gguf_image.hpp"
#include "moe/gguf.hpp"
#include "moe/tokenizer.hpp"

namespace moe::tok::testing {

inline const std::string kVocabPath = std::string(MOE_TEST_DATA) + "/ggml-vocab-qwen2.gguf";
inline const std::string kTinyModelPath = std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q8_0.gguf";

inline const Tokenizer& qwen2() {
  static const Tokenizer tok = [] {
    const auto f = gguf::File::open(kVocabPath);
    return Tokenizer::from_gguf(*f);
  }();
  return tok;
}

// GPT-2 byte -> code point map written out from its definition (REFERENCE §6.2).
inline std::string gpt2_encode(const std::string& raw) {
  std::string out;
  for (unsigned char b : raw) {
    uint32_t cp;
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) {
      cp = b;
    } else {
      // position of b among the unmapped bytes 0x00-0x20, 0x7F-0xA0, 0xAD
      uint32_t k = b <= 0x20 ? b : (b <= 0xA0 ? 0x21 + (b - 0x7F) : 0x21 + 0x22);
      cp = 0x100 + k;
    }
    if (cp < 0x80) {
      out += char(cp);
    } else {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

// Vocabulary string -> id, straight from the token list (last id wins for duplicates).
inline int32_t vocab_id(const Tokenizer& tok, const std::string& raw_text) {
  static std::unordered_map<const void*, std::unordered_map<std::string, int32_t>> maps;
  auto& m = maps[&tok];
  if (m.empty())
    for (int32_t i = 0; i < tok.n_vocab(); ++i) m[tok.token_text(i)] = i;
  const auto it = m.find(gpt2_encode(raw_text));
  return it == m.end() ? -1 : it->second;
}

// Strict UTF-8 well-formedness (Unicode table 3-7), independent of src/tokenizer.
inline bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned c = p[i];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80) { ++i; continue; }
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return false;
    if (i + len > n) return false;
    if (p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// Each byte that does not start a well-formed sequence becomes U+FFFD (what the encoder must do).
inline std::string replace_invalid(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    size_t len = 0;
    for (size_t l = 1; l <= 4 && i + l <= s.size(); ++l)
      if (valid_utf8(s.substr(i, l))) { len = l; break; }
    if (len == 0) { out += "\xEF\xBF\xBD"; ++i; }
    else { out += s.substr(i, len); i += len; }
  }
  return out;
}

// Byte offsets where the tokens of `ids` end.
inline std::vector<size_t> token_ends(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<size_t> ends;
  size_t at = 0;
  for (int32_t id : ids) ends.push_back(at += tok.piece(id).size());
  return ends;
}

// ---- GGUF image edits ------------------------------------------------------------------------
inline void put_str(std::vector<uint8_t>& v, const std::string& s) {
  gguf_test::put<uint64_t>(v, s.size());
  v.insert(v.end(), s.begin(), s.end());
}
inline gguf_test::Kv& kv_slot(gguf_test::Image& img, const std::string& key, uint32_t type) {
  gguf_test::Kv* kv = img.find(key);
  if (!kv) {
    img.kvs.push_back({key, type, {}});
    kv = &img.kvs.back();
  }
  kv->type = type;
  kv->value.clear();
  return *kv;
}
inline void set_string(gguf_test::Image& img, const std::string& key, const std::string& s) {
  put_str(kv_slot(img, key, 8).value, s);
}
inline void set_bool(gguf_test::Image& img, const std::string& key, bool b) {
  kv_slot(img, key, 7).value.push_back(b ? 1 : 0);
}
inline void set_strings(gguf_test::Image& img, const std::string& key, const std::vector<std::string>& a) {
  auto& v = kv_slot(img, key, 9).value;
  gguf_test::put<uint32_t>(v, 8);
  gguf_test::put<uint64_t>(v, a.size());
  for (const auto& s : a) put_str(v, s);
}
inline void set_i32s(gguf_test::Image& img, const std::string& key, const std::vector<int32_t>& a) {
  auto& v = kv_slot(img, key, 9).value;
  gguf_test::put<uint32_t>(v, 5);
  gguf_test::put<uint64_t>(v, a.size());
  for (int32_t x : a) gguf_test::put<int32_t>(v, x);
}
inline std::vector<std::string> get_strings(gguf_test::Image& img, const std::string& key) {
  const auto& v = img.find(key)->value;
  uint64_t n;
  std::memcpy(&n, v.data() + 4, 8);
  std::vector<std::string> out;
  size_t at = 12;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t len;
    std::memcpy(&len, v.data() + at, 8);
    out.emplace_back(reinterpret_cast<const char*>(v.data() + at + 8), len);
    at += 8 + len;
  }
  return out;
}
inline std::vector<int32_t> get_i32s(gguf_test::Image& img, const std::string& key) {
  const auto& v = img.find(key)->value;
  uint64_t n;
  std::memcpy(&n, v.data() + 4, 8);
  std::vector<int32_t> out(n);
  std::memcpy(out.data(), v.data() + 12, n * 4);
  return out;
}

inline gguf_test::Image vocab_image() {
  static const gguf_test::Image img = [] {
    // The vocabulary file has no tensors and ends right after its metadata; the test walker expects
    // the aligned start of a data section, so pad the bytes it reads.
    auto bytes = gguf_test::read_file(kVocabPath);
    while (bytes.size() % 32) bytes.push_back(0);
    return gguf_test::Image::read(bytes);
  }();
  return img;
}

// A tokenizer loaded from an edited image (the bytes are kept alive with the File).
struct Loaded {
  std::vector<uint8_t> bytes;
  std::shared_ptr<const gguf::File> file;
  Tokenizer tok;
};
inline std::unique_ptr<Loaded> load_image(const gguf_test::Image& img) {
  auto l = std::make_unique<Loaded>();
  l->bytes = img.write();
  l->file = gguf::File::parse(l->bytes, "edited.gguf");
  l->tok = Tokenizer::from_gguf(*l->file);
  return l;
}

}  // namespace moe::tok::testing
