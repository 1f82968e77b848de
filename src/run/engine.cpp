#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <future>
#include <ostream>

#include <fmt/format.h>

#include "internal.hpp"
#include "moe/cpu.hpp"
#include "moe/error.hpp"

namespace moe::run {

static constexpr const char* kFallbackPrefix = "qwen3moe: the CUDA forward did not serve this run, falling back to CPU: ";

Engine::Engine(const RunConfig& cfg, const Backends& b, std::shared_ptr<const model::OwnedQuantizedModel> m,
               quant::ThreadPool& pool, int n_threads, int64_t n_ctx, std::ostream& err)
    : cfg_(cfg), b_(b), model_(std::move(m)), pool_(pool), n_threads_(n_threads), n_ctx_(n_ctx), err_(err) {
  rep_.requested = cfg.backend == Requested::gpu ? "gpu" : cfg.backend == Requested::cpu ? "cpu" : "auto";
}

std::unique_ptr<Forward> Engine::make_cpu(int64_t n_ctx, quant::ActMode mode) {
  cpu::Options o;
  o.n_ctx = n_ctx;
  o.mode = mode;
  o.pool = &pool_;
  return cpu::make_forward(model_, o);
}

void Engine::cpu_banner() {
  if (!cfg_.quiet)
    err_ << fmt::format("Backend: CPU ({} threads, {}{})\n", n_threads_, quant::isa_name(),
                        cfg_.cpu_mode == quant::ActMode::exact ? ", exact FP32 activations" : "");
}

void Engine::fall_back(const std::string& reason) {
  if (cfg_.backend == Requested::gpu) fail(Exit::gpu_failed, "--gpu: the GPU could not serve this run: {}", reason);
  // Printed whatever the verbosity: a run that silently lost its GPU would mislead.
  err_ << kFallbackPrefix << reason << '\n';
  err_.flush();
  rep_.fell_back = true;
  rep_.reason = reason;
  rep_.ran = "cpu";
  rep_.device.reset();
  rep_.vram_mib = 0;
  fwd_.reset();  // free the GPU before the CPU cache is allocated
  on_gpu_ = false;
  fwd_ = make_cpu(n_ctx_, cfg_.cpu_mode);
  cpu_banner();
}

void Engine::start(std::span<const int32_t> prompt) {
  const auto t0 = Clock::now();
  if (cfg_.backend == Requested::cpu) {
    fwd_ = make_cpu(n_ctx_, cfg_.cpu_mode);
    rep_.build_ms = ms_between(t0, Clock::now());
    cpu_banner();
    return;
  }
  if (!b_.gpu) {
    if (cfg_.backend == Requested::gpu)
      fail(Exit::no_cuda, "--gpu: this build of moe-run has no CUDA (it was configured without nvcc or with -DMOE_CUDA=OFF)");
    fall_back("this build of moe-run has no CUDA");
    rep_.build_ms = ms_between(t0, Clock::now());
    return;
  }

  // ---- GPU attempt: build, then prove it on this prompt.
  const int64_t n_probe = std::min<int64_t>(static_cast<int64_t>(prompt.size()), guard::kProbeMax);
  const bool guard_judges = !b_.skip_guard && n_probe >= 2;
  // The CPU side of the guard needs nothing from the GPU: start it now so it runs while the GPU
  // model builds and uploads (seconds on a large model), not after. Only when a device is there:
  // a missing device fails at once and should fall back at once.
  std::future<guard::Reference> reference;
  if (guard_judges && b_.fault != Fault::gpu_init && (!b_.gpu_present || b_.gpu_present(cfg_.device))) {
    reference = std::async(std::launch::async, [this, prompt, n_probe] {
      auto cpu_exact = make_cpu(n_probe + 1, quant::ActMode::exact);
      return guard::cpu_reference(*cpu_exact, prompt);
    });
  }
  GpuInfo info;
  std::string failure;
  try {
    if (b_.fault == Fault::gpu_init)
      fail(Exit::gpu_failed, "CUDA initialization failed: injected fault (MOE_FAULT=gpu-init)");
    GpuRequest req;
    req.device = cfg_.device;
    // The probe's decode step needs one position past the probe even when nothing is generated.
    req.n_ctx = std::max(n_ctx_, n_probe + 1);
    req.pool = &pool_;
    req.progress = !cfg_.quiet;  // the CUDA side draws it only on a terminal
    fwd_ = wrap_fault(b_.gpu(model_, req, info), b_.fault, static_cast<int64_t>(prompt.size()));
    if (!fwd_) fail(Exit::gpu_failed, "the CUDA model would not build: no forward was returned");
  } catch (const std::exception& e) {
    failure = e.what();
  }
  rep_.build_ms = ms_between(t0, Clock::now());
  if (!failure.empty()) {
    if (reference.valid()) {
      try {
        reference.get();  // the CPU run below reports its own failures
      } catch (const std::exception&) {
      }
    }
    fall_back(failure);
    return;
  }
  on_gpu_ = true;
  rep_.ran = "cuda";
  rep_.device = info.device;
  rep_.vram_mib = info.vram_used_mib;
  if (!cfg_.quiet)
    err_ << fmt::format("Backend: GPU (CUDA, {}, {} MiB VRAM) [weights resident in {:.0f} ms]\n", info.device,
                        info.vram_total_mib, info.upload_ms > 0 ? info.upload_ms : rep_.build_ms);

  rep_.guard_ran = true;
  if (b_.skip_guard) {
    rep_.guard_skipped = true;
    if (!cfg_.quiet) err_ << guard::skipped_line() << '\n';
    return;
  }
  if (!guard_judges) {
    rep_.guard_positions = n_probe;
    if (!cfg_.quiet) err_ << guard::nothing_judged_line(static_cast<int64_t>(prompt.size())) << '\n';
    return;
  }
  const auto tg = Clock::now();
  // CPU failures (non-finite reference logits, memory) are real errors and propagate from here.
  guard::Reference ref;
  if (reference.valid()) {
    ref = reference.get();
  } else {
    auto cpu_exact = make_cpu(n_probe + 1, quant::ActMode::exact);
    ref = guard::cpu_reference(*cpu_exact, prompt);
  }
  rep_.guard_ref_ms = ref.ms;
  guard::Report r;
  try {
    r = guard::f2_report(ref.rows, guard::gpu_probe(*fwd_, prompt, ref), ref.n_vocab);
  } catch (const Error& e) {
    rep_.guard_ms = ms_between(tg, Clock::now());
    rep_.guard_accepted = false;
    fall_back(e.what());
    return;
  }
  rep_.guard_ms = ms_between(tg, Clock::now());
  if (cfg_.verbose)
    err_ << fmt::format("[verbose] F2 guard: CPU reference (FP32 activations, {} positions) {:.1f} ms, run while "
                        "the GPU model uploaded; the guard added {:.1f} ms after the upload\n",
                        n_probe + 1, ref.ms, rep_.guard_ms);
  // A non-finite reference is the CPU's failure, not the GPU's: falling back could not help.
  if (r.non_finite_side && *r.non_finite_side == "CPU")
    fail(Exit::inference, "non-finite logits at position {} of the F2 guard's probe (token id {}) on the CPU",
         r.first_bad_pos.value_or(0), r.non_finite_id);
  rep_.guard_positions = r.positions;
  rep_.guard_min_cosine = r.min_cosine;
  rep_.guard_accepted = r.accepted;
  rep_.guard_first_bad = r.first_bad_pos;
  if (!r.accepted) {
    fall_back(guard::reject_reason(r));
    return;
  }
  if (!cfg_.quiet) err_ << guard::accept_line(r, rep_.guard_ms) << '\n';
}

void Engine::eval(std::span<const int32_t> tokens, std::span<const int32_t> history, bool all_logits,
                  std::vector<float>& logits) {
  const int64_t nv = model_->config.n_vocab;
  const int64_t first_pos = static_cast<int64_t>(history.size() - tokens.size());
  if (on_gpu_) {
    std::string failure;
    try {
      fwd_->eval(tokens, all_logits, logits);
      const int64_t bad = first_non_finite(logits);
      if (bad >= 0) {
        const int64_t pos = all_logits ? first_pos + bad / nv : static_cast<int64_t>(history.size()) - 1;
        failure = fmt::format("the GPU forward produced a non-finite logit at position {} (token id {})", pos, bad % nv);
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (failure.empty()) return;
    fall_back(failure);
    // The CPU starts from an empty cache: re-evaluate everything, hand back the rows of `tokens`.
    fwd_->eval(history, all_logits, logits);
    if (all_logits) logits.erase(logits.begin(), logits.begin() + first_pos * nv);
  } else {
    fwd_->eval(tokens, all_logits, logits);
  }
  const int64_t bad = first_non_finite(logits);
  if (bad >= 0) {
    const int64_t pos = all_logits ? first_pos + bad / nv : static_cast<int64_t>(history.size()) - 1;
    fail(Exit::inference, "non-finite logits at position {} (token id {}) on the CPU", pos, bad % nv);
  }
}

std::vector<float> Engine::cpu_after_failure(const std::string& reason, std::span<const int32_t> history) {
  fall_back(reason);
  std::vector<float> logits;
  fwd_->eval(history, false, logits);  // the CPU starts from an empty cache
  const int64_t bad = first_non_finite(logits);
  if (bad >= 0)
    fail(Exit::inference, "non-finite logits at position {} (token id {}) on the CPU",
         static_cast<int64_t>(history.size()) - 1, bad);
  return logits;
}

int32_t Engine::eval_greedy(int32_t token, std::span<const int32_t> history) {
  if (on_gpu_) {
    try {
      return fwd_->eval_greedy(token);
    } catch (const std::exception& e) {
      const std::vector<float> logits = cpu_after_failure(e.what(), history);
      return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
  }
  std::vector<float> logits;
  eval(std::span<const int32_t>(&token, 1), history, false, logits);
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int32_t Engine::eval_sample(std::span<const int32_t> history, Sampler& sampler) {
  if (on_gpu_) {
    try {
      return fwd_->eval_sample(history, sampler.params(), [&sampler] { return sampler.uniform(); });
    } catch (const std::exception& e) {
      std::vector<float> logits = cpu_after_failure(e.what(), history);
      return sampler.sample(logits, history);
    }
  }
  std::vector<float> logits;
  eval(history.last(1), history, false, logits);
  return sampler.sample(logits, history);
}

}  // namespace moe::run
