// FedPBC server kernels over a store of client models, each a pass over memory in column tiles:
//   pbc_agg_bcast:     v = mean of the active rows; server = v; every active row = v     ((2k+1)·d traffic)
//   weighted_delta:    x += Σ_r w_r·(Y_r − x)  (the caller folds η_g/D into w)           ((k+2)·d traffic)
//   mifa_update:       per active row: S += Δ_r − U_r, U_r = Δ_r; then x += c·S          ((3k+4)·d traffic)
// Every output element sums its rows in the order given, so results do not depend on the thread count.
#include <vector>

#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int64_t kTile = 2048;  // columns per tile: the accumulators stay in L1

template <typename T>
PFK_ALWAYS_INLINE T* row_at(const PbcRow& r, int64_t begin) {
  return static_cast<T*>(r.ptr) + begin * r.stride;
}

// ---- postponed broadcast ---------------------------------------------------------------------------------

template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void agg_bcast_tile_body(int64_t begin, int64_t end, const std::vector<PbcRow>& rows, T* server,
                                           int64_t server_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  Acc acc[kTile];
  T mean[kTile];
  for (int64_t j = 0; j < n; ++j) acc[j] = Acc(0);
  const size_t K = rows.size();
  size_t k = 0;
  for (; k + 4 <= K; k += 4) {  // four rows per sweep, summed in row order
    const T* __restrict__ r0 = row_at<T>(rows[k], begin);
    const T* __restrict__ r1 = row_at<T>(rows[k + 1], begin);
    const T* __restrict__ r2 = row_at<T>(rows[k + 2], begin);
    const T* __restrict__ r3 = row_at<T>(rows[k + 3], begin);
    const int64_t s0 = Contiguous ? 1 : rows[k].stride, s1 = Contiguous ? 1 : rows[k + 1].stride;
    const int64_t s2 = Contiguous ? 1 : rows[k + 2].stride, s3 = Contiguous ? 1 : rows[k + 3].stride;
    for (int64_t j = 0; j < n; ++j)
      acc[j] = acc[j] + to_acc(r0[j * s0]) + to_acc(r1[j * s1]) + to_acc(r2[j * s2]) + to_acc(r3[j * s3]);
  }
  for (; k < K; ++k) {
    const T* __restrict__ r = row_at<T>(rows[k], begin);
    const int64_t s = Contiguous ? 1 : rows[k].stride;
    for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + to_acc(r[j * s]);
  }
  const Acc inv_k = Acc(1) / Acc(static_cast<double>(K));
  for (int64_t j = 0; j < n; ++j) mean[j] = Store<T>::from(acc[j] * inv_k);
  T* __restrict__ o = server + begin * server_stride;
  for (int64_t j = 0; j < n; ++j) o[j * (Contiguous ? 1 : server_stride)] = mean[j];
  for (k = 0; k < K; ++k) {
    T* __restrict__ r = row_at<T>(rows[k], begin);
    const int64_t s = Contiguous ? 1 : rows[k].stride;
    for (int64_t j = 0; j < n; ++j) r[j * s] = mean[j];
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, agg_bcast_tile,
                 (int64_t begin, int64_t end, const std::vector<PbcRow>& rows, T* server, int64_t server_stride),
                 (begin, end, rows, server, server_stride), agg_bcast_tile_body)

// ---- weighted delta --------------------------------------------------------------------------------------

template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void weighted_delta_tile_body(int64_t begin, int64_t end, const std::vector<PbcRow>& rows,
                                                const std::vector<double>& weights, T* x, int64_t x_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  Acc base[kTile];
  Acc acc[kTile];
  T* __restrict__ xo = x + begin * x_stride;
  const int64_t xs = Contiguous ? 1 : x_stride;
  for (int64_t j = 0; j < n; ++j) {
    base[j] = to_acc(xo[j * xs]);
    acc[j] = Acc(0);
  }
  const size_t K = rows.size();
  size_t k = 0;
  for (; k + 4 <= K; k += 4) {  // four rows per sweep, summed in row order
    const T* __restrict__ r0 = row_at<T>(rows[k], begin);
    const T* __restrict__ r1 = row_at<T>(rows[k + 1], begin);
    const T* __restrict__ r2 = row_at<T>(rows[k + 2], begin);
    const T* __restrict__ r3 = row_at<T>(rows[k + 3], begin);
    const int64_t s0 = Contiguous ? 1 : rows[k].stride, s1 = Contiguous ? 1 : rows[k + 1].stride;
    const int64_t s2 = Contiguous ? 1 : rows[k + 2].stride, s3 = Contiguous ? 1 : rows[k + 3].stride;
    const Acc w0 = Acc(weights[k]), w1 = Acc(weights[k + 1]), w2 = Acc(weights[k + 2]), w3 = Acc(weights[k + 3]);
    for (int64_t j = 0; j < n; ++j) {
      const Acc b = base[j];
      acc[j] = acc[j] + w0 * (to_acc(r0[j * s0]) - b) + w1 * (to_acc(r1[j * s1]) - b) + w2 * (to_acc(r2[j * s2]) - b) +
               w3 * (to_acc(r3[j * s3]) - b);
    }
  }
  for (; k + 2 <= K; k += 2) {
    const T* __restrict__ r0 = row_at<T>(rows[k], begin);
    const T* __restrict__ r1 = row_at<T>(rows[k + 1], begin);
    const int64_t s0 = Contiguous ? 1 : rows[k].stride, s1 = Contiguous ? 1 : rows[k + 1].stride;
    const Acc w0 = Acc(weights[k]), w1 = Acc(weights[k + 1]);
    for (int64_t j = 0; j < n; ++j)
      acc[j] = acc[j] + w0 * (to_acc(r0[j * s0]) - base[j]) + w1 * (to_acc(r1[j * s1]) - base[j]);
  }
  for (; k < K; ++k) {
    const T* __restrict__ r = row_at<T>(rows[k], begin);
    const int64_t s = Contiguous ? 1 : rows[k].stride;
    const Acc w = Acc(weights[k]);
    for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + w * (to_acc(r[j * s]) - base[j]);
  }
  for (int64_t j = 0; j < n; ++j) xo[j * xs] = Store<T>::from(base[j] + acc[j]);
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, weighted_delta_tile,
                 (int64_t begin, int64_t end, const std::vector<PbcRow>& rows, const std::vector<double>& weights, T* x,
                  int64_t x_stride),
                 (begin, end, rows, weights, x, x_stride), weighted_delta_tile_body)

// ---- MIFA ------------------------------------------------------------------------------------------------

template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void mifa_tile_body(int64_t begin, int64_t end, const MifaArgs& a) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  Acc xv[kTile];
  Acc sv[kTile];
  T* __restrict__ xo = row_at<T>(a.x, begin);
  T* __restrict__ so = row_at<T>(a.total, begin);
  const int64_t xs = Contiguous ? 1 : a.x.stride, ss = Contiguous ? 1 : a.total.stride;
  for (int64_t j = 0; j < n; ++j) {
    xv[j] = to_acc(xo[j * xs]);
    sv[j] = to_acc(so[j * ss]);
  }
  const bool sub = a.subtract_x;  // Δ = update − x, else Δ = update
  const size_t K = a.updates.size();
  size_t k = 0;
  for (; k + 2 <= K; k += 2) {  // two rows per sweep, in row order
    const T* __restrict__ u0 = row_at<T>(a.updates[k], begin);
    const T* __restrict__ u1 = row_at<T>(a.updates[k + 1], begin);
    T* __restrict__ m0 = row_at<T>(a.memory[k], begin);
    T* __restrict__ m1 = row_at<T>(a.memory[k + 1], begin);
    const int64_t us0 = Contiguous ? 1 : a.updates[k].stride, ms0 = Contiguous ? 1 : a.memory[k].stride;
    const int64_t us1 = Contiguous ? 1 : a.updates[k + 1].stride, ms1 = Contiguous ? 1 : a.memory[k + 1].stride;
    for (int64_t j = 0; j < n; ++j) {
      const T stored0 = Store<T>::from(sub ? to_acc(u0[j * us0]) - xv[j] : to_acc(u0[j * us0]));
      const T stored1 = Store<T>::from(sub ? to_acc(u1[j * us1]) - xv[j] : to_acc(u1[j * us1]));
      sv[j] = sv[j] + (to_acc(stored0) - to_acc(m0[j * ms0])) + (to_acc(stored1) - to_acc(m1[j * ms1]));
      m0[j * ms0] = stored0;
      m1[j * ms1] = stored1;
    }
  }
  for (; k < K; ++k) {
    const T* __restrict__ u = row_at<T>(a.updates[k], begin);
    T* __restrict__ mem = row_at<T>(a.memory[k], begin);
    const int64_t us = Contiguous ? 1 : a.updates[k].stride, ms = Contiguous ? 1 : a.memory[k].stride;
    for (int64_t j = 0; j < n; ++j) {
      const T stored = Store<T>::from(sub ? to_acc(u[j * us]) - xv[j] : to_acc(u[j * us]));
      sv[j] = sv[j] + (to_acc(stored) - to_acc(mem[j * ms]));
      mem[j * ms] = stored;
    }
  }
  if (!a.all_memory.empty()) {  // re-sum S from every memory row (after this round's writes) against drift
    for (int64_t j = 0; j < n; ++j) sv[j] = Acc(0);
    for (const auto& r : a.all_memory) {
      const T* __restrict__ mem = row_at<T>(r, begin);
      const int64_t ms = Contiguous ? 1 : r.stride;
      for (int64_t j = 0; j < n; ++j) sv[j] = sv[j] + to_acc(mem[j * ms]);
    }
  }
  const Acc c = Acc(a.coef);
  for (int64_t j = 0; j < n; ++j) {
    const T stored = Store<T>::from(sv[j]);
    so[j * ss] = stored;
    xo[j * xs] = Store<T>::from(xv[j] + c * to_acc(stored));
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, mifa_tile,
                 (int64_t begin, int64_t end, const MifaArgs& a), (begin, end, a), mifa_tile_body)

// ---- CPU drivers -----------------------------------------------------------------------------------------

bool all_unit(const std::vector<PbcRow>& rows, int64_t other_stride) {
  bool unit = other_stride == 1;
  for (const auto& r : rows) unit = unit && r.stride == 1;
  return unit;
}

template <typename T>
void agg_bcast_cpu(int64_t d, const std::vector<PbcRow>& rows, void* server, int64_t server_stride) {
  const bool contiguous = all_unit(rows, server_stride);
  T* s = static_cast<T*>(server);
  parallel_chunks(d, kTile, (2 * static_cast<int64_t>(rows.size()) + 1) * d, [&](int64_t, int64_t begin, int64_t end) {
    if (contiguous) {
      agg_bcast_tile<T, true>(begin, end, rows, s, 1);
    } else {
      agg_bcast_tile<T, false>(begin, end, rows, s, server_stride);
    }
  });
}

template <typename T>
void weighted_delta_cpu(int64_t d, const std::vector<PbcRow>& rows, const std::vector<double>& weights, void* x,
                        int64_t x_stride) {
  const bool contiguous = all_unit(rows, x_stride);
  T* xp = static_cast<T*>(x);
  parallel_chunks(d, kTile, (static_cast<int64_t>(rows.size()) + 2) * d, [&](int64_t, int64_t begin, int64_t end) {
    if (contiguous) {
      weighted_delta_tile<T, true>(begin, end, rows, weights, xp, 1);
    } else {
      weighted_delta_tile<T, false>(begin, end, rows, weights, xp, x_stride);
    }
  });
}

template <typename T>
void mifa_cpu(int64_t d, const MifaArgs& a) {
  bool contiguous = a.x.stride == 1 && all_unit(a.updates, a.total.stride);
  contiguous = contiguous && all_unit(a.memory, 1) && all_unit(a.all_memory, 1);
  const int64_t rows = static_cast<int64_t>(a.updates.size() + a.memory.size() + a.all_memory.size());
  parallel_chunks(d, kTile, (rows + 3) * d, [&](int64_t, int64_t begin, int64_t end) {
    if (contiguous) {
      mifa_tile<T, true>(begin, end, a);
    } else {
      mifa_tile<T, false>(begin, end, a);
    }
  });
}

template <template <typename> class Fn, typename... Args>
void by_dtype(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::F32:
      return Fn<float>::run(args...);
    case DType::F64:
      return Fn<double>::run(args...);
    case DType::F16:
      return Fn<f16_t>::run(args...);
    case DType::BF16:
      return Fn<bf16_t>::run(args...);
  }
}

