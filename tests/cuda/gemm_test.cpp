// The integer prefill GEMM (kernels/gemm_kq.cu, igemm_kernel) for Q4_K, Q5_K and Q6_K.
//
// GemmEmulation: a CPU model of one warp, run without a GPU. The per-lane helpers of kernels/mma.cuh
// (activation scales and digits, code extraction, the magic-constant conversions, the shared-memory
// layout) are the kernel's own; ldmatrix and the three MMA shapes are modelled here from the PTX
// fragment tables, and a stage is walked as stage_kq / stage_q6k walk it. One m16 x n8 tile (rows
// 16..31 of a stage, tokens 8..15 of a 16-token item) over two or eight super-blocks is compared
// with the dequantized product, so fragment or layout mistakes show up as O(1) errors before a
// device run, and the accuracy (worst and rms error as fractions of the kernel tests' bound) is
// printed per type and activation distribution (Gaussian, silu(g) * u, 100x outliers).
//
// CudaGemm: the shapes the kernel tests (kernels_test.cpp) do not reach: the wide dense tile with
// several items per block, accumulation and a row tail; grouped experts with 0, 1 and more than a
// tile of tokens, every integer type as gate/up and as down; Gaussian and heavy-tailed activations,
// with the worst error printed and asked to stay below a quarter of the bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu.hpp"
#include "mma.cuh"
#include "moe/cuda.hpp"
#include "moe/gguf.hpp"
#include "moe/quant.hpp"

namespace {

using moe::gguf::Type;
using namespace moe::cuda::dev;
using namespace moe::cuda::dev::i8;

uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
float half_of(uint32_t w, int hi) { return moe::quant::fp16_to_f32(static_cast<uint16_t>(w >> (16 * hi))); }

// ---- PTX models --------------------------------------------------------------------------------
using Regs4 = uint32_t[32][4];

// ldmatrix.sync.aligned.m8n8.x4.b16: lane 8m + r gives the address of row r of matrix m; lane
// (g, t) receives, for each matrix m, the two b16 elements 2t, 2t+1 (bytes 4t..4t+3) of row g.
void ldsm_x4(const uint8_t* base, const int (&row_off)[32], Regs4& out) {
  for (int lane = 0; lane < 32; ++lane)
    for (int m = 0; m < 4; ++m) out[lane][m] = ld32(base + row_off[8 * m + lane / 4] + 4 * (lane % 4));
}

// m16n8k32 .u8 x .s8 -> .s32 (row.col): A: a0 row g k 4t..4t+3, a1 row g+8, a2 row g k 16+4t.., a3
// row g+8 k 16+4t..; B: b0 k 4t.. of column g, b1 k 16+4t..; D: d0 (g, 2t), d1 (g, 2t+1), d2 (g+8,
// 2t), d3 (g+8, 2t+1). C is one value for every element; int32 arithmetic wraps.
void mma_k32(const Regs4& A, const uint32_t (&B)[32][2], uint32_t c, Regs4& D) {
  int a[16][32], b[32][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      a[g][4 * t + i] = static_cast<int>(byte_u(A[lane][0], i));
      a[g + 8][4 * t + i] = static_cast<int>(byte_u(A[lane][1], i));
      a[g][16 + 4 * t + i] = static_cast<int>(byte_u(A[lane][2], i));
      a[g + 8][16 + 4 * t + i] = static_cast<int>(byte_u(A[lane][3], i));
      b[4 * t + i][g] = byte_s(B[lane][0], i);
      b[16 + 4 * t + i][g] = byte_s(B[lane][1], i);
    }
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      const int row = lane / 4 + 8 * (e >> 1), col = 2 * (lane % 4) + (e & 1);
      int64_t s = 0;
      for (int k = 0; k < 32; ++k) s += a[row][k] * b[k][col];
      D[lane][e] = c + static_cast<uint32_t>(s);
    }
}

// m16n8k16 .s8 x .s8 -> .s32: A: a0 row g k 4t..4t+3, a1 row g+8; B: b0 k 4t.. of column g.
void mma_k16(const uint32_t (&A)[32][2], const uint32_t (&B)[32], uint32_t c, Regs4& D) {
  int a[16][16], b[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      a[g][4 * t + i] = byte_s(A[lane][0], i);
      a[g + 8][4 * t + i] = byte_s(A[lane][1], i);
      b[4 * t + i][g] = byte_s(B[lane], i);
    }
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      const int row = lane / 4 + 8 * (e >> 1), col = 2 * (lane % 4) + (e & 1);
      int64_t s = 0;
      for (int k = 0; k < 16; ++k) s += a[row][k] * b[k][col];
      D[lane][e] = c + static_cast<uint32_t>(s);
    }
}

// m16n8k8 .tf32 -> .f32: A: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); B: b0 (t, g), b1
// (t+4, g); operands truncated to tf32; d = A B + d (summed exactly, rounded once: the hardware
// truncates, a difference of ulps that the comparisons allow for).
void mma_tf32(const Regs4& A, const uint32_t (&B)[32][2], float (&D)[32][4]) {
  double a[16][8], b[8][8];
  auto tf = [](uint32_t u) { return static_cast<double>(u2f(u & 0xffffe000u)); };
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    a[g][t] = tf(A[lane][0]);
    a[g + 8][t] = tf(A[lane][1]);
    a[g][t + 4] = tf(A[lane][2]);
    a[g + 8][t + 4] = tf(A[lane][3]);
    b[t][g] = tf(B[lane][0]);
    b[t + 4][g] = tf(B[lane][1]);
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      const int row = lane / 4 + 8 * (e >> 1), col = 2 * (lane % 4) + (e & 1);
      double s = D[lane][e];
      for (int k = 0; k < 8; ++k) s += a[row][k] * b[k][col];
      D[lane][e] = static_cast<float>(s);
    }
}

// ---- the modelled warp --------------------------------------------------------------------------
constexpr int kBN = 16, kTSP = kBN + 2;   // tokens of the item; slice-scale row pitch (as ISmem::TSP)
constexpr int kVr0 = 16, kStageRows = 48;  // the tile's first virtual row; rows in the stage
constexpr int kN8 = 1;                     // the tile's n8 index: tokens 8..15

struct TypeGeo {
  int bb, pitch;
};
TypeGeo geo(Type t) {
  switch (t) {
    case Type::Q4_K: return {144, 144};
    case Type::Q5_K: return {176, 176};
    default: return {224, 240};
  }
}

// The activations of one stage as quant_x leaves them (all 32 lanes of the staging warp of each token).
struct Act {
  std::vector<uint32_t> bq = std::vector<uint32_t>(kBN * 32 * 4);  // digits a, b
  std::vector<uint32_t> bc = std::vector<uint32_t>(kBN * 32 * 2);  // digit c
  std::vector<float> ts = std::vector<float>(8 * kTSP);
  std::vector<float> xs = std::vector<float>(kBN * 16);  // slice sums hi, mid
  std::vector<float> xs2 = std::vector<float>(kBN * 8);  // lo
};

Act quantize_stage(const std::vector<float>& X, int cols, int kt) {
  Act act;
  for (int n = 0; n < kBN; ++n) {
    float x[32][8];
    uint32_t mb[32];
    int sum[32];
    for (int lane = 0; lane < 32; ++lane) {
      const int j = lane >> 2, t = lane & 3;
      for (int e = 0; e < 8; ++e) x[lane][e] = X[n * cols + kt * 256 + 32 * j + 4 * t + (e & 3) + 16 * (e >> 2)];
      mb[lane] = 0;
      for (int e = 0; e < 8; ++e) mb[lane] = std::max(mb[lane], abs_bits(x[lane][e]));
    }
    for (int o : {1, 2}) {  // __shfl_xor_sync butterfly
      uint32_t m2[32];
      for (int lane = 0; lane < 32; ++lane) m2[lane] = std::max(mb[lane], mb[lane ^ o]);
      std::memcpy(mb, m2, sizeof mb);
    }
    Digits q[32];
    Scale sc[32];
    for (int lane = 0; lane < 32; ++lane) {
      sc[lane] = slice_scale(mb[lane]);
      q[lane] = quant8(x[lane], sc[lane].inv);
      sum[lane] = q[lane].sum;
    }
    for (int o : {1, 2}) {
      int s2[32];
      for (int lane = 0; lane < 32; ++lane) s2[lane] = sum[lane] + sum[lane ^ o];
      std::memcpy(sum, s2, sizeof sum);
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int j = lane >> 2, t = lane & 3;
      uint32_t* dst = &act.bq[4 * bq_index(n, j, t)];
      dst[0] = q[lane].a0, dst[1] = q[lane].a1, dst[2] = q[lane].b0, dst[3] = q[lane].b1;
      act.bc[2 * bc_index(n, j, t)] = q[lane].c0;
      act.bc[2 * bc_index(n, j, t) + 1] = q[lane].c1;
      if (t == 0) {
        act.ts[j * kTSP + n] = sc[lane].ts;
        uint32_t hi, mid, lo;
        split3_tf32(mul_rn(static_cast<float>(sum[lane]), sc[lane].ts), hi, mid, lo);
        act.xs[16 * n + xs_word(j, 0)] = u2f(hi);
        act.xs[16 * n + xs_word(j, 1)] = u2f(mid);
        act.xs2[8 * n + xs2_word(j)] = u2f(lo);
      }
    }
  }
  return act;
}

