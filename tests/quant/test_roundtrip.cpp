// quantize_row -> dequantize_row on fresh random data, with a stated bound per format, and
// dequantize_row against the independent decoder in ref_decode.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "moe/error.hpp"
#include "moe/quant.hpp"
#include "ref_decode.hpp"

using moe::gguf::Type;
namespace q = moe::quant;

namespace {

std::vector<float> random_row(std::mt19937& rng, int64_t n, int kind) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (kind) {
      case 0: x[i] = nd(rng); break;                               // Gaussian, like weights
      case 1: x[i] = ud(rng) * 3.f + 1.f; break;                   // shifted: exercises the mins
      case 2: x[i] = nd(rng) * std::exp(2.f * ud(rng)); break;     // heavy-tailed / mixed scales
      default: x[i] = std::fabs(nd(rng)) * 0.01f; break;           // all positive, small
    }
  }
  return x;
}

uint32_t seed() { return std::random_device{}(); }

struct Stats {
  double max_excess = 0;  // max over elements of |err| / bound (must stay <= 1)
  double sse = 0, ssx = 0;
};

// Per-element bound for the block that holds element i, from the original floats of that block.
// Justifications (d = the block's scale, u = 2^-11 the fp16 rounding of a stored scale):
//  Q8_0/Q8_1: d = amax/127, round to nearest: |err| <= d/2 + 127·u·d (fp16 d) -> 0.57·amax/127.
//  Q4_0/Q5_0: d = signed extreme / -(8|16); codes truncate x/d + 8.5 (round half up) and the side
//     opposite the extreme reaches +8 (+16), one past the top code 15 (31), so |err| <= d, plus 16·u·d.
//  Q4_1/Q5_1: d = (max-min)/(15|31) rounded half up: |err| <= d/2 + nmax·u·d + u·|min| (fp16 min).
//  K-quants: codes are re-rounded against the stored scales, so inside the grid |err| <= step/2; the
//     least-squares scale may place the extremes up to about one step outside the grid, so we allow a
//     sub-block's value range divided by its number of levels (Q4_K: range/15, Q5_K: range/31,
//     Q6_K: amax/32, Q3_K: 8 levels -> amax/3.5, Q2_K: 4 levels -> range/2.5). On top of that the
//     sub-block scale (and min) is stored as a code relative to the super-block's largest one, off by
//     up to half a code step D/2; with codes up to nmax that moves an element by nmax·D/2:
//     Q4_K/Q5_K: D = max_scale/63 with max_scale·nmax ≈ super-block range R, plus the same for the
//     min -> 2·R/126; Q6_K: D = max|scale|/128, 32·D/2 = max|x|/256; Q3_K: D = max|scale|/32,
//     4·D/2 = max|x|/64; Q2_K: D = max_scale/15, 3·D/2 + the min's -> R/15.
//     A bound on the RMS error (checked separately) pins the typical quality: it must be close to the
//     step/sqrt(12) of uniform rounding.
double element_bound(Type t, const float* blk, int n_blk, int i_in_blk) {
  auto range_of = [&](int lo, int len, double& mn, double& mx, double& amax) {
    mn = blk[lo]; mx = blk[lo]; amax = 0;
    for (int k = lo; k < lo + len; ++k) { mn = std::min<double>(mn, blk[k]); mx = std::max<double>(mx, blk[k]); amax = std::max<double>(amax, std::fabs(blk[k])); }
  };
  double mn, mx, amax;
  const double u = 1.0 / 2048;
  switch (t) {
    case Type::Q8_0: case Type::Q8_1:
      range_of(0, 32, mn, mx, amax); return amax / 127 * (0.5 + 127 * u) + 1e-12;
    case Type::Q8_K:  // fp32 d = ±amax/127, round to nearest
      range_of(0, 256, mn, mx, amax); return amax / 127 * 0.5 * (1 + 1e-5) + 1e-12;
    case Type::Q4_0:
      range_of(0, 32, mn, mx, amax); return amax / 8 * (1 + 16 * u) + 1e-12;
    case Type::Q5_0:
      range_of(0, 32, mn, mx, amax); return amax / 16 * (1 + 32 * u) + 1e-12;
    case Type::Q4_1:
      range_of(0, 32, mn, mx, amax); return (mx - mn) / 15 * (0.5 + 16 * u) + u * std::fabs(mn) + 1e-12;
    case Type::Q5_1:
      range_of(0, 32, mn, mx, amax); return (mx - mn) / 31 * (0.5 + 32 * u) + u * std::fabs(mn) + 1e-12;
    case Type::Q4_K: case Type::Q5_K: {
      int s = i_in_blk / 32;
      range_of(32 * s, 32, mn, mx, amax);
      double lo = std::min(mn, 0.0);
      // The 6-bit scale codes are relative to the largest sub-block scale of the super-block, so a
      // sub-block much flatter than the others gets a coarse code; the whole super-block's range/63
      // bounds that extra error.
      double bmn, bmx, bamax;
      range_of(0, n_blk, bmn, bmx, bamax);
      double levels = t == Type::Q4_K ? 15 : 31;
      return (mx - lo) / levels + 2 * (bmx - std::min(bmn, 0.0)) / 126 + 1e-9;
    }
    case Type::Q6_K: {
      int s = i_in_blk / 16;
      range_of(16 * s, 16, mn, mx, amax);
      double bmn, bmx, bamax;
      range_of(0, n_blk, bmn, bmx, bamax);
      return amax / 32 + bamax / 256 + 1e-9;
    }
    case Type::Q3_K: {
      int s = i_in_blk / 16;
      range_of(16 * s, 16, mn, mx, amax);
      double bmn, bmx, bamax;
      range_of(0, n_blk, bmn, bmx, bamax);
      return amax / 3.5 + bamax / 4 / 32 * 2 + 1e-9;
    }
    case Type::Q2_K: {
      int s = i_in_blk / 16;
      range_of(16 * s, 16, mn, mx, amax);
      double lo = std::min(mn, 0.0);
      double bmn, bmx, bamax;
      range_of(0, n_blk, bmn, bmx, bamax);
      return (mx - lo) / 2.5 + (bmx - std::min(bmn, 0.0)) / 15 + 1e-9;
    }
    case Type::F16: return std::fabs(blk[i_in_blk]) * u * 1.0000001 + 6e-8;  // half an fp16 ulp (10 fraction bits)
    case Type::BF16: return std::fabs(blk[i_in_blk]) / 256 * 1.0000001 + 1e-38;  // half a bf16 ulp (7 fraction bits)
    case Type::F32: return 0;
    default: return 0;
  }
}

