// The CUDA forward: weights resident in the device layout, decode as one captured CUDA graph per
// token step (token and position read from device memory), batched prefill with expert-grouped GEMMs.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "device.hpp"
#include "launch.cuh"
#include "layout.cuh"
#include "moe/cuda.hpp"
#include "moe/quant.hpp"

namespace moe::cuda {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr size_t kAlign = 256;
constexpr size_t kStagingBytes = 64ull << 20;
constexpr uint64_t kReserveBytes = 512ull << 20;  // CUDA context, graphs, fragmentation

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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
  size_t add(const model::Tensor& t, bool as_f32) {
    const size_t off = bytes;
    size_t b;
    if (as_f32) {
      b = static_cast<size_t>(t.ne[0]) * sizeof(float);
    } else {
      b = device_bytes(t.type, t.ne[0], t.ne[1] * t.ne[2] * t.ne[3]);
    }
    items.push_back({&t, off, as_f32});
    bytes = align_up(off + b, kAlign);
    return off;
  }
};

void check_matrix(const model::Tensor& t) {
  const std::string name = t.info ? t.info->name : std::string("a tensor");
  if (!layout::supported(static_cast<uint32_t>(t.type)))
    fail(Exit::gpu_failed, "the CUDA model would not build: {} has type {}, which the CUDA kernels do not support", name,
         gguf::type_name(t.type));
  if (t.ne[0] % 32 != 0)
    fail(Exit::gpu_failed, "the CUDA model would not build: {} has rows of {} elements (the CUDA kernels need a multiple of 32)",
         name, t.ne[0]);
}

