// AVX-512 kernels with VNNI (compiled with the AVX-512 flags; installed only when the CPU has
// AVX-512 F/BW/VL/DQ and VNNI). Fast mode keeps the scalar kernels' integers and float order (see
// kernels_scalar.cpp); exact mode uses FMA on weights dequantized in registers.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 headers self-initialise "undefined" vectors, which warns once the optimize
// pragma is active.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstring>

#include "../internal.hpp"

namespace moe::quant::detail {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline int hsum_i32(__m512i v) {
  return hsum_i32(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}

inline __m256i reduce8(const __m256i* v) {
  __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
  __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
  __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The six-bit scales and mins of a Q4_K/Q5_K super-block, unpacked four at a time with 32-bit ops:
// sc[0..3] = b[0..3] & 63, m[0..3] = b[4..7] & 63, sc[4..7] = low nibbles of b[8..11] with the top
// bits of b[0..3], m[4..7] = high nibbles of b[8..11] with the top bits of b[4..7].
inline void unpack_k4(const uint8_t* b, uint64_t& sc8, uint64_t& m8) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, b, 4);
  std::memcpy(&u1, b + 4, 4);
  std::memcpy(&u2, b + 8, 4);
  uint32_t s_lo = u0 & 0x3F3F3F3Fu, m_lo = u1 & 0x3F3F3F3Fu;
  uint32_t s_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
  uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
  sc8 = s_lo | (static_cast<uint64_t>(s_hi) << 32);
  m8 = m_lo | (static_cast<uint64_t>(m_hi) << 32);
}

// The same unpacking in vector registers (a GPR round trip per super-block costs ~30% of the Q4_K
// dot): bytes 0..7 of the result are the scales, bytes 8..15 the mins. Reads 16 bytes at `b`
// (the 12 scale bytes and the first 4 code bytes, inside the block).
inline __m128i unpack_k4_vec(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo6 = _mm_and_si128(v, _mm_set1_epi8(0x3F));                          // s_lo, m_lo
  const __m128i top = _mm_and_si128(_mm_srli_epi32(v, 2), _mm_set1_epi8(0x30));        // top bits of u0, u1
  const __m128i u2 = _mm_shuffle_epi32(v, 0xAA);                                        // u2 everywhere
  const __m128i nib = _mm_and_si128(_mm_srlv_epi32(u2, _mm_setr_epi32(0, 4, 0, 0)), _mm_set1_epi8(0x0F));
  return _mm_unpacklo_epi32(lo6, _mm_or_si128(nib, top));  // [s_lo, s_hi, m_lo, m_hi]
}

inline __m512i pairs16v(__m128i bytes8) {
  __m512i v = _mm512_cvtepu8_epi32(bytes8);
  return _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
}

// 8 byte values -> 16 int32 lanes holding (v, v) as two int16, for a 16-bit multiply-add against
// pairs; lanes 0..7 repeat nothing (callers permute what they need).
inline __m512i pairs16(uint64_t bytes8) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes8)));
  return _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
}

// ---- activation quantization: Q8_K ------------------------------------------------------------
void act_q8_k(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_K*>(dst);
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    BlockQ8_K& b = out[i];
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < kQKK; j += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + j)));
    float amax = _mm512_reduce_max_ps(m);
    if (!(amax > 0.f)) {
      std::memset(&b, 0, sizeof b);
      continue;
    }
    int first = 0;
    __m512 am = _mm512_set1_ps(amax);
    for (int j = 0; j < kQKK; j += 16) {
      __mmask16 k = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, _mm512_loadu_ps(x + j)), am, _CMP_EQ_OQ);
      if (k) { first = j + __builtin_ctz(static_cast<unsigned>(k)); break; }
    }
    float iscale = -127.f / x[first];
    __m512 mul = _mm512_set1_ps(iscale);
    const __m512i top = _mm512_set1_epi32(127);
    for (int j = 0; j < kQKK; j += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(v), top);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.qs + j), _mm512_cvtsepi32_epi8(q));
      b.bsums[j / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
    b.d = 1.f / iscale;
  }
}

