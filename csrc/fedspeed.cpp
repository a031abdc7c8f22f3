// FedSpeed local-step kernels over flat [d] buffers (one call per step for the whole model):
//   perturb:    out = x + s * g, s = rho / (||g|| + eps)            (norm pass + one fused pass)
//   update:     x -= lr * (k * ((1 - alpha) g1 + alpha g2 + c D) + (c + wd) x), k = 1 or the clip factor
//   round end:  h += x_K - x^t; acc += w (x_K + h); h_sum += x_K - x^t
// Norms are sums of squares in double over fixed chunks, added in chunk order: the result does not depend on the
// number of threads. The row forms (rows > 1, one client per row) give each row exactly the 1-D result: rows of at
// least one chunk run one after another, each parallel over its chunks; shorter rows run in parallel, a block of
// rows per thread task.
#include "fedspeed.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int64_t kChunk = 16384;  // elements per parallel chunk (and per partial sum of a norm)
constexpr int kLanes = 8;          // independent partial sums inside a chunk (vectorisable)

// v_i = a1 * g1_i + a2 * g2_i + c * D_i, with g1 and D present only when the template flags say so.
template <typename T>
struct Combo {
  using Acc = typename AccOf<T>::type;
  const T* g1;
  int64_t s1;
  const T* g2;
  int64_t s2;
  const T* anchor;
  int64_t sa;
  Acc a1, a2, c;
};

template <typename T, bool Contig, bool HasG1, bool HasD>
PFK_ALWAYS_INLINE typename AccOf<T>::type combo_at(const Combo<T>& k, int64_t i) {
  using Acc = typename AccOf<T>::type;
  Acc v = k.a2 * to_acc(k.g2[Contig ? i : i * k.s2]);
  if constexpr (HasG1) v = k.a1 * to_acc(k.g1[Contig ? i : i * k.s1]) + v;
  if constexpr (HasD) v = v + k.c * to_acc(k.anchor[Contig ? i : i * k.sa]);
  return v;
}

template <typename T, bool Contig, bool HasG1, bool HasD>
PFK_ALWAYS_INLINE double sumsq_body(int64_t begin, int64_t end, const Combo<T>& k) {
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = static_cast<double>(combo_at<T, Contig, HasG1, HasD>(k, i + l));
      lanes[l] += v * v;
    }
  }
  for (; i < end; ++i) {
    const double v = static_cast<double>(combo_at<T, Contig, HasG1, HasD>(k, i));
    lanes[0] += v * v;
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contig PFK_COMMA bool HasG1 PFK_COMMA bool HasD>,
                 <T PFK_COMMA Contig PFK_COMMA HasG1 PFK_COMMA HasD>, double, sumsq_chunk,
                 (int64_t begin, int64_t end, const Combo<T>& k), (begin, end, k), sumsq_body)

