// f2_report at and around each threshold, non-finite logits, position 0, short probes; the probe
// runner with scripted forwards. Expected cosines are computed here, not by the guard.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "moe/error.hpp"
#include "moe/guard.hpp"

namespace {

using moe::guard::f2_report;
using moe::guard::Report;

double ref_cosine(const std::vector<float>& a, const std::vector<float>& b) {
  long double d = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += static_cast<long double>(a[i]) * b[i];
    na += static_cast<long double>(a[i]) * a[i];
    nb += static_cast<long double>(b[i]) * b[i];
  }
  return static_cast<double>(d / std::sqrt(na * nb));
}

// A GPU row g(z) = base + z * e_extra whose cosine with `cpu` equals `target` (bisection on z, the
// cosine falling monotonically as z grows).
std::vector<float> row_with_cosine(const std::vector<float>& cpu, std::vector<float> base, size_t extra,
                                   double target) {
  double lo = 0, hi = 100;
  for (int it = 0; it < 200; ++it) {
    const double mid = 0.5 * (lo + hi);
    auto g = base;
    g[extra] += static_cast<float>(mid);
    (ref_cosine(cpu, g) > target ? lo : hi) = mid;
  }
  base[extra] += static_cast<float>(lo);
  return base;
}

struct Rows {
  int64_t nv;
  std::vector<float> cpu, gpu;
  void add(const std::vector<float>& c, const std::vector<float>& g) {
    cpu.insert(cpu.end(), c.begin(), c.end());
    gpu.insert(gpu.end(), g.begin(), g.end());
  }
};

// Position 0 identical, position 1 given.
Report two_positions(const std::vector<float>& c1, const std::vector<float>& g1) {
  Rows r{static_cast<int64_t>(c1.size()), {}, {}};
  std::vector<float> same(c1.size(), 0.f);
  same[0] = 1.f;
  r.add(same, same);
  r.add(c1, g1);
  return f2_report(r.cpu, r.gpu, r.nv);
}

const std::vector<float> kCpuSame = {3.f, 1.f, 0.f, 0.f};    // argmax 0
const std::vector<float> kCpuClose = {1.f, 0.999f, 0.f, 0.f};  // argmax 0, a near tie

TEST(F2Report, IdenticalLogitsAccepted) {
  Rows r{5, {}, {}};
  for (int p = 0; p < 4; ++p) {
    std::vector<float> v = {0.1f * p, -1.f, 2.f, 0.5f, static_cast<float>(p)};
    r.add(v, v);
  }
  const Report rep = f2_report(r.cpu, r.gpu, r.nv);
  EXPECT_TRUE(rep.accepted);
  EXPECT_EQ(rep.positions, 4);
  EXPECT_EQ(rep.judged, 3);
  ASSERT_TRUE(rep.min_cosine.has_value());
  EXPECT_NEAR(*rep.min_cosine, 1.0, 1e-12);
  EXPECT_FALSE(rep.first_bad_pos.has_value());
}

TEST(F2Report, CosineThresholdSameArgmax) {
  for (double target : {0.9502, 0.9501, 0.9499, 0.9498}) {
    const auto g = row_with_cosine(kCpuSame, kCpuSame, 2, target);
    ASSERT_EQ(std::max_element(g.begin(), g.end()) - g.begin(), 0) << "the argmax must not move";
    const double c = ref_cosine(kCpuSame, g);
    ASSERT_NEAR(c, target, 2e-5);
    const Report rep = two_positions(kCpuSame, g);
    EXPECT_EQ(rep.accepted, c >= 0.95) << "cosine " << c;
    EXPECT_NEAR(*rep.min_cosine, c, 1e-9);
    if (!rep.accepted) {
      EXPECT_EQ(*rep.first_bad_pos, 1);
      EXPECT_EQ(rep.bad_cpu_argmax, 0);
      EXPECT_EQ(rep.bad_gpu_argmax, 0);
    }
  }
}

TEST(F2Report, ArgmaxFlipThreshold) {
  // The GPU prefers id 1 where the CPU prefers id 0; accepted only at cosine >= 0.98.
  const std::vector<float> flipped = {0.999f, 1.f, 0.f, 0.f};
  for (double target : {0.9802, 0.9801, 0.9799, 0.9798, 0.96}) {
    const auto g = row_with_cosine(kCpuClose, flipped, 2, target);
    ASSERT_EQ(std::max_element(g.begin(), g.end()) - g.begin(), 1);
    const double c = ref_cosine(kCpuClose, g);
    ASSERT_NEAR(c, target, 2e-5);
    const Report rep = two_positions(kCpuClose, g);
    EXPECT_EQ(rep.accepted, c >= 0.98) << "cosine " << c;
    if (!rep.accepted) {
      EXPECT_EQ(rep.bad_cpu_argmax, 0);
      EXPECT_EQ(rep.bad_gpu_argmax, 1);
      EXPECT_NEAR(rep.bad_cosine, c, 1e-9);
    }
  }
}