// ---- fast dot products ----------------------------------------------------------------------------
// Signed x (may be -128) times signed y (never -128: activations are within ±127), per 4 bytes.
inline __m512i dot_i8(__m512i x, __m512i y) {
  __mmask64 neg = _mm512_movepi8_mask(x);
  __m512i sy = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(x), sy);
}

// Legacy blocks, 8 at a time into the 8 canonical lanes (see fold8). NA activation rows share the
// unpacked codes; each output follows the single-row order exactly.
template <int NA, typename Block, typename Codes>
void dot_legacy8(const Block* x, const uint8_t* act, size_t act_stride, int64_t nb, Codes codes, float* out,
                 int64_t out_stride) {
  const BlockQ8_0* y[NA];
  __m256 acc[NA];
  for (int a = 0; a < NA; ++a) {
    y[a] = reinterpret_cast<const BlockQ8_0*>(act + a * act_stride);
    acc[a] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m512i ax[4];
    __mmask64 neg[4];
    for (int k = 0; k < 4; ++k) {
      __m512i c = join(codes(x[b + 2 * k]), codes(x[b + 2 * k + 1]));
      ax[k] = _mm512_abs_epi8(c);
      neg[k] = _mm512_movepi8_mask(c);
    }
    __m128i xd = _mm_setr_epi16(x[b].d, x[b + 1].d, x[b + 2].d, x[b + 3].d, x[b + 4].d, x[b + 5].d, x[b + 6].d, x[b + 7].d);
    const __m256 xdf = _mm256_cvtph_ps(xd);
    for (int a = 0; a < NA; ++a) {
      const BlockQ8_0* ya = y[a] + b;
      __m256i v[8];
      for (int k = 0; k < 4; ++k) {
        __m512i yy = join(load256(ya[2 * k].qs), load256(ya[2 * k + 1].qs));
        // y negated where x is negative, so |x|·(±y) = x·y (activations are never -128).
        __m512i sy = _mm512_mask_sub_epi8(yy, neg[k], _mm512_setzero_si512(), yy);
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax[k], sy);
        v[2 * k] = _mm512_castsi512_si256(p);
        v[2 * k + 1] = _mm512_extracti64x4_epi64(p, 1);
      }
      __m256i isum = reduce8(v);
      __m128i yd = _mm_setr_epi16(ya[0].d, ya[1].d, ya[2].d, ya[3].d, ya[4].d, ya[5].d, ya[6].d, ya[7].d);
      __m256 dd = _mm256_mul_ps(xdf, _mm256_cvtph_ps(yd));
      acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
    }
  }
  for (int a = 0; a < NA; ++a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[a]);
    for (int64_t bb = b; bb < nb; ++bb) {
      __m512i p = dot_i8(_mm512_castsi256_si512(codes(x[bb])), _mm512_castsi256_si512(load256(y[a][bb].qs)));
      int s = hsum_i32(_mm512_castsi512_si256(p));
      lanes[bb % 8] += (h2f(x[bb].d) * h2f(y[a][bb].d)) * static_cast<float>(s);
    }
    out[a * out_stride] = fold8(lanes);
  }
}

struct Q8Codes {
  __m256i operator()(const BlockQ8_0& x) const { return load256(x.qs); }
};
struct Q4Codes {
  __m256i operator()(const BlockQ4_0& x) const {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.qs));
    __m256i qq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0xF));
    return _mm256_sub_epi8(qq, _mm256_set1_epi8(8));
  }
};

template <int NA> struct Q80 {
  static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) {
    dot_legacy8<NA>(static_cast<const BlockQ8_0*>(w), a, s, n / kQK, Q8Codes{}, o, os);
  }
};
template <int NA> struct Q40 {
  static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) {
    dot_legacy8<NA>(static_cast<const BlockQ4_0*>(w), a, s, n / kQK, Q4Codes{}, o, os);
  }
};

