// The qwen2 pre-tokenizer (REFERENCE §6.3) as a hand-written matcher over code points:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// The alternatives are tried in order at each position, with the same decisions as llama.cpp's
// matcher (which is what the reference ids come from), including at the fragment end.
#include "internal.hpp"

namespace moe::tok::detail {

namespace {

constexpr uint32_t kOutOfRange = 0xFFFFFFFFu;

inline uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

}  // namespace

void split_qwen2(std::string_view text, std::vector<uint32_t>& ends, SplitScratch& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t nb = text.size();
  // Decode once; the caller guarantees valid UTF-8 (invalid bytes were replaced by U+FFFD).
  // Sized for the worst case (one code point per byte) and written by index: no per-element checks.
  if (s.cps.size() < nb + 1) {
    s.cps.resize(nb + 1);
    s.flags.resize(nb + 1);
    s.offs.resize(nb + 1);
  }
  uint32_t* cp_out = s.cps.data();
  uint8_t* fl_out = s.flags.data();
  uint32_t* off_out = s.offs.data();
  size_t n = 0;
  for (size_t i = 0; i < nb;) {
    uint32_t cp;
    size_t len;
    if (p[i] < 0x80) {
      cp = p[i];
      len = 1;
    } else {
      len = utf8_decode(p, nb, i, cp);
      if (len == 0) {  // not reachable with sanitized input; keep the byte as U+FFFD
        cp = 0xFFFD;
        len = 1;
      }
    }
    cp_out[n] = cp;
    fl_out[n] = cp_flags(cp);
    off_out[n] = uint32_t(i);
    ++n;
    i += len;
  }
  off_out[n] = uint32_t(nb);

  const uint32_t* cps = s.cps.data();
  const uint8_t* fl = s.flags.data();
  auto cpt_at = [&](size_t i) -> uint32_t { return i < n ? cps[i] : kOutOfRange; };
  auto flags_at = [&](size_t i) -> uint8_t { return i < n ? fl[i] : 0; };
  auto add = [&](size_t end) { ends.push_back(s.offs[end]); };

  size_t pos = 0;
  while (pos < n) {
    const uint32_t c = cps[pos];
    const uint8_t f = fl[pos];

    // 1. contractions, case-insensitive
    if (c == '\'' && pos + 1 < n) {
      const uint32_t c1 = ascii_lower(cps[pos + 1]);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        pos += 2;
        add(pos);
        continue;
      }
      if (pos + 2 < n) {
        const uint32_t c2 = ascii_lower(cps[pos + 2]);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          pos += 3;
          add(pos);
          continue;
        }
      }
    }

    // 2. [^\r\n\p{L}\p{N}]?\p{L}+
    if (!(c == '\r' || c == '\n' || (f & kNumber))) {
      if ((f & kLetter) || (flags_at(pos + 1) & kLetter)) {
        ++pos;
        while (flags_at(pos) & kLetter) ++pos;
        add(pos);
        continue;
      }
    }

    // 3. \p{N}: one number character per word
    if (f & kNumber) {
      ++pos;
      add(pos);
      continue;
    }

    // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'. A lone trailing space also lands here (it has no next
    //    code point), which yields the same word as the whitespace rules would.
    uint8_t f2 = (c == ' ') ? flags_at(pos + 1) : f;
    if (!(f2 & (kSpace | kLetter | kNumber))) {
      pos += (c == ' ');
      while (f2 != 0 && !(f2 & (kSpace | kLetter | kNumber))) f2 = flags_at(++pos);
      uint32_t c2 = cpt_at(pos);
      while (c2 == '\r' || c2 == '\n') c2 = cpt_at(++pos);
      add(pos);
      continue;
    }

    // 5.-7. whitespace runs
    size_t nws = 0, last_rn_end = 0;
    while (flags_at(pos + nws) & kSpace) {
      const uint32_t c2 = cps[pos + nws];
      if (c2 == '\r' || c2 == '\n') last_rn_end = pos + nws + 1;
      ++nws;
    }
    if (last_rn_end > 0) {  // \s*[\r\n]+
      pos = last_rn_end;
      add(pos);
      continue;
    }
    if (nws > 1 && pos + nws < n) {  // \s+(?!\S): leave the last space for the next word
      pos += nws - 1;
      add(pos);
      continue;
    }
    if (nws > 0) {  // \s+
      pos += nws;
      add(pos);
      continue;
    }
    // 8. no alternative matched: the code point alone
    ++pos;
    add(pos);
  }
}

}  // namespace moe::tok::detail
