// Internal pieces of the tokenizer module shared by its .cpp files (not a public header).
#pragma once
#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "moe/tokenizer.hpp"

namespace moe::tok::detail {

// ---- Unicode helpers (unicode.cpp) ----------------------------------------------------------
// Per-code-point class bits used by the pre-tokenizer. kDefined is set for every real code point so
// that "no flags" only ever means "past the end of the fragment", as in llama.cpp's matcher.
enum CpFlags : uint8_t { kDefined = 1, kLetter = 2, kNumber = 4, kSpace = 8, kMark = 16 };

uint8_t cp_flags_lookup(uint32_t cp);  // from libutf8proc's general category (+ White_Space)
struct AsciiFlags {
  AsciiFlags();
  uint8_t v[128];
};
extern const AsciiFlags kAsciiFlags;  // cp_flags_lookup of 0..127, computed once at start-up
inline uint8_t cp_flags(uint32_t cp) { return cp < 128 ? kAsciiFlags.v[cp] : cp_flags_lookup(cp); }

// Decodes one well-formed UTF-8 sequence at s[i] (strict: no overlongs, surrogates or values above
// U+10FFFF). Returns its length (1..4) and sets cp, or 0 when the bytes there are not well-formed.
size_t utf8_decode(const unsigned char* s, size_t n, size_t i, uint32_t& cp);
void utf8_append(std::string& out, uint32_t cp);
// Replaces every byte that does not belong to a well-formed sequence by U+FFFD.
std::string utf8_sanitize(std::string_view s);
bool utf8_valid(std::string_view s);

// GPT-2 byte <-> code point map (REFERENCE §6.2).
uint32_t byte_to_cp(uint8_t b);
int byte_from_cp(uint32_t cp);  // -1 when cp is not one of the 256 mapped code points
std::string byte_encode(std::string_view raw);

// ---- pre-tokenizer (pretokenize.cpp) -----------------------------------------------------------
// Splits one text fragment (valid UTF-8) with the qwen2 rules; appends the byte end offset of each
// word to `ends` (words are contiguous from 0). `cps`/`flags`/`offs` are scratch buffers.
struct SplitScratch {
  std::vector<uint32_t> cps;
  std::vector<uint8_t> flags;
  std::vector<uint32_t> offs;  // byte offset of each code point, plus the total at the end
};
void split_qwen2(std::string_view text, std::vector<uint32_t>& ends, SplitScratch& s);

// ---- hashing ------------------------------------------------------------------------------------
// A fast hash for short byte strings (words, token texts): 8 bytes per step, multiply-xorshift mix.
inline uint32_t hash_bytes(std::string_view w) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ w.size();
  const char* p = w.data();
  size_t n = w.size();
  while (n >= 8) {
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    p += 8, n -= 8;
  }
  uint64_t v = 0;
  __builtin_memcpy(&v, p, n);
  h = (h ^ v) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  return uint32_t(h ^ (h >> 32));
}

// String -> symbol id over a flat array of (hash, id); the strings themselves live in `texts`
// (views that stay valid while the index is used).
class SymbolIndex {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
  }
  int32_t find(std::string_view s, const std::vector<std::string_view>& texts) const {
    const uint32_t h = hash_bytes(s);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& e = slots_[i];
      if (e.id < 0) return -1;
      if (e.hash == h && texts[size_t(e.id)] == s) return e.id;
    }
  }
  // Maps texts[id] to id, replacing an earlier id with the same text when `replace`.
  void put(int32_t id, const std::vector<std::string_view>& texts, bool replace) {
    if ((used_ + 1) * 2 > slots_.size()) grow(texts);
    const std::string_view s = texts[size_t(id)];
    const uint32_t h = hash_bytes(s);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& e = slots_[i];
      if (e.id < 0) {
        e = {h, id};
        ++used_;
        return;
      }
      if (e.hash == h && texts[size_t(e.id)] == s) {
        if (replace) e.id = id;
        return;
      }
    }
  }

 private:
  struct Slot {
    uint32_t hash;
    int32_t id;
  };
  void grow(const std::vector<std::string_view>& texts) {
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(16, old.size()));
    used_ = 0;
    for (const Slot& e : old)
      if (e.id >= 0) put(e.id, texts, false);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

