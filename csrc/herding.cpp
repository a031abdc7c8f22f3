// Herding kernels (BHerd, arXiv 2403.16557): the greedy ordering of Algorithm 2 on a precomputed Gram matrix of
// centred gradients, the masked row sum that forms a client's message, and GraB's online balancing (Algorithm 4).
//
// Greedy form: with z_m the centred gradients, s the centred running sum and G = Z Z^T, the next pick minimises
// ||s + z_m||^2 = ||s||^2 + 2 c_m + G_mm over the remaining m, where c_m = <s, z_m> is updated by c += G[j, :]
// after picking j. Each step costs O(tau). Ties go to the lowest index: a candidate ties with the minimum when its
// score is within rel_tol * (G_mm + 2 sqrt(G_mm * sum_{j picked} G_jj)) of it, the rounding-error scale of a score
// computed from a Gram matrix whose entries carry relative errors of order rel_tol (exact duplicates of a row then
// tie however the library's GEMM rounded them). rel_tol = 0 gives the plain first minimiser.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int64_t kTile = 4096;  // columns per tile of the row sums (a float accumulator of 16 KiB stays in L1)

// ---------------------------------------------------------------------------------------------------------------
// Greedy herding order on one client's Gram matrix.

void greedy_one(const double* gram, int64_t ld, int64_t tau, int64_t k, int64_t kmax, double rel_tol, int64_t* order,
                uint8_t* mask, double* sq_norm, std::vector<double>& c) {
  c.assign(static_cast<size_t>(tau), 0.0);
  std::fill(mask, mask + ld, uint8_t{0});
  double s2 = 0.0;      // ||s||^2 of the centred running sum
  double picked = 0.0;  // sum of G_jj over the picks so far (scale of the rounding error of c)
  for (int64_t step = 0; step < k; ++step) {
    double best = std::numeric_limits<double>::infinity();
    for (int64_t m = 0; m < tau; ++m) {
      if (!mask[m]) best = std::min(best, 2.0 * c[m] + gram[m * ld + m]);
    }
    int64_t j = -1;
    double score = 0.0;
    for (int64_t m = 0; m < tau && j < 0; ++m) {  // the lowest index within rounding of the minimum
      if (mask[m]) continue;
      const double gmm = gram[m * ld + m];
      const double v = 2.0 * c[m] + gmm;
      if (v <= best + tie_tolerance(rel_tol, gmm, picked)) {
        j = m;
        score = v;
      }
    }
    if (j < 0) {  // only NaN scores left: take the first remaining row
      for (j = 0; mask[j]; ++j) {
      }
      score = 2.0 * c[j] + gram[j * ld + j];
    }
    order[step] = j;
    mask[j] = 1;
    s2 += score;
    picked += gram[j * ld + j];
    const double* row = gram + j * ld;
    for (int64_t m = 0; m < tau; ++m) c[m] += row[m];
  }
  for (int64_t step = k; step < kmax; ++step) order[step] = -1;
  *sq_norm = s2;
}

