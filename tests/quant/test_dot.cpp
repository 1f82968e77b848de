// Dot products and matmul: exact mode against a double-precision reference, fast mode within the
// error its 8-bit (or 16-bit) activations allow, every SIMD table against the scalar one, threads.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "../../src/quant/internal.hpp"
#include "moe/error.hpp"
#include "moe/quant.hpp"
#include "ref_decode.hpp"

using moe::gguf::Type;
namespace q = moe::quant;
namespace qd = moe::quant::detail;

namespace {

const Type kWeights[] = {Type::F32, Type::F16, Type::BF16, Type::Q4_0, Type::Q4_1, Type::Q5_0, Type::Q5_1,
                         Type::Q8_0, Type::Q2_K, Type::Q3_K, Type::Q4_K, Type::Q5_K, Type::Q6_K};

const char* name_of(Type t) {
  switch (t) {
    case Type::F32: return "F32"; case Type::F16: return "F16"; case Type::BF16: return "BF16";
    case Type::Q4_0: return "Q4_0"; case Type::Q4_1: return "Q4_1"; case Type::Q5_0: return "Q5_0";
    case Type::Q5_1: return "Q5_1"; case Type::Q8_0: return "Q8_0"; case Type::Q2_K: return "Q2_K";
    case Type::Q3_K: return "Q3_K"; case Type::Q4_K: return "Q4_K"; case Type::Q5_K: return "Q5_K";
    case Type::Q6_K: return "Q6_K"; default: return "other";
  }
}

size_t rbytes(Type t, int64_t n) {
  auto id = static_cast<uint32_t>(t);
  return static_cast<size_t>(n / moe::quant::test::ref_block_elems(id)) *
         static_cast<size_t>(moe::quant::test::ref_block_bytes(id));
}

struct Problem {
  Type type;
  int64_t rows, cols;
  size_t row_bytes;
  std::vector<uint8_t> w;
  std::vector<std::vector<double>> wd;  // rows decoded by the independent decoder
  q::Matrix m() const { return q::Matrix{w.data(), type, cols, rows, row_bytes}; }
};

Problem make_problem(Type t, int64_t rows, int64_t cols, std::mt19937& rng) {
  Problem p{t, rows, cols, rbytes(t, cols), {}, {}};
  p.w.resize(p.row_bytes * static_cast<size_t>(rows));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> row(static_cast<size_t>(cols));
  p.wd.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = nd(rng) * 0.05f;
    q::quantize_row(t, row.data(), p.w.data() + r * p.row_bytes, cols);
    EXPECT_TRUE(moe::quant::test::ref_decode(static_cast<uint32_t>(t), p.w.data() + r * p.row_bytes, cols, p.wd[r]));
  }
  return p;
}

std::vector<float> make_x(int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = nd(rng) * scale;
  return x;
}

// Bound on |fast - exact| for one row: the activation's quantization error per element times |w|,
// plus float rounding of both sums.
//  Q8_K: q = round(x·127/|mx|) with fp32 d -> |x - d·q| <= d/2 (d = amax/127, a little slack for
//        the rounding of iscale and d).
//  Q8_0/Q8_1: the same rounding but the stored d is fp16 (relative error <= 2^-11, times |q| <= 127).
//  F16: half an fp16 ulp <= 2^-11·|x| (plus subnormal spacing); BF16: 2^-8·|x|; F32: none.
double fast_bound(Type t, const std::vector<double>& w, const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  double bound = 0, mag = 0;
  for (int64_t i = 0; i < n; ++i) mag += std::fabs(w[i] * x[i]);
  Type a = q::act_type(t);
  if (a == Type::Q8_K || a == Type::Q8_0 || a == Type::Q8_1) {
    const int blk = a == Type::Q8_K ? 256 : 32;
    for (int64_t b = 0; b < n / blk; ++b) {
      double amax = 0, wsum = 0;
      for (int64_t i = b * blk; i < (b + 1) * blk; ++i) { amax = std::max(amax, std::fabs(static_cast<double>(x[i]))); wsum += std::fabs(w[i]); }
      double d = amax / 127;
      double per = a == Type::Q8_K ? d * 0.5 * (1 + 1e-5) : d * (0.5 + 127.0 / 2048);
      bound += per * wsum;
    }
  } else if (a == Type::F16) {
    for (int64_t i = 0; i < n; ++i) bound += std::fabs(w[i]) * (std::fabs(x[i]) / 2048 + 6e-8);
  } else if (a == Type::BF16) {
    for (int64_t i = 0; i < n; ++i) bound += std::fabs(w[i]) * std::fabs(x[i]) / 256;
  }
  return bound + 1e-5 * mag;
}

