// Feature-norm kernels (FNR-FL, per-sample statistics): each row's L2 norm, per-class sums/means/counts of the
// norms (a segmented reduction by label), the count of correct top-1 predictions, and the backward pass.
// Rows are cut into fixed chunks; each chunk keeps its own per-class partial sums, which are then added in chunk
// order, so results never depend on the number of threads.
#include <cmath>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int kLanes = 16;  // partial sums per row: vector-friendly, fixed order on every ISA

constexpr int64_t kBlock = 4096;  // elements per block: each lane adds 256 squares in Acc before they go to double

// Σ x_j² over n elements at stride s (s == 1 is the vectorised path), in blocks of kBlock elements: within a block
// lane l sums j ≡ l (mod 16) in the accumulator type, a fixed pairwise tree adds the lanes, and the block sums are
// added in double, so the result stays accurate at any length (a float sum stops growing at 2^24 of its terms).
template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE double row_sumsq_body(const T* __restrict__ x, int64_t n, int64_t s) {
  using Acc = typename AccOf<T>::type;
  double total = 0.0;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = begin + kBlock < n ? begin + kBlock : n;
    Acc acc[kLanes];
    for (int l = 0; l < kLanes; ++l) acc[l] = Acc(0);
    int64_t j = begin;
    for (; j + kLanes <= end; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const Acc v = to_acc(x[(j + l) * (Contiguous ? 1 : s)]);
        acc[l] = acc[l] + v * v;
      }
    }
    for (int l = 0; j + l < end; ++l) {
      const Acc v = to_acc(x[(j + l) * (Contiguous ? 1 : s)]);
      acc[l] = acc[l] + v * v;
    }
    for (int w = kLanes / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
    total += static_cast<double>(acc[0]);
  }
  return total;
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, double, row_sumsq,
                 (const T* x, int64_t n, int64_t s), (x, n, s), row_sumsq_body)

template <typename T>
typename AccOf<T>::type row_norm(const T* x, int64_t n, int64_t s) {
  using Acc = typename AccOf<T>::type;
  return static_cast<Acc>(std::sqrt(s == 1 ? row_sumsq<T, true>(x, n, 1) : row_sumsq<T, false>(x, n, s)));
}

// out[j] = scale * x[j * s] for one row.
template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void scale_row_body(const T* __restrict__ x, int64_t n, int64_t s, typename AccOf<T>::type scale,
                                      T* __restrict__ out) {
  for (int64_t j = 0; j < n; ++j) out[j] = Store<T>::from(scale * to_acc(x[j * (Contiguous ? 1 : s)]));
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, scale_row,
                 (const T* x, int64_t n, int64_t s, typename AccOf<T>::type scale, T* out), (x, n, s, scale, out),
                 scale_row_body)

// First index of the row maximum; a NaN counts as the maximum (numpy/torch argmax semantics).
template <typename T>
int64_t row_argmax(const T* x, int64_t n, int64_t s) {
  int64_t best = 0;
  float best_v = static_cast<float>(to_acc(x[0]));
  if (std::isnan(best_v)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    const float v = static_cast<float>(to_acc(x[j * s]));
    if (std::isnan(v)) return j;
    if (v > best_v) best_v = v, best = j;
  }
  return best;
}

// Rows per chunk: a fixed function of the shape (never of the thread count), large enough that the per-chunk
// class partials stay small.
int64_t chunk_rows(int64_t B, int64_t C) {
  int64_t rows = 256;
  while (rows < B && (B / rows) * C > (int64_t{1} << 20)) rows *= 2;
  return rows;
}

struct Matrix {
  const void* ptr;
  int64_t stride0, stride1;
};

template <typename L>
const L* label_ptr(uintptr_t p) {
  return reinterpret_cast<const L*>(p);
}

// Checks every label is in [0, C) and counts each class, before any output is written.
template <typename L>
void check_and_count(const L* labels, int64_t stride, int64_t B, int64_t C, int64_t* counts) {
  for (int64_t c = 0; c < C; ++c) counts[c] = 0;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t v = static_cast<int64_t>(labels[r * stride]);
    if (v < 0 || v >= C)
      throw ArgumentError("labels[" + std::to_string(r) + "] = " + std::to_string(v) + " is out of range [0, " +
                          std::to_string(C) + ")");
    ++counts[v];
  }
}