size_t herding_greedy(int device, uintptr_t stream, uintptr_t gram, int64_t ld, const std::vector<int64_t>& taus,
                      const std::vector<int64_t>& ks, double rel_tol, uintptr_t order, int64_t kmax, uintptr_t mask,
                      uintptr_t sq_norm, uintptr_t scratch, size_t scratch_bytes) {
  const int64_t n = static_cast<int64_t>(taus.size());
  if (n < 1 || static_cast<int64_t>(ks.size()) != n) throw ArgumentError("herding_greedy: need one k per client");
  if (gram == 0 || order == 0 || mask == 0 || sq_norm == 0) throw ArgumentError("herding_greedy: null pointer");
  if (!(rel_tol >= 0.0 && rel_tol < 1.0)) throw ArgumentError("herding_greedy: rel_tol must be in [0, 1)");
  for (int64_t i = 0; i < n; ++i) {
    if (taus[i] < 1 || taus[i] > ld) throw ArgumentError("herding_greedy: tau out of range [1, ld]");
    if (ks[i] < 1 || ks[i] > taus[i] || ks[i] > kmax) throw ArgumentError("herding_greedy: k out of range [1, tau]");
  }
  const double* g = reinterpret_cast<const double*>(gram);
  int64_t* o = reinterpret_cast<int64_t*>(order);
  uint8_t* mk = reinterpret_cast<uint8_t*>(mask);
  double* sq = reinterpret_cast<double*>(sq_norm);
  if (device >= 0)
    return PFK_CUDA_CALL(cuda::herding_greedy(device, stream, g, ld, taus, ks, rel_tol, o, kmax, mk, sq,
                                              as_scratch(scratch, scratch_bytes)));
  int64_t work = 0;  // each of k steps scans and updates tau scores
  for (int64_t i = 0; i < n; ++i) work += 3 * ks[i] * taus[i];
  parallel_chunks(n, 1, work, [&](int64_t, int64_t begin, int64_t end) {
    std::vector<double> c;
    for (int64_t i = begin; i < end; ++i)
      greedy_one(g + i * ld * ld, ld, taus[i], ks[i], kmax, rel_tol, o + i * kmax, mk + i * ld, sq + i, c);
  });
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Masked row sum: out[n, :] = sum over rows r of client n with mask[n, r] != 0 of Y_n[r, :], rows in ascending order.

template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void masked_sum_tile_body(int64_t begin, int64_t end, const MatrixView& y, const uint8_t* mask,
                                            T* out, int64_t out_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  const int64_t cs = Contiguous ? 1 : y.col_stride;
  Acc acc[kTile];
  for (int64_t j = 0; j < n; ++j) acc[j] = Acc(0);
  const T* base = static_cast<const T*>(y.ptr);
  for (int64_t r = 0; r < y.rows; ++r) {
    if (!mask[r]) continue;
    const T* __restrict__ row = base + r * y.row_stride + begin * cs;
    for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + to_acc(row[j * cs]);
  }
  for (int64_t j = 0; j < n; ++j) out[(begin + j) * out_stride] = Store<T>::from(acc[j]);
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, masked_sum_tile,
                 (int64_t begin, int64_t end, const MatrixView& y, const uint8_t* mask, T* out, int64_t out_stride),
                 (begin, end, y, mask, out, out_stride), masked_sum_tile_body)

template <typename T>
void masked_sum_cpu_typed(int64_t d, const std::vector<MatrixView>& clients, const uint8_t* mask, int64_t mask_stride,
                          T* out, int64_t out_row_stride, int64_t out_col_stride) {
  const int64_t tiles = (d + kTile - 1) / kTile;
  const int64_t n = static_cast<int64_t>(clients.size());
  int64_t work = n * d;  // the outputs, and every client's rows
  for (const auto& y : clients) work += y.rows * d;
  parallel_chunks(n * tiles, 1, work, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / tiles;
      const int64_t lo = (job % tiles) * kTile;
      const int64_t hi = std::min(d, lo + kTile);
      const MatrixView& y = clients[static_cast<size_t>(i)];
      T* o = out + i * out_row_stride;
      if (y.col_stride == 1 && out_col_stride == 1) {
        masked_sum_tile<T, true>(lo, hi, y, mask + i * mask_stride, o, 1);
      } else {
        masked_sum_tile<T, false>(lo, hi, y, mask + i * mask_stride, o, out_col_stride);
      }
    }
  });
}

