// Internal to the quant module (and its tests): block structs, the per-ISA kernel tables and the
// helpers the scalar and SIMD kernels share. Not a public header.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "moe/quant.hpp"

namespace moe::quant::detail {

using gguf::kTypeCount;

constexpr int kQK = 32;    // elements of a legacy block
constexpr int kQKK = 256;  // elements of a K-quant super-block

#pragma pack(push, 1)
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ8_1 { uint16_t d, s; int8_t qs[32]; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockQ8_K { float d; int8_t qs[256]; int16_t bsums[16]; };
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);

// Block geometry of the types this module knows (elems == 0: not handled here).
struct BlockInfo {
  int elems;
  int bytes;
};
BlockInfo block_info(Type t);
const char* type_label(Type t);  // "Q4_K", "IQ2_XXS", "type 99"
// Throws Exit::unsupported naming the type and `what`.
[[noreturn]] void unsupported_type(Type t, const char* what);
// Blocks in a row of n elements; throws unless n is a positive multiple of the block size.
int64_t blocks_in_row(Type t, int64_t n);

// Small helpers shared by files compiled for different ISAs: internal linkage, so each file keeps
// its own copy and no AVX-512 build of one can be picked by the linker for a scalar caller.
namespace {

inline float fp16(uint16_t h) { return fp16_to_f32(h); }

// Round half to even for |v| < 2^22: adding 1.5·2^23 leaves the integer in the low mantissa bits,
// rounded by the FPU (the way llama.cpp's nearest_int does it).
inline int nearest_int(float v) {
  float t = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// The 6-bit scale and min of sub-block s of a Q4_K/Q5_K super-block.
inline void scale_min_k4(int s, const uint8_t* b, int& sc, int& m) {
  if (s < 4) {
    sc = b[s] & 63;
    m = b[s + 4] & 63;
  } else {
    sc = (b[s + 4] & 0xF) | ((b[s - 4] >> 6) << 4);
    m = (b[s + 4] >> 4) | ((b[s] >> 6) << 4);
  }
}

// Signed 6-bit scale i of a Q3_K super-block.
inline int scale_q3k(int i, const uint8_t* b) {
  int low = i < 8 ? (b[i] & 0xF) : (b[i - 8] >> 4);
  int hi = (b[8 + (i % 4)] >> (2 * (i / 4))) & 3;
  return (low | (hi << 4)) - 32;
}

}  // namespace

// ---- kernel tables -------------------------------------------------------------------------
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

using QuantizeActFn = void (*)(const float* x, void* dst, int64_t n);
using DotFastFn = float (*)(const void* w, const void* act, int64_t n);
using DotExactFn = float (*)(const void* w, const float* x, int64_t n);
// n_act (1..4) activation rows, act_stride bytes apart, against one weight row; out[a * out_stride].
// Must give exactly what dot_fast gives for each row.
using DotFastMultiFn = void (*)(const void* w, const uint8_t* act, size_t act_stride, int n_act, int64_t n, float* out,
                                int64_t out_stride);

struct Kernels {
  const char* name = "scalar";
  QuantizeActFn quantize_act[kTypeCount] = {};  // indexed by the activation type
  DotFastFn dot_fast[kTypeCount] = {};          // indexed by the weight type
  DotExactFn dot_exact[kTypeCount] = {};        // indexed by the weight type
  DotFastMultiFn dot_fast_multi[kTypeCount] = {};  // optional (nullptr: one dot_fast per row)
  // Row dequantization, used by exact-mode prefill; the scalar table fills every weight type.
  void (*dequant_row[kTypeCount])(const void* src, float* dst, int64_t n) = {};
  // out[t * out_stride + r] = w[r] · x[t] for r < nr <= 4, t < nt <= 4 (nullptr: not provided).
  void (*f32_block)(const float* const* w, int nr, const float* const* x, int nt, int64_t n, float* out,
                    int64_t out_stride) = nullptr;
};

void fill_scalar_kernels(Kernels& k);
// Override entries with SIMD kernels (defined in isa_avx2/ and isa_avx512/).
void fill_avx2_kernels(Kernels& k);
void fill_avx512_kernels(Kernels& k);

// The best level this CPU supports (ignoring MOE_ISA).
Isa cpu_isa();
// The table of one level (which must be <= cpu_isa()); tests compare them.
const Kernels& kernels(Isa isa);
// The table in use: cpu_isa() capped by MOE_ISA.
const Kernels& active();
// Re-reads MOE_ISA (tests set it between cases).
void reload_isa_from_env();

namespace {
// 8-lane canonical accumulation of legacy-block dot products: block b adds to lane b % 8, and the
// lanes are folded as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the order an AVX2 horizontal sum
// takes, so the scalar and SIMD paths give the same float.
inline float fold8(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
}  // namespace

}  // namespace moe::quant::detail
