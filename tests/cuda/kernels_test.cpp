// Each CUDA kernel against its CPU twin on fresh random inputs (outputs poisoned with NaN first,
// odd sizes). The twins use quant::dequantize_row for the weights and double-precision sums.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "gpu.hpp"
#include "moe/sampler.hpp"

using namespace gpu_test;
namespace k = moe::cuda::k;
using moe::gguf::Type;

namespace {

int64_t cols_for(Type t, int64_t want) {
  const int64_t b = std::max<int64_t>(32, moe::gguf::type_traits(t).block_elems);
  return (want + b - 1) / b * b;
}

TEST(CudaKernels, GemvEveryTypeMatchesDequantizedDot) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  // the K-quants run on the tensor cores by default, a block's tile through shared memory at padded row
  // strides (MOE_CUDA_ROWS_PAD=0: the global stride; MOE_CUDA_GEMV_SMEM=0: loaded from global memory);
  // MOE_CUDA_TC=0 checks their SIMT kernels too
  for (const char* mode : {"tc", "tc-unpadded", "tc-global", "simt"})
  for (Type t : all_types()) {
    SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(t) << " " << mode);
    setenv("MOE_CUDA_TC", mode[0] == 't' ? "1" : "0", 1);
    setenv("MOE_CUDA_GEMV_SMEM", std::string(mode) == "tc-global" ? "0" : "1", 1);
    setenv("MOE_CUDA_ROWS_PAD", std::string(mode) == "tc-unpadded" ? "0" : "1", 1);
    const int64_t cols = cols_for(t, 768), rows = 37;
    QMatrix W(t, rows, cols, rng);
    std::vector<float> x = randn(cols, rng);
    Dev<float> dx(x), dy(rows);
    k::GemvOut out{W.mat(), dy.p};
    ok(k::gemv(&out, 1, dx.p, nullptr, 0.f, false, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> y = dy.get();
    for (int64_t r = 0; r < rows; ++r)
      expect_close(y[r], dot(&W.deq[r * cols], x.data(), cols), abs_dot(&W.deq[r * cols], x.data(), cols), "gemv", r);
  }
  unsetenv("MOE_CUDA_TC");
  unsetenv("MOE_CUDA_GEMV_SMEM");
  unsetenv("MOE_CUDA_ROWS_PAD");
}

// Matrices of more tiles than a wave of blocks (the LM head) run one tile per warp (kWarpTiles): every
// K-quant, an uneven last tile, accumulate into y, and the weights said to be in L2 already; tiles of 2
// and 5 super-blocks, through shared memory (LmPipe: fewer and more super-blocks per tile than its
// stages) and with MOE_CUDA_LM_PIPE=0 from global memory; the last round's tiles split over pairs of
// warps (LmOrder: 2, 3 and 5 super-blocks split 1 + 1, 1 + 2, 2 + 3) and with MOE_CUDA_LM_HALVES=0 whole.
TEST(CudaKernels, GemvManyTilesOnePerWarpMatchDequantizedDot) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  // the kernel's warps: two blocks of 8 per SM. Tiles: fewer than the warps (each a half tile for a pair of
  // warps), one round and a quarter (the last quarter in halves), one round and three quarters (whole tiles)
  const int64_t warps = 2 * 8 * static_cast<int64_t>(k::sm_count());
  struct Case {
    const char *pipe, *halves;
    int64_t rows, cols;
  };
  std::vector<Case> cases;
  const int64_t few = 6 * 16 * static_cast<int64_t>(k::sm_count()) + 37;
  for (const char* pipe : {"1", "0"})
    for (int64_t cols : {512, 1280}) cases.push_back({pipe, "1", few, cols});
  for (const char* halves : {"1", "0"})
    for (int64_t q : {1, 3}) cases.push_back({"1", halves, 16 * (warps + q * warps / 4) - 5, q == 1 ? 768 : 512});
  for (const Case& c : cases)
  for (Type t : {Type::Q4_K, Type::Q5_K, Type::Q6_K}) {
    const int64_t rows = c.rows, cols = c.cols;
    SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(t) << " rows " << rows << " cols " << cols
                                      << " MOE_CUDA_LM_PIPE=" << c.pipe << " MOE_CUDA_LM_HALVES=" << c.halves);
    setenv("MOE_CUDA_LM_PIPE", c.pipe, 1);
    setenv("MOE_CUDA_LM_HALVES", c.halves, 1);
    QMatrix W(t, rows, cols, rng);
    std::vector<float> x = randn(cols, rng), y0 = randn(rows, rng);
    Dev<float> dx(x), dy(y0);
    k::GemvOut out{W.mat(), dy.p};
    ok(k::gemv(&out, 1, dx.p, nullptr, 0.f, true, nullptr, nullptr, nullptr, true));
    ok(cudaDeviceSynchronize());
    std::vector<float> y = dy.get();
    for (int64_t r = 0; r < rows; ++r)
      expect_close(y[r], y0[r] + dot(&W.deq[r * cols], x.data(), cols),
                   std::fabs(y0[r]) + abs_dot(&W.deq[r * cols], x.data(), cols), "gemv", r);
  }
  unsetenv("MOE_CUDA_LM_PIPE");
  unsetenv("MOE_CUDA_LM_HALVES");
}

TEST(CudaKernels, GemvFusedNormThreeMatricesAndAccumulate) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t cols = 512;
  QMatrix A(Type::Q4_K, 45, cols, rng), B(Type::Q6_K, 13, cols, rng), C(Type::Q8_0, 7, cols, rng);
  std::vector<float> x = randn(cols, rng, 3.f), w = randn(cols, rng), y0 = randn(45, rng);
  const float eps = 1e-6f;
  Dev<float> dx(x), dw(w), ya(y0), yb(13), yc(7);
  k::GemvOut outs[3] = {{A.mat(), ya.p}, {B.mat(), yb.p}, {C.mat(), yc.p}};
  ok(k::gemv(outs, 3, dx.p, dw.p, eps, false, nullptr));
  ok(cudaDeviceSynchronize());
  std::vector<float> h = rmsnorm(x.data(), w.data(), cols, eps);
  const QMatrix* mats[3] = {&A, &B, &C};
  Dev<float>* ys[3] = {&ya, &yb, &yc};
  for (int m = 0; m < 3; ++m) {
    std::vector<float> y = ys[m]->get();
    for (int64_t r = 0; r < mats[m]->rows; ++r) {
      const float* row = &mats[m]->deq[r * cols];
      expect_close(y[r], dot(row, h.data(), cols), abs_dot(row, h.data(), cols), "fused", r);
    }
  }
  // the same with an L2 hint over rows past the end of its buffer (capped by max_rows: no fault, same y)
  {
    Dev<uint8_t> rows(std::vector<uint8_t>(64 * 256, 1));
    Dev<int32_t> pos(std::vector<int32_t>{1000});
    k::L2Hint hint;
    hint.base[0] = rows.p;
    hint.base[1] = rows.p + 32 * 256;
    hint.pos = pos.p;
    hint.row_bytes = 256;
    hint.max_rows = 32;
    Dev<float> yh(45);
    k::GemvOut one{A.mat(), yh.p};
    ok(k::gemv(&one, 1, dx.p, dw.p, eps, false, nullptr, &hint));
    ok(cudaDeviceSynchronize());
    // A alone takes the tensor-core kernel (with B and C it went through the SIMT one): same bound
    const std::vector<float> b = yh.get();
    for (int64_t r = 0; r < 45; ++r) {
      const float* row = &A.deq[r * cols];
      expect_close(b[r], dot(row, h.data(), cols), abs_dot(row, h.data(), cols), "hint", r);
    }
  }
  // accumulate: y += W x
  ya.put(y0);
  ok(k::gemv(outs, 1, dx.p, nullptr, 0.f, true, nullptr));
  ok(cudaDeviceSynchronize());
  std::vector<float> y = ya.get();
  for (int64_t r = 0; r < 45; ++r) {
    const float* row = &A.deq[r * cols];
    expect_close(y[r], y0[r] + dot(row, x.data(), cols), std::fabs(y0[r]) + abs_dot(row, x.data(), cols), "acc", r);
  }
}

