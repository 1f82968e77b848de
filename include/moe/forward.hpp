// The one interface where the two backends really differ: a forward pass over one sequence
// with its own KV cache.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "moe/error.hpp"
#include "moe/sampler.hpp"

namespace moe {

class Forward {
 public:
  virtual ~Forward() = default;
  // Evaluates `tokens` at positions n_past() ... n_past()+size-1 (appending them to the KV cache).
  // Writes logits: all_logits ? size rows of n_vocab() : one row (the last token's).
  // Throws moe::Error on failure (the CUDA forward: a reason naming the step).
  virtual void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) = 0;
  // Evaluates one token and returns the argmax of its logits (lowest id on ties) without handing
  // the logits back; backends override it to keep the logits on the device. A non-finite logit
  // throws moe::Error (backends: their own failure exit; here Exit::inference) naming the position.
  virtual int32_t eval_greedy(int32_t token) {
    std::vector<float>& l = scratch_;
    eval(std::span<const int32_t>(&token, 1), false, l);
    int32_t best = 0;
    for (size_t i = 0; i < l.size(); ++i) {
      if (!std::isfinite(l[i]))
        fail(Exit::inference, "non-finite logits at position {} (token id {})", n_past() - 1, i);
      if (l[i] > l[best]) best = static_cast<int32_t>(i);
    }
    return best;
  }
  // Sampled decoding without the logits coming back: whether this forward draws the tokens of `p`
  // itself (the CUDA forward: top-k 1..128 or greedy with a repeat penalty; src/cuda), and one step of
  // it: evaluates history.back() at position n_past() and returns the token run::Sampler::sample would
  // draw from its logits, the repeat penalty's window taken from `history` (every token so far); `uniform`
  // gives the draw's uniform, called once per sampled step in step order (as the Sampler's own draws; never
  // when p is greedy). A non-finite logit throws moe::Error as eval_greedy does.
  virtual bool samples_on_device(const run::SamplerParams& p) const {
    (void)p;
    return false;
  }
  // Readies eval_sample for `p` ahead of the first step (the CUDA forward captures its graph), so that the first
  // sampled step does not pay for it; optional.
  virtual void prepare_sample(const run::SamplerParams& p) { (void)p; }
  virtual int32_t eval_sample(std::span<const int32_t> history, const run::SamplerParams& p,
                              const std::function<double()>& uniform) {
    (void)history, (void)p, (void)uniform;
    fail(Exit::other, "{} forward: no sampler on the device", name());
  }
  virtual int64_t n_past() const = 0;
  virtual int64_t n_ctx() const = 0;
  virtual int64_t n_vocab() const = 0;
  virtual void reset() = 0;  // empty the KV cache
  virtual std::string name() const = 0;  // "cpu" or "cuda"

 private:
  std::vector<float> scratch_;
};

}  // namespace moe