class CudaForward final : public Forward {
 public:
  CudaForward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o, DeviceInfo* info)
      : model_(std::move(m)), c_(model_->config) {
    const auto t_start = std::chrono::steady_clock::now();
    init_device(o.device);
    n_ctx_ = o.n_ctx > 0 ? o.n_ctx : static_cast<int64_t>(c_.context_length);
    if (n_ctx_ <= 0) fail(Exit::gpu_failed, "the CUDA model would not build: context size must be positive");
    batch_ = std::max<int64_t>(1, std::min<int64_t>(o.max_batch, n_ctx_));
    validate();
    WeightPlan plan = plan_weights();
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "CUDA initialization failed");
    const uint64_t kv = kv_bytes(), scratch = scratch_bytes();
    const uint64_t need = plan.bytes + kv + scratch + kReserveBytes;
    if (need > free_b)
      fail(Exit::gpu_failed,
           "the model does not fit on device {} ({}): needs {:.0f} MiB (weights {:.0f} MiB, KV cache {:.0f} MiB for {} "
           "positions, scratch {:.0f} MiB, reserve {:.0f} MiB), free {:.0f} MiB of {:.0f} MiB",
           device_, device_name_, need / kMiB, plan.bytes / kMiB, kv / kMiB, n_ctx_, scratch / kMiB,
           kReserveBytes / kMiB, free_b / kMiB, total_b / kMiB);
    check(k::init_kernels(), "CUDA initialization failed");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "CUDA initialization failed");
    upload(plan, o.progress);
    alloc_scratch();
    capture();
    size_t free_after = 0;
    check(cudaMemGetInfo(&free_after, &total_b), "CUDA initialization failed");
    if (info) {
      info->name = device_name_;
      info->vram_total_mib = static_cast<uint64_t>(total_b / kMiB);
      info->vram_used_mib = free_b > free_after ? static_cast<uint64_t>((free_b - free_after) / kMiB) : 0;
      info->decode_path = use_persist_ ? "persistent kernel" : "kernel graph";
      info->upload_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();
    }
  }

  ~CudaForward() override {
    if (stream_) cudaStreamSynchronize(stream_);  // a greedy step may still be ahead (eval_greedy)
    if (!profile_path_.empty()) write_profile();
    if (graph_logits_) cudaGraphExecDestroy(graph_logits_);
    if (graph_greedy_) cudaGraphExecDestroy(graph_greedy_);
    if (host_io_) cudaFreeHost(host_io_);
    for (cudaEvent_t e : step_done_)
      if (e) cudaEventDestroy(e);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    if (side_) cudaStreamDestroy(side_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) override {
    check_tokens(tokens);
    ahead_ = false;
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t V = n_vocab();
    if (n_past_ + n > n_ctx_)
      fail(Exit::resources, "context is full: {} positions used + {} new tokens > context size {}", n_past_, n, n_ctx_);
    if (n == 1) {
      decode_step(tokens[0], false);
      logits.resize(static_cast<size_t>(V));
      finish(cudaMemcpyAsync(logits.data(), logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_),
             "reading the logits");
      n_past_ += 1;
      return;
    }
    logits.resize(static_cast<size_t>(all_logits ? n * V : V));
    for (int64_t i0 = 0; i0 < n; i0 += batch_) {
      const int64_t nb = std::min(batch_, n - i0);
      const bool last = i0 + nb == n;
      prefill_chunk(tokens.data() + i0, static_cast<int>(nb), all_logits, last);
      if (all_logits) {
        finish(cudaMemcpyAsync(logits.data() + i0 * V, logits_.ptr, nb * V * sizeof(float), cudaMemcpyDeviceToHost,
                               stream_),
               "reading the logits");
      } else if (last) {
        finish(cudaMemcpyAsync(logits.data(), logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_),
               "reading the logits");
      }
      n_past_ += nb;
    }
  }

  // Greedy decoding runs one step ahead: the greedy graph's argmax also writes the next step's token and
  // position on the device, so the step after this one is enqueued before this one's result is read
  // (the host's wait, copy and launch no longer leave the GPU idle between tokens). When the caller then
  // asks for exactly that token, its step is already running; any other call (another token, eval,
  // reset) abandons it: it only wrote the KV row at n_past(), which the next step there rewrites.
  // MOE_CUDA_CHAIN=0 turns it off (read when the forward is made).
  int32_t eval_greedy(int32_t token) override {
    check_tokens(std::span<const int32_t>(&token, 1));
    if (n_past_ + 1 > n_ctx_)
      fail(Exit::resources, "context is full: {} positions used + 1 new token > context size {}", n_past_, n_ctx_);
    step_ = "a CUDA kernel failed at decode position";
    const bool hit = ahead_ && token == ahead_token_;
    ahead_ = false;  // set again only once this call has succeeded
    int s;
    if (hit) {
      s = ahead_slot_;  // this step is already on the stream
    } else {
      s = slot_;
      slot_ ^= 1;
      enqueue_greedy(s, &token);
    }
    bool launched = false;
    if (chain_ && n_past_ + 2 <= n_ctx_) {
      ahead_slot_ = slot_;
      slot_ ^= 1;
      enqueue_greedy(ahead_slot_, nullptr);
      launched = true;
    }
    check_step(cudaEventSynchronize(step_done_[s]));
    n_past_ += 1;
    const int32_t* r = host_io_ + 4 + 2 * s;
    if (r[1] != 0) fail(Exit::gpu_failed, "the GPU forward produced a non-finite logit at position {}", n_past_ - 1);
    ahead_ = launched;
    ahead_token_ = r[0];
    return r[0];
  }

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
  void init_device(int device) {
    device_ = device;
    int count = 0;
    check(cudaGetDeviceCount(&count), "CUDA initialization failed");
    if (device < 0 || device >= count)
      fail(Exit::gpu_failed, "CUDA initialization failed: device {} does not exist ({} CUDA device{})", device, count,
           count == 1 ? "" : "s");
    check(cudaSetDevice(device), "CUDA initialization failed");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "CUDA initialization failed");
    device_name_ = prop.name;
    if (prop.major < 7)
      fail(Exit::gpu_failed, "CUDA initialization failed: {} has compute capability {}.{} (7.0 or newer needed)",
           device_name_, prop.major, prop.minor);
    check(cudaFree(nullptr), "CUDA initialization failed");  // creates the context now
  }

  void validate() {
    if (!k::attention_supported(static_cast<int>(c_.n_head), static_cast<int>(c_.n_head_kv),
                                static_cast<int>(c_.head_dim)))
      fail(Exit::gpu_failed,
           "the CUDA model would not build: attention with {} heads, {} KV heads and head_dim {} has no CUDA kernel "
           "(head_dim 64 or 128, 1/2/4/8 query heads per KV head)",
           c_.n_head, c_.n_head_kv, c_.head_dim);
    if (c_.n_expert > 1024 || c_.n_expert_used > 64 || c_.n_expert_used == 0)
      fail(Exit::gpu_failed, "the CUDA model would not build: {} experts with {} used has no CUDA kernel", c_.n_expert,
           c_.n_expert_used);
    if (batch_ * c_.n_expert_used > 8192)
      batch_ = std::max<int64_t>(1, 8192 / c_.n_expert_used);
    check_matrix(model_->token_embd);
    check_matrix(model_->output);
    for (const model::Layer& L : model_->layers)
      for (const model::Tensor* t : {&L.attn_q, &L.attn_k, &L.attn_v, &L.attn_output, &L.ffn_gate_inp, &L.ffn_gate_exps,
                                     &L.ffn_up_exps, &L.ffn_down_exps})
        check_matrix(*t);
  }

  WeightPlan plan_weights() {
    WeightPlan p;
    embd_off_ = p.add(model_->token_embd, false);
    out_off_ = c_.tied_output ? embd_off_ : p.add(model_->output, false);
    out_norm_off_ = p.add(model_->output_norm, true);
    layer_offs_.clear();
    for (const model::Layer& L : model_->layers) {
      LayerOffsets lo;
      lo.q = p.add(L.attn_q, false);
      lo.k = p.add(L.attn_k, false);
      lo.v = p.add(L.attn_v, false);
      lo.o = p.add(L.attn_output, false);
      lo.router = p.add(L.ffn_gate_inp, false);
      lo.gate = p.add(L.ffn_gate_exps, false);
      lo.up = p.add(L.ffn_up_exps, false);
      lo.down = p.add(L.ffn_down_exps, false);
      lo.attn_norm = p.add(L.attn_norm, true);
      lo.ffn_norm = p.add(L.ffn_norm, true);
      lo.q_norm = p.add(L.attn_q_norm, true);
      lo.k_norm = p.add(L.attn_k_norm, true);
      layer_offs_.push_back(lo);
    }
    return p;
  }

  uint64_t kv_bytes() const { return 2ull * 2ull * c_.n_layer * static_cast<uint64_t>(n_ctx_) * c_.kv_dim(); }

  // Cache rows per layer that the Q/K/V GEMV sends to L2 for the decode attention (MOE_CUDA_KV_PREFETCH,
  // default 128: the rows whose reads are latency, not bandwidth; 0 turns it off).
  static int kv_prefetch_rows() {
    static const int rows = [] {
      const char* v = std::getenv("MOE_CUDA_KV_PREFETCH");
      return v ? std::max(0, std::atoi(v)) : 128;
    }();
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
  bool side_stream() {
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

  // The decode's routing inside the O projection and the gate/up kernel (k::o_proj_router) when every
  // layer allows it; MOE_CUDA_FUSED_ROUTER=0 keeps the router kernel (read when the graphs are captured).
  bool fused_router() const {
    if (!k::env_switch("MOE_CUDA_FUSED_ROUTER", true) || racc_.n != static_cast<int>(c_.n_expert)) return false;
    for (const DevLayer& L : layers_)
      if (!k::router_in_o_proj_supported(L, static_cast<int>(c_.n_expert_used))) return false;
    return true;
  }

  int decode_splits() const {
    const int want = (2 * k::sm_count() + static_cast<int>(c_.n_head_kv) - 1) / static_cast<int>(c_.n_head_kv);
    return std::clamp(want, 1, 64);
  }

  // Bytes of every scratch buffer, in the order alloc_scratch takes them.
  std::vector<size_t> scratch_sizes() const {
    const size_t B = static_cast<size_t>(batch_), E = c_.n_embd, Q = c_.q_dim(), KV = c_.kv_dim();
    const size_t X = c_.n_expert, K = c_.n_expert_used, F = c_.expert_ffn;
    const size_t V = static_cast<size_t>(model_->output.ne[1]);
    const size_t G = c_.n_head / c_.n_head_kv;
    const size_t f = sizeof(float);
    return {
        B * E * f,                                            // x
        B * E * f,                                            // h
        B * (Q + 2 * KV) * f,                                 // qkv
        B * Q * f,                                            // o
        B * X * f,                                            // router logits
        B * K * 4,                                            // ids
        B * K * f,                                            // weights
        X * 4,                                                // count
        X * 4,                                                // offset
        B * K * 4,                                            // token_of_slot
        B * K * 4,                                            // slot_of
        B * K * F * f,                                        // act
        B * K * E * f,                                        // expert outputs
        B * V * f,                                            // logits
        c_.n_head_kv * static_cast<size_t>(decode_splits()) * G * k::attention_partial_stride(static_cast<int>(c_.head_dim)) * f,  // partials
        B * c_.n_head_kv * 4,                                 // counters
        X * f,                                                // router logits (decode)
        64,                                                   // -, token, pos, prefill pos, argmax, barrier
        B * 4,                                                // prefill ids
        k::kArgmaxScratch * f,                                // argmax partials
        B * c_.head_dim * f,                                  // RoPE tables: the decode position, or the chunk's
        (X + 1) * 8 + 16,                                     // the router's fixed-point sums and their unit
        std::max({k::split_h16_bytes(static_cast<int>(B), static_cast<int>(E)),  // a prefill GEMM's split
                  k::split_h16_bytes(static_cast<int>(B), static_cast<int>(Q)),  // input (h, o or act)
                  k::split_h16_bytes(static_cast<int>(B * K), static_cast<int>(F))}),
        c_.n_layer * 2 * 4,                                   // the expert GEMMs' work tickets (prefill)
    };
  }
  uint64_t scratch_bytes() const {
    uint64_t s = 0;
    for (size_t b : scratch_sizes()) s += align_up(b, kAlign);
    return s;
  }

  void upload(const WeightPlan& plan, bool progress) {
    weights_.alloc(plan.bytes, "the weights");
    uint8_t* staging[2] = {nullptr, nullptr};
    cudaEvent_t done[2] = {nullptr, nullptr};
    struct Cleanup {
      uint8_t** s;
      cudaEvent_t* e;
      ~Cleanup() {
        for (int i = 0; i < 2; ++i) {
          if (e[i]) { cudaEventSynchronize(e[i]); cudaEventDestroy(e[i]); }
          if (s[i]) cudaFreeHost(s[i]);
        }
      }
    } cleanup{staging, done};
    for (int i = 0; i < 2; ++i) {
      check(cudaMallocHost(reinterpret_cast<void**>(&staging[i]), kStagingBytes), "upload failed: pinned staging buffer");
      check(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming), "upload failed");
    }
    const bool bar = progress && isatty(fileno(stderr));
    size_t sent = 0;
    int last_pct = -1;
    int buf = 0;
    std::vector<float> row;
    auto send = [&](const uint8_t* host, size_t n, size_t dst_off) {
      check(cudaMemcpyAsync(weights_.as<uint8_t>(dst_off), host, n, cudaMemcpyHostToDevice, stream_), "upload failed");
      check(cudaEventRecord(done[buf], stream_), "upload failed");
      buf ^= 1;
      sent += n;
      if (bar) {
        const int pct = static_cast<int>(100.0 * static_cast<double>(sent) / static_cast<double>(plan.bytes));
        if (pct != last_pct) {
          std::fprintf(stderr, "\rmoe-run: uploading weights to %s %3d%% (%.1f / %.1f GiB)", device_name_.c_str(), pct,
                       sent / (kMiB * 1024), plan.bytes / (kMiB * 1024));
          last_pct = pct;
        }
      }
    };
    for (const WeightPlan::Item& it : plan.items) {
      const model::Tensor& t = *it.t;
      if (it.as_f32) {
        check(cudaEventSynchronize(done[buf]), "upload failed");
        quant::dequantize_row(t.type, t.data, reinterpret_cast<float*>(staging[buf]), t.ne[0]);
        send(staging[buf], static_cast<size_t>(t.ne[0]) * sizeof(float), it.offset);
        continue;
      }
      const int64_t cols = t.ne[0], rows = t.ne[1] * t.ne[2] * t.ne[3];
      const size_t src_row = gguf::row_bytes(t.type, cols);
      const size_t dst_row = layout::dev_row_bytes(static_cast<uint32_t>(t.type), cols);
      const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kStagingBytes / dst_row));
      if (static_cast<size_t>(chunk) * dst_row > kStagingBytes)
        fail(Exit::gpu_failed, "upload failed: a row of {} does not fit the staging buffer", t.info->name);
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t nr = std::min(chunk, rows - r0);
        check(cudaEventSynchronize(done[buf]), "upload failed");
        repack_rows(t.type, t.data + r0 * src_row, staging[buf], cols, nr);
        send(staging[buf], static_cast<size_t>(nr) * dst_row, it.offset + static_cast<size_t>(r0) * dst_row);
      }
    }
    check(cudaStreamSynchronize(stream_), "upload failed");
    if (bar) std::fprintf(stderr, "\r%*s\r", 90, "");

    auto mat = [&](const model::Tensor& t, size_t off) {
      k::Mat m;
      m.data = weights_.as<uint8_t>(off);
      m.type = static_cast<uint32_t>(t.type);
      m.cols = static_cast<int32_t>(t.ne[0]);
      m.rows = static_cast<int32_t>(t.ne[1]);
      m.row_stride = static_cast<int64_t>(layout::dev_row_bytes(m.type, t.ne[0]));
      m.expert_stride = m.row_stride * t.ne[1];
      return m;
    };
    embd_ = mat(model_->token_embd, embd_off_);
    output_ = c_.tied_output ? embd_ : mat(model_->output, out_off_);
    out_norm_ = weights_.as<float>(out_norm_off_);
    layers_.clear();
    for (size_t l = 0; l < model_->layers.size(); ++l) {
      const model::Layer& L = model_->layers[l];
      const LayerOffsets& lo = layer_offs_[l];
      DevLayer d;
      d.q = mat(L.attn_q, lo.q);
      d.k = mat(L.attn_k, lo.k);
      d.v = mat(L.attn_v, lo.v);
      d.o = mat(L.attn_output, lo.o);
      d.router = mat(L.ffn_gate_inp, lo.router);
      d.gate = mat(L.ffn_gate_exps, lo.gate);
      d.up = mat(L.ffn_up_exps, lo.up);
      d.down = mat(L.ffn_down_exps, lo.down);
      d.attn_norm = weights_.as<float>(lo.attn_norm);
      d.ffn_norm = weights_.as<float>(lo.ffn_norm);
      d.q_norm = weights_.as<float>(lo.q_norm);
      d.k_norm = weights_.as<float>(lo.k_norm);
      layers_.push_back(d);
    }
  }

  void alloc_scratch() {
    kv_.alloc(kv_bytes(), "the KV cache");
    const std::vector<size_t> sizes = scratch_sizes();
    scratch_.alloc(scratch_bytes(), "scratch buffers");
    check(cudaMemsetAsync(scratch_.ptr, 0, scratch_.bytes, stream_), "upload failed: clearing scratch");
    std::vector<uint8_t*> p;
    size_t off = 0;
    for (size_t b : sizes) {
      p.push_back(scratch_.as<uint8_t>(off));
      off += align_up(b, kAlign);
    }
    x_ = reinterpret_cast<float*>(p[0]);
    h_ = reinterpret_cast<float*>(p[1]);
    qkv_ = reinterpret_cast<float*>(p[2]);
    o_ = reinterpret_cast<float*>(p[3]);
    router_logits_ = reinterpret_cast<float*>(p[4]);
    ids_ = reinterpret_cast<int32_t*>(p[5]);
    wts_ = reinterpret_cast<float*>(p[6]);
    count_ = reinterpret_cast<int*>(p[7]);
    offset_ = reinterpret_cast<int*>(p[8]);
    token_of_slot_ = reinterpret_cast<int32_t*>(p[9]);
    slot_of_ = reinterpret_cast<int32_t*>(p[10]);
    act_ = reinterpret_cast<float*>(p[11]);
    expert_out_ = reinterpret_cast<float*>(p[12]);
    logits_.ptr = p[13];
    partials_ = reinterpret_cast<float*>(p[14]);
    counters_ = reinterpret_cast<int*>(p[15]);
    route_logits_ = reinterpret_cast<float*>(p[16]);
    int32_t* small = reinterpret_cast<int32_t*>(p[17]);
    token_ = small + 1;
    pos_ = small + 2;
    prefill_pos_ = small + 3;
    argmax_.ptr = small + 4;
    barrier_ = reinterpret_cast<unsigned*>(small + 8);
    early_tag_ = small + 12;  // k::EarlyIds
    prefill_ids_ = reinterpret_cast<int32_t*>(p[18]);
    argmax_scratch_ = reinterpret_cast<float*>(p[19]);
    rope_cs_ = reinterpret_cast<float*>(p[20]);
    racc_.n = static_cast<int>(c_.n_expert);
    racc_.acc = reinterpret_cast<long long*>(p[21]);
    racc_.ref = reinterpret_cast<float*>(p[21] + (c_.n_expert + 1) * 8);
    split_ = p[22];
    tickets_ = reinterpret_cast<int*>(p[23]);
    check(cudaMallocHost(reinterpret_cast<void**>(&host_io_), 64), "upload failed: pinned buffer");
    for (cudaEvent_t& e : step_done_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "upload failed");
    chain_ = k::env_switch("MOE_CUDA_CHAIN", true);
    check(cudaStreamSynchronize(stream_), "upload failed: clearing scratch");
  }

  // ---- the forward -------------------------------------------------------------------------------------
  k::Rope rope() const {
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

  void* k_cache(size_t l) const {
    return kv_.as<uint8_t>(l * 2 * static_cast<size_t>(n_ctx_) * c_.kv_dim() * 2);
  }
  void* v_cache(size_t l) const {
    return kv_.as<uint8_t>((l * 2 + 1) * static_cast<size_t>(n_ctx_) * c_.kv_dim() * 2);
  }

  // One decode token: reads the token id from token_ and its position from pos_.
  void enqueue_decode(bool greedy) {
    const char* step = "graph capture failed";
    const int E = static_cast<int>(c_.n_embd), Q = static_cast<int>(c_.q_dim()), KV = static_cast<int>(c_.kv_dim());
    const int K = static_cast<int>(c_.n_expert_used);
    const float eps = c_.rms_eps;
    const k::Rope rp = rope();
    check(k::embed_rows(embd_, token_, 1, x_, stream_), step);
    check(k::rope_table(pos_, 1, rp, static_cast<int>(c_.head_dim), rope_cs_, stream_), step);
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
      // Q/K/V rows: sent to L2 by the previous layer's down kernel (see below), else prefetched by the GEMV
      const bool qkv_in_l2 = l > 0 && k::expert_down_sends_ahead(layers_[l - 1].down);
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
      if (fused_router_) {  // the router's sums in the O projection, the choice in the gate/up blocks
        check(k::o_proj_router(L.o, o_, x_, L.router, L.ffn_norm, racc_, stream_, &att_), step);
        check(k::expert_gate_up_acc(L.gate, L.up, x_, L.ffn_norm, eps, racc_, K, ids_, wts_, act_, stream_,
                                    early.tag ? &early : nullptr),
              step);
      } else {
        k::GemvOut out{L.o, x_};
        check(k::gemv(&out, 1, o_, nullptr, 0.f, true, stream_), step);
        check(k::route_token(x_, L.ffn_norm, eps, L.router, h_, route_logits_, stream_), step);
        check(k::expert_gate_up(L.gate, L.up, h_, route_logits_, static_cast<int>(c_.n_expert), K, ids_, wts_, act_,
                                stream_),
              step);
      }
      // the next layer's Q/K/V rows go to L2 from the down kernel's blocks: the Q/K/V GEMV's blocks can start
      // only as the down blocks leave the SMs, and their own prefetch then delayed their loads of x
      k::L2Ahead next;
      if (l + 1 < layers_.size()) {
        const DevLayer& N = layers_[l + 1];
        const k::Mat* m3[3] = {&N.q, &N.k, &N.v};
        for (int i = 0; i < 3; ++i) {
          next.base[i] = m3[i]->data;
          next.bytes[i] = m3[i]->rows * m3[i]->row_stride;
        }
      }
      check(k::expert_down_add(L.down, act_, ids_, wts_, K, x_, stream_, l + 1 < layers_.size() ? &next : nullptr,
                               early.tag ? &early : nullptr),
            step);
    }
    k::GemvOut head{output_, static_cast<float*>(logits_.ptr)};
    check(k::gemv(&head, 1, x_, out_norm_, eps, false, stream_), step);
    if (greedy)  // also the next greedy step's token and position (see eval_greedy)
      check(k::argmax(static_cast<float*>(logits_.ptr), output_.rows, argmax_scratch_, argmax_.ptr, stream_, token_,
                      pos_),
            step);
    (void)E;
  }

  // MOE_PERSIST_PROFILE=file: the barrier times of the last decode token, one line per (barrier, block).
  void write_profile() {
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

  // The persistent kernel's table and launch shape, when the model and the device allow it.
  void setup_persist() {
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

  // The decode attention's slices merged by the O projection (k::AttSlices) when the routing is in the O
  // projection and the head size allows it, for contexts of 2 .. defer slices; MOE_CUDA_ATT_DEFER=0 keeps
  // the attention's own merge, =2 or 3 defers fewer than kAttMaxDefer slices.
  k::AttSlices att_slices() const {
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

  // Captures the decode graphs with the persistent kernel when it is available, else (or when its
  // capture fails: a driver without cooperative launches in graphs) with one kernel per step.
  void capture() {
    fused_router_ = fused_router();
    att_ = att_slices();
    early_ids_ = k::env_switch("MOE_CUDA_EARLY_IDS", true);
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

  void capture_graphs() {
    for (int greedy = 0; greedy < 2; ++greedy) {
      cudaGraph_t g = nullptr;
      check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "graph capture failed");
      try {
        enqueue_decode(greedy != 0);
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
      cudaGraphExec_t& slot = greedy ? graph_greedy_ : graph_logits_;
      if (slot) cudaGraphExecDestroy(slot);
      slot = exec;
    }
  }

  // The greedy graph for position n_past() (+1 when a step is already ahead of it on the stream), its
  // argmax copied to result slot s (host_io_[4 + 2s], [5 + 2s]) and step_done_[s] recorded. token: the
  // step's token from the host, or null: the previous greedy step's argmax, on the device already.
  void enqueue_greedy(int s, const int32_t* token) {
    if (token) {
      host_io_[0] = *token;
      host_io_[1] = static_cast<int32_t>(n_past_);
      check_step(cudaMemcpyAsync(token_, host_io_, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    }
    check_step(cudaGraphLaunch(graph_greedy_, stream_));
    check_step(
        cudaMemcpyAsync(host_io_ + 4 + 2 * s, argmax_.ptr, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    check_step(cudaEventRecord(step_done_[s], stream_));
  }

  void decode_step(int32_t token, bool greedy) {
    if (n_past_ + 1 > n_ctx_)
      fail(Exit::resources, "context is full: {} positions used + 1 new token > context size {}", n_past_, n_ctx_);
    host_io_[0] = token;
    host_io_[1] = static_cast<int32_t>(n_past_);
    step_ = "a CUDA kernel failed at decode position";
    check_step(cudaMemcpyAsync(token_, host_io_, 2 * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    check_step(cudaGraphLaunch(greedy ? graph_greedy_ : graph_logits_, stream_));
  }

  void prefill_chunk(const int32_t* tokens, int n, bool all_logits, bool last) {
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
  k::RouterAcc racc_;
  struct {
    void* ptr = nullptr;
  } logits_;
  struct {
    int32_t* ptr = nullptr;
  } argmax_;
  int32_t* host_io_ = nullptr;  // pinned: token, pos, -, prefill pos, then two greedy results {argmax, non-finite}
  // greedy decoding one step ahead (eval_greedy)
  bool chain_ = true, ahead_ = false;
  int32_t ahead_token_ = -1;
  int slot_ = 0, ahead_slot_ = 0;
  cudaEvent_t step_done_[2] = {nullptr, nullptr};

  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // the prefill's V projection, next to K (and Q) on stream_
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  cudaGraphExec_t graph_logits_ = nullptr, graph_greedy_ = nullptr;
};

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Forward> make_forward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o,
                                      DeviceInfo* info) {
  if (!m) fail(Exit::gpu_failed, "the CUDA model would not build: no model");
  return std::make_unique<CudaForward>(std::move(m), o, info);
}

}  // namespace moe::cuda
