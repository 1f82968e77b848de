// Device dequantization of one 32-element group of a row, for every supported weight type, in the
// repacked device layout (layout.cuh). Both the GEMV (decode) and the tiled GEMM (prefill) build on
// it, so a type is either supported everywhere on the GPU or nowhere.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "layout.cuh"

namespace moe::cuda::dev {

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

__device__ __forceinline__ uint4 ld16(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t ld4(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// 32 bytes (two 16-byte loads) as eight words.
__device__ __forceinline__ void ld32(const uint8_t* p, uint32_t (&w)[8]) {
  uint4 a = ld16(p), b = ld16(p + 16);
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}
__device__ __forceinline__ int byte_of(const uint32_t (&w)[8], int l) { return (w[l >> 2] >> (8 * (l & 3))) & 0xFF; }

// Q4_K / Q5_K 6-bit scale and min of sub-block s (REFERENCE.md §5.7).
__device__ __forceinline__ void k_scale_min(const uint8_t* b, int s, int& sc, int& m) {
  if (s < 4) {
    sc = b[s] & 63;
    m = b[s + 4] & 63;
  } else {
    sc = (b[s + 4] & 0xF) | ((b[s - 4] >> 6) << 4);
    m = (b[s + 4] >> 4) | ((b[s] >> 6) << 4);
  }
}

// v[0..32) = elements [32g, 32g+32) of a device row of type T.
template <uint32_t T>
__device__ __forceinline__ void dequant32(const uint8_t* row, int g, float (&v)[32]) {
  using namespace layout;
  if constexpr (T == F32) {
    const float4* p = reinterpret_cast<const float4*>(row) + g * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float4 f = p[i];
      v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
  } else if constexpr (T == F16 || T == BF16) {
    const uint4* p = reinterpret_cast<const uint4*>(row + g * 64);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 u = p[i];
      uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (T == F16) {
          __half2 h = *reinterpret_cast<__half2*>(&w[j]);
          float2 f = __half22float2(h);
          v[8 * i + 2 * j] = f.x; v[8 * i + 2 * j + 1] = f.y;
        } else {
          v[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
          v[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
        }
      }
    }
  } else if constexpr (T == Q8_0) {
    const uint8_t* b = row + g * 36;
    float d = half_at(b + 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t w = ld4(b + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[4 * i + j] = d * static_cast<float>(static_cast<int8_t>(w >> (8 * j)));
    }
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    const uint8_t* b = row + g * 20;
    float d = half_at(b + 16);
    float m = T == Q4_1 ? half_at(b + 18) : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t w = ld4(b + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int q = (w >> (8 * j)) & 0xFF;
        if constexpr (T == Q4_0) {
          v[4 * i + j] = d * static_cast<float>((q & 0xF) - 8);
          v[4 * i + j + 16] = d * static_cast<float>((q >> 4) - 8);
        } else {
          v[4 * i + j] = d * static_cast<float>(q & 0xF) + m;
          v[4 * i + j + 16] = d * static_cast<float>(q >> 4) + m;
        }
      }
    }
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    const uint8_t* b = row + g * 24;
    uint32_t h = ld4(b + 16);
    float d = half_at(b + 20);
    float m = T == Q5_1 ? half_at(b + 22) : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t w = ld4(b + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int l = 4 * i + j;
        int q = (w >> (8 * j)) & 0xFF;
        int lo = (q & 0xF) | (((h >> l) & 1) << 4);
        int hi = (q >> 4) | (((h >> (l + 16)) & 1) << 4);
        if constexpr (T == Q5_0) {
          v[l] = d * static_cast<float>(lo - 16);
          v[l + 16] = d * static_cast<float>(hi - 16);
        } else {
          v[l] = d * static_cast<float>(lo) + m;
          v[l + 16] = d * static_cast<float>(hi) + m;
        }
      }
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr int BB = T == Q4_K ? 144 : 176;
    const uint8_t* b = row + (g >> 3) * BB;
    const int s = g & 7, c = s >> 1, shift = 4 * (s & 1);
    float d = half_at(b), dmin = half_at(b + 2);
    int sc, mn;
    k_scale_min(b + 4, s, sc, mn);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
    uint32_t w[8];
    ld32(b + (T == Q4_K ? 16 : 48) + 32 * c, w);
    if constexpr (T == Q4_K) {
#pragma unroll
      for (int l = 0; l < 32; ++l) v[l] = d1 * static_cast<float>((byte_of(w, l) >> shift) & 0xF) - m1;
    } else {
      uint32_t hw[8];
      ld32(b + 16, hw);
      const int hb = 2 * c + (s & 1);
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        int q = ((byte_of(w, l) >> shift) & 0xF) | (((byte_of(hw, l) >> hb) & 1) << 4);
        v[l] = d1 * static_cast<float>(q) - m1;
      }
    }
  } else if constexpr (T == Q6_K) {
    const uint8_t* b = row + (g >> 3) * 224;
    const int q8 = g & 7, n = q8 >> 2, k = q8 & 3;
    const float d = half_at(b + 208);
    const int8_t* S = reinterpret_cast<const int8_t*>(b + 192 + 8 * n);
    const float s0 = d * static_cast<float>(S[2 * k]), s1 = d * static_cast<float>(S[2 * k + 1]);
    uint32_t lw[8], hw[8];
    ld32(b + 64 * n + 32 * (k & 1), lw);
    ld32(b + 128 + 32 * n, hw);
    const int lshift = (k >> 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      int q = ((byte_of(lw, l) >> lshift) & 0xF) | (((byte_of(hw, l) >> (2 * k)) & 3) << 4);
      v[l] = (l < 16 ? s0 : s1) * static_cast<float>(q - 32);
    }
  } else if constexpr (T == Q3_K) {
    const uint8_t* b = row + (g >> 3) * 112;
    const int q8 = g & 7, n = q8 >> 2, j = q8 & 3;
    const float d = half_at(b + 108);
    const uint8_t* sb = b + 96;
    float scl[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int i = 8 * n + 2 * j + half;
      int low4 = i < 8 ? (sb[i] & 0xF) : (sb[i - 8] >> 4);
      int hi2 = (sb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
      scl[half] = d * static_cast<float>((low4 | (hi2 << 4)) - 32);
    }
    uint32_t qw[8], hm[8];
    ld32(b + 32 + 32 * n, qw);
    ld32(b, hm);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      int low = (byte_of(qw, l) >> (2 * j)) & 3;
      int hb = (byte_of(hm, l) >> (4 * n + j)) & 1;
      v[l] = scl[l >> 4] * static_cast<float>(low - (hb ? 0 : 4));
    }
  } else if constexpr (T == Q2_K) {
    const uint8_t* b = row + (g >> 3) * 96;
    const int q8 = g & 7, n = q8 >> 2, j = q8 & 3;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    float dl[2], ml[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int sc = b[64 + 8 * n + 2 * j + half];
      dl[half] = d * static_cast<float>(sc & 0xF);
      ml[half] = dmin * static_cast<float>(sc >> 4);
    }
    uint32_t qw[8];
    ld32(b + 32 * n, qw);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = dl[l >> 4] * static_cast<float>((byte_of(qw, l) >> (2 * j)) & 3) - ml[l >> 4];
  }
}

// A row of n_groups groups of 32, dequantized by the block's threads (the embedding lookup).
template <uint32_t T>
__device__ __forceinline__ void embed_t(const uint8_t* row, int n_groups, float* out) {
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
    float v[32];
    dequant32<T>(row, g, v);
#pragma unroll
    for (int i = 0; i < 32; ++i) out[g * 32 + i] = v[i];
  }
}

// Expands to a switch that calls FN<T>(args...) for the device type tag T of runtime type `t`.
#define MOE_DISPATCH_TYPE(t, FN, ...)                                  \
  switch (t) {                                                         \
    case ::moe::cuda::layout::F32: FN<::moe::cuda::layout::F32>(__VA_ARGS__); break;   \
    case ::moe::cuda::layout::F16: FN<::moe::cuda::layout::F16>(__VA_ARGS__); break;   \
    case ::moe::cuda::layout::BF16: FN<::moe::cuda::layout::BF16>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q4_0: FN<::moe::cuda::layout::Q4_0>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q4_1: FN<::moe::cuda::layout::Q4_1>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q5_0: FN<::moe::cuda::layout::Q5_0>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q5_1: FN<::moe::cuda::layout::Q5_1>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q8_0: FN<::moe::cuda::layout::Q8_0>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q2_K: FN<::moe::cuda::layout::Q2_K>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q3_K: FN<::moe::cuda::layout::Q3_K>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q4_K: FN<::moe::cuda::layout::Q4_K>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q5_K: FN<::moe::cuda::layout::Q5_K>(__VA_ARGS__); break; \
    case ::moe::cuda::layout::Q6_K: FN<::moe::cuda::layout::Q6_K>(__VA_ARGS__); break; \
    default: break;                                                    \
  }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace moe::cuda::dev
