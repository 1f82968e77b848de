// Prefill GEMM for Q4_K and Q6_K weights against Q8_K activations (AVX-512 VNNI): one weight row
// against 16 activation rows at a time. The row's codes and scales are unpacked once per 16 tokens, the 16
// integer block sums come out of one transpose-reduce instead of 16 horizontal sums, and the block's
// float scaling runs on 16 lanes. Every output is bit-identical to quant::dot_fast: the integer sums
// are exact and the float operations per block are the same, in the same order, without contraction.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <cpuid.h>
#include <immintrin.h>

#include "gemm.hpp"
#include "moe/quant.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 headers self-initialise "undefined" vectors, which warns under the pragma.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace moe::cpu {

namespace {

#define MOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))

constexpr int kTile = 16;                    // activation rows per kernel call
// Remainders of at least this many tokens run as an overlapping full tile: the tile kernels do a
// token in about 0.6 of the time of quant's four-token path.
constexpr int64_t kOverlapMin = 10;
constexpr size_t kQ4KBytes = 144;            // d, dmin, scales[12], qs[128]
constexpr size_t kQ8KBytes = 292;            // float d, qs[256], int16 bsums[16]
constexpr size_t kQ8KQs = 4, kQ8KBsums = 260;

// The 6-bit scales (sc) and mins (m) of the 8 sub-blocks, one byte each (REFERENCE.md §5.7).
inline void unpack_scales(const uint8_t* b, uint64_t& sc8, uint64_t& m8) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, b, 4);
  std::memcpy(&u1, b + 4, 4);
  std::memcpy(&u2, b + 8, 4);
  const uint32_t s_lo = u0 & 0x3F3F3F3Fu, m_lo = u1 & 0x3F3F3F3Fu;
  const uint32_t s_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
  const uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
  sc8 = s_lo | (static_cast<uint64_t>(s_hi) << 32);
  m8 = m_lo | (static_cast<uint64_t>(m_hi) << 32);
}

// 8 bytes -> int32 lanes 0..7 holding the int16 pair (v, v); lanes 8..15 zero.
MOE_AVX512 inline __m512i pairs16(uint64_t bytes8) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes8)));
  return _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
}

MOE_AVX512 inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 16 vectors of 16 int32 -> one vector whose lane k is the sum of vector k.
MOE_AVX512 inline __m512i reduce16(const __m512i* a) {
  __m512i v[8], w[4];
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j)
    w[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_epi64(v[2 * j], v[2 * j + 1]));
  const __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
  const __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], 0x88), _mm512_shuffle_i32x4(w[2], w[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xDD));
}

// 8 vectors, each two groups of 8 int32 (halves) -> lane 4*(2*(k/4) + half) + k%4 holds the sum of
// vector k's half.
MOE_AVX512 inline __m512i reduce8x2(const __m512i* z) {
  __m512i v[4], w[2];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]), _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]));
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_epi64(v[2 * j], v[2 * j + 1]));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
}

// out[a * out_stride] = row · act[a] for the 16 activation rows act + a * stride.
MOE_AVX512 void q4k_row_x16(const uint8_t* row, const uint8_t* act, size_t stride, int64_t n_blocks, float* out,
                            int64_t out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m512i gather_idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(stride)));
  // Activation a of min-term vector k (see reduce8x2): halves (k, k+4) for k < 4, (k+4, k+8) above.
  static constexpr int kMinAct[8][2] = {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}};
  __m512 sumf = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* blk = row + b * kQ4KBytes;
    const uint8_t* ab = act + b * kQ8KBytes;
    uint16_t d, dmin;
    std::memcpy(&d, blk, 2);
    std::memcpy(&dmin, blk + 2, 2);
    uint64_t sc8, m8;
    unpack_scales(blk + 4, sc8, m8);
    const __m512i scp = pairs16(sc8);
    const uint8_t* qs = blk + 16;
    __m512i acc[kTile];
    for (int a = 0; a < kTile; ++a) acc[a] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      const __m512i codes = join(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
      const __m512i sv = _mm512_permutexvar_epi32(
          _mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                            2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1),
          scp);
      const uint8_t* aq = ab + kQ8KQs + 64 * c;
      for (int a = 0; a < kTile; ++a)
        acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(codes, _mm512_loadu_si512(aq + a * stride)), sv);
    }
    const __m512i isum = reduce16(acc);

    const __m256i mp = _mm512_castsi512_si256(pairs16(m8));
    const __m512i mpp = join(mp, mp);
    __m512i z[8];
    for (int k = 0; k < 8; ++k) {
      const uint8_t* b0 = ab + kMinAct[k][0] * stride + kQ8KBsums;
      const uint8_t* b1 = ab + kMinAct[k][1] * stride + kQ8KBsums;
      z[k] = _mm512_madd_epi16(join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1))),
                               mpp);
    }
    const __m512i imin = reduce8x2(z);

    const __m512 yd = _mm512_i32gather_ps(gather_idx, ab, 1);
    const __m512 fd = _mm512_set1_ps(_cvtsh_ss(d)), fm = _mm512_set1_ps(_cvtsh_ss(dmin));
    sumf = _mm512_add_ps(sumf, _mm512_mul_ps(_mm512_mul_ps(fd, yd), _mm512_cvtepi32_ps(isum)));
    sumf = _mm512_sub_ps(sumf, _mm512_mul_ps(_mm512_mul_ps(fm, yd), _mm512_cvtepi32_ps(imin)));
  }
  alignas(64) float lanes[kTile];
  _mm512_store_ps(lanes, sumf);
  for (int a = 0; a < kTile; ++a) out[a * out_stride] = lanes[a];
}