template <typename T>
struct AggBcastCpu {
  static void run(int64_t d, const std::vector<PbcRow>& rows, void* s, int64_t ss) { agg_bcast_cpu<T>(d, rows, s, ss); }
};
template <typename T>
struct WeightedDeltaCpu {
  static void run(int64_t d, const std::vector<PbcRow>& rows, const std::vector<double>& w, void* x, int64_t xs) {
    weighted_delta_cpu<T>(d, rows, w, x, xs);
  }
};
template <typename T>
struct MifaCpu {
  static void run(int64_t d, const MifaArgs& a) { mifa_cpu<T>(d, a); }
};

// ---- entry points from Python ----------------------------------------------------------------------------

std::vector<PbcRow> make_rows(const char* op, const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides) {
  if (ptrs.size() != strides.size()) throw ArgumentError(std::string(op) + ": ptrs and strides differ in length");
  std::vector<PbcRow> rows;
  rows.reserve(ptrs.size());
  for (size_t k = 0; k < ptrs.size(); ++k) {
    if (ptrs[k] == 0) throw ArgumentError(std::string(op) + ": row pointer is null");
    rows.push_back({reinterpret_cast<void*>(ptrs[k]), strides[k]});
  }
  return rows;
}

void check_common(const char* op, int64_t d, uintptr_t out) {
  if (d < 1) throw ArgumentError(std::string(op) + ": d must be >= 1");
  if (out == 0) throw ArgumentError(std::string(op) + ": output pointer is null");
}

