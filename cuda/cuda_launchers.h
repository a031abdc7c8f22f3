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

}  // namespace pfk::cuda

// Evaluates a CUDA launcher call, or raises when this build has no CUDA.
#ifdef PYFEDKERN_WITH_CUDA
#define PFK_CUDA_CALL(expr) (expr)
#else
#define PFK_CUDA_CALL(expr) \
  throw ::pfk::ArgumentError("pyfedkern was built without CUDA; reinstall with nvcc available (PYFEDKERN_CUDA=ON)")
#endif

// ---- FedPBC family (csrc/pbc.cpp, cuda/pbc.cu) ----
namespace pfk {

// One row of a model store: element j lives at ptr + j * stride (stride in elements).
struct PbcRow {
  void* ptr;
  int64_t stride;
};

// Arguments of mifa_update: updates[r] is written (as a delta) into memory[r]; all_memory is empty unless the
// running sum `total` is to be re-summed from every memory row; x += coef * total afterwards.
struct MifaArgs {
  PbcRow x{};
  PbcRow total{};
  std::vector<PbcRow> updates;
  std::vector<PbcRow> memory;
  std::vector<PbcRow> all_memory;
  double coef = 0.0;
  bool subtract_x = false;
};

namespace cuda {
// server = mean of rows; every row = server (rows non-empty, distinct, none overlapping server).
void pbc_agg_bcast(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<PbcRow>& rows, void* server,
                   int64_t server_stride);
// x += sum_r weights[r] * (rows[r] - x).
void weighted_delta(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                    const std::vector<double>& weights, void* x, int64_t x_stride);
// MIFA's running-sum update (see MifaArgs).
void mifa_update(int device, uintptr_t stream, DType dtype, int64_t d, const MifaArgs& args);
}  // namespace cuda

}  // namespace pfk
