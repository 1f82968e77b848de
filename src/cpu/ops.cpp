#include "ops.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "moe/quant.hpp"

namespace moe::cpu {

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
}

// ---- RoPE ------------------------------------------------------------------------------------
namespace {
float yarn_corr_dim(int n_dims, float n_ctx_orig, float n_rot, float base) {
  return static_cast<float>(n_dims) * std::log(n_ctx_orig / (n_rot * 2.0f * static_cast<float>(M_PI))) /
         (2.0f * std::log(base));
}
}  // namespace

Rope Rope::from_config(const model::ModelConfig& c) {
  Rope r;
  r.n_dims = static_cast<int>(c.head_dim);
  r.theta_scale = std::pow(c.rope_base, -2.0f / static_cast<float>(r.n_dims));
  r.attn_factor = c.rope_attn_factor;
  switch (c.rope_scaling) {
    case model::RopeScalingType::none:
      r.freq_scale = 1.f;
      break;
    case model::RopeScalingType::linear:
      r.freq_scale = c.rope_freq_scale;
      break;
    case model::RopeScalingType::yarn: {
      r.freq_scale = c.rope_freq_scale;
      r.ext_factor = 1.f;
      const float n_orig = static_cast<float>(c.rope_n_ctx_orig ? c.rope_n_ctx_orig : c.context_length);
      const float lo = std::floor(yarn_corr_dim(r.n_dims, n_orig, 32.0f, c.rope_base));
      const float hi = std::ceil(yarn_corr_dim(r.n_dims, n_orig, 1.0f, c.rope_base));
      r.corr_lo = std::max(0.0f, lo);
      r.corr_hi = std::min(static_cast<float>(r.n_dims - 1), hi);
      break;
    }
  }
  return r;
}

void Rope::table(int64_t pos, float* cs) const {
  float theta_extrap = static_cast<float>(pos);
  for (int i0 = 0; i0 < n_dims; i0 += 2) {
    const float theta_interp = freq_scale * theta_extrap;
    float theta = theta_interp;
    float mscale = attn_factor;
    if (ext_factor != 0.0f) {
      const float y = (static_cast<float>(i0 / 2) - corr_lo) / std::max(0.001f, corr_hi - corr_lo);
      const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * ext_factor;
      theta = theta_interp * (1 - ramp) + theta_extrap * ramp;
      mscale *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
    }
    cs[i0] = std::cos(theta) * mscale;
    cs[i0 + 1] = std::sin(theta) * mscale;
    theta_extrap *= theta_scale;
  }
}

void rope_neox(float* x, const float* cs, int n_dims) {
  const int half = n_dims / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x0 * s + x1 * c;
  }
}

// ---- fp16 ------------------------------------------------------------------------------------
namespace {

bool use_f16c() {
  static const bool ok = [] {
    const char* cap = std::getenv("MOE_ISA");
    if (cap && std::strcmp(cap, "scalar") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

__attribute__((target("avx2,fma,f16c"))) void f32_to_f16_avx2(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
  }
  for (; i < n; ++i) y[i] = quant::f32_to_fp16(x[i]);
}

__attribute__((target("avx2,fma,f16c"))) void round_f16_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) y[i] = quant::fp16_to_f32(quant::f32_to_fp16(x[i]));
}

__attribute__((target("avx2,fma,f16c"))) float dot_f32_f16_avx2(const float* a, const uint16_t* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    const __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 8)));
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), b0, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), b1, acc1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), b0, acc0);
  }
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * quant::fp16_to_f32(b[i]);
  return r;
}

__attribute__((target("avx2,fma,f16c"))) void axpy_f16_avx2(float* y, float a, const uint16_t* x, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, xv, _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * quant::fp16_to_f32(x[i]);
}

}  // namespace

void f32_to_f16_row(const float* x, uint16_t* y, int64_t n) {
  if (use_f16c()) return f32_to_f16_avx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = quant::f32_to_fp16(x[i]);
}

void round_f16_row(const float* x, float* y, int64_t n) {
  if (use_f16c()) return round_f16_avx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = quant::fp16_to_f32(quant::f32_to_fp16(x[i]));
}

float dot_f32_f16(const float* a, const uint16_t* b, int64_t n) {
  if (use_f16c()) return dot_f32_f16_avx2(a, b, n);
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * quant::fp16_to_f32(b[i]);
  return r;
}

void axpy_f16(float* y, float a, const uint16_t* x, int64_t n) {
  if (use_f16c()) return axpy_f16_avx2(y, a, x, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * quant::fp16_to_f32(x[i]);
}

void softmax(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += static_cast<double>(x[i]);
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace moe::cpu
