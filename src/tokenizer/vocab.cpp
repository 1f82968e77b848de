// Loading the vocabulary from GGUF metadata (REFERENCE §2.5, §6.6, §6.7): tokens, types, merges,
// special ids, the special-token candidate lists, the end-of-generation set and the piece cache.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "internal.hpp"

namespace moe::tok {

namespace {

constexpr std::string_view kModelKey = "tokenizer.ggml.model";
constexpr std::string_view kPreKey = "tokenizer.ggml.pre";
constexpr std::string_view kTokensKey = "tokenizer.ggml.tokens";
constexpr std::string_view kTypesKey = "tokenizer.ggml.token_type";
constexpr std::string_view kMergesKey = "tokenizer.ggml.merges";

// Pre-tokenizer names llama.cpp maps to its QWEN2 pre-tokenizer.
bool is_qwen2_pre(std::string_view pre) {
  return pre == "qwen2" || pre == "deepseek-r1-qwen" || pre == "kormo" || pre == "f2llmv2" ||
         pre == "megrez";
}

uint8_t attr_from_type(int64_t t) {
  switch (t) {
    case int64_t(TokenType::normal): return kAttrNormal;
    case int64_t(TokenType::unknown): return kAttrUnknown;
    case int64_t(TokenType::control): return kAttrControl;
    case int64_t(TokenType::user_defined): return kAttrUserDefined;
    case int64_t(TokenType::unused): return kAttrUnused;
    case int64_t(TokenType::byte): return kAttrByte;
    default: return 0;  // undefined: never matched, renders as nothing
  }
}

// Token texts llama.cpp treats as end of generation wherever they occur in a vocabulary
// (llama_vocab::impl::load, "maintain a list of tokens that cause end-of-generation").
bool is_eog_text(std::string_view t) {
  static constexpr std::string_view kTexts[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
      "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
      "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
  };
  return std::find(std::begin(kTexts), std::end(kTexts), t) != std::end(kTexts);
}

// Texts of the tokens llama.cpp auto-detects per role when the file names no id for the role; the
// detected token is marked CONTROL. Roles: EOT, EOM, FIM prefix, suffix, middle, pad, repo, sep.
enum Role { kEot, kEom, kFimPre, kFimSuf, kFimMid, kFimPad, kFimRep, kFimSep, kRoles };
constexpr std::string_view kRoleKeys[kRoles] = {
    "tokenizer.ggml.eot_token_id",     "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id",
};
// Every text the auto-detection looks for starts with one of these and is short: a cheap filter.
bool maybe_named(std::string_view t) {
  return t.size() >= 3 && t.size() <= 24 && (t[0] == '<' || t[0] == '[' || t[0] == '_');
}

bool role_text(int role, std::string_view t) {
  auto any = [&](std::initializer_list<std::string_view> l) {
    return std::find(l.begin(), l.end(), t) != l.end();
  };
  switch (role) {
    case kEot:
      return any({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                  "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>"});
    case kEom: return t == "<|eom_id|>";
    case kFimPre:
      return any({"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>",
                  "<|prefix|>"});
    case kFimSuf:
      return any({"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>",
                  "<|suffix|>"});
    case kFimMid:
      return any({"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>",
                  "<|middle|>"});
    case kFimPad: return any({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"});
    case kFimRep:
      return any({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"});
    case kFimSep: return t == "<|file_sep|>";
    default: return false;
  }
}

std::optional<int32_t> read_special_id(const gguf::File& f, std::string_view key, int32_t n_vocab) {
  const auto v = f.opt_u32(key);
  if (!v) return std::nullopt;
  if (*v >= uint32_t(n_vocab))
    fail(Exit::unsupported, "'{}' = {} is not a token id (the vocabulary has {} tokens)", key, *v,
         n_vocab);
  return int32_t(*v);
}

// The rendering of one token with special rendering on (llama.cpp token_to_piece, special = true).
std::string render_piece(std::string_view text, uint8_t attr) {
  if (attr & (kAttrControl | kAttrUnknown | kAttrUserDefined)) return std::string(text);
  if (attr & kAttrNormal) {
    std::string out;
    out.reserve(text.size());
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t i = 0; i < text.size();) {
      uint32_t cp;
      size_t len = detail::utf8_decode(p, text.size(), i, cp);
      if (len == 0) {  // malformed vocabulary string: llama.cpp drops such bytes too
        ++i;
        continue;
      }
      const int b = detail::byte_from_cp(cp);
      if (b >= 0) {
        out.push_back(char(b));
      } else {
        // llama.cpp's llama_decode_text writes this marker followed by the whole token text.
        out += "[UNK_BYTE_0x";
        for (size_t k = 0; k < len; ++k) out += fmt::format("{:02x}", p[i + k]);
        out += text;
        out += "]";
      }
      i += len;
    }
    return out;
  }
  if (attr & kAttrByte) {  // SPM-style <0xXX> byte tokens
    if (text.size() == 6 && text.substr(0, 3) == "<0x" && text[5] == '>') {
      unsigned v = 0;
      for (char c : text.substr(3, 2)) {
        v <<= 4;
        if (c >= '0' && c <= '9') v |= unsigned(c - '0');
        else if (c >= 'a' && c <= 'f') v |= unsigned(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= unsigned(c - 'A' + 10);
        else return {};
      }
      return std::string(1, char(v));
    }
  }
  return {};
}

void build_special_set(const Tokenizer::Impl& t, bool parse_special, detail::SpecialSet& set) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < t.n_vocab; ++id) {
    const uint8_t a = t.attr[size_t(id)];
    if (!(a & (kAttrControl | kAttrUserDefined | kAttrUnknown))) continue;
    if (!parse_special && (a & (kAttrControl | kAttrUnknown))) continue;
    ids.push_back(id);
  }
  // llama.cpp sorts by length only (std::sort); equal lengths keep id order here.
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return t.text[size_t(a)].size() > t.text[size_t(b)].size();
  });
  for (int32_t id : ids) {
    const std::string_view s = t.text[size_t(id)];
    const auto idx = uint32_t(set.by_priority.size());
    set.by_priority.push_back({id, s});
    set.index.emplace(s, idx);
    const auto b = static_cast<unsigned char>(s[0]);
    set.first_byte[b] = true;
    auto& lens = set.lengths[b];
    if (std::find(lens.begin(), lens.end(), uint32_t(s.size())) == lens.end())
      lens.push_back(uint32_t(s.size()));
  }
}

}  // namespace

void Tokenizer::Impl::emit_missing(int32_t sym, std::vector<int32_t>& out) const {
  // A merge produced a string the vocabulary lacks: llama.cpp looks up each byte of it alone.
  for (char c : symbol_text(sym)) {
    const int32_t id = sym_id(std::string_view(&c, 1));
    if (id >= 0 && id < n_vocab) out.push_back(id);
  }
}

namespace detail {

void MergeMap::reserve(size_t n) {
  size_t cap = 16;
  unsigned bits = 4;
  while (cap * 3 < n * 4) cap <<= 1, ++bits;  // load factor <= 0.75
  std::vector<uint64_t> old = std::move(slots_);
  slots_.assign(cap, kEmpty);
  mask_ = cap - 1;
  shift_ = 64 - bits;
  for (uint64_t s : old)
    if (s != kEmpty) place(s);
}

void MergeMap::place(uint64_t slot) {
  size_t i = hash(slot >> 22);
  while (slots_[i] != kEmpty) i = (i + 1) & mask_;
  slots_[i] = slot;
}

void MergeMap::insert(int32_t left, int32_t right, int32_t rank, int32_t result) {
  if ((size_ + 1) * 4 > slots_.size() * 3) reserve(std::max<size_t>(16, slots_.size()));
  const uint64_t key = pack(left, right);
  size_t i = hash(key);
  while (slots_[i] != kEmpty) {
    if ((slots_[i] >> 22) == key) return;
    i = (i + 1) & mask_;
  }
  slots_[i] = (key << 22) | uint64_t(rank);
  if (results_.size() <= size_t(rank)) results_.resize(size_t(rank) + 1, -1);
  results_[size_t(rank)] = result;
  ++size_;
}

}  // namespace detail

Tokenizer Tokenizer::from_gguf(const gguf::File& f) {
  auto impl = std::make_shared<Impl>();
  Impl& t = *impl;

  if (!f.has(kModelKey)) fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", kModelKey);
  t.model = std::string(f.get_string(kModelKey));
  if (t.model != "gpt2")
    fail(Exit::unsupported, "'{}' = '{}' is not supported (only 'gpt2' byte-level BPE)", kModelKey,
         t.model);
  if (!f.has(kPreKey))
    fail(Exit::unsupported,
         "'{}' is missing from the GGUF metadata (the qwen2 pre-tokenizer is required)", kPreKey);
  t.pre = std::string(f.get_string(kPreKey));
  if (!is_qwen2_pre(t.pre))
    fail(Exit::unsupported, "'{}' = '{}' is not supported (supported: qwen2 and its aliases)",
         kPreKey, t.pre);

  // ---- tokens and types
  if (!f.has(kTokensKey)) fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", kTokensKey);
  const auto& tokens = f.get_string_array(kTokensKey);
  if (tokens.empty()) fail(Exit::unsupported, "'{}' is empty", kTokensKey);
  if (tokens.size() > size_t(INT32_MAX) / 2)
    fail(Exit::unsupported, "'{}' has too many entries ({})", kTokensKey, tokens.size());
  t.n_vocab = int32_t(tokens.size());
  t.text.resize(tokens.size());
  t.attr.assign(tokens.size(), kAttrNormal);
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.text[i] = tokens[i].empty() ? fmt::format("[EMPTY_{}]", i) : std::string(tokens[i]);
  }
  if (f.has(kTypesKey)) {
    const gguf::Value& types = f.get_array(kTypesKey, gguf::ValueType::INT32);
    if (types.count < tokens.size())
      fail(Exit::unsupported, "'{}' has {} entries, fewer than the {} tokens", kTypesKey,
           types.count, tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) t.attr[i] = attr_from_type(types.int_at(i));
  }
  t.sym_text.assign(t.text.begin(), t.text.end());
  t.sym_index.reserve(tokens.size() + 1024);
  for (size_t i = 0; i < tokens.size(); ++i) t.sym_index.put(int32_t(i), t.sym_text, true);

