// Quantized tensor math on the CPU: block formats, reference quantizers, activation
// quantization and dot products in two modes (REFERENCE.md §5).
//   fast  : the activation row is quantized the way llama.cpp pairs it with the weight type
//           (Q8_K for K-quants, Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, F16/BF16 for
//           F16/BF16 weights, F32 for F32) and dot products run on integers.
//   exact : FP32 activations against weights dequantized in registers (the F2 guard's reference).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "moe/gguf.hpp"

namespace moe::quant {

using gguf::Type;

// ---- scalar conversions (round to nearest even; NaN stays NaN) ----------------------------
float fp16_to_f32(uint16_t h);
uint16_t f32_to_fp16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);

// Weight types the CPU computes with: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K.
bool is_weight_type(Type t);

// Dequantize one row of n elements (n a multiple of the block size).
void dequantize_row(Type t, const void* src, float* dst, int64_t n);
// Reference quantizer of a row (the weight writer and the tests use it); writes row_bytes(t, n).
// Supports every weight type above plus Q8_K and Q8_1.
void quantize_row(Type t, const float* src, void* dst, int64_t n);

enum class ActMode { fast, exact };

// A weight matrix: `rows` rows of `cols` elements, consecutive rows `row_bytes` apart.
struct Matrix {
  const uint8_t* data = nullptr;
  Type type = Type::F32;
  int64_t cols = 0;
  int64_t rows = 0;
  size_t row_bytes = 0;
  const uint8_t* row(int64_t r) const { return data + static_cast<size_t>(r) * row_bytes; }
};

// ---- fast mode building blocks ------------------------------------------------------------
Type act_type(Type weight);                    // activation format paired with `weight`
size_t act_row_bytes(Type weight, int64_t n);  // bytes of one quantized activation row
void quantize_act(Type weight, const float* x, void* dst, int64_t n);
float dot_fast(Type weight, const void* wrow, const void* act, int64_t n);
// ---- exact mode building block
float dot_exact(Type weight, const void* wrow, const float* x, int64_t n);

// Single-threaded kernels over a row range: Y[t * y_stride + r] for r in [r0, r1), t < n_tok.
// fast: `acts` holds n_tok activation rows quantized with quantize_act(W.type, ...), act_stride apart.
void matmul_rows_fast(const Matrix& W, int64_t r0, int64_t r1, const uint8_t* acts, size_t act_stride,
                      int64_t n_tok, float* Y, int64_t y_stride);
// exact: X holds n_tok fp32 rows of W.cols, x_stride floats apart.
void matmul_rows_exact(const Matrix& W, int64_t r0, int64_t r1, const float* X, int64_t x_stride,
                       int64_t n_tok, float* Y, int64_t y_stride);

// ---- threads ----------------------------------------------------------------------------
// A fixed pool; run() splits [0, n_tasks) over the threads (the caller is thread 0) and returns
// when all are done. No allocation per call.
class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  int size() const;
  // fn(task, thread) for every task; tasks are handed out dynamically (an atomic counter).
  void run(int64_t n_tasks, const std::function<void(int64_t task, int thread)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Y[t * y_stride + r] = W.row(r) · X[t * x_stride ...] for every r < W.rows, t < n_tok, on the pool.
// In fast mode the activations are quantized once per call into a scratch buffer kept per thread.
void matmul(const Matrix& W, const float* X, int64_t x_stride, int64_t n_tok, float* Y, int64_t y_stride,
            ActMode mode, ThreadPool& pool);

// The SIMD level picked at run time ("avx512-vnni", "avx2", "scalar"); MOE_ISA=scalar|avx2|avx512
// in the environment caps it (tests compare the paths).
const char* isa_name();

}  // namespace moe::quant
