// Streaming detokenizer (REFERENCE §6.8): a token can end in the middle of a UTF-8 character, so
// bytes are held back until the character completes; output is always well-formed UTF-8.
#include "internal.hpp"

namespace moe::tok {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// How many more bytes could still turn s[i..n) into a well-formed sequence: 0 when they can not
// (the lead byte or a continuation byte is already wrong), else how many are missing.
size_t missing_bytes(const unsigned char* s, size_t n, size_t i) {
  const unsigned c = s[i];
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;       // no overlongs
    else if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  const size_t have = n - i;
  if (have >= len) return 0;  // complete yet not decodable: invalid
  for (size_t k = 1; k < have; ++k) {
    const unsigned t = s[i + k];
    if (k == 1 ? (t < lo || t > hi) : ((t & 0xC0) != 0x80)) return 0;
  }
  return len - have;
}

}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tok) : tok_(tok) {}

std::string StreamDecoder::push(int32_t id) { return push_bytes(tok_.piece_ref(id)); }

std::string StreamDecoder::push_bytes(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(pending_.data());
  const size_t n = pending_.size();
  size_t i = 0;
  while (i < n) {
    uint32_t cp;
    const size_t len = detail::utf8_decode(p, n, i, cp);
    if (len > 0) {
      out.append(pending_, i, len);
      i += len;
    } else if (missing_bytes(p, n, i) > 0) {
      break;  // the rest may complete with the next token
    } else {
      out += kReplacement;
      ++i;
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out;
  for (size_t i = 0; i < pending_.size(); ++i) out += kReplacement;
  pending_.clear();
  return out;
}

}  // namespace moe::tok