float dot_q8_0_q8_0(const void* w, const void* a, int64_t n) {
  float r;
  Q80<1>::run(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}
float dot_q4_0_q8_0(const void* w, const void* a, int64_t n) {
  float r;
  Q40<1>::run(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}

// K-quants: a per-super-block kernel leaves, for each activation row, 8 int32 lanes summing to the
// scaled-product integer (vs) and 8 summing to the min-term integer (vm). The driver collects eight
// super-blocks and totals their lanes with one transposing reduction (reduce8) instead of eight
// horizontal sums; the float steps then run in super-block order exactly as in the scalar kernel
// (sumf += (d_w·d_a)·isum; sumf -= (dmin_w·d_a)·imin), which src/cpu's prefill kernel also follows.
struct KOut {
  __m256i vs, vm;
};

inline __m256i fold256(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// Q4_K/Q5_K: per 64-element chunk one zmm of codes (low nibbles = sub-block 2c, high = 2c+1),
// u8·s8 pairs to int16 (exact: 31·127·2 < 2^15), then a 16-bit multiply-add with the scales.
template <bool kFive, int NA>
struct K4Block {
  static constexpr size_t kBytes = kFive ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  static constexpr bool kHasMin = true;
  static void run(const uint8_t* blk, const BlockQ8_K* const* y, KOut* out, uint16_t& d, uint16_t& dmin) {
    std::memcpy(&d, blk, 2);
    std::memcpy(&dmin, blk + 2, 2);
    const __m128i scm = unpack_k4_vec(blk + 4);
    const uint8_t* qs = blk + (kFive ? 48 : 16);
    // The eight scales as int16 in every 128-bit lane; a byte shuffle per chunk then spreads
    // sc_2c over the first half of the zmm and sc_2c+1 over the second (in-lane, one cycle).
    const __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(scm));
    __m512i acc[NA];
    for (int a = 0; a < NA; ++a) acc[a] = _mm512_setzero_si512();
    const __m256i hbits = kFive ? load256(blk + 16) : _mm256_setzero_si256();
    const __m512i m4z = _mm512_set1_epi8(0xF);
    for (int h = 0; h < 2; ++h) {
      // 64 code bytes = chunks 2h and 2h+1; each chunk's zmm of codes is [low nibbles | high nibbles]
      // of its 32 bytes, gathered with one two-source qword permute.
      const __m512i q = _mm512_loadu_si512(qs + 64 * h);
      const __m512i lo = _mm512_and_si512(q, m4z), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4z);
      __m512i codes[2] = {_mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), hi),
                          _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15), hi)};
      for (int k = 0; k < 2; ++k) {
        const int c = 2 * h + k;
        if constexpr (kFive) {
          // Bit 2c of qh[l] is the fifth bit of the low-nibble element, bit 2c+1 of the high one.
          __m256i b0 = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c), 4), _mm256_set1_epi8(16));
          __m256i b1 = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c + 1), 4), _mm256_set1_epi8(16));
          codes[k] = _mm512_or_si512(codes[k], join(b0, b1));
        }
        const int16_t e0 = static_cast<int16_t>((4 * c) | ((4 * c + 1) << 8));
        const int16_t e1 = static_cast<int16_t>((4 * c + 2) | ((4 * c + 3) << 8));
        const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi16(e0), _mm256_set1_epi16(e1), 1);
        const __m512i sv = _mm512_shuffle_epi8(sc16, sel);
        for (int a = 0; a < NA; ++a)
          acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(codes[k], _mm512_loadu_si512(y[a]->qs + 64 * c)), sv);
      }
    }
    // Σ_s m_s·(bsum_2s + bsum_2s+1): one 16-bit multiply-add of the bsums against (m_s, m_s) pairs.
    const __m256i mp = _mm512_castsi512_si256(pairs16v(_mm_srli_si128(scm, 8)));
    for (int a = 0; a < NA; ++a) {
      out[a].vs = fold256(acc[a]);
      out[a].vm = _mm256_madd_epi16(load256(y[a]->bsums), mp);
    }
  }
};

