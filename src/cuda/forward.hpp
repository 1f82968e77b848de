// The CUDA forward's host side (internal to src/cuda): the CudaForward class, whose members are defined in
// forward.cpp (construction, upload, scratch, eval), forward_decode.cpp (the decode step, its graphs and
// the persistent kernel) and forward_prefill.cpp (the batched prefill).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "device.hpp"
#include "launch.cuh"
#include "moe/cuda.hpp"

namespace moe::cuda::detail {

inline constexpr double kMiB = 1024.0 * 1024.0;
inline constexpr size_t kAlign = 256;

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

using DevLayer = k::LayerWeights;  // one layer's weights in the device arena

// Where each weight goes in the one device arena.
struct WeightPlan {
  struct Item {
    const model::Tensor* t;
    size_t offset;
    bool as_f32;  // 1-D gains, converted to f32 on the host
  };
  std::vector<Item> items;
  size_t bytes = 0;
  size_t add(const model::Tensor& t, bool as_f32);
};

class CudaForward final : public Forward {
 public:
  CudaForward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o, DeviceInfo* info);
  ~CudaForward() override;
  void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) override;

  // Greedy decoding runs one step ahead: the greedy graph's argmax also writes the next step's token and
  // position on the device, so the step after this one is enqueued before this one's result is read
  // (the host's wait, copy and launch no longer leave the GPU idle between tokens). When the caller then
  // asks for exactly that token, its step is already running; any other call (another token, eval,
  // reset) abandons it: it only wrote the KV row at n_past(), which the next step there rewrites.
  // MOE_CUDA_CHAIN=0 turns it off (read when the forward is made).
  int32_t eval_greedy(int32_t token) override;

  // Sampled decoding the same way (k::sample draws the token at the end of a third graph, captured at the first
  // use of a parameter set): the step ahead is enqueued with the next uniform before this step's token is read.
  // The penalty's window goes to the device when a step is not the one already running; after that the graph
  // appends its tokens itself. MOE_CUDA_DEVICE_SAMPLER=0 turns it off (the host samples the copied logits), and
  // so does a graph that cannot be captured (prepare_sample; samples_on_device then says false).
  bool samples_on_device(const run::SamplerParams& p) const override;
  void prepare_sample(const run::SamplerParams& p) override;
  int32_t eval_sample(std::span<const int32_t> history, const run::SamplerParams& p,
                      const std::function<double()>& uniform) override;

  int64_t n_past() const override { return n_past_; }
  int64_t n_ctx() const override { return n_ctx_; }
  int64_t n_vocab() const override { return output_.rows; }
  void reset() override {
    n_past_ = 0;
    ahead_ = false;
  }
  std::string name() const override { return "cuda"; }

 private:
  // ---- setup -------------------------------------------------------------------------------------
  void init_device(int device);
  void validate();
  WeightPlan plan_weights();

  uint64_t kv_bytes() const { return 2ull * 2ull * c_.n_layer * static_cast<uint64_t>(n_ctx_) * c_.kv_dim(); }

  // Cache rows per layer that the Q/K/V GEMV sends to L2 for the decode attention (MOE_CUDA_KV_PREFETCH,
  // default 128: the rows whose reads are latency, not bandwidth; 0 turns it off).
  static int kv_prefetch_rows() {
    static const int rows = k::env_int("MOE_CUDA_KV_PREFETCH", 128, 0, 1 << 30);
    return rows;
  }

  // MOE_CUDA_PREFILL_OVERLAP=1: the prefill's V GEMM on a second stream next to K and Q. Off by default:
  // +2.6 % pp512, but once a second stream had run work the decode graph on stream_ ran ~2.5 % slower
  // (CLI 361.6-362.4 vs 369.2-373.3 tok/s without any second stream, alternating in one call).
  // MOE_CUDA_GEMM_DYN=0: the prefill's expert GEMMs give each block a fixed share of their tiles.
  static bool gemm_dynamic() {
    static const bool on = k::env_switch("MOE_CUDA_GEMM_DYN", true);
    return on;
  }
  static bool prefill_overlap() {
    static const bool on = k::env_switch("MOE_CUDA_PREFILL_OVERLAP", false);
    return on;
  }

  // The prefill's second stream and its two events, made at the first prefill that overlaps (never
  // without MOE_CUDA_PREFILL_OVERLAP=1). False (one stream) if they cannot be made.
  bool side_stream();

  // The decode's routing inside the O projection and the gate/up kernel (k::o_proj_router) when every
  // layer allows it; MOE_CUDA_FUSED_ROUTER=0 keeps the router kernel (read when the graphs are captured).
  bool fused_router() const;
  int decode_splits() const;

  // Bytes of every scratch buffer, in the order alloc_scratch takes them.
  std::vector<size_t> scratch_sizes() const;
  uint64_t scratch_bytes() const;
  void upload(const WeightPlan& plan, bool progress);
  void alloc_scratch();

  // ---- the forward -------------------------------------------------------------------------------------
  k::Rope rope() const;

  void* k_cache(size_t l) const {
    return kv_.as<uint8_t>(l * 2 * static_cast<size_t>(n_ctx_) * c_.kv_dim() * 2);
  }
  void* v_cache(size_t l) const {
    return kv_.as<uint8_t>((l * 2 + 1) * static_cast<size_t>(n_ctx_) * c_.kv_dim() * 2);
  }

  // One decode token: reads the token id from token_ and its position from pos_; the graph's tail after the
  // LM head: none (the logits stay in logits_), the argmax, or the device sampler with sample_params_.
  enum class Tail { logits, greedy, sample };
  void enqueue_decode(Tail tail);
  cudaGraphExec_t capture_graph(Tail tail);
  static k::SampleParams sample_params(const run::SamplerParams& p);

  // MOE_PERSIST_PROFILE=file: the barrier times of the last decode token, one line per (barrier, block).
  void write_profile();

  // The persistent kernel's table and launch shape, when the model and the device allow it.
  void setup_persist();

  // The decode attention's slices merged by the O projection (k::AttSlices) when the routing is in the O
  // projection and the head size allows it, for contexts of 2 .. defer slices; MOE_CUDA_ATT_DEFER=0 keeps
  // the attention's own merge, =2 or 3 defers fewer than kAttMaxDefer slices.
  k::AttSlices att_slices() const;

  // Captures the decode graphs with the persistent kernel when it is available, else (or when its
  // capture fails: a driver without cooperative launches in graphs) with one kernel per step.
  void capture();
  void capture_graphs();

  // The greedy graph for position n_past() (+1 when a step is already ahead of it on the stream), its
  // argmax in result slot s (host_io_[4 + 2s], [5 + 2s]: written by the graph itself with host_result_, where s
  // is the step's position parity, else copied after it) and step_done_[s] recorded. token: the
  // step's token from the host, or null: the previous greedy step's argmax, on the device already.
  void enqueue_greedy(int s, const int32_t* token) { enqueue_chained(graph_greedy_, s, token); }
  void enqueue_chained(cudaGraphExec_t graph, int s, const int32_t* token);
  // Waits for the chained step in result slot s, counts its position, and returns its token (a non-finite logit
  // throws); `launched`: a step of graph `tail` is now ahead of it.
  int32_t chained_result(int s, bool launched, Tail tail);
  void decode_step(int32_t token, bool greedy);
  void prefill_chunk(const int32_t* tokens, int n, bool all_logits, bool last);

  void check_tokens(std::span<const int32_t> tokens) {
    if (tokens.empty()) fail(Exit::usage, "cuda forward: eval of an empty token list");
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || tokens[i] >= embd_.rows)
        fail(Exit::usage, "token id {} at position {} is outside the vocabulary (n_vocab {})", tokens[i],
             n_past_ + static_cast<int64_t>(i), embd_.rows);
  }

  void check_step(cudaError_t e) {
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail(Exit::gpu_failed, "{} {}: {} ({})", step_, n_past_, cudaGetErrorString(e), cudaGetErrorName(e));
    }
  }
  // Enqueues the last copy of a step and waits: kernel faults of the step surface here.
  void finish(cudaError_t e, const char* what) {
    check_step(e);
    check_step(cudaStreamSynchronize(stream_));
    (void)what;
  }

  struct LayerOffsets {
    size_t q, k, v, o, router, gate, up, down, attn_norm, ffn_norm, q_norm, k_norm;
  };

  std::shared_ptr<const model::OwnedQuantizedModel> model_;
  const model::ModelConfig& c_;
  int device_ = 0;
  std::string device_name_;
  int64_t n_ctx_ = 0;
  int64_t batch_ = 1;
  int64_t n_past_ = 0;
  const char* step_ = "";

  DeviceBuffer weights_, kv_, scratch_;
  size_t embd_off_ = 0, out_off_ = 0, out_norm_off_ = 0;
  std::vector<LayerOffsets> layer_offs_;
  k::Mat embd_, output_;
  const float* out_norm_ = nullptr;
  std::vector<DevLayer> layers_;

  float *x_ = nullptr, *h_ = nullptr, *qkv_ = nullptr, *o_ = nullptr, *router_logits_ = nullptr, *wts_ = nullptr;
  int* tickets_ = nullptr;  // two per layer: the prefill's expert GEMMs' dynamic walk
  int32_t *ids_ = nullptr, *token_of_slot_ = nullptr, *slot_of_ = nullptr, *prefill_ids_ = nullptr;
  int *count_ = nullptr, *offset_ = nullptr, *counters_ = nullptr;
  float *act_ = nullptr, *expert_out_ = nullptr, *argmax_scratch_ = nullptr, *partials_ = nullptr, *route_logits_ = nullptr;
  int32_t *token_ = nullptr, *pos_ = nullptr, *prefill_pos_ = nullptr;
  unsigned* barrier_ = nullptr;
  int32_t* early_tag_ = nullptr;  // the expert ids' tag for the down kernel's early prefetch (k::EarlyIds)
  float* rope_cs_ = nullptr;
  void* split_ = nullptr;  // the split input of the prefill's fp16-path GEMMs (k::split_h16)
  // the persistent decode kernel (decode_persist.cu): its layer table, arguments and launch shape
  DeviceBuffer persist_table_, profile_;
  std::string profile_path_;
  k::PersistArgs persist_;
  size_t persist_smem_ = 0;
  int persist_blocks_ = 0;
  bool use_persist_ = false;
  bool fused_router_ = false;
  k::AttSlices att_;  // the attention's slices the O projection merges (att_slices)
  bool early_ids_ = true;  // the down kernel's early expert-row prefetch (k::EarlyIds)
  bool ahead_at_gate_up_ = true;  // the next layer's Q/K/V to L2 from the gate/up kernel (MOE_CUDA_AHEAD_AT)
  k::RouterAcc racc_;
  struct {
    void* ptr = nullptr;
  } logits_;
  struct {
    int32_t* ptr = nullptr;
  } argmax_;
  // pinned: token, pos, -, prefill pos, then two greedy results {argmax, non-finite}; at byte 32 the device
  // sampler's two uniforms (doubles), at int kHistStage the penalty window's staging (k::kSampleMaxWindow ints)
  static constexpr size_t kHistStage = 16, kHostIoBytes = (kHistStage + k::kSampleMaxWindow) * sizeof(int32_t);
  int32_t* host_io_ = nullptr;
  int32_t* host_io_dev_ = nullptr;  // host_io_ mapped into the device's address space
  // pinned: a decode step's logits on their way to the caller's vector (a copy into pageable memory goes through
  // the driver's own staging; MOE_CUDA_PINNED_LOGITS=0: straight into the vector)
  float* logits_host_ = nullptr;
  // the greedy graph's argmax writes its result to host_io_ (the slot of its position's parity) itself, with no
  // copy after the graph (set at capture; MOE_CUDA_HOST_RESULT=0: the copy)
  bool host_result_ = false;
  // greedy decoding one step ahead (eval_greedy)
  bool chain_ = true, ahead_ = false;
  Tail ahead_tail_ = Tail::greedy;  // the graph of the step ahead
  int32_t ahead_token_ = -1;
  int slot_ = 0, ahead_slot_ = 0;
  cudaEvent_t step_done_[2] = {nullptr, nullptr};

  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // the prefill's V projection, next to K (and Q) on stream_
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  cudaGraphExec_t graph_logits_ = nullptr, graph_greedy_ = nullptr;
  // the device sampler (eval_sample): its graph and parameters, scratch, and the tokens by position (the penalty's
  // window: written by the host when a step is not the one already running, then by the graph)
  cudaGraphExec_t graph_sample_ = nullptr;
  k::SampleParams sample_params_;
  void* sample_scratch_ = nullptr;
  int32_t* hist_ = nullptr;
  bool device_sampler_ = true;
};

}  // namespace moe::cuda::detail
