// Host launchers of pyfedkern's CUDA kernels, called from the csrc/ dispatch code. Each runs on the given
// stream (the caller's current torch/cupy stream) of the given device and never synchronises the device.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fedspeed.h"
#include "types.h"

namespace pfk::cuda {

#ifdef PYFEDKERN_WITH_CUDA
int device_count();     // 0 when there is no driver or no device
int runtime_version();  // e.g. 13000
#else
inline int device_count() {
  return 0;
}
#endif

// out = (accumulate ? out : 0) + sum_k rows[k].weight * rows[k]; rows with weight 0 have been dropped.
void weighted_sum(int device, uintptr_t stream, DType dtype, int64_t d, void* out, int64_t out_stride,
                  const std::vector<WeightedRow>& rows, bool accumulate);

// FedSpeed step kernels (see csrc/fedspeed.h); norms stay on the device (norm_out), no host synchronisation.
void fedspeed_perturb(int device, uintptr_t stream, DType dtype, const PerturbArgs& args);
void fedspeed_update(int device, uintptr_t stream, DType dtype, const UpdateArgs& args);
void fedspeed_round_end(int device, uintptr_t stream, DType dtype, const RoundEndArgs& args);

}  // namespace pfk::cuda

// Evaluates a CUDA launcher call, or raises when this build has no CUDA.
#ifdef PYFEDKERN_WITH_CUDA
#define PFK_CUDA_CALL(expr) (expr)
#else
#define PFK_CUDA_CALL(expr) \
  throw ::pfk::ArgumentError("pyfedkern was built without CUDA; reinstall with nvcc available (PYFEDKERN_CUDA=ON)")
#endif