double ref_dot(const std::vector<double>& w, const std::vector<float>& x) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += w[i] * static_cast<double>(x[i]);
  return s;
}
double mag_dot(const std::vector<double>& w, const std::vector<float>& x) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += std::fabs(w[i] * static_cast<double>(x[i]));
  return s;
}

uint32_t seed() { return std::random_device{}(); }

}  // namespace

class Dot : public ::testing::TestWithParam<Type> {};

// Exact mode: fp32 arithmetic on exactly decoded weights. The error of an fp32 dot product is bounded
// relative to Σ|w·x| (its condition); we require <= 1e-5 of max(|ref|, Σ|w·x|/100), i.e. 1e-5
// relative to the result unless the sum cancels to below 1% of its terms.
TEST_P(Dot, ExactMatchesDoubleReference) {
  const Type t = GetParam();
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << name_of(t) << " seed " << s);
  std::mt19937 rng(s);
  for (int64_t cols : {256, 768, 2048}) {
    Problem p = make_problem(t, 9, cols, rng);
    std::vector<float> x = make_x(cols, rng);
    for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
      const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
      for (int64_t r = 0; r < p.rows; ++r) {
        double ref = ref_dot(p.wd[r], x), mag = mag_dot(p.wd[r], x);
        float got = k.dot_exact[static_cast<size_t>(t)](p.w.data() + r * p.row_bytes, x.data(), cols);
        EXPECT_LE(std::fabs(got - ref), 1e-5 * std::max(std::fabs(ref), mag / 100))
            << k.name << " cols " << cols << " row " << r << " got " << got << " ref " << ref;
      }
    }
  }
}

// Fast mode against the double reference: the difference must be explained by the activation
// quantization (fast_bound), for every kernel table.
TEST_P(Dot, FastWithinActivationQuantizationError) {
  const Type t = GetParam();
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << name_of(t) << " seed " << s);
  std::mt19937 rng(s);
  const int64_t cols = 2048;
  Problem p = make_problem(t, 7, cols, rng);
  for (float xscale : {1.f, 1e-3f, 40.f}) {
    std::vector<float> x = make_x(cols, rng, xscale);
    x[5] = 0;  // a few exact zeros and a large outlier, as in real activations
    x[77] = 12.f * xscale;
    std::vector<uint8_t> act(q::act_row_bytes(t, cols));
    q::quantize_act(t, x.data(), act.data(), cols);
    for (int64_t r = 0; r < p.rows; ++r) {
      double ref = ref_dot(p.wd[r], x);
      float got = q::dot_fast(t, p.w.data() + r * p.row_bytes, act.data(), cols);
      EXPECT_LE(std::fabs(got - ref), fast_bound(t, p.wd[r], x)) << "row " << r << " scale " << xscale;
      float ex = q::dot_exact(t, p.w.data() + r * p.row_bytes, x.data(), cols);
      EXPECT_LE(std::fabs(got - ex), fast_bound(t, p.wd[r], x) + 1e-5 * mag_dot(p.wd[r], x)) << "row " << r;
    }
  }
}