TEST(CudaKernels, GemmEveryTypeMatchesDequantizedProduct) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (Type t : all_types()) {
    SCOPED_TRACE(moe::gguf::type_name(t));
    const int64_t cols = cols_for(t, 512), rows = 71, ntok = 67;
    QMatrix W(t, rows, cols, rng);
    std::vector<float> X = randn(ntok * cols, rng);
    const int y_stride = rows + 3;
    Dev<float> dX(X), dY(ntok * y_stride);
    ok(k::gemm(W.mat(), dX.p, static_cast<int>(cols), static_cast<int>(ntok), dY.p, y_stride, false, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> Y = dY.get();
    for (int64_t tk = 0; tk < ntok; ++tk)
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = &W.deq[r * cols];
        expect_close(Y[tk * y_stride + r], dot(row, &X[tk * cols], cols), abs_dot(row, &X[tk * cols], cols), "gemm",
                     tk * rows + r);
      }
    // columns past `rows` in each output row stay untouched (NaN poison)
    EXPECT_TRUE(std::isnan(Y[rows])) << "gemm wrote outside its rows";
    // accumulate: Y += W X (once more)
    ok(k::gemm(W.mat(), dX.p, static_cast<int>(cols), static_cast<int>(ntok), dY.p, y_stride, true, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> Y2 = dY.get();
    for (int64_t tk = 0; tk < ntok; ++tk)
      for (int64_t r = 0; r < rows; ++r)
        EXPECT_NEAR(Y2[tk * y_stride + r], 2.f * Y[tk * y_stride + r], 1e-6 * (1 + std::fabs(Y[tk * y_stride + r])))
            << "accumulate, token " << tk << " row " << r;
  }
}

TEST(CudaKernels, EmbedRowsDequantizesTheChosenRows) {
  REQUIRE_GPU();
  std::mt19937_64 rng(fresh_seed());
  for (Type t : {Type::Q4_K, Type::Q6_K, Type::Q8_0, Type::F16}) {
    QMatrix W(t, 50, 256, rng);
    std::vector<int32_t> ids = {3, 49, 0, 17, 17};
    Dev<int32_t> di(ids);
    Dev<float> out(ids.size() * 256);
    ok(k::embed_rows(W.mat(), di.p, 5, out.p, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> o = out.get();
    for (size_t i = 0; i < ids.size(); ++i)
      for (int c = 0; c < 256; ++c) ASSERT_EQ(o[i * 256 + c], W.deq[ids[i] * 256 + c]) << moe::gguf::type_name(t);
  }
}

// A decode token's first launch (k::token_start): the embedding row and the RoPE table of its position, the
// same floats as embed_rows (checked against the CPU's dequantization) and rope_table.
TEST(CudaKernels, TokenStartIsEmbedAndRopeTable) {
  REQUIRE_GPU();
  std::mt19937_64 rng(fresh_seed());
  for (Type t : {Type::Q4_K, Type::Q6_K, Type::Q8_0, Type::BF16})
  for (int yarn = 0; yarn < 2; ++yarn) {
    SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(t) << " yarn " << yarn);
    const int cols = 2048, hd = 128, id = 77, pos = 40961;
    QMatrix W(t, 100, cols, rng);
    k::Rope rope;
    rope.theta_scale = std::pow(1e6f, -2.f / hd);
    if (yarn) {
      rope.yarn = 1;
      rope.freq_scale = 0.25f;
      rope.corr_lo = 10.f;
      rope.corr_hi = 41.f;
      rope.mscale = 1.1f;
    }
    Dev<int32_t> tok(std::vector<int32_t>{id}), dpos(std::vector<int32_t>{pos});
    Dev<float> x(cols), cs(hd), x2(cols), cs2(hd);
    ok(k::token_start(W.mat(), tok.p, x.p, dpos.p, rope, hd, cs.p, nullptr));
    ok(k::embed_rows(W.mat(), tok.p, 1, x2.p, nullptr));
    ok(k::rope_table(dpos.p, 1, rope, hd, cs2.p, nullptr));
    ok(cudaDeviceSynchronize());
    const std::vector<float> a = x.get(), b = cs.get(), b2 = cs2.get();
    for (int c = 0; c < cols; ++c) ASSERT_EQ(a[c], W.deq[static_cast<size_t>(id) * cols + c]) << c;
    EXPECT_EQ(std::memcmp(b.data(), b2.data(), hd * sizeof(float)), 0) << "the RoPE table";
    EXPECT_EQ(std::memcmp(a.data(), x2.get().data(), cols * sizeof(float)), 0) << "the embedding";
  }
}

// The device sampler against run::Sampler (the host's, src/run/sampler.cpp) on the same logits, window and uniform:
// vocabularies of one block to 75, logits with ties (a coarse grid) and a peak, top-k from 1 to 128 (and past
// the vocabulary), top-p, min-p, penalties above and below 1 with windows longer than the history, ids outside
// the vocabulary in the window, greedy with a penalty, two-valued logits (more ties at a block's threshold than
// its candidate sort takes); one scratch for every launch (its counters left at zero).
TEST(CudaKernels, SampleDrawsAsTheHostSampler) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  using moe::run::SamplerParams;
  auto sp = [](float t, int k, float top_p, float min_p, float pen, int last_n) {
    SamplerParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = pen;
    p.repeat_last_n = last_n;
    p.seed = 0;
    return p;
  };
  const std::vector<SamplerParams> sets = {
      sp(0.7f, 40, 1.f, 0.f, 1.f, 64),    sp(1.3f, 128, 0.9f, 0.f, 1.f, 64),   sp(0.5f, 7, 1.f, 0.1f, 1.3f, 64),
      sp(0.f, 40, 1.f, 0.f, 1.5f, 1024),  sp(1.f, 1, 1.f, 0.f, 1.f, 64),       sp(2.f, 128, 0.5f, 0.05f, 0.8f, 300),
      sp(0.9f, 100, 0.97f, 0.f, 1.1f, 5), sp(3.f, 64, 1.f, 0.2f, 1.2f, 1024)};
  Dev<unsigned char> scratch(std::vector<unsigned char>(k::kSampleScratchBytes, 0));
  Dev<int32_t> out(2), chain(2);
  Dev<double> du(2);
  int cases = 0;
  for (int V : {151936, 4099, 2048, 2049, 37}) {
    Dev<float> dx(static_cast<size_t>(V));
    for (int dist = 0; dist < 4; ++dist) {
      for (const SamplerParams& p : sets) {
        SCOPED_TRACE(::testing::Message() << "V " << V << " dist " << dist << " T " << p.temperature << " k "
                                          << p.top_k << " top-p " << p.top_p << " min-p " << p.min_p << " penalty "
                                          << p.repeat_penalty << " last " << p.repeat_last_n);
        std::vector<float> x = randn(static_cast<size_t>(V), rng, 2.f);
        if (dist == 1)
          for (float& v : x) v = std::round(v * 2.f) / 2.f;  // many ties
        if (dist == 2) x[rng() % V] = 30.f;                   // one token far ahead
        if (dist == 3)  // two values: over a thousand ties at a block's threshold (the full sort's path)
          for (float& v : x) v = rng() % 5 < 3 ? 1.f : -1.f;
        const int pos = static_cast<int>(rng() % 600);
        std::vector<int32_t> hist(static_cast<size_t>(pos) + 2, -7);
        for (int j = 0; j <= pos; ++j) {
          const uint64_t r = rng() % 16;
          hist[j] = r == 0 ? -1 : r == 1 ? V + 3 : r < 6 ? static_cast<int32_t>(rng() % 5) : static_cast<int32_t>(rng() % V);
        }
        const int n_ctx = pos + 1 + static_cast<int>(rng() % 2);  // hist[pos + 1] written only inside the context
        Dev<int32_t> dh(hist);
        moe::run::Sampler host(p);
        const double u = moe::run::Sampler(p).uniform();  // the host's first draw
        std::vector<double> us(2, -1.0);
        us[pos & 1] = u;
        du.put(us);
        dx.put(x);
        chain.put({-1, pos});
        k::SampleParams d;
        d.greedy = p.temperature == 0.f || p.top_k == 1;
        d.temperature = p.temperature;
        d.top_k = p.top_k;
        d.top_p = p.top_p;
        d.min_p = p.min_p;
        d.penalty = p.repeat_penalty;
        d.last_n = p.repeat_last_n;
        ASSERT_TRUE(k::sample_supported(d, V));
        ok(k::sample(dx.p, V, d, scratch.p, dh.p, n_ctx, du.p, out.p, nullptr, chain.p, chain.p + 1, nullptr));
        ok(cudaDeviceSynchronize());
        const std::vector<int32_t> window(hist.begin(), hist.begin() + pos + 1);
        const int32_t want = host.sample(x, window);
        EXPECT_EQ(out.get(), (std::vector<int32_t>{want, 0}));
        EXPECT_EQ(chain.get(), (std::vector<int32_t>{want, pos + 1}));
        EXPECT_EQ(dh.get()[pos + 1], pos + 1 < n_ctx ? want : -7);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 4 * static_cast<int>(sets.size()));
  const std::vector<unsigned char> left = scratch.get();
  EXPECT_TRUE(std::all_of(left.begin(), left.begin() + 8, [](unsigned char b) { return b == 0; })) << "counters";
  // a NaN is flagged and never drawn; the result to the host slot of the position's parity, `out` untouched
  std::vector<float> x = randn(4099, rng);
  x[100] = std::nanf("");
  x[200] = 50.f;
  Dev<float> dx(x);
  Dev<int32_t> dh(std::vector<int32_t>(8, 0));
  int32_t* host = nullptr;
  ok(cudaHostAlloc(reinterpret_cast<void**>(&host), 4 * sizeof(int32_t), cudaHostAllocMapped));
  int32_t* host_dev = nullptr;
  ok(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  std::fill(host, host + 4, -3);
  chain.put({-1, 5});
  out.put({-5, -5});
  k::SampleParams g;
  g.greedy = 1;
  ok(k::sample(dx.p, 4099, g, scratch.p, dh.p, 8, nullptr, nullptr, host_dev, chain.p, chain.p + 1, nullptr));
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(std::vector<int32_t>(host, host + 4), (std::vector<int32_t>{-3, -3, 200, 1})) << "slot 1 (position 5)";
  EXPECT_EQ(out.get(), (std::vector<int32_t>{-5, -5}));
  EXPECT_EQ(chain.get(), (std::vector<int32_t>{200, 6}));
  cudaFreeHost(host);
  // what the device does not draw: top-k off or past kSampleMaxK, no temperature, windows past kSampleMaxWindow
  k::SampleParams no = g;
  no.greedy = 0;
  no.top_k = 0;
  EXPECT_FALSE(k::sample_supported(no, 4099));
  no.top_k = k::kSampleMaxK + 1;
  EXPECT_FALSE(k::sample_supported(no, 4099));
  no.top_k = 40;
  no.temperature = 0.f;
  EXPECT_FALSE(k::sample_supported(no, 4099));
  g.penalty = 1.1f;
  g.last_n = k::kSampleMaxWindow + 1;
  EXPECT_FALSE(k::sample_supported(g, 4099));
  EXPECT_EQ(k::sample(dx.p, 4099, no, scratch.p, dh.p, 8, du.p, out.p, nullptr, chain.p, chain.p + 1, nullptr),
            cudaErrorInvalidValue);
}

TEST(CudaKernels, RmsnormRowsAndArgmax) {
  REQUIRE_GPU();
  std::mt19937_64 rng(fresh_seed());
  const int n = 5, cols = 288;
  std::vector<float> x = randn(n * cols, rng, 2.f), w = randn(cols, rng);
  Dev<float> dx(x), dw(w), dy(n * cols);
  ok(k::rmsnorm_rows(dx.p, dw.p, n, cols, cols, 1e-6f, dy.p, nullptr));
  ok(cudaDeviceSynchronize());
  std::vector<float> y = dy.get();
  for (int t = 0; t < n; ++t) {
    std::vector<float> ref = rmsnorm(&x[t * cols], w.data(), cols, 1e-6f);
    for (int c = 0; c < cols; ++c) EXPECT_NEAR(y[t * cols + c], ref[c], 1e-5 * (std::fabs(ref[c]) + 1e-3));
  }
  std::vector<float> v = randn(151937, rng);
  const int best = 123457;
  v[best] = 100.f;
  v[best + 1000] = 100.f;  // tie: the lower index wins
  Dev<float> dv(v);
  Dev<int32_t> di(2);
  Dev<float> scratch(std::vector<float>(k::kArgmaxScratch, 0.f));  // its counter starts at zero
  Dev<int32_t> chain(std::vector<int32_t>{-1, 41});  // the next decode's token and position
  ok(k::argmax(dv.p, static_cast<int>(v.size()), scratch.p, di.p, nullptr, chain.p, chain.p + 1));
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(di.get()[0], best);
  EXPECT_EQ(di.get()[1], 0) << "all finite";
  EXPECT_EQ(chain.get(), (std::vector<int32_t>{best, 42})) << "chained token and position";
  // a NaN and an infinity are flagged; the argmax skips the NaN (and the launch before left its counter at
  // zero: the merge happens again)
  v[77] = std::nanf("");
  v[150000] = -INFINITY;
  dv.put(v);
  di.put({-5, -5});
  ok(k::argmax(dv.p, static_cast<int>(v.size()), scratch.p, di.p, nullptr));
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(di.get()[0], best);
  EXPECT_EQ(di.get()[1], 1) << "non-finite values are flagged";
  // the result in mapped pinned memory: the slot of the step's position parity (42: slot 0, then 43: slot 1),
  // `out` untouched; the best at the last element (the last slice's end)
  int32_t* host = nullptr;
  ok(cudaHostAlloc(reinterpret_cast<void**>(&host), 4 * sizeof(int32_t), cudaHostAllocMapped));
  int32_t* host_dev = nullptr;
  ok(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  std::fill(host, host + 4, -3);
  v[77] = 0.f;
  v[150000] = 0.f;
  v.back() = 101.f;
  dv.put(v);
  di.put({-5, -5});
  ok(k::argmax(dv.p, static_cast<int>(v.size()), scratch.p, di.p, nullptr, chain.p, chain.p + 1, host_dev));
  ok(cudaDeviceSynchronize());
  const int32_t last = static_cast<int32_t>(v.size()) - 1;
  EXPECT_EQ(std::vector<int32_t>(host, host + 4), (std::vector<int32_t>{last, 0, -3, -3})) << "slot 0 (position 42)";
  v.back() = 0.f;
  dv.put(v);
  ok(k::argmax(dv.p, static_cast<int>(v.size()), scratch.p, di.p, nullptr, chain.p, chain.p + 1, host_dev));
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(std::vector<int32_t>(host, host + 4), (std::vector<int32_t>{last, 0, best, 0})) << "slot 1 (position 43)";
  EXPECT_EQ(chain.get(), (std::vector<int32_t>{best, 44}));
  EXPECT_EQ(di.get(), (std::vector<int32_t>{-5, -5})) << "out is not written when the result goes to the host";
  EXPECT_EQ(k::argmax(dv.p, static_cast<int>(v.size()), scratch.p, di.p, nullptr, chain.p, nullptr, host_dev),
            cudaErrorInvalidValue) << "the host slots need the position";
  cudaFreeHost(host);
}

// CPU twin of routing: softmax over all experts, top k (lowest id on ties), renormalised.
void route_cpu(const std::vector<float>& logits, int k, std::vector<int>& ids, std::vector<float>& w) {
  const int n = static_cast<int>(logits.size());
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(n);
  double s = 0;
  for (int i = 0; i < n; ++i) s += p[i] = std::exp(static_cast<double>(logits[i]) - mx);
  for (double& v : p) v /= s;
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  ids.assign(order.begin(), order.begin() + k);
  double cs = 0;
  for (int j = 0; j < k; ++j) cs += p[ids[j]];
  w.resize(k);
  for (int j = 0; j < k; ++j) w[j] = static_cast<float>(p[ids[j]] / std::max(cs, 6.103515625e-5));
}

TEST(CudaKernels, RouteTokenPicksTheTopExpertsOfTheNormalisedInput) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 512, X = 40, K = 6;
  QMatrix R(Type::F32, X, E, rng, 0.2f);
  std::vector<float> x = randn(E, rng, 2.f), w = randn(E, rng);
  Dev<float> dx(x), dw(w), dh(E), dlg(X), dwt(K);
  Dev<int32_t> dids(K);
  ok(k::route_token(dx.p, dw.p, 1e-6f, R.mat(), dh.p, dlg.p, nullptr));
  // the choice is made by the expert kernel (every block); tiny experts of 16 rows
  QMatrix G(Type::Q4_K, X * 16, E, rng), U(Type::Q4_K, X * 16, E, rng);
  for (const char* tc : {"1", "0"}) {
    SCOPED_TRACE(::testing::Message() << "MOE_CUDA_TC=" << tc);
    setenv("MOE_CUDA_TC", tc, 1);
    Dev<float> act(K * 16);
    ok(k::expert_gate_up(G.mat(16), U.mat(16), dh.p, dlg.p, X, K, dids.p, dwt.p, act.p, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> h = rmsnorm(x.data(), w.data(), E, 1e-6f);
    std::vector<float> lg(X), glg = dlg.get();
    for (int i = 0; i < X; ++i) {
      lg[i] = static_cast<float>(dot(&R.deq[i * E], h.data(), E));
      EXPECT_NEAR(glg[i], lg[i], 1e-5 * (abs_dot(&R.deq[i * E], h.data(), E) + 1e-3)) << "logit " << i;
    }
    std::vector<int> ids;
    std::vector<float> wt;
    route_cpu(glg, K, ids, wt);  // the choice over the GPU's logits (near-ties could flip on the CPU's)
    std::vector<int32_t> gids = dids.get();
    std::vector<float> gw = dwt.get(), gh = dh.get();
    for (int i = 0; i < E; ++i) EXPECT_NEAR(gh[i], h[i], 1e-5 * (std::fabs(h[i]) + 1e-3));
    for (int j = 0; j < K; ++j) {
      EXPECT_EQ(gids[j], ids[j]) << "rank " << j;
      EXPECT_NEAR(gw[j], wt[j], 1e-5) << "rank " << j;
    }
  }
  unsetenv("MOE_CUDA_TC");
  std::vector<float> lg = dlg.get();
  std::vector<int> ids;
  std::vector<float> wt;
  route_cpu(lg, K, ids, wt);
  // topk_rows over the same logits gives the same choice
  Dev<float> dl(lg), tw(K);
  Dev<int32_t> tid(K);
  ok(k::topk_rows(dl.p, 1, X, K, tid.p, tw.p, nullptr));
  ok(cudaDeviceSynchronize());
  std::vector<int32_t> tids = tid.get();
  for (int j = 0; j < K; ++j) EXPECT_EQ(tids[j], ids[j]);
}

float silu(double g) { return static_cast<float>(g / (1.0 + std::exp(-g))); }

// The routing without a router kernel, as the decode chains it: the Q/K/V GEMV zeroes the fixed-point
// sums and writes their unit (the RMS of its input), the O projection adds the router's dot products
// with norm_w ⊙ (x + O·o) and the sum of squares of that x, and the gate/up kernel stages
// rmsnorm(x) * norm_w, ranks the sums and weights the chosen with rmsnorm's scale. Against the twin: x,
// the logits and Σ x² (double sums over the GPU's x), the ranking of the sums (ties to the lower id:
// router rows repeated), the weights and the experts' activations; the sums are bit-identical when the
// chain runs again (integer adds: the order of the blocks does not matter).
TEST(CudaKernels, RouterInOProjectionMatchesTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Case {
    Type t;
    int n, cols, X, K;
  };
  for (const Case& c : {Case{Type::Q4_K, 2048, 4096, 128, 8}, Case{Type::Q6_K, 512, 1024, 40, 3},
                        Case{Type::Q5_K, 256, 512, 256, 64}, Case{Type::Q4_K, 768, 2560, 9, 1}}) {
    SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(c.t) << " n " << c.n << ", O cols " << c.cols << ", "
                                      << c.X << " experts, " << c.K << " chosen");
    const int n = c.n, F = 16;
    const float eps = 1e-6f;
    QMatrix Wq(Type::Q4_K, 48, n, rng), O(c.t, n, c.cols, rng, 0.05f), R(Type::F32, c.X, n, rng, 0.2f);
    QMatrix G(Type::Q4_K, c.X * F, n, rng), U(Type::Q5_K, c.X * F, n, rng);
    // ties: router rows 1 and 4 equal, rows 2 and 7 their negation (3x: one pair usually leads), so that
    // equal sums meet in the ranking (the lower id first)
    for (int i = 0; i < n; ++i) {
      const float v = 3.f * R.deq[n + i];
      R.deq[n + i] = R.deq[4 * n + i] = v;
      R.deq[2 * n + i] = R.deq[7 * n + i] = -v;
    }
    ok(cudaMemcpy(R.dev, R.deq.data(), R.deq.size() * sizeof(float), cudaMemcpyHostToDevice));
    const std::vector<float> x = randn(n, rng, 2.f), an = randn(n, rng), o = randn(c.cols, rng), g = randn(n, rng);
    Dev<float> dx(x), dan(an), dO(o), dg(g), dq(48), dw(c.K), act(c.K * F);
    Dev<long long> sums(c.X + 1);  // poisoned: the Q/K/V GEMV must zero them
    Dev<float> ref(1);
    Dev<int32_t> di(c.K);
    const k::RouterAcc ra = router_acc(sums.p, ref.p, c.X);
    std::vector<long long> first;
    std::vector<float> first_x;
    for (int rep = 0; rep < 2; ++rep) {
      // the second run with the residual's rows read after the MMAs (MOE_CUDA_X_EARLY=0): the same bits
      if (rep == 1) setenv("MOE_CUDA_X_EARLY", "0", 1);
      dx.put(x);
      const k::GemvOut q{Wq.mat(), dq.p};
      ok(k::gemv(&q, 1, dx.p, dan.p, eps, false, nullptr, nullptr, &ra));
      ok(k::o_proj_router(O.mat(), dO.p, dx.p, R.mat(), dg.p, ra, nullptr));
      ok(k::expert_gate_up_acc(G.mat(F), U.mat(F), dx.p, dg.p, eps, ra, c.K, di.p, dw.p, act.p, nullptr));
      ok(cudaDeviceSynchronize());

      const std::vector<long long> acc = sums.get();
      if (rep == 1) {
        unsetenv("MOE_CUDA_X_EARLY");
        EXPECT_EQ(acc, first) << "the sums differ between two runs";
        EXPECT_EQ(dx.get(), first_x) << "x differs between two runs";
        break;
      }
      first = acc;
      first_x = dx.get();
      double ss = 0;
      for (float v : x) ss += static_cast<double>(v) * v;
      const double rms = std::sqrt(ss / n + eps), unit = ref.get()[0];
      EXPECT_NEAR(unit, rms, 1e-5 * rms) << "ref";
      // x + O·o within the GEMV's bound; the logits over the GPU's x
      const std::vector<float> gx = dx.get();
      std::vector<float> xb(n);  // bound of x's error per element
      for (int r = 0; r < n; ++r) {
        const float* w = &O.deq[static_cast<int64_t>(r) * c.cols];
        xb[r] = static_cast<float>(std::fabs(x[r]) + abs_dot(w, o.data(), c.cols));
        expect_close(gx[r], x[r] + dot(w, o.data(), c.cols), xb[r], "x", r);
      }
      std::vector<float> gxg(n);
      for (int r = 0; r < n; ++r) gxg[r] = gx[r] * g[r];
      double sx = 0;
      for (float v : gx) sx += static_cast<double>(v) * v;
      EXPECT_NEAR(static_cast<double>(acc[c.X]) * 0x1p-32 * unit * unit, sx, 1e-6 * sx) << "sum of squares";
      for (int e = 0; e < c.X; ++e) {
        const float* re = &R.deq[static_cast<int64_t>(e) * n];
        const double want = dot(re, gxg.data(), n), got = static_cast<double>(acc[e]) * 0x1p-32 * unit;
        EXPECT_NEAR(got, want, 1e-5 * abs_dot(re, gxg.data(), n) + 1e-7 * unit) << "router sum " << e;
      }
      // the choice: the sums ranked as floats, ties to the lower id
      std::vector<float> lf(c.X);
      for (int e = 0; e < c.X; ++e) lf[e] = static_cast<float>(acc[e]);
      std::vector<int> order(c.X);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lf[a] > lf[b]; });
      EXPECT_TRUE(acc[1] == acc[4] && acc[2] == acc[7]) << "equal router rows, equal sums";
      const std::vector<int32_t> gi = di.get();
      const std::vector<float> gw = dw.get(), ga = act.get();
      const std::vector<float> h = rmsnorm(gx.data(), g.data(), n, eps);
      const double scale = 1.0 / std::sqrt(sx / n + eps);
      double wsum = 0;
      std::vector<double> wv(c.K);
      for (int j = 0; j < c.K; ++j)
        wsum += wv[j] = std::exp((static_cast<double>(lf[order[j]]) - lf[order[0]]) * 0x1p-32 * unit * scale);
      for (int j = 0; j < c.K; ++j) {
        ASSERT_EQ(gi[j], order[j]) << "rank " << j;
        EXPECT_NEAR(gw[j], wv[j] / wsum, 1e-5) << "rank " << j;
        for (int r = 0; r < F; r += 5) {
          const float* gr = &G.deq[(static_cast<int64_t>(order[j]) * F + r) * n];
          const float* ur = &U.deq[(static_cast<int64_t>(order[j]) * F + r) * n];
          const double gv = dot(gr, h.data(), n), uv = dot(ur, h.data(), n);
          EXPECT_NEAR(ga[j * F + r], silu(gv) * static_cast<float>(uv),
                      1e-4 * (abs_dot(gr, h.data(), n) * (1 + abs_dot(ur, h.data(), n))))
              << "rank " << j << " row " << r;
        }
      }
    }
  }
}

// The expert choice inside the gate/up kernel, for several expert counts. Logits on a coarse grid, so
// that many tie (the lowest id among equal logits must win, as in the twin: the ranking's exact
// fallback), and fine ones (its count of the greater logits alone, no tie among the chosen).
TEST(CudaKernels, ExpertChoiceTiesAndWidths) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 256;
  for (bool coarse : {true, false})
    for (int X : {9, 40, 127, 128, 129, 300})
      for (int K : {1, 3, 8}) {
        SCOPED_TRACE(::testing::Message() << X << " experts, " << K << " chosen, " << (coarse ? "ties" : "fine"));
        QMatrix G(Type::Q4_K, X * 16, E, rng), U(Type::Q4_K, X * 16, E, rng);
        std::vector<float> logits = randn(X, rng, 2.f), h = randn(E, rng);
        if (coarse)
          for (float& l : logits) l = std::round(l * 2.f) / 2.f;  // steps of 0.5: ties, +0 and -0 among them
        std::vector<int> ids;
        std::vector<float> wt;
        route_cpu(logits, K, ids, wt);
        Dev<float> dlg(logits), dh(h), act(K * 16), dw(K);
        Dev<int32_t> di(K);
        ok(k::expert_gate_up(G.mat(16), U.mat(16), dh.p, dlg.p, X, K, di.p, dw.p, act.p, nullptr));
        ok(cudaDeviceSynchronize());
        const std::vector<int32_t> gi = di.get();
        const std::vector<float> gw = dw.get(), a = act.get();
        for (int j = 0; j < K; ++j) {
          EXPECT_EQ(gi[j], ids[j]) << "rank " << j;
          EXPECT_NEAR(gw[j], wt[j], 1e-6) << "rank " << j;
        }
        // the blocks multiplied the chosen experts' rows (rank j's first row)
        for (int j = 0; j < K; ++j) {
          const float* gr = &G.deq[static_cast<int64_t>(ids[j]) * 16 * E];
          const float* ur = &U.deq[static_cast<int64_t>(ids[j]) * 16 * E];
          const double g = dot(gr, h.data(), E), u = dot(ur, h.data(), E);
          EXPECT_NEAR(a[j * 16], silu(g) * static_cast<float>(u),
                      1e-4 * (abs_dot(gr, h.data(), E) * (1 + abs_dot(ur, h.data(), E))))
              << "rank " << j;
        }
      }
}

// NaN router logits (a broken layer; the F2 guard rejects such a run) are left out of the choice, the
// same way every time: the chosen are the best of the logits that are numbers (ties to the lower id),
// whether or not a NaN sits where the best would be; with fewer numbers than chosen slots, the slots past
// them hold valid ids.
TEST(CudaKernels, ExpertChoiceLeavesNaNLogitsOut) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 256;
  for (int X : {9, 40, 128, 300})
    for (int K : {1, 3, 8})
      for (int nans : {1, 3, X - 2, X}) {
        SCOPED_TRACE(::testing::Message() << X << " experts, " << K << " chosen, " << nans << " NaN");
        QMatrix G(Type::Q4_K, X * 16, E, rng), U(Type::Q4_K, X * 16, E, rng);
        std::vector<float> logits = randn(X, rng, 2.f), h = randn(E, rng);
        // the first NaN where the best logit is, the others anywhere
        const int best = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        std::vector<int> at(X);
        std::iota(at.begin(), at.end(), 0);
        std::shuffle(at.begin(), at.end(), rng);
        std::swap(*std::find(at.begin(), at.end(), best), at[0]);
        for (int i = 0; i < nans; ++i) logits[at[i]] = std::nanf("");
        std::vector<int> order;
        for (int e = 0; e < X; ++e)
          if (!std::isnan(logits[e])) order.push_back(e);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
        Dev<float> dlg(logits), dh(h), act(K * 16), dw(K);
        Dev<int32_t> di(K);
        std::vector<int32_t> first;
        for (int rep = 0; rep < 3; ++rep) {
          ok(k::expert_gate_up(G.mat(16), U.mat(16), dh.p, dlg.p, X, K, di.p, dw.p, act.p, nullptr));
          ok(cudaDeviceSynchronize());
          const std::vector<int32_t> gi = di.get();
          for (int j = 0; j < K; ++j) {
            if (j < static_cast<int>(order.size()))
              EXPECT_EQ(gi[j], order[j]) << "rank " << j;
            else
              EXPECT_TRUE(gi[j] >= 0 && gi[j] < X) << "rank " << j << " past the numbers: id " << gi[j];
          }
          if (rep == 0) first = gi;
          else EXPECT_EQ(gi, first) << "the same choice every time";
          if (static_cast<int>(order.size()) >= K) {  // the weights of the chosen, renormalised over them
            const std::vector<float> gw = dw.get();
            double sum = 0;
            for (int j = 0; j < K; ++j) sum += std::exp(static_cast<double>(logits[order[j]]) - logits[order[0]]);
            for (int j = 0; j < K; ++j)
              EXPECT_NEAR(gw[j], std::exp(static_cast<double>(logits[order[j]]) - logits[order[0]]) / sum, 1e-6)
                  << "rank " << j;
          }
        }
      }
}

// The choice from o_proj_router's fixed-point sums inside the gate/up kernel (rank_experts: its count of
// the greater sums, and its exact fallback where the best tie), on sums written here: random, on a coarse
// grid (ties), all equal, sorted either way (one warp holding every one of the best, or none), and so
// large that distinct sums round to one float (the ranking is of the floats, ties to the lower id);
// expert counts around the warps' width. The twin: a stable sort of the sums as floats.
TEST(CudaKernels, ExpertChoiceFromSumsEveryPattern) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 256, F = 16;
  const float eps = 1e-6f;
  const std::vector<float> x = randn(E, rng), g = randn(E, rng);
  Dev<float> dx(x), dg(g), ref(std::vector<float>{1.f});
  for (int X : {1, 9, 31, 32, 33, 64, 128, 200, 256}) {
    QMatrix G(Type::Q4_K, X * F, E, rng), U(Type::Q4_K, X * F, E, rng);
    Dev<long long> sums(X + 1);
    const k::RouterAcc ra = router_acc(sums.p, ref.p, X);
    for (int pattern = 0; pattern < 7; ++pattern) {
      std::vector<long long> v(X + 1);
      std::normal_distribution<double> nd(0.0, 1.0);
      for (int e = 0; e < X; ++e) {
        switch (pattern) {
          case 0: v[e] = std::llround(nd(rng) * 0x1p33); break;                  // fine
          case 1: v[e] = std::llround(std::round(nd(rng) * 2) * 0x1p31); break;  // steps of 0.5: ties
          case 2: v[e] = 0; break;                                                // all equal
          case 3: v[e] = -5LL << 32; break;                                       // all equal, negative
          case 4: v[e] = static_cast<long long>(X - e) << 30; break;              // the best first
          case 5: v[e] = static_cast<long long>(e) << 30; break;                  // the best last
          default: v[e] = (1LL << 60) + e * 1000LL; break;                        // one float for all
        }
      }
      v[X] = static_cast<long long>(E) << 32;  // Σ x² = E: rmsnorm's scale ~1
      std::vector<float> lf(X);
      for (int e = 0; e < X; ++e) lf[e] = static_cast<float>(v[e]);
      std::vector<int> order(X);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lf[a] > lf[b]; });
      const double scale = 1.0 / std::sqrt(1.0 + eps);
      for (int K : {1, 3, 8, 64}) {
        if (K > X) continue;
        double wsum = 0;
        std::vector<double> wv(K);
        for (int j = 0; j < K; ++j)
          wsum += wv[j] = std::exp((static_cast<double>(lf[order[j]]) - lf[order[0]]) * 0x1p-32 * scale);
        SCOPED_TRACE(::testing::Message() << X << " experts, " << K << " chosen, pattern " << pattern);
        sums.put(v);
        Dev<int32_t> di(K);
        Dev<float> dw(K), act(K * F);
        ok(k::expert_gate_up_acc(G.mat(F), U.mat(F), dx.p, dg.p, eps, ra, K, di.p, dw.p, act.p, nullptr));
        ok(cudaDeviceSynchronize());
        const std::vector<int32_t> gi = di.get();
        const std::vector<float> gw = dw.get();
        for (int j = 0; j < K; ++j) {
          ASSERT_EQ(gi[j], order[j]) << "rank " << j;
          EXPECT_NEAR(gw[j], wv[j] / wsum, 1e-5) << "rank " << j;
        }
      }
    }
  }
}

