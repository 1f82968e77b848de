// The CPU forward's element-wise and attention helpers against plain double-precision versions
// written here (the fixtures only exercise 2 query heads per KV head; Qwen3-30B-A3B has 8).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "../../src/cpu/ops.hpp"
#include "moe/finite.hpp"
#include "moe/quant.hpp"

namespace {

double f16(double v) { return static_cast<double>(static_cast<_Float16>(static_cast<float>(v))); }

struct AttnCase {
  int heads, hd, n_pos;
};

class Attend : public testing::TestWithParam<AttnCase> {};

TEST_P(Attend, MatchesDoubleReference) {
  const AttnCase c = GetParam();
  const int kv_stride = c.hd * 3;  // the KV head sits inside wider cache rows
  std::mt19937 rng(7 + c.heads * 100 + c.n_pos);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(c.heads * c.hd));
  for (auto& v : q) v = 2.f * nd(rng);
  std::vector<uint16_t> K(static_cast<size_t>(c.n_pos * kv_stride)), V(K.size());
  for (auto& v : K) v = moe::quant::f32_to_fp16(nd(rng));
  for (auto& v : V) v = moe::quant::f32_to_fp16(nd(rng));
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hd));

  for (bool round : {false, true}) {
    std::vector<float> scores(static_cast<size_t>(8 * c.n_pos)), qbuf(q.size()), out(q.size());
    moe::cpu::attend(q.data(), c.heads, c.hd, K.data(), V.data(), kv_stride, c.n_pos, scale, round, scores.data(),
                     qbuf.data(), out.data());
    for (int h = 0; h < c.heads; ++h) {
      std::vector<double> s(static_cast<size_t>(c.n_pos));
      double mx = -1e300;
      for (int p = 0; p < c.n_pos; ++p) {
        double d = 0;
        for (int j = 0; j < c.hd; ++j) {
          const double qv = round ? f16(q[static_cast<size_t>(h * c.hd + j)]) : q[static_cast<size_t>(h * c.hd + j)];
          d += qv * moe::quant::fp16_to_f32(K[static_cast<size_t>(p * kv_stride + j)]);
        }
        s[static_cast<size_t>(p)] = d * scale;
        mx = std::max(mx, s[static_cast<size_t>(p)]);
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (int j = 0; j < c.hd; ++j) {
        double o = 0;
        for (int p = 0; p < c.n_pos; ++p) {
          const double pr = round ? f16(s[static_cast<size_t>(p)] / sum) : s[static_cast<size_t>(p)] / sum;
          o += pr * moe::quant::fp16_to_f32(V[static_cast<size_t>(p * kv_stride + j)]);
        }
        // fp16 rounding of a probability may land on the other side in fp32 vs double: 1e-3 covers it.
        EXPECT_NEAR(out[static_cast<size_t>(h * c.hd + j)], o, round ? 2e-3 : 2e-5)
            << "head " << h << " dim " << j << (round ? " (fp16 Q/P)" : "");
      }
    }
  }
}

TEST_P(Attend, OutputMayAliasQ) {
  const AttnCase c = GetParam();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(c.heads * c.hd));
  for (auto& v : q) v = nd(rng);
  std::vector<uint16_t> K(static_cast<size_t>(c.n_pos * c.hd)), V(K.size());
  for (auto& v : K) v = moe::quant::f32_to_fp16(nd(rng));
  for (auto& v : V) v = moe::quant::f32_to_fp16(nd(rng));
  std::vector<float> scores(static_cast<size_t>(8 * c.n_pos)), qbuf(q.size()), out(q.size());
  moe::cpu::attend(q.data(), c.heads, c.hd, K.data(), V.data(), c.hd, c.n_pos, 0.1f, true, scores.data(), qbuf.data(),
                   out.data());
  moe::cpu::attend(q.data(), c.heads, c.hd, K.data(), V.data(), c.hd, c.n_pos, 0.1f, true, scores.data(), qbuf.data(),
                   q.data());
  EXPECT_EQ(out, q);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attend,
                         testing::Values(AttnCase{8, 128, 1}, AttnCase{8, 128, 37}, AttnCase{4, 64, 9},
                                         AttnCase{3, 64, 300}, AttnCase{1, 128, 5}, AttnCase{12, 128, 17},
                                         AttnCase{2, 24, 6}));

