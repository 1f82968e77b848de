// The run: prompt -> template -> ids -> backend dispatch (CUDA first, F2 guard, CPU fallback) ->
// prefill -> sample/decode loop -> text / JSON / NDJSON outputs and stats. The CLI fills a
// RunConfig; everything here writes to the streams it is given and throws moe::Error for failures.
#pragma once
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/forward.hpp"
#include "moe/model.hpp"
#include "moe/quant.hpp"
#include "moe/sampler.hpp"

namespace moe::run {

enum class Requested { automatic, gpu, cpu };
enum class OutputMode { text, json, stream };
enum class TemplateMode { automatic, chat, raw };

struct RunConfig {
  std::string model_path;
  std::optional<std::string> prompt;                 // text prompt (from PROMPT, -p or -i)
  std::optional<std::vector<int32_t>> prompt_tokens;  // --prompt-tokens: no template, no BOS
  TemplateMode template_mode = TemplateMode::automatic;
  std::optional<std::string> system;
  std::optional<bool> thinking;  // --thinking on|off; absent = off
  int64_t max_tokens = 32;
  SamplerParams sampler;
  int64_t ctx_size = 0;  // 0 = prompt + max_tokens
  std::vector<std::string> stops;
  Requested backend = Requested::automatic;
  int device = 0;
  int threads = 0;  // 0 = all online CPUs
  quant::ActMode cpu_mode = quant::ActMode::fast;  // --cpu-mode (debug): exact = FP32 activations
  OutputMode output = OutputMode::text;
  bool quiet = false;
  bool verbose = false;
  std::string dump_logits;  // --dump-logits FILE.npy
};

// ---- backends -----------------------------------------------------------------------------
struct GpuInfo {
  std::string device;  // "NVIDIA H200"
  uint64_t vram_total_mib = 0;
  uint64_t vram_used_mib = 0;
  double upload_ms = 0;
};
struct GpuRequest {
  int device = 0;
  int64_t n_ctx = 0;
  quant::ThreadPool* pool = nullptr;  // for fake GPUs that are really CPU forwards (tests)
  bool progress = false;
};
// Builds the GPU forward or throws (any exception is a reason to fall back). It must not run work
// on `pool`: the guard's CPU reference may be using it meanwhile.
using GpuFactory = std::function<std::unique_ptr<Forward>(std::shared_ptr<const model::OwnedQuantizedModel>,
                                                          const GpuRequest&, GpuInfo&)>;

// Fault injection (MOE_FAULT), applied to whatever the GPU factory builds:
//   gpu-init    : the factory is not called; "CUDA initialization failed: injected fault"
//   gpu-nan     : every GPU logits row gets a NaN (the guard rejects; in generation: fallback)
//   gpu-perturb : GPU logits are replaced by a deterministic pseudo-random vector of the same
//                 scale (cosine near 0: the guard rejects)
//   gpu-kernel  : the GPU eval throws at the first position past the prompt's first generated
//                 token, i.e. mid-generation after the guard accepted
enum class Fault { none, gpu_init, gpu_nan, gpu_perturb, gpu_kernel };
Fault parse_fault(std::string_view s);  // throws Exit::usage for an unknown value
std::unique_ptr<Forward> wrap_fault(std::unique_ptr<Forward> gpu, Fault f, int64_t n_prompt);

struct Backends {
  GpuFactory gpu;          // empty: this build has no CUDA
  // Is device N there at all? Lets the dispatcher start the guard's CPU reference while the GPU
  // model uploads without wasting it when there is no device. Empty: assume present.
  std::function<bool(int device)> gpu_present;
  Fault fault = Fault::none;
  bool skip_guard = false;  // SKIP_PARITY_GATE=1
};
// The build's CUDA factory (none on a CPU-only build) with MOE_FAULT and SKIP_PARITY_GATE read
// from the environment. MOE_FAKE_GPU=1 (tests) replaces the CUDA factory with a fast-mode CPU
// forward posing as the GPU, so the dispatcher, guard and fallback run without a device.
Backends backends_from_env();
bool build_has_cuda();

// ---- entry points ------------------------------------------------------------------------------
// Generates; returns the process exit code (0, or 130 after SIGINT). Failures throw moe::Error.
int generate(const RunConfig& cfg, const Backends& b, std::ostream& out, std::ostream& err);
// --inspect: model summary (human, or JSON with json = true).
int inspect(const RunConfig& cfg, bool json, std::ostream& out);
// --tokenize: the prompt's ids after the template as a JSON array; needs only the vocabulary.
int tokenize(const RunConfig& cfg, std::ostream& out, std::ostream& err);

// ---- process behaviour -------------------------------------------------------------------------
// SIGINT sets a flag the decode loop polls once per token; SIGPIPE is ignored so a closed stdout
// shows up as a failed write (the run then ends quietly).
void install_signal_handlers();
bool interrupt_requested();
void request_interrupt();  // what the SIGINT handler does (tests call it)
void clear_interrupt();

// Peak resident set size of this process in MiB.
double peak_rss_mib();

// Writes a float32 NPY file of shape [rows, cols] (C order).
void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols);

}  // namespace moe::run