// q6k_walk for the modelled tile: f(n_, k, hi, j, ql, qh) per 32-column group of a Q6_K stage.
template <class Ldsm, class F>
void q6k_walk_model(Ldsm&& ldsm, F&& f) {
  for (int n_ = 0; n_ < 2; ++n_) {
    Regs4 qh;
    ldsm(128 + 32 * n_, qh);
    for (int kk = 0; kk < 2; ++kk) {
      Regs4 ql;
      ldsm(64 * n_ + 32 * kk, ql);
      for (int hi = 0; hi < 2; ++hi) f(n_, kk + 2 * hi, hi, 4 * n_ + kk + 2 * hi, ql, qh);
    }
  }
}

// stage_kq / stage_q6k for the modelled tile; acc[lane][e] as in the kernel.
void stage(Type type, const std::vector<uint8_t>& W, const Act& act, float (&acc)[32][4]) {
  const TypeGeo tg = geo(type);
  int lrow[32];  // byte offset of each lane's ldmatrix row
  for (int lane = 0; lane < 32; ++lane) lrow[lane] = (kVr0 + ldsm_row(lane)) * tg.pitch + ldsm_byte(lane);
  auto ldsm = [&](int add, Regs4& out) {
    int off[32];
    for (int lane = 0; lane < 32; ++lane) off[lane] = lrow[lane] + add;
    ldsm_x4(W.data(), off, out);
  };
  auto hdr = [&](int lane, int h, int at) { return W.data() + (kVr0 + lane / 4 + 8 * h) * tg.pitch + at; };
  auto bq = [&](int lane, int j) { return &act.bq[4 * bq_index(8 * kN8 + lane / 4, j, lane % 4)]; };
  auto bc = [&](int lane, int j) { return &act.bc[2 * bc_index(8 * kN8 + lane / 4, j, lane % 4)]; };
  auto ts = [&](int lane, int j, int e) { return act.ts[j * kTSP + 8 * kN8 + 2 * (lane % 4) + (e & 1)]; };
  // one output's digit MMA results -> scaled slice value (ActView::scales + digit_value)
  auto value = [&](uint32_t da, uint32_t db, uint32_t dc, int lane, int j, int e) {
    const float s = ts(lane, j, e);
    return digit_value(da, db, dc, s, digit_offset(s));
  };

  if (type == Type::Q4_K || type == Type::Q5_K) {
    uint32_t scw[32][2][2], mn[32][2][2];
    float dd[32][2], nd[32][2], dmin[32][2];
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* p = hdr(lane, h, 0);
        kq_scales(ld32(p + 4), ld32(p + 8), ld32(p + 12), scw[lane][h], mn[lane][h]);
        dd[lane][h] = half_of(ld32(p), 0);
        dmin[lane][h] = half_of(ld32(p), 1);
        nd[lane][h] = -dd[lane][h] * kMagic;
      }
    Regs4 qh = {};
    if (type == Type::Q5_K) ldsm(16, qh);
    const int qs = type == Type::Q4_K ? 16 : 48;
    for (int c = 0; c < 4; ++c) {
      Regs4 qw;
      ldsm(qs + 32 * c, qw);
      for (int hi = 0; hi < 2; ++hi) {
        const int j = 2 * c + hi;
        Regs4 A;
        uint32_t ba[32][2], bb[32][2], bcc[32][2];
        float rs[32][2];
        for (int lane = 0; lane < 32; ++lane) {
          for (int r = 0; r < 4; ++r)
            A[lane][r] = type == Type::Q4_K ? q4k_codes(qw[lane][r], hi) : q5k_codes(qw[lane][r], qh[lane][r], j, hi);
          for (int h = 0; h < 2; ++h)
            rs[lane][h] = scaled_int(dd[lane][h], kMagicBits + byte_u(scw[lane][h][j >> 2], j & 3), nd[lane][h]);
          const uint32_t* b = bq(lane, j);
          const uint32_t* c2 = bc(lane, j);
          ba[lane][0] = b[0], ba[lane][1] = b[1], bb[lane][0] = b[2], bb[lane][1] = b[3];
          bcc[lane][0] = c2[0], bcc[lane][1] = c2[1];
        }
        Regs4 da, db, dc;
        mma_k32(A, ba, kMagicA, da);
        mma_k32(A, bb, kMagicB, db);
        mma_k32(A, bcc, kMagicC, dc);
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e)
            acc[lane][e] =
                fma_rn(rs[lane][e >> 1], value(da[lane][e], db[lane][e], dc[lane][e], lane, j, e), acc[lane][e]);
      }
    }
    Regs4 am;
    uint32_t xh[32][2], xm[32][2], xl[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int t = lane % 4;
      am[lane][0] = f2u(small_u2f(byte_u(mn[lane][0][0], t)));
      am[lane][1] = f2u(small_u2f(byte_u(mn[lane][1][0], t)));
      am[lane][2] = f2u(small_u2f(byte_u(mn[lane][0][1], t)));
      am[lane][3] = f2u(small_u2f(byte_u(mn[lane][1][1], t)));
      const float* x = &act.xs[4 * xs_index(8 * kN8 + lane / 4, t)];
      const float* x2 = &act.xs2[2 * xs_index(8 * kN8 + lane / 4, t)];
      xh[lane][0] = f2u(x[0]), xh[lane][1] = f2u(x[1]), xm[lane][0] = f2u(x[2]), xm[lane][1] = f2u(x[3]);
      xl[lane][0] = f2u(x2[0]), xl[lane][1] = f2u(x2[1]);
    }
    float D[32][4] = {};
    mma_tf32(am, xl, D);
    mma_tf32(am, xm, D);
    mma_tf32(am, xh, D);
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) acc[lane][e] = fma_rn(-dmin[lane][e >> 1], D[lane][e], acc[lane][e]);
  } else {  // Q6_K
    uint32_t scv[32][2][4];
    float dd[32][2], nd[32][2];
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        for (int w = 0; w < 4; ++w) scv[lane][h][w] = ld32(hdr(lane, h, 192 + 4 * w));
        dd[lane][h] = half_of(ld32(hdr(lane, h, 208)), 0);
        nd[lane][h] = -dd[lane][h] * kMagic;
      }
    q6k_walk_model(ldsm, [&](int n_, int k, int hi, int j, const Regs4& ql, const Regs4& qh) {
          uint32_t a0[32][2], a1[32][2], ba0[32], bb0[32], bc0[32], ba1[32], bb1[32], bc1[32];
          float rs[32][2][2];
          for (int lane = 0; lane < 32; ++lane) {
            uint32_t A[4];
            for (int r = 0; r < 4; ++r) A[r] = q6k_codes(ql[lane][r], qh[lane][r], k, hi);
            a0[lane][0] = A[0], a0[lane][1] = A[1], a1[lane][0] = A[2], a1[lane][1] = A[3];
            for (int h = 0; h < 2; ++h)
              for (int f = 0; f < 2; ++f) {
                const int si = 8 * n_ + 2 * k + f;
                rs[lane][h][f] = scaled_int(dd[lane][h], kMagicBits + static_cast<uint32_t>(byte_s(scv[lane][h][si >> 2], si & 3)),
                                            nd[lane][h]);
              }
            const uint32_t* b = bq(lane, j);
            const uint32_t* c2 = bc(lane, j);
            ba0[lane] = b[0], ba1[lane] = b[1], bb0[lane] = b[2], bb1[lane] = b[3], bc0[lane] = c2[0], bc1[lane] = c2[1];
          }
          Regs4 da0, db0, dc0, da1, db1, dc1;
          mma_k16(a0, ba0, kMagicA, da0);
          mma_k16(a0, bb0, kMagicB, db0);
          mma_k16(a0, bc0, kMagicC, dc0);
          mma_k16(a1, ba1, kMagicA, da1);
          mma_k16(a1, bb1, kMagicB, db1);
          mma_k16(a1, bc1, kMagicC, dc1);
          for (int lane = 0; lane < 32; ++lane)
            for (int e = 0; e < 4; ++e) {
              const float v0 = fma_rn(rs[lane][e >> 1][0], value(da0[lane][e], db0[lane][e], dc0[lane][e], lane, j, e), acc[lane][e]);
              acc[lane][e] = fma_rn(rs[lane][e >> 1][1], value(da1[lane][e], db1[lane][e], dc1[lane][e], lane, j, e), v0);
            }
    });
  }
}

