// Scalar kernels: activation quantization (llama.cpp's x86 rules), integer dot products per block,
// and exact-mode dot products against weights dequantized one block at a time on the stack.
// The SIMD kernels must produce the same integers and combine them in the same float order.
// The fast-mode float steps must round exactly like the scalar kernels: no fused multiply-adds
// unless written as intrinsics.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>

#include "dequant.hpp"
#include "internal.hpp"
#include "kquants.hpp"

namespace moe::quant::detail {
namespace {

// ---- activation quantization ------------------------------------------------------------
// Q8_0 the way the x86 AVX/AVX2 build does it: id = 127/amax, round half to even; d = amax/127 (fp16).
void act_q8_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_0*>(dst);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    out[i].d = f32_to_fp16(amax / 127.f);
    float id = amax != 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < kQK; ++j) out[i].qs[j] = static_cast<int8_t>(std::clamp(nearest_int(x[j] * id), -128, 127));
  }
}

// Q8_1: as Q8_0, plus s = fp16(d · Σq) with the fp32 d.
void act_q8_1(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<BlockQ8_1*>(dst);
  for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    float d = amax / 127.f;
    out[i].d = f32_to_fp16(d);
    float id = amax != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      out[i].qs[j] = static_cast<int8_t>(std::clamp(nearest_int(x[j] * id), -128, 127));
      sum += out[i].qs[j];
    }
    out[i].s = f32_to_fp16(d * static_cast<float>(sum));
  }
}

void act_f32(const float* x, void* dst, int64_t n) { std::memcpy(dst, x, static_cast<size_t>(n) * 4); }
void act_f16(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_fp16(x[i]);
}
void act_bf16(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

// ---- fast dot products --------------------------------------------------------------------
float dot_q4_0_q8_0(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ4_0*>(w);
  auto* y = static_cast<const BlockQ8_0*>(a);
  float lanes[8] = {};
  for (int64_t b = 0; b < n / kQK; ++b) {
    int isum = 0;
    for (int j = 0; j < 16; ++j)
      isum += ((x[b].qs[j] & 0xF) - 8) * y[b].qs[j] + ((x[b].qs[j] >> 4) - 8) * y[b].qs[j + 16];
    lanes[b % 8] += (fp16(x[b].d) * fp16(y[b].d)) * static_cast<float>(isum);
  }
  return fold8(lanes);
}

float dot_q8_0_q8_0(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ8_0*>(w);
  auto* y = static_cast<const BlockQ8_0*>(a);
  float lanes[8] = {};
  for (int64_t b = 0; b < n / kQK; ++b) {
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += x[b].qs[j] * y[b].qs[j];
    lanes[b % 8] += (fp16(x[b].d) * fp16(y[b].d)) * static_cast<float>(isum);
  }
  return fold8(lanes);
}

float dot_q5_0_q8_0(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ5_0*>(w);
  auto* y = static_cast<const BlockQ8_0*>(a);
  float lanes[8] = {};
  for (int64_t b = 0; b < n / kQK; ++b) {
    uint32_t h;
    std::memcpy(&h, x[b].qh, 4);
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      int lo = ((x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4)) - 16;
      int hi = ((x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - 16;
      isum += lo * y[b].qs[j] + hi * y[b].qs[j + 16];
    }
    lanes[b % 8] += (fp16(x[b].d) * fp16(y[b].d)) * static_cast<float>(isum);
  }
  return fold8(lanes);
}

float dot_q4_1_q8_1(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ4_1*>(w);
  auto* y = static_cast<const BlockQ8_1*>(a);
  float lanes[8] = {};
  for (int64_t b = 0; b < n / kQK; ++b) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += (x[b].qs[j] & 0xF) * y[b].qs[j] + (x[b].qs[j] >> 4) * y[b].qs[j + 16];
    // The min term uses the activation block's stored d·Σq.
    lanes[b % 8] += (fp16(x[b].d) * fp16(y[b].d)) * static_cast<float>(isum) + fp16(x[b].m) * fp16(y[b].s);
  }
  return fold8(lanes);
}

float dot_q5_1_q8_1(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ5_1*>(w);
  auto* y = static_cast<const BlockQ8_1*>(a);
  float lanes[8] = {};
  for (int64_t b = 0; b < n / kQK; ++b) {
    uint32_t h;
    std::memcpy(&h, x[b].qh, 4);
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      int lo = (x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4);
      int hi = (x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
      isum += lo * y[b].qs[j] + hi * y[b].qs[j + 16];
    }
    lanes[b % 8] += (fp16(x[b].d) * fp16(y[b].d)) * static_cast<float>(isum) + fp16(x[b].m) * fp16(y[b].s);
  }
  return fold8(lanes);
}

// K-quants: per super-block one integer for the scaled products and one for the min term, then
// sumf += (d_w·d_a)·isum; sumf -= (dmin_w·d_a)·imin in super-block order. This order is a contract:
// the SIMD kernels here and src/cpu's Q4_K prefill kernel reproduce it bit for bit.
float dot_q2_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ2_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int isum = 0, imin = 0;
    for (int nn = 0; nn < 2; ++nn)
      for (int j = 0; j < 4; ++j)
        for (int half = 0; half < 2; ++half) {
          int g = 8 * nn + 2 * j + half;
          int s = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l)
            s += ((x[b].qs[32 * nn + l] >> (2 * j)) & 3) * y[b].qs[128 * nn + 32 * j + l];
          isum += (x[b].scales[g] & 0xF) * s;
          imin += (x[b].scales[g] >> 4) * y[b].bsums[g];
        }
    sumf += fp16(x[b].d) * y[b].d * static_cast<float>(isum);
    sumf -= fp16(x[b].dmin) * y[b].d * static_cast<float>(imin);
  }
  return sumf;
}

