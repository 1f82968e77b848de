// Run-time choice of the kernel table (CPU features capped by MOE_ISA) and the public entry points
// that go through it.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "internal.hpp"
#include "moe/error.hpp"

namespace moe::quant {
namespace detail {
namespace {

std::array<Kernels, 3> build_tables() {
  std::array<Kernels, 3> t;
  fill_scalar_kernels(t[0]);
  t[1] = t[0];
  t[2] = t[0];
#if defined(__x86_64__) || defined(__i386__)
  Isa best = cpu_isa();
  if (best >= Isa::avx2) fill_avx2_kernels(t[1]);
  if (best >= Isa::avx512) {
    fill_avx2_kernels(t[2]);
    fill_avx512_kernels(t[2]);
  }
#endif
  return t;
}

const std::array<Kernels, 3>& tables() {
  static const std::array<Kernels, 3> t = build_tables();
  return t;
}

Isa isa_from_env() {
  Isa best = cpu_isa();
  const char* cap = std::getenv("MOE_ISA");
  if (!cap || !*cap) return best;
  Isa want = best;
  if (std::strcmp(cap, "scalar") == 0) want = Isa::scalar;
  else if (std::strcmp(cap, "avx2") == 0) want = Isa::avx2;
  else if (std::strncmp(cap, "avx512", 6) == 0) want = Isa::avx512;
  return std::min(want, best);
}

std::atomic<const Kernels*> g_active{nullptr};

}  // namespace

#if defined(__x86_64__) || defined(__i386__)
// CPUID leaf 1, ECX bit 29; clang before 16 has no "f16c" in __builtin_cpu_supports (the fuzz build).
static bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}
#endif

Isa cpu_isa() {
#if defined(__x86_64__) || defined(__i386__)
  static const Isa isa = [] {
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c() &&
                __builtin_cpu_supports("bmi2");
    if (!avx2) return Isa::scalar;
    // The AVX-512 kernels use VNNI (vpdpbusd); without it the AVX2 ones are as good.
    bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vnni");
    return avx512 ? Isa::avx512 : Isa::avx2;
  }();
  return isa;
#else
  return Isa::scalar;
#endif
}

const Kernels& kernels(Isa isa) { return tables()[static_cast<size_t>(std::min(isa, cpu_isa()))]; }

const Kernels& active() {
  const Kernels* k = g_active.load(std::memory_order_acquire);
  if (!k) {
    k = &kernels(isa_from_env());
    g_active.store(k, std::memory_order_release);
  }
  return *k;
}

void reload_isa_from_env() { g_active.store(&kernels(isa_from_env()), std::memory_order_release); }

}  // namespace detail

const char* isa_name() { return detail::active().name; }

void quantize_act(Type weight, const float* x, void* dst, int64_t n) {
  Type a = act_type(weight);
  detail::blocks_in_row(a, n);
  detail::active().quantize_act[static_cast<size_t>(a)](x, dst, n);
}

namespace {
detail::DotFastFn fast_fn(Type weight) {
  auto id = static_cast<uint32_t>(weight);
  detail::DotFastFn fn = id < gguf::kTypeCount ? detail::active().dot_fast[id] : nullptr;
  if (!fn) detail::unsupported_type(weight, "as a CPU weight");
  return fn;
}
detail::DotExactFn exact_fn(Type weight) {
  auto id = static_cast<uint32_t>(weight);
  detail::DotExactFn fn = id < gguf::kTypeCount ? detail::active().dot_exact[id] : nullptr;
  if (!fn) detail::unsupported_type(weight, "as a CPU weight");
  return fn;
}

// Rows handled together against every token, so a row block stays in L1 while the activation
// rows stream past it (prefill); about 16 KiB of weights.
int64_t row_block(size_t row_bytes) { return std::max<int64_t>(1, static_cast<int64_t>((16u << 10) / std::max<size_t>(row_bytes, 1))); }
}  // namespace

float dot_fast(Type weight, const void* wrow, const void* act, int64_t n) {
  detail::blocks_in_row(weight, n);
  return fast_fn(weight)(wrow, act, n);
}

float dot_exact(Type weight, const void* wrow, const float* x, int64_t n) {
  detail::blocks_in_row(weight, n);
  return exact_fn(weight)(wrow, x, n);
}

void matmul_rows_fast(const Matrix& W, int64_t r0, int64_t r1, const uint8_t* acts, size_t act_stride, int64_t n_tok,
                      float* Y, int64_t y_stride) {
  detail::DotFastFn fn = fast_fn(W.type);
  const int64_t n = W.cols;
  if (n_tok == 1) {
    for (int64_t r = r0; r < r1; ++r) Y[r] = fn(W.row(r), acts, n);
    return;
  }
  const int64_t rb = row_block(W.row_bytes);
  detail::DotFastMultiFn multi = detail::active().dot_fast_multi[static_cast<size_t>(W.type)];
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    if (multi) {
      // Four activation rows share each unpacked weight row.
      for (int64_t t = 0; t < n_tok; t += 4) {
        const int na = static_cast<int>(std::min<int64_t>(4, n_tok - t));
        const uint8_t* a = acts + static_cast<size_t>(t) * act_stride;
        for (int64_t r = b0; r < b1; ++r) multi(W.row(r), a, act_stride, na, n, Y + t * y_stride + r, y_stride);
      }
      continue;
    }
    for (int64_t t = 0; t < n_tok; ++t) {
      const uint8_t* a = acts + static_cast<size_t>(t) * act_stride;
      float* y = Y + t * y_stride;
      for (int64_t r = b0; r < b1; ++r) y[r] = fn(W.row(r), a, n);
    }
  }
}

void matmul_rows_exact(const Matrix& W, int64_t r0, int64_t r1, const float* X, int64_t x_stride, int64_t n_tok,
                       float* Y, int64_t y_stride) {
  detail::DotExactFn fn = exact_fn(W.type);
  const int64_t n = W.cols;
  if (n_tok == 1) {
    for (int64_t r = r0; r < r1; ++r) Y[r] = fn(W.row(r), X, n);
    return;
  }
  // Several tokens: weight rows are dequantized once into a per-thread buffer (at most four rows,
  // never the matrix) and multiplied with every token's fp32 activations.
  const detail::Kernels& k = detail::active();
  auto deq = k.dequant_row[static_cast<size_t>(W.type)];
  thread_local std::vector<float> rows;
  if (static_cast<int64_t>(rows.size()) < 4 * n) rows.resize(static_cast<size_t>(4 * n));
  for (int64_t r = r0; r < r1; r += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, r1 - r));
    const float* w[4];
    for (int i = 0; i < nr; ++i) {
      if (W.type == Type::F32) {
        w[i] = reinterpret_cast<const float*>(W.row(r + i));
      } else {
        deq(W.row(r + i), rows.data() + i * n, n);
        w[i] = rows.data() + i * n;
      }
    }
    if (k.f32_block) {
      for (int64_t t = 0; t < n_tok; t += 4) {
        const int nt = static_cast<int>(std::min<int64_t>(4, n_tok - t));
        const float* x[4];
        for (int j = 0; j < nt; ++j) x[j] = X + (t + j) * x_stride;
        k.f32_block(w, nr, x, nt, n, Y + t * y_stride + r, y_stride);
      }
    } else {
      detail::DotExactFn f32 = k.dot_exact[static_cast<size_t>(Type::F32)];
      for (int i = 0; i < nr; ++i)
        for (int64_t t = 0; t < n_tok; ++t) Y[t * y_stride + r + i] = f32(w[i], X + t * x_stride, n);
    }
  }
}

}  // namespace moe::quant