// ---- the fp16 path (stage_kq_h, quant_x_h) ---------------------------------------------------------
float h2f(uint32_t w, int k) { return moe::quant::fp16_to_f32(static_cast<uint16_t>(w >> (16 * k))); }
uint32_t pack_h2(float a, float b) {
  return moe::quant::f32_to_fp16(a) | static_cast<uint32_t>(moe::quant::f32_to_fp16(b)) << 16;
}
// fma.rn.f16x2 / mul / sub: exact in double, one rounding to fp16 (through float, exact for the
// values here: they are checked to be small integers or powers of two times them).
uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const double v = static_cast<double>(h2f(a, k)) * h2f(b, k) + h2f(c, k);
    r |= static_cast<uint32_t>(moe::quant::f32_to_fp16(static_cast<float>(v))) << (16 * k);
  }
  return r;
}
uint32_t hmul2(uint32_t a, uint32_t b) { return hfma2(a, b, 0u); }
uint32_t hsub2(uint32_t a, uint32_t b) { return hfma2(b, 0xBC00BC00u, a); }  // a + (-1) b

// m16n8k16 .f16 -> .f32 (row.col): A a0 (g, k 2t, 2t+1), a1 (g+8), a2 (g, k 2t+8, 2t+9), a3 (g+8);
// B b0 (k 2t, 2t+1 of column g), b1 (k 2t+8, 2t+9); d = A B + d (exact sum, one rounding).
void mma_f16(const Regs4& A, const uint32_t (&B)[32][2], float (&D)[32][4]) {
  double a[16][16], b[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int k = 0; k < 2; ++k) {
      a[g][2 * t + k] = h2f(A[lane][0], k);
      a[g + 8][2 * t + k] = h2f(A[lane][1], k);
      a[g][2 * t + 8 + k] = h2f(A[lane][2], k);
      a[g + 8][2 * t + 8 + k] = h2f(A[lane][3], k);
      b[2 * t + k][g] = h2f(B[lane][0], k);
      b[2 * t + 8 + k][g] = h2f(B[lane][1], k);
    }
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      const int row = lane / 4 + 8 * (e >> 1), col = 2 * (lane % 4) + (e & 1);
      double s = D[lane][e];
      for (int k = 0; k < 16; ++k) s += a[row][k] * b[k][col];
      D[lane][e] = static_cast<float>(s);
    }
}

// One stage's activations as quant_x_h leaves them.
struct ActH {
  std::vector<uint32_t> bh = std::vector<uint32_t>(kBN * h16::kPitch4 * 4);  // records kPitch4 apart
  std::vector<float> tinv = std::vector<float>(kBN);
  std::vector<float> xs = std::vector<float>(kBN * 16);
  std::vector<float> xs2 = std::vector<float>(kBN * 8);
};

ActH quantize_stage_h(const std::vector<float>& X, int cols, int kt) {
  ActH act;
  for (int n = 0; n < kBN; ++n) {
    float x[32][8], sum[32];
    uint32_t mb = 0;
    for (int lane = 0; lane < 32; ++lane) {
      const int j = lane >> 2, t = lane & 3;
      for (int e = 0; e < 8; ++e) {
        x[lane][e] = X[n * cols + kt * 256 + 32 * j + 4 * t + (e & 3) + 16 * (e >> 2)];
        mb = std::max(mb, abs_bits(x[lane][e]));
      }
    }
    const h16::TokScale f = h16::token_scale(mb);
    for (int lane = 0; lane < 32; ++lane) {
      const int j = lane >> 2, t = lane & 3;
      sum[lane] = 0.f;
      for (int st = 0; st < 2; ++st) {
        float y[4];
        for (int e = 0; e < 4; ++e) y[e] = mul_rn(x[lane][4 * st + e], f.f);
        const uint32_t h0 = pack_h2(y[0], y[2]), h1 = pack_h2(y[1], y[3]);
        const uint32_t l0 = pack_h2(y[0] - h2f(h0, 0), y[2] - h2f(h0, 1));
        const uint32_t l1 = pack_h2(y[1] - h2f(h1, 0), y[3] - h2f(h1, 1));
        sum[lane] += (h2f(h0, 0) + h2f(l0, 0)) + (h2f(h1, 0) + h2f(l1, 0));
        sum[lane] += (h2f(h0, 1) + h2f(l0, 1)) + (h2f(h1, 1) + h2f(l1, 1));
        uint32_t* dst = &act.bh[4 * h16::bh_index(n, st, j, t)];
        dst[0] = h0, dst[1] = h1, dst[2] = l0, dst[3] = l1;
      }
    }
    for (int o : {1, 2}) {
      float s2[32];
      for (int lane = 0; lane < 32; ++lane) s2[lane] = sum[lane] + sum[lane ^ o];
      std::memcpy(sum, s2, sizeof sum);
    }
    for (int j = 0; j < 8; ++j) {
      uint32_t hi, mid, lo;
      split3_tf32(sum[4 * j], hi, mid, lo);
      act.xs[16 * n + xs_word(j, 0)] = u2f(hi);
      act.xs[16 * n + xs_word(j, 1)] = u2f(mid);
      act.xs2[8 * n + xs2_word(j)] = u2f(lo);
    }
    act.tinv[n] = f.inv;
  }
  return act;
}

