// Host launchers of pyfedkern's CUDA kernels, called from the csrc/ dispatch code. Each runs on the given
// stream (the caller's current torch/cupy stream) of the given device and never synchronises the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "types.h"

namespace pfk {

// A [rows, cols] matrix: element (r, j) lives at ptr + r * row_stride + j * col_stride (strides in elements).
struct MatrixView {
  const void* ptr;
  int64_t rows;
  int64_t row_stride;
  int64_t col_stride;
};

#if defined(__CUDACC__)
#define PFK_HOST_DEVICE __host__ __device__
#else
#define PFK_HOST_DEVICE
#endif

// Tolerance within which a greedy-herding score ties with the minimum (see csrc/herding.cpp).
PFK_HOST_DEVICE inline double tie_tolerance(double rel_tol, double gmm, double picked_diag_sum) {
  return rel_tol * (gmm + 2.0 * sqrt(gmm * picked_diag_sum));
}

}  // namespace pfk

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

// Greedy herding order of n clients on float64 Gram matrices [n, ld, ld] (one block per client).
void herding_greedy(int device, uintptr_t stream, const double* gram, int64_t ld, const std::vector<int64_t>& taus,
                    const std::vector<int64_t>& ks, double rel_tol, int64_t* order, int64_t kmax, uint8_t* mask,
                    double* sq_norm);

// out[n, :] = sum of the rows r of clients[n] with mask[n * mask_stride + r] set, in ascending row order.
void herding_masked_sum(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<MatrixView>& clients,
                        const uint8_t* mask, int64_t mask_stride, void* out, int64_t out_row_stride,
                        int64_t out_col_stride);

// GraB balancing of the rows of y in order; mean/s/g are in the accumulation type (float, or double for F64).
void grab_steps(int device, uintptr_t stream, DType dtype, const MatrixView& y, int64_t d, void* mean, void* s, void* g,
                uint8_t* picked, int64_t first_step, int64_t tau, bool running_mean);

}  // namespace pfk::cuda

// Evaluates a CUDA launcher call, or raises when this build has no CUDA.
#ifdef PYFEDKERN_WITH_CUDA
#define PFK_CUDA_CALL(expr) (expr)
#else
#define PFK_CUDA_CALL(expr) \
  throw ::pfk::ArgumentError("pyfedkern was built without CUDA; reinstall with nvcc available (PYFEDKERN_CUDA=ON)")
#endif
