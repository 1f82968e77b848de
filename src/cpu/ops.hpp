// Element-wise and attention helpers of the CPU forward (private to src/cpu).
#pragma once
#include <cstddef>
#include <cstdint>

#include "moe/model.hpp"

namespace moe::cpu {

// y = (x * 1/sqrt(mean(x^2) + eps)) * w, the sum of squares in double and the rest in fp32, in the
// operation order of ggml's CPU rms_norm followed by the gain multiply. y may alias x.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);

// The cos/sin of every rotary pair at one position, built like ggml's CPU rope cache
// (theta grows by a factor per pair; YaRN ramp and magnitude when configured).
struct Rope {
  int n_dims = 0;
  float theta_scale = 1.f;
  float freq_scale = 1.f;
  float ext_factor = 0.f;
  float attn_factor = 1.f;
  float corr_lo = 0.f, corr_hi = 0.f;

  static Rope from_config(const model::ModelConfig& c);
  // cs[2*i] = cos, cs[2*i + 1] = sin of pair i (n_dims/2 pairs).
  void table(int64_t pos, float* cs) const;
};
// NEOX rotation of one head of n_dims values in place: element i pairs with i + n_dims/2.
void rope_neox(float* x, const float* cs, int n_dims);

// fp16 helpers picked at run time (F16C/AVX2 when the CPU has them).
void f32_to_f16_row(const float* x, uint16_t* y, int64_t n);
void round_f16_row(const float* x, float* y, int64_t n);  // y = f32(f16(x))
float dot_f32_f16(const float* a, const uint16_t* b, int64_t n);
void axpy_f16(float* y, float a, const uint16_t* x, int64_t n);  // y += a * f32(x)

// Attention of `n_heads` query heads (q: n_heads rows of hd) sharing one KV head over cache
// positions [0, n_pos) (rows kv_stride halves apart): out = softmax(q·K^T · scale) · V per head.
// round_f16: Q and the probabilities rounded to fp16 first (llama.cpp's CPU path against an fp16
// cache). scores: n_heads * n_pos floats of scratch. out may alias q.
void attend(const float* q, int64_t n_heads, int64_t hd, const uint16_t* K, const uint16_t* V, int64_t kv_stride,
            int64_t n_pos, float scale, bool round_f16, float* scores, float* qbuf, float* out);

// y = x * sigmoid(x) * u over n values (SwiGLU's gate applied to up).
void swiglu(const float* g, const float* u, float* y, int64_t n);

// Index of the first non-finite value, or -1.
int64_t first_non_finite(const float* x, int64_t n);
// Index of the largest value, the lowest index on ties (x finite).
int64_t argmax(const float* x, int64_t n);

// Softmax in place with max subtraction; exp sum in double, then one multiply by 1/sum, as ggml's
// soft_max does.
void softmax(float* x, int64_t n);

inline float silu(float x) { return x / (1.0f + __builtin_expf(-x)); }

}  // namespace moe::cpu