// stage_kq_h (Q4_K, Q5_K) and stage_q6k_h for the modelled tile.
void stage_h(Type type, const std::vector<uint8_t>& W, const ActH& act, float (&acc)[32][4]) {
  const TypeGeo tg = geo(type);
  int lrow[32];
  for (int lane = 0; lane < 32; ++lane) lrow[lane] = (kVr0 + ldsm_row(lane)) * tg.pitch + ldsm_byte(lane);
  auto ldsm = [&](int add, Regs4& out) {
    int off[32];
    for (int lane = 0; lane < 32; ++lane) off[lane] = lrow[lane] + add;
    ldsm_x4(W.data(), off, out);
  };
  auto hdr = [&](int lane, int h) { return W.data() + (kVr0 + lane / 4 + 8 * h) * tg.pitch; };
  auto tinv = [&](int lane, int e) { return act.tinv[8 * kN8 + 2 * (lane % 4) + (e & 1)]; };
  if (type == Type::Q6_K) {
    uint32_t scv[32][2][4];
    float dd[32][2], Ds[32][4] = {};
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        for (int w = 0; w < 4; ++w) scv[lane][h][w] = ld32(hdr(lane, h) + 192 + 4 * w);
        dd[lane][h] = half_of(ld32(hdr(lane, h) + 208), 0);
      }
    q6k_walk_model(ldsm, [&](int n_, int k, int hi, int j, const Regs4& ql, const Regs4& qh) {
          for (int st = 0; st < 2; ++st) {
            Regs4 A;
            uint32_t bhi[32][2], blo[32][2];
            float sc[32][2];
            for (int lane = 0; lane < 32; ++lane) {
              uint32_t w[2];
              for (int h = 0; h < 2; ++h) {
                w[h] = ((ql[lane][2 * st + h] >> (4 * hi)) & 0x0F0F0F0Fu) | (((qh[lane][2 * st + h] >> (2 * k)) & 0x03030303u) << 4);
                const int si = 8 * n_ + 2 * k + st;
                sc[lane][h] = static_cast<float>(byte_s(scv[lane][h][si >> 2], si & 3));
              }
              A[lane][0] = hsub2(h16::magic_pair(w[0], 0x003F003Fu), 0x64206420u);
              A[lane][1] = hsub2(h16::magic_pair(w[1], 0x003F003Fu), 0x64206420u);
              A[lane][2] = hsub2(h16::magic_pair(w[0] >> 8, 0x003F003Fu), 0x64206420u);
              A[lane][3] = hsub2(h16::magic_pair(w[1] >> 8, 0x003F003Fu), 0x64206420u);
              const uint32_t* b = &act.bh[4 * h16::bh_index(8 * kN8 + lane / 4, st, j, lane % 4)];
              bhi[lane][0] = b[0], bhi[lane][1] = b[1], blo[lane][0] = b[2], blo[lane][1] = b[3];
            }
            float D[32][4] = {};
            mma_f16(A, blo, D);
            mma_f16(A, bhi, D);
            for (int lane = 0; lane < 32; ++lane)
              for (int e = 0; e < 4; ++e) Ds[lane][e] = fma_rn(sc[lane][e >> 1], D[lane][e], Ds[lane][e]);
          }
    });
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) acc[lane][e] = fma_rn(mul_rn(dd[lane][e >> 1], Ds[lane][e]), tinv(lane, e), acc[lane][e]);
    return;
  }
  uint32_t scw[32][2][2], mn[32][2][2];
  float dd[32][2], dmin[32][2];
  for (int lane = 0; lane < 32; ++lane)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* p = hdr(lane, h);
      kq_scales(ld32(p + 4), ld32(p + 8), ld32(p + 12), scw[lane][h], mn[lane][h]);
      dd[lane][h] = half_of(ld32(p), 0);
      dmin[lane][h] = half_of(ld32(p), 1);
    }
  Regs4 qh = {};
  if (type == Type::Q5_K) ldsm(16, qh);
  const int qs = type == Type::Q4_K ? 16 : 48;
  float D[32][4] = {};
  for (int c = 0; c < 4; ++c) {
    Regs4 qw;
    ldsm(qs + 32 * c, qw);
    for (int hi = 0; hi < 2; ++hi) {
      const int j = 2 * c + hi;
      for (int st = 0; st < 2; ++st) {
        Regs4 A;
        uint32_t bhi[32][2], blo[32][2];
        for (int lane = 0; lane < 32; ++lane) {
          uint32_t sc2[2];
          for (int h = 0; h < 2; ++h) {
            const uint32_t s2 = hsub2(h16::magic_scale2(scw[lane][h][j >> 2], j & 3), 0x64006400u);
            sc2[h] = type == Type::Q4_K && hi ? hmul2(s2, 0x2C002C00u) : s2;
          }
          uint32_t w[2];
          for (int h = 0; h < 2; ++h)
            w[h] = type == Type::Q4_K ? qw[lane][2 * st + h] : q5k_codes(qw[lane][2 * st + h], qh[lane][2 * st + h], j, hi);
          const uint32_t mask = type == Type::Q4_K ? (hi ? 0x00F000F0u : 0x000F000Fu) : 0x001F001Fu;
          const uint32_t off = type == Type::Q4_K ? (hi ? 0x64806480u : 0x64086408u) : 0x64106410u;
          A[lane][0] = hmul2(hsub2(h16::magic_pair(w[0], mask), off), sc2[0]);
          A[lane][1] = hmul2(hsub2(h16::magic_pair(w[1], mask), off), sc2[1]);
          A[lane][2] = hmul2(hsub2(h16::magic_pair(w[0] >> 8, mask), off), sc2[0]);
          A[lane][3] = hmul2(hsub2(h16::magic_pair(w[1] >> 8, mask), off), sc2[1]);
          const uint32_t* b = &act.bh[4 * h16::bh_index(8 * kN8 + lane / 4, st, j, lane % 4)];
          bhi[lane][0] = b[0], bhi[lane][1] = b[1], blo[lane][0] = b[2], blo[lane][1] = b[3];
        }
        mma_f16(A, blo, D);
        mma_f16(A, bhi, D);
      }
    }
  }
  Regs4 am, as;
  uint32_t xh[32][2], xm[32][2], xl[32][2];
  for (int lane = 0; lane < 32; ++lane) {
    const int t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      am[lane][r] = f2u(small_u2f(byte_u(mn[lane][r & 1][r >> 1], t)));
      as[lane][r] = f2u(small_u2f(byte_u(scw[lane][r & 1][r >> 1], t)));
    }
    const float* x = &act.xs[4 * xs_index(8 * kN8 + lane / 4, t)];
    const float* x2 = &act.xs2[2 * xs_index(8 * kN8 + lane / 4, t)];
    xh[lane][0] = f2u(x[0]), xh[lane][1] = f2u(x[1]), xm[lane][0] = f2u(x[2]), xm[lane][1] = f2u(x[3]);
    xl[lane][0] = f2u(x2[0]), xl[lane][1] = f2u(x2[1]);
  }
  float Dm[32][4] = {}, Ds[32][4] = {};
  mma_tf32(am, xl, Dm);
  mma_tf32(am, xm, Dm);
  mma_tf32(am, xh, Dm);
  mma_tf32(as, xl, Ds);
  mma_tf32(as, xm, Ds);
  mma_tf32(as, xh, Ds);
  const float off = type == Type::Q4_K ? 8.f : 16.f;
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      const float d = dd[lane][e >> 1];
      const float v = fma_rn(d, D[lane][e], fma_rn(off * d, Ds[lane][e], mul_rn(-dmin[lane][e >> 1], Dm[lane][e])));
      acc[lane][e] = fma_rn(v, act.tinv[8 * kN8 + 2 * (lane % 4) + (e & 1)], acc[lane][e]);
    }
}

// Runs the modelled warp over cols columns; returns the tile [row 0..16)[token 0..8).
void emulate(Type type, const std::vector<uint8_t>& dev_rows, int64_t row_stride, const std::vector<float>& X, int cols,
             double (&out)[16][8], bool fp16 = false) {
  const TypeGeo tg = geo(type);
  float acc[32][4] = {};
  for (int kt = 0; kt < cols / 256; ++kt) {
    // the weight stage as issue_w leaves it: super-block kt of row r at virtual row kVr0 + r; the
    // other rows hold garbage, which the tile must not read
    std::vector<uint8_t> W(static_cast<size_t>(kStageRows) * tg.pitch, 0xA5);
    for (int r = 0; r < 16; ++r)
      std::memcpy(&W[(kVr0 + r) * tg.pitch], &dev_rows[r * row_stride + kt * tg.bb], tg.bb);
    if (fp16) stage_h(type, W, quantize_stage_h(X, cols, kt), acc);
    else stage(type, W, quantize_stage(X, cols, kt), acc);
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) out[lane / 4 + 8 * (e >> 1)][2 * (lane % 4) + (e & 1)] = acc[lane][e];
}

