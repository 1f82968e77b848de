// Sampler properties: greedy = argmax, seed reproducibility, support sets of top-k/top-p/min-p,
// the order of temperature and min-p, draw frequencies, repeat-penalty semantics of CLI.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "moe/sampler.hpp"

namespace {

using moe::run::Sampler;
using moe::run::SamplerParams;

std::vector<float> random_logits(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Draws `n` tokens from fresh copies of `logits` (the sampler modifies them in place).
std::map<int32_t, int> draw(Sampler& s, const std::vector<float>& logits, int n) {
  std::map<int32_t, int> counts;
  for (int i = 0; i < n; ++i) {
    auto l = logits;
    ++counts[s.sample(l, {})];
  }
  return counts;
}

std::set<int32_t> keys(const std::map<int32_t, int>& m) {
  std::set<int32_t> k;
  for (const auto& [id, n] : m) k.insert(id);
  return k;
}

TEST(Sampler, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> l = {0.5f, 2.f, -1.f, 2.f, 1.9f};
  SamplerParams p;  // T = 0
  Sampler s(p);
  auto a = l;
  EXPECT_EQ(s.sample(a, {}), 1);
  for (uint32_t seed = 0; seed < 20; ++seed) {
    auto r = random_logits(1000, seed);
    const auto best = std::max_element(r.begin(), r.end()) - r.begin();
    SamplerParams q;
    q.temperature = 0.7f;
    q.top_k = 1;  // K = 1 is greedy whatever the temperature
    Sampler k1(q);
    for (int rep = 0; rep < 3; ++rep) {
      auto c = r;
      EXPECT_EQ(k1.sample(c, {}), best);
    }
  }
}

TEST(Sampler, SameSeedSameTokensOtherSeedOtherTokens) {
  const auto l = random_logits(64, 7);
  SamplerParams p;
  p.temperature = 1.5f;
  p.top_k = 0;
  auto run = [&](uint32_t seed) {
    SamplerParams q = p;
    q.seed = seed;
    Sampler s(q);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) {
      auto c = l;
      out.push_back(s.sample(c, {}));
    }
    return out;
  };
  EXPECT_EQ(run(299792458), run(299792458));
  EXPECT_NE(run(299792458), run(1));
}

TEST(Sampler, TopKSupport) {
  const auto l = random_logits(200, 3);
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
  SamplerParams p;
  p.temperature = 50.f;  // nearly flat: every allowed token shows up
  p.top_k = 5;
  Sampler s(p);
  const auto got = keys(draw(s, l, 3000));
  EXPECT_EQ(got, std::set<int32_t>(order.begin(), order.begin() + 5));
}

// Probabilities 0.5, 0.3, 0.15, 0.05 at T = 1.
const std::vector<float> kQuad = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};

TEST(Sampler, TopPKeepsTheTokenThatCrossesP) {
  SamplerParams p;
  p.temperature = 1.f;
  p.top_k = 0;
  p.top_p = 0.75f;  // 0.5 < 0.75 <= 0.8: ids 0 and 1
  Sampler s(p);
  EXPECT_EQ(keys(draw(s, kQuad, 4000)), (std::set<int32_t>{0, 1}));
  p.top_p = 0.9f;  // 0.8 < 0.9 <= 0.95: ids 0, 1, 2
  Sampler s2(p);
  EXPECT_EQ(keys(draw(s2, kQuad, 4000)), (std::set<int32_t>{0, 1, 2}));
}