// Every SIMD table quantizes activations to the same bytes and returns the same float as the scalar
// table in fast mode (same integers, same float order).
TEST_P(Dot, SimdFastIdenticalToScalar) {
  const Type t = GetParam();
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << name_of(t) << " seed " << s);
  std::mt19937 rng(s);
  const qd::Kernels& sc = qd::kernels(qd::Isa::scalar);
  const Type a = q::act_type(t);
  for (int64_t cols : {256, 512, 768, 2304}) {  // 2304: a block count that is not a multiple of 8
    Problem p = make_problem(t, 5, cols, rng);
    for (float xscale : {1.f, 1e-4f, 1e4f}) {
      // Beyond 65504 fp16 activations (and Q8_1's fp16 d·Σq) overflow, as in llama.cpp.
      if ((t == Type::F16 || t == Type::Q4_1 || t == Type::Q5_1) && xscale > 100) xscale = 100;
      std::vector<float> x = make_x(cols, rng, xscale);
      for (int64_t i = 0; i < cols; i += 97) x[i] = -x[i] * 3;  // ties in |x| with opposite signs
      x[1] = 0.5f * xscale;
      x[2] = -0.5f * xscale;
      std::vector<uint8_t> act_s(q::act_row_bytes(t, cols));
      sc.quantize_act[static_cast<size_t>(a)](x.data(), act_s.data(), cols);
      for (int isa = 1; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
        const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
        std::vector<uint8_t> act_k(act_s.size(), 0xAB);
        k.quantize_act[static_cast<size_t>(a)](x.data(), act_k.data(), cols);
        ASSERT_EQ(0, std::memcmp(act_s.data(), act_k.data(), act_s.size())) << k.name << " activation bytes, cols " << cols;
        for (int64_t r = 0; r < p.rows; ++r) {
          const uint8_t* wr = p.w.data() + r * p.row_bytes;
          float want = sc.dot_fast[static_cast<size_t>(t)](wr, act_s.data(), cols);
          float got = k.dot_fast[static_cast<size_t>(t)](wr, act_s.data(), cols);
          if (t == Type::F32) {
            // F32 pairs with F32 activations: the SIMD kernels use FMA and more accumulators.
            double mag = mag_dot(p.wd[r], x) + 1e-30;
            EXPECT_LE(std::fabs(got - want), 2e-6 * mag) << k.name;
          } else {
            EXPECT_EQ(want, got) << k.name << " cols " << cols << " row " << r;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllWeights, Dot, ::testing::ValuesIn(kWeights),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// matmul over the pool equals the single-row dot products, for odd row counts, a last thread chunk
// that is partial, several tokens and padded output strides (the padding must stay untouched).
// Runs `body` once per kernel table by capping the level through MOE_ISA.
template <typename F>
void for_each_isa(F body) {
  const char* old = std::getenv("MOE_ISA");
  const std::string saved = old ? old : "";
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    setenv("MOE_ISA", isa, 1);
    qd::reload_isa_from_env();
    SCOPED_TRACE(q::isa_name());
    body();
  }
  if (old) setenv("MOE_ISA", saved.c_str(), 1);
  else unsetenv("MOE_ISA");
  qd::reload_isa_from_env();
}

TEST(Matmul, ThreadsAndChunksMatchRowDots) {
  for_each_isa([] {
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << "seed " << s);
  std::mt19937 rng(s);
  for (Type t : {Type::Q4_K, Type::Q8_0, Type::Q6_K, Type::F32, Type::Q5_1, Type::Q5_K}) {
    for (int64_t rows : {1, 17, 37, 301}) {
      Problem p = make_problem(t, rows, 512, rng);
      const int64_t n_tok = 5, x_stride = 512 + 3, y_stride = rows + 7;
      std::vector<float> X = make_x(x_stride * n_tok, rng);
      for (int threads : {1, 2, 3}) {
        q::ThreadPool pool(threads);
        for (q::ActMode mode : {q::ActMode::fast, q::ActMode::exact}) {
          for (int64_t nt : {int64_t{1}, n_tok}) {
            std::vector<float> Y(static_cast<size_t>(y_stride * n_tok), -777.f);
            q::matmul(p.m(), X.data(), x_stride, nt, Y.data(), y_stride, mode, pool);
            for (int64_t tk = 0; tk < n_tok; ++tk) {
              const float* x = X.data() + tk * x_stride;
              std::vector<uint8_t> act(q::act_row_bytes(t, 512));
              q::quantize_act(t, x, act.data(), 512);
              for (int64_t r = 0; r < y_stride; ++r) {
                float got = Y[tk * y_stride + r];
                if (tk >= nt || r >= rows) {
                  ASSERT_EQ(got, -777.f) << "wrote outside the output";
                  continue;
                }
                const uint8_t* wr = p.w.data() + r * p.row_bytes;
                float want = mode == q::ActMode::fast ? q::dot_fast(t, wr, act.data(), 512) : q::dot_exact(t, wr, x, 512);
                if (mode == q::ActMode::exact && nt > 1) {
                  // Several tokens share one dequantized row: fp32 rounding differs from dot_exact.
                  std::vector<float> xv(x, x + 512);
                  ASSERT_LE(std::fabs(got - want), 2e-6 * mag_dot(p.wd[r], xv) + 1e-30) << name_of(t) << " row " << r;
                } else {
                  ASSERT_EQ(got, want) << name_of(t) << " rows " << rows << " threads " << threads << " tok " << tk << " row " << r;
                }
              }
            }
          }
        }
      }
    }
  }
  });
}

TEST(Matmul, RowRangeKernelsCoverOnlyTheirRows) {
  std::mt19937 rng(seed());
  Problem p = make_problem(Type::Q4_K, 40, 256, rng);
  std::vector<float> X = make_x(256 * 3, rng);
  std::vector<uint8_t> acts(q::act_row_bytes(Type::Q4_K, 256) * 3);
  for (int t = 0; t < 3; ++t) q::quantize_act(Type::Q4_K, X.data() + 256 * t, acts.data() + t * q::act_row_bytes(Type::Q4_K, 256), 256);
  std::vector<float> Y(3 * 40, 5.f), Ye(3 * 40, 5.f);
  q::Matrix m = p.m();
  q::matmul_rows_fast(m, 11, 29, acts.data(), q::act_row_bytes(Type::Q4_K, 256), 3, Y.data(), 40);
  q::matmul_rows_exact(m, 11, 29, X.data(), 256, 3, Ye.data(), 40);
  for (int t = 0; t < 3; ++t)
    for (int r = 0; r < 40; ++r) {
      if (r < 11 || r >= 29) {
        EXPECT_EQ(Y[t * 40 + r], 5.f);
        EXPECT_EQ(Ye[t * 40 + r], 5.f);
      } else {
        double ref = ref_dot(p.wd[r], std::vector<float>(X.begin() + 256 * t, X.begin() + 256 * (t + 1)));
        EXPECT_NEAR(Ye[t * 40 + r], ref, 1e-4 * (std::fabs(ref) + 1));
        EXPECT_NE(Y[t * 40 + r], 5.f);
      }
    }
}

TEST(ThreadPool, EveryTaskOnceAndReusable) {
  for (int threads : {1, 2, 4}) {
    q::ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad_thread{0};
        pool.run(n, [&](int64_t task, int th) {
          hits[task].fetch_add(1);
          if (th < 0 || th >= threads) bad_thread.fetch_add(1);
        });
        for (auto& h : hits) ASSERT_EQ(h.load(), 1);
        ASSERT_EQ(bad_thread.load(), 0);
      }
    }
  }
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
  q::ThreadPool pool(3);
  EXPECT_THROW(pool.run(100, [](int64_t task, int) {
    if (task == 42) throw moe::Error(moe::Exit::inference, "task 42");
  }), moe::Error);
  std::atomic<int> n{0};
  pool.run(10, [&](int64_t, int) { n.fetch_add(1); });  // still usable afterwards
  EXPECT_EQ(n.load(), 10);
}

TEST(Isa, EnvironmentCapsTheLevel) {
  const char* old = std::getenv("MOE_ISA");
  std::string saved = old ? old : "";
  setenv("MOE_ISA", "scalar", 1);
  qd::reload_isa_from_env();
  EXPECT_STREQ(q::isa_name(), "scalar");
  setenv("MOE_ISA", "avx2", 1);
  qd::reload_isa_from_env();
  EXPECT_STREQ(q::isa_name(), qd::cpu_isa() >= qd::Isa::avx2 ? "avx2" : "scalar");
  unsetenv("MOE_ISA");
  qd::reload_isa_from_env();
  EXPECT_STREQ(q::isa_name(), qd::kernels(qd::cpu_isa()).name);
  if (old) setenv("MOE_ISA", saved.c_str(), 1);
  qd::reload_isa_from_env();
}

// Blocks of random bytes (every code, every scale bit pattern, Q8_0 codes of -128, negative Q6_K
// scales down to -128) with finite fp16 scale fields: every table must agree with the scalar one
// (fast: bit for bit; exact: within fp32 rounding of the double reference).
TEST(Dot, RandomBlockBytesAllTablesAgree) {
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << "seed " << s);
  std::mt19937 rng(s);
  struct Layout { Type t; std::vector<int> half_offsets; };
  const Layout layouts[] = {{Type::Q4_0, {0}}, {Type::Q4_1, {0, 2}}, {Type::Q5_0, {0}}, {Type::Q5_1, {0, 2}},
                            {Type::Q8_0, {0}}, {Type::Q2_K, {80, 82}}, {Type::Q3_K, {108}}, {Type::Q4_K, {0, 2}},
                            {Type::Q5_K, {0, 2}}, {Type::Q6_K, {208}}};
  std::uniform_real_distribution<float> ud(0.001f, 0.1f);
  const qd::Kernels& sc = qd::kernels(qd::Isa::scalar);
  for (const auto& lay : layouts) {
    const uint32_t id = static_cast<uint32_t>(lay.t);
    const int be = moe::quant::test::ref_block_elems(id), bb = moe::quant::test::ref_block_bytes(id);
    for (int64_t cols : {256, 1792}) {
      std::vector<uint8_t> w(rbytes(lay.t, cols));
      for (auto& v : w) v = static_cast<uint8_t>(rng());
      for (int64_t b = 0; b < cols / be; ++b)
        for (int off : lay.half_offsets) {
          uint16_t h = q::f32_to_fp16(ud(rng));
          std::memcpy(w.data() + b * bb + off, &h, 2);
        }
      std::vector<double> wd;
      ASSERT_TRUE(moe::quant::test::ref_decode(id, w.data(), cols, wd));
      std::vector<float> x = make_x(cols, rng);
      std::vector<uint8_t> act(q::act_row_bytes(lay.t, cols));
      sc.quantize_act[static_cast<size_t>(q::act_type(lay.t))](x.data(), act.data(), cols);
      const float want = sc.dot_fast[id](w.data(), act.data(), cols);
      const double ref = ref_dot(wd, x), mag = mag_dot(wd, x);
      EXPECT_LE(std::fabs(want - ref), fast_bound(lay.t, wd, x)) << name_of(lay.t);
      for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
        const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
        EXPECT_EQ(want, k.dot_fast[id](w.data(), act.data(), cols)) << k.name << " " << name_of(lay.t) << " cols " << cols;
        float ex = k.dot_exact[id](w.data(), x.data(), cols);
        EXPECT_LE(std::fabs(ex - ref), 1e-5 * std::max(std::fabs(ref), mag / 100)) << k.name << " " << name_of(lay.t);
      }
    }
  }
}