// The chosen experts' ids as an early hint for the down kernel (k::EarlyIds): the gate/up kernel writes
// the tag for its position and layer after the ids, and the down kernel's result is the same bits with
// no hint, a fresh one, a stale tag that names this position and layer over other experts' ids (a
// hint only fetches rows), or a matching tag whose hint names other experts than the ids it then
// reads (the rows fetched early into shared memory are fetched again); with the rows through shared
// memory (MOE_CUDA_DOWN_SMEM, default) and through L2 alike, and with x's rows read before the kernels'
// waits (MOE_CUDA_X_EARLY, default) or after their MMAs.
TEST(CudaKernels, EarlyExpertIdsAreOnlyAHint) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int n = 512, C = 1024, X = 16, K = 4, F = 256, pos = 37, layer = 5;
  const float eps = 1e-6f;
  QMatrix O(Type::Q4_K, n, C, rng, 0.05f), R(Type::F32, X, n, rng, 0.2f);
  QMatrix G(Type::Q4_K, X * F, n, rng), U(Type::Q4_K, X * F, n, rng), D(Type::Q6_K, X * n, F, rng);
  const std::vector<float> x = randn(n, rng, 2.f), o = randn(C, rng), g = randn(n, rng);
  std::vector<float> want;
  // "late": shared memory, x's rows read after the MMAs (MOE_CUDA_X_EARLY=0)
  for (const char* sm : {"1", "0", "late"})
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(::testing::Message() << "MOE_CUDA_DOWN_SMEM=" << sm << " variant " << variant);
      const bool late = sm[0] == 'l';
      setenv("MOE_CUDA_DOWN_SMEM", late ? "1" : sm, 1);
      setenv("MOE_CUDA_X_EARLY", late ? "0" : "1", 1);
      Dev<float> dx(x), dO(o), dg(g), dw(K), act(K * F), ref(std::vector<float>{1.f});
      Dev<long long> sums(std::vector<long long>(X + 1, 0));
      Dev<int32_t> di(std::vector<int32_t>{X - 1, X - 2, X - 3, X - 4}), dpos(std::vector<int32_t>{pos});
      Dev<int32_t> other(std::vector<int32_t>{0, 5, 10, 15});  // variant 3's hint
      Dev<int> tag(std::vector<int>{variant >= 2 ? k::early_ids_tag(pos, layer) : 0});
      const k::RouterAcc ra = router_acc(sums.p, ref.p, X);
      k::EarlyIds early;
      early.tag = tag.p;
      early.pos = dpos.p;
      early.layer = layer;
      if (variant == 3) early.hint = other.p;
      const k::EarlyIds* e = variant ? &early : nullptr;
      ok(k::o_proj_router(O.mat(), dO.p, dx.p, R.mat(), dg.p, ra, nullptr));
      if (variant == 2) {  // the down kernel alone first: it finds the stale tag over the preset ids
        Dev<float> scratch(x);
        ok(k::expert_down_add(D.mat(n), act.p, di.p, dw.p, K, scratch.p, nullptr, nullptr, e));
        ok(cudaDeviceSynchronize());
      }
      ok(k::expert_gate_up_acc(G.mat(F), U.mat(F), dx.p, dg.p, eps, ra, K, di.p, dw.p, act.p, nullptr, e));
      ok(k::expert_down_add(D.mat(n), act.p, di.p, dw.p, K, dx.p, nullptr, nullptr, e));
      ok(cudaDeviceSynchronize());
      EXPECT_EQ(tag.get()[0], variant ? k::early_ids_tag(pos, layer) : 0);
      const std::vector<float> got = dx.get();
      if (want.empty()) {
        want = got;
        double moved = 0;
        for (int r = 0; r < n; ++r) moved += std::fabs(got[r] - x[r]);
        EXPECT_GT(moved, 0.0);
      } else {
        for (int r = 0; r < n; ++r) ASSERT_EQ(got[r], want[r]) << "x row " << r;
      }
    }
  unsetenv("MOE_CUDA_DOWN_SMEM");
  unsetenv("MOE_CUDA_X_EARLY");
  k::EarlyIds bad;
  Dev<int> t(1);
  bad.tag = t.p;  // no position
  Dev<float> a(8), xx(8), w(1);
  Dev<int32_t> ids(1);
  EXPECT_EQ(k::expert_down_add(D.mat(n), a.p, ids.p, w.p, 1, xx.p, nullptr, nullptr, &bad), cudaErrorInvalidValue);
}

