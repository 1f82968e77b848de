// Scalar fp16/bf16 conversions and the block geometry of the types the CPU computes with.
#include <cstring>
#include <string>

#include "internal.hpp"
#include "moe/error.hpp"

namespace moe::quant {

namespace {
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

float fp16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  if (exp == 0) {
    // Subnormal or zero: mant · 2^-24 is exact in fp32.
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7F800000u | (mant << 13));  // inf / NaN keeps its payload
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_fp16(float f) {
  uint32_t x = bits_of(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00 | static_cast<uint16_t>((x >> 13) & 0x3FF);  // quiet NaN
  // 65520 is the half-way point between 65504 (odd mantissa) and 2^16: ties round to infinity.
  if (x >= 0x477FF000u) return sign | 0x7C00;
  if (x < 0x38800000u) {
    // Below the smallest normal half: adding 0.5 puts the value's 2^-24 units in the low mantissa
    // bits, rounded to nearest even by the FPU.
    float t = float_of(x) + 0.5f;
    return sign | static_cast<uint16_t>(bits_of(t) - 0x3F000000u);
  }
  uint32_t odd = (x >> 13) & 1;
  x += 0xC8000FFFu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_bf16(float f) {
  uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

bool is_weight_type(Type t) {
  switch (t) {
    case Type::F32: case Type::F16: case Type::BF16: case Type::Q4_0: case Type::Q4_1:
    case Type::Q5_0: case Type::Q5_1: case Type::Q8_0: case Type::Q2_K: case Type::Q3_K:
    case Type::Q4_K: case Type::Q5_K: case Type::Q6_K:
      return true;
    default:
      return false;
  }
}

Type act_type(Type weight) {
  switch (weight) {
    case Type::F32: return Type::F32;
    case Type::F16: return Type::F16;
    case Type::BF16: return Type::BF16;
    case Type::Q4_0: case Type::Q5_0: case Type::Q8_0: return Type::Q8_0;
    case Type::Q4_1: case Type::Q5_1: return Type::Q8_1;
    case Type::Q2_K: case Type::Q3_K: case Type::Q4_K: case Type::Q5_K: case Type::Q6_K: return Type::Q8_K;
    default: detail::unsupported_type(weight, "as a CPU weight");
  }
}

size_t act_row_bytes(Type weight, int64_t n) {
  Type a = act_type(weight);
  int64_t nb = detail::blocks_in_row(a, n);
  return static_cast<size_t>(nb) * static_cast<size_t>(detail::block_info(a).bytes);
}

namespace detail {

BlockInfo block_info(Type t) {
  switch (t) {
    case Type::F32: return {1, 4};
    case Type::F16: return {1, 2};
    case Type::BF16: return {1, 2};
    case Type::Q4_0: return {32, 18};
    case Type::Q4_1: return {32, 20};
    case Type::Q5_0: return {32, 22};
    case Type::Q5_1: return {32, 24};
    case Type::Q8_0: return {32, 34};
    case Type::Q8_1: return {32, 36};
    case Type::Q2_K: return {256, 84};
    case Type::Q3_K: return {256, 110};
    case Type::Q4_K: return {256, 144};
    case Type::Q5_K: return {256, 176};
    case Type::Q6_K: return {256, 210};
    case Type::Q8_K: return {256, 292};
    default: return {0, 0};
  }
}

const char* type_label(Type t) {
  // Names of the ggml ids (REFERENCE.md §1.6); kept here so error messages need no other module.
  static const char* const names[kTypeCount] = {
      "F32", "F16", "Q4_0", "Q4_1", nullptr, nullptr, "Q5_0", "Q5_1", "Q8_0", "Q8_1",
      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
      "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
      "BF16", nullptr, nullptr, nullptr, "TQ1_0", "TQ2_0", nullptr, nullptr, nullptr, "MXFP4",
      "NVFP4", "Q1_0", "Q2_0"};
  auto id = static_cast<uint32_t>(t);
  if (id < kTypeCount && names[id]) return names[id];
  thread_local std::string buf;
  buf = "type " + std::to_string(id);
  return buf.c_str();
}

void unsupported_type(Type t, const char* what) {
  fail(Exit::unsupported, "quant: tensor type {} is not supported {}", type_label(t), what);
}

int64_t blocks_in_row(Type t, int64_t n) {
  BlockInfo bi = block_info(t);
  if (bi.elems == 0) unsupported_type(t, "by the CPU block formats");
  if (n <= 0 || n % bi.elems != 0)
    fail(Exit::unsupported, "quant: a row of {} elements is not a positive multiple of the {} block size {}", n,
         type_label(t), bi.elems);
  return n / bi.elems;
}

}  // namespace detail
}  // namespace moe::quant