// RMS error / RMS value on Gaussian data. Uniform rounding error has RMS step/sqrt(12); a Gaussian
// block of 32 spans about ±2.1σ, so Q4_K's step is ~4.2σ/15 -> 0.081σ; the bounds leave ~25% room
// for scale quantization. Q8_0: 2·2.1σ/254/sqrt(12) ≈ 0.005σ.
double rms_bound(Type t) {
  switch (t) {
    case Type::Q8_0: case Type::Q8_1: return 0.006;
    case Type::Q8_K: return 0.009;  // one scale per 256 values: amax ~2.9σ, step 2.9σ/127 -> 0.0066σ
    case Type::Q4_0: return 0.12;
    case Type::Q4_1: return 0.10;
    case Type::Q5_0: return 0.06;
    case Type::Q5_1: return 0.05;
    case Type::Q2_K: return 0.40;
    case Type::Q3_K: return 0.21;
    case Type::Q4_K: return 0.10;
    case Type::Q5_K: return 0.05;
    case Type::Q6_K: return 0.025;
    case Type::F16: return 4e-4;
    case Type::BF16: return 3e-3;
    default: return 0;
  }
}

const Type kTypes[] = {Type::F32, Type::F16, Type::BF16, Type::Q4_0, Type::Q4_1, Type::Q5_0, Type::Q5_1,
                       Type::Q8_0, Type::Q8_1, Type::Q8_K, Type::Q2_K, Type::Q3_K, Type::Q4_K, Type::Q5_K,
                       Type::Q6_K};

const char* test_type_name(Type t) {
  switch (t) {
    case Type::F32: return "F32"; case Type::F16: return "F16"; case Type::BF16: return "BF16";
    case Type::Q4_0: return "Q4_0"; case Type::Q4_1: return "Q4_1"; case Type::Q5_0: return "Q5_0";
    case Type::Q5_1: return "Q5_1"; case Type::Q8_0: return "Q8_0"; case Type::Q8_1: return "Q8_1";
    case Type::Q2_K: return "Q2_K"; case Type::Q3_K: return "Q3_K"; case Type::Q4_K: return "Q4_K";
    case Type::Q5_K: return "Q5_K"; case Type::Q6_K: return "Q6_K"; case Type::Q8_K: return "Q8_K";
    default: return "other";
  }
}

int block_elems(Type t) { return moe::quant::test::ref_block_elems(static_cast<uint32_t>(t)); }
size_t test_row_bytes(Type t, int64_t n) {
  return static_cast<size_t>(n / block_elems(t)) * static_cast<size_t>(moe::quant::test::ref_block_bytes(static_cast<uint32_t>(t)));
}

}  // namespace

class RoundTrip : public ::testing::TestWithParam<Type> {};

