// Where a row of floats stops being finite: the one check that the CPU forward, the engine (logits from any
// backend) and the F2 guard make before they use a row. Header-only.
#pragma once
#include <bit>
#include <cstdint>
#include <span>

namespace moe {

// Index of the first value that is NaN or infinite, or -1. First whether there is any (an all-ones exponent),
// by a loop without an early exit that the compiler vectorises (151,936 logits: 75-79 -> 22 us against a
// search that stops at the first, tools/bench/bench_sampler.cpp, docs/PERFORMANCE.md version 28); then where.
inline int64_t first_non_finite(std::span<const float> v) {
  uint32_t any = 0;
  for (float x : v) any |= (std::bit_cast<uint32_t>(x) & 0x7f800000u) == 0x7f800000u;
  if (!any) return -1;
  for (size_t i = 0; i < v.size(); ++i)
    if ((std::bit_cast<uint32_t>(v[i]) & 0x7f800000u) == 0x7f800000u) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace moe