TEST(CudaKernels, ExpertGateUpAndDownDecodeMatchTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 512, F = 288, X = 9, K = 3;
  for (const char* tc : {"1", "0"})
  for (Type t : {Type::Q4_K, Type::Q5_K, Type::Q6_K, Type::Q8_0, Type::Q5_0}) {
    SCOPED_TRACE(::testing::Message() << moe::gguf::type_name(t) << " MOE_CUDA_TC=" << tc);
    setenv("MOE_CUDA_TC", tc, 1);
    const int Fc = static_cast<int>(cols_for(t, F));
    QMatrix G(t, X * Fc, E, rng), U(t, X * Fc, E, rng), D(t, X * E, Fc, rng);
    std::vector<float> h = randn(E, rng), x = randn(E, rng);
    // router logits that rank experts 7, 2, 8 first (the choice itself: RouteToken... above)
    std::vector<float> logits(X, -1.f);
    logits[7] = 2.f;
    logits[2] = 1.5f;
    logits[8] = 1.f;
    std::vector<int32_t> ids;
    std::vector<float> wt;
    route_cpu(logits, K, ids, wt);
    ASSERT_EQ(ids, (std::vector<int32_t>{7, 2, 8}));
    Dev<float> dh(h), act(K * Fc), dx(x), dw(K), dlg(logits);
    Dev<int32_t> di(K);
    ok(k::expert_gate_up(G.mat(Fc), U.mat(Fc), dh.p, dlg.p, X, K, di.p, dw.p, act.p, nullptr));
    // with the next layer's rows to send to L2 (a hint: the results are the same; one region's size is not
    // a multiple of 16 and is skipped)
    k::L2Ahead ahead;
    ahead.base[0] = G.dev;
    ahead.bytes[0] = static_cast<int64_t>(G.mat().row_stride) * G.rows;
    ahead.base[1] = U.dev;
    ahead.bytes[1] = 40;
    ahead.base[2] = D.dev;
    ahead.bytes[2] = 1;
    ok(k::expert_down_add(D.mat(E), act.p, di.p, dw.p, K, dx.p, nullptr, &ahead));
    ok(cudaDeviceSynchronize());
    EXPECT_EQ(di.get(), ids);
    std::vector<float> gwt = dw.get();
    for (int j = 0; j < K; ++j) EXPECT_NEAR(gwt[j], wt[j], 1e-6) << "rank " << j;
    std::vector<float> a = act.get(), y = dx.get();
    std::vector<float> aref(K * Fc);
    for (int j = 0; j < K; ++j)
      for (int r = 0; r < Fc; ++r) {
        const float* gr = &G.deq[(static_cast<int64_t>(ids[j]) * Fc + r) * E];
        const float* ur = &U.deq[(static_cast<int64_t>(ids[j]) * Fc + r) * E];
        const double g = dot(gr, h.data(), E), u = dot(ur, h.data(), E);
        aref[j * Fc + r] = silu(g) * static_cast<float>(u);
        EXPECT_NEAR(a[j * Fc + r], aref[j * Fc + r], 1e-4 * (abs_dot(gr, h.data(), E) * (1 + abs_dot(ur, h.data(), E))));
      }
    for (int r = 0; r < E; ++r) {
      double s = 0, sa = std::fabs(x[r]);
      for (int j = 0; j < K; ++j) {
        const float* dr = &D.deq[(static_cast<int64_t>(ids[j]) * E + r) * Fc];
        s += wt[j] * dot(dr, &a[j * Fc], Fc);
        sa += wt[j] * abs_dot(dr, &a[j * Fc], Fc);
      }
      expect_close(y[r], x[r] + s, sa, "down", r);
    }
  }
  unsetenv("MOE_CUDA_TC");
}

