// Tokenizer metadata: copied from a vocabulary GGUF (optionally truncated) or made up here.
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "moe/error.hpp"
#include "synth.hpp"

namespace synth {

using moe::Error;
using moe::Exit;

// ChatML with Qwen3's thinking switch: enable_thinking=false pre-fills an empty think block.
const char* const kChatTemplate =
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}";

namespace {

constexpr int32_t kNormal = 1, kControl = 3, kUserDefined = 4;

struct Special {
  const char* text;
  int32_t type;
  bool essential;  // always present in a moe-synth vocabulary (the chat template and stopping need them)
};
// Qwen3's added tokens in id order from <|endoftext|> (REFERENCE.md §6.6).
constexpr Special kQwen3Added[] = {
    {"<|endoftext|>", kControl, true},       {"<|im_start|>", kControl, true},
    {"<|im_end|>", kControl, true},          {"<|object_ref_start|>", kControl, false},
    {"<|object_ref_end|>", kControl, false}, {"<|box_start|>", kControl, false},
    {"<|box_end|>", kControl, false},        {"<|quad_start|>", kControl, false},
    {"<|quad_end|>", kControl, false},       {"<|vision_start|>", kControl, false},
    {"<|vision_end|>", kControl, false},     {"<|vision_pad|>", kControl, false},
    {"<|image_pad|>", kControl, false},      {"<|video_pad|>", kControl, false},
    {"<tool_call>", kUserDefined, false},    {"</tool_call>", kUserDefined, false},
    {"<|fim_prefix|>", kControl, false},     {"<|fim_middle|>", kControl, false},
    {"<|fim_suffix|>", kControl, false},     {"<|fim_pad|>", kControl, false},
    {"<|repo_name|>", kControl, false},      {"<|file_sep|>", kControl, false},
    {"<tool_response>", kUserDefined, false}, {"</tool_response>", kUserDefined, false},
    {"<think>", kUserDefined, true},         {"</think>", kUserDefined, true},
};

bool is_filler(std::string_view s) {
  if (s.size() < 6 || s.substr(0, 4) != "[PAD" || s.back() != ']') return false;
  for (char c : s.substr(4, s.size() - 5))
    if (c < '0' || c > '9') return false;
  return true;
}

std::unordered_map<std::string_view, uint32_t> index_of(const std::vector<std::string>& tokens) {
  std::unordered_map<std::string_view, uint32_t> m;
  m.reserve(tokens.size() * 2);
  for (uint32_t i = 0; i < tokens.size(); ++i) m.emplace(tokens[i], i);
  return m;
}

// Special ids by text; bos/pad keep the source's meaning, eos is <|im_end|> as in Qwen3 chat models.
void assign_special_ids(Vocab& v, const std::string& bos_text, const std::string& pad_text) {
  const auto idx = index_of(v.tokens);
  const uint32_t eot = idx.at("<|endoftext|>");
  auto find = [&](const std::string& s) {
    auto it = idx.find(s);
    return it == idx.end() ? eot : it->second;
  };
  v.bos = find(bos_text);
  v.pad = find(pad_text);
  v.eos = idx.at("<|im_end|>");
}

// All tokens kept; Qwen3's added tokens that are missing take the places of [PADnnn] fillers in order
// (for the Qwen2 vocabulary that reproduces Qwen3's ids), the essential ones are appended otherwise.
void complete(Vocab& v) {
  auto idx = index_of(v.tokens);
  size_t filler = 0;
  std::vector<std::pair<std::string, int32_t>> appended;
  for (const auto& s : kQwen3Added) {
    if (idx.count(s.text)) continue;
    while (filler < v.tokens.size() && !is_filler(v.tokens[filler])) ++filler;
    if (filler < v.tokens.size()) {
      v.tokens[filler] = s.text;
      v.token_type[filler] = s.type;
      ++filler;
    } else if (s.essential) {
      appended.emplace_back(s.text, s.type);
    }
  }
  for (auto& [text, type] : appended) {
    v.tokens.push_back(text);
    v.token_type.push_back(type);
  }
}

// The first `keep` ordinary tokens, the merges whose parts and result all survive, then the essential
// special tokens appended with fresh ids.
Vocab truncate(const Vocab& src, uint32_t keep) {
  Vocab v;
  v.model = src.model;
  v.pre = src.pre;
  for (size_t i = 0; i < src.tokens.size() && v.tokens.size() < keep; ++i) {
    if (src.token_type[i] != kNormal) continue;
    v.tokens.push_back(src.tokens[i]);
    v.token_type.push_back(kNormal);
  }
  if (v.tokens.size() < keep)
    throw Error(Exit::usage, fmt::format("--vocab-size {}: the vocabulary has only {} ordinary tokens", keep,
                                         v.tokens.size()));
  const std::unordered_set<std::string_view> kept(v.tokens.begin(), v.tokens.end());
  std::string joined;
  for (const auto& m : src.merges) {
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 >= m.size()) continue;
    const std::string_view a(m.data(), sp), b(m.data() + sp + 1, m.size() - sp - 1);
    joined.assign(a);
    joined.append(b);
    if (kept.count(a) && kept.count(b) && kept.count(joined)) v.merges.push_back(m);
  }
  for (const auto& s : kQwen3Added) {
    if (!s.essential) continue;
    v.tokens.push_back(s.text);
    v.token_type.push_back(s.type);
  }
  return v;
}