float dot_q3_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ3_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int isum = 0;
    for (int nn = 0; nn < 2; ++nn)
      for (int j = 0; j < 4; ++j)
        for (int half = 0; half < 2; ++half) {
          int s = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            int low = (x[b].qs[32 * nn + l] >> (2 * j)) & 3;
            int hb = (x[b].hmask[l] >> (4 * nn + j)) & 1;
            s += (low - (hb ? 0 : 4)) * y[b].qs[128 * nn + 32 * j + l];
          }
          isum += scale_q3k(8 * nn + 2 * j + half, x[b].scales) * s;
        }
    sumf += fp16(x[b].d) * y[b].d * static_cast<float>(isum);
  }
  return sumf;
}

float dot_q4_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ4_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int isum = 0, imin = 0;
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, x[b].scales, sc0, m0);
      scale_min_k4(2 * c + 1, x[b].scales, sc1, m1);
      int s0 = 0, s1 = 0;
      for (int l = 0; l < 32; ++l) {
        s0 += (x[b].qs[32 * c + l] & 0xF) * y[b].qs[64 * c + l];
        s1 += (x[b].qs[32 * c + l] >> 4) * y[b].qs[64 * c + 32 + l];
      }
      isum += sc0 * s0 + sc1 * s1;
      imin += m0 * (y[b].bsums[4 * c] + y[b].bsums[4 * c + 1]) + m1 * (y[b].bsums[4 * c + 2] + y[b].bsums[4 * c + 3]);
    }
    sumf += fp16(x[b].d) * y[b].d * static_cast<float>(isum);
    sumf -= fp16(x[b].dmin) * y[b].d * static_cast<float>(imin);
  }
  return sumf;
}

float dot_q5_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ5_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int isum = 0, imin = 0;
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, x[b].scales, sc0, m0);
      scale_min_k4(2 * c + 1, x[b].scales, sc1, m1);
      int s0 = 0, s1 = 0;
      for (int l = 0; l < 32; ++l) {
        int q0 = (x[b].qs[32 * c + l] & 0xF) + (((x[b].qh[l] >> (2 * c)) & 1) << 4);
        int q1 = (x[b].qs[32 * c + l] >> 4) + (((x[b].qh[l] >> (2 * c + 1)) & 1) << 4);
        s0 += q0 * y[b].qs[64 * c + l];
        s1 += q1 * y[b].qs[64 * c + 32 + l];
      }
      isum += sc0 * s0 + sc1 * s1;
      imin += m0 * (y[b].bsums[4 * c] + y[b].bsums[4 * c + 1]) + m1 * (y[b].bsums[4 * c + 2] + y[b].bsums[4 * c + 3]);
    }
    sumf += fp16(x[b].d) * y[b].d * static_cast<float>(isum);
    sumf -= fp16(x[b].dmin) * y[b].d * static_cast<float>(imin);
  }
  return sumf;
}

