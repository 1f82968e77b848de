// Dequantization of the llama.cpp-quantized fixtures against the independent decoder, and the
// reference Q8_0 quantizer reproducing llama-quantize's blocks from their own values.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "moe/gguf.hpp"
#include "moe/quant.hpp"
#include "ref_decode.hpp"

using moe::gguf::Type;
namespace q = moe::quant;

namespace {

std::map<Type, int> check_file(const std::string& name) {
  auto f = moe::gguf::File::open(std::string(MOE_TEST_DATA) + "/" + name);
  std::map<Type, int> seen;
  for (const auto& t : f->tensors()) {
    const int64_t cols = t.ne[0];
    const int64_t rows = t.nelements() / cols;
    const size_t rb = t.row_bytes();
    ++seen[t.type];
    std::vector<float> y(static_cast<size_t>(cols));
    std::vector<double> ref;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* src = t.data + r * rb;
      q::dequantize_row(t.type, src, y.data(), cols);
      EXPECT_TRUE(moe::quant::test::ref_decode(static_cast<uint32_t>(t.type), src, cols, ref)) << t.name;
      double amax = 0;
      for (double v : ref) amax = std::max(amax, std::fabs(v));
      for (int64_t i = 0; i < cols; ++i) {
        // A few fp32 roundings of terms no larger than the row's largest value.
        if (!(std::fabs(y[i] - ref[i]) <= 1e-6 * std::fabs(ref[i]) + 3e-7 * amax)) {
          ADD_FAILURE() << name << " " << t.name << " row " << r << " col " << i << ": " << y[i] << " vs " << ref[i];
          return seen;
        }
      }
    }
  }
  return seen;
}

}  // namespace

TEST(Fixtures, Q8_0ModelDequantizesLikeTheBlockLayout) {
  auto seen = check_file("tiny-qwen3moe-q8_0.gguf");
  EXPECT_EQ(seen[Type::Q8_0], 16);
  EXPECT_EQ(seen[Type::F32], 11);
}

TEST(Fixtures, Q4_K_MModelDequantizesLikeTheBlockLayout) {
  auto seen = check_file("tiny-qwen3moe-q4_k_m.gguf");
  EXPECT_EQ(seen[Type::Q4_K], 8);
  EXPECT_EQ(seen[Type::Q5_K], 2);
  EXPECT_EQ(seen[Type::Q6_K], 2);
  EXPECT_EQ(seen[Type::Q8_0], 4);
  EXPECT_EQ(seen[Type::F32], 11);
}

// llama-quantize maps each block's largest |x| to ±127 with d = amax/127 in fp16; our reference
// quantizer given the dequantized block recovers amax = 127·d exactly, hence the same bytes.
TEST(Fixtures, Q8_0QuantizerReproducesLlamaBlocks) {
  auto f = moe::gguf::File::open(std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q8_0.gguf");
  const auto* t = f->tensor("blk.0.ffn_up_exps.weight");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->type, Type::Q8_0);
  const int64_t cols = t->ne[0];
  const size_t rb = t->row_bytes();
  std::vector<float> y(static_cast<size_t>(cols));
  std::vector<uint8_t> back(rb);
  for (int64_t r = 0; r < t->nelements() / cols; ++r) {
    q::dequantize_row(Type::Q8_0, t->data + r * rb, y.data(), cols);
    q::quantize_row(Type::Q8_0, y.data(), back.data(), cols);
    ASSERT_EQ(0, std::memcmp(back.data(), t->data + r * rb, rb)) << "row " << r;
  }
}

// A real Q4_K matrix through the threaded matmul: fast within the Q8_K activation error of exact.
TEST(Fixtures, FixtureMatmulFastAgreesWithExact) {
  auto f = moe::gguf::File::open(std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q4_k_m.gguf");
  for (const char* name : {"blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight", "output.weight"}) {
    const auto* t = f->tensor(name);
    ASSERT_NE(t, nullptr) << name;
    q::Matrix m{t->data, t->type, t->ne[0], t->nelements() / t->ne[0], t->row_bytes()};
    std::vector<float> x(static_cast<size_t>(m.cols));
    for (int64_t i = 0; i < m.cols; ++i) x[i] = std::sin(0.37 * i) + 0.01f * i;
    std::vector<float> yf(m.rows), ye(m.rows);
    q::ThreadPool pool(2);
    q::matmul(m, x.data(), m.cols, 1, yf.data(), m.rows, q::ActMode::fast, pool);
    q::matmul(m, x.data(), m.cols, 1, ye.data(), m.rows, q::ActMode::exact, pool);
    double amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(static_cast<double>(v)));
    std::vector<float> w(static_cast<size_t>(m.cols));
    for (int64_t r = 0; r < m.rows; ++r) {
      q::dequantize_row(m.type, m.row(r), w.data(), m.cols);
      double wsum = 0;
      for (float v : w) wsum += std::fabs(v);
      // Q8_K rounding moves each activation by at most half of (block amax)/127 <= amax/254.
      EXPECT_NEAR(yf[r], ye[r], amax / 254 * wsum * 1.001 + 1e-4) << name << " row " << r;
    }
  }
}

// Values that lie exactly on a block grid chosen by llama-quantize should be found again by our
// reference quantizer: requantizing every quantized tensor of the Q4_K_M fixture reproduces its
// values with a relative RMS error below 2e-3 and no element off by more than 6% of its row's
// largest value (most rows come back bit for bit; a few land on a neighbouring grid).
TEST(Fixtures, QuantizerRecoversLlamaGrids) {
  auto f = moe::gguf::File::open(std::string(MOE_TEST_DATA) + "/tiny-qwen3moe-q4_k_m.gguf");
  int checked = 0;
  for (const auto& t : f->tensors()) {
    if (t.type == Type::F32) continue;
    const int64_t cols = t.ne[0], rows = t.nelements() / cols;
    const size_t rb = t.row_bytes();
    std::vector<float> y(static_cast<size_t>(cols)), z(static_cast<size_t>(cols));
    std::vector<uint8_t> back(rb);
    double sse = 0, ssx = 0, worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
      q::dequantize_row(t.type, t.data + r * rb, y.data(), cols);
      q::quantize_row(t.type, y.data(), back.data(), cols);
      q::dequantize_row(t.type, back.data(), z.data(), cols);
      double amax = 0;
      for (float v : y) amax = std::max(amax, std::fabs(static_cast<double>(v)));
      for (int64_t i = 0; i < cols; ++i) {
        double e = std::fabs(static_cast<double>(z[i]) - y[i]);
        sse += e * e;
        ssx += static_cast<double>(y[i]) * y[i];
        if (amax > 0) worst = std::max(worst, e / amax);
      }
    }
    EXPECT_LE(std::sqrt(sse / ssx), 2e-3) << t.name;
    EXPECT_LE(worst, 0.06) << t.name;
    ++checked;
  }
  EXPECT_EQ(checked, 16);
}
