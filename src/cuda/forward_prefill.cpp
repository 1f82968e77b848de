// The CUDA forward's batched prefill (CudaForward, forward.hpp): a chunk of prompt tokens through every
// layer with tensor-core GEMMs, the experts as grouped GEMMs over the tokens routed to each.
#include "forward.hpp"

namespace moe::cuda::detail {

bool CudaForward::side_stream() {
  if (side_) return true;
  if (cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&join_, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    if (side_) cudaStreamDestroy(side_);
    if (fork_) cudaEventDestroy(fork_);
    side_ = nullptr;
    fork_ = nullptr;
    return false;
  }
  return true;
}

void CudaForward::prefill_chunk(const int32_t* tokens, int n, bool all_logits, bool last) {
  if (n_past_ + n > n_ctx_)
    fail(Exit::resources, "context is full: {} positions used + {} new tokens > context size {}", n_past_, n, n_ctx_);
  step_ = "a CUDA kernel failed in the prefill at position";
  const int E = static_cast<int>(c_.n_embd), Q = static_cast<int>(c_.q_dim()), KV = static_cast<int>(c_.kv_dim());
  const int X = static_cast<int>(c_.n_expert), K = static_cast<int>(c_.n_expert_used);
  const int qkv_stride = Q + 2 * KV;
  const float eps = c_.rms_eps;
  const k::Rope rp = rope();
  host_io_[3] = static_cast<int32_t>(n_past_);
  check_step(cudaMemcpyAsync(prefill_ids_, tokens, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  check_step(cudaMemcpyAsync(prefill_pos_, host_io_ + 3, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  check_step(k::embed_rows(embd_, prefill_ids_, n, x_, stream_));
  check_step(k::rope_table(prefill_pos_, n, rp, static_cast<int>(c_.head_dim), rope_cs_, stream_));  // every layer's
  const int F = static_cast<int>(c_.expert_ffn);
  // Each layer's two expert GEMMs walk their work by a ticket (k::expert_gate_up_grouped), zero at the start.
  int* tickets = gemm_dynamic() ? tickets_ : nullptr;
  if (tickets) check_step(cudaMemsetAsync(tickets, 0, layers_.size() * 2 * sizeof(int), stream_));
  // The input of a layer's Q4_K/Q5_K GEMMs split once for their fp16 path (k::split_h16), or nullptr.
  auto split = [&](bool wanted, const float* in, int rows, int cols) -> const void* {
    if (!wanted) return nullptr;
    check_step(k::split_h16(in, cols, rows, cols, split_, stream_));
    return split_;
  };
  // h = rmsnorm(x) * w, with its split when a GEMM that reads h wants one (one launch: k::rmsnorm_split_h16).
  auto norm = [&](const float* w, bool wanted) -> const void* {
    if (!wanted) {
      check_step(k::rmsnorm_rows(x_, w, n, E, E, eps, h_, stream_));
      return nullptr;
    }
    check_step(k::rmsnorm_split_h16(x_, w, n, E, E, eps, h_, split_, stream_));
    return split_;
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DevLayer& L = layers_[l];
    const void* hs = norm(L.attn_norm, k::split_h16_wanted(L.q) || k::split_h16_wanted(L.k) || k::split_h16_wanted(L.v));
    if (prefill_overlap() && side_stream()) {
      // V on the side stream next to K: at prefill sizes each is a small GEMM that leaves most of
      // the GPU idle (latency-bound); Q follows K, the attention waits for both
      check_step(cudaEventRecord(fork_, stream_));
      check_step(cudaStreamWaitEvent(side_, fork_, 0));
      check_step(k::gemm(L.v, h_, E, n, qkv_ + Q + KV, qkv_stride, false, side_, hs));
      check_step(cudaEventRecord(join_, side_));
      check_step(k::gemm(L.k, h_, E, n, qkv_ + Q, qkv_stride, false, stream_, hs));
      check_step(k::gemm(L.q, h_, E, n, qkv_, qkv_stride, false, stream_, hs));
      check_step(cudaStreamWaitEvent(stream_, join_, 0));
    } else {
      check_step(k::gemm(L.q, h_, E, n, qkv_, qkv_stride, false, stream_, hs));
      check_step(k::gemm(L.k, h_, E, n, qkv_ + Q, qkv_stride, false, stream_, hs));
      check_step(k::gemm(L.v, h_, E, n, qkv_ + Q + KV, qkv_stride, false, stream_, hs));
    }
    check_step(k::qk_norm_rope_store(qkv_, n, prefill_pos_, L.q_norm, L.k_norm, c_.n_head, c_.n_head_kv,
                                     c_.head_dim, eps, rp, k_cache(l), v_cache(l), rope_cs_, stream_));
    check_step(k::attention(qkv_, qkv_stride, n, prefill_pos_, k_cache(l), v_cache(l), c_.n_head, c_.n_head_kv,
                            c_.head_dim, o_, stream_));
    check_step(k::gemm(L.o, o_, Q, n, x_, E, true, stream_, split(k::split_h16_wanted(L.o), o_, n, Q)));
    // h's split stays in the split buffer for gate/up (the router, top-k and grouping read none).
    const void* hf = norm(L.ffn_norm, k::split_h16_wanted(L.gate));
    check_step(k::gemm(L.router, h_, E, n, router_logits_, X, false, stream_));
    check_step(k::topk_rows(router_logits_, n, X, K, ids_, wts_, stream_));
    check_step(k::group_by_expert(ids_, n, K, X, count_, offset_, token_of_slot_, slot_of_, stream_));
    check_step(k::expert_gate_up_grouped(L.gate, L.up, h_, E, count_, offset_, token_of_slot_, X, n, act_, stream_, hf,
                                         tickets ? tickets + 2 * l : nullptr));
    check_step(k::expert_down_grouped(L.down, act_, count_, offset_, X, n, expert_out_, stream_,
                                      split(k::split_h16_wanted(L.down), act_, n * K, F),
                                      tickets ? tickets + 2 * l + 1 : nullptr));
    check_step(k::combine_experts(expert_out_, slot_of_, wts_, n, K, E, x_, stream_));
  }
  float* logits = static_cast<float*>(logits_.ptr);
  if (all_logits) {
    check_step(k::rmsnorm_rows(x_, out_norm_, n, E, E, eps, h_, stream_));
    check_step(k::gemm(output_, h_, E, n, logits, output_.rows, false, stream_));
  } else if (last) {
    k::GemvOut head{output_, logits};
    check_step(k::gemv(&head, 1, x_ + static_cast<size_t>(n - 1) * E, out_norm_, eps, false, stream_));
  }
}

}  // namespace moe::cuda::detail
