// Device discovery for pyfedkern.cuda_available() and build_info(), and the runtime helpers of cuda_common.cuh.
#include <atomic>

#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace pfk::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" / "no device" error
    return 0;
  }
  return n;
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

int sm_count(int device) {
  constexpr int kCached = 64;
  static std::atomic<int> cache[kCached] = {};
  if (device >= 0 && device < kCached) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (device >= 0 && device < kCached) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

void refuse_if_capturing(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone)
    throw ArgumentError(std::string(what) + ": this call's argument tables exceed " + std::to_string(kLargeArgs) +
                        " bytes (too many rows or segments) and must be copied from the host, which a CUDA graph "
                        "cannot capture; call it outside the capture or split it into smaller calls");
}

}  // namespace pfk::cuda
