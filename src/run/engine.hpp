// The backend dispatcher: picks the forward that serves the run (CUDA first, proven by the F2
// guard; otherwise the CPU), and keeps serving it through GPU failures by falling back to the CPU
// with the same tokens (internal to src/run).
#pragma once
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moe/finite.hpp"
#include "moe/forward.hpp"
#include "moe/guard.hpp"
#include "moe/model.hpp"
#include "moe/quant.hpp"
#include "moe/run.hpp"
#include "moe/sampler.hpp"

namespace moe::run {

struct BackendReport {
  std::string requested = "auto";  // auto | gpu | cpu
  std::string ran = "cpu";         // cuda | cpu
  bool fell_back = false;
  std::optional<std::string> reason;
  std::optional<std::string> device;
  uint64_t vram_mib = 0;
  double build_ms = 0;  // building the serving forward (GPU: init + upload)
  // The guard (guard_ran false: no guard ran, the JSON value is null).
  bool guard_ran = false;
  bool guard_skipped = false;
  int64_t guard_positions = 0;
  std::optional<double> guard_min_cosine;
  bool guard_accepted = true;
  std::optional<int64_t> guard_first_bad;
  double guard_ms = 0;      // what the guard added before the first token (its critical path)
  double guard_ref_ms = 0;  // the CPU reference's own time (overlapped with the GPU upload)
};

class Engine {
 public:
  Engine(const RunConfig& cfg, const Backends& b, std::shared_ptr<const model::OwnedQuantizedModel> m,
         quant::ThreadPool& pool, int n_threads, int64_t n_ctx, std::ostream& err);

  // Builds the serving forward (GPU attempt, F2 guard over `prompt`, or the CPU). Throws
  // Exit::gpu_failed with --gpu when the GPU cannot serve, Exit::no_cuda on a CPU-only build.
  void start(std::span<const int32_t> prompt);

  // Evaluates `tokens` (the tail of `history`, which holds every token so far including them).
  // A GPU failure (an exception or non-finite logits) falls back to the CPU, which re-evaluates the
  // whole history; the rows handed back are those of `tokens` either way. Non-finite CPU logits
  // throw Exit::inference naming the position.
  void eval(std::span<const int32_t> tokens, std::span<const int32_t> history, bool all_logits,
            std::vector<float>& logits);

  // Greedy decoding of one token (the tail of `history`) on the GPU without copying the logits back:
  // returns the argmax (lowest id on ties). A GPU failure (an exception, or a non-finite logit that the
  // device's argmax flags) falls back to the CPU as eval does; on the CPU it is eval + argmax.
  int32_t eval_greedy(int32_t token, std::span<const int32_t> history);

  // Sampled decoding of one token (history.back()) with the draw on the GPU (Forward::eval_sample), when
  // samples_on_device says the serving forward can: the same token as sampler.sample on the logits, the
  // uniforms taken from `sampler` in the same order. A GPU failure falls back to the CPU as eval_greedy
  // does, which then samples with `sampler` on the host.
  bool samples_on_device(const SamplerParams& p) const { return on_gpu_ && fwd_->samples_on_device(p); }
  int32_t eval_sample(std::span<const int32_t> history, Sampler& sampler);
  // Readies the GPU's sampler for `p` before the decode (its graph's capture): see Forward::prepare_sample.
  // A failure here is left to the first eval_sample, which falls back.
  void prepare_sample(const SamplerParams& p) {
    if (!samples_on_device(p)) return;
    try {
      fwd_->prepare_sample(p);
    } catch (const std::exception&) {
    }
  }

  const BackendReport& report() const { return rep_; }
  bool on_gpu() const { return on_gpu_; }
  int64_t n_past() const { return fwd_->n_past(); }

 private:
  void fall_back(const std::string& reason);
  // After a GPU failure during decoding: falls back, and the CPU's logits for history.back() (it re-evaluates
  // the whole history); non-finite ones throw Exit::inference.
  std::vector<float> cpu_after_failure(const std::string& reason, std::span<const int32_t> history);
  std::unique_ptr<Forward> make_cpu(int64_t n_ctx, quant::ActMode mode);
  void cpu_banner();

  const RunConfig& cfg_;
  const Backends& b_;
  std::shared_ptr<const model::OwnedQuantizedModel> model_;
  quant::ThreadPool& pool_;
  int n_threads_;
  int64_t n_ctx_;
  std::ostream& err_;
  std::unique_ptr<Forward> fwd_;
  bool on_gpu_ = false;
  BackendReport rep_;
};

using moe::first_non_finite;  // include/moe/finite.hpp

}  // namespace moe::run