template <typename T, bool Contig, bool HasG1, bool HasD>
PFK_ALWAYS_INLINE void update_body(int64_t begin, int64_t end, T* x, int64_t sx, const Combo<T>& k,
                                   typename AccOf<T>::type scale, typename AccOf<T>::type x_coef,
                                   typename AccOf<T>::type lr) {
  using Acc = typename AccOf<T>::type;
  for (int64_t i = begin; i < end; ++i) {
    T& xi = x[Contig ? i : i * sx];
    const Acc xv = to_acc(xi);
    const Acc v = combo_at<T, Contig, HasG1, HasD>(k, i);
    xi = Store<T>::from(xv - lr * (scale * v + x_coef * xv));
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contig PFK_COMMA bool HasG1 PFK_COMMA bool HasD>,
                 <T PFK_COMMA Contig PFK_COMMA HasG1 PFK_COMMA HasD>, void, update_chunk,
                 (int64_t begin, int64_t end, T* x, int64_t sx, const Combo<T>& k, typename AccOf<T>::type scale,
                  typename AccOf<T>::type x_coef, typename AccOf<T>::type lr),
                 (begin, end, x, sx, k, scale, x_coef, lr), update_body)

template <typename T, bool Contig>
PFK_ALWAYS_INLINE void perturb_body(int64_t begin, int64_t end, const T* x, int64_t sx, const T* g, int64_t sg, T* out,
                                    int64_t so, typename AccOf<T>::type s) {
  for (int64_t i = begin; i < end; ++i) {
    const auto xv = to_acc(x[Contig ? i : i * sx]);
    out[Contig ? i : i * so] = Store<T>::from(xv + s * to_acc(g[Contig ? i : i * sg]));
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contig>, <T PFK_COMMA Contig>, void, perturb_chunk,
                 (int64_t begin, int64_t end, const T* x, int64_t sx, const T* g, int64_t sg, T* out, int64_t so,
                  typename AccOf<T>::type s),
                 (begin, end, x, sx, g, sg, out, so, s), perturb_body)

template <typename T>
Combo<T> make_combo(const StridedVec& g1, const StridedVec& g2, const StridedVec& anchor, double a1, double a2,
                    double c) {
  using Acc = typename AccOf<T>::type;
  return {static_cast<const T*>(g1.ptr),
          g1.stride,
          static_cast<const T*>(g2.ptr),
          g2.stride,
          static_cast<const T*>(anchor.ptr),
          anchor.stride,
          static_cast<Acc>(a1),
          static_cast<Acc>(a2),
          static_cast<Acc>(c)};
}

// fn(chunk_index, begin, end) over the chunks of [0, d): in parallel (for `work` above the pool's grain), or in
// order on this thread.
template <typename Fn>
void for_chunks(int64_t d, bool parallel, int64_t work, Fn&& fn) {
  if (parallel) return parallel_chunks(d, kChunk, work, fn);
  for (int64_t c = 0, begin = 0; begin < d; ++c, begin += kChunk) fn(c, begin, std::min(d, begin + kChunk));
}

// ||v|| over [0, d): chunk partial sums added in chunk order.
template <typename T, bool Contig, bool HasG1, bool HasD>
double combo_norm(int64_t d, const Combo<T>& k, bool parallel) {
  std::vector<double> partial(static_cast<size_t>((d + kChunk - 1) / kChunk));
  for_chunks(d, parallel, (1 + HasG1 + HasD) * d, [&](int64_t c, int64_t begin, int64_t end) {
    partial[static_cast<size_t>(c)] = sumsq_chunk<T, Contig, HasG1, HasD>(begin, end, k);
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return std::sqrt(total);
}

template <typename T>
void* row_ptr(void* ptr, int64_t offset) {
  return ptr == nullptr ? nullptr : static_cast<void*>(static_cast<T*>(ptr) + offset);
}

template <typename T>
StridedVec row_of(const StridedVec& v, int64_t r) {
  return {row_ptr<T>(v.ptr, r * v.row_stride), v.stride, 0};
}

// Row r of a row-form call as a 1-D call.
template <typename T>
PerturbArgs row_of(const PerturbArgs& a, int64_t r) {
  PerturbArgs row = a;
  row.rows = 1;
  row.x = row_of<T>(a.x, r);
  row.g = row_of<T>(a.g, r);
  row.out = row_of<T>(a.out, r);
  row.norm_out = row_ptr<typename AccOf<T>::type>(a.norm_out, r * a.norm_stride);
  return row;
}

template <typename T>
UpdateArgs row_of(const UpdateArgs& a, int64_t r) {
  UpdateArgs row = a;
  row.rows = 1;
  row.x = row_of<T>(a.x, r);
  row.g1 = row_of<T>(a.g1, r);
  row.g2 = row_of<T>(a.g2, r);
  row.anchor = row_of<T>(a.anchor, r);
  row.norm_out = row_ptr<typename AccOf<T>::type>(a.norm_out, r * a.norm_stride);
  return row;
}

// fn(row_args, parallel) for every row: rows of a chunk or more one after another (each parallel inside), shorter
// rows in parallel blocks of about a chunk's elements. The split depends on d only, not on the thread count.
template <typename T, typename Args, typename Fn>
void for_rows(const Args& a, Fn&& fn) {
  if (a.rows == 1) return fn(a, true);
  if (a.d >= kChunk) {
    for (int64_t r = 0; r < a.rows; ++r) fn(row_of<T>(a, r), true);
    return;
  }
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / a.d);
  parallel_chunks(a.rows, rows_per_chunk, 4 * a.rows * a.d, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(row_of<T>(a, r), false);
  });
}

template <typename T>
void store_norm(void* norm_out, double norm) {
  if (norm_out != nullptr)
    *static_cast<typename AccOf<T>::type*>(norm_out) = static_cast<typename AccOf<T>::type>(norm);
}

template <typename T>
void perturb_row(const PerturbArgs& a, bool parallel) {
  using Acc = typename AccOf<T>::type;
  const bool contig = a.x.stride == 1 && a.g.stride == 1 && a.out.stride == 1;
  double s = a.rho;
  if (a.normalize) {
    const Combo<T> k = make_combo<T>({}, a.g, {}, 0.0, 1.0, 0.0);
    const double norm = contig ? combo_norm<T, true, false, false>(a.d, k, parallel)
                               : combo_norm<T, false, false, false>(a.d, k, parallel);
    store_norm<T>(a.norm_out, norm);
    const double denom = norm + a.eps;
    s = denom > 0.0 ? a.rho / denom : 0.0;  // zero gradient with eps = 0: no perturbation
  }
  const T* x = static_cast<const T*>(a.x.ptr);
  const T* g = static_cast<const T*>(a.g.ptr);
  T* out = static_cast<T*>(a.out.ptr);
  const Acc sa = static_cast<Acc>(s);
  for_chunks(a.d, parallel, 3 * a.d, [&](int64_t, int64_t begin, int64_t end) {
    if (contig) {
      perturb_chunk<T, true>(begin, end, x, 1, g, 1, out, 1, sa);
    } else {
      perturb_chunk<T, false>(begin, end, x, a.x.stride, g, a.g.stride, out, a.out.stride, sa);
    }
  });
}

template <typename T>
void perturb_cpu(const PerturbArgs& a) {
  for_rows<T>(a, [](const PerturbArgs& row, bool parallel) { perturb_row<T>(row, parallel); });
}

template <typename T, bool Contig, bool HasG1, bool HasD>
void update_cpu_flags(const UpdateArgs& a, bool parallel) {
  using Acc = typename AccOf<T>::type;
  const Combo<T> k = make_combo<T>(a.g1, a.g2, a.anchor, a.a1, a.a2, a.c);
  double scale = 1.0;
  if (a.clip_norm > 0.0) {
    const double norm = combo_norm<T, Contig, HasG1, HasD>(a.d, k, parallel);
    store_norm<T>(a.norm_out, norm);
    scale = std::fmin(1.0, a.clip_norm / (norm + 1e-6));
  }
  T* x = static_cast<T*>(a.x.ptr);
  const Acc sc = static_cast<Acc>(scale), xc = static_cast<Acc>(a.x_coef), lr = static_cast<Acc>(a.lr);
  for_chunks(a.d, parallel, (3 + HasG1 + HasD) * a.d, [&](int64_t, int64_t begin, int64_t end) {
    update_chunk<T, Contig, HasG1, HasD>(begin, end, x, a.x.stride, k, sc, xc, lr);
  });
}

template <typename T, bool Contig>
void update_cpu_contig(const UpdateArgs& a, bool parallel) {
  const bool g1 = a.g1.ptr != nullptr, anchor = a.anchor.ptr != nullptr;
  if (g1 && anchor) return update_cpu_flags<T, Contig, true, true>(a, parallel);
  if (g1) return update_cpu_flags<T, Contig, true, false>(a, parallel);
  if (anchor) return update_cpu_flags<T, Contig, false, true>(a, parallel);
  return update_cpu_flags<T, Contig, false, false>(a, parallel);
}

template <typename T>
void update_cpu(const UpdateArgs& a) {
  bool contig = a.x.stride == 1 && a.g2.stride == 1;
  if (a.g1.ptr) contig = contig && a.g1.stride == 1;
  if (a.anchor.ptr) contig = contig && a.anchor.stride == 1;
  for_rows<T>(a, [contig](const UpdateArgs& row, bool parallel) {
    if (contig) return update_cpu_contig<T, true>(row, parallel);
    return update_cpu_contig<T, false>(row, parallel);
  });
}

template <typename T, bool HasAcc, bool IncludeH, bool HasHsum>
void round_end_cpu_flags(const RoundEndArgs& a) {
  using Acc = typename AccOf<T>::type;
  T* h = static_cast<T*>(a.h.ptr);
  const T* xk = static_cast<const T*>(a.x_local.ptr);
  const T* xt = static_cast<const T*>(a.x_global.ptr);
  T* acc = static_cast<T*>(a.acc.ptr);
  T* hs = static_cast<T*>(a.h_sum.ptr);
  const Acc w = static_cast<Acc>(a.weight);
  const int64_t sh = a.h.stride, sk = a.x_local.stride, st = a.x_global.stride, sa = a.acc.stride, ss = a.h_sum.stride;
  // Each element chunk takes the rows in order, so acc and h_sum add the rows' terms in row order.
  const int64_t work = (4 + 2 * HasAcc + 2 * HasHsum) * a.d * a.rows;
  parallel_chunks(a.d, kChunk, work, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t r = 0; r < a.rows; ++r) {
      T* hr = h + r * a.h.row_stride;
      const T* xkr = xk + r * a.x_local.row_stride;
      const T* xtr = xt + r * a.x_global.row_stride;
      for (int64_t i = begin; i < end; ++i) {
        const Acc xl = to_acc(xkr[i * sk]);
        const Acc delta = xl - to_acc(xtr[i * st]);
        const Acc hn = to_acc(hr[i * sh]) + delta;
        hr[i * sh] = Store<T>::from(hn);
        if constexpr (HasAcc) {
          const Acc upload = IncludeH ? xl + hn : xl;
          acc[i * sa] = Store<T>::from(to_acc(acc[i * sa]) + w * upload);
        }
        if constexpr (HasHsum) hs[i * ss] = Store<T>::from(to_acc(hs[i * ss]) + delta);
      }
    }
  });
}