TEST(CpuOps, SoftmaxAndSwiglu) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 5.f);
  for (int n : {1, 7, 8, 33, 128}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = nd(rng);
    x[0] = -200.f;  // far below the max: its probability is 0 (or denormal)
    std::vector<float> y = x;
    moe::cpu::softmax(y.data(), n);
    double mx = -1e300, sum = 0;
    for (float v : x) mx = std::max(mx, static_cast<double>(v));
    for (float v : x) sum += std::exp(v - mx);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[static_cast<size_t>(i)], std::exp(x[static_cast<size_t>(i)] - mx) / sum, 1e-6);
  }
  std::vector<float> g(100), u(100), out(100);
  for (int i = 0; i < 100; ++i) {
    g[static_cast<size_t>(i)] = -95.f + 1.9f * static_cast<float>(i);
    u[static_cast<size_t>(i)] = 0.5f + 0.01f * static_cast<float>(i);
  }
  moe::cpu::swiglu(g.data(), u.data(), out.data(), 100);
  for (int i = 0; i < 100; ++i) {
    const double x = g[static_cast<size_t>(i)];
    const double want = x / (1.0 + std::exp(-x)) * u[static_cast<size_t>(i)];
    EXPECT_NEAR(out[static_cast<size_t>(i)], want, 1e-6 * std::max(1.0, std::abs(want))) << "x = " << x;
  }
}

TEST(CpuOps, ArgmaxLowestIdOnTiesAndNonFiniteScan) {
  for (int n : {1, 7, 8, 9, 33, 4099}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i));
    const int hi = n / 3, lo = n - 1;
    x[static_cast<size_t>(lo)] = 5.f;
    x[static_cast<size_t>(hi)] = 5.f;  // a tie: the lower index wins
    EXPECT_EQ(moe::cpu::argmax(x.data(), n), std::min(hi, lo)) << n;
    EXPECT_EQ(moe::cpu::first_non_finite(x.data(), n), -1) << n;
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      std::vector<float> y = x;
      y[static_cast<size_t>(n - 1)] = bad;
      if (n > 2) y[static_cast<size_t>(n / 2)] = bad;
      EXPECT_EQ(moe::cpu::first_non_finite(y.data(), n), n > 2 ? n / 2 : n - 1) << n;
    }
  }
}

// The shared check (include/moe/finite.hpp) that the engine and the F2 guard use, and the CPU forward after
// its AVX2 pass: the first NaN or infinity of any sign or payload, never a finite value (the largest, the
// smallest subnormal, -0), and -1 for an empty row.
TEST(CpuOps, FirstNonFiniteFindsTheFirstNaNOrInfinity) {
  EXPECT_EQ(moe::first_non_finite({}), -1);
  const float finite[] = {3.4028235e38f, -3.4028235e38f, 1.4e-45f, -0.f, 0.f, 1.f};
  EXPECT_EQ(moe::first_non_finite(finite), -1);
  const float bads[] = {std::nanf(""), -std::nanf(""), std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xffc12345u),
                        INFINITY, -INFINITY};
  for (int n : {1, 2, 15, 16, 17, 151936})
    for (float bad : bads) {
      std::vector<float> x(static_cast<size_t>(n), 0.5f);
      EXPECT_EQ(moe::first_non_finite(x), -1) << n;
      for (int at : {n - 1, n / 2, 0}) {
        x[static_cast<size_t>(at)] = bad;
        EXPECT_EQ(moe::first_non_finite(x), at) << n << " " << at;
        EXPECT_EQ(moe::cpu::first_non_finite(x.data(), n), at) << n << " " << at;
      }
    }
}