std::string text_of(const Vocab& v, uint32_t id) { return id < v.tokens.size() ? v.tokens[id] : std::string(); }

Vocab finish(Vocab src, uint32_t keep_ordinary) {
  const std::string bos = text_of(src, src.bos), pad = text_of(src, src.pad);
  Vocab v;
  if (keep_ordinary > 0) {
    v = truncate(src, keep_ordinary);
  } else {
    v = std::move(src);
    complete(v);
  }
  assign_special_ids(v, bos, pad);
  v.chat_template = kChatTemplate;
  return v;
}

// GPT-2's byte-to-code-point map: printable bytes map to themselves, the rest to 256 + n.
std::string byte_token(int b) {
  int cp = b;
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

}  // namespace

Vocab load_vocab(const std::string& path, uint32_t keep_ordinary) {
  auto f = moe::gguf::File::open(path);
  Vocab src;
  src.model = std::string(f->get_string("tokenizer.ggml.model"));
  if (auto pre = f->opt_string("tokenizer.ggml.pre")) src.pre = std::string(*pre);
  for (auto s : f->get_string_array("tokenizer.ggml.tokens")) src.tokens.emplace_back(s);
  src.token_type.assign(src.tokens.size(), kNormal);
  if (f->has("tokenizer.ggml.token_type")) {
    const auto& a = f->get_array("tokenizer.ggml.token_type", moe::gguf::ValueType::INT32);
    if (a.count < src.tokens.size())
      throw Error(Exit::bad_file, fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", path,
                                              a.count, src.tokens.size()));
    for (size_t i = 0; i < src.tokens.size(); ++i) src.token_type[i] = static_cast<int32_t>(a.int_at(i));
  }
  if (f->has("tokenizer.ggml.merges"))
    for (auto s : f->get_string_array("tokenizer.ggml.merges")) src.merges.emplace_back(s);
  src.bos = f->opt_u32("tokenizer.ggml.bos_token_id").value_or(UINT32_MAX);
  src.pad = f->opt_u32("tokenizer.ggml.padding_token_id").value_or(src.bos);
  if (src.model != "gpt2")
    throw Error(Exit::unsupported,
                fmt::format("{}: tokenizer.ggml.model is '{}', moe-synth writes byte-level BPE ('gpt2') models", path,
                            src.model));
  return finish(std::move(src), keep_ordinary);
}

Vocab synthetic_vocab(uint32_t keep_ordinary) {
  Vocab src;
  for (int b = 0; b < 256; ++b) src.tokens.push_back(byte_token(b));
  // A handful of English merges so that ordinary text does not tokenize byte by byte.
  const std::string sp = byte_token(' ');
  const std::pair<std::string, std::string> pairs[] = {
      {sp, "t"}, {sp, "a"}, {"h", "e"}, {"i", "n"}, {"r", "e"}, {"o", "n"}, {sp + "t", "he"}, {"e", "r"},
      {sp, "s"}, {"a", "t"}, {sp, "w"}, {"o", "r"}, {"e", "n"}, {sp, "c"}, {"i", "s"}, {"i", "t"},
      {"a", "n"}, {sp, "o"}, {"e", "s"}, {sp, "i"}, {sp + "a", "n"}, {"an", "d"}, {sp + "o", "f"}, {"in", "g"},
  };
  for (const auto& [a, b] : pairs) {
    src.merges.push_back(a + " " + b);
    src.tokens.push_back(a + b);
  }
  src.token_type.assign(src.tokens.size(), kNormal);
  src.bos = src.pad = UINT32_MAX;  // -> <|endoftext|>
  return finish(std::move(src), keep_ordinary);
}

}  // namespace synth
