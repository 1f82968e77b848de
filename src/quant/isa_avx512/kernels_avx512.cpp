// AVX-512 kernels with VNNI (compiled with the AVX-512 flags; used only when the CPU has them).
#include <immintrin.h>

#include "../internal.hpp"

namespace moe::quant::detail {

void fill_avx512_kernels(Kernels& k) { k.name = "avx512-vnni"; }

}  // namespace moe::quant::detail