// ---- accuracy ------------------------------------------------------------------------------------
// Activation distributions of the accuracy checks (rows x cols, row-major):
//   Exact: integers times 2^-10 with one of magnitude kExactQ per 32-column slice: the slice scale
//     comes out as 2^-10 and the quantization holds them exactly, so only fp32 rounding is left;
//   Gauss: N(0, 1);
//   SwiGlu: silu(g) * u with g, u ~ N(0, 1): heavy tailed, like the down projection's input;
//   Outliers: N(0, 1) with 4 elements per row, at distinct random columns, 100x larger;
//   Outliers1000: the same 1000x larger (the accuracy is relative to the slice's largest element, so
//     this is the hard case: an outlier whose weight is ~0 adds little to sum |w x| and yet coarsens
//     the quantization of the other 31 elements of its slice).
enum class Dist { Exact, Gauss, SwiGlu, Outliers, Outliers1000 };
constexpr int kExactQ = 8323072 - 1024;  // kXMax - 1024: the scale rounds up to exactly 2^-10
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::Exact: return "exact";
    case Dist::Gauss: return "gaussian";
    case Dist::SwiGlu: return "silu(g)*u";
    case Dist::Outliers: return "outliers x100";
    default: return "outliers x1000";
  }
}
std::vector<float> make_x(Dist d, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> X(static_cast<size_t>(rows * cols));
  if (d == Dist::Exact) {
    std::uniform_int_distribution<int> q(-kExactQ, kExactQ);
    for (float& v : X) v = std::ldexp(static_cast<float>(q(rng)), -10);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t s = 0; s < cols / 32; ++s)
        X[n * cols + 32 * s + (n + s) % 32] = std::ldexp(static_cast<float>((s & 1) ? -kExactQ : kExactQ), -10);
  } else if (d == Dist::SwiGlu) {
    for (float& v : X) {
      const float g = nd(rng), u = nd(rng);
      v = g / (1.f + std::exp(-g)) * u;
    }
  } else {
    for (float& v : X) v = nd(rng);
    if (d == Dist::Outliers || d == Dist::Outliers1000) {
      std::uniform_int_distribution<int64_t> col(0, cols - 1);
      for (int64_t n = 0; n < rows; ++n) {
        int64_t at[4];
        for (int o = 0; o < 4; ++o) {
          do {
            at[o] = col(rng);
          } while (std::find(at, at + o, at[o]) != at + o);
          X[n * cols + at[o]] *= d == Dist::Outliers ? 100.f : 1000.f;
        }
      }
    }
  }
  return X;
}

// Errors as fractions of the kernel tests' bound (1e-5 of sum |w x| + 1e-6): worst and rms.
struct Ratio {
  double worst = 0, sq = 0;
  int64_t n = 0;
  void add(double err, double bound) {
    const double r = std::isfinite(err) ? err / bound : INFINITY;
    worst = std::max(worst, r);
    sq += r * r;
    ++n;
  }
  double rms() const { return n ? std::sqrt(sq / static_cast<double>(n)) : 0.0; }
};

// One emulated 16 x 8 tile over cols columns: Gaussian weights of the type (quantized), activations
// of distribution d. Each output must be within the bound (Exact: within 2e-6 of the scale); the
// errors are added to r.
void check_tile(Type type, Dist d, int cols, std::mt19937_64& rng, Ratio& r, bool fp16 = false) {
  const int rows = 16;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> src(rows * cols), deq(rows * cols);
  for (float& v : src) v = nd(rng);
  const size_t rb = moe::gguf::row_bytes(type, cols);
  std::vector<uint8_t> gg(rb * rows);
  for (int i = 0; i < rows; ++i) {
    moe::quant::quantize_row(type, &src[i * cols], &gg[i * rb], cols);
    moe::quant::dequantize_row(type, &gg[i * rb], &deq[i * cols], cols);
  }
  const int64_t row_stride = static_cast<int64_t>(moe::cuda::device_bytes(type, cols, 1));
  std::vector<uint8_t> dev(moe::cuda::device_bytes(type, cols, rows));
  moe::cuda::repack_rows(type, gg.data(), dev.data(), cols, rows);
  const std::vector<float> X = make_x(d, kBN, cols, rng);

  double got[16][8];
  emulate(type, dev, row_stride, X, cols, got, fp16);
  for (int i = 0; i < 16; ++i)
    for (int tk = 0; tk < 8; ++tk) {
      const float* w = &deq[i * cols];
      const float* x = &X[(8 * kN8 + tk) * cols];
      double want = 0, scale = 0;
      for (int c = 0; c < cols; ++c) {
        want += static_cast<double>(w[c]) * x[c];
        scale += std::fabs(static_cast<double>(w[c]) * x[c]);
      }
      const double tol = d == Dist::Exact ? 2e-6 * scale : 1e-5 * scale + 1e-6;
      EXPECT_NEAR(got[i][tk], want, tol) << "row " << i << " token " << tk;
      r.add(std::fabs(got[i][tk] - want), 1e-5 * scale + 1e-6);
    }
}

// Fragment or layout mistakes show up as O(1) errors; the accuracy is asked to stay below a tenth of
// the kernel tests' bound (half for 1000x outliers) on every distribution (K = 512 and 2048, 4096
// outputs per type and distribution). fp16: the fp16 path's model (stage_h) instead of the integer one.
void emulate_types(bool fp16) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (Type t : {Type::Q4_K, Type::Q5_K, Type::Q6_K})
    for (Dist d : {Dist::Exact, Dist::Gauss, Dist::SwiGlu, Dist::Outliers, Dist::Outliers1000}) {
      SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(t) << ", " << dist_name(d));
      Ratio r;
      // MOE_GEMM_EMU_TRIALS: tiles per width (16 by default; more for the tails)
      const char* env = std::getenv("MOE_GEMM_EMU_TRIALS");
      const int trials = env ? std::max(1, std::atoi(env)) : 16;
      const char* wenv = std::getenv("MOE_GEMM_EMU_COLS");
      const int w0 = wenv ? std::atoi(wenv) : 512;
      for (int cols : {w0, 2048})
        for (int it = 0; it < trials; ++it) check_tile(t, d, cols, rng, r, fp16);
      std::printf("  %-5s %-14s %s error / bound: worst %.4f, rms %.5f (%lld outputs)\n", moe::gguf::type_name(t).c_str(),
                  dist_name(d), fp16 ? "fp16" : "int8", r.worst, r.rms(), static_cast<long long>(r.n));
      EXPECT_LT(r.worst, d == Dist::Outliers1000 ? 0.5 : 0.1);
    }
}
TEST(GemmEmulation, IntegerFragmentsMatchDequantizedProduct) { emulate_types(false); }
TEST(GemmEmulation, Fp16FragmentsMatchDequantizedProduct) { emulate_types(true); }

// The fp16 path's exact steps: every centred code times every 6-bit scale through the magic pair
// (low and high nibbles, five-bit codes), and the token factors.
TEST(GemmEmulation, Fp16CodesTimesScalesExact) {
  for (uint32_t sc = 0; sc < 64; ++sc) {
    const uint32_t word = sc << 16;  // the scale in byte 2 of a scale word
    const uint32_t s2 = hsub2(h16::magic_scale2(word, 2), 0x64006400u);
    ASSERT_EQ(h2f(s2, 0), static_cast<float>(sc));
    ASSERT_EQ(h2f(s2, 1), static_cast<float>(sc));
    const float fs = static_cast<float>(sc);
    for (uint32_t q = 0; q < 32; ++q) {
      const uint32_t w = q | (q ^ 7) << 8 | (31 - q) << 16 | (q * 5 % 32) << 24;  // four codes
      const int want[4] = {static_cast<int>(q), static_cast<int>(q ^ 7), static_cast<int>(31 - q), static_cast<int>(q * 5 % 32)};
      // Q5_K: (q - 16) sc
      const uint32_t lo = hmul2(hsub2(h16::magic_pair(w, 0x001F001Fu), 0x64106410u), s2);
      const uint32_t lo8 = hmul2(hsub2(h16::magic_pair(w >> 8, 0x001F001Fu), 0x64106410u), s2);
      ASSERT_EQ(h2f(lo, 0), (want[0] - 16) * fs);
      ASSERT_EQ(h2f(lo, 1), (want[2] - 16) * fs);
      ASSERT_EQ(h2f(lo8, 0), (want[1] - 16) * fs);
      ASSERT_EQ(h2f(lo8, 1), (want[3] - 16) * fs);
      // Q4_K: (q - 8) sc from the low and from the high nibbles
      const uint32_t w4 = w & 0x0F0F0F0Fu;
      const uint32_t l4 = hmul2(hsub2(h16::magic_pair(w4, 0x000F000Fu), 0x64086408u), s2);
      const uint32_t h4 = hmul2(hsub2(h16::magic_pair(w4 << 4, 0x00F000F0u), 0x64806480u), hmul2(s2, 0x2C002C00u));
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(h2f(l4, k), ((want[2 * k] & 15) - 8) * fs);
        ASSERT_EQ(h2f(h4, k), ((want[2 * k] & 15) - 8) * fs);
      }
    }
  }
  // Q6_K: q - 32 for every 6-bit q (bytes 0 and 2, then 1 and 3)
  for (uint32_t q = 0; q < 64; ++q) {
    const uint32_t w = q | (63 - q) << 8 | (q ^ 21) << 16 | (q * 7 % 64) << 24;
    const uint32_t p0 = hsub2(h16::magic_pair(w, 0x003F003Fu), 0x64206420u);
    const uint32_t p1 = hsub2(h16::magic_pair(w >> 8, 0x003F003Fu), 0x64206420u);
    ASSERT_EQ(h2f(p0, 0), static_cast<float>(static_cast<int>(q) - 32));
    ASSERT_EQ(h2f(p0, 1), static_cast<float>(static_cast<int>(q ^ 21) - 32));
    ASSERT_EQ(h2f(p1, 0), static_cast<float>(31 - static_cast<int>(q)));
    ASSERT_EQ(h2f(p1, 1), static_cast<float>(static_cast<int>(q * 7 % 64) - 32));
  }
  for (int e = -130; e < 129; ++e) {
    const float m = e == 128 ? INFINITY : std::ldexp(1.5f, e);
    const h16::TokScale f = h16::token_scale(abs_bits(m));
    ASSERT_EQ(static_cast<double>(f.f) * f.inv, 1.0) << e;  // powers of two, inverse
    if (e >= -100 && e < 128) {
      ASSERT_GE(static_cast<double>(m) * f.f, 16384.0) << e;
      ASSERT_LT(static_cast<double>(m) * f.f, 32768.0) << e;
    } else if (e < -100) {
      ASSERT_LT(static_cast<double>(m) * f.f, 16384.0) << e;
    }
  }
}