TEST(CudaKernels, GroupedExpertGemmsMatchPerTokenTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int E = 256, F = 160, X = 6, K = 2, T = 83;
  QMatrix G(Type::Q4_K, X * F, E, rng), U(Type::Q4_K, X * F, E, rng), D(Type::Q8_0, X * E, F, rng);
  std::vector<float> h = randn(T * E, rng), x = randn(T * E, rng);
  std::vector<int32_t> ids(T * K);
  std::vector<float> wt(T * K);
  std::uniform_int_distribution<int> pick(0, X - 1);
  for (int t = 0; t < T; ++t) {
    ids[t * K] = pick(rng);
    do {
      ids[t * K + 1] = pick(rng);
    } while (ids[t * K + 1] == ids[t * K]);
    wt[t * K] = 0.7f;
    wt[t * K + 1] = 0.3f;
  }
  Dev<float> dh(h), dx(x), dw(wt), act(T * K * F), dout(T * K * E);
  Dev<int32_t> di(ids), tos(T * K), slot(T * K);
  Dev<int> count(X), offset(X);
  ok(k::group_by_expert(di.p, T, K, X, count.p, offset.p, tos.p, slot.p, nullptr));
  ok(k::expert_gate_up_grouped(G.mat(F), U.mat(F), dh.p, E, count.p, offset.p, tos.p, X, T, act.p, nullptr));
  ok(k::expert_down_grouped(D.mat(E), act.p, count.p, offset.p, X, T, dout.p, nullptr));
  ok(k::combine_experts(dout.p, slot.p, dw.p, T, K, E, dx.p, nullptr));
  ok(cudaDeviceSynchronize());
  std::vector<int> cnt = count.get();
  for (int e = 0; e < X; ++e)
    EXPECT_EQ(cnt[e], std::count(ids.begin(), ids.end(), e)) << "expert " << e;
  std::vector<float> y = dx.get();
  for (int t = 0; t < T; ++t) {
    std::vector<double> s(E, 0.0), sa(E, 0.0);
    for (int j = 0; j < K; ++j) {
      const int e = ids[t * K + j];
      std::vector<float> a(F);
      for (int r = 0; r < F; ++r) {
        const float* gr = &G.deq[(static_cast<int64_t>(e) * F + r) * E];
        const float* ur = &U.deq[(static_cast<int64_t>(e) * F + r) * E];
        a[r] = silu(dot(gr, &h[t * E], E)) * static_cast<float>(dot(ur, &h[t * E], E));
      }
      for (int r = 0; r < E; ++r) {
        const float* dr = &D.deq[(static_cast<int64_t>(e) * E + r) * F];
        s[r] += wt[t * K + j] * dot(dr, a.data(), F);
        sa[r] += wt[t * K + j] * abs_dot(dr, a.data(), F);
      }
    }
    for (int r = 0; r < E; ++r)
      EXPECT_NEAR(y[t * E + r], x[t * E + r] + s[r], 1e-4 * (sa[r] + std::fabs(x[t * E + r])) + 1e-5)
          << "token " << t << " row " << r;
  }
}