// Q6_K: 64 codes (0..63) per zmm; each 128-bit lane is one group of 16 with its own scale; the −32
// offset of every code comes out through the bsums.
template <int NA>
struct Q6Block {
  static constexpr size_t kBytes = sizeof(BlockQ6_K);
  static constexpr bool kHasMin = false;
  static void run(const uint8_t* blk, const BlockQ8_K* const* y, KOut* out, uint16_t& d, uint16_t& dmin) {
    const auto* x = reinterpret_cast<const BlockQ6_K*>(blk);
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x30);
    d = x->d;
    dmin = 0;
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x->scales));
    const __m512i s32 = _mm512_cvtepi8_epi32(s8);
    const __m512i sp = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
    __m512i acc[NA];
    for (int a = 0; a < NA; ++a) acc[a] = _mm512_setzero_si512();
    for (int nn = 0; nn < 2; ++nn) {
      const __m512i L = _mm512_loadu_si512(x->ql + 64 * nn);
      const __m256i H = load256(x->qh + 32 * nn);
      // Elements 0..63 of the half: low nibbles, high bits (H>>0)&3 then (H>>2)&3.
      const __m512i A = _mm512_or_si512(_mm512_and_si512(L, m4),
                                        _mm512_and_si512(join(_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2)), m3));
      // Elements 64..127: high nibbles, high bits (H>>4)&3 then (H>>6)&3.
      const __m512i B = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                        _mm512_and_si512(join(H, _mm256_srli_epi16(H, 2)), m3));
      const int g = 8 * nn;
      const __m512i ia = _mm512_set_epi32(g + 3, g + 3, g + 3, g + 3, g + 2, g + 2, g + 2, g + 2, g + 1, g + 1, g + 1, g + 1, g, g, g, g);
      const __m512i sa = _mm512_permutexvar_epi32(ia, sp);
      const __m512i sb = _mm512_permutexvar_epi32(_mm512_add_epi32(ia, _mm512_set1_epi32(4)), sp);
      for (int a = 0; a < NA; ++a) {
        acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(A, _mm512_loadu_si512(y[a]->qs + 128 * nn)), sa);
        acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(B, _mm512_loadu_si512(y[a]->qs + 128 * nn + 64)), sb);
      }
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(s8);
    for (int a = 0; a < NA; ++a) {
      // Σ_g S_g·32·bsum_g taken off lane by lane (the lanes' total is what matters).
      __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(load256(y[a]->bsums), s16), 5);
      out[a].vs = _mm256_sub_epi32(fold256(acc[a]), off);
      out[a].vm = _mm256_setzero_si256();
    }
  }
};

template <typename Block, int NA>
void drive_k(const void* w, const uint8_t* act, size_t act_stride, int64_t n, float* out, int64_t out_stride) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const int64_t nb = n / kQKK;
  const BlockQ8_K* y0[NA];
  for (int a = 0; a < NA; ++a) y0[a] = reinterpret_cast<const BlockQ8_K*>(act + a * act_stride);
  float sumf[NA] = {};
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    KOut o[8][NA];
    alignas(16) uint16_t dw[8], dm[8];
    for (int k = 0; k < 8; ++k) {
      const BlockQ8_K* y[NA];
      for (int a = 0; a < NA; ++a) y[a] = y0[a] + b + k;
      Block::run(base + (b + k) * Block::kBytes, y, o[k], dw[k], dm[k]);
    }
    alignas(32) float fdw[8], fdm[8];
    _mm256_store_ps(fdw, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dw))));
    _mm256_store_ps(fdm, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dm))));
    for (int a = 0; a < NA; ++a) {
      const BlockQ8_K* y = y0[a] + b;
      __m256i v[8];
      alignas(32) int32_t is[8], im[8];
      for (int k = 0; k < 8; ++k) v[k] = o[k][a].vs;
      _mm256_store_si256(reinterpret_cast<__m256i*>(is), reduce8(v));
      if constexpr (Block::kHasMin) {
        for (int k = 0; k < 8; ++k) v[k] = o[k][a].vm;
        _mm256_store_si256(reinterpret_cast<__m256i*>(im), reduce8(v));
      }
      for (int k = 0; k < 8; ++k) {
        sumf[a] += fdw[k] * y[k].d * static_cast<float>(is[k]);
        if constexpr (Block::kHasMin) sumf[a] -= fdm[k] * y[k].d * static_cast<float>(im[k]);
      }
    }
  }
  for (; b < nb; ++b) {
    KOut o[NA];
    uint16_t dw, dm;
    const BlockQ8_K* y[NA];
    for (int a = 0; a < NA; ++a) y[a] = y0[a] + b;
    Block::run(base + b * Block::kBytes, y, o, dw, dm);
    for (int a = 0; a < NA; ++a) {
      sumf[a] += h2f(dw) * y[a]->d * static_cast<float>(hsum_i32(o[a].vs));
      if constexpr (Block::kHasMin) sumf[a] -= h2f(dm) * y[a]->d * static_cast<float>(hsum_i32(o[a].vm));
    }
  }
  for (int a = 0; a < NA; ++a) out[a * out_stride] = sumf[a];
}