float dot_q6_k_q8_k(const void* w, const void* a, int64_t n) {
  auto* x = static_cast<const BlockQ6_K*>(w);
  auto* y = static_cast<const BlockQ8_K*>(a);
  float sumf = 0;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int isum = 0;
    for (int nn = 0; nn < 2; ++nn) {
      const uint8_t* L = x[b].ql + 64 * nn;
      const uint8_t* H = x[b].qh + 32 * nn;
      const int8_t* S = x[b].scales + 8 * nn;
      const int8_t* q = y[b].qs + 128 * nn;
      for (int t = 0; t < 2; ++t) {
        int s1 = 0, s2 = 0, s3 = 0, s4 = 0;
        for (int l = 16 * t; l < 16 * t + 16; ++l) {
          s1 += (((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32) * q[l];
          s2 += (((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32) * q[l + 32];
          s3 += (((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32) * q[l + 64];
          s4 += (((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32) * q[l + 96];
        }
        isum += S[t] * s1 + S[t + 2] * s2 + S[t + 4] * s3 + S[t + 6] * s4;
      }
    }
    sumf += fp16(x[b].d) * y[b].d * static_cast<float>(isum);
  }
  return sumf;
}

// ---- float dot products (F32/F16/BF16 weights in both modes, and the exact mode) ----------------
template <typename Load>
float dot_lanes(int64_t n, Load w, const float* x) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += w(i + k) * x[i + k];
  for (; i < n; ++i) lanes[i % 8] += w(i) * x[i];
  return fold8(lanes);
}

float u16_at(const void* p, int64_t i, float (*conv)(uint16_t)) {
  uint16_t h;
  std::memcpy(&h, static_cast<const uint8_t*>(p) + 2 * i, 2);
  return conv(h);
}

float dot_f32(const void* w, const void* a, int64_t n) {
  auto* wf = static_cast<const float*>(w);
  return dot_lanes(n, [wf](int64_t i) { return wf[i]; }, static_cast<const float*>(a));
}
float dot_f16_f16(const void* w, const void* a, int64_t n) {
  float lanes[8] = {};
  for (int64_t i = 0; i < n; ++i) lanes[i % 8] += u16_at(w, i, fp16_to_f32) * u16_at(a, i, fp16_to_f32);
  return fold8(lanes);
}
float dot_bf16_bf16(const void* w, const void* a, int64_t n) {
  float lanes[8] = {};
  for (int64_t i = 0; i < n; ++i) lanes[i % 8] += u16_at(w, i, bf16_to_f32) * u16_at(a, i, bf16_to_f32);
  return fold8(lanes);
}

float exact_f32(const void* w, const float* x, int64_t n) { return dot_f32(w, x, n); }
float exact_f16(const void* w, const float* x, int64_t n) {
  return dot_lanes(n, [w](int64_t i) { return u16_at(w, i, fp16_to_f32); }, x);
}
float exact_bf16(const void* w, const float* x, int64_t n) {
  return dot_lanes(n, [w](int64_t i) { return u16_at(w, i, bf16_to_f32); }, x);
}

// Blocks are dequantized into a stack buffer one at a time; the lanes run across blocks.
template <Type T>
float exact_blocks(const void* w, const float* x, int64_t n) {
  static const DequantBlockFn deq = dequant_block_fn(T);
  const BlockInfo bi = block_info(T);
  auto* p = static_cast<const uint8_t*>(w);
  float buf[kQKK];
  float lanes[8] = {};
  for (int64_t b = 0; b < n / bi.elems; ++b) {
    deq(p + b * bi.bytes, buf);
    const float* xb = x + b * bi.elems;
    for (int i = 0; i < bi.elems; i += 8)
      for (int k = 0; k < 8; ++k) lanes[k] += buf[i + k] * xb[i + k];
  }
  return fold8(lanes);
}

// Table entries carry no type argument: one instance per type.
template <Type T>
void dequant_t(const void* src, float* dst, int64_t n) { dequantize_row(T, src, dst, n); }

}  // namespace

void fill_scalar_kernels(Kernels& k) {
  auto i = [](Type t) { return static_cast<size_t>(t); };
  k.name = "scalar";
  k.quantize_act[i(Type::F32)] = act_f32;
  k.quantize_act[i(Type::F16)] = act_f16;
  k.quantize_act[i(Type::BF16)] = act_bf16;
  k.quantize_act[i(Type::Q8_0)] = act_q8_0;
  k.quantize_act[i(Type::Q8_1)] = act_q8_1;
  k.quantize_act[i(Type::Q8_K)] = quantize_q8_k;

  k.dot_fast[i(Type::F32)] = dot_f32;
  k.dot_fast[i(Type::F16)] = dot_f16_f16;
  k.dot_fast[i(Type::BF16)] = dot_bf16_bf16;
  k.dot_fast[i(Type::Q4_0)] = dot_q4_0_q8_0;
  k.dot_fast[i(Type::Q4_1)] = dot_q4_1_q8_1;
  k.dot_fast[i(Type::Q5_0)] = dot_q5_0_q8_0;
  k.dot_fast[i(Type::Q5_1)] = dot_q5_1_q8_1;
  k.dot_fast[i(Type::Q8_0)] = dot_q8_0_q8_0;
  k.dot_fast[i(Type::Q2_K)] = dot_q2_k_q8_k;
  k.dot_fast[i(Type::Q3_K)] = dot_q3_k_q8_k;
  k.dot_fast[i(Type::Q4_K)] = dot_q4_k_q8_k;
  k.dot_fast[i(Type::Q5_K)] = dot_q5_k_q8_k;
  k.dot_fast[i(Type::Q6_K)] = dot_q6_k_q8_k;

  k.dequant_row[i(Type::F32)] = dequant_t<Type::F32>;
  k.dequant_row[i(Type::F16)] = dequant_t<Type::F16>;
  k.dequant_row[i(Type::BF16)] = dequant_t<Type::BF16>;
  k.dequant_row[i(Type::Q4_0)] = dequant_t<Type::Q4_0>;
  k.dequant_row[i(Type::Q4_1)] = dequant_t<Type::Q4_1>;
  k.dequant_row[i(Type::Q5_0)] = dequant_t<Type::Q5_0>;
  k.dequant_row[i(Type::Q5_1)] = dequant_t<Type::Q5_1>;
  k.dequant_row[i(Type::Q8_0)] = dequant_t<Type::Q8_0>;
  k.dequant_row[i(Type::Q2_K)] = dequant_t<Type::Q2_K>;
  k.dequant_row[i(Type::Q3_K)] = dequant_t<Type::Q3_K>;
  k.dequant_row[i(Type::Q4_K)] = dequant_t<Type::Q4_K>;
  k.dequant_row[i(Type::Q5_K)] = dequant_t<Type::Q5_K>;
  k.dequant_row[i(Type::Q6_K)] = dequant_t<Type::Q6_K>;
  k.dot_exact[i(Type::F32)] = exact_f32;
  k.dot_exact[i(Type::F16)] = exact_f16;
  k.dot_exact[i(Type::BF16)] = exact_bf16;
  k.dot_exact[i(Type::Q4_0)] = exact_blocks<Type::Q4_0>;
  k.dot_exact[i(Type::Q4_1)] = exact_blocks<Type::Q4_1>;
  k.dot_exact[i(Type::Q5_0)] = exact_blocks<Type::Q5_0>;
  k.dot_exact[i(Type::Q5_1)] = exact_blocks<Type::Q5_1>;
  k.dot_exact[i(Type::Q8_0)] = exact_blocks<Type::Q8_0>;
  k.dot_exact[i(Type::Q2_K)] = exact_blocks<Type::Q2_K>;
  k.dot_exact[i(Type::Q3_K)] = exact_blocks<Type::Q3_K>;
  k.dot_exact[i(Type::Q4_K)] = exact_blocks<Type::Q4_K>;
  k.dot_exact[i(Type::Q5_K)] = exact_blocks<Type::Q5_K>;
  k.dot_exact[i(Type::Q6_K)] = exact_blocks<Type::Q6_K>;
}

}  // namespace moe::quant::detail