size_t pbc_agg_bcast(int device, uintptr_t stream, const std::string& dtype_name, int64_t d, uintptr_t server,
                     int64_t server_stride, const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides,
                     uintptr_t scratch, size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  check_common("pbc_agg_bcast", d, server);
  const std::vector<PbcRow> rows = make_rows("pbc_agg_bcast", ptrs, strides);
  if (rows.empty()) return 0;  // no active client: nothing changes
  void* s = reinterpret_cast<void*>(server);
  if (device >= 0)
    return PFK_CUDA_CALL(
        cuda::pbc_agg_bcast(device, stream, dtype, d, rows, s, server_stride, as_scratch(scratch, scratch_bytes)));
  by_dtype<AggBcastCpu>(dtype, d, rows, s, server_stride);
  return 0;
}

size_t weighted_delta(int device, uintptr_t stream, const std::string& dtype_name, int64_t d, uintptr_t x,
                      int64_t x_stride, const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides,
                      const std::vector<double>& weights, uintptr_t scratch, size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  check_common("weighted_delta", d, x);
  if (weights.size() != ptrs.size()) throw ArgumentError("weighted_delta: weights and rows differ in length");
  std::vector<uintptr_t> kept_ptrs;
  std::vector<int64_t> kept_strides;
  std::vector<double> kept_weights;
  for (size_t k = 0; k < ptrs.size(); ++k) {
    if (weights[k] == 0.0) continue;  // a zero weight means the row is not read
    kept_ptrs.push_back(ptrs[k]);
    kept_strides.push_back(strides[k]);
    kept_weights.push_back(weights[k]);
  }
  const std::vector<PbcRow> rows = make_rows("weighted_delta", kept_ptrs, kept_strides);
  if (rows.empty()) return 0;
  void* xp = reinterpret_cast<void*>(x);
  if (device >= 0)
    return PFK_CUDA_CALL(cuda::weighted_delta(device, stream, dtype, d, rows, kept_weights, xp, x_stride,
                                              as_scratch(scratch, scratch_bytes)));
  by_dtype<WeightedDeltaCpu>(dtype, d, rows, kept_weights, xp, x_stride);
  return 0;
}

