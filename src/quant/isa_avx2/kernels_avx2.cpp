// AVX2 kernels (compiled with -mavx2 -mfma -mf16c -mbmi2; installed only when the CPU has them).
// Fast mode: the same integers as the scalar kernels, combined in the same float order (the
// bit-identity test compares them), so no FMA is used where the scalar path multiplies and adds.
// Exact mode: FMA against weights dequantized in registers.
// The fast-mode float steps must round exactly like the scalar kernels: no fused multiply-adds
// unless written as intrinsics.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "../internal.hpp"
#include "simd_avx2.hpp"

namespace moe::quant::detail {
namespace {

using namespace avx2;

// ---- activation quantization ----------------------------------------------------------------
inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 floats -> 32 int8 with round-half-even and saturation, in element order.
inline __m256i round_pack32(const float* x, __m256 mul) {
  const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), mul), r));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8), mul), r));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16), mul), r));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 24), mul), r));
  __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
  __m256i p = _mm256_packs_epi16(p01, p23);
  // The packs interleave 128-bit lanes: restore element order.
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void act_q8_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_0*>(dst);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    __m256 m = _mm256_max_ps(_mm256_max_ps(abs_ps(_mm256_loadu_ps(x)), abs_ps(_mm256_loadu_ps(x + 8))),
                             _mm256_max_ps(abs_ps(_mm256_loadu_ps(x + 16)), abs_ps(_mm256_loadu_ps(x + 24))));
    float amax = hmax_ps(m);
    out[i].d = f32_to_fp16(amax / 127.f);
    float id = amax != 0.f ? 127.f / amax : 0.f;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[i].qs), round_pack32(x, _mm256_set1_ps(id)));
  }
}

void act_q8_1(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_1*>(dst);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    __m256 m = _mm256_max_ps(_mm256_max_ps(abs_ps(_mm256_loadu_ps(x)), abs_ps(_mm256_loadu_ps(x + 8))),
                             _mm256_max_ps(abs_ps(_mm256_loadu_ps(x + 16)), abs_ps(_mm256_loadu_ps(x + 24))));
    float amax = hmax_ps(m);
    float d = amax / 127.f;
    out[i].d = f32_to_fp16(d);
    float id = amax != 0.f ? 127.f / amax : 0.f;
    __m256i q = round_pack32(x, _mm256_set1_ps(id));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[i].qs), q);
    int sum = hsum_i32(dot_i8(q, _mm256_set1_epi8(1)));
    out[i].s = f32_to_fp16(d * static_cast<float>(sum));
  }
}

void act_q8_k(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_K*>(dst);
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    BlockQ8_K& b = out[i];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < kQKK; j += 8) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + j)));
    float amax = hmax_ps(m);
    if (!(amax > 0.f)) {
      std::memset(&b, 0, sizeof b);
      continue;
    }
    // The signed value of the first element with the largest magnitude.
    int first = 0;
    __m256 am = _mm256_set1_ps(amax);
    for (int j = 0; j < kQKK; j += 8) {
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + j)), am, _CMP_EQ_OQ));
      if (mask) { first = j + __builtin_ctz(static_cast<unsigned>(mask)); break; }
    }
    float iscale = -127.f / x[first];
    __m256 mul = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi8(127);
    for (int j = 0; j < kQKK; j += 32) {
      __m256i q = _mm256_min_epi8(round_pack32(x + j, mul), top);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.qs + j), q);
    }
    // Sums of 16 consecutive codes: widen to 16 bits and add neighbours.
    for (int g = 0; g < 16; g += 2) {
      __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * g)));
      __m256i r = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * g + 16)));
      __m256i s = _mm256_madd_epi16(_mm256_hadd_epi16(q, r), _mm256_set1_epi16(1));
      // hadd_epi16 per 128-bit lane: lane0 = q[0..7] pairs, r[0..7] pairs; lane1 = q[8..15], r[8..15].
      int sq = _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 1) + _mm256_extract_epi32(s, 4) +
               _mm256_extract_epi32(s, 5);
      int sr = _mm256_extract_epi32(s, 2) + _mm256_extract_epi32(s, 3) + _mm256_extract_epi32(s, 6) +
               _mm256_extract_epi32(s, 7);
      b.bsums[g] = static_cast<int16_t>(sq);
      b.bsums[g + 1] = static_cast<int16_t>(sr);
    }
    b.d = 1.f / iscale;
  }
}

