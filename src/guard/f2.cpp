// f2_report and its messages. Thresholds and semantics: DESIGN.md "The guard is a pure function".
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "moe/error.hpp"
#include "moe/finite.hpp"
#include "moe/guard.hpp"

namespace moe::guard {

double cosine(std::span<const float> a, std::span<const float> b) {
  const size_t n = std::min(a.size(), b.size());
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  const double norm = std::sqrt(na) * std::sqrt(nb);
  if (!(norm >= kNormFloor)) return 0.0;
  return dot / norm;
}

int32_t argmax(std::span<const float> v) {
  int32_t best = -1;
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i])) continue;
    if (best < 0 || v[i] > v[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

static std::optional<int64_t> non_finite_at(std::span<const float> row) {
  if (const int64_t i = first_non_finite(row); i >= 0) return i;
  return std::nullopt;
}

Report f2_report(std::span<const float> cpu, std::span<const float> gpu, int64_t n_vocab) {
  Report r;
  if (n_vocab <= 0) return r;
  const size_t nv = static_cast<size_t>(n_vocab);
  r.positions = static_cast<int64_t>(std::min(cpu.size(), gpu.size()) / nv);
  // A non-finite GPU logit anywhere (position 0 included) is never a near-tie: reject at once.
  for (int64_t p = 0; p < r.positions; ++p) {
    for (const auto& [side, all] : {std::pair{"GPU", gpu}, std::pair{"CPU", cpu}}) {
      if (auto id = non_finite_at(all.subspan(static_cast<size_t>(p) * nv, nv))) {
        r.accepted = false;
        r.first_bad_pos = p;
        r.non_finite_side = side;
        r.non_finite_id = *id;
        return r;
      }
    }
  }
  for (int64_t p = 0; p < r.positions; ++p) {
    auto c = cpu.subspan(static_cast<size_t>(p) * nv, nv);
    auto g = gpu.subspan(static_cast<size_t>(p) * nv, nv);
    const int32_t ca = argmax(c), ga = argmax(g);
    if (p == 0) {
      // The first token has no context: near-ties there are benign and not judged.
      r.pos0_argmax_flip = ca != ga;
      continue;
    }
    const double cs = cosine(c, g);
    ++r.judged;
    if (!r.min_cosine || cs < *r.min_cosine) r.min_cosine = cs;
    const bool bad = cs < kCosineMin || (ca != ga && cs < kArgmaxMismatchCosine);
    if (bad && !r.first_bad_pos) {
      r.accepted = false;
      r.first_bad_pos = p;
      r.bad_cpu_argmax = ca;
      r.bad_gpu_argmax = ga;
      r.bad_cosine = cs;
    }
  }
  return r;
}

std::string reject_reason(const Report& r) {
  if (r.accepted || !r.first_bad_pos) return "the F2 guard accepted the GPU";
  if (r.non_finite_side) {
    if (*r.non_finite_side == "CPU")
      return fmt::format("the CPU reference of the F2 guard has a non-finite logit at position {} (token id {})",
                         *r.first_bad_pos, r.non_finite_id);
    return fmt::format("GPU output diverges from CPU at position {} (non-finite logit at token id {})",
                       *r.first_bad_pos, r.non_finite_id);
  }
  return fmt::format("GPU output diverges from CPU at position {} (argmax {} != {}, cosine {:.4f}); min cosine {:.4f}",
                     *r.first_bad_pos, r.bad_gpu_argmax, r.bad_cpu_argmax, r.bad_cosine,
                     r.min_cosine.value_or(r.bad_cosine));
}

std::string accept_line(const Report& r, double ms) {
  return fmt::format("F2 guard: GPU matches the CPU forward on {} positions (min cosine {:.4f}) in {:.0f} ms",
                     r.positions, r.min_cosine.value_or(1.0), ms);
}

std::string skipped_line() { return "F2 guard: SKIP_PARITY_GATE=1 \u2014 nothing was compared on this run"; }

std::string nothing_judged_line(int64_t n_prompt) {
  return fmt::format("F2 guard: a {}-token prompt has no real position to compare; nothing was judged", n_prompt);
}

static std::span<const int32_t> probe_of(std::span<const int32_t> prompt) {
  const size_t n_probe = std::min(prompt.size(), static_cast<size_t>(kProbeMax));
  return prompt.subspan(prompt.size() - n_probe);
}

Reference cpu_reference(Forward& cpu_exact, std::span<const int32_t> prompt) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto probe = probe_of(prompt);
  Reference r;
  r.n_vocab = cpu_exact.n_vocab();
  std::vector<float> step;
  cpu_exact.reset();
  cpu_exact.eval(probe, true, r.rows);
  r.next = argmax(std::span<const float>(r.rows).subspan((probe.size() - 1) * static_cast<size_t>(r.n_vocab)));
  cpu_exact.eval(std::span<const int32_t>(&r.next, 1), false, step);
  r.rows.insert(r.rows.end(), step.begin(), step.end());
  cpu_exact.reset();
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::vector<float> gpu_probe(Forward& gpu, std::span<const int32_t> prompt, const Reference& ref) {
  const auto probe = probe_of(prompt);
  std::vector<float> rows, step;
  // Any GPU-side failure is a reason to fall back, whatever category the backend gave it.
  try {
    if (gpu.n_vocab() != ref.n_vocab)
      fail(Exit::gpu_failed, "the GPU forward has {} vocabulary rows, the CPU forward {}", gpu.n_vocab(), ref.n_vocab);
    gpu.reset();
    gpu.eval(probe, true, rows);
    gpu.eval(std::span<const int32_t>(&ref.next, 1), false, step);
    rows.insert(rows.end(), step.begin(), step.end());
    gpu.reset();
    if (rows.size() != ref.rows.size())
      fail(Exit::gpu_failed, "it returned {} logits for the probe, expected {}", rows.size(), ref.rows.size());
  } catch (const std::exception& e) {
    fail(Exit::gpu_failed, "the GPU forward failed during the F2 guard: {}", e.what());
  }
  return rows;
}

Report run_probe(Forward& cpu_exact, Forward& gpu, std::span<const int32_t> prompt) {
  const Reference ref = cpu_reference(cpu_exact, prompt);
  return f2_report(ref.rows, gpu_probe(gpu, prompt, ref), ref.n_vocab);
}

}  // namespace moe::guard
