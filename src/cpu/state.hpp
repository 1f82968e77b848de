// The CPU forward's state: model views, KV cache and the scratch carved from one arena at
// construction (private to src/cpu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe/cpu.hpp"
#include "ops.hpp"

namespace moe::cpu {

// Rows of a weight matrix handed to one task. Chunks are small enough that every thread gets
// several tasks in decode and large enough that a task amortises its bookkeeping.
// Long row runs keep the hardware prefetchers streaming in decode, where a few experts' rows are
// all the work.
inline constexpr int64_t kExpertRowChunk = 256;  // gate/up rows (of expert_ffn) per task
inline constexpr int64_t kDownRowChunkMax = 256;  // down rows (of n_embd) per task, at most
inline constexpr int64_t kDownScratchRows = 64;   // down scratch: batch * n_used * this many floats
// Up to this many (token, expert) slots (decode, short evals) the down projection runs expert by
// expert over whole rows into a shared [slot][n_embd] buffer, then combines: each task streams one
// long run of one expert's rows instead of short runs of every expert.
inline constexpr int64_t kFewSlots = 128;

// Buffer sizes of one forward: the single source for memory_bytes() and the allocation.
struct Plan {
  int64_t batch = 0, n_ctx = 0;
  int threads = 1;
  size_t act_row_max = 0;  // bytes of one quantized activation row of max(n_embd, q_dim)
  size_t act_row_ffn = 0;  // ... of expert_ffn
  size_t gather_row = 0;   // bytes of one gathered expert input row (fast or exact)
  // offsets into the arena
  size_t x, h, q, k, v, rope, router, sel_id, sel_w, slot_of, slot_tok, exp_count, exp_off,
      exp_active, qx, a, qa, dslots;
  size_t per_thread_base, per_thread;  // per-thread block: gather, gate, up, down, scores, head
  size_t t_gather, t_gather2, t_gate, t_up, t_down, t_scores, t_head;
  size_t arena = 0;
  uint64_t kv = 0;

  static Plan make(const model::ModelConfig& c, int64_t n_ctx, int64_t batch, int threads);
};

// Anonymous private mapping: pages cost memory only once written, so a long context's cache
// counts in RSS only as far as it is used.
struct Mapping {
  void* p = nullptr;
  size_t n = 0;
  Mapping() = default;
  Mapping(size_t bytes, const char* what);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

// Wall time per phase, summed over evals, printed to stderr when the forward is destroyed; on when
// MOE_CPU_PROFILE is set (for tuning; costs two clock reads per phase).
enum Phase { kEmbed, kQkv, kRopeKv, kAttention, kWo, kRouter, kGateUp, kDown, kHead, kPhases };
inline constexpr const char* kPhaseNames[kPhases] = {"embed",  "norm+qkv", "qk-norm+rope+kv", "attention", "wo",
                                                     "router", "gate+up",  "down+sum",        "lm head"};

struct State {
  std::shared_ptr<const model::OwnedQuantizedModel> model;
  const model::ModelConfig* c = nullptr;
  quant::ThreadPool* pool = nullptr;
  quant::ActMode mode = quant::ActMode::fast;
  Plan plan;
  Rope rope;
  std::unique_ptr<Mapping> arena, kv;
  int64_t n_ctx = 0, batch = 0;
  bool profile = false;
  double phase_s[kPhases] = {};
  // Options::router_margins: this chunk's smallest margin per row (null when not asked for)
  std::vector<float>* margins_out = nullptr;
  std::vector<float> margin;

  // shared scratch; y (the Wo and MoE outputs) shares h's memory: h is dead by the time either
  // is written (Q/K/V are projected, the experts' inputs gathered)
  float *x = nullptr, *h = nullptr, *y = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *rope_cs = nullptr,
        *router = nullptr, *sel_w = nullptr, *a = nullptr, *dslots = nullptr;
  int32_t *sel_id = nullptr, *slot_of = nullptr, *slot_tok = nullptr, *exp_count = nullptr, *exp_off = nullptr,
          *exp_active = nullptr;
  uint8_t *qx = nullptr, *qa = nullptr;

  uint8_t* thread_block(int t) const {
    return static_cast<uint8_t*>(arena->p) + plan.per_thread_base + static_cast<size_t>(t) * plan.per_thread;
  }
  uint16_t* k_cache(int64_t layer) const {
    return static_cast<uint16_t*>(kv->p) + static_cast<size_t>(layer) * 2 * n_ctx * c->kv_dim();
  }
  uint16_t* v_cache(int64_t layer) const { return k_cache(layer) + static_cast<size_t>(n_ctx) * c->kv_dim(); }

  // fn(task, thread) over [0, n) on the pool; inline when there is at most one task. The wrapper
  // captures one reference, so std::function stores it without allocating.
  template <class F>
  void parallel(int64_t n, const F& fn) const {
    if (n <= 0) return;
    if (n == 1 || pool->size() == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    pool->run(n, [&fn](int64_t task, int thread) { fn(task, thread); });
  }
};

double wall_seconds();
// Profiling laps: t holds the start of the current phase.
inline double lap_start(const State& s) { return s.profile ? wall_seconds() : 0.0; }
inline void lap(State& s, Phase p, double& t) {
  if (!s.profile) return;
  const double now = wall_seconds();
  s.phase_s[p] += now - t;
  t = now;
}

// One output of a projection: Y[t * y_stride + r] = W.row(r) · X[t].
struct Proj {
  quant::Matrix w;
  float* y = nullptr;
  int64_t y_stride = 0;
};
// All projections of one input in one pass over the pool; in fast mode X is quantized once per
// activation format (into qx) and shared by the matrices that use it. force_exact: FP32
// activations whatever the mode (the router).
void project(const State& s, const Proj* ps, int n_proj, const float* x, int64_t x_stride, int64_t n_tok,
             bool force_exact = false);

// Row ranges [t0, t0 + n) of the batch: attention of layer `layer` for tokens at positions
// p0 + t, the residual added into s.x. Tokens outside [out0, out0 + n_out) only write K/V.
void attention_block(State& s, int64_t layer, int64_t n, int64_t p0, int64_t out0, int64_t n_out);
// MoE block of `layer` for rows [out0, out0 + n_out), residual added into s.x.
void moe_block(State& s, int64_t layer, int64_t out0, int64_t n_out);

}  // namespace moe::cpu