// ---- fast dot products: legacy blocks, 8 blocks at a time into the 8 canonical lanes ----------
template <typename Block, typename BlockDot>
float dot_legacy8(const Block* x, const BlockQ8_0* y, int64_t nb, BlockDot block_dot) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = block_dot(x[b + k], y[b + k]);
    __m256i isum = reduce8(v);
    __m128i xd = _mm_setr_epi16(x[b].d, x[b + 1].d, x[b + 2].d, x[b + 3].d, x[b + 4].d, x[b + 5].d, x[b + 6].d, x[b + 7].d);
    __m128i yd = _mm_setr_epi16(y[b].d, y[b + 1].d, y[b + 2].d, y[b + 3].d, y[b + 4].d, y[b + 5].d, y[b + 6].d, y[b + 7].d);
    __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(xd), _mm256_cvtph_ps(yd));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; b < nb; ++b)
    lanes[b % 8] += (h2f(x[b].d) * h2f(y[b].d)) * static_cast<float>(hsum_i32(block_dot(x[b], y[b])));
  return fold8(lanes);
}

float dot_q8_0_q8_0(const void* w, const void* a, int64_t n) {
  return dot_legacy8(static_cast<const BlockQ8_0*>(w), static_cast<const BlockQ8_0*>(a), n / kQK,
                     [](const BlockQ8_0& x, const BlockQ8_0& y) {
                       return dot_i8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs)));
                     });
}

float dot_q4_0_q8_0(const void* w, const void* a, int64_t n) {
  return dot_legacy8(static_cast<const BlockQ4_0*>(w), static_cast<const BlockQ8_0*>(a), n / kQK,
                     [](const BlockQ4_0& x, const BlockQ8_0& y) {
                       __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.qs));
                       __m256i qq = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
                       qq = _mm256_sub_epi8(_mm256_and_si256(qq, _mm256_set1_epi8(0xF)), _mm256_set1_epi8(8));
                       return dot_i8(qq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs)));
                     });
}

float dot_q5_0_q8_0(const void* w, const void* a, int64_t n) {
  return dot_legacy8(static_cast<const BlockQ5_0*>(w), static_cast<const BlockQ8_0*>(a), n / kQK,
                     [](const BlockQ5_0& x, const BlockQ8_0& y) {
                       __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.qs));
                       __m256i qq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0xF));
                       uint32_t h;
                       std::memcpy(&h, x.qh, 4);
                       // Spread bit j of h to byte j: byte j selects from the broadcast word the byte
                       // holding bit j, then tests that bit.
                       __m256i hv = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                                        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                           0x0303030303030303LL));
                       __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
                       __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
                       qq = _mm256_or_si256(qq, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
                       qq = _mm256_sub_epi8(qq, _mm256_set1_epi8(16));
                       return dot_i8(qq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs)));
                     });
}

// Q4_1/Q5_1 against Q8_1: codes are unsigned, the min term uses the activation's stored d·Σq.
// Lane b % 8 gets (dw·da)·isum + m·s, as in the scalar kernel.
template <typename Block, typename Codes>
float dot_legacy8_q8_1(const Block* x, const BlockQ8_1* y, int64_t nb, Codes codes) {
  auto block_dot = [&](int64_t b) {
    __m256i p = _mm256_maddubs_epi16(codes(x[b]), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  };
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = block_dot(b + k);
    __m256i isum = reduce8(v);
    __m128i xd = _mm_setr_epi16(x[b].d, x[b + 1].d, x[b + 2].d, x[b + 3].d, x[b + 4].d, x[b + 5].d, x[b + 6].d, x[b + 7].d);
    __m128i yd = _mm_setr_epi16(y[b].d, y[b + 1].d, y[b + 2].d, y[b + 3].d, y[b + 4].d, y[b + 5].d, y[b + 6].d, y[b + 7].d);
    __m128i xm = _mm_setr_epi16(x[b].m, x[b + 1].m, x[b + 2].m, x[b + 3].m, x[b + 4].m, x[b + 5].m, x[b + 6].m, x[b + 7].m);
    __m128i ys = _mm_setr_epi16(y[b].s, y[b + 1].s, y[b + 2].s, y[b + 3].s, y[b + 4].s, y[b + 5].s, y[b + 6].s, y[b + 7].s);
    __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(xd), _mm256_cvtph_ps(yd));
    __m256 ms = _mm256_mul_ps(_mm256_cvtph_ps(xm), _mm256_cvtph_ps(ys));
    acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)), ms));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; b < nb; ++b)
    lanes[b % 8] += (h2f(x[b].d) * h2f(y[b].d)) * static_cast<float>(hsum_i32(block_dot(b))) + h2f(x[b].m) * h2f(y[b].s);
  return fold8(lanes);
}