// The multi-row kernels (prefill) give each row exactly what the single-row kernel gives.
TEST(Dot, MultiRowKernelsMatchSingleRow) {
  const uint32_t s = seed();
  SCOPED_TRACE(::testing::Message() << "seed " << s);
  std::mt19937 rng(s);
  const qd::Kernels& sc = qd::kernels(qd::Isa::scalar);
  for (Type t : kWeights) {
    const int64_t cols = 2304;  // nine super-blocks: the batched path and a tail
    Problem p = make_problem(t, 1, cols, rng);
    const size_t stride = q::act_row_bytes(t, cols) + 64;  // a stride larger than a row
    std::vector<uint8_t> acts(stride * 4);
    for (int a = 0; a < 4; ++a) {
      std::vector<float> x = make_x(cols, rng, a + 0.5f);
      q::quantize_act(t, x.data(), acts.data() + a * stride, cols);
    }
    for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
      const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
      auto multi = k.dot_fast_multi[static_cast<size_t>(t)];
      if (!multi) continue;
      for (int na = 1; na <= 4; ++na) {
        float out[8];
        std::fill(out, out + 8, -1.f);
        multi(p.w.data(), acts.data(), stride, na, cols, out, 2);
        for (int a = 0; a < 4; ++a) {
          float want = sc.dot_fast[static_cast<size_t>(t)](p.w.data(), acts.data() + a * stride, cols);
          if (a < na) {
            EXPECT_EQ(out[2 * a], want) << k.name << " " << name_of(t) << " na " << na << " row " << a;
          } else {
            EXPECT_EQ(out[2 * a], -1.f);
          }
          EXPECT_EQ(out[2 * a + 1], -1.f);
        }
      }
    }
  }
}

