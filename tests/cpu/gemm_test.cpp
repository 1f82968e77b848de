// The CPU forward's own prefill kernels against quant::dot_fast: bit-identical outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "../../src/cpu/gemm.hpp"
#include "moe/quant.hpp"

namespace {

using moe::quant::Type;

struct Data {
  Type type;
  int64_t rows, cols, n_tok;
  std::vector<uint8_t> w, acts;
  size_t row_bytes, act_stride;
};

Data make(Type type, int64_t rows, int64_t cols, int64_t n_tok, float act_scale, uint32_t seed) {
  Data d{type, rows, cols, n_tok, {}, {}, 0, 0};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  d.row_bytes = moe::gguf::row_bytes(d.type, cols);
  d.w.resize(d.row_bytes * static_cast<size_t>(rows));
  std::vector<float> x(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float s = std::exp(nd(rng));  // rows of different magnitude
    for (auto& v : x) v = s * nd(rng) + (r % 3 == 0 ? 0.5f * s : 0.f);
    moe::quant::quantize_row(d.type, x.data(), d.w.data() + r * d.row_bytes, cols);
  }
  d.act_stride = moe::quant::act_row_bytes(d.type, cols) + 12;  // rows need not be packed
  d.acts.resize(d.act_stride * static_cast<size_t>(n_tok));
  for (int64_t t = 0; t < n_tok; ++t) {
    for (auto& v : x) v = act_scale * nd(rng);
    if (t % 5 == 1) std::fill(x.begin(), x.begin() + 256, 0.f);  // an all-zero block
    moe::quant::quantize_act(d.type, x.data(), d.acts.data() + t * d.act_stride, cols);
  }
  return d;
}

void check(const Data& d, int64_t r0, int64_t r1) {
  const moe::quant::Matrix m{d.w.data(), d.type, d.cols, d.rows, d.row_bytes};
  const int64_t y_stride = d.rows + 3;
  std::vector<float> y(static_cast<size_t>(y_stride * d.n_tok), -1.f);
  moe::cpu::gemm_kquant_rows(m, r0, r1, d.acts.data(), d.act_stride, d.n_tok, y.data(), y_stride);
  for (int64_t t = 0; t < d.n_tok; ++t)
    for (int64_t r = 0; r < d.rows; ++r) {
      const float got = y[static_cast<size_t>(t * y_stride + r)];
      if (r < r0 || r >= r1) {
        EXPECT_EQ(got, -1.f) << "wrote outside the rows at token " << t << " row " << r;
        continue;
      }
      const float want = moe::quant::dot_fast(d.type, m.row(r), d.acts.data() + t * d.act_stride, d.cols);
      EXPECT_EQ(got, want) << "token " << t << " row " << r;
    }
}

class CpuGemm : public testing::TestWithParam<Type> {};

TEST_P(CpuGemm, MatchesDotFastBitForBit) {
  if (!moe::cpu::gemm_kquant_available()) GTEST_SKIP() << "no AVX-512 VNNI (the kernels then defer to quant)";
  const Type t = GetParam();
  check(make(t, 9, 2048, 16, 1.f, 1), 0, 9);
  check(make(t, 13, 768, 35, 3.f, 2), 2, 11);   // two tiles and a remainder of 3 tokens
  check(make(t, 5, 256, 48, 100.f, 3), 0, 5);   // one block per row, large activations
  check(make(t, 6, 2048, 7, 1.f, 4), 1, 6);     // fewer tokens than a tile: all through quant
  check(make(t, 7, 512, 29, 1.f, 6), 0, 7);     // a remainder of 13: an overlapping last tile
}

TEST_P(CpuGemm, DispatchMatchesQuant) {
  const Data d = make(GetParam(), 11, 512, 40, 2.f, 5);
  const moe::quant::Matrix m{d.w.data(), d.type, d.cols, d.rows, d.row_bytes};
  std::vector<float> a(static_cast<size_t>(d.rows * d.n_tok)), b(a.size());
  moe::cpu::matmul_rows(m, 0, d.rows, d.acts.data(), d.act_stride, d.n_tok, a.data(), d.rows);
  moe::quant::matmul_rows_fast(m, 0, d.rows, d.acts.data(), d.act_stride, d.n_tok, b.data(), d.rows);
  EXPECT_EQ(a, b);
}

INSTANTIATE_TEST_SUITE_P(KQuants, CpuGemm, testing::Values(Type::Q4_K, Type::Q6_K),
                         [](const testing::TestParamInfo<Type>& i) { return moe::gguf::type_name(i.param); });

}  // namespace
