// Tokenization (REFERENCE §6.1): special-token partition, qwen2 pre-tokenization, byte-level BPE,
// and the accessors of Tokenizer.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "internal.hpp"

namespace moe::tok {

namespace {

struct Segment {
  size_t begin, end;  // raw text byte range; a token when id >= 0
  int32_t id;
};

// llama.cpp's tokenizer_st_partition: for each candidate in priority order (longest first), cut
// every non-overlapping occurrence out of the text that earlier candidates left. Occurrences are
// found in one pass over the text (first-byte filter, then a hash lookup per candidate length) and
// then granted in that same priority order, which gives the same cuts without rescanning the text
// once per candidate.
void partition(const detail::SpecialSet& set, std::string_view text, std::vector<Segment>& out) {
  out.clear();
  const size_t n = text.size();
  struct Occ {
    uint32_t prio;
    size_t pos;
  };
  std::vector<Occ> occ;
  if (!set.by_priority.empty()) {
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t i = 0; i < n; ++i) {
      if (!set.first_byte[p[i]]) continue;
      for (uint32_t len : set.lengths[p[i]]) {
        if (len > n - i) continue;
        const auto it = set.index.find(text.substr(i, len));
        if (it != set.index.end()) occ.push_back({it->second, i});
      }
    }
  }
  if (occ.empty()) {
    if (n > 0) out.push_back({0, n, -1});
    return;
  }
  std::sort(occ.begin(), occ.end(),
            [](const Occ& a, const Occ& b) { return a.prio != b.prio ? a.prio < b.prio : a.pos < b.pos; });
  std::vector<uint8_t> claimed(n, 0);
  std::vector<Segment> tokens;
  // An occurrence overlapping an earlier cut (a longer candidate's, or the same candidate's to its
  // left) is not in any remaining fragment, so it is skipped.
  for (const Occ& o : occ) {
    const size_t len = set.by_priority[o.prio].text.size();
    if (std::find(claimed.begin() + long(o.pos), claimed.begin() + long(o.pos + len), 1) !=
        claimed.begin() + long(o.pos + len))
      continue;
    std::fill(claimed.begin() + long(o.pos), claimed.begin() + long(o.pos + len), 1);
    tokens.push_back({o.pos, o.pos + len, set.by_priority[o.prio].id});
  }
  std::sort(tokens.begin(), tokens.end(), [](const Segment& a, const Segment& b) { return a.begin < b.begin; });
  size_t at = 0;
  for (const Segment& t : tokens) {
    if (t.begin > at) out.push_back({at, t.begin, -1});
    out.push_back(t);
    at = t.end;
  }
  if (at < n) out.push_back({at, n, -1});
}

// Word -> ids cache for one encode call: open addressing over 16-byte slots; the words are copied
// into one arena and their ids into one buffer, so a lookup touches little memory. It starts small
// and doubles, so its size follows the number of distinct words, not the length of the text.
class WordCache {
 public:
  static constexpr size_t kMaxLen = 0xFFFF;  // longer words (or more ids) are not cached
  WordCache() { grow(); }
  // Appends the cached ids of `w` to `out`; false when `w` is not cached.
  bool get(std::string_view w, uint32_t h, std::vector<int32_t>& out) const {
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == 0) return false;
      if (s.hash == h && s.len == w.size() && std::memcmp(arena_.data() + s.key_off, w.data(), w.size()) == 0) {
        out.insert(out.end(), ids_.begin() + s.ids_off, ids_.begin() + s.ids_off + s.ids_len);
        return true;
      }
    }
  }
  void put(std::string_view w, uint32_t h, const int32_t* ids, size_t n) {
    if (w.empty() || w.size() > kMaxLen || n > kMaxLen) return;
    if ((used_ + 1) * 2 > slots_.size()) grow();
    size_t i = h & mask_;
    while (slots_[i].len != 0) i = (i + 1) & mask_;
    slots_[i] = {h, uint32_t(ids_.size()), uint32_t(arena_.size()), uint16_t(w.size()), uint16_t(n)};
    arena_.append(w);
    ids_.insert(ids_.end(), ids, ids + n);
    ++used_;
  }
  bool full() const { return arena_.size() > UINT32_MAX - 2 * kMaxLen || ids_.size() > UINT32_MAX - 2 * kMaxLen; }

 private:
  struct Slot {
    uint32_t hash = 0;
    uint32_t ids_off = 0;
    uint32_t key_off = 0;
    uint16_t len = 0;  // 0: empty slot
    uint16_t ids_len = 0;
  };
  void grow() {
    std::vector<Slot> old(slots_.empty() ? 256 : slots_.size() * 2);
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.len == 0) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].len != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
  std::string arena_;
  std::vector<int32_t> ids_;
};

// Per-call state: scratch buffers and the word -> ids cache (words repeat a lot in real text).
struct Session {
  const Tokenizer::Impl& t;
  detail::SplitScratch split;
  std::vector<uint32_t> ends;
  struct Sym {
    int32_t id, prev, next;
  };
  std::vector<Sym> syms;
  struct Cand {
    uint64_t key;  // rank << 32 | left: the lowest rank first, then the leftmost
    int32_t right, lid, rid;
  };
  std::vector<Cand> heap;
  WordCache cache;
  std::string owned;  // a sanitized copy of the current fragment

  explicit Session(const Tokenizer::Impl& impl) : t(impl) {}

  void push_pair(int32_t left) {
    if (left < 0) return;
    const int32_t right = syms[size_t(left)].next;
    if (right < 0) return;
    const int32_t lid = syms[size_t(left)].id, rid = syms[size_t(right)].id;
    const int32_t rank = t.merges.find(lid, rid);
    if (rank < 0) return;
    heap.push_back({(uint64_t(uint32_t(rank)) << 32) | uint32_t(left), right, lid, rid});
    std::push_heap(heap.begin(), heap.end(), [](const Cand& a, const Cand& b) { return a.key > b.key; });
  }