size_t herding_masked_sum(int device, uintptr_t stream, const std::string& dtype_name, int64_t d,
                          const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& taus,
                          const std::vector<int64_t>& row_strides, const std::vector<int64_t>& col_strides,
                          uintptr_t mask, int64_t mask_stride, uintptr_t out, int64_t out_row_stride,
                          int64_t out_col_stride, uintptr_t scratch, size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  const size_t n = ptrs.size();
  if (d < 1 || n < 1) throw ArgumentError("herding_masked_sum: need d >= 1 and at least one client");
  if (taus.size() != n || row_strides.size() != n || col_strides.size() != n)
    throw ArgumentError("herding_masked_sum: ptrs, taus and strides must have the same length");
  if (mask == 0 || out == 0) throw ArgumentError("herding_masked_sum: null pointer");
  std::vector<MatrixView> clients;
  clients.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ptrs[i] == 0 || taus[i] < 1 || taus[i] > mask_stride)
      throw ArgumentError("herding_masked_sum: bad client matrix");
    clients.push_back({reinterpret_cast<const void*>(ptrs[i]), taus[i], row_strides[i], col_strides[i]});
  }
  const uint8_t* mk = reinterpret_cast<const uint8_t*>(mask);
  void* o = reinterpret_cast<void*>(out);
  if (device >= 0)
    return PFK_CUDA_CALL(cuda::herding_masked_sum(device, stream, dtype, d, clients, mk, mask_stride, o, out_row_stride,
                                                  out_col_stride, as_scratch(scratch, scratch_bytes)));
  switch (dtype) {
    case DType::F32:
      masked_sum_cpu_typed(d, clients, mk, mask_stride, static_cast<float*>(o), out_row_stride, out_col_stride);
      break;
    case DType::F64:
      masked_sum_cpu_typed(d, clients, mk, mask_stride, static_cast<double*>(o), out_row_stride, out_col_stride);
      break;
    case DType::F16:
      masked_sum_cpu_typed(d, clients, mk, mask_stride, static_cast<f16_t*>(o), out_row_stride, out_col_stride);
      break;
    case DType::BF16:
      masked_sum_cpu_typed(d, clients, mk, mask_stride, static_cast<bf16_t*>(o), out_row_stride, out_col_stride);
      break;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// GraB online balancing. State (mean, s, g) is kept in the accumulation type: float for float32/16-bit gradients,
// double for float64. For each row y (step lam = first_step + r, 1-based):
//   mean += y / tau  (or mean += (y - mean) / lam with running_mean);  z = y - mean;
//   picked = <s, z> < 0;  s += picked ? z : -z;  g += picked ? y : 0.

template <typename T>
void grab_cpu_typed(const MatrixView& y, int64_t d, typename AccOf<T>::type* mean, typename AccOf<T>::type* s,
                    typename AccOf<T>::type* g, uint8_t* picked, int64_t first_step, int64_t tau, bool running_mean) {
  using Acc = typename AccOf<T>::type;
  const int64_t tiles = (d + kTile - 1) / kTile;
  std::vector<double> partial(static_cast<size_t>(tiles));
  const T* base = static_cast<const T*>(y.ptr);
  const int64_t cs = y.col_stride;
  for (int64_t r = 0; r < y.rows; ++r) {
    const T* row = base + r * y.row_stride;
    const Acc divisor = running_mean ? Acc(first_step + r) : Acc(tau);
    parallel_chunks(d, kTile, 3 * d, [&](int64_t tile, int64_t lo, int64_t hi) {
      double dot = 0.0;
      for (int64_t j = lo; j < hi; ++j) {
        const Acc v = to_acc(row[j * cs]);
        mean[j] = running_mean ? mean[j] + (v - mean[j]) / divisor : mean[j] + v / divisor;
        dot += static_cast<double>(s[j]) * static_cast<double>(v - mean[j]);
      }
      partial[static_cast<size_t>(tile)] = dot;
    });
    double dot = 0.0;
    for (double p : partial) dot += p;
    const bool pick = dot < 0.0;
    picked[r] = pick ? 1 : 0;
    parallel_chunks(d, kTile, 5 * d, [&](int64_t, int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        const Acc v = to_acc(row[j * cs]);
        const Acc z = v - mean[j];
        if (pick) {
          s[j] = s[j] + z;
          g[j] = g[j] + v;
        } else {
          s[j] = s[j] - z;
        }
      }
    });
  }
}