// CPUID leaf 1, ECX bit 29. clang before 16 has no "f16c" in __builtin_cpu_supports (the fuzz build).
static bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}

constexpr size_t kQ6KBytes = 210;  // ql[128], qh[64], int8 scales[16], fp16 d

// Q6_K: codes 0..63 (the -32 offset comes back through the bsums), one scale per 16 elements.
MOE_AVX512 void q6k_row_x16(const uint8_t* row, const uint8_t* act, size_t stride, int64_t n_blocks, float* out,
                            int64_t out_stride) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x30);
  const __m512i gather_idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(stride)));
  static constexpr int kOffAct[8][2] = {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}};
  __m512 sumf = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const uint8_t* ab = act + b * kQ8KBytes;
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m512i s32 = _mm512_cvtepi8_epi32(s8);
    const __m512i sp = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
    uint16_t d;
    std::memcpy(&d, blk + 208, 2);
    __m512i acc[kTile];
    for (int a = 0; a < kTile; ++a) acc[a] = _mm512_setzero_si512();
    for (int nn = 0; nn < 2; ++nn) {
      const __m512i L = _mm512_loadu_si512(blk + 64 * nn);
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * nn));
      // Elements 0..63 of the half: low nibbles with qh bits 0-1 (first 32) and 2-3 (next 32);
      // elements 64..127: high nibbles with qh bits 4-5 and 6-7.
      const __m512i A = _mm512_or_si512(_mm512_and_si512(L, m4),
                                        _mm512_and_si512(join(_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2)), m3));
      const __m512i B = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                        _mm512_and_si512(join(H, _mm256_srli_epi16(H, 2)), m3));
      // Each 128-bit lane of A/B is one group of 16 with its own scale.
      const int g = 8 * nn;
      const __m512i ia = _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2, g + 2, g + 3,
                                           g + 3, g + 3, g + 3);
      const __m512i sa = _mm512_permutexvar_epi32(ia, sp);
      const __m512i sb = _mm512_permutexvar_epi32(_mm512_add_epi32(ia, _mm512_set1_epi32(4)), sp);
      const uint8_t* aq = ab + kQ8KQs + 128 * nn;
      for (int a = 0; a < kTile; ++a) {
        acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(A, _mm512_loadu_si512(aq + a * stride)), sa);
        acc[a] = _mm512_dpwssd_epi32(acc[a], _mm512_maddubs_epi16(B, _mm512_loadu_si512(aq + a * stride + 64)), sb);
      }
    }
    const __m512i isum = reduce16(acc);
    // 32 * Σ_g S_g * bsum_g per activation, for the -32 offset of every code.
    const __m256i s16 = _mm256_cvtepi8_epi16(s8);
    const __m512i ss = join(s16, s16);
    __m512i z[8];
    for (int k = 0; k < 8; ++k) {
      const uint8_t* b0 = ab + kOffAct[k][0] * stride + kQ8KBsums;
      const uint8_t* b1 = ab + kOffAct[k][1] * stride + kQ8KBsums;
      z[k] = _mm512_madd_epi16(join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1))),
                               ss);
    }
    const __m512i total = _mm512_sub_epi32(isum, _mm512_slli_epi32(reduce8x2(z), 5));
    const __m512 yd = _mm512_i32gather_ps(gather_idx, ab, 1);
    const __m512 fd = _mm512_set1_ps(_cvtsh_ss(d));
    sumf = _mm512_add_ps(sumf, _mm512_mul_ps(_mm512_mul_ps(fd, yd), _mm512_cvtepi32_ps(total)));
  }
  alignas(64) float lanes[kTile];
  _mm512_store_ps(lanes, sumf);
  for (int a = 0; a < kTile; ++a) out[a * out_stride] = lanes[a];
}

bool detect() {
  const char* cap = std::getenv("MOE_ISA");
  if (cap && std::strncmp(cap, "avx512", 6) != 0) return false;
  if (const char* off = std::getenv("MOE_CPU_GEMM"); off && std::strcmp(off, "0") == 0) return false;  // A/B runs
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && cpu_has_f16c();
}

}  // namespace

bool gemm_kquant_available() {
  static const bool ok = detect();
  return ok;
}

void gemm_kquant_rows(const quant::Matrix& w, int64_t r0, int64_t r1, const uint8_t* acts, size_t act_stride,
                      int64_t n_tok, float* y, int64_t y_stride) {
  const int64_t n_blocks = w.cols / 256;
  const bool q6 = w.type == quant::Type::Q6_K;
  const bool usable = gemm_kquant_available() && (q6 || w.type == quant::Type::Q4_K) && n_tok >= kTile;
  const int64_t full = usable ? n_tok / kTile * kTile : 0;
  const auto kernel = q6 ? q6k_row_x16 : q4k_row_x16;
  const auto tile = [&](int64_t t) {
    for (int64_t r = r0; r < r1; ++r)
      kernel(w.row(r), acts + static_cast<size_t>(t) * act_stride, act_stride, n_blocks, y + t * y_stride + r, y_stride);
  };
  // Token tile outer: its 16 activation rows (37 KiB for n_embd 2048) stay in L1/L2 while the task's
  // weight rows stream past them from L2.
  for (int64_t t = 0; t < full; t += kTile) tile(t);
  if (full == n_tok) return;
  if (usable && n_tok - full >= kOverlapMin) {
    // A last tile that overlaps the previous one costs less than the remainder through quant; the
    // overlapping outputs are rewritten with the same bits.
    tile(n_tok - kTile);
    return;
  }
  quant::matmul_rows_fast(w, r0, r1, acts + static_cast<size_t>(full) * act_stride, act_stride, n_tok - full,
                          y + full * y_stride, y_stride);
}

}  // namespace moe::cpu