template <bool kFive, int NA>
void dot_k4(const void* w, const uint8_t* act, size_t act_stride, int64_t n, float* out, int64_t out_stride) {
  drive_k<K4Block<kFive, NA>, NA>(w, act, act_stride, n, out, out_stride);
}
template <int NA>
void dot_q6_k(const void* w, const uint8_t* act, size_t act_stride, int64_t n, float* out, int64_t out_stride) {
  drive_k<Q6Block<NA>, NA>(w, act, act_stride, n, out, out_stride);
}

float dot_q4_k_q8_k(const void* w, const void* a, int64_t n) {
  float r;
  dot_k4<false, 1>(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}
float dot_q5_k_q8_k(const void* w, const void* a, int64_t n) {
  float r;
  dot_k4<true, 1>(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}
float dot_q6_k_q8_k(const void* w, const void* a, int64_t n) {
  float r;
  dot_q6_k<1>(w, static_cast<const uint8_t*>(a), 0, n, &r, 0);
  return r;
}

// Up to four activation rows against one weight row.
template <template <int> class K>
void multi(const void* w, const uint8_t* act, size_t stride, int n_act, int64_t n, float* out, int64_t ostride) {
  switch (n_act) {
    case 1: K<1>::run(w, act, stride, n, out, ostride); break;
    case 2: K<2>::run(w, act, stride, n, out, ostride); break;
    case 3: K<3>::run(w, act, stride, n, out, ostride); break;
    default: K<4>::run(w, act, stride, n, out, ostride); break;
  }
}
template <int NA> struct Q4K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_k4<false, NA>(w, a, s, n, o, os); } };
template <int NA> struct Q5K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_k4<true, NA>(w, a, s, n, o, os); } };
template <int NA> struct Q6K { static void run(const void* w, const uint8_t* a, size_t s, int64_t n, float* o, int64_t os) { dot_q6_k<NA>(w, a, s, n, o, os); } };

// ---- exact mode ---------------------------------------------------------------------------------
inline float hsum_ps(__m512 v) { return _mm512_reduce_add_ps(v); }
inline __m512 u8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
inline __m512 i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

float exact_f32(const void* w, const float* x, int64_t n) {
  auto* wf = static_cast<const float*>(w);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wf + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wf + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(wf + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(wf + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wf + i), _mm512_loadu_ps(x + i), a0);
  if (i < n) {
    __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wf + i), _mm512_maskz_loadu_ps(k, x + i), a1);
  }
  return hsum_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
float fast_f32(const void* w, const void* x, int64_t n) { return exact_f32(w, static_cast<const float*>(x), n); }

float exact_q8_0(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ8_0*>(w);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    __m512 d = _mm512_set1_ps(h2f(b[i].d));
    acc0 = _mm512_fmadd_ps(_mm512_mul_ps(d, i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs)))),
                           _mm512_loadu_ps(x), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_mul_ps(d, i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs + 16)))),
                           _mm512_loadu_ps(x + 16), acc1);
  }
  return hsum_ps(_mm512_add_ps(acc0, acc1));
}

// 32 unsigned codes against 32 floats: y = dl·q − ml.
// The 16 (Q4_K) or 32 (Q5_K) possible weights of a sub-block, dl·q − ml, are computed once into
// registers and the codes index them (vpermps / vpermt2ps) instead of being converted one by one.
template <bool kFive>
inline void lut_affine32(__m256i q, __m512 t0, __m512 t1, const float* x, __m512& acc0, __m512& acc1) {
  const __m512i i0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q));
  const __m512i i1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1));
  __m512 w0, w1;
  if constexpr (kFive) {
    w0 = _mm512_permutex2var_ps(t0, i0, t1);
    w1 = _mm512_permutex2var_ps(t0, i1, t1);
  } else {
    w0 = _mm512_permutexvar_ps(i0, t0);
    w1 = _mm512_permutexvar_ps(i1, t0);
  }
  acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc0);
  acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc1);
}

