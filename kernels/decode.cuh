// Host entry of the persistent decode kernel (decode.cu): one launch runs a whole token step (embedding,
// every layer, LM head, argmax) with grid-wide barriers between the phases. Plain C++.
#pragma once
#include <cuda_fp16.h>

#include "launch.cuh"

namespace moe::cuda::k {

struct DecLayer {
  Mat q, k, v, o, router, gate, up, down;
  const float *attn_norm, *ffn_norm, *q_norm, *k_norm;
  __half *k_cache, *v_cache;
};

struct DecodeArgs {
  const DecLayer* layers;  // device array of n_layer entries
  int n_layer;
  Mat embd, output;
  const float* out_norm;
  int n_embd, n_head, n_head_kv, head_dim, n_expert, n_used;
  float eps;
  Rope rope;
  const int32_t* token;  // device: the token id and its position
  const int32_t* pos;
  float *x, *qkv, *o, *router_logits, *act, *logits;
  float* partials;  // attention slices: [n_head_kv][n_split][G][head_dim + 2]
  int* counters;    // [n_head_kv], zero
  int n_split;
  unsigned* barrier;  // 1 + gridDim words, zero
  float* amax_val;    // gridDim entries
  int* amax_idx;
  int32_t* argmax_out;
  int greedy;
  unsigned long long* times;  // optional: globaltimer at the start and after each barrier (block 0)
};

// Whether the persistent kernel covers this model: K-quant (Q4_K/Q5_K/Q6_K) weights for every matrix
// but the router and the embedding, supported attention shape, at most 64 experts used.
bool decode_supported(const DecodeArgs& a, const DecLayer& layer0);
// Blocks of the launch (all resident at once: the barriers need it) and its dynamic shared memory.
int decode_grid(const DecodeArgs& a);
cudaError_t decode_token(const DecodeArgs& a, int grid, cudaStream_t s);

}  // namespace moe::cuda::k
