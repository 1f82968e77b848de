// Reference quantizers of Q2_K..Q6_K, written from the block layouts of REFERENCE.md §5.7.
// Each sub-block gets a weighted least-squares scale (and min) chosen among several candidate
// grids; the sub-block scales are then quantized to the super-block's 4/6/8-bit scale codes and
// the elements re-rounded against the scales actually stored, so the stored codes and the stored
// scales agree.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kquants.hpp"

namespace moe::quant::detail {
namespace {

// Larger elements matter more for a matmul's output, but small ones must not be ignored entirely:
// weight by |x| plus the block's RMS.
void affine_weights(const float* x, int n, float* w) {
  float s2 = 0;
  for (int i = 0; i < n; ++i) s2 += x[i] * x[i];
  float rms = std::sqrt(s2 / static_cast<float>(n));
  for (int i = 0; i < n; ++i) w[i] = rms + std::fabs(x[i]);
}
void symmetric_weights(const float* x, int n, float* w) {
  float s2 = 0;
  for (int i = 0; i < n; ++i) s2 += x[i] * x[i];
  float ms = s2 / static_cast<float>(n);
  for (int i = 0; i < n; ++i) w[i] = ms + x[i] * x[i];
}

// Quantizes signed sub-block scales to codes in [lo, hi] with one fp16 super-scale; the signed
// extreme maps to lo so the longer side of the two's-complement range is used.
void quantize_scales_signed(const float* s, int n, int lo, int hi, int* codes, uint16_t& d_out) {
  float amax = 0, max = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(s[i]) > amax) { amax = std::fabs(s[i]); max = s[i]; }
  if (amax == 0.f) {
    std::fill(codes, codes + n, 0);
    d_out = 0;
    return;
  }
  float iscale = static_cast<float>(lo) / max;
  for (int i = 0; i < n; ++i) codes[i] = std::clamp(nearest_int(iscale * s[i]), lo, hi);
  d_out = f32_to_fp16(1.f / iscale);
}

// Unsigned codes in [0, top] for non-negative values.
void quantize_scales_unsigned(const float* s, int n, int top, int* codes, uint16_t& d_out) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = std::max(max, s[i]);
  if (max <= 0.f) {
    std::fill(codes, codes + n, 0);
    d_out = 0;
    return;
  }
  float inv = static_cast<float>(top) / max;
  for (int i = 0; i < n; ++i) codes[i] = std::clamp(nearest_int(inv * s[i]), 0, top);
  d_out = f32_to_fp16(max / static_cast<float>(top));
}

// The codes of an affine super-block against its stored scales: L = round((x + dmin·m)/(d·sc)).
// A scale code rounded down can push the extremes out of the grid, so each sub-block also tries the
// neighbouring scale and min codes and keeps the pair with the smallest weighted error.
void requantize_affine(const float* x, const float* w, int sub, int n_sub, int nmax, float d, float dmin, int top,
                       int* sc, int* m, uint8_t* L) {
  for (int s = 0; s < n_sub; ++s) {
    const float* xs = x + s * sub;
    const float* ws = w + s * sub;
    float best = std::numeric_limits<float>::infinity();
    int best_sc = sc[s], best_m = m[s];
    for (int c = std::max(0, sc[s] - 1); c <= std::min(top, sc[s] + 1); ++c)
      for (int mm = std::max(0, m[s] - 1); mm <= std::min(top, m[s] + 1); ++mm) {
        float ds = d * static_cast<float>(c), dm = dmin * static_cast<float>(mm);
        float err = 0;
        for (int i = 0; i < sub; ++i) {
          int q = ds != 0.f ? std::clamp(nearest_int((xs[i] + dm) / ds), 0, nmax) : 0;
          float diff = ds * static_cast<float>(q) - dm - xs[i];
          err += ws[i] * diff * diff;
        }
        if (err < best) { best = err; best_sc = c; best_m = mm; }
      }
    sc[s] = best_sc;
    m[s] = best_m;
    float ds = d * static_cast<float>(sc[s]), dm = dmin * static_cast<float>(m[s]);
    for (int i = 0; i < sub; ++i) {
      int q = ds != 0.f ? nearest_int((xs[i] + dm) / ds) : 0;
      L[s * sub + i] = static_cast<uint8_t>(std::clamp(q, 0, nmax));
    }
  }
}