  // ---- BPE symbols and merges
  auto intern = [&](std::string_view s) -> int32_t {
    const int32_t found = t.sym_id(s);
    if (found >= 0) return found;
    t.extra_text.emplace_back(s);
    const auto id = int32_t(t.sym_text.size());
    t.sym_text.emplace_back(t.extra_text.back());
    t.sym_index.put(id, t.sym_text, false);
    return id;
  };
  for (int b = 0; b < 256; ++b) {
    std::string enc;
    detail::utf8_append(enc, detail::byte_to_cp(uint8_t(b)));
    t.byte_sym[size_t(b)] = intern(enc);
  }
  if (!f.has(kMergesKey)) fail(Exit::unsupported, "'{}' is missing from the GGUF metadata", kMergesKey);
  const auto& merges = f.get_string_array(kMergesKey);
  t.n_merges = merges.size();
  if (merges.size() >= detail::MergeMap::kMaxRanks)
    fail(Exit::unsupported, "'{}' has {} entries; at most {} are supported", kMergesKey, merges.size(),
         detail::MergeMap::kMaxRanks - 1);
  t.merges.reserve(merges.size());
  std::string joined;
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string_view m = merges[r];
    const size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
    if (sp == std::string_view::npos) continue;  // cannot match any pair of symbols
    const std::string_view a = m.substr(0, sp), b = m.substr(sp + 1);
    if (a.empty() || b.empty()) continue;
    joined.assign(a);
    joined += b;
    const int32_t ia = intern(a), ib = intern(b), iab = intern(joined);
    if (t.sym_text.size() > detail::MergeMap::kMaxSymbols)
      fail(Exit::unsupported, "'{}' and '{}' define more than {} distinct symbols", kTokensKey,
           kMergesKey, detail::MergeMap::kMaxSymbols);
    t.merges.insert(ia, ib, int32_t(r), iab);
  }

  // ---- special ids and flags
  const int32_t n = t.n_vocab;
  t.bos = read_special_id(f, "tokenizer.ggml.bos_token_id", n).value_or(-1);
  t.eos = read_special_id(f, "tokenizer.ggml.eos_token_id", n).value_or(-1);
  t.pad = read_special_id(f, "tokenizer.ggml.padding_token_id", n).value_or(-1);
  int32_t role_id[kRoles];
  bool role_from_key[kRoles];
  for (int r = 0; r < kRoles; ++r) {
    const auto v = read_special_id(f, kRoleKeys[r], n);
    role_id[r] = v.value_or(-1);
    role_from_key[r] = v.has_value();
  }
  for (auto key : {"tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id",
                   "tokenizer.ggml.mask_token_id"})
    (void)read_special_id(f, key, n);  // validated only
  t.add_bos = f.opt_bool("tokenizer.ggml.add_bos_token").value_or(false);
  t.add_eos = f.opt_bool("tokenizer.ggml.add_eos_token").value_or(false);
  if (t.add_bos && t.bos < 0)
    fail(Exit::unsupported, "'tokenizer.ggml.add_bos_token' is true but 'tokenizer.ggml.bos_token_id' is missing");
  if (t.add_eos && t.eos < 0)
    fail(Exit::unsupported, "'tokenizer.ggml.add_eos_token' is true but 'tokenizer.ggml.eos_token_id' is missing");

  // ---- auto-detection from token text, as llama.cpp does at load. It walks its text -> id map, so
  // with duplicated texts only the last id of each text takes part.
  std::set<int32_t> eog;
  for (int32_t id = 0; id < n; ++id) {
    const std::string& s = t.text[size_t(id)];
    if (!maybe_named(s) || t.sym_id(s) != id) continue;
    for (int r = 0; r < kRoles; ++r) {
      if (role_from_key[r] || role_id[r] >= 0 || !role_text(r, s)) continue;
      role_id[r] = id;  // the first match (llama.cpp's pick follows its hash map order)
      t.attr[size_t(id)] |= kAttrControl;
    }
  }
  for (int r : {kFimPad, kFimRep, kFimSep})
    if (role_id[r] >= 0) eog.insert(role_id[r]);
  for (int32_t id = 0; id < n; ++id) {
    const std::string& s = t.text[size_t(id)];
    if (maybe_named(s) && is_eog_text(s) && t.sym_id(s) == id) {
      eog.insert(id);
      t.attr[size_t(id)] |= kAttrControl;
    }
  }
  t.eot = role_id[kEot];
  // llama.cpp's "quick hack for gpt-oss": these always render and match as user-defined text.
  for (int32_t id = 0; id < n; ++id) {
    const std::string& s = t.text[size_t(id)];
    if ((s == "<|channel|>" || s == "<|message|>" || s == "<|start|>" || s == "<|constrain|>") &&
        t.sym_id(s) == id)
      t.attr[size_t(id)] = kAttrUserDefined;
  }
  if (t.eos >= 0) eog.insert(t.eos);
  if (t.eot >= 0) eog.insert(t.eot);
  if (role_id[kEom] >= 0) eog.insert(role_id[kEom]);
  {
    // o200k_harmony / solar-open: with <|return|>+<|call|> (or <|calls|>+<|flush|>), <|end|> is not EOG;
    // gemma4 / paddleocr: with <|tool_response>, </s> is not EOG.
    auto find_text = [&](std::string_view s) -> int32_t {
      for (int32_t id : eog)
        if (t.text[size_t(id)] == s) return id;
      return -1;
    };
    const int32_t end_id = find_text("<|end|>");
    const bool has_call = find_text("<|call|>") >= 0 || find_text("<|calls|>") >= 0;
    if (end_id >= 0 && has_call && (find_text("<|return|>") >= 0 || find_text("<|flush|>") >= 0)) {
      eog.erase(end_id);
      t.attr[size_t(end_id)] = kAttrUserDefined;
    }
    const int32_t s_id = find_text("</s>");
    if (s_id >= 0 && find_text("<|tool_response>") >= 0) {
      eog.erase(s_id);
      t.attr[size_t(s_id)] = kAttrNormal;
    }
  }
  t.eog.assign(eog.begin(), eog.end());
  t.eog_flag.assign(size_t(n), 0);
  for (int32_t id : t.eog) t.eog_flag[size_t(id)] = 1;

  if (auto tmpl = f.opt_string("tokenizer.chat_template")) t.chat_template = std::string(*tmpl);

  build_special_set(t, true, t.special_all);
  build_special_set(t, false, t.special_user);
  t.pieces.resize(size_t(n));
  for (int32_t id = 0; id < n; ++id) t.pieces[size_t(id)] = render_piece(t.text[size_t(id)], t.attr[size_t(id)]);

  Tokenizer out;
  out.impl_ = std::move(impl);
  return out;
}

}  // namespace moe::tok
