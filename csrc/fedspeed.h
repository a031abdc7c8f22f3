// Argument bundles of the FedSpeed step kernels, shared by csrc/fedspeed.cpp and cuda/fedspeed.cu.
// Every vector has d elements; element i of a vector lives at ptr + i * stride (stride in elements).
#pragma once

#include <cstdint>

namespace pfk {

struct StridedVec {
  void* ptr = nullptr;  // null: the vector is absent
  int64_t stride = 1;
};

// out = x + s * g with s = rho / (||g|| + eps) (normalize) or s = rho. ||g|| goes to norm_out when given.
// A zero denominator (||g|| + eps == 0) gives s = 0: out = x.
struct PerturbArgs {
  int64_t d = 0;
  StridedVec x, g, out;
  double rho = 0.0;
  double eps = 0.0;
  bool normalize = true;
  void* norm_out = nullptr;   // one accumulator-typed element (float, or double for float64), may be null on CPU
  void* workspace = nullptr;  // CUDA only: workspace_len accumulator-typed elements for the partial sums
  int64_t workspace_len = 0;
};

// v = a1 * g1 + a2 * g2 + c * D (g1 and D optional); x -= lr * (k * v + x_coef * x) where k = 1, or with
// clip_norm > 0, k = min(1, clip_norm / (||v|| + 1e-6)) (the norm goes to norm_out when given).
struct UpdateArgs {
  int64_t d = 0;
  StridedVec x, g1, g2, anchor;
  double a1 = 0.0, a2 = 1.0, c = 0.0, x_coef = 0.0, lr = 0.0;
  double clip_norm = 0.0;  // <= 0: no clipping
  void* norm_out = nullptr;
  void* workspace = nullptr;
  int64_t workspace_len = 0;
};

// delta = x_local - x_global; h += delta; acc += weight * (x_local + h_new) (include_h) or weight * x_local;
// h_sum += delta. acc and h_sum optional.
struct RoundEndArgs {
  int64_t d = 0;
  StridedVec h, x_local, x_global, acc, h_sum;
  double weight = 1.0;
  bool include_h = true;
};

// Partial sums a CUDA norm needs at most (the workspace length the Python layer allocates).
constexpr int64_t kFedSpeedMaxPartials = 1024;

}  // namespace pfk
