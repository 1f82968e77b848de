// AVX2 K-quant fast dots (Q4_K, Q5_K, Q6_K) for one or several activation rows, and the fp32 block
// kernel of exact-mode prefill. Same integers and float order as kernels_scalar.cpp.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <immintrin.h>

#include "../internal.hpp"
#include "simd_avx2.hpp"

namespace moe::quant::detail {
namespace {
using namespace avx2;

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Q4_K/Q5_K: u8 codes · s8 activations in 16-bit pairs (exact: 31·127·2 < 2^15), times the 6-bit
// scale with a 16-bit multiply-add; NA activation rows share the unpacked codes.
template <bool kFive, int NA>
void dot_k4(const void* w, const uint8_t* act, size_t act_stride, int64_t n, float* out, int64_t out_stride) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const size_t bytes = kFive ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  const __m256i m4 = _mm256_set1_epi8(0xF), sixteen = _mm256_set1_epi8(16);
  float sumf[NA] = {};
  for (int64_t b = 0; b < n / kQKK; ++b) {
    const uint8_t* blk = base + b * bytes;
    uint16_t d, dmin;
    std::memcpy(&d, blk, 2);
    std::memcpy(&dmin, blk + 2, 2);
    int sc[8], mn[8];
    for (int s = 0; s < 8; ++s) scale_min_k4(s, blk + 4, sc[s], mn[s]);
    const uint8_t* qs = blk + (kFive ? 48 : 16);
    const __m256i hbits = kFive ? load256(blk + 16) : _mm256_setzero_si256();
    const BlockQ8_K* y[NA];
    __m256i acc[NA];
    for (int a = 0; a < NA; ++a) {
      y[a] = reinterpret_cast<const BlockQ8_K*>(act + a * act_stride) + b;
      acc[a] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 4; ++c) {
      __m256i q = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (kFive) {
        __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c))), b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b0), b0), sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b1), b1), sixteen));
      }
      const __m256i s0 = _mm256_set1_epi16(static_cast<short>(sc[2 * c])), s1 = _mm256_set1_epi16(static_cast<short>(sc[2 * c + 1]));
      for (int a = 0; a < NA; ++a) {
        __m256i p0 = _mm256_maddubs_epi16(lo, load256(y[a]->qs + 64 * c));
        __m256i p1 = _mm256_maddubs_epi16(hi, load256(y[a]->qs + 64 * c + 32));
        acc[a] = _mm256_add_epi32(acc[a], _mm256_madd_epi16(p0, s0));
        acc[a] = _mm256_add_epi32(acc[a], _mm256_madd_epi16(p1, s1));
      }
    }
    // Min term: pairs of bsums times the mins, with a 16-bit multiply-add.
    const __m256i mv = _mm256_setr_epi16(mn[0], mn[0], mn[1], mn[1], mn[2], mn[2], mn[3], mn[3], mn[4], mn[4], mn[5],
                                         mn[5], mn[6], mn[6], mn[7], mn[7]);
    const float fd = h2f(d), fm = h2f(dmin);
    for (int a = 0; a < NA; ++a) {
      int imin = hsum_i32(_mm256_madd_epi16(load256(y[a]->bsums), mv));
      int isum = hsum_i32(acc[a]);
      sumf[a] += fd * y[a]->d * static_cast<float>(isum);
      sumf[a] -= fm * y[a]->d * static_cast<float>(imin);
    }
  }
  for (int a = 0; a < NA; ++a) out[a * out_stride] = sumf[a];
}

