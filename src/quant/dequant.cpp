// Dequantization of one block / one row for every CPU block format (REFERENCE.md §5).
#include "dequant.hpp"

#include "moe/error.hpp"

namespace moe::quant {
namespace detail {

void deq_q4_0(const void* src, float* y) {
  auto* b = static_cast<const BlockQ4_0*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((b->qs[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((b->qs[j] >> 4) - 8);
  }
}

void deq_q4_1(const void* src, float* y) {
  auto* b = static_cast<const BlockQ4_1*>(src);
  float d = fp16(b->d), m = fp16(b->m);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(b->qs[j] & 0xF) + m;
    y[j + 16] = d * static_cast<float>(b->qs[j] >> 4) + m;
  }
}

void deq_q5_0(const void* src, float* y) {
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

void deq_q5_1(const void* src, float* y) {
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

void deq_q8_0(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_0*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(b->qs[j]);
}

void deq_q8_1(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_1*>(src);
  float d = fp16(b->d);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(b->qs[j]);
}

void deq_q2_k(const void* src, float* y) {
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

void deq_q3_k(const void* src, float* y) {
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

void deq_q4_k(const void* src, float* y) {
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

void deq_q5_k(const void* src, float* y) {
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

void deq_q6_k(const void* src, float* y) {
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

void deq_q8_k(const void* src, float* y) {
  auto* b = static_cast<const BlockQ8_K*>(src);
  for (int j = 0; j < 256; ++j) y[j] = b->d * static_cast<float>(b->qs[j]);
}

DequantBlockFn dequant_block_fn(Type t) {
  switch (t) {
    case Type::Q4_0: return deq_q4_0;
    case Type::Q4_1: return deq_q4_1;
    case Type::Q5_0: return deq_q5_0;
    case Type::Q5_1: return deq_q5_1;
    case Type::Q8_0: return deq_q8_0;
    case Type::Q8_1: return deq_q8_1;
    case Type::Q2_K: return deq_q2_k;
    case Type::Q3_K: return deq_q3_k;
    case Type::Q4_K: return deq_q4_k;
    case Type::Q5_K: return deq_q5_k;
    case Type::Q6_K: return deq_q6_k;
    case Type::Q8_K: return deq_q8_k;
    default: return nullptr;
  }
}

}  // namespace detail

void dequantize_row(Type t, const void* src, float* dst, int64_t n) {
  using namespace detail;
  int64_t nb = blocks_in_row(t, n);
  auto* p = static_cast<const uint8_t*>(src);
  switch (t) {
    case Type::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case Type::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = fp16_to_f32(h);
      }
      return;
    case Type::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    default:
      break;
  }
  DequantBlockFn fn = dequant_block_fn(t);
  if (!fn) unsupported_type(t, "for dequantization");
  BlockInfo bi = block_info(t);
  for (int64_t b = 0; b < nb; ++b) fn(p + b * bi.bytes, dst + b * bi.elems);
}

}  // namespace moe::quant
