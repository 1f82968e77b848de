// UTF-8 coding, Unicode classes (from libutf8proc) and the GPT-2 byte <-> code point map.
#include <utf8proc.h>

#include <array>

#include "internal.hpp"

namespace moe::tok::detail {

namespace {

uint8_t classify(uint32_t cp) {
  uint8_t f = kDefined;
  switch (utf8proc_category(utf8proc_int32_t(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      f |= kLetter;
      break;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      f |= kNumber;
      break;
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
      f |= kMark;
      break;
    // The White_Space property (the regex `\s`) is exactly the separators Zs/Zl/Zp plus the
    // controls U+0009..U+000D and U+0085; utf8proc has categories, not that property.
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
      f |= kSpace;
      break;
    default:
      break;
  }
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) f |= kSpace;
  return f;
}

struct ByteMap {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 324> from_cp{};  // code points 0..323 cover every mapped value
  std::array<std::string, 256> encoded;
  ByteMap() {
    from_cp.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = printable ? b : next++;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      from_cp[to_cp[b]] = int16_t(b);
      utf8_append(encoded[b], to_cp[b]);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

}  // namespace

uint8_t cp_flags_lookup(uint32_t cp) { return classify(cp); }

AsciiFlags::AsciiFlags() {
  for (uint32_t c = 0; c < 128; ++c) v[c] = classify(c);
}
const AsciiFlags kAsciiFlags;

size_t utf8_decode(const unsigned char* s, size_t n, size_t i, uint32_t& cp) {
  const unsigned c = s[i];
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  size_t len;
  uint32_t v, min;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2, v = c & 0x1F, min = 0x80;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3, v = c & 0x0F, min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4, v = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > n) return 0;
  for (size_t k = 1; k < len; ++k) {
    const unsigned t = s[i + k];
    if ((t & 0xC0) != 0x80) return 0;
    v = (v << 6) | (t & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  cp = v;
  return len;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

bool utf8_valid(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // Skip ASCII eight bytes at a time: the common case for prose and code.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp;
    const size_t len = utf8_decode(p, n, i, cp);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    uint32_t cp;
    const size_t len = utf8_decode(p, n, i, cp);
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.data() + i, len);
      i += len;
    }
  }
  return out;
}

uint32_t byte_to_cp(uint8_t b) { return byte_map().to_cp[b]; }

int byte_from_cp(uint32_t cp) {
  const auto& m = byte_map();
  return cp < m.from_cp.size() ? m.from_cp[cp] : -1;
}

std::string byte_encode(std::string_view raw) {
  const auto& m = byte_map();
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char c : raw) out += m.encoded[c];
  return out;
}

}  // namespace moe::tok::detail
