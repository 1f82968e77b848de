// F2 guard: before the GPU forward may serve a run, its logits on the real prompt are compared
// with the FP32-activation CPU forward's. f2_report is a pure function over two logit sets; the
// probe runner feeds the same tokens through two Forwards and hands the logits to it.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moe/forward.hpp"

namespace moe::guard {

// The probe is the last kProbeMax prompt tokens, plus one greedy decode step.
inline constexpr int64_t kProbeMax = 64;
// Reject a position whose cosine is below kCosineMin, or whose argmaxes differ while the cosine is
// below kArgmaxMismatchCosine (an argmax flip above it is a near-tie and is accepted).
inline constexpr double kCosineMin = 0.95;
inline constexpr double kArgmaxMismatchCosine = 0.98;
// Norm products below this make the cosine meaningless; it is then taken as 0.
inline constexpr double kNormFloor = 1e-12;

struct Report {
  int64_t positions = 0;        // rows compared (min of both sides), position 0 included
  int64_t judged = 0;           // rows judged (position 0 never is)
  bool accepted = true;
  std::optional<double> min_cosine;  // over judged positions; empty when nothing was judged
  // The first rejected position (empty when accepted) and what was seen there.
  std::optional<int64_t> first_bad_pos;
  int32_t bad_cpu_argmax = -1;
  int32_t bad_gpu_argmax = -1;
  double bad_cosine = 0.0;
  // A non-finite logit rejects at once: side ("GPU" or "CPU"), position and vocabulary id.
  std::optional<std::string> non_finite_side;
  int64_t non_finite_id = -1;
  bool pos0_argmax_flip = false;  // recorded only; position 0 has no context to judge
};

// Cosine of two vectors, accumulated in double; 0 when either norm is (nearly) zero.
double cosine(std::span<const float> a, std::span<const float> b);
// Index of the largest value, lowest index on ties; NaN never wins.
int32_t argmax(std::span<const float> v);

// cpu and gpu hold rows of n_vocab logits (row p = position p of the probe).
Report f2_report(std::span<const float> cpu, std::span<const float> gpu, int64_t n_vocab);

// "GPU output diverges from CPU at position ..." (the fallback reason of a rejection).
std::string reject_reason(const Report& r);
// The accepted line "F2 guard: GPU matches the CPU forward on N positions (min cosine c) in ms ms".
std::string accept_line(const Report& r, double ms);
std::string skipped_line();
std::string nothing_judged_line(int64_t n_prompt);

// The probe: the last kProbeMax tokens of `prompt`, then one decode step on the CPU's argmax of
// the last probe row, each side from an empty cache (forwards are reset() before and after).
struct Reference {
  std::vector<float> rows;  // (n_probe + 1) rows of n_vocab
  int32_t next = 0;         // the decode step's token
  int64_t n_vocab = 0;
  double ms = 0;            // time the reference took
};
// CPU side; `cpu_exact` should be the FP32-activation CPU forward. Independent of the GPU, so the
// dispatcher may run it while the GPU model uploads.
Reference cpu_reference(Forward& cpu_exact, std::span<const int32_t> prompt);
// GPU side: the probe in one eval with every row, then the decode step through eval. Any exception
// becomes Error(Exit::gpu_failed) naming the guard.
std::vector<float> gpu_probe(Forward& gpu, std::span<const int32_t> prompt, const Reference& ref);
// Both sides, then f2_report.
Report run_probe(Forward& cpu_exact, Forward& gpu, std::span<const int32_t> prompt);

}  // namespace moe::guard