// Every table's row dequantizer (exact-mode prefill) against the independent decoder.
TEST(Dot, RowDequantizersMatchDecoder) {
  std::mt19937 rng(seed());
  for (Type t : kWeights) {
    Problem p = make_problem(t, 3, 768, rng);
    for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
      const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
      ASSERT_NE(k.dequant_row[static_cast<size_t>(t)], nullptr) << k.name << " " << name_of(t);
      for (int64_t r = 0; r < p.rows; ++r) {
        std::vector<float> y(768);
        k.dequant_row[static_cast<size_t>(t)](p.w.data() + r * p.row_bytes, y.data(), 768);
        double amax = 0;
        for (double v : p.wd[r]) amax = std::max(amax, std::fabs(v));
        for (int i = 0; i < 768; ++i)
          ASSERT_LE(std::fabs(y[i] - p.wd[r][i]), 1e-6 * std::fabs(p.wd[r][i]) + 3e-7 * amax) << k.name << " " << name_of(t) << " " << i;
      }
    }
  }
}

TEST(ThreadPool, NestedRunExecutesInline) {
  q::ThreadPool pool(2);
  std::atomic<int> inner{0};
  std::atomic<int> wrong_thread{0};
  pool.run(8, [&](int64_t, int outer) {
    pool.run(5, [&](int64_t, int th) {
      inner.fetch_add(1);
      if (th != outer) wrong_thread.fetch_add(1);  // inline tasks keep the outer task's thread index
    });
  });
  EXPECT_EQ(wrong_thread.load(), 0);
  EXPECT_EQ(inner.load(), 40);
}