TEST(CpuOps, RmsNormUsesTheMeanSquare) {
  std::vector<float> x = {1.f, -2.f, 3.f, 4.f}, w = {1.f, 0.5f, 2.f, 1.f}, y(4);
  moe::cpu::rms_norm(x.data(), w.data(), y.data(), 4, 1e-6f);
  const double r = 1.0 / std::sqrt((1 + 4 + 9 + 16) / 4.0 + 1e-6);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[static_cast<size_t>(i)], x[static_cast<size_t>(i)] * r * w[static_cast<size_t>(i)], 1e-6);
}

TEST(CpuOps, RopePlainAndNeoxPairing) {
  moe::model::ModelConfig c;
  c.head_dim = 8;
  c.rope_base = 10000.f;
  c.context_length = 4096;
  const moe::cpu::Rope r = moe::cpu::Rope::from_config(c);
  std::vector<float> cs(8);
  r.table(5, cs.data());
  for (int i = 0; i < 4; ++i) {
    const double theta = 5.0 * std::pow(10000.0, -2.0 * i / 8);
    EXPECT_NEAR(cs[static_cast<size_t>(2 * i)], std::cos(theta), 1e-5);
    EXPECT_NEAR(cs[static_cast<size_t>(2 * i + 1)], std::sin(theta), 1e-5);
  }
  // NEOX: element i rotates with element i + 4.
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  moe::cpu::rope_neox(x.data(), cs.data(), 8);
  for (int i = 0; i < 4; ++i) {
    const double co = cs[static_cast<size_t>(2 * i)], si = cs[static_cast<size_t>(2 * i + 1)];
    EXPECT_NEAR(x[static_cast<size_t>(i)], (i + 1) * co - (i + 5) * si, 1e-5);
    EXPECT_NEAR(x[static_cast<size_t>(i + 4)], (i + 1) * si + (i + 5) * co, 1e-5);
  }
}

TEST(CpuOps, RopeYarnFollowsReference) {
  // REFERENCE.md §4.5 YaRN: factor 4, n_ctx_orig 32768, base 1e6, 128 dims.
  moe::model::ModelConfig c;
  c.head_dim = 128;
  c.rope_base = 1e6f;
  c.context_length = 131072;
  c.rope_scaling = moe::model::RopeScalingType::yarn;
  c.rope_freq_scale = 0.25f;
  c.rope_n_ctx_orig = 32768;
  const moe::cpu::Rope r = moe::cpu::Rope::from_config(c);
  const double pi = 3.14159265358979323846;
  auto corr = [&](double b) { return 128 * std::log(32768 / (2 * pi * b)) / (2 * std::log(1e6)); };
  const double lo = std::max(0.0, std::floor(corr(32))), hi = std::min(127.0, std::ceil(corr(1)));
  const int64_t pos = 40000;
  std::vector<float> cs(128);
  r.table(pos, cs.data());
  const double mscale = 1 + 0.1 * std::log(4.0);
  for (int i = 0; i < 64; ++i) {
    const double ramp = 1 - std::clamp((i - lo) / std::max(0.001, hi - lo), 0.0, 1.0);
    const double extrap = pos * std::pow(1e6, -2.0 * i / 128);
    const double theta = extrap * 0.25 * (1 - ramp) + extrap * ramp;
    // θ is built by repeated fp32 multiplication: compare the rotation, with a tolerance that
    // grows with the angle.
    const double tol = 2e-6 * std::max(1.0, theta);
    EXPECT_NEAR(cs[static_cast<size_t>(2 * i)], std::cos(theta) * mscale, tol) << "pair " << i;
    EXPECT_NEAR(cs[static_cast<size_t>(2 * i + 1)], std::sin(theta) * mscale, tol) << "pair " << i;
  }
}

}  // namespace