TEST(F2Report, Position0IsNotJudged) {
  Rows r{4, {}, {}};
  r.add({5.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 5.f});  // cosine 0 and an argmax flip at position 0
  r.add(kCpuSame, kCpuSame);
  const Report rep = f2_report(r.cpu, r.gpu, r.nv);
  EXPECT_TRUE(rep.accepted);
  EXPECT_TRUE(rep.pos0_argmax_flip);
  EXPECT_EQ(rep.judged, 1);
  EXPECT_NEAR(*rep.min_cosine, 1.0, 1e-12);
}

TEST(F2Report, NonFiniteGpuLogitRejectsAtOnce) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int64_t pos : {0, 2}) {
      Rows r{4, {}, {}};
      for (int p = 0; p < 4; ++p) {
        auto g = kCpuSame;
        if (p == pos) g[3] = bad;
        r.add(kCpuSame, g);
      }
      const Report rep = f2_report(r.cpu, r.gpu, r.nv);
      EXPECT_FALSE(rep.accepted);
      ASSERT_TRUE(rep.first_bad_pos.has_value());
      EXPECT_EQ(*rep.first_bad_pos, pos);
      ASSERT_TRUE(rep.non_finite_side.has_value());
      EXPECT_EQ(*rep.non_finite_side, "GPU");
      EXPECT_EQ(rep.non_finite_id, 3);
      EXPECT_NE(moe::guard::reject_reason(rep).find("non-finite"), std::string::npos);
    }
  }
}

TEST(F2Report, NonFiniteCpuLogitIsNamed) {
  Rows r{4, {}, {}};
  r.add(kCpuSame, kCpuSame);
  auto c = kCpuSame;
  c[1] = std::numeric_limits<float>::quiet_NaN();
  r.add(c, kCpuSame);
  const Report rep = f2_report(r.cpu, r.gpu, r.nv);
  EXPECT_FALSE(rep.accepted);
  EXPECT_EQ(*rep.non_finite_side, "CPU");
  EXPECT_NE(moe::guard::reject_reason(rep).find("CPU reference"), std::string::npos);
}

TEST(F2Report, ShortProbes) {
  // Nothing to judge: accepted, no cosine.
  for (int rows : {0, 1}) {
    Rows r{4, {}, {}};
    for (int p = 0; p < rows; ++p) r.add(kCpuSame, {0.f, 0.f, 9.f, 0.f});
    const Report rep = f2_report(r.cpu, r.gpu, r.nv);
    EXPECT_TRUE(rep.accepted);
    EXPECT_EQ(rep.positions, rows);
    EXPECT_EQ(rep.judged, 0);
    EXPECT_FALSE(rep.min_cosine.has_value());
  }
  // Sides of different lengths: only the common rows are compared.
  Rows r{4, {}, {}};
  r.add(kCpuSame, kCpuSame);
  r.add(kCpuSame, kCpuSame);
  r.cpu.insert(r.cpu.end(), {0.f, 0.f, 0.f, 1.f});
  EXPECT_EQ(f2_report(r.cpu, r.gpu, r.nv).positions, 2);
  EXPECT_TRUE(f2_report(r.cpu, r.gpu, r.nv).accepted);
}

TEST(F2Report, FirstBadPositionAndMinCosineOverAll) {
  Rows r{4, {}, {}};
  r.add(kCpuSame, kCpuSame);
  const auto g2 = row_with_cosine(kCpuSame, kCpuSame, 2, 0.90);
  const auto g3 = row_with_cosine(kCpuSame, kCpuSame, 2, 0.80);
  r.add(kCpuSame, kCpuSame);
  r.add(kCpuSame, g2);
  r.add(kCpuSame, g3);
  const Report rep = f2_report(r.cpu, r.gpu, r.nv);
  EXPECT_FALSE(rep.accepted);
  EXPECT_EQ(*rep.first_bad_pos, 2);
  EXPECT_NEAR(rep.bad_cosine, ref_cosine(kCpuSame, g2), 1e-9);
  EXPECT_NEAR(*rep.min_cosine, ref_cosine(kCpuSame, g3), 1e-9);
}

TEST(F2Report, ZeroVectorHasCosineZero) {
  const Report rep = two_positions(kCpuSame, {0.f, 0.f, 0.f, 0.f});
  EXPECT_FALSE(rep.accepted);
  EXPECT_EQ(rep.bad_cosine, 0.0);
}