TEST(Sampler, MinPAfterTemperature) {
  SamplerParams p;
  p.temperature = 1.f;
  p.top_k = 0;
  p.min_p = 0.2f;  // keep p >= 0.1: ids 0, 1, 2
  Sampler s(p);
  EXPECT_EQ(keys(draw(s, kQuad, 4000)), (std::set<int32_t>{0, 1, 2}));
  // Temperature comes before min-p (CLI.md): at T = 2 the relative probabilities are the square
  // roots (1, 0.77, 0.55, 0.32), all above 0.2.
  p.temperature = 2.f;
  Sampler s2(p);
  EXPECT_EQ(keys(draw(s2, kQuad, 4000)), (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(Sampler, DrawFrequenciesFollowSoftmax) {
  SamplerParams p;
  p.temperature = 1.f;
  p.top_k = 0;
  Sampler s(p);
  const int n = 40000;
  const auto c = draw(s, kQuad, n);
  const double expect[4] = {0.5, 0.3, 0.15, 0.05};
  for (int id = 0; id < 4; ++id) {
    const double f = c.count(id) ? static_cast<double>(c.at(id)) / n : 0.0;
    const double sd = std::sqrt(expect[id] * (1 - expect[id]) / n);
    EXPECT_NEAR(f, expect[id], 5 * sd) << "id " << id;
  }
}

TEST(Sampler, CandidateSetIsSortedAndTempered) {
  SamplerParams p;
  p.temperature = 2.f;
  p.top_k = 3;
  const std::vector<float> l = {1.f, 4.f, 4.f, -2.f, 3.f};
  const auto c = moe::run::candidate_set(l, p);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].id, 1);  // tie between 1 and 2: lower id first
  EXPECT_EQ(c[1].id, 2);
  EXPECT_EQ(c[2].id, 4);
  EXPECT_FLOAT_EQ(c[2].logit, 1.5f);
}

// The top-k candidates (selected in one pass with a moving threshold) against sorting every tempered logit:
// the same ids and floats in the same order, for vocabulary sizes around the buffer's 2k, logits on a coarse
// grid (many ties, which go to the lower id), NaNs, inputs in ascending order (every logit enters the
// buffer before the threshold rises) or descending order, and logits a few ulps apart around 1, -1 and 0
// (the one-comparison skip before the division must never drop one that the division makes equal to the
// k-th).
TEST(Sampler, TopKCandidatesAreTheFirstOfTheFullSort) {
  std::mt19937 g(7);
  for (size_t n : {1u, 7u, 79u, 80u, 81u, 1000u, 151936u})
    for (int k : {1, 2, 40, 41, 200})
      for (int shape = 0; shape < 7; ++shape) {  // 0 random, 1 coarse grid, 2 ascending, 3 descending, 4-6 ulps
        SCOPED_TRACE(::testing::Message() << "n " << n << " k " << k << " shape " << shape);
        std::vector<float> l = random_logits(n, static_cast<uint32_t>(n * 131 + k * 7 + shape));
        if (shape == 1)
          for (float& x : l) x = std::round(x);
        if (shape >= 4) {  // each logit 0-63 ulps from 1, -1 or the smallest normal
          const float base = shape == 4 ? 1.f : shape == 5 ? -1.f : 1.17549435e-38f;
          for (float& x : l) {
            x = base;
            for (uint32_t u = g() % 64; u > 0; --u) x = std::nextafter(x, INFINITY);
          }
        }
        if (shape == 2 || shape == 3) std::sort(l.begin(), l.end());
        if (shape == 3) std::reverse(l.begin(), l.end());
        if (n > 10)
          for (int j = 0; j < 5; ++j) l[g() % n] = std::nanf("");
        SamplerParams p;
        p.temperature = 0.7f;
        p.top_k = k;
        const auto c = moe::run::candidate_set(l, p);
        std::vector<std::pair<float, int32_t>> all;  // (tempered logit, id) of every number
        for (size_t i = 0; i < n; ++i)
          if (!std::isnan(l[i])) all.emplace_back(l[i] / p.temperature, static_cast<int32_t>(i));
        std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        ASSERT_EQ(c.size(), std::min(all.size(), static_cast<size_t>(k)));
        for (size_t i = 0; i < c.size(); ++i) {
          EXPECT_EQ(c[i].id, all[i].second) << i;
          EXPECT_EQ(c[i].logit, all[i].first) << i;
        }
      }
}

// Without top-k, top-p and min-p against sorting every tempered logit: the nucleus is the shortest prefix of
// the ranking whose probability (normalised over every number, summed in index order) reaches top_p, the
// crossing token kept; the min-p floor alone keeps every logit at or above max + ln(min_p). Peaked, flat (a
// 90 % nucleus of 151,936 equal logits) and coarse-grid inputs, NaNs among them.
TEST(Sampler, TopPAndMinPWithoutTopKMatchTheFullSort) {
  std::mt19937 g(11);
  for (size_t n : {3u, 1000u, 151936u})
    for (int shape = 0; shape < 3; ++shape)  // 0 peaked (sd 3), 1 flat, 2 coarse grid
      for (float top_p : {0.5f, 0.9f, 0.99f, 1.f})
        for (float min_p : {0.f, 0.05f}) {
          if (top_p == 1.f && min_p == 0.f) continue;
          SCOPED_TRACE(::testing::Message() << "n " << n << " shape " << shape << " top_p " << top_p
                                            << " min_p " << min_p);
          std::vector<float> l = random_logits(n, static_cast<uint32_t>(n + shape));
          for (float& x : l) x = shape == 1 ? 0.25f : shape == 2 ? std::round(x) : x;
          if (n > 10)
            for (int j = 0; j < 3; ++j) l[g() % n] = std::nanf("");
          SamplerParams p;
          p.temperature = 0.8f;
          p.top_k = 0;
          p.top_p = top_p;
          p.min_p = min_p;
          const auto c = moe::run::candidate_set(l, p);
          std::vector<std::pair<float, int32_t>> all;
          for (size_t i = 0; i < n; ++i)
            if (!std::isnan(l[i])) all.emplace_back(l[i] / p.temperature, static_cast<int32_t>(i));
          double top = -INFINITY, sum = 0;
          for (const auto& [v, id] : all) top = std::max(top, static_cast<double>(v));
          for (const auto& [v, id] : all) sum += std::exp(v - top);
          std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
          size_t keep = all.size();
          double cum = 0;
          for (size_t i = 0; i < all.size() && top_p < 1.f; ++i)
            if ((cum += std::exp(all[i].first - top) / sum) >= top_p) {
              keep = i + 1;
              break;
            }
          if (min_p > 0.f)
            for (size_t i = 1; i < keep; ++i)
              if (all[i].first < top + std::log(static_cast<double>(min_p))) keep = i;
          ASSERT_EQ(c.size(), keep);
          for (size_t i = 0; i < keep; ++i) ASSERT_EQ(c[i].id, all[i].second) << i;
        }
}

TEST(RepeatPenalty, DividesPositiveMultipliesNegativeOncePerToken) {
  std::vector<float> l = {2.f, -2.f, 3.f, 0.f, 4.f};
  const std::vector<int32_t> hist = {0, 1, 0, 0, 3};
  moe::run::apply_repeat_penalty(l, hist, 2.f, 64);
  EXPECT_FLOAT_EQ(l[0], 1.f);   // seen three times, penalised once
  EXPECT_FLOAT_EQ(l[1], -4.f);
  EXPECT_FLOAT_EQ(l[2], 3.f);   // not seen
  EXPECT_FLOAT_EQ(l[3], 0.f);   // 0 * 2
  EXPECT_FLOAT_EQ(l[4], 4.f);
}

TEST(RepeatPenalty, OnlyTheLastNTokensCount) {
  std::vector<float> l = {2.f, 2.f, 2.f};
  const std::vector<int32_t> hist = {0, 1, 2};
  moe::run::apply_repeat_penalty(l, hist, 2.f, 2);
  EXPECT_FLOAT_EQ(l[0], 2.f);
  EXPECT_FLOAT_EQ(l[1], 1.f);
  EXPECT_FLOAT_EQ(l[2], 1.f);
  std::vector<float> m = {2.f, 2.f};
  moe::run::apply_repeat_penalty(m, hist, 2.f, 0);  // window 0: off
  moe::run::apply_repeat_penalty(m, hist, 1.f, 64);  // penalty 1: off
  EXPECT_FLOAT_EQ(m[0], 2.f);
  EXPECT_FLOAT_EQ(m[1], 2.f);
}

TEST(RepeatPenalty, AppliesBeforeGreedy) {
  SamplerParams p;
  p.repeat_penalty = 1.5f;
  Sampler s(p);
  std::vector<float> l = {2.f, 1.9f};
  const std::vector<int32_t> hist = {0};
  EXPECT_EQ(s.sample(l, hist), 1);  // 2 / 1.5 < 1.9
}

}  // namespace
