// The CPU forward of qwen3moe (REFERENCE.md §4) over the zero-copy views of an OwnedQuantizedModel.
// One Forward owns one sequence's fp16 KV cache and all its scratch, sized at construction, so
// eval() allocates nothing beyond growing the caller's logits vector.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moe/forward.hpp"
#include "moe/model.hpp"
#include "moe/quant.hpp"

namespace moe::cpu {

struct Options {
  int64_t n_ctx = 0;                           // KV-cache length (positions); 0 = the model's context_length
  quant::ActMode mode = quant::ActMode::fast;  // fast = Q8 activations (production); exact = FP32 (F2 guard)
  quant::ThreadPool* pool = nullptr;           // required; shared with the caller
  int64_t max_batch = 512;                     // tokens per pass; longer evals run in chunks of this
  // For tests comparing other forwards against this one: when set, every eval appends one value per
  // position it evaluates, the smallest router margin over the layers whose MoE block ran for it:
  // log p_k - log p_(k+1) of its router probabilities in descending order (k = n_expert_used; +inf
  // when every expert is used). A margin near zero is a near-tie that rounding elsewhere may flip.
  std::vector<float>* router_margins = nullptr;
};

// A Forward over the model's views. Throws moe::Error: Exit::resources if the KV cache/scratch
// cannot be allocated (the message gives the numbers) or an eval would run past n_ctx;
// Exit::inference if logits are non-finite (naming the position); Exit::usage for a missing pool,
// bad options or a token id outside the vocabulary.
std::unique_ptr<Forward> make_forward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o);

// Bytes the KV cache + scratch of make_forward would allocate (checked before allocating): an upper
// bound over the tensor types a model may use, with per-thread buffers for `n_threads` threads
// (memory_bytes assumes std::thread::hardware_concurrency()).
uint64_t memory_bytes(const model::ModelConfig& c, int64_t n_ctx, int64_t max_batch);
uint64_t memory_bytes(const model::ModelConfig& c, int64_t n_ctx, int64_t max_batch, int n_threads);

// Bytes of the fp16 KV cache alone (K and V of every layer).
uint64_t kv_bytes(const model::ModelConfig& c, int64_t n_ctx);

}  // namespace moe::cpu