// Q6_K: codes 0..63 times activations, minus 32·bsum per group of 16, times the signed scales.
template <int NA>
void dot_q6_k(const void* w, const uint8_t* act, size_t act_stride, int64_t n, float* out, int64_t out_stride) {
  auto* x = static_cast<const BlockQ6_K*>(w);
  const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(0x30);
  float sumf[NA] = {};
  for (int64_t b = 0; b < n / kQKK; ++b) {
    const BlockQ8_K* y[NA];
    __m256i acc[NA];
    for (int a = 0; a < NA; ++a) {
      y[a] = reinterpret_cast<const BlockQ8_K*>(act + a * act_stride) + b;
      acc[a] = _mm256_setzero_si256();
    }
    for (int nn = 0; nn < 2; ++nn) {
      const __m256i L0 = load256(x[b].ql + 64 * nn), L1 = load256(x[b].ql + 64 * nn + 32);
      const __m256i H = load256(x[b].qh + 32 * nn);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m3));
      q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m3));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4), _mm256_and_si256(H, m3));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m3));
      for (int k = 0; k < 4; ++k) {
        // Scales 8nn + 2k (first 16 elements) and 8nn + 2k + 1 (next 16): one per 128-bit lane.
        const int g = 8 * nn + 2 * k;
        const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(x[b].scales[g + 1]), _mm_set1_epi16(x[b].scales[g]));
        for (int a = 0; a < NA; ++a) {
          __m256i p = _mm256_maddubs_epi16(q[k], load256(y[a]->qs + 128 * nn + 32 * k));
          acc[a] = _mm256_add_epi32(acc[a], _mm256_madd_epi16(p, sv));
        }
      }
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].scales)));
    const float fd = h2f(x[b].d);
    for (int a = 0; a < NA; ++a) {
      int ioff = hsum_i32(_mm256_madd_epi16(load256(y[a]->bsums), s16)) * 32;
      int isum = hsum_i32(acc[a]) - ioff;
      sumf[a] += fd * y[a]->d * static_cast<float>(isum);
    }
  }
  for (int a = 0; a < NA; ++a) out[a * out_stride] = sumf[a];
}

template <int NA> struct Q4K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_k4<false, NA>(w, a, s, n, o, os); } };
template <int NA> struct Q5K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_k4<true, NA>(w, a, s, n, o, os); } };
template <int NA> struct Q6K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_q6_k<NA>(w, a, s, n, o, os); } };

template <template <int> class K>
float single(const void* w, const void* a, int64_t n) {
  float r;
  K<1>::run(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}

template <template <int> class K>
void multi(const void* w, const uint8_t* act, size_t stride, int n_act, int64_t n, float* out, int64_t ostride) {
  switch (n_act) {
    case 1: K<1>::run(w, act, stride, n, out, ostride); break;
    case 2: K<2>::run(w, act, stride, n, out, ostride); break;
    case 3: K<3>::run(w, act, stride, n, out, ostride); break;
    default: K<4>::run(w, act, stride, n, out, ostride); break;
  }
}

// fp32 R x T block (16 ymm registers: 4x2 accumulators, two activation vectors and one weight).
template <int R, int T>
void f32_block(const float* const* w, const float* const* x, int64_t n, float* out, int64_t out_stride) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = hsum_ps(acc[r][t]);
      for (int64_t j = i; j < n; ++j) s += w[r][j] * x[t][j];
      out[t * out_stride + r] = s;
    }
}

template <int R>
void f32_rows(const float* const* w, const float* const* x, int nt, int64_t n, float* out, int64_t os) {
  for (int t = 0; t < nt; t += 2) {
    if (nt - t >= 2) f32_block<R, 2>(w, x + t, n, out + t * os, os);
    else f32_block<R, 1>(w, x + t, n, out + t * os, os);
  }
}

void f32_block_any(const float* const* w, int nr, const float* const* x, int nt, int64_t n, float* out, int64_t os) {
  switch (nr) {
    case 1: f32_rows<1>(w, x, nt, n, out, os); break;
    case 2: f32_rows<2>(w, x, nt, n, out, os); break;
    case 3: f32_rows<3>(w, x, nt, n, out, os); break;
    default: f32_rows<4>(w, x, nt, n, out, os); break;
  }
}

}  // namespace

void fill_avx2_prefill_kernels(Kernels& k) {
  auto i = [](Type t) { return static_cast<size_t>(t); };
  k.dot_fast[i(Type::Q4_K)] = single<Q4K>;
  k.dot_fast[i(Type::Q5_K)] = single<Q5K>;
  k.dot_fast[i(Type::Q6_K)] = single<Q6K>;
  k.dot_fast_multi[i(Type::Q4_K)] = multi<Q4K>;
  k.dot_fast_multi[i(Type::Q5_K)] = multi<Q5K>;
  k.dot_fast_multi[i(Type::Q6_K)] = multi<Q6K>;
  k.f32_block = f32_block_any;
}

}  // namespace moe::quant::detail