void requantize_symmetric(const float* x, const float* w, int sub, int n_sub, int nmax, float d, int lo, int hi,
                          int* sc, int8_t* L) {
  for (int s = 0; s < n_sub; ++s) {
    const float* xs = x + s * sub;
    const float* ws = w + s * sub;
    float best = std::numeric_limits<float>::infinity();
    int best_sc = sc[s];
    for (int c = std::max(lo, sc[s] - 1); c <= std::min(hi, sc[s] + 1); ++c) {
      float ds = d * static_cast<float>(c);
      float err = 0;
      for (int i = 0; i < sub; ++i) {
        int q = ds != 0.f ? std::clamp(nearest_int(xs[i] / ds), -nmax, nmax - 1) : 0;
        float diff = ds * static_cast<float>(q) - xs[i];
        err += ws[i] * diff * diff;
      }
      if (err < best) { best = err; best_sc = c; }
    }
    sc[s] = best_sc;
    float ds = d * static_cast<float>(sc[s]);
    for (int i = 0; i < sub; ++i) {
      int q = ds != 0.f ? nearest_int(xs[i] / ds) : 0;
      L[s * sub + i] = static_cast<int8_t>(std::clamp(q, -nmax, nmax - 1));
    }
  }
}

// Packs 8 six-bit scales and mins into the 12 bytes of Q4_K/Q5_K.
void pack_scale_min_k4(const int* sc, const int* m, uint8_t* b) {
  for (int s = 0; s < 4; ++s) {
    b[s] = static_cast<uint8_t>((sc[s] & 63) | ((sc[s + 4] >> 4) << 6));
    b[s + 4] = static_cast<uint8_t>((m[s] & 63) | ((m[s + 4] >> 4) << 6));
    b[s + 8] = static_cast<uint8_t>((sc[s + 4] & 0xF) | ((m[s + 4] & 0xF) << 4));
  }
}

// Shared by Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins.
void fit_k4(const float* x, int nmax, uint16_t& d, uint16_t& dmin, uint8_t* scales, uint8_t* L) {
  float w[kQKK];
  affine_weights(x, kQKK, w);
  float sub_scale[8], sub_min[8];
  for (int s = 0; s < 8; ++s) fit_affine(32, nmax, x + 32 * s, w + 32 * s, L + 32 * s, sub_scale[s], sub_min[s]);
  int sc[8], m[8];
  quantize_scales_unsigned(sub_scale, 8, 63, sc, d);
  quantize_scales_unsigned(sub_min, 8, 63, m, dmin);
  requantize_affine(x, w, 32, 8, nmax, fp16_to_f32(d), fp16_to_f32(dmin), 63, sc, m, L);
  pack_scale_min_k4(sc, m, scales);
}

}  // namespace

float fit_symmetric(int n, int nmax, const float* x, const float* w, int8_t* L) {
  float amax = 0, max = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); max = x[i]; }
  if (amax < 1e-30f) {
    std::fill(L, L + n, int8_t{0});
    return 0.f;
  }
  int8_t tmp[256];
  float best_score = -1, best_scale = 0;
  auto try_grid = [&](float iscale) {
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
      tmp[i] = static_cast<int8_t>(l);
      sumlx += w[i] * x[i] * static_cast<float>(l);
      suml2 += w[i] * static_cast<float>(l * l);
    }
    // For fixed codes the best scale is sumlx/suml2 and the error drops by sumlx²/suml2.
    if (suml2 > 0 && sumlx * sumlx > best_score * suml2) {
      best_score = sumlx * sumlx / suml2;
      best_scale = sumlx / suml2;
      std::copy(tmp, tmp + n, L);
      return true;
    }
    return false;
  };
  for (int is = -10; is <= 10; ++is) try_grid(-(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max);
  // Re-round against the fitted scale until nothing improves.
  for (int it = 0; it < 4 && best_scale != 0.f; ++it)
    if (!try_grid(1.f / best_scale)) break;
  return best_scale;
}

