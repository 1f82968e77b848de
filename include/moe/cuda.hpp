// The CUDA forward of qwen3moe: weights resident on the GPU in their quantized form, fused decode
// kernels replayed as one CUDA graph per token, batched prefill with expert-grouped GEMMs.
// Only built with CUDA (MOE_HAVE_CUDA); the dispatcher (src/run) is its one user.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "moe/forward.hpp"
#include "moe/model.hpp"

namespace moe::cuda {

struct Options {
  int device = 0;
  int64_t n_ctx = 0;      // KV-cache positions; 0 = the model's context_length
  bool progress = false;  // upload progress bar (only when stderr is a terminal)
  int64_t max_batch = 512;  // prefill tokens per pass; longer evals run in chunks of this
};

struct DeviceInfo {
  std::string name;
  uint64_t vram_total_mib = 0;
  uint64_t vram_used_mib = 0;  // taken by this forward (weights, KV cache, scratch)
  double upload_ms = 0;
  std::string decode_path;  // "persistent kernel" or "kernel graph" (docs/ARCHITECTURE.md)
};

// Builds the forward on `o.device`. Throws moe::Error(Exit::gpu_failed, reason) where the reason
// names the step: "CUDA initialization failed: ...", "the CUDA model would not build: ...",
// "the model does not fit on ...: needs ... MiB" (with the numbers), "upload failed: ...",
// "graph capture failed: ...". Later failures (a kernel during eval) throw the same way.
std::unique_ptr<Forward> make_forward(std::shared_ptr<const model::OwnedQuantizedModel> m, const Options& o,
                                      DeviceInfo* info);

// Number of CUDA devices usable by this process (0 when there is no driver or no device).
int device_count();

// ---- pieces exposed for the tests ------------------------------------------------------------------
// Bytes of one tensor's rows in the device layout; 0 when the type has no CUDA kernels.
uint64_t device_bytes(gguf::Type t, int64_t cols, int64_t rows);
// Converts `rows` rows of `cols` elements from the GGUF layout to the device layout (host memory).
void repack_rows(gguf::Type t, const uint8_t* src, uint8_t* dst, int64_t cols, int64_t rows);

}  // namespace moe::cuda
