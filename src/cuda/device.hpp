// Host-side plumbing of the CUDA forward: checked CUDA calls and owned device allocations.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "moe/error.hpp"

namespace moe::cuda {

// Any CUDA failure becomes a gpu_failed error whose message names the step.
inline void check(cudaError_t e, const char* step) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls are not confused by it
    throw Error(Exit::gpu_failed, fmt::format("{}: {} ({})", step, cudaGetErrorString(e), cudaGetErrorName(e)));
  }
}

// One cudaMalloc, freed on destruction.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void alloc(size_t n, const char* what) {
    bytes = n;
    cudaError_t e = cudaMalloc(&ptr, n ? n : 1);
    if (e != cudaSuccess) {
      ptr = nullptr;
      cudaGetLastError();
      throw Error(Exit::gpu_failed, fmt::format("upload failed: cannot allocate {} ({:.1f} MiB) on the GPU: {}", what,
                                                static_cast<double>(n) / (1024.0 * 1024.0), cudaGetErrorString(e)));
    }
  }
  template <typename T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(ptr) + byte_offset);
  }
};

}  // namespace moe::cuda