template <typename T, typename L>
void forward_cpu(int64_t B, int64_t D, Matrix f, const L* labels, int64_t label_stride, int64_t C, Matrix logits,
                 int64_t logit_cols, T* norms, T* class_sum, T* class_mean, int64_t* counts, int64_t* correct) {
  using Acc = typename AccOf<T>::type;
  if (labels != nullptr) check_and_count(labels, label_stride, B, C, counts);
  const int64_t rows = chunk_rows(B, C);
  const int64_t nchunks = (B + rows - 1) / rows;
  const bool with_classes = labels != nullptr && C > 0;
  std::vector<double> partial(with_classes ? nchunks * C : 0, 0.0);
  std::vector<int64_t> hits(nchunks, 0);
  const T* fx = static_cast<const T*>(f.ptr);
  const T* lx = static_cast<const T*>(logits.ptr);
  parallel_chunks(B, rows, B * (D + (lx != nullptr ? logit_cols : 0) + 1),
                  [&](int64_t chunk, int64_t begin, int64_t end) {
                    double* part = with_classes ? partial.data() + chunk * C : nullptr;
                    int64_t chunk_hits = 0;
                    for (int64_t r = begin; r < end; ++r) {
                      const Acc nrm = row_norm(fx + r * f.stride0, D, f.stride1);
                      norms[r] = Store<T>::from(nrm);
                      if (part != nullptr)
                        part[static_cast<int64_t>(labels[r * label_stride])] += static_cast<double>(nrm);
                      if (lx != nullptr) {
                        const int64_t pred = row_argmax(lx + r * logits.stride0, logit_cols, logits.stride1);
                        chunk_hits += pred == static_cast<int64_t>(labels[r * label_stride]);
                      }
                    }
                    hits[chunk] = chunk_hits;
                  });
  if (with_classes) {
    for (int64_t c = 0; c < C; ++c) {
      double total = 0.0;
      for (int64_t k = 0; k < nchunks; ++k) total += partial[k * C + c];
      class_sum[c] = Store<T>::from(static_cast<Acc>(total));
      class_mean[c] = Store<T>::from(static_cast<Acc>(counts[c] > 0 ? total / static_cast<double>(counts[c]) : 0.0));
    }
  }
  if (correct != nullptr) {
    int64_t total = 0;
    for (int64_t k = 0; k < nchunks; ++k) total += hits[k];
    *correct = total;
  }
}

// grad_f[r, :] = (grad_norms[r] + class_coef[labels[r]]) · f[r, :] / ‖f[r, :]‖ (0 for a zero row).
template <typename T, typename L>
void backward_cpu(int64_t B, int64_t D, Matrix f, const L* labels, int64_t label_stride, int64_t C,
                  const typename AccOf<T>::type* grad_norms, const typename AccOf<T>::type* class_coef, T* grad) {
  using Acc = typename AccOf<T>::type;
  if (labels != nullptr) {
    for (int64_t r = 0; r < B; ++r) {
      const int64_t v = static_cast<int64_t>(labels[r * label_stride]);
      if (v < 0 || v >= C)
        throw ArgumentError("labels[" + std::to_string(r) + "] = " + std::to_string(v) + " is out of range");
    }
  }
  const T* fx = static_cast<const T*>(f.ptr);
  parallel_chunks(B, 64, 3 * B * D, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = fx + r * f.stride0;
      const Acc nrm = row_norm(row, D, f.stride1);
      Acc coef = grad_norms != nullptr ? grad_norms[r] : Acc(0);
      if (class_coef != nullptr && labels != nullptr) coef = coef + class_coef[labels[r * label_stride]];
      const Acc scale = nrm > Acc(0) ? coef / nrm : Acc(0);
      if (f.stride1 == 1) {
        scale_row<T, true>(row, D, 1, scale, grad + r * D);
      } else {
        scale_row<T, false>(row, D, f.stride1, scale, grad + r * D);
      }
    }
  });
}

template <typename Fn>
void with_types(DType dtype, const std::string& label_dtype, Fn&& fn) {
  auto by_label = [&](auto tag) {
    using T = decltype(tag);
    if (label_dtype == "int64" || label_dtype.empty()) return fn(T{}, int64_t{});
    if (label_dtype == "int32") return fn(T{}, int32_t{});
    throw ArgumentError("labels must be int32 or int64, got " + label_dtype);
  };
  switch (dtype) {
    case DType::F32:
      return by_label(float{});
    case DType::F64:
      return by_label(double{});
    case DType::F16:
      return by_label(f16_t{});
    case DType::BF16:
      return by_label(bf16_t{});
  }
}

