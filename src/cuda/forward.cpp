// The CUDA forward: weights resident in the device layout, decode as one captured CUDA graph per
// token step (token and position read from device memory), batched prefill with expert-grouped GEMMs.
// This file: construction (device, checks, the weight plan and upload, scratch) and the eval entry
// points; the decode step is in forward_decode.cpp, the prefill in forward_prefill.cpp.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "forward.hpp"
#include "layout.cuh"
#include "moe/quant.hpp"

namespace moe::cuda {
namespace detail {

namespace {

constexpr size_t kStagingBytes = 64ull << 20;
constexpr uint64_t kReserveBytes = 512ull << 20;  // CUDA context, graphs, fragmentation

void check_matrix(const model::Tensor& t) {
  const std::string name = t.info ? t.info->name : std::string("a tensor");
  if (!layout::supported(static_cast<uint32_t>(t.type)))
    fail(Exit::gpu_failed, "the CUDA model would not build: {} has type {}, which the CUDA kernels do not support", name,
         gguf::type_name(t.type));
  if (t.ne[0] % 32 != 0)
    fail(Exit::gpu_failed, "the CUDA model would not build: {} has rows of {} elements (the CUDA kernels need a multiple of 32)",
         name, t.ne[0]);
}

}  // namespace

size_t WeightPlan::add(const model::Tensor& t, bool as_f32) {
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

CudaForward::CudaForward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o, DeviceInfo* info)
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

CudaForward::~CudaForward() {
  if (stream_) cudaStreamSynchronize(stream_);  // a greedy step may still be ahead (eval_greedy)
  if (!profile_path_.empty()) write_profile();
  if (graph_logits_) cudaGraphExecDestroy(graph_logits_);
  if (graph_greedy_) cudaGraphExecDestroy(graph_greedy_);
  if (graph_sample_) cudaGraphExecDestroy(graph_sample_);
  if (host_io_) cudaFreeHost(host_io_);
  if (logits_host_) cudaFreeHost(logits_host_);
  for (cudaEvent_t e : step_done_)
    if (e) cudaEventDestroy(e);
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (side_) cudaStreamDestroy(side_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaForward::eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) {
  check_tokens(tokens);
  ahead_ = false;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t V = n_vocab();
  if (n_past_ + n > n_ctx_)
    fail(Exit::resources, "context is full: {} positions used + {} new tokens > context size {}", n_past_, n, n_ctx_);
  if (n == 1) {
    decode_step(tokens[0], false);
    logits.resize(static_cast<size_t>(V));
    float* dst = logits_host_ ? logits_host_ : logits.data();
    finish(cudaMemcpyAsync(dst, logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_), "reading the logits");
    if (logits_host_) std::copy(logits_host_, logits_host_ + V, logits.begin());
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

int32_t CudaForward::eval_greedy(int32_t token) {
  check_tokens(std::span<const int32_t>(&token, 1));
  if (n_past_ + 1 > n_ctx_)
    fail(Exit::resources, "context is full: {} positions used + 1 new token > context size {}", n_past_, n_ctx_);
  step_ = "a CUDA kernel failed at decode position";
  const bool hit = ahead_ && ahead_tail_ == Tail::greedy && token == ahead_token_;
  ahead_ = false;  // set again only once this call has succeeded
  int s;
  if (hit) {
    s = ahead_slot_;  // this step is already on the stream
  } else {
    s = host_result_ ? static_cast<int>(n_past_ & 1) : slot_;  // the argmax writes its position parity's slot
    slot_ ^= 1;
    enqueue_greedy(s, &token);
  }
  bool launched = false;
  if (chain_ && n_past_ + 2 <= n_ctx_) {
    ahead_slot_ = host_result_ ? static_cast<int>((n_past_ + 1) & 1) : slot_;
    slot_ ^= 1;
    enqueue_greedy(ahead_slot_, nullptr);
    launched = true;
  }
  return chained_result(s, launched, Tail::greedy);
}

int32_t CudaForward::chained_result(int s, bool launched, Tail tail) {
  check_step(cudaEventSynchronize(step_done_[s]));
  n_past_ += 1;
  const int32_t* r = host_io_ + 4 + 2 * s;
  if (r[1] != 0) fail(Exit::gpu_failed, "the GPU forward produced a non-finite logit at position {}", n_past_ - 1);
  ahead_ = launched;
  ahead_tail_ = tail;
  ahead_token_ = r[0];
  return r[0];
}

k::SampleParams CudaForward::sample_params(const run::SamplerParams& p) {
  k::SampleParams s;
  s.greedy = run::is_greedy(p);
  s.temperature = p.temperature;
  s.top_k = p.top_k;
  s.top_p = p.top_p;
  s.min_p = p.min_p;
  s.penalty = p.repeat_penalty;
  s.last_n = p.repeat_last_n;
  return s;
}

bool CudaForward::samples_on_device(const run::SamplerParams& p) const {
  return device_sampler_ && host_result_ && sample_scratch_ && k::sample_supported(sample_params(p), output_.rows);
}

void CudaForward::prepare_sample(const run::SamplerParams& p) {
  if (!samples_on_device(p)) return;
  const k::SampleParams sp = sample_params(p);
  const auto same = [](const k::SampleParams& a, const k::SampleParams& b) {
    return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p && a.min_p == b.min_p &&
           a.penalty == b.penalty && a.last_n == b.last_n && a.greedy == b.greedy;
  };
  if (graph_sample_ && same(sp, sample_params_)) return;
  step_ = "graph capture failed at decode position";
  check_step(cudaStreamSynchronize(stream_));
  ahead_ = false;
  if (graph_sample_) cudaGraphExecDestroy(graph_sample_);
  graph_sample_ = nullptr;
  sample_params_ = sp;
  try {
    graph_sample_ = capture_graph(Tail::sample);
  } catch (const Error&) {
    // e.g. a device without the shared memory the sampler needs: the host samples from now on (the stream is
    // checked again by the next step, which fails over to the CPU if the device itself is at fault)
    cudaGetLastError();
    device_sampler_ = false;
  }
}

int32_t CudaForward::eval_sample(std::span<const int32_t> history, const run::SamplerParams& p,
                                 const std::function<double()>& uniform) {
  prepare_sample(p);
  if (!samples_on_device(p) || !graph_sample_)
    fail(Exit::other, "cuda forward: these sampler settings are not drawn on the device");
  if (history.empty() || static_cast<int64_t>(history.size()) != n_past_ + 1)
    fail(Exit::usage, "cuda forward: eval_sample needs the {} tokens up to position {}, got {}", n_past_ + 1, n_past_,
         history.size());
  const int32_t token = history.back();
  check_tokens(std::span<const int32_t>(&token, 1));
  if (n_past_ + 1 > n_ctx_)
    fail(Exit::resources, "context is full: {} positions used + 1 new token > context size {}", n_past_, n_ctx_);
  const k::SampleParams& sp = sample_params_;  // prepare_sample captured graph_sample_ with these
  step_ = "a CUDA kernel failed at decode position";
  const bool hit = ahead_ && ahead_tail_ == Tail::sample && token == ahead_token_;
  ahead_ = false;  // set again only once this call has succeeded
  double* u = reinterpret_cast<double*>(host_io_ + 8);  // the graph reads slot (position & 1)
  const int s = static_cast<int>(n_past_ & 1);
  if (!hit) {
    const size_t m = sp.penalty != 1.0f && sp.last_n > 0 ? std::min(history.size(), static_cast<size_t>(sp.last_n)) : 0;
    if (m > 0) {  // the window; the graph appends the tokens it draws
      std::copy(history.end() - static_cast<std::ptrdiff_t>(m), history.end(), host_io_ + kHistStage);
      check_step(cudaMemcpyAsync(hist_ + (history.size() - m), host_io_ + kHistStage, m * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream_));
    }
    if (!sp.greedy) u[s] = uniform();
    std::atomic_thread_fence(std::memory_order_seq_cst);
    enqueue_chained(graph_sample_, s, &token);
  }
  bool launched = false;
  if (chain_ && n_past_ + 2 <= n_ctx_) {
    if (!sp.greedy) u[s ^ 1] = uniform();
    std::atomic_thread_fence(std::memory_order_seq_cst);
    enqueue_chained(graph_sample_, s ^ 1, nullptr);
    launched = true;
  }
  return chained_result(s, launched, Tail::sample);
}

void CudaForward::init_device(int device) {
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

void CudaForward::validate() {
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

WeightPlan CudaForward::plan_weights() {
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

std::vector<size_t> CudaForward::scratch_sizes() const {
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
      k::attention_partials_floats(static_cast<int>(c_.n_head_kv), decode_splits(), static_cast<int>(G),
                                   static_cast<int>(c_.head_dim)) * f,  // the decode attention's partials
      std::max(B * c_.n_head_kv, static_cast<size_t>(k::attention_counter_ints(static_cast<int>(c_.n_head_kv),
                                                                               decode_splits()))) * 4,  // counters
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
      k::kSampleScratchBytes,                               // the device sampler's counters and lists
      static_cast<size_t>(n_ctx_) * 4,                      // the tokens by position (the sampler's window)
  };
}

uint64_t CudaForward::scratch_bytes() const {
  uint64_t s = 0;
  for (size_t b : scratch_sizes()) s += align_up(b, kAlign);
  return s;
}

void CudaForward::upload(const WeightPlan& plan, bool progress) {
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

void CudaForward::alloc_scratch() {
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
  sample_scratch_ = p[24];
  hist_ = reinterpret_cast<int32_t*>(p[25]);
  device_sampler_ = k::env_switch("MOE_CUDA_DEVICE_SAMPLER", true);
  // mapped, so that the greedy graph can write its token there (host_result_); else plain pinned memory and the
  // greedy results come back by copies
  if (cudaHostAlloc(reinterpret_cast<void**>(&host_io_), kHostIoBytes, cudaHostAllocMapped) != cudaSuccess ||
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_io_dev_), host_io_, 0) != cudaSuccess) {
    cudaGetLastError();
    if (host_io_) cudaFreeHost(host_io_);
    host_io_ = nullptr;
    host_io_dev_ = nullptr;
    check(cudaMallocHost(reinterpret_cast<void**>(&host_io_), kHostIoBytes), "upload failed: pinned buffer");
  }
  if (k::env_switch("MOE_CUDA_PINNED_LOGITS", true) &&
      cudaMallocHost(reinterpret_cast<void**>(&logits_host_), static_cast<size_t>(n_vocab()) * sizeof(float)) !=
          cudaSuccess) {
    cudaGetLastError();
    logits_host_ = nullptr;  // the logits then go straight into the caller's vector
  }
  for (cudaEvent_t& e : step_done_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "upload failed");
  chain_ = k::env_switch("MOE_CUDA_CHAIN", true);
  check(cudaStreamSynchronize(stream_), "upload failed: clearing scratch");
}

}  // namespace detail

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
  return std::make_unique<detail::CudaForward>(std::move(m), o, info);
}

}  // namespace moe::cuda
