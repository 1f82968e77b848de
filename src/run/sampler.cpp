#include "moe/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace moe::run {

void apply_repeat_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty,
                          int32_t last_n) {
  if (penalty == 1.0f || last_n <= 0 || history.empty()) return;
  const size_t n = std::min(history.size(), static_cast<size_t>(last_n));
  std::unordered_set<int32_t> seen;
  for (int32_t id : history.subspan(history.size() - n)) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size() || !seen.insert(id).second) continue;
    float& l = logits[static_cast<size_t>(id)];
    l = l > 0 ? l / penalty : l * penalty;
  }
}

int32_t argmax(std::span<const float> logits) {
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

std::vector<Candidate> candidate_set(std::span<const float> logits, const SamplerParams& p) {
  std::vector<Candidate> c;
  c.reserve(logits.size());
  const float t = p.temperature > 0 ? p.temperature : 1.0f;
  for (size_t i = 0; i < logits.size(); ++i)
    if (!std::isnan(logits[i])) c.push_back({static_cast<int32_t>(i), logits[i] / t});
  if (c.empty()) return c;
  auto before = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < c.size()) {
    std::partial_sort(c.begin(), c.begin() + p.top_k, c.end(), before);
    c.resize(static_cast<size_t>(p.top_k));
  } else {
    std::sort(c.begin(), c.end(), before);
  }
  const double top = c.front().logit;
  if (p.top_p < 1.0f) {
    double sum = 0;
    for (const auto& x : c) sum += std::exp(static_cast<double>(x.logit) - top);
    double cum = 0;
    size_t keep = c.size();
    for (size_t i = 0; i < c.size(); ++i) {
      cum += std::exp(static_cast<double>(c[i].logit) - top) / sum;
      // The token that crosses p is kept; at least one token always is.
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
    c.resize(std::max<size_t>(keep, 1));
  }
  if (p.min_p > 0.0f) {
    // prob_i >= min_p * prob_max  <=>  logit_i >= max_logit + ln(min_p)
    const double floor = top + std::log(static_cast<double>(p.min_p));
    size_t keep = 1;
    while (keep < c.size() && static_cast<double>(c[keep].logit) >= floor) ++keep;
    c.resize(keep);
  }
  return c;
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  apply_repeat_penalty(logits, history, p_.repeat_penalty, p_.repeat_last_n);
  if (greedy()) return argmax(logits);
  const auto c = candidate_set(logits, p_);
  if (c.empty()) return argmax(logits);
  const double top = c.front().logit;
  double sum = 0;
  for (const auto& x : c) sum += std::exp(static_cast<double>(x.logit) - top);
  if (!(sum > 0) || !std::isfinite(sum)) return c.front().id;
  // One draw per sampled token, even with a single candidate, so the RNG stream stays aligned.
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_) * sum;
  double cum = 0;
  for (const auto& x : c) {
    cum += std::exp(static_cast<double>(x.logit) - top);
    if (cum >= u) return x.id;
  }
  return c.back().id;
}

}  // namespace moe::run