size_t class_feature_norms(int device, uintptr_t stream, const std::string& dtype_name, int64_t B, int64_t D,
                           uintptr_t features, int64_t f_stride0, int64_t f_stride1, uintptr_t labels,
                           const std::string& label_dtype, int64_t label_stride, int64_t num_classes, uintptr_t logits,
                           int64_t logit_stride0, int64_t logit_stride1, uintptr_t norms, uintptr_t class_sum,
                           uintptr_t class_mean, uintptr_t counts, uintptr_t correct, uintptr_t scratch,
                           size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  if (B < 1 || D < 1) throw ArgumentError("class_feature_norms: need B >= 1 and D >= 1");
  if (features == 0 || norms == 0) throw ArgumentError("class_feature_norms: null features or norms pointer");
  if (labels != 0 && (num_classes < 1 || class_sum == 0 || class_mean == 0 || counts == 0))
    throw ArgumentError("class_feature_norms: labels need num_classes >= 1 and the class outputs");
  if (logits != 0 && (labels == 0 || correct == 0))
    throw ArgumentError("class_feature_norms: logits need labels and a correct-count output");
  const Matrix f{reinterpret_cast<const void*>(features), f_stride0, f_stride1};
  const Matrix lg{reinterpret_cast<const void*>(logits), logit_stride0, logit_stride1};
  if (device >= 0) {
    return PFK_CUDA_CALL(cuda::class_feature_norms(
        device, stream, dtype, label_dtype == "int32", B, D, f.ptr, f_stride0, f_stride1,
        reinterpret_cast<const void*>(labels), label_stride, num_classes, lg.ptr, logit_stride0, logit_stride1,
        reinterpret_cast<void*>(norms), reinterpret_cast<void*>(class_sum), reinterpret_cast<void*>(class_mean),
        reinterpret_cast<int64_t*>(counts), reinterpret_cast<int64_t*>(correct), as_scratch(scratch, scratch_bytes)));
  }
  with_types(dtype, label_dtype, [&](auto t, auto l) {
    using T = decltype(t);
    using L = decltype(l);
    forward_cpu<T, L>(B, D, f, labels ? label_ptr<L>(labels) : nullptr, label_stride, num_classes, lg, num_classes,
                      reinterpret_cast<T*>(norms), reinterpret_cast<T*>(class_sum), reinterpret_cast<T*>(class_mean),
                      reinterpret_cast<int64_t*>(counts), reinterpret_cast<int64_t*>(correct));
  });
  return 0;
}

void class_feature_norms_backward(int device, uintptr_t stream, const std::string& dtype_name, int64_t B, int64_t D,
                                  uintptr_t features, int64_t f_stride0, int64_t f_stride1, uintptr_t labels,
                                  const std::string& label_dtype, int64_t label_stride, int64_t num_classes,
                                  uintptr_t grad_norms, uintptr_t class_coef, uintptr_t grad_features) {
  const DType dtype = dtype_from_name(dtype_name);
  if (B < 1 || D < 1) throw ArgumentError("class_feature_norms_backward: need B >= 1 and D >= 1");
  if (features == 0 || grad_features == 0) throw ArgumentError("class_feature_norms_backward: null pointer");
  if (class_coef != 0 && (labels == 0 || num_classes < 1))
    throw ArgumentError("class_feature_norms_backward: class_coef needs labels and num_classes >= 1");
  const Matrix f{reinterpret_cast<const void*>(features), f_stride0, f_stride1};
  if (device >= 0) {
    PFK_CUDA_CALL(cuda::class_feature_norms_backward(
        device, stream, dtype, label_dtype == "int32", B, D, f.ptr, f_stride0, f_stride1,
        reinterpret_cast<const void*>(labels), label_stride, num_classes, reinterpret_cast<const void*>(grad_norms),
        reinterpret_cast<const void*>(class_coef), reinterpret_cast<void*>(grad_features)));
    return;
  }
  with_types(dtype, label_dtype, [&](auto t, auto l) {
    using T = decltype(t);
    using L = decltype(l);
    using Acc = typename AccOf<T>::type;
    backward_cpu<T, L>(B, D, f, labels ? label_ptr<L>(labels) : nullptr, label_stride, num_classes,
                       reinterpret_cast<const Acc*>(grad_norms), reinterpret_cast<const Acc*>(class_coef),
                       reinterpret_cast<T*>(grad_features));
  });
}

}  // namespace

void bind_norms(py::module_& m) {
  m.def("class_feature_norms", &class_feature_norms, py::arg("device"), py::arg("stream"), py::arg("dtype"),
        py::arg("B"), py::arg("D"), py::arg("features"), py::arg("f_stride0"), py::arg("f_stride1"), py::arg("labels"),
        py::arg("label_dtype"), py::arg("label_stride"), py::arg("num_classes"), py::arg("logits"),
        py::arg("logit_stride0"), py::arg("logit_stride1"), py::arg("norms"), py::arg("class_sum"),
        py::arg("class_mean"), py::arg("counts"), py::arg("correct"), py::arg("scratch"), py::arg("scratch_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Row L2 norms of a [B, D] matrix; with labels, per-class sums/means/counts of the norms; with logits, the "
        "number of rows whose argmax equals the label. Null (0) pointers switch parts off.");
  m.def("class_feature_norms_backward", &class_feature_norms_backward, py::arg("device"), py::arg("stream"),
        py::arg("dtype"), py::arg("B"), py::arg("D"), py::arg("features"), py::arg("f_stride0"), py::arg("f_stride1"),
        py::arg("labels"), py::arg("label_dtype"), py::arg("label_stride"), py::arg("num_classes"),
        py::arg("grad_norms"), py::arg("class_coef"), py::arg("grad_features"),
        py::call_guard<py::gil_scoped_release>(),
        "grad_features[r] = (grad_norms[r] + class_coef[labels[r]]) * f[r] / ||f[r]|| (0 for zero rows); the "
        "coefficients are float32 (float64 for float64 features); grad_features is a contiguous [B, D] output.");
}

}  // namespace pfk