template <typename T>
void round_end_cpu(const RoundEndArgs& a) {
  const bool acc = a.acc.ptr != nullptr, hs = a.h_sum.ptr != nullptr;
  if (acc && a.include_h)
    return hs ? round_end_cpu_flags<T, true, true, true>(a) : round_end_cpu_flags<T, true, true, false>(a);
  if (acc) return hs ? round_end_cpu_flags<T, true, false, true>(a) : round_end_cpu_flags<T, true, false, false>(a);
  return hs ? round_end_cpu_flags<T, false, false, true>(a) : round_end_cpu_flags<T, false, false, false>(a);
}

template <template <typename> class Fn, typename Args>
void by_dtype(DType dtype, const Args& a) {
  switch (dtype) {
    case DType::F32:
      return Fn<float>::run(a);
    case DType::F64:
      return Fn<double>::run(a);
    case DType::F16:
      return Fn<f16_t>::run(a);
    case DType::BF16:
      return Fn<bf16_t>::run(a);
  }
}

template <typename T>
struct PerturbFn {
  static void run(const PerturbArgs& a) { perturb_cpu<T>(a); }
};
template <typename T>
struct UpdateFn {
  static void run(const UpdateArgs& a) { update_cpu<T>(a); }
};
template <typename T>
struct RoundEndFn {
  static void run(const RoundEndArgs& a) { round_end_cpu<T>(a); }
};

