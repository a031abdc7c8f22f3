// Host launchers of pyfedkern's CUDA kernels, called from the csrc/ dispatch code. Each runs on the given
// stream (the caller's current torch/cupy stream) of the given device and never synchronises the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fedspeed.h"
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

// `count` rows of a stack, row r at byte address base + r * step_bytes with element stride col_stride: read without a
// per-row table, so a stack of any height fits in a kernel's parameters.
struct RowStack {
  const void* base = nullptr;
  int64_t step_bytes = 0;
  int64_t col_stride = 1;
  int64_t count = 0;
};

// Where a kernel finds its rows and weights: `count` RowRefs at byte offset `rows` of its tables (or, with rows < 0,
// the rows of `stack`), and at `weights` one accumulator-typed weight per row (float, or double for float64 data).
struct RowTables {
  int64_t count = 0;
  int64_t rows = -1;
  int64_t weights = 0;
  RowStack stack;
};

// out = (accumulate ? out : 0) + sum_k w_k * row_k over d elements, the rows a list (`rows`) or, when stack.count > 0,
// a stack. The weights are `weights` (host, double) or, when device_weights is not null, one accumulator-typed value
// per row in device memory; a row whose weight is 0 is not read.
struct WeightedSumCall {
  int64_t d = 0;
  void* out = nullptr;
  int64_t out_stride = 1;
  std::vector<RowRef> rows;
  RowStack stack;
  std::vector<double> weights;
  const void* device_weights = nullptr;
  bool accumulate = false;
};

// Each CUDA launcher below that takes a Scratch returns 0 once launched, or the bytes of scratch it needs (having
// launched nothing).
size_t weighted_sum(int device, uintptr_t stream, DType dtype, const WeightedSumCall& call, Scratch scratch);

// Row L2 norms of a [B, D] matrix; with labels (int32 or int64), per-class sums/means/counts of the norms (fixed
// order); with logits [B, C], the number of rows whose argmax equals the label. Null pointers switch parts off.
// Labels are checked on the device: any label outside [0, C) makes every class sum/mean NaN and every count (and
// the correct count) -1.
size_t class_feature_norms(int device, uintptr_t stream, DType dtype, bool labels_int32, int64_t B, int64_t D,
                           const void* features, int64_t f_stride0, int64_t f_stride1, const void* labels,
                           int64_t label_stride, int64_t C, const void* logits, int64_t logit_stride0,
                           int64_t logit_stride1, void* norms, void* class_sum, void* class_mean, int64_t* counts,
                           int64_t* correct, Scratch scratch);

// grad[r, :] = (grad_norms[r] + class_coef[labels[r]]) * f[r, :] / ||f[r, :]|| with float32 coefficients
// (float64 for float64 features); grad is a contiguous [B, D] array of the features' dtype. A label outside
// [0, C) gives a NaN row.
void class_feature_norms_backward(int device, uintptr_t stream, DType dtype, bool labels_int32, int64_t B, int64_t D,
                                  const void* features, int64_t f_stride0, int64_t f_stride1, const void* labels,
                                  int64_t label_stride, int64_t C, const void* grad_norms, const void* class_coef,
                                  void* grad);

// FedSpeed step kernels (see csrc/fedspeed.h); norms stay on the device (norm_out), no host synchronisation.
void fedspeed_perturb(int device, uintptr_t stream, DType dtype, const PerturbArgs& args);
void fedspeed_update(int device, uintptr_t stream, DType dtype, const UpdateArgs& args);
void fedspeed_round_end(int device, uintptr_t stream, DType dtype, const RoundEndArgs& args);
// Their row forms (args.rows clients, one norm per row; workspace: rows * fedspeed_row_partials(d) elements).
void fedspeed_perturb_rows(int device, uintptr_t stream, DType dtype, const PerturbArgs& args);
void fedspeed_update_rows(int device, uintptr_t stream, DType dtype, const UpdateArgs& args);
void fedspeed_round_end_rows(int device, uintptr_t stream, DType dtype, const RoundEndArgs& args);
// Greedy herding order of n clients on float64 Gram matrices [n, ld, ld] (one block per client).
size_t herding_greedy(int device, uintptr_t stream, const double* gram, int64_t ld, const std::vector<int64_t>& taus,
                      const std::vector<int64_t>& ks, double rel_tol, int64_t* order, int64_t kmax, uint8_t* mask,
                      double* sq_norm, Scratch scratch);

// out[n, :] = sum of the rows r of clients[n] with mask[n * mask_stride + r] set, in ascending row order.
size_t herding_masked_sum(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<MatrixView>& clients,
                          const uint8_t* mask, int64_t mask_stride, void* out, int64_t out_row_stride,
                          int64_t out_col_stride, Scratch scratch);

// GraB balancing of the rows of y in order; mean/s/g are in the accumulation type (float, or double for F64).
size_t grab_steps(int device, uintptr_t stream, DType dtype, const MatrixView& y, int64_t d, void* mean, void* s,
                  void* g, uint8_t* picked, int64_t first_step, int64_t tau, bool running_mean, Scratch scratch);

// Similarity softmax (csrc/similarity.h) of a query and K bank rows over the included segments
// [seg_begin[l], seg_end[l]): per-segment statistics in one pass, then scores and weights, written to `weights`
// and `scores` (K elements of out_dtype, F32 or F64; scores may be null). blend_weights, when not null, receives
// the weights again as K floats (doubles with blend_weights_f64) in device memory, for similarity_combine's blend.
struct SimilarityArgs {
  DType dtype = DType::F32;
  DType out_dtype = DType::F32;
  const void* query = nullptr;
  int64_t query_stride = 1;
  std::vector<RowRef> bank;
  std::vector<int64_t> seg_begin, seg_end;
  int metric = 0;
  double scale = 0.0, eps = 0.0;
  void* weights = nullptr;
  void* scores = nullptr;
  void* blend_weights = nullptr;
  bool blend_weights_f64 = false;
};
size_t similarity_scratch_bytes(const SimilarityArgs& args);  // what similarity_weights needs
size_t similarity_weights(int device, uintptr_t stream, const SimilarityArgs& args, Scratch scratch);
size_t weighted_sum_scratch_bytes(DType dtype, const WeightedSumCall& call);  // what weighted_sum needs

}  // namespace pfk::cuda

// Evaluates a CUDA launcher call, or raises when this build has no CUDA.
#ifdef PYFEDKERN_WITH_CUDA
#define PFK_CUDA_CALL(expr) (expr)
#else
namespace pfk {
[[noreturn]] inline size_t no_cuda() {
  throw ArgumentError("pyfedkern was built without CUDA; reinstall with nvcc available (PYFEDKERN_CUDA=ON)");
}
}  // namespace pfk
#define PFK_CUDA_CALL(expr) (::pfk::no_cuda())
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
size_t pbc_agg_bcast(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                     void* server, int64_t server_stride, Scratch scratch);
// x += sum_r weights[r] * (rows[r] - x).
size_t weighted_delta(int device, uintptr_t stream, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                      const std::vector<double>& weights, void* x, int64_t x_stride, Scratch scratch);
// MIFA's running-sum update (see MifaArgs).
size_t mifa_update(int device, uintptr_t stream, DType dtype, int64_t d, const MifaArgs& args, Scratch scratch);
}  // namespace cuda

}  // namespace pfk
