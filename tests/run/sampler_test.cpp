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