// combine_experts against its twin, exactly: x[t] += Σ_j w_j out[slot_j] with fmaf from zero in rank
// order, then one add (the same float operations: the same bits), for the four-column path (2,048) and
// the scalar one (cols not a multiple of 4), slots in scattered order.
TEST(CudaKernels, CombineExpertsExactTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int cols : {2048, 257}) {
    SCOPED_TRACE(cols);
    const int T = 37, K = 8;
    std::vector<int32_t> slot(T * K);
    for (int i = 0; i < T * K; ++i) slot[i] = i;
    std::shuffle(slot.begin(), slot.end(), rng);
    const std::vector<float> out = randn(static_cast<size_t>(T) * K * cols, rng), w = randn(T * K, rng),
                             x = randn(static_cast<size_t>(T) * cols, rng);
    Dev<float> dout(out), dw(w), dx(x);
    Dev<int32_t> ds(slot);
    ok(k::combine_experts(dout.p, ds.p, dw.p, T, K, cols, dx.p, nullptr));
    ok(cudaDeviceSynchronize());
    const std::vector<float> y = dx.get();
    int bad = 0;
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < cols; ++d) {
        float acc = 0.f;
        for (int j = 0; j < K; ++j) acc = std::fmaf(w[t * K + j], out[static_cast<size_t>(slot[t * K + j]) * cols + d], acc);
        const float want = x[static_cast<size_t>(t) * cols + d] + acc;
        bad += std::memcmp(&want, &y[static_cast<size_t>(t) * cols + d], 4) != 0;
      }
    EXPECT_EQ(bad, 0) << "elements differing from the twin";
  }
}

// CPU twin of the per-head norm + NEOX RoPE (incremental theta, as the CPU forward builds it).
void norm_rope_cpu(float* v, const float* gain, int hd, int pos, float theta_scale, float eps) {
  std::vector<float> y = rmsnorm(v, gain, hd, eps);
  float theta = static_cast<float>(pos);
  for (int i = 0; i < hd / 2; ++i) {
    const double c = std::cos(theta), s = std::sin(theta);
    const double a = y[i], b = y[i + hd / 2];
    v[i] = static_cast<float>(a * c - b * s);
    v[i + hd / 2] = static_cast<float>(a * s + b * c);
    theta *= theta_scale;
  }
}

// CPU twin of causal attention of one query row q (head_dim hd) over cache positions [0, len) of KV
// head g (rows of KV floats): softmax(q k / sqrt(hd)) v in double precision.
std::vector<double> attention_twin(const float* q, const std::vector<float>& ck, const std::vector<float>& cv, int KV,
                                   int g, int hd, int len) {
  std::vector<double> s(len), o(hd, 0.0);
  double mx = -1e300;
  for (int p = 0; p < len; ++p) {
    s[p] = dot(q, &ck[static_cast<size_t>(p) * KV + g * hd], hd) / std::sqrt(static_cast<double>(hd));
    mx = std::max(mx, s[p]);
  }
  double z = 0;
  for (double& v : s) z += v = std::exp(v - mx);
  for (int p = 0; p < len; ++p)
    for (int d = 0; d < hd; ++d) o[d] += s[p] * cv[static_cast<size_t>(p) * KV + g * hd + d];
  for (double& v : o) v /= z;
  return o;
}

TEST(CudaKernels, QkNormRopeStoreAndAttentionMatchTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int hd : {64, 128}) {
    const int n_head = 8, n_kv = 2, G = n_head / n_kv, ctx = 700;
    const int Q = n_head * hd, KV = n_kv * hd, stride = Q + 2 * KV;
    const float eps = 1e-6f, theta_scale = std::pow(1e6f, -2.0f / hd);
    // a cache already holding `past` positions, then n new tokens
    const int past = 611, n = 13;
    std::vector<float> cache_k = randn(static_cast<size_t>(ctx) * KV, rng), cache_v = randn(static_cast<size_t>(ctx) * KV, rng);
    std::vector<uint16_t> hk(cache_k.size()), hv(cache_v.size());
    for (size_t i = 0; i < hk.size(); ++i) {
      hk[i] = moe::quant::f32_to_fp16(cache_k[i]);
      hv[i] = moe::quant::f32_to_fp16(cache_v[i]);
      cache_k[i] = moe::quant::fp16_to_f32(hk[i]);
      cache_v[i] = moe::quant::fp16_to_f32(hv[i]);
    }
    std::vector<float> qkv = randn(static_cast<size_t>(n) * stride, rng, 2.f), qn = randn(hd, rng), kn = randn(hd, rng);
    Dev<float> dqkv(qkv), dqn(qn), dkn(kn);
    Dev<uint16_t> dk(hk), dv(hv);
    Dev<int32_t> dpos(std::vector<int32_t>{past});
    moe::cuda::k::Rope rope;
    rope.theta_scale = theta_scale;
    // the same with the chunk's RoPE table (rope_table of the n positions) into copies
    Dev<float> tqkv(qkv), table(std::vector<float>(static_cast<size_t>(n) * hd, NAN));
    Dev<uint16_t> tk(hk), tv(hv);
    ok(k::rope_table(dpos.p, n, rope, hd, table.p, nullptr));
    ok(k::qk_norm_rope_store(tqkv.p, n, dpos.p, dqn.p, dkn.p, n_head, n_kv, hd, eps, rope, tk.p, tv.p, table.p, nullptr));
    ok(k::qk_norm_rope_store(dqkv.p, n, dpos.p, dqn.p, dkn.p, n_head, n_kv, hd, eps, rope, dk.p, dv.p, nullptr, nullptr));
    ok(cudaDeviceSynchronize());
    EXPECT_EQ(tqkv.get(), dqkv.get()) << "table: the same angles as evaluated per block";
    EXPECT_EQ(tk.get(), dk.get());
    EXPECT_EQ(tv.get(), dv.get());
    // twin of the norm/rope/store
    for (int t = 0; t < n; ++t) {
      float* row = &qkv[t * stride];
      for (int h = 0; h < n_head; ++h) norm_rope_cpu(row + h * hd, qn.data(), hd, past + t, theta_scale, eps);
      for (int g = 0; g < n_kv; ++g) {
        norm_rope_cpu(row + Q + g * hd, kn.data(), hd, past + t, theta_scale, eps);
        for (int d = 0; d < hd; ++d) {
          cache_k[(past + t) * KV + g * hd + d] = moe::quant::fp16_to_f32(moe::quant::f32_to_fp16(row[Q + g * hd + d]));
          cache_v[(past + t) * KV + g * hd + d] = moe::quant::fp16_to_f32(moe::quant::f32_to_fp16(row[Q + KV + g * hd + d]));
        }
      }
    }
    ok(cudaDeviceSynchronize());
    std::vector<float> gq = dqkv.get();
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < Q; ++i) EXPECT_NEAR(gq[t * stride + i], qkv[t * stride + i], 2e-5 * (1 + std::fabs(qkv[t * stride + i])));
    std::vector<uint16_t> gk = dk.get();
    int kdiff = 0;
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < KV; ++i)
        kdiff += std::fabs(moe::quant::fp16_to_f32(gk[(past + t) * KV + i]) - cache_k[(past + t) * KV + i]) >
                 2e-3 * (1 + std::fabs(cache_k[(past + t) * KV + i]));
    EXPECT_EQ(kdiff, 0);
    // attention over the GPU's own q (checked above)
    {
      SCOPED_TRACE(::testing::Message() << "hd " << hd);
      Dev<float> out(std::vector<float>(static_cast<size_t>(n) * Q, NAN));
      ok(k::attention(dqkv.p, stride, n, dpos.p, dk.p, dv.p, n_head, n_kv, hd, out.p, nullptr));
      ok(cudaDeviceSynchronize());
      std::vector<float> o = out.get();
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < n_head; ++h) {
          const std::vector<double> want = attention_twin(&gq[t * stride + h * hd], cache_k, cache_v, KV, h / G, hd, past + t + 1);
          for (int d = 0; d < hd; ++d)
            ASSERT_NEAR(o[t * Q + h * hd + d], want[d], 2e-4) << "token " << t << " head " << h << " dim " << d;
        }
    }
  }
  // A head size whose RoPE pairs do not fill whole warps is refused, not run.
  Dev<float> q(64 * 96);
  Dev<int32_t> pos(std::vector<int32_t>{0});
  Dev<uint16_t> kc(64 * 96);
  EXPECT_EQ(k::qk_norm_rope_store(q.p, 1, pos.p, q.p, q.p, 2, 1, 96, 1e-6f, moe::cuda::k::Rope{}, kc.p, kc.p, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// The prefill attention over every group size, head size, a fresh cache and one holding a past, token
// counts that leave partial blocks and partial tiles. Cache rows past the last token hold NaN: they
// must not leak in (masked positions multiply V by zero).
TEST(CudaKernels, PrefillAttentionEveryShapeMatchesTwin) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Case { int hd, n_head, n_kv, past, n; };
  for (const Case c : {Case{128, 32, 4, 0, 77}, Case{128, 8, 8, 5, 70}, Case{64, 8, 4, 130, 19}, Case{64, 16, 2, 0, 1},
                       Case{128, 16, 2, 200, 129}, Case{128, 8, 1, 63, 66}}) {
    SCOPED_TRACE(::testing::Message() << "hd " << c.hd << " heads " << c.n_head << "/" << c.n_kv << " past " << c.past
                                      << " n " << c.n);
    const int G = c.n_head / c.n_kv, Q = c.n_head * c.hd, KV = c.n_kv * c.hd, stride = Q + 2 * KV;
    const int ctx = c.past + c.n + 45;
    std::vector<float> ck = randn(static_cast<size_t>(ctx) * KV, rng), cv = randn(static_cast<size_t>(ctx) * KV, rng);
    std::vector<uint16_t> hk(ck.size()), hv(cv.size());
    for (size_t i = 0; i < hk.size(); ++i) {
      const bool beyond = static_cast<int>(i / KV) >= c.past + c.n;
      hk[i] = beyond ? 0x7e00 : moe::quant::f32_to_fp16(ck[i]);  // fp16 NaN past the context
      hv[i] = beyond ? 0x7e00 : moe::quant::f32_to_fp16(cv[i]);
      ck[i] = moe::quant::fp16_to_f32(hk[i]);
      cv[i] = moe::quant::fp16_to_f32(hv[i]);
    }
    // q with the scale of normalised heads times a gain (logits of a few units, some large)
    std::vector<float> qkv = randn(static_cast<size_t>(c.n) * stride, rng, 1.5f);
    Dev<float> dqkv(qkv), out(std::vector<float>(static_cast<size_t>(c.n) * Q, NAN));
    Dev<uint16_t> dk(hk), dv(hv);
    Dev<int32_t> dpos(std::vector<int32_t>{c.past});
    ok(k::attention(dqkv.p, stride, c.n, dpos.p, dk.p, dv.p, c.n_head, c.n_kv, c.hd, out.p, nullptr));
    ok(cudaDeviceSynchronize());
    std::vector<float> o = out.get();
    for (int t = 0; t < c.n; ++t)
      for (int h = 0; h < c.n_head; ++h) {
        const std::vector<double> want = attention_twin(&qkv[t * stride + h * c.hd], ck, cv, KV, h / G, c.hd, c.past + t + 1);
        for (int d = 0; d < c.hd; ++d)
          ASSERT_NEAR(o[t * Q + h * c.hd + d], want[d], 2e-4) << "token " << t << " head " << h << " dim " << d;
      }
  }
}

}  // namespace