// The bit-level helpers on their own: slice scales, digits, the exact steps of digit_value.
TEST(GemmEmulation, ActivationDigitsAndMagicConversions) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::uniform_int_distribution<int> ex(-60, 60);
  for (int it = 0; it < 20000; ++it) {
    float x[8];
    uint32_t mb = 0;
    const float mag = std::ldexp(1.f, ex(rng));
    for (float& v : x) {
      v = u(rng) * mag;
      mb = std::max(mb, abs_bits(v));
    }
    if (it % 7 == 0) x[it % 8] = u2f((f2u(x[it % 8]) & 0x80000000u) | mb);  // a tie for the max
    const Scale sc = slice_scale(mb);
    // kScaleBits significant bits, never below max|x| / kXMax
    ASSERT_EQ(f2u(sc.ts) & ((1u << (24 - kScaleBits)) - 1u), 0u) << sc.ts;
    ASSERT_GE(static_cast<double>(sc.ts) * kXMax, static_cast<double>(u2f(mb)) * (1 - 1e-7));
    ASSERT_EQ(static_cast<double>(digit_offset(sc.ts)), -static_cast<double>(sc.ts) * kMagicSum);  // exact
    const Digits q = quant8(x, sc.inv);
    const uint32_t a[2] = {q.a0, q.a1}, b[2] = {q.b0, q.b1}, c[2] = {q.c0, q.c1};
    int64_t sum = 0;
    for (int e = 0; e < 8; ++e) {
      // X as the kernel rounds it: the fma rounds to halves at worst, then ties go to even
      const int X = static_cast<int>(std::nearbyint(static_cast<double>(std::fmaf(x[e], sc.inv, kYOffset)))) - 0x8080;
      ASSERT_LE(std::fabs(X - static_cast<double>(x[e]) * sc.inv), 0.75) << x[e];
      ASSERT_LE(std::abs(X), kXMax + 2);
      const int xa = byte_s(a[e >> 2], e & 3), xb = byte_s(b[e >> 2], e & 3), xc = byte_s(c[e >> 2], e & 3);
      ASSERT_EQ(65536 * xa + 256 * xb + xc, X) << x[e];
      ASSERT_LE(std::abs(xa), 127);
      // what X stands for: x to 3/4 of a unit of s (s <= 1.04 max|x| / kXMax) and 2^-23 |x|
      ASSERT_NEAR(static_cast<double>(X) * sc.ts, x[e], 0.75 * sc.ts + std::fabs(x[e]) * 1.2e-7);
      sum += X;
    }
    ASSERT_EQ(q.sum, sum);
  }
  // Dist::Exact's slices: scale 2^-10
  EXPECT_EQ(slice_scale(f2u(std::ldexp(static_cast<float>(kExactQ), -10))).ts, std::ldexp(1.f, -10));
  // zero, tiny, infinite and NaN slices
  EXPECT_EQ(slice_scale(0u).ts, 0.f);
  EXPECT_EQ(slice_scale(0u).inv, 0.f);
  EXPECT_EQ(slice_scale(f2u(1e-30f)).ts, 0.f);
  EXPECT_TRUE(std::isnan(slice_scale(0x7F800000u).ts));
  EXPECT_TRUE(std::isnan(slice_scale(0x7FFFFFFFu).ts));
  // digit_value at the extremes of the three digit MMAs (a Q4_K/Q5_K slice: |D| <= 32 * 31 * 128;
  // the top digit |Xa| <= 127): the first fma exact, the result within 2^-23 and 0.75 ts
  for (float ts : {std::ldexp(1.f, -20), std::ldexp(63.f, -30), std::ldexp(33.f, 3)}) {
    const float k = digit_offset(ts);
    for (int da : {-125984, -62496, -1, 0, 1, 777, 62496, 125984})
      for (int db : {-126976, -5, 0, 126976})
        for (int dc : {-126976, -3, 0, 1, 126976}) {
          const float fa = u2f(kMagicA + static_cast<uint32_t>(da));
          EXPECT_EQ(static_cast<double>(fma_rn(ts, fa, k)), static_cast<double>(ts) * 65536.0 * (da - 49344.0));
          const float v = digit_value(kMagicA + static_cast<uint32_t>(da), kMagicB + static_cast<uint32_t>(db),
                                      kMagicC + static_cast<uint32_t>(dc), ts, k);
          const double want = static_cast<double>(ts) * (65536.0 * da + 256.0 * db + dc);
          EXPECT_NEAR(v, want, std::fabs(want) * 1.2e-7 + 0.75 * ts) << da << " " << db << " " << dc;
        }
  }
  // the slice sums' three-way split
  for (float v : {1.f, -3.1415926f, 12345.678f, 1e-20f, 7.77e20f}) {
    uint32_t hi, mid, lo;
    split3_tf32(v, hi, mid, lo);
    const auto tf = [](uint32_t w) { return static_cast<double>(u2f(w & 0xffffe000u)); };
    EXPECT_NEAR(tf(hi) + tf(mid) + tf(lo), v, std::fabs(v) * 1e-9);
  }
  for (int s = -128; s < 128; ++s)
    EXPECT_EQ(scaled_int(0.0123f, kMagicBits + static_cast<uint32_t>(s), -0.0123f * kMagic), 0.0123f * static_cast<float>(s));
  for (uint32_t v : {0u, 1u, 63u, 255u}) EXPECT_EQ(small_u2f(v), static_cast<float>(v));
  // Q6_K codes: q - 32 for every 6-bit q
  for (int q = 0; q < 64; ++q) {
    const uint32_t ql = static_cast<uint32_t>(q & 15) * 0x01010101u, qh = static_cast<uint32_t>(q >> 4) * 0x01010101u;
    EXPECT_EQ(byte_s(q6k_codes(ql, qh, 0, 0), 2), q - 32);
  }
}

// ---- on the device ---------------------------------------------------------------------------------
namespace k = moe::cuda::k;
using gpu_test::Dev;
using gpu_test::ok;
using gpu_test::QMatrix;

// sum w*x and sum |w*x| in one pass.
void dot2(const float* w, const float* x, int64_t n, double& s, double& a) {
  s = a = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double p = static_cast<double>(w[i]) * x[i];
    s += p;
    a += std::fabs(p);
  }
}