StridedVec vec(uintptr_t ptr, int64_t row_stride, int64_t stride) {
  return {reinterpret_cast<void*>(ptr), stride, row_stride};
}

void require(bool ok, const char* what) {
  if (!ok) throw ArgumentError(what);
}

// Each op has one entry point for a [d] vector (vector = true: rows = 1, row strides 0) and for [rows, d] matrices
// (one client per row). Both forms share the CPU kernels; on CUDA a vector keeps its own single-vector launcher,
// whose norm uses fedspeed_workspace_size() partial sums.
void check_workspace(int device, uintptr_t workspace, int64_t workspace_len, bool needed, bool vector, int64_t rows,
                     int64_t d) {
  if (device < 0 || !needed) return;
  if (vector)
    require(workspace != 0 && workspace_len >= kFedSpeedMaxPartials,
            "fedspeed: a CUDA norm needs a workspace of fedspeed_workspace_size() accumulator elements");
  else
    require(workspace != 0 && workspace_len >= rows * fedspeed_row_partials(d),
            "fedspeed rows: a CUDA norm needs a workspace of fedspeed_row_workspace_size(d, rows) elements");
}

void fedspeed_perturb(int device, uintptr_t stream, const std::string& dtype_name, bool vector, int64_t rows, int64_t d,
                      uintptr_t x, int64_t xr, int64_t xs, uintptr_t g, int64_t gr, int64_t gs, uintptr_t out,
                      int64_t outr, int64_t outs, double rho, double eps, bool normalize, uintptr_t norm_out,
                      int64_t norm_stride, uintptr_t workspace, int64_t workspace_len) {
  const DType dtype = dtype_from_name(dtype_name);
  require(rows >= 1 && d >= 1 && (!vector || rows == 1), "fedspeed_perturb: rows and d must be >= 1");
  require(x != 0 && g != 0 && out != 0, "fedspeed_perturb: null pointer");
  require(std::isfinite(rho) && std::isfinite(eps) && eps >= 0.0, "fedspeed_perturb: rho and eps must be finite");
  check_workspace(device, workspace, workspace_len, normalize, vector, rows, d);
  PerturbArgs a;
  a.d = d;
  a.rows = rows;
  a.x = vec(x, xr, xs);
  a.g = vec(g, gr, gs);
  a.out = vec(out, outr, outs);
  a.rho = rho;
  a.eps = eps;
  a.normalize = normalize;
  a.norm_out = reinterpret_cast<void*>(norm_out);
  a.norm_stride = norm_stride;
  a.workspace = reinterpret_cast<void*>(workspace);
  a.workspace_len = workspace_len;
  if (device < 0) {
    by_dtype<PerturbFn>(dtype, a);
  } else if (vector) {
    PFK_CUDA_CALL(cuda::fedspeed_perturb(device, stream, dtype, a));
  } else {
    PFK_CUDA_CALL(cuda::fedspeed_perturb_rows(device, stream, dtype, a));
  }
}

