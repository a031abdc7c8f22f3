// Aggregation kernels: out = (accumulate ? out : 0) + sum_k w_k * u_k over K vectors of d elements.
// One pass over memory: the columns are cut into tiles that stay in L1 while every row streams through once.
#include "aggregate.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <vector>

#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int64_t kTile = 4096;  // columns per tile: the float accumulator (16 KiB) stays in L1

template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void weighted_sum_tile_body(int64_t begin, int64_t end, T* out, int64_t out_stride,
                                              const std::vector<WeightedRow>& rows, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  Acc acc[kTile];
  if (accumulate) {
    for (int64_t j = 0; j < n; ++j) acc[j] = to_acc(out[(begin + j) * out_stride]);
  } else {
    for (int64_t j = 0; j < n; ++j) acc[j] = Acc(0);
  }
  auto row = [&](size_t k) {
    const int64_t s = Contiguous ? 1 : rows[k].stride;
    return static_cast<const T*>(rows[k].ptr) + begin * s;
  };
  auto stride = [&](size_t k) -> int64_t { return Contiguous ? 1 : rows[k].stride; };
  const size_t K = rows.size();
  size_t k = 0;
  // Eight, then four rows per sweep of the tile (fewer passes over the accumulator); the sum order (row 0, 1, 2, ...)
  // is the same for every element.
  for (; k + 8 <= K; k += 8) {
    const T* __restrict__ r0 = row(k);
    const T* __restrict__ r1 = row(k + 1);
    const T* __restrict__ r2 = row(k + 2);
    const T* __restrict__ r3 = row(k + 3);
    const T* __restrict__ r4 = row(k + 4);
    const T* __restrict__ r5 = row(k + 5);
    const T* __restrict__ r6 = row(k + 6);
    const T* __restrict__ r7 = row(k + 7);
    const int64_t s0 = stride(k), s1 = stride(k + 1), s2 = stride(k + 2), s3 = stride(k + 3);
    const int64_t s4 = stride(k + 4), s5 = stride(k + 5), s6 = stride(k + 6), s7 = stride(k + 7);
    const Acc w0 = Acc(rows[k].weight), w1 = Acc(rows[k + 1].weight), w2 = Acc(rows[k + 2].weight),
              w3 = Acc(rows[k + 3].weight), w4 = Acc(rows[k + 4].weight), w5 = Acc(rows[k + 5].weight),
              w6 = Acc(rows[k + 6].weight), w7 = Acc(rows[k + 7].weight);
    for (int64_t j = 0; j < n; ++j) {
      acc[j] = acc[j] + w0 * to_acc(r0[j * s0]) + w1 * to_acc(r1[j * s1]) + w2 * to_acc(r2[j * s2]) +
               w3 * to_acc(r3[j * s3]) + w4 * to_acc(r4[j * s4]) + w5 * to_acc(r5[j * s5]) + w6 * to_acc(r6[j * s6]) +
               w7 * to_acc(r7[j * s7]);
    }
  }
  for (; k + 4 <= K; k += 4) {
    const T* __restrict__ r0 = row(k);
    const T* __restrict__ r1 = row(k + 1);
    const T* __restrict__ r2 = row(k + 2);
    const T* __restrict__ r3 = row(k + 3);
    const int64_t s0 = stride(k), s1 = stride(k + 1), s2 = stride(k + 2), s3 = stride(k + 3);
    const Acc w0 = Acc(rows[k].weight), w1 = Acc(rows[k + 1].weight), w2 = Acc(rows[k + 2].weight),
              w3 = Acc(rows[k + 3].weight);
    for (int64_t j = 0; j < n; ++j) {
      acc[j] = acc[j] + w0 * to_acc(r0[j * s0]) + w1 * to_acc(r1[j * s1]) + w2 * to_acc(r2[j * s2]) +
               w3 * to_acc(r3[j * s3]);
    }
  }
  for (; k < K; ++k) {
    const T* __restrict__ r = row(k);
    const int64_t s = stride(k);
    const Acc w = Acc(rows[k].weight);
    for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + w * to_acc(r[j * s]);
  }
  for (int64_t j = 0; j < n; ++j) out[(begin + j) * out_stride] = Store<T>::from(acc[j]);
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, weighted_sum_tile,
                 (int64_t begin, int64_t end, T* out, int64_t out_stride, const std::vector<WeightedRow>& rows,
                  bool accumulate),
                 (begin, end, out, out_stride, rows, accumulate), weighted_sum_tile_body)

