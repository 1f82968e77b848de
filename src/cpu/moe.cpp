// The MoE block (REFERENCE.md §4.8): router softmax over all experts, top-k, renormalised weights,
// and the selected experts' SwiGLU FFNs with the batch's tokens grouped by expert, so that every
// selected expert's weights stream through the cache once per batch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "moe/error.hpp"
#include "gemm.hpp"
#include "state.hpp"

namespace moe::cpu {

namespace {

// Where the expert inputs of one matrix come from: quantized rows of s.qx, or FP32 rows of h.
struct ExpertInput {
  const uint8_t* rows = nullptr;
  size_t stride = 0;  // bytes between rows
  bool fp32 = false;
};

void expert_rows(const quant::Matrix& w, int64_t r0, int64_t r1, const ExpertInput& in, const uint8_t* act,
                 int64_t n_tok, float* y, int64_t y_stride) {
  if (in.fp32) {
    quant::matmul_rows_exact(w, r0, r1, reinterpret_cast<const float*>(act),
                             static_cast<int64_t>(in.stride / sizeof(float)), n_tok, y, y_stride);
  } else {
    matmul_rows(w, r0, r1, act, in.stride, n_tok, y, y_stride);
  }
}

// The rows of the tokens routed to one expert, contiguous: a view of the source row when there is
// a single token, else a copy into the thread's gather buffer.
const uint8_t* gather(const ExpertInput& in, const int32_t* tokens, int64_t n_tok, uint8_t* buf) {
  if (n_tok == 1) return in.rows + static_cast<size_t>(tokens[0]) * in.stride;
  for (int64_t j = 0; j < n_tok; ++j)
    std::memcpy(buf + static_cast<size_t>(j) * in.stride, in.rows + static_cast<size_t>(tokens[j]) * in.stride,
                in.stride);
  return buf;
}

// Makes the activation rows of h ([n][E]) for matrix type `wt`, reusing `other` when the format is
// the same; `slot` picks the qx area.
ExpertInput expert_input(const State& s, quant::Type wt, const float* h, int64_t n, int slot,
                         const ExpertInput* other, quant::Type other_type) {
  const int64_t E = s.c->n_embd;
  if (s.mode == quant::ActMode::exact || quant::act_type(wt) == quant::Type::F32)
    return ExpertInput{reinterpret_cast<const uint8_t*>(h), static_cast<size_t>(E) * sizeof(float), true};
  if (other && !other->fp32 && quant::act_type(other_type) == quant::act_type(wt)) return *other;
  const size_t stride = quant::act_row_bytes(wt, E);
  uint8_t* dst = s.qx + static_cast<size_t>(slot) * s.plan.batch * s.plan.act_row_max;
  const auto quantize = [&](int64_t t, int) { quant::quantize_act(wt, h + t * E, dst + t * stride, E); };
  if (n < 4) {
    for (int64_t t = 0; t < n; ++t) quantize(t, 0);
  } else {
    s.parallel(n, quantize);
  }
  return ExpertInput{dst, stride, false};
}

// Router probabilities -> top-k ids (descending probability, lower id first on exact ties) and
// weights renormalised over the selected set (the sum clamped below at 2^-14). With `margin` (k <
// n_expert), also log p_k - log p_(k+1): one more round of the selection.
void route(float* probs, int64_t n_expert, int64_t k, int32_t* ids, float* w, float* margin = nullptr) {
  softmax(probs, n_expert);
  const int64_t rounds = margin && k < n_expert ? k + 1 : k;
  for (int64_t j = 0; j < rounds; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n_expert; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken |= ids[i] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
    }
    if (j == k) {
      *margin = std::log(w[k - 1]) - std::log(probs[best]);
      break;
    }
    ids[j] = static_cast<int32_t>(best);
    w[j] = probs[best];
  }
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += static_cast<double>(w[j]);
  const float denom = std::max(static_cast<float>(sum), 6.103515625e-5f);
  for (int64_t j = 0; j < k; ++j) w[j] /= denom;
}

}  // namespace