template <bool kFive>
float exact_k4(const void* w, const float* x, int64_t n) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const size_t bytes = kFive ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m512 iota0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota1 = _mm512_add_ps(iota0, _mm512_set1_ps(16.f));
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    const uint8_t* blk = base + b * bytes;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    uint64_t sc8, m8;
    unpack_k4(blk + 4, sc8, m8);
    // Per-sub-block d·sc and dmin·m for all eight sub-blocks at once.
    alignas(32) float dl[8], ml[8];
    _mm256_store_ps(dl, _mm256_mul_ps(_mm256_set1_ps(h2f(dh)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc8))))));
    _mm256_store_ps(ml, _mm256_mul_ps(_mm256_set1_ps(h2f(mh)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m8))))));
    const uint8_t* qs = blk + (kFive ? 48 : 16);
    __m256i hbits = kFive ? load256(blk + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i q = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (kFive) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c), 4), _mm256_set1_epi8(16)));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c + 1), 4), _mm256_set1_epi8(16)));
      }
      const __m512 d0 = _mm512_set1_ps(dl[2 * c]), m0 = _mm512_set1_ps(ml[2 * c]);
      const __m512 d1 = _mm512_set1_ps(dl[2 * c + 1]), m1 = _mm512_set1_ps(ml[2 * c + 1]);
      const __m512 t00 = _mm512_fmsub_ps(d0, iota0, m0), t10 = _mm512_fmsub_ps(d1, iota0, m1);
      const __m512 t01 = kFive ? _mm512_fmsub_ps(d0, iota1, m0) : t00;
      const __m512 t11 = kFive ? _mm512_fmsub_ps(d1, iota1, m1) : t10;
      lut_affine32<kFive>(lo, t00, t01, x + 64 * c, acc0, acc1);
      lut_affine32<kFive>(hi, t10, t11, x + 64 * c + 32, acc0, acc1);
    }
  }
  return hsum_ps(_mm512_add_ps(acc0, acc1));
}

float exact_q4_k(const void* w, const float* x, int64_t n) { return exact_k4<false>(w, x, n); }
float exact_q5_k(const void* w, const float* x, int64_t n) { return exact_k4<true>(w, x, n); }

float exact_q6_k(const void* w, const float* x, int64_t n) {
  auto* b = static_cast<const BlockQ6_K*>(w);
  const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    alignas(64) float ds[16];
    _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(h2f(b[i].d)),
                                      i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].scales)))));
    for (int nn = 0; nn < 2; ++nn) {
      const __m512i L = _mm512_loadu_si512(b[i].ql + 64 * nn);
      const __m256i H = load256(b[i].qh + 32 * nn);
      __m512i A = _mm512_or_si512(_mm512_and_si512(L, m4),
                                  _mm512_and_si512(join(_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2)), m3));
      __m512i B = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                  _mm512_and_si512(join(H, _mm256_srli_epi16(H, 2)), m3));
      A = _mm512_sub_epi8(A, off);
      B = _mm512_sub_epi8(B, off);
      const float* xa = x + 128 * nn;
      const float* dsn = ds + 8 * nn;
      // Each 16 codes (one 128-bit lane) form one scale group.
      acc0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[0]), i8x16_ps(_mm512_extracti32x4_epi32(A, 0))), _mm512_loadu_ps(xa), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[1]), i8x16_ps(_mm512_extracti32x4_epi32(A, 1))), _mm512_loadu_ps(xa + 16), acc1);
      acc0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[2]), i8x16_ps(_mm512_extracti32x4_epi32(A, 2))), _mm512_loadu_ps(xa + 32), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[3]), i8x16_ps(_mm512_extracti32x4_epi32(A, 3))), _mm512_loadu_ps(xa + 48), acc1);
      acc0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[4]), i8x16_ps(_mm512_extracti32x4_epi32(B, 0))), _mm512_loadu_ps(xa + 64), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[5]), i8x16_ps(_mm512_extracti32x4_epi32(B, 1))), _mm512_loadu_ps(xa + 80), acc1);
      acc0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[6]), i8x16_ps(_mm512_extracti32x4_epi32(B, 2))), _mm512_loadu_ps(xa + 96), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dsn[7]), i8x16_ps(_mm512_extracti32x4_epi32(B, 3))), _mm512_loadu_ps(xa + 112), acc1);
    }
  }
  return hsum_ps(_mm512_add_ps(acc0, acc1));
}