// The fp32 block kernel of exact-mode prefill, every shape up to 4x4 and a length with a tail.
TEST(Dot, F32BlockKernelsMatchDoubleReference) {
  std::mt19937 rng(seed());
  const int64_t n = 2048 + 13;
  std::vector<std::vector<float>> w(4), x(4);
  for (auto& v : w) v = make_x(n, rng);
  for (auto& v : x) v = make_x(n, rng);
  for (int isa = 0; isa <= static_cast<int>(qd::cpu_isa()); ++isa) {
    const qd::Kernels& k = qd::kernels(static_cast<qd::Isa>(isa));
    if (!k.f32_block) continue;
    for (int nr = 1; nr <= 4; ++nr)
      for (int nt = 1; nt <= 4; ++nt) {
        const float* wp[4] = {w[0].data(), w[1].data(), w[2].data(), w[3].data()};
        const float* xp[4] = {x[0].data(), x[1].data(), x[2].data(), x[3].data()};
        std::vector<float> out(4 * 6, -9.f);
        k.f32_block(wp, nr, xp, nt, n, out.data(), 6);
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 6; ++r) {
            if (t >= nt || r >= nr) {
              EXPECT_EQ(out[t * 6 + r], -9.f);
              continue;
            }
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < n; ++i) {
              ref += static_cast<double>(w[r][i]) * x[t][i];
              mag += std::fabs(static_cast<double>(w[r][i]) * x[t][i]);
            }
            EXPECT_LE(std::fabs(out[t * 6 + r] - ref), 1e-6 * mag) << k.name << " " << nr << "x" << nt;
          }
      }
  }
}