  // BPE over one word of raw bytes (REFERENCE §6.4): one symbol per byte, then merges popped from a
  // min-heap by (rank, left); stale entries are skipped when either side has changed since.
  void bpe(std::string_view word, std::vector<int32_t>& out) {
    const size_t n = word.size();
    if (n == 1) {
      t.emit_symbol(t.byte_sym[static_cast<unsigned char>(word[0])], out);
      return;
    }
    syms.resize(n);
    for (size_t i = 0; i < n; ++i)
      syms[i] = {t.byte_sym[static_cast<unsigned char>(word[i])], int32_t(i) - 1,
                 i + 1 < n ? int32_t(i + 1) : -1};
    heap.clear();
    for (size_t i = 0; i + 1 < n; ++i) push_pair(int32_t(i));
    const auto cmp = [](const Cand& a, const Cand& b) { return a.key > b.key; };
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), cmp);
      const Cand c = heap.back();
      heap.pop_back();
      const int32_t left = int32_t(uint32_t(c.key));
      Sym& l = syms[size_t(left)];
      if (l.id != c.lid || l.next != c.right) continue;
      Sym& r = syms[size_t(c.right)];
      if (r.id != c.rid) continue;
      l.id = t.merges.result(int32_t(c.key >> 32));
      l.next = r.next;
      if (r.next >= 0) syms[size_t(r.next)].prev = left;
      r.id = -1;
      r.next = -1;
      if (l.prev >= 0) push_pair(l.prev);
      push_pair(left);
    }
    for (int32_t i = 0; i >= 0; i = syms[size_t(i)].next) t.emit_symbol(syms[size_t(i)].id, out);
  }

  void word(std::string_view w, std::vector<int32_t>& out) {
    const uint32_t h = detail::hash_bytes(w);
    if (cache.get(w, h, out)) return;
    const size_t before = out.size();
    bpe(w, out);
    if (!cache.full()) cache.put(w, h, out.data() + before, out.size() - before);
  }

  void fragment(std::string_view raw, std::vector<int32_t>& out) {
    std::string_view text = raw;
    if (!detail::utf8_valid(raw)) {
      owned = detail::utf8_sanitize(raw);
      text = owned;
    }
    ends.clear();
    detail::split_qwen2(text, ends, split);
    size_t at = 0;
    for (uint32_t e : ends) {
      word(text.substr(at, e - at), out);
      at = e;
    }
  }
};

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& t = *impl_;
  // Offsets inside a fragment are 32-bit (half the scratch memory of 64-bit ones).
  if (text.size() >= UINT32_MAX)
    fail(Exit::resources, "the text to tokenize is {} bytes; at most {} bytes are supported", text.size(),
         UINT32_MAX - 1);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<Segment> segs;
  partition(parse_special ? t.special_all : t.special_user, text, segs);
  Session s(t);
  for (const Segment& g : segs) {
    if (g.id >= 0) {
      out.push_back(g.id);
    } else {
      s.fragment(text.substr(g.begin, g.end - g.begin), out);
    }
  }
  return out;
}

const std::string& Tokenizer::piece_ref(int32_t id) const {
  if (id < 0 || id >= impl_->n_vocab)
    fail(Exit::usage, "token id {} is outside the vocabulary [0, {})", id, impl_->n_vocab);
  return impl_->pieces[size_t(id)];
}

std::string Tokenizer::piece(int32_t id) const { return piece_ref(id); }

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += piece_ref(id);
  return out;
}

const std::string& Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= impl_->n_vocab)
    fail(Exit::usage, "token id {} is outside the vocabulary [0, {})", id, impl_->n_vocab);
  return impl_->text[size_t(id)];
}

uint8_t Tokenizer::token_attr(int32_t id) const {
  if (id < 0 || id >= impl_->n_vocab)
    fail(Exit::usage, "token id {} is outside the vocabulary [0, {})", id, impl_->n_vocab);
  return impl_->attr[size_t(id)];
}

int32_t Tokenizer::n_vocab() const { return impl_->n_vocab; }
size_t Tokenizer::n_merges() const { return impl_->n_merges; }
const std::string& Tokenizer::pre() const { return impl_->pre; }
bool Tokenizer::is_eog(int32_t id) const {
  return id >= 0 && id < impl_->n_vocab && impl_->eog_flag[size_t(id)] != 0;
}
const std::vector<int32_t>& Tokenizer::eog_ids() const { return impl_->eog; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
int32_t Tokenizer::bos_id() const { return impl_->bos; }
bool Tokenizer::add_eos() const { return impl_->add_eos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
const std::string* Tokenizer::chat_template() const {
  return impl_->chat_template ? &*impl_->chat_template : nullptr;
}

std::string Tokenizer::summary() const {
  const Impl& t = *impl_;
  std::string eog;
  for (int32_t id : t.eog) eog += fmt::format("{}{}", eog.empty() ? "" : ",", id);
  auto id_str = [](int32_t id) { return id < 0 ? std::string("none") : std::to_string(id); };
  return fmt::format(
      "{} byte-level BPE, pre {}, {} tokens, {} merges, {} special; bos {}{}, eos {}, eog [{}]; "
      "chat template {}",
      t.model, t.pre, t.n_vocab, t.n_merges, t.special_all.by_priority.size(), id_str(t.bos),
      t.add_bos ? " (added)" : " (not added)", id_str(t.eos), eog,
      !t.chat_template                       ? "none"
      : template_is_chatml(*t.chat_template) ? "present (ChatML)"
                                             : "present (not ChatML)");
}

}  // namespace moe::tok