// Byte j of the result is 16 when bit j of the 32-bit word h is set.
inline __m256i fifth_bits(uint32_t h) {
  __m256i hv = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                   _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit), _mm256_set1_epi8(16));
}

inline __m256i nibbles32(const uint8_t* qs) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0xF));
}

float dot_q4_1_q8_1(const void* w, const void* a, int64_t n) {
  return dot_legacy8_q8_1(static_cast<const BlockQ4_1*>(w), static_cast<const BlockQ8_1*>(a), n / kQK,
                          [](const BlockQ4_1& x) { return nibbles32(x.qs); });
}

float dot_q5_1_q8_1(const void* w, const void* a, int64_t n) {
  return dot_legacy8_q8_1(static_cast<const BlockQ5_1*>(w), static_cast<const BlockQ8_1*>(a), n / kQK,
                          [](const BlockQ5_1& x) {
                            uint32_t h;
                            std::memcpy(&h, x.qh, 4);
                            return _mm256_or_si256(nibbles32(x.qs), fifth_bits(h));
                          });
}

// Q2_K: 2-bit codes, 4-bit scales and mins per 16 elements.
float dot_q2_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ2_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  const __m256i m3 = _mm256_set1_epi8(3);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].scales));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0xF)));
    alignas(16) uint8_t s4[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(s4), _mm_and_si128(sc, _mm_set1_epi8(0xF)));
    __m256i acc = _mm256_setzero_si256();
    for (int nn = 0; nn < 2; ++nn) {
      const __m256i Q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs + 32 * nn));
      for (int j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * j), m3);
        __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs + 128 * nn + 32 * j)));
        int g = 8 * nn + 2 * j;
        __m256i sv = _mm256_set_m128i(_mm_set1_epi16(s4[g + 1]), _mm_set1_epi16(s4[g]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sv));
      }
    }
    int imin = hsum_i32(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].bsums)), mins));
    int isum = hsum_i32(acc);
    sumf += h2f(x[b].d) * y[b].d * static_cast<float>(isum);
    sumf -= h2f(x[b].dmin) * y[b].d * static_cast<float>(imin);
  }
  return sumf;
}

// Q3_K: codes u = low2 + 4·hbit in 0..7 (q = u − 4); the −4 is taken out with the bsums.
float dot_q3_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ3_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    alignas(32) int16_t sc[16];
    for (int i = 0; i < 16; ++i) sc[i] = static_cast<int16_t>(scale_q3k(i, x[b].scales));
    const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].hmask));
    __m256i acc = _mm256_setzero_si256();
    for (int nn = 0; nn < 2; ++nn) {
      const __m256i Q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs + 32 * nn));
      for (int j = 0; j < 4; ++j) {
        __m256i lo = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * j), m3);
        __m256i hb = _mm256_and_si256(_mm256_srli_epi16(H, 4 * nn + j), one);
        __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
        __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs + 128 * nn + 32 * j)));
        int g = 8 * nn + 2 * j;
        __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sv));
      }
    }
    const __m256i s16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc));
    int ioff = 4 * hsum_i32(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].bsums)), s16));
    int isum = hsum_i32(acc) - ioff;
    sumf += h2f(x[b].d) * y[b].d * static_cast<float>(isum);
  }
  return sumf;
}

// ---- exact mode -------------------------------------------------------------------------------
float exact_f32(const void* w, const float* x, int64_t n) {
  auto* wf = static_cast<const float*>(w);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wf + i), _mm256_loadu_ps(x + i), a0);
  float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += wf[i] * x[i];
  return s;
}

