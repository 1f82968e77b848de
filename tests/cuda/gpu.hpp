// Helpers of the GPU tests: skip without a device, device buffers, CPU twins' small pieces.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "launch.cuh"
#include "moe/cuda.hpp"
#include "moe/gguf.hpp"
#include "moe/quant.hpp"

// Every GPU test starts with this: without a device ctest reports the test as skipped.
#define REQUIRE_GPU()                                                        \
  do {                                                                       \
    if (moe::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

namespace gpu_test {

inline void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

// A device copy of a host vector; poisoned (NaN bytes) when made empty.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T) + 16), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xFF, count * sizeof(T) + 16), cudaSuccess);  // NaN for floats
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  void put(const std::vector<T>& h) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
};

inline uint64_t fresh_seed() { return std::random_device{}(); }

// The router's fixed-point sums (k::RouterAcc) over device buffers.
inline moe::cuda::k::RouterAcc router_acc(long long* acc, float* ref, int n) {
  moe::cuda::k::RouterAcc r;
  r.acc = acc;
  r.ref = ref;
  r.n = n;
  return r;
}

inline std::vector<float> randn(size_t n, std::mt19937_64& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// f(i) for i in [0, n), spread over the host's cores in contiguous ranges (the CPU twins' large loops: f
// must only write what belongs to its own i).
template <typename F>
void parallel_for(int64_t n, F&& f) {
  const int64_t nt = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 64);
  const int64_t per = (n + nt - 1) / nt;
  std::vector<std::thread> pool;
  for (int64_t lo = 0; lo < n; lo += per)
    pool.emplace_back([&f, lo, hi = std::min(n, lo + per)] {
      for (int64_t i = lo; i < hi; ++i) f(i);
    });
  for (std::thread& t : pool) t.join();
}

// A random matrix quantized to `t` on the host, its CPU dequantization, and its device copy.
struct QMatrix {
  moe::gguf::Type type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;  // GGUF layout
  std::vector<float> deq;      // CPU twin: quant::dequantize_row of every row
  uint8_t* dev = nullptr;
  moe::cuda::k::Mat mat(int64_t expert_rows = 0) const {
    moe::cuda::k::Mat m;
    m.data = dev;
    m.type = static_cast<uint32_t>(type);
    m.cols = static_cast<int32_t>(cols);
    m.rows = static_cast<int32_t>(expert_rows ? expert_rows : rows);
    m.row_stride = static_cast<int64_t>(moe::cuda::device_bytes(type, cols, 1));
    m.expert_stride = m.row_stride * m.rows;
    return m;
  }
  QMatrix(moe::gguf::Type t, int64_t r, int64_t c, std::mt19937_64& rng, float sd = 1.f) : type(t), rows(r), cols(c) {
    const size_t rb = moe::gguf::row_bytes(t, c);
    bytes.resize(rb * r);
    deq.resize(static_cast<size_t>(r * c));
    std::vector<float> src = randn(static_cast<size_t>(r * c), rng, sd);
    parallel_for(r, [&](int64_t i) {  // rows are independent: the same bytes as one after the other
      moe::quant::quantize_row(t, src.data() + i * c, bytes.data() + i * rb, c);
      moe::quant::dequantize_row(t, bytes.data() + i * rb, deq.data() + i * c, c);
    });
    const uint64_t db = moe::cuda::device_bytes(t, c, r);
    std::vector<uint8_t> packed(db);
    moe::cuda::repack_rows(t, bytes.data(), packed.data(), c, r);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), db), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dev, packed.data(), db, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~QMatrix() { cudaFree(dev); }
  QMatrix(const QMatrix&) = delete;
};

inline double dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}
inline double abs_dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::fabs(static_cast<double>(a[i]) * b[i]);
  return s;
}

inline std::vector<float> rmsnorm(const float* x, const float* w, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double scale = 1.0 / std::sqrt(ss / n + eps);
  std::vector<float> y(n);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * scale * w[i]);
  return y;
}

// Every type the CUDA kernels support (= the CPU's weight types).
inline std::vector<moe::gguf::Type> all_types() {
  using T = moe::gguf::Type;
  return {T::F32, T::F16, T::BF16, T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q8_0,
          T::Q2_K, T::Q3_K, T::Q4_K, T::Q5_K, T::Q6_K};
}

// An fp32 result is right when its error is within a few ulps of the sum of |terms|.
inline void expect_close(double got, double want, double scale, const char* what, int64_t i) {
  EXPECT_NEAR(got, want, 1e-5 * scale + 1e-6) << what << " index " << i;
  EXPECT_TRUE(std::isfinite(got)) << what << " index " << i;
}

}  // namespace gpu_test