template <typename T>
void weighted_sum_cpu_typed(int64_t d, void* out, int64_t out_stride, const std::vector<WeightedRow>& rows,
                            bool accumulate) {
  bool contiguous = out_stride == 1;
  for (const auto& r : rows) contiguous = contiguous && r.stride == 1;
  T* o = static_cast<T*>(out);
  const int64_t work = (static_cast<int64_t>(rows.size()) + 1) * d;
  parallel_chunks(d, kTile, work, [&](int64_t, int64_t begin, int64_t end) {
    if (contiguous) {
      weighted_sum_tile<T, true>(begin, end, o, 1, rows, accumulate);
    } else {
      weighted_sum_tile<T, false>(begin, end, o, out_stride, rows, accumulate);
    }
  });
}

}  // namespace

void weighted_sum_cpu(DType dtype, int64_t d, void* out, int64_t out_stride, const std::vector<WeightedRow>& rows,
                      bool accumulate) {
  switch (dtype) {
    case DType::F32:
      return weighted_sum_cpu_typed<float>(d, out, out_stride, rows, accumulate);
    case DType::F64:
      return weighted_sum_cpu_typed<double>(d, out, out_stride, rows, accumulate);
    case DType::F16:
      return weighted_sum_cpu_typed<f16_t>(d, out, out_stride, rows, accumulate);
    case DType::BF16:
      return weighted_sum_cpu_typed<bf16_t>(d, out, out_stride, rows, accumulate);
  }
}

namespace {

// Entry point from Python: out and the rows (a list of pointers/strides, or a stack: see make_rows), with host
// weights (float64, one per row) or, on a GPU, device weights (a pointer to K accumulator-typed values). Returns 0,
// or the bytes of device scratch a CUDA call needs (see Scratch).
size_t weighted_sum(int device, uintptr_t stream, const std::string& dtype_name, int64_t d, uintptr_t out,
                    int64_t out_stride, const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides,
                    uintptr_t base, int64_t step_bytes, int64_t count, int64_t col_stride,
                    const py::array_t<double, py::array::c_style>& weights, uintptr_t device_weights, bool accumulate,
                    uintptr_t scratch, size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("weighted_sum: d must be >= 1");
  if (out == 0) throw ArgumentError("weighted_sum: out is a null pointer");
  const std::vector<RowRef> all = make_rows(ptrs, strides, base, step_bytes, count, col_stride);
  const double* w = weights.data();
  if (device_weights == 0 && static_cast<size_t>(weights.size()) != all.size())
    throw ArgumentError("weighted_sum: one weight per row is needed");
  if (device_weights != 0 && device < 0) throw ArgumentError("weighted_sum: device weights need a CUDA device");
  void* o = reinterpret_cast<void*>(out);
  if (device < 0) {
    std::vector<WeightedRow> rows;
    rows.reserve(all.size());
    for (size_t k = 0; k < all.size(); ++k)
      if (w[k] != 0.0) rows.push_back({all[k].ptr, all[k].stride, w[k]});  // a zero weight: the row is not read
    weighted_sum_cpu(dtype, d, o, out_stride, rows, accumulate);
    return 0;
  }
  cuda::WeightedSumCall call;
  call.d = d;
  call.out = o;
  call.out_stride = out_stride;
  call.accumulate = accumulate;
  if (device_weights != 0) call.device_weights = reinterpret_cast<const void*>(device_weights);
  const size_t zeros = device_weights != 0 ? 0 : static_cast<size_t>(std::count(w, w + all.size(), 0.0));
  if (ptrs.empty() && (device_weights != 0 || zeros == 0 || all.size() - zeros > 256)) {
    // a stack: no row table (zero host weights are skipped by the kernel when too many rows remain for a table)
    call.stack = {reinterpret_cast<const void*>(base), step_bytes, col_stride, count};
    if (device_weights == 0) call.weights.assign(w, w + all.size());
  } else if (device_weights != 0) {
    call.rows = all;
  } else {
    for (size_t k = 0; k < all.size(); ++k) {
      if (w[k] == 0.0) continue;  // dropped from the table: the row is not read
      call.rows.push_back(all[k]);
      call.weights.push_back(w[k]);
    }
  }
  return PFK_CUDA_CALL(cuda::weighted_sum(device, stream, dtype, call, as_scratch(scratch, scratch_bytes)));
}

}  // namespace

void bind_aggregate(py::module_& m) {
  m.def("weighted_sum", &weighted_sum, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("out"), py::arg("out_stride"), py::arg("ptrs"), py::arg("strides"), py::arg("base"),
        py::arg("step_bytes"), py::arg("count"), py::arg("col_stride"), py::arg("weights"), py::arg("device_weights"),
        py::arg("accumulate"), py::arg("scratch"), py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "out = (accumulate ? out : 0) + sum_k weights[k] * row_k; rows with weight 0 are skipped. Returns 0, or the "
        "device scratch bytes a CUDA call needs.");
}

}  // namespace pfk
