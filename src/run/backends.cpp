// The GPU factory of this build, fault injection around it, and the test-only fake GPU.
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "moe/cpu.hpp"
#include "moe/error.hpp"
#include "moe/run.hpp"
#include "engine.hpp"
#if defined(MOE_HAVE_CUDA)
#include "moe/cuda.hpp"
#endif

namespace moe::run {

namespace {

// Delegates everything to `inner`; subclasses change what they need.
class Wrapped : public Forward {
 public:
  explicit Wrapped(std::unique_ptr<Forward> inner) : inner_(std::move(inner)) {}
  void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) override {
    inner_->eval(tokens, all_logits, logits);
  }
  int64_t n_past() const override { return inner_->n_past(); }
  int64_t n_ctx() const override { return inner_->n_ctx(); }
  int64_t n_vocab() const override { return inner_->n_vocab(); }
  void reset() override { inner_->reset(); }
  std::string name() const override { return inner_->name(); }
  bool samples_on_device(const SamplerParams& p) const override { return inner_->samples_on_device(p); }
  void prepare_sample(const SamplerParams& p) override { inner_->prepare_sample(p); }
  int32_t eval_sample(std::span<const int32_t> history, const SamplerParams& p,
                      const std::function<double()>& uniform) override {
    return inner_->eval_sample(history, p, uniform);
  }

 protected:
  std::unique_ptr<Forward> inner_;
};

// Poses as the GPU, down to its sampler on the device: every sampled token goes through eval_sample (the host's
// sampler on the CPU forward's logits, the uniforms from the caller), so that the CPU-only tests run the
// engine's device-sampling path and its fallback.
class FakeGpu final : public Wrapped {
 public:
  using Wrapped::Wrapped;
  std::string name() const override { return "cuda"; }
  bool samples_on_device(const SamplerParams&) const override {
    const char* v = std::getenv("MOE_CUDA_DEVICE_SAMPLER");  // =0: the host's path, as on the real GPU
    return !(v && std::string_view(v) == "0");
  }
  void prepare_sample(const SamplerParams&) override {}
  int32_t eval_sample(std::span<const int32_t> history, const SamplerParams& p,
                      const std::function<double()>& uniform) override {
    std::vector<float> logits;
    inner_->eval(history.last(1), false, logits);
    const int64_t bad = first_non_finite(logits);
    if (bad >= 0) fail(Exit::gpu_failed, "the GPU forward produced a non-finite logit at position {}", n_past() - 1);
    return sample_with(logits, history, p, uniform);
  }
};

class Faulty final : public Wrapped {
 public:
  Faulty(std::unique_ptr<Forward> inner, Fault f, int64_t n_prompt)
      : Wrapped(std::move(inner)), fault_(f), n_prompt_(n_prompt) {}

