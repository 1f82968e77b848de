// CpuForward: the layer loop, chunking of long evals, embedding and LM head (REFERENCE.md §4).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "moe/error.hpp"
#include "gemm.hpp"
#include "state.hpp"

namespace moe::cpu {

namespace {

size_t align64(size_t n) { return (n + 63) / 64 * 64; }
// Upper bound of a quantized activation row of n elements for any weight type (F16/BF16 take 2
// bytes per element, the Q8 formats less; F32 activations are never copied into these buffers).
size_t act_bound(int64_t n) { return 2 * static_cast<size_t>(n) + 64; }

constexpr double kMiB = 1024.0 * 1024.0;

}  // namespace

Plan Plan::make(const model::ModelConfig& c, int64_t n_ctx, int64_t batch, int threads) {
  Plan p;
  p.batch = batch;
  p.n_ctx = n_ctx;
  p.threads = std::max(1, threads);
  const size_t B = static_cast<size_t>(batch);
  const size_t E = c.n_embd, qd = c.q_dim(), kvd = c.kv_dim(), X = c.n_expert, K = c.n_expert_used,
               F = c.expert_ffn, hd = c.head_dim;
  p.act_row_max = act_bound(std::max(E, qd));
  p.act_row_ffn = act_bound(static_cast<int64_t>(F));
  p.gather_row = std::max(act_bound(static_cast<int64_t>(E)), 4 * E);

  size_t off = 0;
  auto take = [&off](size_t bytes) {
    const size_t at = off;
    off += align64(bytes);
    return at;
  };
  p.x = take(B * E * 4);
  p.h = take(B * E * 4);
  p.q = take(B * qd * 4);
  p.k = take(B * kvd * 4);
  p.v = take(B * kvd * 4);
  p.rope = take(B * hd * 4);
  p.router = take(B * X * 4);
  p.sel_id = take(B * K * 4);
  p.sel_w = take(B * K * 4);
  p.slot_of = take(B * K * 4);
  p.slot_tok = take(B * K * 4);
  p.exp_count = take(X * 4);
  p.exp_off = take((X + 1) * 4);
  p.exp_active = take(X * 4);
  p.qx = take(3 * B * p.act_row_max);
  p.a = take(B * K * F * 4);
  p.qa = take(B * K * p.act_row_ffn);
  p.dslots = take(static_cast<size_t>(kFewSlots) * E * 4);
  p.per_thread_base = off;

  size_t t = 0;
  auto take_t = [&t](size_t bytes) {
    const size_t at = t;
    t += align64(bytes);
    return at;
  };
  p.t_gather = take_t(B * p.gather_row);
  p.t_gather2 = take_t(B * p.gather_row);
  p.t_gate = take_t(B * kExpertRowChunk * 4);
  p.t_up = take_t(B * kExpertRowChunk * 4);
  p.t_down = take_t(std::max(B * K * kDownScratchRows, K * kDownRowChunkMax) * 4);
  p.t_scores = take_t(8 * static_cast<size_t>(n_ctx) * 4);  // up to 8 heads at once
  p.t_head = take_t(static_cast<size_t>(c.n_head) * hd * 4);
  p.per_thread = align64(t);
  p.arena = off + p.per_thread * static_cast<size_t>(p.threads);
  p.kv = kv_bytes(c, n_ctx);
  return p;
}

Mapping::Mapping(size_t bytes, const char* what) : n(std::max<size_t>(bytes, 1)) {
  p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    p = nullptr;
    fail(Exit::resources, "cannot allocate the CPU {} ({:.1f} MiB)", what, static_cast<double>(bytes) / kMiB);
  }
}
Mapping::~Mapping() {
  if (p) munmap(p, n);
}

uint64_t kv_bytes(const model::ModelConfig& c, int64_t n_ctx) {
  return 2ull * 2ull * c.n_layer * static_cast<uint64_t>(n_ctx) * c.kv_dim();
}

