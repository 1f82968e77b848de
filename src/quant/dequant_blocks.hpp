// Per-block dequantizers as plain loops, included by the scalar code (dequant.cpp) and by the
// SIMD files, where the compiler vectorizes them with that file's ISA. Internal linkage on purpose:
// each file must keep its own copy, or the linker could hand the AVX2 build to a scalar caller.
#pragma once
#include <cstring>

#include "internal.hpp"

namespace moe::quant::detail {
namespace {

[[maybe_unused]] inline void deq_q4_0(const void* src, float* y) {
  auto* b = static_cast<const BlockQ4_0*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((b->qs[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((b->qs[j] >> 4) - 8);
  }
}

[[maybe_unused]] inline void deq_q4_1(const void* src, float* y) {
  auto* b = static_cast<const BlockQ4_1*>(src);
  float d = fp16(b->d), m = fp16(b->m);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(b->qs[j] & 0xF) + m;
    y[j + 16] = d * static_cast<float>(b->qs[j] >> 4) + m;
  }
}

[[maybe_unused]] inline void deq_q5_0(const void* src, float* y) {
  auto* b = static_cast<const BlockQ5_0*>(src);
  float d = fp16(b->d);
  uint32_t h;
  std::memcpy(&h, b->qh, 4);
  for (int j = 0; j < 16; ++j) {
    int lo = (b->qs[j] & 0xF) | (((h >> j) & 1) << 4);
    int hi = (b->qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

[[maybe_unused]] inline void deq_q5_1(const void* src, float* y) {
  auto* b = static_cast<const BlockQ5_1*>(src);
  float d = fp16(b->d), m = fp16(b->m);
  uint32_t h;
  std::memcpy(&h, b->qh, 4);
  for (int j = 0; j < 16; ++j) {
    int lo = (b->qs[j] & 0xF) | (((h >> j) & 1) << 4);
    int hi = (b->qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo) + m;
    y[j + 16] = d * static_cast<float>(hi) + m;
  }
}

[[maybe_unused]] inline void deq_q8_0(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_0*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(b->qs[j]);
}

[[maybe_unused]] inline void deq_q8_1(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_1*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(b->qs[j]);
}

[[maybe_unused]] inline void deq_q2_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ2_K*>(src);
  float d = fp16(b->d), dmin = fp16(b->dmin);
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        int sc = b->scales[8 * n + 2 * j + half];
        float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          y[128 * n + 32 * j + l] = dl * static_cast<float>((b->qs[32 * n + l] >> (2 * j)) & 3) - ml;
      }
}

[[maybe_unused]] inline void deq_q3_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ3_K*>(src);
  float d = fp16(b->d);
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        float dl = d * static_cast<float>(scale_q3k(8 * n + 2 * j + half, b->scales));
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          int low = (b->qs[32 * n + l] >> (2 * j)) & 3;
          int hb = (b->hmask[l] >> (4 * n + j)) & 1;
          y[128 * n + 32 * j + l] = dl * static_cast<float>(low - (hb ? 0 : 4));
        }
      }
}

[[maybe_unused]] inline void deq_q4_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ4_K*>(src);
  float d = fp16(b->d), dmin = fp16(b->dmin);
  for (int c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * c, b->scales, sc0, m0);
    scale_min_k4(2 * c + 1, b->scales, sc1, m1);
    float d0 = d * static_cast<float>(sc0), mm0 = dmin * static_cast<float>(m0);
    float d1 = d * static_cast<float>(sc1), mm1 = dmin * static_cast<float>(m1);
    for (int l = 0; l < 32; ++l) {
      y[64 * c + l] = d0 * static_cast<float>(b->qs[32 * c + l] & 0xF) - mm0;
      y[64 * c + 32 + l] = d1 * static_cast<float>(b->qs[32 * c + l] >> 4) - mm1;
    }
  }
}

[[maybe_unused]] inline void deq_q5_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ5_K*>(src);
  float d = fp16(b->d), dmin = fp16(b->dmin);
  for (int c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * c, b->scales, sc0, m0);
    scale_min_k4(2 * c + 1, b->scales, sc1, m1);
    float d0 = d * static_cast<float>(sc0), mm0 = dmin * static_cast<float>(m0);
    float d1 = d * static_cast<float>(sc1), mm1 = dmin * static_cast<float>(m1);
    for (int l = 0; l < 32; ++l) {
      int q0 = (b->qs[32 * c + l] & 0xF) + (((b->qh[l] >> (2 * c)) & 1) << 4);
      int q1 = (b->qs[32 * c + l] >> 4) + (((b->qh[l] >> (2 * c + 1)) & 1) << 4);
      y[64 * c + l] = d0 * static_cast<float>(q0) - mm0;
      y[64 * c + 32 + l] = d1 * static_cast<float>(q1) - mm1;
    }
  }
}

[[maybe_unused]] inline void deq_q6_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ6_K*>(src);
  float d = fp16(b->d);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* L = b->ql + 64 * n;
    const uint8_t* H = b->qh + 32 * n;
    const int8_t* S = b->scales + 8 * n;
    float* out = y + 128 * n;
    for (int l = 0; l < 32; ++l) {
      int t = l / 16;
      int q1 = ((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32;
      int q2 = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32;
      int q3 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32;
      int q4 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * static_cast<float>(S[t]) * static_cast<float>(q1);
      out[l + 32] = d * static_cast<float>(S[t + 2]) * static_cast<float>(q2);
      out[l + 64] = d * static_cast<float>(S[t + 4]) * static_cast<float>(q3);
      out[l + 96] = d * static_cast<float>(S[t + 6]) * static_cast<float>(q4);
    }
  }
}

[[maybe_unused]] inline void deq_q8_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_K*>(src);
  for (int j = 0; j < 256; ++j) y[j] = b->d * static_cast<float>(b->qs[j]);
}

}  // namespace
}  // namespace moe::quant::detail
