// Argument bundles of the FedSpeed step kernels, shared by csrc/fedspeed.cpp and cuda/fedspeed.cu.
// Every vector has d elements; element i of a vector lives at ptr + i * stride (stride in elements). The row forms
// work on `rows` vectors at once (one client each): vector r starts at ptr + r * row_stride, and each row gets its
// own norm (norm_out + r * norm_stride). A row_stride of 0 shares one vector between all rows (x^t in round end)
// or, for round end's acc and h_sum, sums every row into it.
#pragma once

#include <cstdint>

namespace pfk {

struct StridedVec {
  void* ptr = nullptr;  // null: the vector is absent
  int64_t stride = 1;
  int64_t row_stride = 0;  // elements between consecutive rows (row forms)
};

// out = x + s * g with s = rho / (||g|| + eps) (normalize) or s = rho. ||g|| goes to norm_out when given.
// A zero denominator (||g|| + eps == 0) gives s = 0: out = x.
struct PerturbArgs {
  int64_t d = 0;
  int64_t rows = 1;
  int64_t norm_stride = 1;
  StridedVec x, g, out;
  double rho = 0.0;
  double eps = 0.0;
  bool normalize = true;
  void* norm_out = nullptr;   // one accumulator-typed element (float, or double for float64), may be null on CPU
  void* workspace = nullptr;  // CUDA only: workspace_len doubles for the partial sums of squares
  int64_t workspace_len = 0;
};

// v = a1 * g1 + a2 * g2 + c * D (g1 and D optional); x -= lr * (k * v + x_coef * x) where k = 1, or with
// clip_norm > 0, k = min(1, clip_norm / (||v|| + 1e-6)) (the norm goes to norm_out when given).
struct UpdateArgs {
  int64_t d = 0;
  int64_t rows = 1;
  int64_t norm_stride = 1;
  StridedVec x, g1, g2, anchor;
  double a1 = 0.0, a2 = 1.0, c = 0.0, x_coef = 0.0, lr = 0.0;
  double clip_norm = 0.0;  // <= 0: no clipping
  void* norm_out = nullptr;
  void* workspace = nullptr;
  int64_t workspace_len = 0;
};

// delta = x_local - x_global; h += delta; acc += weight * (x_local + h_new) (include_h) or weight * x_local;
// h_sum += delta. acc and h_sum optional. With rows, acc and h_sum (row_stride 0) gain every row's term, in row
// order (bit for bit the 1-D form called row after row).
struct RoundEndArgs {
  int64_t d = 0;
  int64_t rows = 1;
  StridedVec h, x_local, x_global, acc, h_sum;
  double weight = 1.0;
  bool include_h = true;
};

// Partial sums a CUDA norm needs at most (the workspace length the Python layer allocates).
constexpr int64_t kFedSpeedMaxPartials = 1024;

// Partial sums per row of a CUDA row-form norm over d elements (a function of d only: a fixed reduction order); the
// row forms need a workspace of rows * fedspeed_row_partials(d) accumulator elements.
constexpr int64_t kFedSpeedRowItems = 256 * 16;  // elements per partial sum (256 threads, 16 elements each)
inline int64_t fedspeed_row_partials(int64_t d) {
  const int64_t wanted = (d + kFedSpeedRowItems - 1) / kFedSpeedRowItems;
  return wanted < 1 ? 1 : (wanted < kFedSpeedMaxPartials ? wanted : kFedSpeedMaxPartials);
}

}  // namespace pfk