// ---- merge table --------------------------------------------------------------------------------
// Open-addressing map (left symbol, right symbol) -> rank, 8 bytes a slot (21 + 21 bits of symbol
// ids, 22 bits of rank) so the whole table stays small and cache-friendly; the merged symbol of a
// rank is kept in a separate array and only read when a merge is applied.
class MergeMap {
 public:
  static constexpr uint32_t kMaxSymbols = (1u << 21) - 1;  // the all-ones key marks empty slots
  static constexpr uint32_t kMaxRanks = 1u << 22;
  void reserve(size_t n);
  // Keeps the first insertion for a pair (llama.cpp emplaces, so the lowest rank wins).
  void insert(int32_t left, int32_t right, int32_t rank, int32_t result);
  // The rank of the pair, or -1.
  int32_t find(int32_t left, int32_t right) const {
    if (slots_.empty()) return -1;
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      const uint64_t s = slots_[i];
      if ((s >> 22) == key) return int32_t(s & (kMaxRanks - 1));
      if (s == kEmpty) return -1;
    }
  }
  int32_t result(int32_t rank) const { return results_[size_t(rank)]; }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t pack(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 21) | uint32_t(r); }
  size_t hash(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void place(uint64_t slot);
  std::vector<uint64_t> slots_;  // key << 22 | rank
  std::vector<int32_t> results_;  // rank -> merged symbol
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t size_ = 0;
};

// ---- the loaded vocabulary ---------------------------------------------------------------------
struct Special {
  int32_t id;
  std::string_view text;  // into Impl::text
};

// Candidates for the special-token partition in one mode (parse_special on / off).
struct SpecialSet {
  std::vector<Special> by_priority;  // longest text first, ties by id
  // text -> index into by_priority (first eligible token with that text)
  std::unordered_map<std::string_view, uint32_t> index;
  std::array<bool, 256> first_byte{};
  std::array<std::vector<uint32_t>, 256> lengths;  // distinct text lengths per first byte
};

}  // namespace moe::tok::detail

namespace moe::tok {

struct Tokenizer::Impl {
  std::string model;  // tokenizer.ggml.model
  std::string pre;    // tokenizer.ggml.pre
  int32_t n_vocab = 0;
  std::vector<std::string> text;    // vocabulary strings (byte-encoded form)
  std::vector<uint8_t> attr;        // TokenAttr bits
  std::vector<std::string> pieces;  // detokenized bytes per token (special rendering on)

  // BPE symbols: ids < n_vocab are tokens; larger ids are merge strings missing from the vocabulary.
  std::deque<std::string> extra_text;       // text of symbols >= n_vocab
  std::vector<std::string_view> sym_text;   // text of every symbol (into text / extra_text)
  detail::SymbolIndex sym_index;            // text -> symbol (the last token id with that text)
  int32_t sym_id(std::string_view s) const { return sym_index.find(s, sym_text); }
  std::array<int32_t, 256> byte_sym{};                   // raw byte -> initial symbol
  detail::MergeMap merges;
  size_t n_merges = 0;

  detail::SpecialSet special_all;   // parse_special = true
  detail::SpecialSet special_user;  // parse_special = false (USER_DEFINED only)

  int32_t bos = -1, eos = -1, eot = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  std::vector<int32_t> eog;         // sorted
  std::vector<uint8_t> eog_flag;    // per token
  std::optional<std::string> chat_template;

  std::string_view symbol_text(int32_t sym) const { return sym_text[size_t(sym)]; }
  // Appends the final ids for one BPE symbol (llama.cpp's per-byte fallback for missing strings).
  void emit_symbol(int32_t sym, std::vector<int32_t>& out) const {
    if (sym < n_vocab) out.push_back(sym);
    else emit_missing(sym, out);
  }
  void emit_missing(int32_t sym, std::vector<int32_t>& out) const;
};

}  // namespace moe::tok
