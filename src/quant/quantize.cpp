// Reference quantizers of the legacy 32-element formats, Q8_K and the float types, and the
// quantize_row entry point. The legacy formats follow llama.cpp's reference rules (scale from the
// signed extreme, truncating rounding for the 4/5-bit types, roundf for Q8) so a file written by us
// holds the blocks llama-quantize would write from the same floats.
#include <algorithm>
#include <cmath>

#include "internal.hpp"
#include "kquants.hpp"
#include "moe/error.hpp"

namespace moe::quant {
namespace detail {
namespace {

void quant_q4_0(const float* x, BlockQ4_0* b) {
  float amax = 0, max = 0;
  for (int j = 0; j < 32; ++j)
    if (amax < std::fabs(x[j])) { amax = std::fabs(x[j]); max = x[j]; }
  // The signed extreme maps to -8, so the full 16-level range is used.
  float d = max / -8.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  for (int j = 0; j < 16; ++j) {
    int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
    int q1 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + 16] * id + 8.5f)));
    b->qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
}

void quant_q4_1(const float* x, BlockQ4_1* b) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < 32; ++j) { mn = std::min(mn, x[j]); mx = std::max(mx, x[j]); }
  float d = (mx - mn) / 15.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  b->m = f32_to_fp16(mn);
  for (int j = 0; j < 16; ++j) {
    int q0 = std::min(15, static_cast<int>(static_cast<int8_t>((x[j] - mn) * id + 0.5f)));
    int q1 = std::min(15, static_cast<int>(static_cast<int8_t>((x[j + 16] - mn) * id + 0.5f)));
    b->qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
  }
}

void quant_q5_0(const float* x, BlockQ5_0* b) {
  float amax = 0, max = 0;
  for (int j = 0; j < 32; ++j)
    if (amax < std::fabs(x[j])) { amax = std::fabs(x[j]); max = x[j]; }
  float d = max / -16.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  uint32_t h = 0;
  for (int j = 0; j < 16; ++j) {
    int q0 = std::min(31, static_cast<int>(static_cast<int8_t>(x[j] * id + 16.5f)));
    int q1 = std::min(31, static_cast<int>(static_cast<int8_t>(x[j + 16] * id + 16.5f)));
    b->qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    h |= static_cast<uint32_t>((q0 >> 4) & 1) << j;
    h |= static_cast<uint32_t>((q1 >> 4) & 1) << (j + 16);
  }
  std::memcpy(b->qh, &h, 4);
}

void quant_q5_1(const float* x, BlockQ5_1* b) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < 32; ++j) { mn = std::min(mn, x[j]); mx = std::max(mx, x[j]); }
  float d = (mx - mn) / 31.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  b->m = f32_to_fp16(mn);
  uint32_t h = 0;
  for (int j = 0; j < 16; ++j) {
    int q0 = std::min(31, static_cast<int>(static_cast<int8_t>((x[j] - mn) * id + 0.5f)));
    int q1 = std::min(31, static_cast<int>(static_cast<int8_t>((x[j + 16] - mn) * id + 0.5f)));
    b->qs[j] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
    h |= static_cast<uint32_t>((q0 >> 4) & 1) << j;
    h |= static_cast<uint32_t>((q1 >> 4) & 1) << (j + 16);
  }
  std::memcpy(b->qh, &h, 4);
}

void quant_q8_0(const float* x, BlockQ8_0* b) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  float d = amax / 127.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  for (int j = 0; j < 32; ++j) b->qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
}

void quant_q8_1(const float* x, BlockQ8_1* b) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  float d = amax / 127.f;
  float id = d != 0.f ? 1.f / d : 0.f;
  b->d = f32_to_fp16(d);
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    b->qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
    sum += b->qs[j];
  }
  b->s = f32_to_fp16(static_cast<float>(sum) * d);
}

template <typename Block, typename Fn>
void each_block(const float* src, void* dst, int64_t nb, int elems, Fn fn) {
  auto* out = static_cast<Block*>(dst);
  for (int64_t i = 0; i < nb; ++i) fn(src + i * elems, out + i);
}

}  // namespace

// Q8_K as llama.cpp's reference routine writes it (the x86 build calls the same routine): the
// signed extreme (first one on ties) maps to -127, rounding half to even.
void quantize_q8_k(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_K*>(dst);
  for (int64_t i = 0; i < n / kQKK; ++i, x += kQKK) {
    BlockQ8_K& b = out[i];
    float amax = 0, max = 0;
    for (int j = 0; j < kQKK; ++j)
      if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); max = x[j]; }
    if (amax == 0.f) {
      b.d = 0;
      std::memset(b.qs, 0, sizeof b.qs);
      std::memset(b.bsums, 0, sizeof b.bsums);
      continue;
    }
    float iscale = -127.f / max;
    for (int j = 0; j < kQKK; ++j) b.qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += b.qs[16 * g + j];
      b.bsums[g] = static_cast<int16_t>(s);
    }
    b.d = 1.f / iscale;
  }
}

}  // namespace detail

void quantize_row(Type t, const float* src, void* dst, int64_t n) {
  using namespace detail;
  int64_t nb = blocks_in_row(t, n);
  auto* out = static_cast<uint8_t*>(dst);
  switch (t) {
    case Type::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
    case Type::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = f32_to_fp16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case Type::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case Type::Q4_0: each_block<BlockQ4_0>(src, dst, nb, kQK, quant_q4_0); return;
    case Type::Q4_1: each_block<BlockQ4_1>(src, dst, nb, kQK, quant_q4_1); return;
    case Type::Q5_0: each_block<BlockQ5_0>(src, dst, nb, kQK, quant_q5_0); return;
    case Type::Q5_1: each_block<BlockQ5_1>(src, dst, nb, kQK, quant_q5_1); return;
    case Type::Q8_0: each_block<BlockQ8_0>(src, dst, nb, kQK, quant_q8_0); return;
    case Type::Q8_1: each_block<BlockQ8_1>(src, dst, nb, kQK, quant_q8_1); return;
    case Type::Q8_K: quantize_q8_k(src, dst, n); return;
    case Type::Q2_K: each_block<BlockQ2_K>(src, dst, nb, kQKK, quant_q2_k); return;
    case Type::Q3_K: each_block<BlockQ3_K>(src, dst, nb, kQKK, quant_q3_k); return;
    case Type::Q4_K: each_block<BlockQ4_K>(src, dst, nb, kQKK, quant_q4_k); return;
    case Type::Q5_K: each_block<BlockQ5_K>(src, dst, nb, kQKK, quant_q5_k); return;
    case Type::Q6_K: each_block<BlockQ6_K>(src, dst, nb, kQKK, quant_q6_k); return;
    default: unsupported_type(t, "for quantization");
  }
}

}  // namespace moe::quant