// The decode attention's slices left to the O projection (k::AttSlices): for contexts of 1 to 9 slices the
// O projection's x and router sums are the same bits as with the attention's own merge, and where the
// attention defers (2 .. kAttMaxDefer slices) it leaves its merged output and counters untouched. Against the twin
// of the non-deferred chain (AttentionDecodeFusesNormRopeAndStore, RouterInOProjectionMatchesTwin).
TEST(CudaKernels, AttentionSlicesMergedByTheOProjection) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int G : {8, 4}) {
    const int hd = 128, n_kv = 2, n_head = n_kv * G, ctx = 320, n_split = 64, X = 16;
    const int Q = n_head * hd, KV = n_kv * hd, E = 512;
    const float eps = 1e-6f;
    const int chunk_min = k::attention_min_chunk();
    QMatrix O(Type::Q4_K, E, Q, rng, 0.05f), R(Type::F32, X, E, rng, 0.2f);
    std::vector<uint16_t> hk(static_cast<size_t>(ctx) * KV), hv(hk.size());
    for (size_t i = 0; i < hk.size(); ++i) {
      hk[i] = moe::quant::f32_to_fp16(randn(1, rng)[0]);
      hv[i] = moe::quant::f32_to_fp16(randn(1, rng)[0]);
    }
    const std::vector<float> qkv = randn(static_cast<size_t>(Q + 2 * KV), rng, 2.f), qn = randn(hd, rng),
                             kn = randn(hd, rng), x = randn(E, rng), g = randn(E, rng);
    moe::cuda::k::Rope rope;
    rope.theta_scale = std::pow(1e6f, -2.0f / hd);
    // contexts of 1 to 5 and 9 slices of the minimum length (5 and 9 are past what the O projection takes)
    for (int slices : {1, 2, 3, 4, 5, 9}) {
      const int past = slices == 1 ? 3 : std::min(ctx - 1, (slices - 1) * chunk_min + 1);
      const int chunk = std::max((past + 1 + n_split - 1) / n_split, chunk_min);
      const int n_eff = (past + 1 + chunk - 1) / chunk;
      SCOPED_TRACE(::testing::Message() << "G " << G << " past " << past << " slices " << n_eff);
      std::vector<float> xs[2];
      std::vector<long long> sums[2];
      for (int defer : {0, k::kAttMaxDefer}) {
        Dev<float> dqkv(qkv), dqn(qn), dkn(kn), out(Q), dx(x), dg(g);
        Dev<float> partials(k::attention_partials_floats(n_kv, n_split, G, hd));
        Dev<uint16_t> dk(hk), dv(hv);
        Dev<int32_t> dpos(std::vector<int32_t>{past});
        Dev<int> counters(std::vector<int>(k::attention_counter_ints(n_kv, n_split), 0));
        Dev<long long> acc(std::vector<long long>(X + 1, 0));
        Dev<float> ref(std::vector<float>{1.f});
        const k::RouterAcc ra = router_acc(acc.p, ref.p, X);
        k::AttSlices at;
        at.partials = partials.p;
        at.pos = dpos.p;
        at.n_head_kv = n_kv;
        at.group = G;
        at.head_dim = hd;
        at.n_split = n_split;
        at.min_chunk = chunk_min;
        at.defer = defer;
        ok(k::attention_decode(dqkv.p, dpos.p, dqn.p, dkn.p, eps, rope, dk.p, dv.p, n_head, n_kv, hd, n_split,
                               partials.p, counters.p, out.p, nullptr, nullptr, defer));
        ok(k::o_proj_router(O.mat(), out.p, dx.p, R.mat(), dg.p, ra, nullptr, &at));
        ok(cudaDeviceSynchronize());
        const int i = defer ? 1 : 0;
        xs[i] = dx.get();
        sums[i] = acc.get();
        const std::vector<float> o = out.get();
        const bool deferred = defer && n_eff >= 2 && n_eff <= defer;
        EXPECT_EQ(std::isnan(o[0]) && std::isnan(o[Q - 1]), deferred) << "the merged output written or not";
        std::vector<int> c = counters.get();
        EXPECT_EQ(*std::max_element(c.begin(), c.end()), 0);
        if (!defer) {  // the plain chain moved x
          double moved = 0;
          for (int r = 0; r < E; ++r) moved += std::fabs(xs[0][r] - x[r]);
          EXPECT_GT(moved, 0.0);
        }
      }
      for (int r = 0; r < E; ++r) ASSERT_EQ(xs[1][r], xs[0][r]) << "x row " << r;
      EXPECT_EQ(sums[1], sums[0]) << "router sums";
    }
  }
  // the host checks: slices with a head size whose warps' float4 runs would cross heads, or more than
  // kAttMaxDefer
  QMatrix O(Type::Q4_K, 256, 512, rng), R(Type::F32, 4, 256, rng);
  Dev<float> o(512), x(256), g(256), ref(1), part(64);
  Dev<long long> acc(5);
  Dev<int32_t> pos(1);
  const k::RouterAcc ra = router_acc(acc.p, ref.p, 4);
  k::AttSlices at;
  at.partials = part.p;
  at.pos = pos.p;
  at.n_head_kv = 1;
  at.group = 8;
  at.head_dim = 64;
  at.defer = 2;
  EXPECT_EQ(k::o_proj_router(O.mat(), o.p, x.p, R.mat(), g.p, ra, nullptr, &at), cudaErrorInvalidValue);
  at.group = 4;
  at.head_dim = 128;
  at.defer = k::kAttMaxDefer + 1;
  EXPECT_EQ(k::o_proj_router(O.mat(), o.p, x.p, R.mat(), g.p, ra, nullptr, &at), cudaErrorInvalidValue);
  cudaGetLastError();
}

