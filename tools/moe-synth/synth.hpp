// moe-synth: writes synthetic qwen3moe GGUF files of any geometry (issue 6).
// Pieces: geometry + type mix (plan.cpp), tokenizer metadata (vocab.cpp), weight values (weights.cpp),
// GGUF layout and the streaming writer (writer.cpp), flags (main.cpp).
#pragma once
#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "moe/gguf.hpp"

namespace synth {

using moe::gguf::Type;

struct Geometry {
  uint32_t n_layer = 2;
  uint32_t n_embd = 256;
  uint32_t n_head = 4;
  uint32_t n_head_kv = 2;
  uint32_t head_dim = 64;
  uint32_t n_expert = 8;
  uint32_t n_expert_used = 2;
  uint32_t expert_ffn = 256;
  uint32_t context_length = 1024;
  float rope_base = 1e6f;
  float rms_eps = 1e-6f;
  bool tied = false;
};

// The file-level type choice (llama_ftype analogue).
enum class Mix { q4_k_m, q5_k_m, q6_k, q8_0, bf16, f16, f32 };
std::optional<Mix> parse_mix(const std::string& s);
const char* mix_name(Mix m);
uint32_t mix_file_type(Mix m);  // general.file_type (llama_ftype)
std::optional<Type> parse_type(const std::string& s);  // "q4_k", "Q6_K", "bf16", ...

struct TypeOverride {
  std::string pattern;  // as given (for messages)
  std::regex re;        // searched in the tensor name
  Type type;
};

// What each tensor holds, so the weight generator knows its distribution.
enum class Role {
  token_embd, output, output_norm, attn_norm, ffn_norm, qk_norm, attn_q, attn_k, attn_v, attn_output,
  router, expert_gate, expert_up, expert_down,
};

struct TensorPlan {
  std::string name;
  Role role;
  int layer = -1;          // -1 outside the blocks
  uint32_t n_dims = 1;
  int64_t ne[4] = {1, 1, 1, 1};
  Type type = Type::F32;
  uint64_t offset = 0;     // relative to the data section
  uint64_t nbytes = 0;
  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
};

// Every tensor of the model in file order (llama-quantize's order: by layer, then name), with the
// type the mix and the overrides give it. Offsets are filled by layout().
std::vector<TensorPlan> plan_tensors(const Geometry& g, uint32_t n_vocab, Mix mix,
                                     const std::vector<TypeOverride>& overrides);

// llama-quantize's layer set that gets more bits in *_M mixes.
bool use_more_bits(int i, int n);

// ---- tokenizer metadata ---------------------------------------------------------------------------
struct Vocab {
  std::string model = "gpt2";
  std::string pre = "qwen2";
  std::vector<std::string> tokens;
  std::vector<int32_t> token_type;
  std::vector<std::string> merges;
  uint32_t bos = 0, eos = 0, pad = 0;
  std::string chat_template;
};
// From a vocabulary GGUF; keep_ordinary > 0 keeps only the first keep_ordinary ordinary tokens
// (merges filtered to those fully inside the kept set) and re-appends the chat special tokens.
Vocab load_vocab(const std::string& path, uint32_t keep_ordinary);
// A byte-level vocabulary made here: 256 byte tokens, a few merges, the special tokens.
Vocab synthetic_vocab(uint32_t keep_ordinary);
extern const char* const kChatTemplate;

// ---- weights --------------------------------------------------------------------------------------
// Fills one row (row index over ne[1]*ne[2]*ne[3]) of a tensor with its deterministic values.
// Used for the tensors that are not pooled (below).
void generate_row(const Geometry& g, const TensorPlan& t, uint64_t seed, int64_t row, float* dst);

// Pooled tensors: the big matrices whose rows share one scale (embedding, attention, experts) are
// built from 256-element chunks drawn from a seeded pool of N(0,1) chunks, times the tensor's scale.
// Each pool chunk is quantized once per (type, scale) and copied, so writing a 30B-parameter
// model costs a copy per chunk instead of a quantizer run per element.
constexpr int64_t kPoolChunk = 256;
bool is_pooled(const Geometry& g, const TensorPlan& t);
float pooled_scale(const Geometry& g, const TensorPlan& t);
// The unit-normal pool: n_chunks * kPoolChunk floats.
std::vector<float> make_unit_pool(uint64_t seed, int64_t n_chunks);
// Pool chunk indices of a row's ne[0] / kPoolChunk chunks.
void pooled_row(uint64_t seed, const TensorPlan& t, int64_t row, int64_t n_pool, uint32_t* chunks);

// ---- writing --------------------------------------------------------------------------------------
struct WriteOptions {
  std::string path;
  uint64_t seed = 1;
  int threads = 1;
  bool progress = false;
  std::string name = "moe-synth";
  Mix mix = Mix::q4_k_m;
};
struct WriteStats {
  uint64_t file_bytes = 0;
  uint64_t data_bytes = 0;
  double seconds = 0;
};
WriteStats write_model(const Geometry& g, const Vocab& v, std::vector<TensorPlan>& tensors,
                       const WriteOptions& opt);

}  // namespace synth