// ---- row dequantization (exact-mode prefill: one weight row serves every token) -----------------
void deq_row_q8_0(const void* w, float* y, int64_t n) {
  auto* b = static_cast<const BlockQ8_0*>(w);
  for (int64_t i = 0; i < n / kQK; ++i, y += kQK) {
    __m512 d = _mm512_set1_ps(h2f(b[i].d));
    _mm512_storeu_ps(y, _mm512_mul_ps(d, i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs)))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs + 16)))));
  }
}

template <bool kFive>
void deq_row_k4(const void* w, float* y, int64_t n) {
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const size_t bytes = kFive ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < n / kQKK; ++b, y += kQKK) {
    const uint8_t* blk = base + b * bytes;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    uint64_t sc8, m8;
    unpack_k4(blk + 4, sc8, m8);
    alignas(32) float dl[8], ml[8];
    _mm256_store_ps(dl, _mm256_mul_ps(_mm256_set1_ps(h2f(dh)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc8))))));
    _mm256_store_ps(ml, _mm256_mul_ps(_mm256_set1_ps(h2f(mh)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m8))))));
    const uint8_t* qs = blk + (kFive ? 48 : 16);
    __m256i hbits = kFive ? load256(blk + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i q = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (kFive) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c), 4), _mm256_set1_epi8(16)));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * c + 1), 4), _mm256_set1_epi8(16)));
      }
      const __m512 d0 = _mm512_set1_ps(dl[2 * c]), m0 = _mm512_set1_ps(ml[2 * c]);
      const __m512 d1 = _mm512_set1_ps(dl[2 * c + 1]), m1 = _mm512_set1_ps(ml[2 * c + 1]);
      float* o = y + 64 * c;
      _mm512_storeu_ps(o, _mm512_fmsub_ps(d0, u8x16_ps(_mm256_castsi256_si128(lo)), m0));
      _mm512_storeu_ps(o + 16, _mm512_fmsub_ps(d0, u8x16_ps(_mm256_extracti128_si256(lo, 1)), m0));
      _mm512_storeu_ps(o + 32, _mm512_fmsub_ps(d1, u8x16_ps(_mm256_castsi256_si128(hi)), m1));
      _mm512_storeu_ps(o + 48, _mm512_fmsub_ps(d1, u8x16_ps(_mm256_extracti128_si256(hi, 1)), m1));
    }
  }
}

void deq_row_q6_k(const void* w, float* y, int64_t n) {
  auto* b = static_cast<const BlockQ6_K*>(w);
  const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  for (int64_t i = 0; i < n / kQKK; ++i, y += kQKK) {
    alignas(64) float ds[16];
    _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(h2f(b[i].d)),
                                      i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].scales)))));
    for (int nn = 0; nn < 2; ++nn) {
      const __m512i L = _mm512_loadu_si512(b[i].ql + 64 * nn);
      const __m256i H = load256(b[i].qh + 32 * nn);
      __m512i A = _mm512_or_si512(_mm512_and_si512(L, m4),
                                  _mm512_and_si512(join(_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2)), m3));
      __m512i B = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                  _mm512_and_si512(join(H, _mm256_srli_epi16(H, 2)), m3));
      A = _mm512_sub_epi8(A, off);
      B = _mm512_sub_epi8(B, off);
      float* o = y + 128 * nn;
      const float* dsn = ds + 8 * nn;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(dsn[0]), i8x16_ps(_mm512_extracti32x4_epi32(A, 0))));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_set1_ps(dsn[1]), i8x16_ps(_mm512_extracti32x4_epi32(A, 1))));
      _mm512_storeu_ps(o + 32, _mm512_mul_ps(_mm512_set1_ps(dsn[2]), i8x16_ps(_mm512_extracti32x4_epi32(A, 2))));
      _mm512_storeu_ps(o + 48, _mm512_mul_ps(_mm512_set1_ps(dsn[3]), i8x16_ps(_mm512_extracti32x4_epi32(A, 3))));
      _mm512_storeu_ps(o + 64, _mm512_mul_ps(_mm512_set1_ps(dsn[4]), i8x16_ps(_mm512_extracti32x4_epi32(B, 0))));
      _mm512_storeu_ps(o + 80, _mm512_mul_ps(_mm512_set1_ps(dsn[5]), i8x16_ps(_mm512_extracti32x4_epi32(B, 1))));
      _mm512_storeu_ps(o + 96, _mm512_mul_ps(_mm512_set1_ps(dsn[6]), i8x16_ps(_mm512_extracti32x4_epi32(B, 2))));
      _mm512_storeu_ps(o + 112, _mm512_mul_ps(_mm512_set1_ps(dsn[7]), i8x16_ps(_mm512_extracti32x4_epi32(B, 3))));
    }
  }
}

