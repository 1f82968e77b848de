// Token sampler in the order of CLI.md: repeat penalty -> (greedy if T = 0 or K = 1) -> temperature
// -> top-k -> top-p -> min-p -> draw. The draw uses std::mt19937 seeded with --seed (a 32-bit value,
// as llama.cpp seeds its sampler) and std::uniform_real_distribution<double>: the same seed and flags
// give the same tokens on the same backend. Greedy never touches the RNG.
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

namespace moe::run {

inline constexpr uint32_t kDefaultSeed = 299792458;
inline constexpr int32_t kDefaultTopK = 40;  // used when T > 0 and --top-k was not given

struct SamplerParams {
  float temperature = 0.0f;   // 0 = greedy
  int32_t top_k = kDefaultTopK;  // 0 = off, 1 = greedy
  float top_p = 1.0f;         // 1 = off
  float min_p = 0.0f;         // 0 = off
  float repeat_penalty = 1.0f;  // 1 = off
  int32_t repeat_last_n = 64;   // 0 = off
  uint32_t seed = kDefaultSeed;
};

// Greedy: the argmax of the (penalised) logits, no draw (T = 0 or K = 1).
inline bool is_greedy(const SamplerParams& p) { return p.temperature == 0.0f || p.top_k == 1; }

// Divides positive / multiplies other logits of every distinct token among the last `last_n`
// entries of `history` (each token penalised once, however often it appears, as llama.cpp does).
void apply_repeat_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty,
                          int32_t last_n);

// Largest logit, lowest id on ties (NaN never wins).
int32_t argmax(std::span<const float> logits);

struct Candidate {
  int32_t id;
  float logit;  // after temperature
};
// The tokens a non-greedy draw may return (after temperature, top-k, top-p, min-p), sorted by
// descending logit (lower id first on ties). `logits` are already penalised.
std::vector<Candidate> candidate_set(std::span<const float> logits, const SamplerParams& p);

// Sampler::sample with the draw's uniform from `uniform` (called once per non-greedy token): the repeat
// penalty applied to `logits` in place, then greedy or the candidate set and the draw.
int32_t sample_with(std::span<float> logits, std::span<const int32_t> history, const SamplerParams& p,
                    const std::function<double()>& uniform);

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p) : p_(p), rng_(p.seed) {}
  bool greedy() const { return is_greedy(p_); }
  const SamplerParams& params() const { return p_; }
  // Applies the repeat penalty to `logits` in place, then picks a token. `history` is the whole
  // sequence so far, prompt included.
  int32_t sample(std::span<float> logits, std::span<const int32_t> history);
  // The next draw's uniform in [0, 1), as sample() takes it (one per sampled token): a sampler on the
  // device (Forward::eval_sample) draws with these, so the same seed gives the same stream.
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

 private:
  SamplerParams p_;
  std::mt19937 rng_;
};

}  // namespace moe::run
