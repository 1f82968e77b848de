// The CUDA forward's decode step (CudaForward, forward.hpp): one token through every layer as a chain of
// kernels captured once as a CUDA graph (or the persistent kernel), the greedy step chained one ahead.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "forward.hpp"

namespace moe::cuda::detail {

bool CudaForward::fused_router() const {
  if (!k::env_switch("MOE_CUDA_FUSED_ROUTER", true) || racc_.n != static_cast<int>(c_.n_expert)) return false;
  for (const DevLayer& L : layers_)
    if (!k::router_in_o_proj_supported(L, static_cast<int>(c_.n_expert_used))) return false;
  return true;
}

int CudaForward::decode_splits() const {
  // MOE_CUDA_ATT_SPLIT_SM=1..3: slice blocks per SM at long contexts
  static const int per_sm = k::env_int("MOE_CUDA_ATT_SPLIT_SM", 3, 1, 3);
  const int want = (per_sm * k::sm_count() + static_cast<int>(c_.n_head_kv) - 1) / static_cast<int>(c_.n_head_kv);
  return std::clamp(want, 1, k::kAttMaxSplit);
}

k::Rope CudaForward::rope() const {
  k::Rope r;
  const float hd = static_cast<float>(c_.head_dim);
  r.theta_scale = std::pow(c_.rope_base, -2.0f / hd);
  r.mscale = c_.rope_attn_factor;
  if (c_.rope_scaling != model::RopeScalingType::none) r.freq_scale = c_.rope_freq_scale;
  if (c_.rope_scaling == model::RopeScalingType::yarn) {
    auto corr = [&](float n_rot) {
      const float n_orig = static_cast<float>(c_.rope_n_ctx_orig ? c_.rope_n_ctx_orig : c_.context_length);
      return hd * std::log(n_orig / (n_rot * 2.0f * static_cast<float>(M_PI))) / (2.0f * std::log(c_.rope_base));
    };
    r.yarn = 1;
    r.corr_lo = std::max(0.0f, std::floor(corr(32.0f)));
    r.corr_hi = std::min(hd - 1, std::ceil(corr(1.0f)));
    r.mscale *= 1.0f + 0.1f * std::log(1.0f / r.freq_scale);
  }
  return r;
}

void CudaForward::enqueue_decode(Tail tail) {
  const char* step = "graph capture failed";
  const int E = static_cast<int>(c_.n_embd), Q = static_cast<int>(c_.q_dim()), KV = static_cast<int>(c_.kv_dim());
  const int K = static_cast<int>(c_.n_expert_used);
  const float eps = c_.rms_eps;
  const k::Rope rp = rope();
  // the embedding and the RoPE table in one launch: +0.3 % against two (docs/PERFORMANCE.md version 28)
  check(k::token_start(embd_, token_, x_, pos_, rp, static_cast<int>(c_.head_dim), rope_cs_, stream_), step);
  if (use_persist_) check(k::decode_persist(persist_, persist_smem_, persist_blocks_, stream_), step);
  for (size_t l = 0; l < (use_persist_ ? 0 : layers_.size()); ++l) {
    const DevLayer& L = layers_[l];
    k::GemvOut qkv[3] = {{L.q, qkv_}, {L.k, qkv_ + Q}, {L.v, qkv_ + Q + KV}};
    k::L2Hint kv;  // the attention's first cache rows go to L2 while Q/K/V run
    kv.base[0] = k_cache(l);
    kv.base[1] = v_cache(l);
    kv.pos = pos_;
    kv.row_bytes = KV * 2;
    kv.max_rows = kv_prefetch_rows();
    // Q/K/V rows: sent to L2 by the previous layer's gate/up or down kernel (see below), else prefetched by
    // the GEMV
    const bool qkv_in_l2 =
        l > 0 && ((fused_router_ && ahead_at_gate_up_) || k::expert_down_sends_ahead(layers_[l - 1].down));
    check(k::gemv(qkv, 3, x_, L.attn_norm, eps, false, stream_, kv.max_rows > 0 ? &kv : nullptr,
                  fused_router_ ? &racc_ : nullptr, qkv_in_l2),
          step);
    check(k::attention_decode(qkv_, pos_, L.q_norm, L.k_norm, eps, rp, k_cache(l), v_cache(l), c_.n_head,
                              c_.n_head_kv, c_.head_dim, decode_splits(), partials_, counters_, o_, rope_cs_, stream_,
                              att_.defer),
          step);
    // the chosen experts' ids as a hint for the down kernel's early prefetch (the fused routing's gate/up
    // kernel writes the tag; MOE_CUDA_EARLY_IDS=0 off)
    k::EarlyIds early;
    if (fused_router_ && early_ids_ && l < 1024) {
      early.tag = early_tag_;
      early.pos = pos_;
      early.layer = static_cast<int>(l);
    }
    // the next layer's Q/K/V rows go to L2 from the gate/up kernel's blocks at their start, before their wait,
    // while the DRAM is idle (the router sums, the choice): BM_Decode/0 638.6-639.2 vs 628.0-628.3 tok/s
    // sending them from the down kernel's blocks (MOE_CUDA_AHEAD_AT=down), where they met the down rows'
    // traffic. (Not from the Q/K/V GEMV itself: its blocks can start only as the down blocks leave the SMs,
    // and their own prefetch then delayed their loads of x.)
    k::L2Ahead next;
    if (l + 1 < layers_.size()) {
      const DevLayer& N = layers_[l + 1];
      const k::Mat* m3[3] = {&N.q, &N.k, &N.v};
      for (int i = 0; i < 3; ++i) {
        next.base[i] = m3[i]->data;
        next.bytes[i] = m3[i]->rows * m3[i]->row_stride;
      }
    }
    const k::L2Ahead* ahead = l + 1 < layers_.size() ? &next : nullptr;
    const bool ahead_in_gate_up = fused_router_ && ahead_at_gate_up_;
    if (fused_router_) {  // the router's sums in the O projection, the choice in the gate/up blocks
      check(k::o_proj_router(L.o, o_, x_, L.router, L.ffn_norm, racc_, stream_, &att_), step);
      check(k::expert_gate_up_acc(L.gate, L.up, x_, L.ffn_norm, eps, racc_, K, ids_, wts_, act_, stream_,
                                  early.tag ? &early : nullptr, ahead_in_gate_up ? ahead : nullptr),
            step);
    } else {
      k::GemvOut out{L.o, x_};
      check(k::gemv(&out, 1, o_, nullptr, 0.f, true, stream_), step);
      check(k::route_token(x_, L.ffn_norm, eps, L.router, h_, route_logits_, stream_), step);
      check(k::expert_gate_up(L.gate, L.up, h_, route_logits_, static_cast<int>(c_.n_expert), K, ids_, wts_, act_,
                              stream_),
            step);
    }
    check(k::expert_down_add(L.down, act_, ids_, wts_, K, x_, stream_, ahead_in_gate_up ? nullptr : ahead,
                             early.tag ? &early : nullptr),
          step);
  }
  k::GemvOut head{output_, static_cast<float*>(logits_.ptr)};
  check(k::gemv(&head, 1, x_, out_norm_, eps, false, stream_), step);
  if (tail == Tail::greedy)  // also the next greedy step's token and position (see eval_greedy)
    check(k::argmax(static_cast<float*>(logits_.ptr), output_.rows, argmax_scratch_, argmax_.ptr, stream_, token_,
                    pos_, host_result_ ? host_io_dev_ + 4 : nullptr),
          step);
  if (tail == Tail::sample)  // the drawn token likewise (see eval_sample; only with host_result_)
    check(k::sample(static_cast<float*>(logits_.ptr), output_.rows, sample_params_, sample_scratch_, hist_,
                    static_cast<int>(n_ctx_), reinterpret_cast<const double*>(host_io_dev_ + 8), nullptr,
                    host_io_dev_ + 4, token_, pos_, stream_),
          step);
  (void)E;
}

void CudaForward::write_profile() {
  std::vector<uint64_t> v(profile_.bytes / 8);
  if (cudaStreamSynchronize(stream_) != cudaSuccess ||
      cudaMemcpy(v.data(), profile_.ptr, profile_.bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  std::FILE* f = std::fopen(profile_path_.c_str(), "w");
  if (!f) return;
  std::fprintf(f, "barrier,block,arrive,leave,clock\n");
  const size_t nb = static_cast<size_t>(persist_blocks_);
  for (size_t i = 0; i < v.size() / 3; ++i)
    std::fprintf(f, "%zu,%zu,%llu,%llu,%llu\n", i / nb, i % nb, static_cast<unsigned long long>(v[3 * i]),
                 static_cast<unsigned long long>(v[3 * i + 1]), static_cast<unsigned long long>(v[3 * i + 2]));
  std::fclose(f);
}

void CudaForward::setup_persist() {
  use_persist_ = false;
  if (!k::persist_enabled()) return;
  std::vector<k::PersistLayer> t;
  for (size_t l = 0; l < layers_.size(); ++l) t.push_back({layers_[l], k_cache(l), v_cache(l)});
  k::PersistArgs& a = persist_;
  a.n_layers = static_cast<int>(t.size());
  a.x = x_; a.qkv = qkv_; a.o = o_; a.logits = route_logits_; a.act = act_; a.partials = partials_;
  a.counters = counters_; a.barrier = barrier_; a.pos = pos_; a.rope_cs = rope_cs_; a.rope = rope(); a.eps = c_.rms_eps;
  a.n_embd = static_cast<int>(c_.n_embd); a.n_head = static_cast<int>(c_.n_head);
  a.n_head_kv = static_cast<int>(c_.n_head_kv); a.head_dim = static_cast<int>(c_.head_dim);
  a.n_expert = static_cast<int>(c_.n_expert); a.n_used = static_cast<int>(c_.n_expert_used);
  a.n_split = decode_splits();
  if (t.empty() || k::persist_plan(a, t.data(), &persist_smem_, &persist_blocks_) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (const char* path = std::getenv("MOE_PERSIST_PROFILE")) {  // per-block barrier times of the last token
    profile_path_ = path;
    profile_.alloc(t.size() * k::kPersistBarriersPerLayer * 3 * static_cast<size_t>(persist_blocks_) * 8,
                   "the persistent kernel's profile");
    a.profile = profile_.as<uint64_t>();
  }
  persist_table_.alloc(t.size() * sizeof(k::PersistLayer), "the layer table");
  check(cudaMemcpy(persist_table_.ptr, t.data(), t.size() * sizeof(k::PersistLayer), cudaMemcpyHostToDevice),
        "upload failed: layer table");
  a.layers = persist_table_.as<k::PersistLayer>();
  use_persist_ = true;
}

k::AttSlices CudaForward::att_slices() const {
  k::AttSlices a;
  int defer = k::kAttMaxDefer;
  if (const char* e = std::getenv("MOE_CUDA_ATT_DEFER")) {
    const int v = std::atoi(e);
    defer = e[0] == '0' ? 0 : v >= 2 && v <= k::kAttMaxDefer ? v : defer;
  }
  if (!fused_router_ || defer < 2 || c_.head_dim % 128 != 0 || c_.q_dim() > 4096) return a;
  a.partials = partials_;
  a.pos = pos_;
  a.n_head_kv = static_cast<int>(c_.n_head_kv);
  a.group = static_cast<int>(c_.n_head / c_.n_head_kv);
  a.head_dim = static_cast<int>(c_.head_dim);
  a.n_split = decode_splits();
  a.min_chunk = k::attention_min_chunk();
  a.defer = defer;
  return a;
}

void CudaForward::capture() {
  fused_router_ = fused_router();
  att_ = att_slices();
  early_ids_ = k::env_switch("MOE_CUDA_EARLY_IDS", true);
  host_result_ = host_io_dev_ && k::env_switch("MOE_CUDA_HOST_RESULT", true);
  ahead_at_gate_up_ = [] {  // MOE_CUDA_AHEAD_AT=down: from the down kernel, as before
    const char* v = std::getenv("MOE_CUDA_AHEAD_AT");
    return !(v && std::string(v) == "down");
  }();
  setup_persist();
  if (use_persist_) {
    try {
      capture_graphs();
      return;
    } catch (const Error&) {
      use_persist_ = false;
    }
  }
  capture_graphs();
}

cudaGraphExec_t CudaForward::capture_graph(Tail tail) {
  cudaGraph_t g = nullptr;
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "graph capture failed");
  try {
    enqueue_decode(tail);
  } catch (...) {
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  check(cudaStreamEndCapture(stream_, &g), "graph capture failed");
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  check(e, "graph capture failed");
  return exec;
}

void CudaForward::capture_graphs() {
  for (Tail tail : {Tail::logits, Tail::greedy}) {
    cudaGraphExec_t exec = capture_graph(tail);
    cudaGraphExec_t& slot = tail == Tail::greedy ? graph_greedy_ : graph_logits_;
    if (slot) cudaGraphExecDestroy(slot);
    slot = exec;
  }
  if (graph_sample_) {  // captured again at its next use
    cudaGraphExecDestroy(graph_sample_);
    graph_sample_ = nullptr;
  }
}

void CudaForward::enqueue_chained(cudaGraphExec_t graph, int s, const int32_t* token) {
  if (token) {
    host_io_[0] = *token;
    host_io_[1] = static_cast<int32_t>(n_past_);
    check_step(cudaMemcpyAsync(token_, host_io_, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  }
  check_step(cudaGraphLaunch(graph, stream_));
  // host_result_: the graph's argmax wrote slot s (its position's parity) of host_io_ itself; a copy after the
  // graph put the copy engine between every two tokens (BM_Decode/0 678.0-678.6 vs 683.1-683.4 without it,
  // docs/PERFORMANCE.md version 28)
  if (!host_result_)
    check_step(
        cudaMemcpyAsync(host_io_ + 4 + 2 * s, argmax_.ptr, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  check_step(cudaEventRecord(step_done_[s], stream_));
}

void CudaForward::decode_step(int32_t token, bool greedy) {
  if (n_past_ + 1 > n_ctx_)
    fail(Exit::resources, "context is full: {} positions used + 1 new token > context size {}", n_past_, n_ctx_);
  host_io_[0] = token;
  host_io_[1] = static_cast<int32_t>(n_past_);
  step_ = "a CUDA kernel failed at decode position";
  check_step(cudaMemcpyAsync(token_, host_io_, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  check_step(cudaGraphLaunch(greedy ? graph_greedy_ : graph_logits_, stream_));
}

}  // namespace moe::cuda::detail