size_t grab_steps(int device, uintptr_t stream, const std::string& dtype_name, int64_t rows, int64_t d, uintptr_t y,
                  int64_t row_stride, int64_t col_stride, uintptr_t mean, uintptr_t s, uintptr_t g, uintptr_t picked,
                  int64_t first_step, int64_t tau, bool running_mean, uintptr_t scratch, size_t scratch_bytes) {
  const DType dtype = dtype_from_name(dtype_name);
  if (rows < 1 || d < 1) throw ArgumentError("grab_steps: need rows >= 1 and d >= 1");
  if (first_step < 1 || tau < 1) throw ArgumentError("grab_steps: first_step and tau must be >= 1");
  if (y == 0 || mean == 0 || s == 0 || g == 0 || picked == 0) throw ArgumentError("grab_steps: null pointer");
  const MatrixView view{reinterpret_cast<const void*>(y), rows, row_stride, col_stride};
  uint8_t* pk = reinterpret_cast<uint8_t*>(picked);
  void* mu = reinterpret_cast<void*>(mean);
  void* sp = reinterpret_cast<void*>(s);
  void* gp = reinterpret_cast<void*>(g);
  if (device >= 0)
    return PFK_CUDA_CALL(cuda::grab_steps(device, stream, dtype, view, d, mu, sp, gp, pk, first_step, tau, running_mean,
                                          as_scratch(scratch, scratch_bytes)));
  auto f = [](void* p) { return static_cast<float*>(p); };
  switch (dtype) {
    case DType::F32:
      grab_cpu_typed<float>(view, d, f(mu), f(sp), f(gp), pk, first_step, tau, running_mean);
      break;
    case DType::F64:
      grab_cpu_typed<double>(view, d, static_cast<double*>(mu), static_cast<double*>(sp), static_cast<double*>(gp), pk,
                             first_step, tau, running_mean);
      break;
    case DType::F16:
      grab_cpu_typed<f16_t>(view, d, f(mu), f(sp), f(gp), pk, first_step, tau, running_mean);
      break;
    case DType::BF16:
      grab_cpu_typed<bf16_t>(view, d, f(mu), f(sp), f(gp), pk, first_step, tau, running_mean);
      break;
  }
  return 0;
}

}  // namespace

void bind_herding(py::module_& m) {
  m.def("herding_greedy", &herding_greedy, py::arg("device"), py::arg("stream"), py::arg("gram"), py::arg("ld"),
        py::arg("taus"), py::arg("ks"), py::arg("rel_tol"), py::arg("order"), py::arg("kmax"), py::arg("mask"),
        py::arg("sq_norm"), py::arg("scratch"), py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "Greedy herding order on float64 Gram matrices [n, ld, ld]: order int64 [n, kmax] (-1 padded), "
        "mask uint8 [n, ld], sq_norm float64 [n] (squared norm of the centred selected sum).");
  m.def("herding_masked_sum", &herding_masked_sum, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("ptrs"), py::arg("taus"), py::arg("row_strides"), py::arg("col_strides"), py::arg("mask"),
        py::arg("mask_stride"), py::arg("out"), py::arg("out_row_stride"), py::arg("out_col_stride"),
        py::arg("scratch"), py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "out[n] = sum of the rows of client n whose mask byte is set, in ascending row order.");
  m.def("grab_steps", &grab_steps, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("rows"),
        py::arg("d"), py::arg("y"), py::arg("row_stride"), py::arg("col_stride"), py::arg("mean"), py::arg("s"),
        py::arg("g"), py::arg("picked"), py::arg("first_step"), py::arg("tau"), py::arg("running_mean"),
        py::arg("scratch"), py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "GraB balancing of `rows` gradients in order, updating mean/s/g (accumulation dtype) in place.");
}

}  // namespace pfk
