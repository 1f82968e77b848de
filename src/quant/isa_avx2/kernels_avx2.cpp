// AVX2 kernels (compiled with -mavx2 -mfma -mf16c -mbmi2; used only when the CPU has them).
#include <immintrin.h>

#include "../internal.hpp"

namespace moe::quant::detail {

void fill_avx2_kernels(Kernels& k) { k.name = "avx2"; }

}  // namespace moe::quant::detail
