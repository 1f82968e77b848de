// ModelConfig (every qwen3moe hyperparameter, from metadata) and OwnedQuantizedModel (per-layer
// tensor views into the mapped GGUF, shapes and types validated against the config; zero copy).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe/gguf.hpp"
#include "moe/quant.hpp"

namespace moe::model {

enum class RopeScalingType { none, linear, yarn };

struct ModelConfig {
  std::string arch;               // the key prefix as stored: "qwen3moe" or "qwen3_moe"
  uint32_t n_layer = 0;           // block_count
  uint32_t n_embd = 0;            // embedding_length
  uint32_t n_head = 0;            // attention.head_count
  uint32_t n_head_kv = 0;         // attention.head_count_kv (default n_head)
  uint32_t head_dim = 0;          // attention.key_length (= value_length = rope dims)
  uint32_t n_expert = 0;          // expert_count
  uint32_t n_expert_used = 0;     // expert_used_count
  uint32_t expert_ffn = 0;        // expert_feed_forward_length (or feed_forward_length / n_used)
  uint32_t feed_forward_length = 0;
  uint32_t context_length = 0;
  uint32_t n_vocab = 0;           // length of tokenizer.ggml.tokens (or token_embd rows)
  float rms_eps = 0.f;
  float rope_base = 10000.f;
  RopeScalingType rope_scaling = RopeScalingType::none;
  float rope_freq_scale = 1.f;    // 1 / rope.scaling.factor
  uint32_t rope_n_ctx_orig = 0;
  float rope_attn_factor = 1.f;
  bool tied_output = false;       // output.weight absent: token_embd is the LM head

  uint32_t q_dim() const { return head_dim * n_head; }
  uint32_t kv_dim() const { return head_dim * n_head_kv; }

  // Reads every hyperparameter; Exit::unsupported for another architecture (naming it) or a
  // missing/invalid key ("'qwen3moe.expert_count' is missing from the GGUF metadata").
  static ModelConfig from_gguf(const gguf::File& f);
};

// A view of one tensor in the mapping.
struct Tensor {
  const gguf::TensorInfo* info = nullptr;
  gguf::Type type = gguf::Type::F32;
  const uint8_t* data = nullptr;
  int64_t ne[4] = {1, 1, 1, 1};
  size_t row_bytes = 0;     // bytes of one ne[0] row
  size_t matrix_bytes = 0;  // bytes of one [ne0, ne1] slice (an expert of a 3-D tensor)

  quant::Matrix matrix() const;        // 2-D: ne[1] rows of ne[0]
  quant::Matrix expert(int64_t e) const;  // 3-D: slice e
  const float* f32() const { return reinterpret_cast<const float*>(data); }
  explicit operator bool() const { return data != nullptr; }
};

struct Layer {
  Tensor attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm;
  Tensor ffn_norm, ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps;
};

struct OwnedQuantizedModel {
  std::shared_ptr<const gguf::File> file;
  ModelConfig config;
  Tensor token_embd, output_norm, output;  // output aliases token_embd when tied
  std::vector<Layer> layers;

  // Validates every required tensor (presence, type, shape):
  // "blk.7.ffn_down_exps.weight: expected [768, 2048, 128], found [...]" (Exit::unsupported);
  // IQ*/TQ* and other types the CPU cannot compute: Exit::unsupported naming tensor and type.
  static std::shared_ptr<const OwnedQuantizedModel> load(std::shared_ptr<const gguf::File> file);
  static std::shared_ptr<const OwnedQuantizedModel> open(const std::string& path);

  uint64_t weight_bytes() const;  // bytes of all tensors
};

}  // namespace moe::model