void moe_block(State& s, int64_t layer, int64_t out0, int64_t n) {
  const model::ModelConfig& c = *s.c;
  const model::Layer& L = s.model->layers[static_cast<size_t>(layer)];
  const int64_t E = c.n_embd, X = c.n_expert, K = c.n_expert_used, F = c.expert_ffn;
  float* x = s.x + out0 * E;
  float* h = s.h + out0 * E;
  float* y = s.y + out0 * E;
  double tp = lap_start(s);

  s.parallel(n, [&](int64_t t, int) { rms_norm(x + t * E, L.ffn_norm.f32(), h + t * E, E, c.rms_eps); });

  // Router in FP32 activations (its weights are F32 in every stock file).
  const Proj pr{L.ffn_gate_inp.matrix(), s.router, X};
  project(s, &pr, 1, h, E, n, /*force_exact=*/true);
  const auto route_token = [&](int64_t t, int) {
    float m = std::numeric_limits<float>::infinity();
    route(s.router + t * X, X, K, s.sel_id + t * K, s.sel_w + t * K, s.margins_out ? &m : nullptr);
    if (s.margins_out) s.margin[static_cast<size_t>(out0 + t)] = std::min(s.margin[static_cast<size_t>(out0 + t)], m);
  };
  if (n < 8) {
    for (int64_t t = 0; t < n; ++t) route_token(t, 0);
  } else {
    s.parallel(n, route_token);
  }

  lap(s, kRouter, tp);

  // Group the (token, rank) slots by expert: counting sort, experts in id order.
  int32_t* count = s.exp_count;
  int32_t* off = s.exp_off;
  std::fill(count, count + X, 0);
  for (int64_t i = 0; i < n * K; ++i) ++count[s.sel_id[i]];
  int64_t n_active = 0;
  off[0] = 0;
  for (int64_t e = 0; e < X; ++e) {
    off[e + 1] = off[e] + count[e];
    if (count[e] > 0) s.exp_active[n_active++] = static_cast<int32_t>(e);
  }
  std::fill(count, count + X, 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = s.sel_id[t * K + j];
      const int32_t slot = off[e] + count[e]++;
      s.slot_tok[slot] = static_cast<int32_t>(t);
      s.slot_of[t * K + j] = slot;
    }

  // gate/up: tasks are (active expert, row chunk of expert_ffn); a = silu(gate) * up per slot.
  const ExpertInput in_gate = expert_input(s, L.ffn_gate_exps.type, h, n, 0, nullptr, L.ffn_gate_exps.type);
  const ExpertInput in_up = expert_input(s, L.ffn_up_exps.type, h, n, 1, &in_gate, L.ffn_gate_exps.type);
  const bool same_input = in_up.rows == in_gate.rows;
  // In fast mode each task quantizes its slice of a for the down matrix right away (chunks start on
  // multiples of 256, a multiple of every activation block), so a never exists in FP32.
  const quant::Type dt = L.ffn_down_exps.type;
  const bool quantize_down = s.mode == quant::ActMode::fast && quant::act_type(dt) != quant::Type::F32;
  const size_t qa_stride = quantize_down ? quant::act_row_bytes(dt, F) : 0;
  const gguf::TypeTraits act_traits = gguf::type_traits(quant::act_type(dt));
  static_assert(kExpertRowChunk % 256 == 0);
  // Whole experts per task when there are enough of them for every thread (decode: one long run
  // per matrix), else chunks of kExpertRowChunk rows; either fits the thread's g/u buffers.
  int64_t max_count = 0;
  for (int64_t a = 0; a < n_active; ++a) max_count = std::max<int64_t>(max_count, count[s.exp_active[a]]);
  const int64_t threads = s.pool->size();
  const int64_t gu_chunk =
      (n_active >= 4 * threads && F * max_count <= s.plan.batch * kExpertRowChunk) ? F : kExpertRowChunk;
  const int64_t f_chunks = (F + gu_chunk - 1) / gu_chunk;
  s.parallel(n_active * f_chunks, [&](int64_t task, int thread) {
    const int32_t e = s.exp_active[task / f_chunks];
    const int64_t r0 = (task % f_chunks) * gu_chunk, r1 = std::min(F, r0 + gu_chunk);
    const int64_t n_tok = off[e + 1] - off[e];
    const int32_t* toks = s.slot_tok + off[e];
    uint8_t* tb = s.thread_block(thread);
    float* g = reinterpret_cast<float*>(tb + s.plan.t_gate);
    float* u = reinterpret_cast<float*>(tb + s.plan.t_up);
    const uint8_t* ag = gather(in_gate, toks, n_tok, tb + s.plan.t_gather);
    const uint8_t* au = same_input ? ag : gather(in_up, toks, n_tok, tb + s.plan.t_gather2);
    expert_rows(L.ffn_gate_exps.expert(e), r0, r1, in_gate, ag, n_tok, g - r0, gu_chunk);
    expert_rows(L.ffn_up_exps.expert(e), r0, r1, in_up, au, n_tok, u - r0, gu_chunk);
    for (int64_t j = 0; j < n_tok; ++j) {
      const size_t slot = static_cast<size_t>(off[e] + j);
      float* gr = g + j * gu_chunk;
      const float* ur = u + j * gu_chunk;
      if (quantize_down) {
        swiglu(gr, ur, gr, r1 - r0);
        quant::quantize_act(dt, gr, s.qa + slot * qa_stride + static_cast<size_t>(r0 / act_traits.block_elems) * act_traits.block_bytes,
                            r1 - r0);
      } else {
        swiglu(gr, ur, s.a + slot * F + r0, r1 - r0);
      }
    }
  });

  lap(s, kGateUp, tp);

  const ExpertInput in_down = quantize_down ? ExpertInput{s.qa, qa_stride, false}
                                            : ExpertInput{reinterpret_cast<const uint8_t*>(s.a), static_cast<size_t>(F) * sizeof(float), true};
  const int64_t n_slots = n * K;

  if (n_slots <= kFewSlots) {
    // Few slots: tasks are (expert, row piece of n_embd) into dslots[slot][E], then the rank-order
    // combine per token with the residual.
    const int64_t pieces = std::max<int64_t>(1, (4 * threads + n_active - 1) / n_active);
    const int64_t piece = ((E + pieces - 1) / pieces + 15) / 16 * 16;
    const int64_t n_pieces = (E + piece - 1) / piece;
    s.parallel(n_active * n_pieces, [&](int64_t task, int) {
      const int32_t e = s.exp_active[task / n_pieces];
      const int64_t r0 = (task % n_pieces) * piece, r1 = std::min(E, r0 + piece);
      const uint8_t* act = in_down.rows + static_cast<size_t>(off[e]) * in_down.stride;
      expert_rows(L.ffn_down_exps.expert(e), r0, r1, in_down, act, off[e + 1] - off[e],
                  s.dslots + static_cast<size_t>(off[e]) * E, E);
    });
    const auto combine = [&](int64_t t, int) {
      float* yr = y + t * E;
      for (int64_t j = 0; j < K; ++j) {
        const float w = s.sel_w[t * K + j];
        const float* dr = s.dslots + static_cast<size_t>(s.slot_of[t * K + j]) * E;
        if (j == 0) {
          for (int64_t r = 0; r < E; ++r) yr[r] = dr[r] * w;
        } else {
          for (int64_t r = 0; r < E; ++r) yr[r] += dr[r] * w;
        }
      }
      float* xr = x + t * E;
      for (int64_t r = 0; r < E; ++r) xr[r] += yr[r];
    };
    if (n <= 2) {
      for (int64_t t = 0; t < n; ++t) combine(t, 0);
    } else {
      s.parallel(n, combine);
    }
    lap(s, kDown, tp);
    return;
  }

  // down + weighted sum: tasks are row chunks of n_embd, each runs every active expert on its rows
  // and then combines per token in rank order (y = w0*d0 + w1*d1 + ..., as llama.cpp adds them).
  // The chunk: as long as the scratch allows for this many slots, with a few tasks per thread.
  const int64_t scratch_floats = std::max(s.plan.batch * K * kDownScratchRows, K * kDownRowChunkMax);
  int64_t chunk = std::min<int64_t>(kDownRowChunkMax, scratch_floats / n_slots);
  chunk = std::min<int64_t>(chunk, std::max<int64_t>(16, E / (4 * s.pool->size())));
  chunk = std::max<int64_t>(16, chunk / 16 * 16);
  const int64_t e_chunks = (E + chunk - 1) / chunk;
  s.parallel(e_chunks, [&](int64_t task, int thread) {
    const int64_t r0 = task * chunk, r1 = std::min(E, r0 + chunk);
    float* d = reinterpret_cast<float*>(s.thread_block(thread) + s.plan.t_down);
    for (int64_t a = 0; a < n_active; ++a) {
      const int32_t e = s.exp_active[a];
      const uint8_t* act = in_down.rows + static_cast<size_t>(off[e]) * in_down.stride;
      expert_rows(L.ffn_down_exps.expert(e), r0, r1, in_down, act, off[e + 1] - off[e],
                  d + static_cast<size_t>(off[e]) * chunk - r0, chunk);
    }
    for (int64_t t = 0; t < n; ++t) {
      float* yr = y + t * E;
      for (int64_t j = 0; j < K; ++j) {
        const float w = s.sel_w[t * K + j];
        const float* dr = d + static_cast<size_t>(s.slot_of[t * K + j]) * chunk - r0;
        if (j == 0) {
          for (int64_t r = r0; r < r1; ++r) yr[r] = dr[r] * w;
        } else {
          for (int64_t r = r0; r < r1; ++r) yr[r] += dr[r] * w;
        }
      }
    }
  });

  s.parallel(n, [&](int64_t t, int) {
    float* xr = x + t * E;
    const float* yr = y + t * E;
    for (int64_t e = 0; e < E; ++e) xr[e] += yr[e];
  });
  lap(s, kDown, tp);
}

}  // namespace moe::cpu