// ---- fp32 block product for exact-mode prefill: R weight rows x T token rows -------------------
// R·T accumulators stay in registers over the whole row, so each loaded vector feeds R or T FMAs.
template <int R, int T>
void f32_block(const float* const* w, const float* const* x, int64_t n, float* out, int64_t out_stride) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_ps(k, x[t] + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(k, w[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * out_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
}

template <int R>
void f32_block_t(const float* const* w, int nr, const float* const* x, int nt, int64_t n, float* out, int64_t os) {
  switch (nt) {
    case 1: f32_block<R, 1>(w, x, n, out, os); break;
    case 2: f32_block<R, 2>(w, x, n, out, os); break;
    case 3: f32_block<R, 3>(w, x, n, out, os); break;
    default: f32_block<R, 4>(w, x, n, out, os); break;
  }
}

void f32_block_any(const float* const* w, int nr, const float* const* x, int nt, int64_t n, float* out, int64_t os) {
  switch (nr) {
    case 1: f32_block_t<1>(w, nr, x, nt, n, out, os); break;
    case 2: f32_block_t<2>(w, nr, x, nt, n, out, os); break;
    case 3: f32_block_t<3>(w, nr, x, nt, n, out, os); break;
    default: f32_block_t<4>(w, nr, x, nt, n, out, os); break;
  }
}

}  // namespace

void fill_avx512_kernels(Kernels& k) {
  auto i = [](Type t) { return static_cast<size_t>(t); };
  k.name = "avx512-vnni";
  k.quantize_act[i(Type::Q8_K)] = act_q8_k;
  k.dot_fast[i(Type::Q4_0)] = dot_q4_0_q8_0;
  k.dot_fast[i(Type::Q8_0)] = dot_q8_0_q8_0;
  k.dot_fast[i(Type::Q4_K)] = dot_q4_k_q8_k;
  k.dot_fast[i(Type::Q5_K)] = dot_q5_k_q8_k;
  k.dot_fast[i(Type::Q6_K)] = dot_q6_k_q8_k;
  k.dot_fast_multi[i(Type::Q4_0)] = multi<Q40>;
  k.dot_fast_multi[i(Type::Q8_0)] = multi<Q80>;
  k.dot_fast_multi[i(Type::Q4_K)] = multi<Q4K>;
  k.dot_fast_multi[i(Type::Q5_K)] = multi<Q5K>;
  k.dot_fast_multi[i(Type::Q6_K)] = multi<Q6K>;
  k.dot_fast[i(Type::F32)] = fast_f32;
  k.f32_block = f32_block_any;
  k.dequant_row[i(Type::Q8_0)] = deq_row_q8_0;
  k.dequant_row[i(Type::Q4_K)] = deq_row_k4<false>;
  k.dequant_row[i(Type::Q5_K)] = deq_row_k4<true>;
  k.dequant_row[i(Type::Q6_K)] = deq_row_q6_k;
  k.dot_exact[i(Type::F32)] = exact_f32;
  k.dot_exact[i(Type::Q8_0)] = exact_q8_0;
  k.dot_exact[i(Type::Q4_K)] = exact_q4_k;
  k.dot_exact[i(Type::Q5_K)] = exact_q5_k;
  k.dot_exact[i(Type::Q6_K)] = exact_q6_k;
}

}  // namespace moe::quant::detail