uint64_t memory_bytes(const model::ModelConfig& c, int64_t n_ctx, int64_t max_batch, int n_threads) {
  const Plan p = Plan::make(c, n_ctx, max_batch, n_threads);
  return p.arena + p.kv;
}

uint64_t memory_bytes(const model::ModelConfig& c, int64_t n_ctx, int64_t max_batch) {
  return memory_bytes(c, n_ctx, max_batch, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- projections ------------------------------------------------------------------------------
void project(const State& s, const Proj* ps, int n_proj, const float* x, int64_t x_stride, int64_t n_tok,
             bool force_exact) {
  // Activation formats: at most one quantized copy of X per distinct format.
  struct Src {
    const uint8_t* act = nullptr;  // quantized rows, or nullptr for FP32 (x itself)
    size_t stride = 0;
  };
  Src src[4];
  quant::Type fmt[3];
  int n_fmt = 0;
  const bool exact = force_exact || s.mode == quant::ActMode::exact;
  for (int i = 0; i < n_proj; ++i) {
    const quant::Type wt = ps[i].w.type;
    if (exact || quant::act_type(wt) == quant::Type::F32) continue;
    const quant::Type at = quant::act_type(wt);
    int slot = 0;
    while (slot < n_fmt && fmt[slot] != at) ++slot;
    const size_t stride = quant::act_row_bytes(wt, ps[i].w.cols);
    if (slot == n_fmt) {
      if (n_fmt == 3) fail(Exit::other, "internal: more than 3 activation formats in one projection");
      fmt[n_fmt++] = at;
      uint8_t* dst = s.qx + static_cast<size_t>(slot) * s.plan.batch * s.plan.act_row_max;
      const int64_t cols = ps[i].w.cols;
      const auto quantize = [&](int64_t t, int) { quant::quantize_act(wt, x + t * x_stride, dst + t * stride, cols); };
      if (n_tok < 4) {
        for (int64_t t = 0; t < n_tok; ++t) quantize(t, 0);
      } else {
        s.parallel(n_tok, quantize);
      }
    }
    src[i] = Src{s.qx + static_cast<size_t>(slot) * s.plan.batch * s.plan.act_row_max, stride};
  }

  // Row chunks: enough tasks per thread for balance, never below 16 rows.
  int64_t total_rows = 0;
  for (int i = 0; i < n_proj; ++i) total_rows += ps[i].w.rows;
  const int64_t target_tasks = static_cast<int64_t>(s.pool->size()) * 16;
  int64_t chunk = (total_rows + target_tasks - 1) / target_tasks;
  chunk = std::clamp<int64_t>((chunk + 15) / 16 * 16, 16, 1024);
  int64_t first_task[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < n_proj; ++i) first_task[i + 1] = first_task[i] + (ps[i].w.rows + chunk - 1) / chunk;

  s.parallel(first_task[n_proj], [&](int64_t task, int) {
    int i = 0;
    while (task >= first_task[i + 1]) ++i;
    const Proj& p = ps[i];
    const int64_t r0 = (task - first_task[i]) * chunk;
    const int64_t r1 = std::min(p.w.rows, r0 + chunk);
    if (src[i].act) {
      matmul_rows(p.w, r0, r1, src[i].act, src[i].stride, n_tok, p.y, p.y_stride);
    } else {
      quant::matmul_rows_exact(p.w, r0, r1, x, x_stride, n_tok, p.y, p.y_stride);
    }
  });
}

// ---- attention --------------------------------------------------------------------------------
void attention_block(State& s, int64_t layer, int64_t n, int64_t p0, int64_t out0, int64_t n_out) {
  const model::ModelConfig& c = *s.c;
  const model::Layer& L = s.model->layers[static_cast<size_t>(layer)];
  const int64_t E = c.n_embd, qd = c.q_dim(), kvd = c.kv_dim(), hd = c.head_dim;
  const int64_t n_head = c.n_head, n_kv = c.n_head_kv, group = n_head / n_kv;
  const float eps = c.rms_eps;
  double tp = lap_start(s);

  s.parallel(n, [&](int64_t t, int) { rms_norm(s.x + t * E, L.attn_norm.f32(), s.h + t * E, E, eps); });

  if (n_out == n) {
    const Proj p[3] = {{L.attn_q.matrix(), s.q, qd}, {L.attn_k.matrix(), s.k, kvd}, {L.attn_v.matrix(), s.v, kvd}};
    project(s, p, 3, s.h, E, n);
  } else {
    const Proj kv[2] = {{L.attn_k.matrix(), s.k, kvd}, {L.attn_v.matrix(), s.v, kvd}};
    project(s, kv, 2, s.h, E, n);
    if (n_out > 0) {
      const Proj pq{L.attn_q.matrix(), s.q + out0 * qd, qd};
      project(s, &pq, 1, s.h + out0 * E, E, n_out);
    }
  }

  lap(s, kQkv, tp);

  // Per-head norms and RoPE; K and V go into the fp16 cache.
  uint16_t* kc = s.k_cache(layer);
  uint16_t* vc = s.v_cache(layer);
  s.parallel(n, [&](int64_t t, int) {
    const float* cs = s.rope_cs + t * hd;
    if (t >= out0 && t < out0 + n_out) {
      for (int64_t i = 0; i < n_head; ++i) {
        float* qh = s.q + t * qd + i * hd;
        rms_norm(qh, L.attn_q_norm.f32(), qh, hd, eps);
        rope_neox(qh, cs, static_cast<int>(hd));
      }
    }
    for (int64_t j = 0; j < n_kv; ++j) {
      float* kh = s.k + t * kvd + j * hd;
      rms_norm(kh, L.attn_k_norm.f32(), kh, hd, eps);
      rope_neox(kh, cs, static_cast<int>(hd));
    }
    const size_t pos = static_cast<size_t>(p0 + t);
    f32_to_f16_row(s.k + t * kvd, kc + pos * kvd, kvd);
    f32_to_f16_row(s.v + t * kvd, vc + pos * kvd, kvd);
  });
  lap(s, kRopeKv, tp);
  if (n_out == 0) return;

  // Scaled dot-product attention over the cache (the batch's own K/V already rounded to fp16),
  // one task per (token, KV head) so the query heads sharing a KV head read its rows once. Fast
  // mode rounds Q and the probabilities to fp16 as llama.cpp's CPU matmuls against the fp16 cache
  // do; exact mode keeps them fp32. The heads' outputs overwrite their Q in place.
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const bool fast = s.mode == quant::ActMode::fast;
  s.parallel(n_out * n_kv, [&](int64_t task, int thread) {
    const int64_t t = out0 + task / n_kv, g = task % n_kv;
    uint8_t* tb = s.thread_block(thread);
    float* qg = s.q + t * qd + g * group * hd;
    attend(qg, group, hd, kc + g * hd, vc + g * hd, kvd, p0 + t + 1, scale, fast,
           reinterpret_cast<float*>(tb + s.plan.t_scores), reinterpret_cast<float*>(tb + s.plan.t_head), qg);
  });
  lap(s, kAttention, tp);

  const Proj po{L.attn_output.matrix(), s.y + out0 * E, E};
  project(s, &po, 1, s.q + out0 * qd, qd, n_out);
  s.parallel(n_out, [&](int64_t t, int) {
    float* xr = s.x + (out0 + t) * E;
    const float* yr = s.y + (out0 + t) * E;
    for (int64_t e = 0; e < E; ++e) xr[e] += yr[e];
  });
  lap(s, kWo, tp);
}

// ---- the Forward ------------------------------------------------------------------------------
namespace {

class CpuForward final : public Forward {
 public:
  CpuForward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o) {
    if (!m) fail(Exit::usage, "cpu forward: no model");
    if (!o.pool) fail(Exit::usage, "cpu forward: no thread pool");
    if (o.max_batch < 1) fail(Exit::usage, "cpu forward: max_batch must be positive, got {}", o.max_batch);
    s_.model = std::move(m);
    s_.c = &s_.model->config;
    s_.pool = o.pool;
    s_.mode = o.mode;
    s_.margins_out = o.router_margins;
    const model::ModelConfig& c = *s_.c;
    s_.n_ctx = o.n_ctx > 0 ? o.n_ctx : static_cast<int64_t>(c.context_length);
    if (s_.n_ctx <= 0) fail(Exit::usage, "cpu forward: context size must be positive");
    s_.batch = std::min(o.max_batch, s_.n_ctx);
    s_.plan = Plan::make(c, s_.n_ctx, s_.batch, o.pool->size());
    s_.rope = Rope::from_config(c);
    s_.profile = std::getenv("MOE_CPU_PROFILE") != nullptr;

    const uint64_t need = s_.plan.arena + s_.plan.kv;
    const uint64_t phys = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    if (phys > 0 && need > phys)
      fail(Exit::resources,
           "the CPU KV cache ({:.1f} MiB for {} positions) and scratch ({:.1f} MiB) need {:.1f} MiB, more than the "
           "machine's {:.1f} MiB of memory",
           static_cast<double>(s_.plan.kv) / kMiB, s_.n_ctx, static_cast<double>(s_.plan.arena) / kMiB,
           static_cast<double>(need) / kMiB, static_cast<double>(phys) / kMiB);
    s_.kv = std::make_unique<Mapping>(s_.plan.kv, "KV cache");
    s_.arena = std::make_unique<Mapping>(s_.plan.arena, "scratch");

    uint8_t* base = static_cast<uint8_t*>(s_.arena->p);
    const Plan& p = s_.plan;
    auto f = [base](size_t off) { return reinterpret_cast<float*>(base + off); };
    auto i32 = [base](size_t off) { return reinterpret_cast<int32_t*>(base + off); };
    s_.x = f(p.x);
    s_.h = f(p.h);
    s_.y = s_.h;
    s_.q = f(p.q);
    s_.k = f(p.k);
    s_.v = f(p.v);
    s_.rope_cs = f(p.rope);
    s_.router = f(p.router);
    s_.sel_w = f(p.sel_w);
    s_.a = f(p.a);
    s_.dslots = f(p.dslots);
    s_.sel_id = i32(p.sel_id);
    s_.slot_of = i32(p.slot_of);
    s_.slot_tok = i32(p.slot_tok);
    s_.exp_count = i32(p.exp_count);
    s_.exp_off = i32(p.exp_off);
    s_.exp_active = i32(p.exp_active);
    s_.qx = base + p.qx;
    s_.qa = base + p.qa;
  }

  void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) override {
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t V = n_vocab();
    if (n == 0) fail(Exit::usage, "cpu forward: eval of an empty token list");
    if (n_past_ + n > s_.n_ctx)
      fail(Exit::resources, "context is full: {} positions used + {} new tokens > context size {}", n_past_, n,
           s_.n_ctx);
    for (int64_t i = 0; i < n; ++i)
      if (tokens[static_cast<size_t>(i)] < 0 || tokens[static_cast<size_t>(i)] >= V)
        fail(Exit::usage, "token id {} at position {} is outside the vocabulary (n_vocab {})",
             tokens[static_cast<size_t>(i)], n_past_ + i, V);
    logits.resize(static_cast<size_t>(all_logits ? n * V : V));
    for (int64_t c0 = 0; c0 < n; c0 += s_.batch) {
      const int64_t m = std::min(s_.batch, n - c0);
      float* out = nullptr;
      if (all_logits) {
        out = logits.data() + c0 * V;
      } else if (c0 + m == n) {
        out = logits.data();
      }
      run_chunk(tokens.data() + c0, m, out, all_logits);
    }
  }

  int32_t eval_greedy(int32_t token) override {
    eval(std::span<const int32_t>(&token, 1), false, greedy_logits_);
    return static_cast<int32_t>(argmax(greedy_logits_.data(), static_cast<int64_t>(greedy_logits_.size())));
  }

  int64_t n_past() const override { return n_past_; }
  int64_t n_ctx() const override { return s_.n_ctx; }
  int64_t n_vocab() const override { return s_.model->output.ne[1]; }
  void reset() override { n_past_ = 0; }
  std::string name() const override { return "cpu"; }

 private:
  void run_chunk(const int32_t* tok, int64_t n, float* out, bool all_logits) {
    const model::ModelConfig& c = *s_.c;
    const int64_t E = c.n_embd, hd = c.head_dim, p0 = n_past_;
    double tp = lap_start(s_);
    const model::Tensor& emb = s_.model->token_embd;
    s_.parallel(n, [&](int64_t t, int) {
      quant::dequantize_row(emb.type, emb.data + static_cast<size_t>(tok[t]) * emb.row_bytes, s_.x + t * E, E);
      s_.rope.table(p0 + t, s_.rope_cs + t * hd);
    });

    lap(s_, kEmbed, tp);

    // In the last layer only the rows whose logits are wanted need more than their K/V.
    int64_t out0 = 0, n_out = n;
    if (!out) {
      n_out = 0;
    } else if (!all_logits) {
      out0 = n - 1;
      n_out = 1;
    }
    const int64_t n_layer = c.n_layer;
    if (s_.margins_out) s_.margin.assign(static_cast<size_t>(n), std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < n_layer; ++l) {
      const bool last = l == n_layer - 1;
      const int64_t o0 = last ? out0 : 0, no = last ? n_out : n;
      attention_block(s_, l, n, p0, o0, no);
      if (no > 0) moe_block(s_, l, o0, no);
    }
    n_past_ += n;
    if (s_.margins_out) s_.margins_out->insert(s_.margins_out->end(), s_.margin.begin(), s_.margin.end());
    if (!out) return;
    tp = lap_start(s_);

    s_.parallel(n_out, [&](int64_t t, int) {
      rms_norm(s_.x + (out0 + t) * E, s_.model->output_norm.f32(), s_.h + t * E, E, c.rms_eps);
    });
    // A NaN in the hidden state could vanish in the activation quantization; check it here too.
    for (int64_t t = 0; t < n_out; ++t)
      for (int64_t i = 0; i < E; ++i)
        if (!std::isfinite(s_.h[t * E + i]))
          fail(Exit::inference, "non-finite hidden state at position {} (the input of the LM head)", p0 + out0 + t);
    const int64_t V = n_vocab();
    const Proj head{s_.model->output.matrix(), out, V};
    project(s_, &head, 1, s_.h, E, n_out);
    for (int64_t t = 0; t < n_out; ++t) {
      const float* row = out + t * V;
      if (const int64_t i = first_non_finite(row, V); i >= 0)
        fail(Exit::inference, "non-finite logit at position {} (token id {}: {})", p0 + out0 + t, i, row[i]);
    }
    lap(s_, kHead, tp);
  }

  State s_;
  int64_t n_past_ = 0;
  std::vector<float> greedy_logits_;  // eval_greedy's row, kept between calls

 public:
  ~CpuForward() override {
    if (!s_.profile) return;
    double total = 0;
    for (double t : s_.phase_s) total += t;
    std::fprintf(stderr, "cpu forward profile (%s, %d threads): %.3f s\n",
                 s_.mode == quant::ActMode::fast ? "fast" : "exact", s_.pool->size(), total);
    for (int p = 0; p < kPhases; ++p)
      std::fprintf(stderr, "  %-16s %8.3f s  %5.1f %%\n", kPhaseNames[p], s_.phase_s[p],
                   total > 0 ? 100.0 * s_.phase_s[p] / total : 0.0);
  }
};

}  // namespace

std::unique_ptr<Forward> make_forward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o) {
  return std::make_unique<CpuForward>(std::move(m), o);
}

}  // namespace moe::cpu