float exact_f16(const void* w, const float* x, int64_t n) {
  auto* wh = static_cast<const uint16_t*>(w);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wh + i))), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wh + i + 8))), _mm256_loadu_ps(x + i + 8), a1);
  }
  float s = hsum_ps(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += h2f(wh[i]) * x[i];
  return s;
}

float exact_bf16(const void* w, const float* x, int64_t n) {
  auto* wh = static_cast<const uint16_t*>(w);
  __m256 a0 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wh + i))), 16);
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(v), _mm256_loadu_ps(x + i), a0);
  }
  float s = hsum_ps(a0);
  for (; i < n; ++i) s += bf16_to_f32(wh[i]) * x[i];
  return s;
}

// 8 signed bytes -> 8 floats.
inline __m256 i8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m256 u8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

float exact_q8_0(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ8_0*>(w);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    __m256 d = _mm256_set1_ps(h2f(b[i].d));
    __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs));
    __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs + 16));
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(q0)), _mm256_loadu_ps(x), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(_mm_srli_si128(q0, 8))), _mm256_loadu_ps(x + 8), acc1);
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(q1)), _mm256_loadu_ps(x + 16), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(_mm_srli_si128(q1, 8))), _mm256_loadu_ps(x + 24), acc1);
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

float exact_q4_0(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ4_0*>(w);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(0xF), eight = _mm_set1_epi8(8);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    __m256 d = _mm256_set1_ps(h2f(b[i].d));
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs));
    __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), eight);
    __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), eight);
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(lo)), _mm256_loadu_ps(x), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), acc1);
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(hi)), _mm256_loadu_ps(x + 16), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, i8x8_ps(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), acc1);
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

// 32 unsigned codes (bytes) against 32 floats, y = dl·q − ml.
inline void fma_affine32(__m256i q, __m256 dl, __m256 ml, const float* x, __m256& acc0, __m256& acc1) {
  __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  acc0 = _mm256_fmadd_ps(_mm256_fmsub_ps(dl, u8x8_ps(lo), ml), _mm256_loadu_ps(x), acc0);
  acc1 = _mm256_fmadd_ps(_mm256_fmsub_ps(dl, u8x8_ps(_mm_srli_si128(lo, 8)), ml), _mm256_loadu_ps(x + 8), acc1);
  acc0 = _mm256_fmadd_ps(_mm256_fmsub_ps(dl, u8x8_ps(hi), ml), _mm256_loadu_ps(x + 16), acc0);
  acc1 = _mm256_fmadd_ps(_mm256_fmsub_ps(dl, u8x8_ps(_mm_srli_si128(hi, 8)), ml), _mm256_loadu_ps(x + 24), acc1);
}

float exact_q4_k(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ4_K*>(w);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, b[i].scales, sc0, m0);
      scale_min_k4(2 * c + 1, b[i].scales, sc1, m1);
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].qs + 32 * c));
      fma_affine32(_mm256_and_si256(q, m4), _mm256_set1_ps(d * static_cast<float>(sc0)),
                   _mm256_set1_ps(dmin * static_cast<float>(m0)), x + 64 * c, acc0, acc1);
      fma_affine32(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), _mm256_set1_ps(d * static_cast<float>(sc1)),
                   _mm256_set1_ps(dmin * static_cast<float>(m1)), x + 64 * c + 32, acc0, acc1);
    }
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

float exact_q5_k(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ5_K*>(w);
  const __m256i m4 = _mm256_set1_epi8(0xF), sixteen = _mm256_set1_epi8(16);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].qh));
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, b[i].scales, sc0, m0);
      scale_min_k4(2 * c + 1, b[i].scales, sc1, m1);
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].qs + 32 * c));
      __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c))), b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
      __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b0), b0), sixteen));
      __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                   _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b1), b1), sixteen));
      fma_affine32(lo, _mm256_set1_ps(d * static_cast<float>(sc0)), _mm256_set1_ps(dmin * static_cast<float>(m0)),
                   x + 64 * c, acc0, acc1);
      fma_affine32(hi, _mm256_set1_ps(d * static_cast<float>(sc1)), _mm256_set1_ps(dmin * static_cast<float>(m1)),
                   x + 64 * c + 32, acc0, acc1);
    }
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

