// Helpers shared by pyfedkern's CUDA sources: error checks, device selection, launch sizing, stream scratch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pfk::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("pyfedkern CUDA error in ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
}

// Makes `device` current for this host thread while in scope (this runtime's state only; torch's is
// separate).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

inline cudaStream_t as_stream(uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

// Blocks for a grid-stride loop over `work` items with `threads` per block: enough to fill every SM.
inline unsigned grid_for(int device, int64_t work, int threads) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const int64_t wanted = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sms) * 16;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// A device copy of a small host array, allocated and freed in stream order (no device synchronisation).
template <typename T>
class StreamCopy {
 public:
  StreamCopy(const T* host, size_t n, cudaStream_t stream) : stream_(stream) {
    if (n == 0) return;
    check(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), n * sizeof(T), stream), "cudaMallocAsync");
    check(cudaMemcpyAsync(ptr_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  }
  ~StreamCopy() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamCopy(const StreamCopy&) = delete;
  StreamCopy& operator=(const StreamCopy&) = delete;
  const T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
  cudaStream_t stream_;
};

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace pfk::cuda