// Counts the misses of the kernel tests' bound (1e-5 of the scale + 1e-6), reporting the first few,
// and asks for a margin: the worst error below 0.4 of the bound (the emulation's worst is below a
// tenth; the device's tf32 minimums truncate where the model rounds: on inputs with x100 outliers the
// worst reached 0.28, Q5_K 4300x256 with 290 tokens, seed 1199700485; 0.25 failed 2 of 15 runs).
// The fp16 path asks for half the bound instead: the tensor cores add its fp32 sums with truncation
// (measured worst ~0.3 of the bound with 100x outliers, against ~0.17 on the integer path).
struct Check {
  std::string what;
  double margin;
  int64_t misses = 0;
  Ratio r;
  explicit Check(std::string w, double m = 0.4) : what(std::move(w)), margin(m) {}
  void operator()(double got, double want, double scale, int64_t i) { bound(got, want, 1e-5 * scale + 1e-6, i); }
  void bound(double got, double want, double tol, int64_t i) {
    r.add(std::fabs(got - want), tol);
    if (std::isfinite(got) && std::fabs(got - want) <= tol) return;
    if (++misses <= 5) ADD_FAILURE() << what << " index " << i << ": got " << got << ", want " << want << " (bound " << tol << ")";
  }
  ~Check() {
    std::printf("  %-40s error / bound: worst %.4f, rms %.5f (%lld outputs)\n", what.c_str(), r.worst, r.rms(),
                static_cast<long long>(r.n));
    EXPECT_EQ(misses, 0) << what;
    EXPECT_LT(r.worst, margin) << what;
  }
};

// The wide dense tile (256 rows x 32 tokens, one block per SM walking several items on a 132-SM
// H200) with a row tail, token counts that are not a multiple of 8, one super-block (the pipeline
// then crosses an item every stage) and two, and accumulation into a strided output; Gaussian and
// heavy-tailed activations.
TEST(CudaGemm, IntegerDenseWideTilesAccumulate) {
  REQUIRE_GPU();
  const uint64_t seed = gpu_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t rows, cols, ntok;
  };
  // the wide tile for the first two and the last, the small one (64 rows x 32 tokens, two blocks per
  // SM) for the third (too few items for the wide one); each with and without the split input
  for (const Case c : {Case{2600, 512, 300}, Case{4300, 256, 290}, Case{700, 512, 40}, Case{30000, 256, 20}})
    for (Type t : {Type::Q4_K, Type::Q5_K, Type::Q6_K}) {
      const std::string name = std::string(moe::gguf::type_name(t)) + " " + std::to_string(c.rows) + "x" +
                               std::to_string(c.cols) + ", " + std::to_string(c.ntok) + " tokens";
      SCOPED_TRACE(name);
      QMatrix W(t, c.rows, c.cols, rng);
      for (Dist d : {Dist::Gauss, Dist::SwiGlu, Dist::Outliers})
      for (bool split : {false, true}) {
        if (split && !k::split_h16_wanted(W.mat())) continue;
        const std::vector<float> X = make_x(d, c.ntok, c.cols, rng);
        const int y_stride = static_cast<int>(c.rows) + 5;
        const std::vector<float> Y0 = gpu_test::randn(c.ntok * y_stride, rng);
        Dev<float> dX(X), dY(Y0);
        Dev<uint8_t> dXh(split ? k::split_h16_bytes(static_cast<int>(c.ntok), static_cast<int>(c.cols)) : 1);
        if (split) ok(k::split_h16(dX.p, static_cast<int>(c.cols), static_cast<int>(c.ntok), static_cast<int>(c.cols), dXh.p, nullptr));
        ok(k::gemm(W.mat(), dX.p, static_cast<int>(c.cols), static_cast<int>(c.ntok), dY.p, y_stride, true, nullptr,
                   split ? dXh.p : nullptr));
        ok(cudaDeviceSynchronize());
        const std::vector<float> Y = dY.get();
        Check check(std::string(split ? "fp16 " : "") + "dense " + name + ", " + dist_name(d), split ? 0.5 : 0.4);
        std::vector<double> ref_s(c.ntok * c.rows), ref_a(c.ntok * c.rows);  // the twin's dots, on every core
        gpu_test::parallel_for(c.ntok * c.rows, [&](int64_t j) {
          dot2(&W.deq[(j % c.rows) * c.cols], &X[(j / c.rows) * c.cols], c.cols, ref_s[j], ref_a[j]);
        });
        for (int64_t tk = 0; tk < c.ntok; ++tk) {
          for (int64_t r = 0; r < c.rows; ++r) {
            const double s = ref_s[tk * c.rows + r], a = ref_a[tk * c.rows + r];
            const size_t i = tk * y_stride + r;
            check(Y[i], Y0[i] + s, a + std::fabs(Y0[i]), static_cast<int64_t>(i));
          }
          for (int64_t r = c.rows; r < y_stride; ++r) EXPECT_EQ(Y[tk * y_stride + r], Y0[tk * y_stride + r]) << "wrote past the rows";
        }
      }
    }
}

// Grouped experts with uneven loads: expert 0 gets no token, expert 1 one, expert 2 seventy (three
// token tiles), the others a few each, over 40 experts (~80 items per product: on an H200 each block
// takes at most one; GroupedDynamicWalkSameBitsAsStatic has blocks walk several). Gate/up and down are
// each checked on their own: down against the device's act (silu(g) * u: heavy tailed).
TEST(CudaGemm, IntegerGroupedExpertsUnevenCounts) {
  REQUIRE_GPU();
  const uint64_t seed = gpu_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 512, F = 256, X = 40, K = 2, T = 150;
  std::vector<int32_t> ids(T * K);
  std::uniform_int_distribution<int> pick(3, X - 1);
  for (int t = 0; t < T; ++t) {
    ids[t * K] = t < 70 ? 2 : pick(rng);
    if (t == 70) {
      ids[t * K + 1] = 1;
    } else {
      do {
        ids[t * K + 1] = pick(rng);
      } while (ids[t * K + 1] == ids[t * K]);
    }
  }
  struct Types {
    Type gate_up, down;
  };
  for (const Types ty : {Types{Type::Q4_K, Type::Q6_K}, Types{Type::Q5_K, Type::Q4_K}, Types{Type::Q6_K, Type::Q5_K}})
    for (Dist d : {Dist::Gauss, Dist::Outliers})
    for (bool split : {false, true}) {
      const std::string name = std::string(split ? "fp16 " : "") + "gate/up " + moe::gguf::type_name(ty.gate_up) +
                               ", down " + moe::gguf::type_name(ty.down) + ", " + dist_name(d);
      SCOPED_TRACE(name);
      QMatrix G(ty.gate_up, X * F, E, rng), U(ty.gate_up, X * F, E, rng), D(ty.down, X * E, F, rng);
      const std::vector<float> h = make_x(d, T, E, rng);
      Dev<float> dh(h), act(T * K * F), dout(T * K * E);
      Dev<int32_t> di(ids), tos(T * K), slot(T * K);
      Dev<int> count(X), offset(X);
      // the split inputs (fp16 path) where the type takes them
      const bool split_gu = split && k::split_h16_wanted(G.mat(F)), split_dn = split && k::split_h16_wanted(D.mat(E));
      Dev<uint8_t> hh(split_gu ? k::split_h16_bytes(T, E) : 1), acth(split_dn ? k::split_h16_bytes(T * K, F) : 1);
      ok(k::group_by_expert(di.p, T, K, X, count.p, offset.p, tos.p, slot.p, nullptr));
      if (split_gu) ok(k::split_h16(dh.p, E, T, E, hh.p, nullptr));
      ok(k::expert_gate_up_grouped(G.mat(F), U.mat(F), dh.p, E, count.p, offset.p, tos.p, X, T, act.p, nullptr,
                                   split_gu ? hh.p : nullptr));
      if (split_dn) ok(k::split_h16(act.p, F, T * K, F, acth.p, nullptr));
      ok(k::expert_down_grouped(D.mat(E), act.p, count.p, offset.p, X, T, dout.p, nullptr, split_dn ? acth.p : nullptr));
      ok(cudaDeviceSynchronize());
      const std::vector<int> cnt = count.get(), off = offset.get();
      const std::vector<int32_t> token = tos.get();
      const std::vector<float> a = act.get(), y = dout.get();
      EXPECT_EQ(cnt[0], 0);
      EXPECT_EQ(cnt[1], 1);
      EXPECT_EQ(cnt[2], 70);
      Check check_act("gate/up " + name, split_gu ? 0.5 : 0.4), check_down("down " + name, split_dn ? 0.5 : 0.4);
      for (int e = 0; e < X; ++e)
        for (int sl = off[e]; sl < off[e] + cnt[e]; ++sl) {
          const float* hx = &h[static_cast<size_t>(token[sl]) * E];
          for (int r = 0; r < F; ++r) {
            double g, ag, u, au;
            dot2(&G.deq[(static_cast<int64_t>(e) * F + r) * E], hx, E, g, ag);
            dot2(&U.deq[(static_cast<int64_t>(e) * F + r) * E], hx, E, u, au);
            const double sg = g / (1.0 + std::exp(-g)), want = sg * u;
            // each product within 1e-5 of its scale; silu' stays below 1.1
            const double tol = 1e-5 * (1.1 * std::fabs(u) * ag + std::fabs(sg) * au + 1e-5 * ag * au) + 1e-6 * std::fabs(want) + 1e-6;
            check_act.bound(a[static_cast<size_t>(sl) * F + r], want, tol, static_cast<int64_t>(sl) * F + r);
          }
          for (int r = 0; r < E; ++r) {
            double s, sa;
            dot2(&D.deq[(static_cast<int64_t>(e) * E + r) * F], &a[static_cast<size_t>(sl) * F], F, s, sa);
            check_down(y[static_cast<size_t>(sl) * E + r], s, sa, static_cast<int64_t>(sl) * E + r);
          }
        }
    }
}

