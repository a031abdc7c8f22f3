// Host launchers of pyfedkern's CUDA kernels, called from the csrc/ dispatch code. Each runs on the given
// stream (the caller's current torch/cupy stream) of the given device and never synchronises the device.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

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

// Similarity softmax (csrc/similarity.h) of a query and K bank rows over the included segments
// [seg_begin[l], seg_end[l]): per-segment statistics in one pass, then scores and weights, written to `weights`
// and `scores` (K elements of out_dtype, F32 or F64; scores may be null). When host_alpha is not null the weights
// are also copied to it in double, which waits for the stream (similarity_combine needs them on the host).
void similarity_weights(int device, uintptr_t stream, DType dtype, const void* query, int64_t query_stride,
                        const std::vector<uintptr_t>& bank_ptrs, const std::vector<int64_t>& bank_strides,
                        const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end, int metric,
                        double scale, double eps, DType out_dtype, void* weights, void* scores, double* host_alpha);

}  // namespace pfk::cuda

// Evaluates a CUDA launcher call, or raises when this build has no CUDA.
#ifdef PYFEDKERN_WITH_CUDA
#define PFK_CUDA_CALL(expr) (expr)
#else
#define PFK_CUDA_CALL(expr) \
  throw ::pfk::ArgumentError("pyfedkern was built without CUDA; reinstall with nvcc available (PYFEDKERN_CUDA=ON)")
#endif