void fedspeed_update(int device, uintptr_t stream, const std::string& dtype_name, bool vector, int64_t rows, int64_t d,
                     uintptr_t x, int64_t xr, int64_t xs, uintptr_t g1, int64_t g1r, int64_t g1s, uintptr_t g2,
                     int64_t g2r, int64_t g2s, uintptr_t anchor, int64_t ar, int64_t as, double a1, double a2, double c,
                     double x_coef, double lr, double clip_norm, uintptr_t norm_out, int64_t norm_stride,
                     uintptr_t workspace, int64_t workspace_len) {
  const DType dtype = dtype_from_name(dtype_name);
  require(rows >= 1 && d >= 1 && (!vector || rows == 1), "fedspeed_update: rows and d must be >= 1");
  require(x != 0 && g2 != 0, "fedspeed_update: null pointer");
  for (double v : {a1, a2, c, x_coef, lr, clip_norm})
    require(std::isfinite(v), "fedspeed_update: coefficients must be finite");
  check_workspace(device, workspace, workspace_len, clip_norm > 0.0, vector, rows, d);
  UpdateArgs a;
  a.d = d;
  a.rows = rows;
  a.x = vec(x, xr, xs);
  a.g1 = vec(g1, g1r, g1s);
  a.g2 = vec(g2, g2r, g2s);
  a.anchor = vec(anchor, ar, as);
  a.a1 = a1;
  a.a2 = a2;
  a.c = c;
  a.x_coef = x_coef;
  a.lr = lr;
  a.clip_norm = clip_norm;
  a.norm_out = reinterpret_cast<void*>(norm_out);
  a.norm_stride = norm_stride;
  a.workspace = reinterpret_cast<void*>(workspace);
  a.workspace_len = workspace_len;
  if (device < 0) {
    by_dtype<UpdateFn>(dtype, a);
  } else if (vector) {
    PFK_CUDA_CALL(cuda::fedspeed_update(device, stream, dtype, a));
  } else {
    PFK_CUDA_CALL(cuda::fedspeed_update_rows(device, stream, dtype, a));
  }
}