// The L2 eviction hints (MOE_CUDA_EVICT, launch.cuh) change where the decode's reads stay in L2, never what
// they read: the LM head's warp tiles, the decode attention over several K/V groups per slice, and the
// expert gate/up and down kernels (rows through shared memory and through L2) give the same bits with the
// hints on and off.
TEST(CudaKernels, L2EvictionHintsChangeNoResult) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  // LM head: more tiles than a wave, one per warp
  const int64_t rows = 6 * 16 * static_cast<int64_t>(k::sm_count()) + 37, cols = 512;
  QMatrix W(Type::Q6_K, rows, cols, rng);
  const std::vector<float> xl = randn(cols, rng);
  // attention: 2 KV heads of 4 query heads, 300 cached positions in 4 slices of 96 (three groups each)
  const int hd = 128, n_kv = 2, G = 4, n_head = n_kv * G, past = 300, n_split = 4;
  const int Q = n_head * hd, KV = n_kv * hd;
  std::vector<uint16_t> hk(static_cast<size_t>(past + 1) * KV), hv(hk.size());
  for (size_t i = 0; i < hk.size(); ++i) {
    hk[i] = moe::quant::f32_to_fp16(randn(1, rng)[0]);
    hv[i] = moe::quant::f32_to_fp16(randn(1, rng)[0]);
  }
  const std::vector<float> qkv = randn(static_cast<size_t>(Q + 2 * KV), rng, 2.f), qn = randn(hd, rng),
                           kn = randn(hd, rng);
  k::Rope rope;
  rope.theta_scale = std::pow(1e6f, -2.0f / hd);
  // experts: the routing from the O projection's sums, 4 of 16 experts
  const int n = 512, C = 1024, X = 16, K = 4, F = 256;
  QMatrix O(Type::Q4_K, n, C, rng, 0.05f), R(Type::F32, X, n, rng, 0.2f);
  QMatrix Gm(Type::Q4_K, X * F, n, rng), U(Type::Q4_K, X * F, n, rng), D(Type::Q6_K, X * n, F, rng);
  const std::vector<float> x = randn(n, rng, 2.f), o = randn(C, rng), g = randn(n, rng);
  std::vector<float> want[4];
  for (const char* ev : {"0", "15"})
    for (const char* sm : {"1", "0"}) {
      SCOPED_TRACE(::testing::Message() << "MOE_CUDA_EVICT=" << ev << " MOE_CUDA_DOWN_SMEM=" << sm);
      setenv("MOE_CUDA_EVICT", ev, 1);
      setenv("MOE_CUDA_DOWN_SMEM", sm, 1);
      std::vector<float> got[4];
      {
        Dev<float> dx(xl), dy(std::vector<float>(rows, 0.f));
        k::GemvOut out{W.mat(), dy.p};
        ok(k::gemv(&out, 1, dx.p, nullptr, 0.f, true, nullptr, nullptr, nullptr, true));
        ok(cudaDeviceSynchronize());
        got[0] = dy.get();
      }
      {
        Dev<float> dqkv(qkv), dqn(qn), dkn(kn), out(Q), partials(k::attention_partials_floats(n_kv, n_split, G, hd));
        Dev<uint16_t> dk(hk), dv(hv);
        Dev<int32_t> dpos(std::vector<int32_t>{past});
        Dev<int> counters(std::vector<int>(k::attention_counter_ints(n_kv, n_split), 0));
        ok(k::attention_decode(dqkv.p, dpos.p, dqn.p, dkn.p, 1e-6f, rope, dk.p, dv.p, n_head, n_kv, hd, n_split,
                               partials.p, counters.p, out.p, nullptr, nullptr, 0));
        ok(cudaDeviceSynchronize());
        got[1] = out.get();
      }
      {
        Dev<float> dx(x), dO(o), dg(g), dw(K), act(K * F), ref(std::vector<float>{1.f});
        Dev<long long> sums(std::vector<long long>(X + 1, 0));
        Dev<int32_t> di(K);
        const k::RouterAcc ra = router_acc(sums.p, ref.p, X);
        ok(k::o_proj_router(O.mat(), dO.p, dx.p, R.mat(), dg.p, ra, nullptr));
        ok(k::expert_gate_up_acc(Gm.mat(F), U.mat(F), dx.p, dg.p, 1e-6f, ra, K, di.p, dw.p, act.p, nullptr, nullptr));
        ok(k::expert_down_add(D.mat(n), act.p, di.p, dw.p, K, dx.p, nullptr, nullptr, nullptr));
        ok(cudaDeviceSynchronize());
        got[2] = act.get();
        got[3] = dx.get();
      }
      for (int i = 0; i < 4; ++i) {
        if (want[i].empty()) {
          want[i] = got[i];
          double moved = 0;
          for (float v : got[i]) moved += std::fabs(v);
          EXPECT_GT(moved, 0.0) << "output " << i;
          continue;
        }
        ASSERT_EQ(got[i].size(), want[i].size());
        for (size_t r = 0; r < got[i].size(); ++r) ASSERT_EQ(got[i][r], want[i][r]) << "output " << i << " row " << r;
      }
    }
  unsetenv("MOE_CUDA_EVICT");
  unsetenv("MOE_CUDA_DOWN_SMEM");
}

// The fused decode attention (norm + RoPE + KV store + attention of one new token) against the same
// twin: the new position's K/V are read back fp16-rounded like every cached one.
TEST(CudaKernels, AttentionDecodeFusesNormRopeAndStore) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int hd : {64, 128})
    // 611: 20 slices, 2210: 35 of 64, 4100: 43 of 96 (three groups of 32 each; the merge in two levels)
    for (int past : {0, 70, 611, 2210, 4100})
    for (int G : {8, 4, 2, 1}) {  // a full 8-head tile of the tensor-core steps, or zero-padded heads
      const int n_kv = 2, n_head = n_kv * G, ctx = std::max(700, past + 1);
      const int Q = n_head * hd, KV = n_kv * hd;
      const float eps = 1e-6f, theta_scale = std::pow(1e6f, -2.0f / hd);
      std::vector<float> ck = randn(static_cast<size_t>(ctx) * KV, rng), cv = randn(static_cast<size_t>(ctx) * KV, rng);
      std::vector<uint16_t> hk(ck.size()), hv(cv.size());
      for (size_t i = 0; i < hk.size(); ++i) {
        hk[i] = moe::quant::f32_to_fp16(ck[i]);
        hv[i] = moe::quant::f32_to_fp16(cv[i]);
        ck[i] = moe::quant::fp16_to_f32(hk[i]);
        cv[i] = moe::quant::fp16_to_f32(hv[i]);
      }
      std::vector<float> qkv = randn(static_cast<size_t>(Q + 2 * KV), rng, 2.f), qn = randn(hd, rng), kn = randn(hd, rng);
      // twin: normalised, rotated q; this position's K/V into the cache
      std::vector<float> row = qkv;
      for (int h = 0; h < n_head; ++h) norm_rope_cpu(&row[h * hd], qn.data(), hd, past, theta_scale, eps);
      for (int g = 0; g < n_kv; ++g) {
        norm_rope_cpu(&row[Q + g * hd], kn.data(), hd, past, theta_scale, eps);
        for (int d = 0; d < hd; ++d) {
          ck[past * KV + g * hd + d] = moe::quant::fp16_to_f32(moe::quant::f32_to_fp16(row[Q + g * hd + d]));
          cv[past * KV + g * hd + d] = moe::quant::fp16_to_f32(moe::quant::f32_to_fp16(row[Q + KV + g * hd + d]));
        }
      }
      moe::cuda::k::Rope rope;
      rope.theta_scale = theta_scale;
      for (int n_split : {1, 5, 64, 128})  // 128: contexts of more than 64 slices (4100) always in two levels
      for (bool table : {false, true}) {  // angles per block, or the position's rope_table
        SCOPED_TRACE(::testing::Message() << "hd " << hd << " past " << past << " G " << G << " n_split " << n_split
                                          << " table " << table);
        Dev<float> dqkv(qkv), dqn(qn), dkn(kn), out(Q), partials(k::attention_partials_floats(n_kv, n_split, G, hd));
        Dev<uint16_t> dk(hk), dv(hv);
        Dev<int32_t> dpos(std::vector<int32_t>{past});
        Dev<int> counters(std::vector<int>(k::attention_counter_ints(n_kv, n_split), 0));
        Dev<float> cs(std::vector<float>(hd, -7.f));
        if (table) ok(k::rope_table(dpos.p, 1, rope, hd, cs.p, nullptr));
        ok(k::attention_decode(dqkv.p, dpos.p, dqn.p, dkn.p, eps, rope, dk.p, dv.p, n_head, n_kv, hd, n_split,
                               partials.p, counters.p, out.p, table ? cs.p : nullptr, nullptr));
        ok(cudaDeviceSynchronize());
        std::vector<float> o = out.get();
        // several slices: each slice's normalised output passes through fp16 (AttSlices, launch.cuh), a
        // weighted mean of cache rows rounded to 2^-11 of the largest |v| at most, and with the two-level
        // merge (attention_leaf) each group's merged output once more; one slice: fp32 only
        double slack = 0;
        // the slices (dev::dec_slices): at least the minimum length, then whole 32-position groups
        int chunk = (past + 1 + n_split - 1) / n_split;
        if (n_split > 1) chunk = chunk < k::attention_min_chunk() ? k::attention_min_chunk() : (chunk + 31) / 32 * 32;
        const int n_eff = (past + 1 + chunk - 1) / chunk;
        const int tree = k::attention_tree_min();
        const double rounding = n_eff > 1 && ((tree > 0 && n_eff >= tree) || n_eff > 64) ? 1024 : 2048;
        if (n_eff > 1)
          for (int i = 0; i < (past + 1) * KV; ++i)
            slack = std::max(slack, std::fabs(static_cast<double>(cv[i])) / rounding);
        for (int h = 0; h < n_head; ++h) {
          const std::vector<double> want = attention_twin(&row[h * hd], ck, cv, KV, h / G, hd, past + 1);
          for (int d = 0; d < hd; ++d) ASSERT_NEAR(o[h * hd + d], want[d], 2e-4 + slack) << "head " << h << " dim " << d;
        }
        std::vector<uint16_t> gk = dk.get(), gv = dv.get();
        for (int i = 0; i < KV; ++i) {
          EXPECT_NEAR(moe::quant::fp16_to_f32(gk[past * KV + i]), ck[past * KV + i], 2e-3 * (1 + std::fabs(ck[past * KV + i])));
          EXPECT_EQ(gv[past * KV + i], moe::quant::f32_to_fp16(cv[past * KV + i]));
        }
        EXPECT_EQ(dqkv.get(), qkv) << "the raw q/k/v row is left as it was";
        std::vector<int> c = counters.get();
        EXPECT_EQ(*std::max_element(c.begin(), c.end()), 0);
      }
    }
}