void fit_affine(int n, int nmax, const float* x, const float* w, uint8_t* L, float& scale, float& min) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) { mn = std::min(mn, x[i]); mx = std::max(mx, x[i]); }
  mn = std::min(mn, 0.f);
  if (mx <= mn) {  // every value is the same non-positive number
    std::fill(L, L + n, uint8_t{0});
    scale = 0;
    min = -mn;
    return;
  }
  uint8_t tmp[256];
  float best_err = std::numeric_limits<float>::infinity();
  float best_scale = 0, best_off = 0;
  auto evaluate = [&](float s, float off) {
    float err = 0;
    for (int i = 0; i < n; ++i) {
      float diff = s * static_cast<float>(tmp[i]) + off - x[i];
      err += w[i] * diff * diff;
    }
    if (err < best_err) {
      best_err = err;
      best_scale = s;
      best_off = off;
      std::copy(tmp, tmp + n, L);
    }
  };
  auto try_grid = [&](float iscale, float off) {
    float sw = 0, sl = 0, sl2 = 0, sx = 0, slx = 0;
    for (int i = 0; i < n; ++i) {
      int l = std::clamp(nearest_int(iscale * (x[i] - off)), 0, nmax);
      tmp[i] = static_cast<uint8_t>(l);
      float fl = static_cast<float>(l);
      sw += w[i]; sl += w[i] * fl; sl2 += w[i] * fl * fl; sx += w[i] * x[i]; slx += w[i] * fl * x[i];
    }
    // Weighted least squares for x ≈ s·L + off; the offset may not be positive.
    float det = sw * sl2 - sl * sl;
    float s = 0, o = 0;
    if (det > 0) {
      s = (sw * slx - sl * sx) / det;
      o = (sl2 * sx - sl * slx) / det;
    }
    if (det <= 0 || o > 0) {
      o = 0;
      s = sl2 > 0 ? slx / sl2 : 0;
    }
    if (s > 0) evaluate(s, o);
  };
  // The plain min/max grid first, then stretched and shrunk grids around it.
  float base = static_cast<float>(nmax) / (mx - mn);
  for (int k = 0; k < n; ++k) tmp[k] = static_cast<uint8_t>(std::clamp(nearest_int(base * (x[k] - mn)), 0, nmax));
  evaluate(1.f / base, mn);
  for (int is = 0; is <= 20; ++is) try_grid((static_cast<float>(nmax) - 1.f + 0.1f * static_cast<float>(is)) / (mx - mn), mn);
  // Refine: re-round against the best fit so far.
  for (int it = 0; it < 3; ++it) try_grid(1.f / best_scale, best_off);
  scale = best_scale;
  min = -best_off;
}

void quant_q2_k(const float* x, BlockQ2_K* b) {
  float w[kQKK];
  affine_weights(x, kQKK, w);
  uint8_t L[kQKK];
  float sub_scale[16], sub_min[16];
  for (int s = 0; s < 16; ++s) fit_affine(16, 3, x + 16 * s, w + 16 * s, L + 16 * s, sub_scale[s], sub_min[s]);
  int sc[16], m[16];
  quantize_scales_unsigned(sub_scale, 16, 15, sc, b->d);
  quantize_scales_unsigned(sub_min, 16, 15, m, b->dmin);
  requantize_affine(x, w, 16, 16, 3, fp16_to_f32(b->d), fp16_to_f32(b->dmin), 15, sc, m, L);
  for (int s = 0; s < 16; ++s) b->scales[s] = static_cast<uint8_t>(sc[s] | (m[s] << 4));
  // Element 128n + 32j + l sits in bits 2j of qs[32n + l].
  std::memset(b->qs, 0, sizeof b->qs);
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) b->qs[32 * n + l] |= static_cast<uint8_t>(L[128 * n + 32 * j + l] << (2 * j));
}

