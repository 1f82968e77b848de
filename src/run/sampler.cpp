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

namespace {

// A raw logit below raw_bound(K, t) has l / t < K once rounded: the bound is (K - |K| 2^-20 - 1e-30) t rounded
// down, so that l / t lies below K by far more than the division's rounding (half an ulp, 2^-24 |K|). Lets
// the pass skip most logits with one comparison, before their division.
float raw_bound(float k_logit, float t) {
  const double k = k_logit;
  const double b = (k - std::fabs(k) * 0x1p-20 - 1e-30) * static_cast<double>(t);  // NaN when K is +inf: no skip
  float f = static_cast<float>(b);
  if (static_cast<double>(f) > b) f = std::nextafter(f, -INFINITY);
  return f;
}

// The k candidates first in `before` order (a strict total order: ids are unique) among the tempered,
// non-NaN logits, in that order, in one pass: a buffer of up to 2k candidates is cut back to its k first
// (nth_element) whenever it fills, and from then on a logit enters only if it comes before the k-th of
// those (at least k others come before any that does not, so it cannot be among the k first). The same
// set and order as sorting all of them, without building and heap-sorting a vocabulary-sized array: at
// 151,936 logits and k = 40 that took 314-368 us a token on the host, now 69 (tools/bench/bench_sampler.cpp,
// docs/PERFORMANCE.md version 28).
template <typename Before>
std::vector<Candidate> first_k(std::span<const float> logits, float t, size_t k, Before before) {
  std::vector<Candidate> c;
  c.reserve(std::min(2 * k, logits.size()));
  Candidate kth{};
  bool full = false;
  float bound = -INFINITY;  // nothing skipped before the buffer first fills
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (l < bound || std::isnan(l)) continue;
    const Candidate x{static_cast<int32_t>(i), l / t};
    if (full && !before(x, kth)) continue;
    c.push_back(x);
    if (c.size() == 2 * k) {
      std::nth_element(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k - 1), c.end(), before);
      c.resize(k);
      kth = c.back();
      full = true;
      bound = raw_bound(kth.logit, t);
    }
  }
  std::sort(c.begin(), c.end(), before);
  if (c.size() > k) c.resize(k);
  return c;
}

}  // namespace

std::vector<Candidate> candidate_set(std::span<const float> logits, const SamplerParams& p) {
  const float t = p.temperature > 0 ? p.temperature : 1.0f;
  auto before = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  auto tempered_max = [&] {  // the largest l / t of the numbers (-inf without any)
    double top = -INFINITY;
    for (float l : logits)
      if (!std::isnan(l)) top = std::max(top, static_cast<double>(l / t));
    return top;
  };
  std::vector<Candidate> c;
  bool nucleus_done = false;
  if (p.top_k > 0) {
    c = first_k(logits, t, static_cast<size_t>(p.top_k), before);
  } else if (p.top_p < 1.0f) {
    // No top-k: the nucleus is the shortest run of the ranking whose probability reaches top_p, probabilities
    // normalised over every number (summed in index order). Found from growing first_k prefixes instead of
    // sorting the vocabulary (14 ms a token at 151,936 logits: 45 tok/s on the GPU, docs/PERFORMANCE.md
    // version 28).
    const double top = tempered_max();
    double sum = 0;
    for (float l : logits)
      if (!std::isnan(l)) sum += std::exp(static_cast<double>(l / t) - top);
    for (size_t k = 64;; k *= 4) {
      c = first_k(logits, t, k, before);
      double cum = 0;
      size_t keep = 0;
      for (size_t i = 0; i < c.size() && !keep; ++i) {
        cum += std::exp(static_cast<double>(c[i].logit) - top) / sum;
        if (cum >= p.top_p) keep = i + 1;  // the token that crosses p is kept
      }
      if (keep || c.size() < k) {  // crossed, or every number is in c
        c.resize(std::max<size_t>(keep ? keep : c.size(), std::min<size_t>(1, c.size())));
        break;
      }
    }
    nucleus_done = true;
  } else if (p.min_p > 0.0f) {
    // no top-k or top-p: the min-p floor alone, by one pass and a sort of those above it
    const double floor = tempered_max() + std::log(static_cast<double>(p.min_p));
    for (size_t i = 0; i < logits.size(); ++i)
      if (!std::isnan(logits[i]) && static_cast<double>(logits[i] / t) >= floor)
        c.push_back({static_cast<int32_t>(i), logits[i] / t});
    std::sort(c.begin(), c.end(), before);
  } else {
    c.reserve(logits.size());
    for (size_t i = 0; i < logits.size(); ++i)
      if (!std::isnan(logits[i])) c.push_back({static_cast<int32_t>(i), logits[i] / t});
    std::sort(c.begin(), c.end(), before);
  }
  if (c.empty()) return c;
  const double top = c.front().logit;
  if (p.top_p < 1.0f && !nucleus_done) {
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

int32_t sample_with(std::span<float> logits, std::span<const int32_t> history, const SamplerParams& p,
                    const std::function<double()>& uniform) {
  apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n);
  if (is_greedy(p)) return argmax(logits);
  const auto c = candidate_set(logits, p);
  if (c.empty()) return argmax(logits);
  const double top = c.front().logit;
  double sum = 0;
  for (const auto& x : c) sum += std::exp(static_cast<double>(x.logit) - top);
  if (!(sum > 0) || !std::isfinite(sum)) return c.front().id;
  // One draw per sampled token, even with a single candidate, so the RNG stream stays aligned.
  const double u = uniform() * sum;
  double cum = 0;
  for (const auto& x : c) {
    cum += std::exp(static_cast<double>(x.logit) - top);
    if (cum >= u) return x.id;
  }
  return c.back().id;
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  return sample_with(logits, history, p_, [this] { return uniform(); });
}

}  // namespace moe::run
