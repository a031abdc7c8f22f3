// Device discovery for pyfedkern.cuda_available() and build_info().
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

}  // namespace pfk::cuda