size_t mifa_update(int device, uintptr_t stream, const std::string& dtype_name, int64_t d, uintptr_t x,
                   int64_t x_stride, uintptr_t total, int64_t total_stride, const std::vector<uintptr_t>& update_ptrs,
                   const std::vector<int64_t>& update_strides, const std::vector<uintptr_t>& memory_ptrs,
                   const std::vector<int64_t>& memory_strides, const std::vector<uintptr_t>& all_memory_ptrs,
                   const std::vector<int64_t>& all_memory_strides, double coef, bool subtract_x, uintptr_t scratch,
                   size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  check_common("mifa_update", d, x);
  if (total == 0) throw ArgumentError("mifa_update: total is a null pointer");
  MifaArgs a;
  a.x = {reinterpret_cast<void*>(x), x_stride};
  a.total = {reinterpret_cast<void*>(total), total_stride};
  a.updates = make_rows("mifa_update", update_ptrs, update_strides);
  a.memory = make_rows("mifa_update", memory_ptrs, memory_strides);
  a.all_memory = make_rows("mifa_update", all_memory_ptrs, all_memory_strides);
  if (a.updates.size() != a.memory.size()) throw ArgumentError("mifa_update: updates and memory rows differ in count");
  a.coef = coef;
  a.subtract_x = subtract_x;
  if (device >= 0)
    return PFK_CUDA_CALL(cuda::mifa_update(device, stream, dtype, d, a, as_scratch(scratch, scratch_bytes)));
  by_dtype<MifaCpu>(dtype, d, a);
  return 0;
}

}  // namespace

void bind_pbc(py::module_& m) {
  m.def("pbc_agg_bcast", &pbc_agg_bcast, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("server"), py::arg("server_stride"), py::arg("ptrs"), py::arg("strides"), py::arg("scratch"),
        py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "server = mean of the rows; every row = server (no rows: no-op).");
  m.def("weighted_delta", &weighted_delta, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("x"), py::arg("x_stride"), py::arg("ptrs"), py::arg("strides"), py::arg("weights"), py::arg("scratch"),
        py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "x += sum_r weights[r] * (row_r - x); zero-weight rows skipped.");
  m.def("mifa_update", &mifa_update, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"), py::arg("x"),
        py::arg("x_stride"), py::arg("total"), py::arg("total_stride"), py::arg("update_ptrs"),
        py::arg("update_strides"), py::arg("memory_ptrs"), py::arg("memory_strides"), py::arg("all_memory_ptrs"),
        py::arg("all_memory_strides"), py::arg("coef"), py::arg("subtract_x"), py::arg("scratch"),
        py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "MIFA: per row, S += delta - U, U = delta (delta = update - x if subtract_x); optional re-sum; x += coef*S.");
}

}  // namespace pfk
