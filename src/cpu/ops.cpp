#include "ops.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <cpuid.h>
#include <immintrin.h>

#include "moe/finite.hpp"
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

// CPUID leaf 1, ECX bit 29. clang before 16 has no "f16c" in __builtin_cpu_supports (the fuzz build).
static bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}

bool use_f16c() {
  static const bool ok = [] {
    const char* cap = std::getenv("MOE_ISA");
    if (cap && std::strcmp(cap, "scalar") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
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

// exp(x) for 8 lanes: 2^n · P(r) with n = round(x·log2 e), r = x − n·ln 2 in two parts and a
// degree-6 polynomial (Cephes); relative error ~2 ulp, like the vector exp llama.cpp uses in the
// same places. Inputs below -87.3 give 0 (the softmax and SiLU only need that end).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n via the exponent field; n is in [-126, 127] after the clamp.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(zero_mask, y);
}

__attribute__((target("avx2,fma"))) float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) void softmax_avx2(float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  float mx = -INFINITY;
  {
    alignas(32) float l[8];
    _mm256_store_ps(l, vmax);
    for (float v : l) mx = std::max(mx, v);
    for (int64_t j = i; j < n; ++j) mx = std::max(mx, x[j]);
  }
  double sum = 0.0;
  const __m256 m = _mm256_set1_ps(mx);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    sum += static_cast<double>(hsum8(e));
  }
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += static_cast<double>(x[i]);
  }
  const float inv = static_cast<float>(1.0 / sum);
  const __m256 vi = _mm256_set1_ps(inv);
  i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vi));
  for (; i < n; ++i) x[i] *= inv;
}

__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) y[i] = silu(g[i]) * u[i];
}

// Scores of NB query heads against one K row at a time: the K row is converted once and every head
// accumulates in its own register; a transpose-reduce gives the NB scores.
template <int NB>
__attribute__((target("avx2,fma,f16c"))) void scores_block(const float* q, int64_t hd, const uint16_t* K,
                                                           int64_t kv_stride, int64_t n_pos, float scale,
                                                           float* scores, int64_t score_stride) {
  for (int64_t p = 0; p < n_pos; ++p) {
    const uint16_t* k = K + p * kv_stride;
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
      const __m256 kv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + c)));
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(_mm256_loadu_ps(q + b * hd + c), kv, acc[b]);
    }
    for (int b = 0; b < NB; ++b) scores[b * score_stride + p] = hsum8(acc[b]) * scale;
  }
}

// out[b] = Σ_p P[b][p] · V[p] for NB heads, 8 dims at a time with the heads in registers.
template <int NB>
__attribute__((target("avx2,fma,f16c"))) void values_block(const float* P, int64_t score_stride, int64_t hd,
                                                           const uint16_t* V, int64_t kv_stride, int64_t n_pos,
                                                           float* out) {
  for (int64_t c = 0; c < hd; c += 8) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n_pos; ++p) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(V + p * kv_stride + c)));
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(_mm256_broadcast_ss(P + b * score_stride + p), v, acc[b]);
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + b * hd + c, acc[b]);
  }
}

template <int NB>
void attend_heads_avx2(const float* q, int64_t hd, const uint16_t* K, const uint16_t* V, int64_t kv_stride,
                       int64_t n_pos, float scale, bool round, float* scores, float* out) {
  scores_block<NB>(q, hd, K, kv_stride, n_pos, scale, scores, n_pos);
  for (int b = 0; b < NB; ++b) {
    softmax_avx2(scores + b * n_pos, n_pos);
    if (round) round_f16_avx2(scores + b * n_pos, scores + b * n_pos, n_pos);
  }
  values_block<NB>(scores, n_pos, hd, V, kv_stride, n_pos, out);
}

__attribute__((target("avx2"))) bool all_finite_avx2(const float* x, int64_t n) {
  // Finite: the exponent field is not all ones.
  const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i e = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), exp_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, exp_mask));
  }
  if (!_mm256_testz_si256(bad, bad)) return false;
  for (; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

__attribute__((target("avx2"))) float max_avx2(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_max_ps(m0, m1));
  float m = l[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, l[j]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

}  // namespace

int64_t first_non_finite(const float* x, int64_t n) {
  if (use_f16c() && all_finite_avx2(x, n)) return -1;
  return moe::first_non_finite({x, static_cast<size_t>(n)});
}

int64_t argmax(const float* x, int64_t n) {
  if (n <= 0) return -1;
  if (use_f16c()) {
    const float m = max_avx2(x, n);
    for (int64_t i = 0; i < n; ++i)
      if (x[i] == m) return i;
  }
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

void attend(const float* q, int64_t n_heads, int64_t hd, const uint16_t* K, const uint16_t* V, int64_t kv_stride,
            int64_t n_pos, float scale, bool round_f16, float* scores, float* qbuf, float* out) {
  if (round_f16) {
    round_f16_row(q, qbuf, n_heads * hd);
  } else {
    std::memcpy(qbuf, q, static_cast<size_t>(n_heads * hd) * sizeof(float));
  }
  if (use_f16c() && hd % 8 == 0) {
    int64_t h = 0;
    for (; h + 8 <= n_heads; h += 8)
      attend_heads_avx2<8>(qbuf + h * hd, hd, K, V, kv_stride, n_pos, scale, round_f16, scores, out + h * hd);
    for (; h + 4 <= n_heads; h += 4)
      attend_heads_avx2<4>(qbuf + h * hd, hd, K, V, kv_stride, n_pos, scale, round_f16, scores, out + h * hd);
    for (; h < n_heads; ++h)
      attend_heads_avx2<1>(qbuf + h * hd, hd, K, V, kv_stride, n_pos, scale, round_f16, scores, out + h * hd);
    return;
  }
  for (int64_t h = 0; h < n_heads; ++h) {
    const float* qh = qbuf + h * hd;
    for (int64_t p = 0; p < n_pos; ++p) scores[p] = dot_f32_f16(qh, K + p * kv_stride, hd) * scale;
    softmax(scores, n_pos);
    if (round_f16) round_f16_row(scores, scores, n_pos);
    float* oh = out + h * hd;
    std::fill(oh, oh + hd, 0.0f);
    for (int64_t p = 0; p < n_pos; ++p) axpy_f16(oh, scores[p], V + p * kv_stride, hd);
  }
}

void swiglu(const float* g, const float* u, float* y, int64_t n) {
  if (use_f16c()) return swiglu_avx2(g, u, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = silu(g[i]) * u[i];
}

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
  if (use_f16c()) return softmax_avx2(x, n);
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