TEST_P(RoundTrip, ErrorWithinBoundAndDecoderAgrees) {
  const Type t = GetParam();
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << "type " << static_cast<int>(t) << " seed " << s);
  std::mt19937 rng(s);
  const int64_t n = 2048;
  const int be = std::max(block_elems(t), 32);
  for (int kind = 0; kind < 4; ++kind) {
    std::vector<float> x = random_row(rng, n, kind);
    std::vector<uint8_t> qbuf(test_row_bytes(t, n));
    q::quantize_row(t, x.data(), qbuf.data(), n);
    std::vector<float> y(static_cast<size_t>(n));
    q::dequantize_row(t, qbuf.data(), y.data(), n);
    std::vector<double> ref;
    ASSERT_TRUE(moe::quant::test::ref_decode(static_cast<uint32_t>(t), qbuf.data(), n, ref));
    double worst = 0, sse = 0, ssx = 0;
    int64_t worst_i = 0;
    for (int64_t i = 0; i < n; ++i) {
      // The library's float dequantization against the double decoder: a few float roundings.
      ASSERT_NEAR(y[i], ref[i], 1e-6 * std::fabs(ref[i]) + 1e-30) << "element " << i << " kind " << kind;
      const float* blk = x.data() + (i / be) * be;
      double bound = element_bound(t, blk, be, static_cast<int>(i % be));
      double err = std::fabs(ref[i] - x[i]);
      if (bound == 0 ? err > 0 : err / bound > worst) { worst = bound == 0 ? 1e9 : err / bound; worst_i = i; }
      sse += err * err;
      ssx += static_cast<double>(x[i]) * x[i];
    }
    if (std::getenv("MOE_QUANT_VERBOSE")) std::printf("%d kind %d worst %.3f rms %.4f\n", static_cast<int>(t), kind, worst, std::sqrt(sse / ssx));
    EXPECT_LE(worst, 1.0) << "kind " << kind << " element " << worst_i << " x=" << x[worst_i] << " y=" << ref[worst_i];
    if (kind == 0) {
      EXPECT_LE(std::sqrt(sse / ssx), rms_bound(t)) << "rms error on Gaussian data";
    }
  }
}

TEST_P(RoundTrip, ZeroRowStaysZero) {
  const Type t = GetParam();
  const int64_t n = 512;
  std::vector<float> x(n, 0.f), y(n, 1.f);
  std::vector<uint8_t> qbuf(test_row_bytes(t, n));
  q::quantize_row(t, x.data(), qbuf.data(), n);
  q::dequantize_row(t, qbuf.data(), y.data(), n);
  for (float v : y) ASSERT_EQ(v, 0.f);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, RoundTrip, ::testing::ValuesIn(kTypes),
                         [](const auto& info) { return std::string(test_type_name(info.param)); });

TEST(Quant, UnsupportedTypesAreRefusedByName) {
  std::vector<float> x(256, 1.f);
  std::vector<uint8_t> buf(4096);
  try {
    q::quantize_row(Type::IQ2_XXS, x.data(), buf.data(), 256);
    FAIL() << "no throw";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::unsupported);
    EXPECT_NE(std::string(e.what()).find("IQ2_XXS"), std::string::npos) << e.what();
  }
  try {
    q::dequantize_row(Type::TQ1_0, buf.data(), x.data(), 256);
    FAIL() << "no throw";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::unsupported);
    EXPECT_NE(std::string(e.what()).find("TQ1_0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(q::dot_fast(Type::IQ4_NL, buf.data(), buf.data(), 32), moe::Error);
  EXPECT_THROW(q::dot_exact(Type::MXFP4, buf.data(), x.data(), 32), moe::Error);
  EXPECT_THROW(q::act_type(Type::IQ4_XS), moe::Error);
  // A row that is not a whole number of blocks.
  EXPECT_THROW(q::dequantize_row(Type::Q4_K, buf.data(), x.data(), 200), moe::Error);
  EXPECT_FALSE(q::is_weight_type(Type::IQ1_S));
  EXPECT_FALSE(q::is_weight_type(Type::Q8_K));
  EXPECT_TRUE(q::is_weight_type(Type::Q6_K));
}

TEST(Quant, ActivationPairing) {
  EXPECT_EQ(q::act_type(Type::Q4_K), Type::Q8_K);
  EXPECT_EQ(q::act_type(Type::Q2_K), Type::Q8_K);
  EXPECT_EQ(q::act_type(Type::Q6_K), Type::Q8_K);
  EXPECT_EQ(q::act_type(Type::Q4_0), Type::Q8_0);
  EXPECT_EQ(q::act_type(Type::Q5_0), Type::Q8_0);
  EXPECT_EQ(q::act_type(Type::Q8_0), Type::Q8_0);
  EXPECT_EQ(q::act_type(Type::Q4_1), Type::Q8_1);
  EXPECT_EQ(q::act_type(Type::Q5_1), Type::Q8_1);
  EXPECT_EQ(q::act_type(Type::F16), Type::F16);
  EXPECT_EQ(q::act_type(Type::BF16), Type::BF16);
  EXPECT_EQ(q::act_type(Type::F32), Type::F32);
  EXPECT_EQ(q::act_row_bytes(Type::Q4_K, 2048), 8u * 292u);
  EXPECT_EQ(q::act_row_bytes(Type::Q8_0, 768), 24u * 34u);
  EXPECT_EQ(q::act_row_bytes(Type::Q5_1, 64), 2u * 36u);
  EXPECT_EQ(q::act_row_bytes(Type::F32, 10), 40u);
}