void fedspeed_round_end(int device, uintptr_t stream, const std::string& dtype_name, bool vector, int64_t rows,
                        int64_t d, uintptr_t h, int64_t hr, int64_t hs, uintptr_t x_local, int64_t kr, int64_t ks,
                        uintptr_t x_global, int64_t tr, int64_t ts, uintptr_t acc, int64_t as, uintptr_t h_sum,
                        int64_t ss, double weight, bool include_h) {
  const DType dtype = dtype_from_name(dtype_name);
  require(rows >= 1 && d >= 1 && (!vector || rows == 1), "fedspeed_round_end: rows and d must be >= 1");
  require(h != 0 && x_local != 0 && x_global != 0, "fedspeed_round_end: null pointer");
  require(std::isfinite(weight), "fedspeed_round_end: weight must be finite");
  RoundEndArgs a;
  a.d = d;
  a.rows = rows;
  a.h = vec(h, hr, hs);
  a.x_local = vec(x_local, kr, ks);
  a.x_global = vec(x_global, tr, ts);
  a.acc = vec(acc, 0, as);
  a.h_sum = vec(h_sum, 0, ss);
  a.weight = weight;
  a.include_h = include_h;
  if (device < 0) {
    by_dtype<RoundEndFn>(dtype, a);
  } else if (vector) {
    PFK_CUDA_CALL(cuda::fedspeed_round_end(device, stream, dtype, a));
  } else {
    PFK_CUDA_CALL(cuda::fedspeed_round_end_rows(device, stream, dtype, a));
  }
}

}  // namespace

void bind_fedspeed(py::module_& m) {
  m.def(
      "fedspeed_workspace_size", [] { return kFedSpeedMaxPartials; },
      "Accumulator elements of the workspace a CUDA FedSpeed norm of one [d] vector needs.");
  m.def(
      "fedspeed_row_workspace_size", [](int64_t d, int64_t rows) { return rows * fedspeed_row_partials(d); },
      py::arg("d"), py::arg("rows"), "Accumulator elements of the workspace a CUDA row-form norm needs.");
  m.def("fedspeed_perturb", &fedspeed_perturb, py::arg("device"), py::arg("stream"), py::arg("dtype"),
        py::arg("vector"), py::arg("rows"), py::arg("d"), py::arg("x"), py::arg("x_row_stride"), py::arg("x_stride"),
        py::arg("g"), py::arg("g_row_stride"), py::arg("g_stride"), py::arg("out"), py::arg("out_row_stride"),
        py::arg("out_stride"), py::arg("rho"), py::arg("eps"), py::arg("normalize"), py::arg("norm_out"),
        py::arg("norm_stride"), py::arg("workspace"), py::arg("workspace_len"),
        py::call_guard<py::gil_scoped_release>(),
        "Per row: out = x + s g with s = rho / (||g|| + eps) (normalize) or rho; ||g|| to norm_out.");
  m.def("fedspeed_update", &fedspeed_update, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("vector"),
        py::arg("rows"), py::arg("d"), py::arg("x"), py::arg("x_row_stride"), py::arg("x_stride"), py::arg("g1"),
        py::arg("g1_row_stride"), py::arg("g1_stride"), py::arg("g2"), py::arg("g2_row_stride"), py::arg("g2_stride"),
        py::arg("anchor"), py::arg("anchor_row_stride"), py::arg("anchor_stride"), py::arg("a1"), py::arg("a2"),
        py::arg("c"), py::arg("x_coef"), py::arg("lr"), py::arg("clip_norm"), py::arg("norm_out"),
        py::arg("norm_stride"), py::arg("workspace"), py::arg("workspace_len"),
        py::call_guard<py::gil_scoped_release>(),
        "Per row: x -= lr (k (a1 g1 + a2 g2 + c anchor) + x_coef x), k = 1 or min(1, clip_norm / (||.|| + 1e-6)).");
  m.def("fedspeed_round_end", &fedspeed_round_end, py::arg("device"), py::arg("stream"), py::arg("dtype"),
        py::arg("vector"), py::arg("rows"), py::arg("d"), py::arg("h"), py::arg("h_row_stride"), py::arg("h_stride"),
        py::arg("x_local"), py::arg("x_local_row_stride"), py::arg("x_local_stride"), py::arg("x_global"),
        py::arg("x_global_row_stride"), py::arg("x_global_stride"), py::arg("acc"), py::arg("acc_stride"),
        py::arg("h_sum"), py::arg("h_sum_stride"), py::arg("weight"), py::arg("include_h"),
        py::call_guard<py::gil_scoped_release>(),
        "Per row: h += x_local - x_global; acc += weight (x_local [+ h]); h_sum += x_local - x_global (row order).");
}

}  // namespace pfk
