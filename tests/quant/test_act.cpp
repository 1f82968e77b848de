// Activation quantization follows llama.cpp's x86 rules (REFERENCE.md §5.9) on hand-made blocks
// whose expected codes are worked out here, for every kernel table.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../../src/quant/internal.hpp"
#include "moe/quant.hpp"

using moe::gguf::Type;
namespace q = moe::quant;
namespace qd = moe::quant::detail;

namespace {
template <typename F>
void each_table(F f) {
  for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) f(qd::kernels(static_cast<qd::Isa>(isa)));
}
}  // namespace

// Q8_0 (x86): id = 127/amax and round half to even. With amax = 127, id = 1 and the codes are the
// values rounded to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -0.5 -> 0; d = fp16(1.0).
TEST(Act, Q8_0RoundsHalfToEven) {
  std::vector<float> x(64, 0.f);
  x[0] = 127.f;
  x[1] = 2.5f;
  x[2] = 3.5f;
  x[3] = -2.5f;
  x[4] = -0.5f;
  x[5] = 1.49f;
  x[32] = 0.f;  // second block all zero: d = 0, codes 0
  each_table([&](const qd::Kernels& k) {
    qd::BlockQ8_0 b[2];
    std::memset(b, 0x55, sizeof b);
    k.quantize_act[static_cast<size_t>(Type::Q8_0)](x.data(), b, 64);
    EXPECT_EQ(b[0].d, q::f32_to_fp16(1.f)) << k.name;
    EXPECT_EQ(b[0].qs[0], 127) << k.name;
    EXPECT_EQ(b[0].qs[1], 2) << k.name;
    EXPECT_EQ(b[0].qs[2], 4) << k.name;
    EXPECT_EQ(b[0].qs[3], -2) << k.name;
    EXPECT_EQ(b[0].qs[4], 0) << k.name;
    EXPECT_EQ(b[0].qs[5], 1) << k.name;
    EXPECT_EQ(b[1].d, 0) << k.name;
    for (int j = 0; j < 32; ++j) EXPECT_EQ(b[1].qs[j], 0) << k.name;
  });
}

// Q8_1: as Q8_0 plus s = fp16(d·Σq) with the fp32 d = amax/127.
TEST(Act, Q8_1StoresScaledSum) {
  std::vector<float> x(32, 0.f);
  x[0] = 12.7f;  // d = 0.1, id = 10
  x[1] = 0.25f;  // 2.5 -> 2
  x[2] = -1.0f;  // -10
  each_table([&](const qd::Kernels& k) {
    qd::BlockQ8_1 b;
    k.quantize_act[static_cast<size_t>(Type::Q8_1)](x.data(), &b, 32);
    EXPECT_EQ(b.qs[0], 127) << k.name;
    EXPECT_EQ(b.qs[1], 2) << k.name;
    EXPECT_EQ(b.qs[2], -10) << k.name;
    EXPECT_EQ(b.d, q::f32_to_fp16(12.7f / 127.f)) << k.name;
    EXPECT_EQ(b.s, q::f32_to_fp16(12.7f / 127.f * 119.f)) << k.name;
  });
}

// Q8_K: the first element of largest magnitude, with its sign, maps to -127; d = 1/iscale may be
// negative; halves round to even; bsums are sums of 16 codes.
TEST(Act, Q8_KUsesFirstSignedExtreme) {
  std::vector<float> x(256, 0.f);
  x[3] = -2.f;   // first of the two largest magnitudes: iscale = -127 / -2 = 63.5
  x[10] = 2.f;   // -> 127
  x[20] = 1.f / 127.f;       // 63.5/127 = 0.5 -> 0 (even)
  x[21] = 3.f / 127.f;       // 1.5 -> 2
  x[40] = -1.f;              // -63.5 -> -64 (even)
  each_table([&](const qd::Kernels& k) {
    qd::BlockQ8_K b;
    k.quantize_act[static_cast<size_t>(Type::Q8_K)](x.data(), &b, 256);
    EXPECT_EQ(b.qs[3], -127) << k.name;
    EXPECT_EQ(b.qs[10], 127) << k.name;
    EXPECT_EQ(b.qs[20], 0) << k.name;
    EXPECT_EQ(b.qs[21], 2) << k.name;
    EXPECT_EQ(b.qs[40], -64) << k.name;
    EXPECT_FLOAT_EQ(b.d, 1.f / 63.5f) << k.name;
    EXPECT_EQ(b.bsums[0], 0) << k.name;         // -127 + 127
    EXPECT_EQ(b.bsums[1], 2) << k.name;         // elements 16..31
    EXPECT_EQ(b.bsums[2], -64) << k.name;       // elements 32..47
    for (int g = 3; g < 16; ++g) EXPECT_EQ(b.bsums[g], 0) << k.name;
  });
  // A positive extreme first gives a negative d.
  std::vector<float> y(256, 0.f);
  y[0] = 4.f;
  y[1] = -4.f;
  each_table([&](const qd::Kernels& k) {
    qd::BlockQ8_K b;
    k.quantize_act[static_cast<size_t>(Type::Q8_K)](y.data(), &b, 256);
    EXPECT_EQ(b.qs[0], -127) << k.name;
    EXPECT_EQ(b.qs[1], 127) << k.name;
    EXPECT_LT(b.d, 0.f) << k.name;
    EXPECT_FLOAT_EQ(b.d * b.qs[0], 4.f) << k.name;
  });
}