  void eval(std::span<const int32_t> tokens, bool all_logits, std::vector<float>& logits) override {
    // Past the prompt and its first generated token: only the generation loop gets here (the
    // guard's probe ends at or before position n_prompt).
    if (fault_ == Fault::gpu_kernel && inner_->n_past() > n_prompt_)
      fail(Exit::gpu_failed, "a CUDA kernel failed at decode position {}: injected fault (MOE_FAULT=gpu-kernel)",
           inner_->n_past());
    inner_->eval(tokens, all_logits, logits);
    const size_t nv = static_cast<size_t>(inner_->n_vocab());
    if (nv == 0) return;
    const size_t rows = logits.size() / nv;
    if (fault_ == Fault::gpu_nan) {
      for (size_t r = 0; r < rows; ++r) logits[r * nv + (r * 7919) % nv] = std::nanf("");
    } else if (fault_ == Fault::gpu_perturb) {
      // Same scale as the real row, unrelated direction: a broken kernel that still looks plausible.
      for (size_t r = 0; r < rows; ++r) {
        float* row = logits.data() + r * nv;
        double ss = 0;
        for (size_t i = 0; i < nv; ++i) ss += static_cast<double>(row[i]) * row[i];
        const double rms = std::sqrt(ss / static_cast<double>(nv));
        for (size_t i = 0; i < nv; ++i) {
          state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
          const double u = static_cast<double>(state_ >> 11) * (1.0 / 9007199254740992.0);
          row[i] = static_cast<float>((u * 2.0 - 1.0) * std::sqrt(3.0) * rms);
        }
      }
    }
  }
  int32_t eval_greedy(int32_t token) override { return Forward::eval_greedy(token); }
  // gpu-kernel also fails the device sampler's steps (the engine's fallback from eval_sample); the faults that
  // corrupt logits need them on the host
  bool samples_on_device(const SamplerParams& p) const override {
    return fault_ == Fault::gpu_kernel && inner_->samples_on_device(p);
  }
  int32_t eval_sample(std::span<const int32_t> history, const SamplerParams& p,
                      const std::function<double()>& uniform) override {
    if (inner_->n_past() > n_prompt_)
      fail(Exit::gpu_failed, "a CUDA kernel failed at decode position {}: injected fault (MOE_FAULT=gpu-kernel)",
           inner_->n_past());
    return inner_->eval_sample(history, p, uniform);
  }

 private:
  Fault fault_;
  int64_t n_prompt_;
  uint64_t state_ = 0x9E3779B97F4A7C15ULL;
};

}  // namespace

Fault parse_fault(std::string_view s) {
  if (s.empty() || s == "none") return Fault::none;
  if (s == "gpu-init") return Fault::gpu_init;
  if (s == "gpu-nan") return Fault::gpu_nan;
  if (s == "gpu-perturb") return Fault::gpu_perturb;
  if (s == "gpu-kernel") return Fault::gpu_kernel;
  fail(Exit::usage, "MOE_FAULT={} is not one of gpu-init, gpu-nan, gpu-perturb, gpu-kernel", s);
}

std::unique_ptr<Forward> wrap_fault(std::unique_ptr<Forward> gpu, Fault f, int64_t n_prompt) {
  if (f == Fault::none || f == Fault::gpu_init) return gpu;
  return std::make_unique<Faulty>(std::move(gpu), f, n_prompt);
}

bool build_has_cuda() {
#if defined(MOE_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

Backends backends_from_env() {
  Backends b;
  if (const char* f = std::getenv("MOE_FAULT")) b.fault = parse_fault(f);
  if (const char* s = std::getenv("SKIP_PARITY_GATE")) b.skip_guard = std::string_view(s) == "1";
  const char* fake = std::getenv("MOE_FAKE_GPU");
  if (fake && std::string_view(fake) == "1") {
    b.gpu = [](std::shared_ptr<const model::OwnedQuantizedModel> m, const GpuRequest& r, GpuInfo& info) {
      cpu::Options o;
      o.n_ctx = r.n_ctx;
      o.mode = quant::ActMode::fast;
      o.pool = r.pool;
      info.device = "fake GPU (CPU forward, MOE_FAKE_GPU=1)";
      return std::unique_ptr<Forward>(std::make_unique<FakeGpu>(cpu::make_forward(std::move(m), o)));
    };
    return b;
  }
#if defined(MOE_HAVE_CUDA)
  b.gpu_present = [](int device) { return device < cuda::device_count(); };
  b.gpu = [](std::shared_ptr<const model::OwnedQuantizedModel> m, const GpuRequest& r, GpuInfo& info) {
    cuda::Options o;
    o.device = r.device;
    o.n_ctx = r.n_ctx;
    o.progress = r.progress;
    cuda::DeviceInfo di;
    auto f = cuda::make_forward(std::move(m), o, &di);
    info.device = di.name;
    info.vram_total_mib = di.vram_total_mib;
    info.vram_used_mib = di.vram_used_mib;
    info.upload_ms = di.upload_ms;
    return f;
  };
#endif
  return b;
}

}  // namespace moe::run