// The dynamic work walk (a ticket per call) against the static one: every tile is computed by one
// block with the same code whichever block draws it, so the outputs must be the same bits. Enough
// experts (96, ~12 tokens each) that both products have ~1.5 times as many tiles as an H200 has
// SMs, so blocks draw items; down has one super-block per row (n_k = 1: an item per stage,
// the draws' earliest case) and gate/up two. The ticket ends past the item count.
TEST(CudaGemm, GroupedDynamicWalkSameBitsAsStatic) {
  REQUIRE_GPU();
  const uint64_t seed = gpu_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 512, F = 256, X = 96, K = 4, T = 300;
  std::vector<int32_t> ids(T * K);
  for (int t = 0; t < T; ++t) {
    std::vector<int> all(X);
    for (int e = 0; e < X; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < K; ++j) ids[t * K + j] = all[j];
  }
  struct Types {
    Type gate_up, down;
  };
  for (const Types ty : {Types{Type::Q4_K, Type::Q6_K}, Types{Type::Q5_K, Type::Q4_K}})
    for (bool split : {false, true}) {
      const std::string name = std::string(split ? "fp16 " : "") + "gate/up " + moe::gguf::type_name(ty.gate_up) +
                               ", down " + moe::gguf::type_name(ty.down);
      SCOPED_TRACE(name);
      QMatrix G(ty.gate_up, X * F, E, rng), U(ty.gate_up, X * F, E, rng), D(ty.down, X * E, F, rng);
      const std::vector<float> h = make_x(Dist::Gauss, T, E, rng);
      Dev<float> dh(h), act(T * K * F), act2(T * K * F), dout(T * K * E), dout2(T * K * E);
      Dev<int32_t> di(ids), tos(T * K), slot(T * K);
      Dev<int> count(X), offset(X), ticket(std::vector<int>{0, 0});
      const bool split_gu = split && k::split_h16_wanted(G.mat(F)), split_dn = split && k::split_h16_wanted(D.mat(E));
      Dev<uint8_t> hh(split_gu ? k::split_h16_bytes(T, E) : 1), acth(split_dn ? k::split_h16_bytes(T * K, F) : 1);
      ok(k::group_by_expert(di.p, T, K, X, count.p, offset.p, tos.p, slot.p, nullptr));
      if (split_gu) ok(k::split_h16(dh.p, E, T, E, hh.p, nullptr));
      ok(k::expert_gate_up_grouped(G.mat(F), U.mat(F), dh.p, E, count.p, offset.p, tos.p, X, T, act.p, nullptr,
                                   split_gu ? hh.p : nullptr));
      ok(k::expert_gate_up_grouped(G.mat(F), U.mat(F), dh.p, E, count.p, offset.p, tos.p, X, T, act2.p, nullptr,
                                   split_gu ? hh.p : nullptr, ticket.p));
      if (split_dn) ok(k::split_h16(act.p, F, T * K, F, acth.p, nullptr));
      ok(k::expert_down_grouped(D.mat(E), act.p, count.p, offset.p, X, T, dout.p, nullptr, split_dn ? acth.p : nullptr));
      ok(k::expert_down_grouped(D.mat(E), act.p, count.p, offset.p, X, T, dout2.p, nullptr, split_dn ? acth.p : nullptr,
                                ticket.p + 1));
      ok(cudaDeviceSynchronize());
      const std::vector<int> cnt = count.get(), tk = ticket.get();
      int tiles = 0, sms = 0;
      for (int c : cnt) tiles += (c + 31) / 32;
      ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      // Each product has 2 row tiles per token tile; its grid is at most one block per SM here, and
      // every block that drew stops at its first draw past the items (a few more when n_k is small).
      for (int p = 0; p < 2; ++p) {
        EXPECT_GE(tk[p], 2 * tiles - sms) << "product " << p << ": fewer draws than items past the first wave";
        EXPECT_LE(tk[p], 2 * tiles + 3 * sms) << "product " << p;
      }
      const std::vector<float> a1 = act.get(), a2 = act2.get(), y1 = dout.get(), y2 = dout2.get();
      int bad_a = 0, bad_y = 0;
      for (size_t i = 0; i < a1.size(); ++i) bad_a += std::memcmp(&a1[i], &a2[i], 4) != 0;
      for (size_t i = 0; i < y1.size(); ++i) bad_y += std::memcmp(&y1[i], &y2[i], 4) != 0;
      EXPECT_EQ(bad_a, 0) << "gate/up outputs differing between the walks";
      EXPECT_EQ(bad_y, 0) << "down outputs differing between the walks";
      EXPECT_TRUE(std::isfinite(a1[0]) && std::isfinite(y1[0]));
    }
}

// rmsnorm_split_h16 (the prefill's norm and split in one launch) against rmsnorm_rows then split_h16:
// the same bits in both outputs, for one and for several super-blocks per warp (cols 768: three
// warps idle; 2,304 = nine super-blocks over eight warps), rows with a stride past cols.
TEST(CudaGemm, RmsnormSplitSameBitsAsTwoKernels) {
  REQUIRE_GPU();
  const uint64_t seed = gpu_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int cols : {768, 2048, 2304}) {
    SCOPED_TRACE(cols);
    const int rows = 37, stride = cols + 12;
    const std::vector<float> x = make_x(Dist::Outliers, rows, stride, rng), w = make_x(Dist::Gauss, 1, cols, rng);
    Dev<float> dx(x), dw(w), h1(static_cast<size_t>(rows) * stride), h2(static_cast<size_t>(rows) * stride);
    const size_t rb = k::split_h16_bytes(rows, cols);
    Dev<uint8_t> r1(rb), r2(rb);
    ok(k::rmsnorm_rows(dx.p, dw.p, rows, cols, stride, 1e-6f, h1.p, nullptr));
    ok(k::split_h16(h1.p, stride, rows, cols, r1.p, nullptr));
    ok(k::rmsnorm_split_h16(dx.p, dw.p, rows, cols, stride, 1e-6f, h2.p, r2.p, nullptr));
    ok(cudaDeviceSynchronize());
    const std::vector<float> a = h1.get(), b = h2.get();
    const std::vector<uint8_t> ra = r1.get(), rbv = r2.get();
    int bad = 0;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) bad += std::memcmp(&a[r * stride + c], &b[r * stride + c], 4) != 0;
    EXPECT_EQ(bad, 0) << "normed floats differing";
    EXPECT_EQ(ra, rbv) << "split records differing";
    EXPECT_TRUE(std::isfinite(b[0]));
  }
  // A column count the records cannot hold is refused, not run.
  Dev<float> x(64 * 300), o(64 * 300);
  Dev<uint8_t> r(1024);
  EXPECT_EQ(k::rmsnorm_split_h16(x.p, x.p, 2, 300, 300, 1e-6f, o.p, r.p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