TEST(F2Report, MessagesFollowTheContract) {
  Report rep;
  rep.accepted = false;
  rep.positions = 9;
  rep.first_bad_pos = 4;
  rep.bad_gpu_argmax = 17;
  rep.bad_cpu_argmax = 3;
  rep.bad_cosine = 0.91234;
  rep.min_cosine = 0.81234;
  EXPECT_EQ(moe::guard::reject_reason(rep),
            "GPU output diverges from CPU at position 4 (argmax 17 != 3, cosine 0.9123); min cosine 0.8123");
  Report ok;
  ok.positions = 65;
  ok.min_cosine = 0.999912;
  EXPECT_EQ(moe::guard::accept_line(ok, 812.4),
            "F2 guard: GPU matches the CPU forward on 65 positions (min cosine 0.9999) in 812 ms");
  EXPECT_EQ(moe::guard::skipped_line(), "F2 guard: SKIP_PARITY_GATE=1 \u2014 nothing was compared on this run");
  EXPECT_EQ(moe::guard::nothing_judged_line(1),
            "F2 guard: a 1-token prompt has no real position to compare; nothing was judged");
}

// A scripted forward: row for (token, position) is f(token, position); records every eval.
class Scripted : public moe::Forward {
 public:
  using Fn = std::function<float(int32_t token, int64_t pos, int64_t id)>;
  Scripted(int64_t nv, Fn f) : nv_(nv), f_(std::move(f)) {}
  void eval(std::span<const int32_t> tokens, bool all, std::vector<float>& logits) override {
    if (throw_) throw moe::Error(moe::Exit::other, "kernel exploded");
    calls.emplace_back(tokens.begin(), tokens.end());
    logits.clear();
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int64_t pos = past_ + static_cast<int64_t>(i);
      if (!all && i + 1 < tokens.size()) continue;
      for (int64_t v = 0; v < nv_; ++v) logits.push_back(f_(tokens[i], pos, v));
    }
    past_ += static_cast<int64_t>(tokens.size());
  }
  int64_t n_past() const override { return past_; }
  int64_t n_ctx() const override { return 1 << 20; }
  int64_t n_vocab() const override { return nv_; }
  void reset() override { past_ = 0; ++resets; }
  std::string name() const override { return "scripted"; }

  std::vector<std::vector<int32_t>> calls;
  int resets = 0;
  bool throw_ = false;

 private:
  int64_t nv_;
  Fn f_;
  int64_t past_ = 0;
};

TEST(RunProbe, ProbeIsTheLast64TokensPlusOneGreedyStep) {
  // Row argmax = (token + pos) % nv, with a smooth background.
  auto f = [](int32_t t, int64_t pos, int64_t id) {
    return (id == (t + pos) % 11 ? 5.f : 0.f) + 0.01f * static_cast<float>(id);
  };
  Scripted cpu(11, f), gpu(11, f);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 100; ++i) prompt.push_back(i % 11);
  const Report rep = moe::guard::run_probe(cpu, gpu, prompt);
  ASSERT_EQ(cpu.calls.size(), 2u);
  ASSERT_EQ(gpu.calls.size(), 2u);
  const std::vector<int32_t> tail(prompt.end() - moe::guard::kProbeMax, prompt.end());
  EXPECT_EQ(cpu.calls[0], tail);
  EXPECT_EQ(gpu.calls[0], tail);
  // The decode step feeds the CPU's argmax at the last probe position (position 63 of the probe).
  const int32_t expect_next = static_cast<int32_t>((tail.back() + 63) % 11);
  EXPECT_EQ(cpu.calls[1], std::vector<int32_t>{expect_next});
  EXPECT_EQ(gpu.calls[1], std::vector<int32_t>{expect_next});
  EXPECT_TRUE(rep.accepted);
  EXPECT_EQ(rep.positions, moe::guard::kProbeMax + 1);
  EXPECT_GE(gpu.resets, 2);  // fresh state before, throwaway state after
}

TEST(RunProbe, ShortPromptAndGpuDivergence) {
  Scripted cpu(7, [](int32_t t, int64_t pos, int64_t id) { return id == t ? 3.f : 0.f; });
  // The GPU agrees at every prompt position but is wrong on the decode step.
  Scripted gpu(7, [](int32_t t, int64_t pos, int64_t id) { return pos >= 3 ? (id == 6 - t ? 3.f : 0.f) : (id == t ? 3.f : 0.f); });
  const std::vector<int32_t> prompt = {1, 2, 5};
  const Report rep = moe::guard::run_probe(cpu, gpu, prompt);
  EXPECT_EQ(rep.positions, 4);
  EXPECT_FALSE(rep.accepted);
  EXPECT_EQ(*rep.first_bad_pos, 3);
}

TEST(RunProbe, GpuFailureBecomesGpuFailedError) {
  auto f = [](int32_t t, int64_t pos, int64_t id) { return static_cast<float>(id == t); };
  Scripted cpu(5, f), gpu(5, f);
  gpu.throw_ = true;
  const std::vector<int32_t> prompt = {1, 2, 3};
  try {
    moe::guard::run_probe(cpu, gpu, prompt);
    FAIL() << "no error";
  } catch (const moe::Error& e) {
    EXPECT_EQ(e.code(), moe::Exit::gpu_failed);
    EXPECT_NE(std::string(e.what()).find("kernel exploded"), std::string::npos);
  }
}

}  // namespace