void quant_q3_k(const float* x, BlockQ3_K* b) {
  float w[kQKK];
  symmetric_weights(x, kQKK, w);
  int8_t L[kQKK];
  float sub_scale[16];
  for (int s = 0; s < 16; ++s) sub_scale[s] = fit_symmetric(16, 4, x + 16 * s, w + 16 * s, L + 16 * s);
  int sc[16];
  quantize_scales_signed(sub_scale, 16, -32, 31, sc, b->d);
  requantize_symmetric(x, w, 16, 16, 4, fp16_to_f32(b->d), -32, 31, sc, L);
  std::memset(b->scales, 0, sizeof b->scales);
  for (int i = 0; i < 16; ++i) {
    int v = sc[i] + 32;
    if (i < 8) b->scales[i] |= static_cast<uint8_t>(v & 0xF);
    else b->scales[i - 8] |= static_cast<uint8_t>((v & 0xF) << 4);
    b->scales[8 + i % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (i / 4)));
  }
  // The stored value u = q + 4 in 0..7: two low bits in qs (as Q2_K), the third in hmask.
  std::memset(b->qs, 0, sizeof b->qs);
  std::memset(b->hmask, 0, sizeof b->hmask);
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        int u = L[128 * n + 32 * j + l] + 4;
        b->qs[32 * n + l] |= static_cast<uint8_t>((u & 3) << (2 * j));
        b->hmask[l] |= static_cast<uint8_t>((u >> 2) << (4 * n + j));
      }
}

void quant_q4_k(const float* x, BlockQ4_K* b) {
  uint8_t L[kQKK];
  fit_k4(x, 15, b->d, b->dmin, b->scales, L);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l)
      b->qs[32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
}

void quant_q5_k(const float* x, BlockQ5_K* b) {
  uint8_t L[kQKK];
  fit_k4(x, 31, b->d, b->dmin, b->scales, L);
  std::memset(b->qh, 0, sizeof b->qh);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      int q0 = L[64 * c + l], q1 = L[64 * c + 32 + l];
      b->qs[32 * c + l] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
      b->qh[l] |= static_cast<uint8_t>(((q0 >> 4) << (2 * c)) | ((q1 >> 4) << (2 * c + 1)));
    }
}

void quant_q6_k(const float* x, BlockQ6_K* b) {
  float w[kQKK];
  symmetric_weights(x, kQKK, w);
  int8_t L[kQKK];
  float sub_scale[16];
  for (int s = 0; s < 16; ++s) sub_scale[s] = fit_symmetric(16, 32, x + 16 * s, w + 16 * s, L + 16 * s);
  int sc[16];
  quantize_scales_signed(sub_scale, 16, -128, 127, sc, b->d);
  requantize_symmetric(x, w, 16, 16, 32, fp16_to_f32(b->d), -128, 127, sc, L);
  for (int s = 0; s < 16; ++s) b->scales[s] = static_cast<int8_t>(sc[s]);
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      int q1 = L[128 * n + l] + 32, q2 = L[128 * n + l + 32] + 32;
      int q3 = L[128 * n + l + 64] + 32, q4 = L[128 * n + l + 96] + 32;
      b->ql[64 * n + l] = static_cast<uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
      b->ql[64 * n + l + 32] = static_cast<uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
      b->qh[32 * n + l] = static_cast<uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
    }
}

}  // namespace moe::quant::detail