float exact_q6_k(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ6_K*>(w);
  const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    float d = h2f(b[i].d);
    for (int nn = 0; nn < 2; ++nn) {
      const __m256i L0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].ql + 64 * nn));
      const __m256i L1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].ql + 64 * nn + 32));
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i].qh + 32 * nn));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m3));
      q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m3));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4), _mm256_and_si256(H, m3));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m3));
      for (int k = 0; k < 4; ++k) {
        __m256i s = _mm256_sub_epi8(q[k], off);
        const float* xk = x + 128 * nn + 32 * k;
        int g = 8 * nn + 2 * k;
        __m256 d0 = _mm256_set1_ps(d * static_cast<float>(b[i].scales[g]));
        __m256 d1 = _mm256_set1_ps(d * static_cast<float>(b[i].scales[g + 1]));
        __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d0, i8x8_ps(lo)), _mm256_loadu_ps(xk), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d0, i8x8_ps(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xk + 8), acc1);
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d1, i8x8_ps(hi)), _mm256_loadu_ps(xk + 16), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d1, i8x8_ps(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xk + 24), acc1);
      }
    }
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

// F16/BF16 weights with F16/BF16 activations: one accumulator, so lane k sums elements k, k+8, ...
// in order, then the same fold as the scalar kernel.
template <bool kBf16>
float dot_h16(const void* w, const void* a, int64_t n) {
  auto* wh = static_cast<const uint16_t*>(w);
  auto* ah = static_cast<const uint16_t*>(a);
  auto load8 = [](const uint16_t* p) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    else return _mm256_cvtph_ps(v);
  };
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(load8(wh + i), load8(ah + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; i < n; ++i) {
    float wv = kBf16 ? bf16_to_f32(wh[i]) : h2f(wh[i]);
    float av = kBf16 ? bf16_to_f32(ah[i]) : h2f(ah[i]);
    lanes[i % 8] += wv * av;
  }
  return fold8(lanes);
}

void act_f16(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = f32_to_fp16(x[i]);
}

float fast_f32(const void* w, const void* x, int64_t n) { return exact_f32(w, static_cast<const float*>(x), n); }

}  // namespace

void fill_avx2_prefill_kernels(Kernels& k);
void fill_avx2_exact_kernels(Kernels& k);

void fill_avx2_kernels(Kernels& k) {
  auto i = [](Type t) { return static_cast<size_t>(t); };
  k.name = "avx2";
  k.quantize_act[i(Type::Q8_0)] = act_q8_0;
  k.quantize_act[i(Type::Q8_1)] = act_q8_1;
  k.quantize_act[i(Type::Q8_K)] = act_q8_k;
  k.dot_fast[i(Type::Q4_0)] = dot_q4_0_q8_0;
  k.dot_fast[i(Type::Q5_0)] = dot_q5_0_q8_0;
  k.dot_fast[i(Type::Q8_0)] = dot_q8_0_q8_0;
  k.dot_fast[i(Type::Q4_1)] = dot_q4_1_q8_1;
  k.dot_fast[i(Type::Q5_1)] = dot_q5_1_q8_1;
  k.dot_fast[i(Type::Q2_K)] = dot_q2_k_q8_k;
  k.dot_fast[i(Type::Q3_K)] = dot_q3_k_q8_k;
  fill_avx2_prefill_kernels(k);  // K-quant dots (single and multi-row), fp32 blocks
  fill_avx2_exact_kernels(k);    // exact fallbacks and row dequantizers
  k.dot_fast[i(Type::F32)] = fast_f32;  // F32 weights pair with F32 activations
  k.dot_fast[i(Type::F16)] = dot_h16<false>;
  k.dot_fast[i(Type::BF16)] = dot_h16<true>;
  k.quantize_act[i(Type::F16)] = act_f16;
  k.dot_exact[i(Type::F32)] = exact_f32;
  k.dot_exact[i(Type::F16)] = exact_f16;
  k.dot_exact[i(Type::BF16)] = exact_bf16;
  k.dot_exact[i(Type::Q4_0)] = exact_q4_0;
  k.dot_exact[i(Type::Q8_0)] = exact_q8_0;
  k.dot_exact[i(Type::Q4_K)] = exact_q4_k;
  k.dot_exact[i(Type::Q5_K)] = exact_q5_k;
  k.dot_exact[i(Type::Q6_K)] = exact_q6_k;
}

}  // namespace moe::quant::detail
