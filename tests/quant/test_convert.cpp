// fp16 / bf16 conversions: every half value, rounding ties, overflow, subnormals, NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "moe/quant.hpp"
#include "ref_decode.hpp"

namespace q = moe::quant;

namespace {
float f_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t u_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
}  // namespace

TEST(Convert, EveryHalfDecodesAndRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = q::fp16_to_f32(static_cast<uint16_t>(h));
    double want = moe::quant::test::half_to_double(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(q::fp16_to_f32(q::f32_to_fp16(f)))) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << h;
    ASSERT_EQ(q::f32_to_fp16(f), h) << h;
  }
}

TEST(Convert, HalfRoundsToNearestEven) {
  // Between two neighbouring halves a and b: below the midpoint -> a, above -> b, at it -> even.
  for (uint32_t h = 0; h < 0x7BFF; h += 7) {
    double a = moe::quant::test::half_to_double(static_cast<uint16_t>(h));
    double b = moe::quant::test::half_to_double(static_cast<uint16_t>(h + 1));
    double mid = (a + b) / 2;
    float just_below = std::nextafter(static_cast<float>(mid), 0.f);
    float just_above = std::nextafter(static_cast<float>(mid), 1e9f);
    ASSERT_EQ(q::f32_to_fp16(just_below), h);
    ASSERT_EQ(q::f32_to_fp16(just_above), h + 1);
    ASSERT_EQ(q::f32_to_fp16(static_cast<float>(mid)), (h % 2 == 0) ? h : h + 1) << h;
    ASSERT_EQ(q::f32_to_fp16(-static_cast<float>(mid)), ((h % 2 == 0) ? h : h + 1) | 0x8000) << h;
  }
  EXPECT_EQ(q::f32_to_fp16(65519.f), 0x7BFF);
  EXPECT_EQ(q::f32_to_fp16(65520.f), 0x7C00);  // the tie above 65504 rounds to infinity
  EXPECT_EQ(q::f32_to_fp16(1e10f), 0x7C00);
  EXPECT_EQ(q::f32_to_fp16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(q::f32_to_fp16(1e-8f), 0x0000);  // below half the smallest subnormal
  EXPECT_EQ(q::f32_to_fp16(3e-8f), 0x0001);  // above half of 2^-24
  EXPECT_EQ(q::f32_to_fp16(-0.f), 0x8000);
  uint16_t nan = q::f32_to_fp16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x3FF, 0);
}

TEST(Convert, Bfloat16) {
  for (uint32_t h = 0; h < 65536; h += 3) {
    float f = q::bf16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(u_of(f), h << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(q::f32_to_bf16(f), h);
    }
  }
  // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: even mantissa (1.0) wins; 1 + 3·2^-8 -> 1 + 2^-6.
  EXPECT_EQ(q::f32_to_bf16(1.00390625f), 0x3F80);
  EXPECT_EQ(q::f32_to_bf16(1.01171875f), 0x3F82);
  EXPECT_EQ(q::f32_to_bf16(f_of(0x3F808001)), 0x3F81);
  uint16_t nan = q::f32_to_bf16(f_of(0x7F800001));  // a signalling NaN stays a NaN
  EXPECT_TRUE(std::isnan(q::bf16_to_f32(nan)));
  EXPECT_EQ(q::f32_to_bf16(f_of(0x7F7FFFFF)), 0x7F80);  // the largest float rounds to infinity
}
