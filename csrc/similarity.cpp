// Similarity kernels of the dynamic initial-model method: softmax weights over K stored vectors of
// −scale·distance (or +scale·cosine) to a query, whole-vector or per segment, and the blend Σ_k α_k·models_k.
//
// One streaming pass: the included segments are cut into fixed chunks; for each chunk the query slice is loaded
// once into an L1-resident buffer and every bank row streams over it, accumulating per segment Σq², and per row
// Σq·b, Σb² and Σ(q − b)², in double over 16 independent lanes; chunk partials are added in chunk order, so
// results never depend on the thread count. The scores and the max-subtracted softmax are computed in double
// (similarity.h); the blend is the aggregation kernel (aggregate.h).
#include "similarity.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "aggregate.h"
#include "bindings.h"
#include "cuda_launchers.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

constexpr int64_t kChunk =
    2048;  // elements per work item: the double query slice (16 KiB) stays in L1 while K rows stream by
constexpr int kLanes4 = 4;  // doubles per vector; four vectors give 16 independent partial sums

struct Row {
  const void* ptr;
  int64_t stride;
};

// One chunk [begin, end) of included segment `segment`.
struct WorkItem {
  int64_t segment;
  int64_t begin;
  int64_t end;
};

// Four doubles as one value (GCC/Clang vector extension, one AVX register): the lane loops below are explicit
// SIMD on every ISA with exactly the same rounding per lane.
typedef double Vd4 __attribute__((vector_size(32)));
typedef float Vf4 __attribute__((vector_size(16)));

PFK_ALWAYS_INLINE Vd4 load4(const double* p) {
  Vd4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

PFK_ALWAYS_INLINE Vd4 load4(const float* p) {
  Vf4 f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, Vd4);
}

// Sums over n contiguous elements of the query q and one row b, in double, each in 16 lanes (element j of the full
// 16-blocks goes to lane j mod 16, the tail to lanes 0, 1, ...), then the lanes in order. Diff: out[2] = Σ (q − b)²
// (the l2 metric, no cancellation); otherwise out[0] = Σ q·b and out[1] = Σ b².
// `next` (or null): the row read after this one, prefetched W elements per step, so that the next row's chunk is
// on its way while this one is summed (one row at a time is a single memory stream per thread otherwise).
template <bool Diff, typename Q, typename B>
PFK_ALWAYS_INLINE void lane_stats(const Q* q, const B* b, int64_t n, double out[3], const B* next = nullptr) {
  constexpr int W = 4 * kLanes4;
  constexpr int kLine = 64 / sizeof(B);  // elements per cache line
  Vd4 x[4] = {}, y[4] = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    if (next != nullptr) {
      for (int e = 0; e < W; e += kLine) __builtin_prefetch(next + j + e, 0, 3);
    }
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const Vd4 a = load4(q + j + h * kLanes4);
      const Vd4 v = load4(b + j + h * kLanes4);
      if constexpr (Diff) {
        const Vd4 e = a - v;
        x[h] += e * e;
      } else {
        x[h] += a * v;
        y[h] += v * v;
      }
    }
  }
  double xl[W], yl[W];
  std::memcpy(xl, x, sizeof x);
  std::memcpy(yl, y, sizeof y);
  for (int64_t t = j, l = 0; t < n; ++t, ++l) {
    const double a = static_cast<double>(q[t]), v = static_cast<double>(b[t]);
    if constexpr (Diff) {
      xl[l] += (a - v) * (a - v);
    } else {
      xl[l] += a * v;
      yl[l] += v * v;
    }
  }
  double sx = 0.0, sy = 0.0;
  for (int l = 0; l < W; ++l) {
    sx += xl[l];
    sy += yl[l];
  }
  out[0] = Diff ? 0.0 : sx;
  out[1] = Diff ? 0.0 : sy;
  out[2] = Diff ? sx : 0.0;
}

// dst[j] = src[j * stride] converted, j < n.
template <typename T, bool Contiguous, typename D>
PFK_ALWAYS_INLINE void load_chunk(D* dst, const T* src, int64_t stride, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<D>(to_acc(src[j * (Contiguous ? 1 : stride)]));
}

// Writes partial[0] = Σq² and partial[1 + 3k + (0, 1, 2)] = (Σq·b_k, Σb_k², 0), or (0, 0, Σ(q − b_k)²) with Diff,
// over one chunk. Products and sums are in double (16-bit and float values convert exactly), so the cosine of
// nearly parallel segments keeps its last digits. The query slice is loaded once per chunk and reused K times;
// contiguous float/double rows are read in place, others are converted (or gathered) into a buffer first.
template <typename T, bool Contiguous, bool Diff>
PFK_ALWAYS_INLINE void chunk_stats_body(const WorkItem& item, const T* query, int64_t query_stride,
                                        const std::vector<Row>& bank, double* partial) {
  using Buf = typename AccOf<T>::type;  // float holds 32/16-bit values exactly
  constexpr bool kReadInPlace = Contiguous && std::is_same_v<T, Buf>;
  const int64_t n = item.end - item.begin;
  alignas(64) double q[kChunk];                    // the query slice, converted once per chunk
  alignas(64) Buf row[kReadInPlace ? 1 : kChunk];  // a converted or gathered bank row
  load_chunk<T, Contiguous>(q, query + item.begin * (Contiguous ? 1 : query_stride), query_stride, n);
  double st[3];
  lane_stats<false>(q, q, n, st);
  partial[0] = st[0];
  for (size_t k = 0; k < bank.size(); ++k) {
    const int64_t s = Contiguous ? 1 : bank[k].stride;
    const T* r = static_cast<const T*>(bank[k].ptr) + item.begin * s;
    const Buf* b;
    const Buf* next = nullptr;
    if constexpr (kReadInPlace) {
      b = r;
      if (k + 1 < bank.size()) next = static_cast<const T*>(bank[k + 1].ptr) + item.begin;
    } else {
      load_chunk<T, Contiguous>(row, r, s, n);
      b = row;
    }
    lane_stats<Diff>(q, b, n, st, next);
    for (int i = 0; i < 3; ++i) partial[1 + 3 * k + i] = st[i];
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous PFK_COMMA bool Diff>,
                 <T PFK_COMMA Contiguous PFK_COMMA Diff>, void, chunk_stats,
                 (const WorkItem& item, const T* query, int64_t query_stride, const std::vector<Row>& bank,
                  double* partial),
                 (item, query, query_stride, bank, partial), chunk_stats_body)

// Segment statistics [L][1 + 3K] (similarity.h layout) of the included segments [seg_begin[l], seg_end[l]).
// With diff the rows' statistic is Σ(q − b)² (the l2 metric), otherwise Σq·b and Σb².
template <typename T>
std::vector<double> segment_stats_cpu(const void* query, int64_t query_stride, const std::vector<Row>& bank,
                                      const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end,
                                      bool diff) {
  const int64_t L = static_cast<int64_t>(seg_begin.size());
  const int64_t pitch = similarity_pitch(static_cast<int64_t>(bank.size()));
  std::vector<WorkItem> items;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = seg_begin[l]; b < seg_end[l]; b += kChunk)
      items.push_back({l, b, std::min(seg_end[l], b + kChunk)});
  bool contiguous = query_stride == 1;
  for (const auto& r : bank) contiguous = contiguous && r.stride == 1;
  const T* q = static_cast<const T*>(query);
  std::vector<double> partials(items.size() * pitch);
  int64_t work = 0;  // the query and every bank row over the included segments
  for (int64_t l = 0; l < L; ++l) work += (static_cast<int64_t>(bank.size()) + 1) * (seg_end[l] - seg_begin[l]);
  parallel_chunks(static_cast<int64_t>(items.size()), 1, work, [&](int64_t c, int64_t, int64_t) {
    double* out = partials.data() + c * pitch;
    if (contiguous) {
      diff ? chunk_stats<T, true, true>(items[c], q, 1, bank, out)
           : chunk_stats<T, true, false>(items[c], q, 1, bank, out);
    } else {
      diff ? chunk_stats<T, false, true>(items[c], q, query_stride, bank, out)
           : chunk_stats<T, false, false>(items[c], q, query_stride, bank, out);
    }
  });
  std::vector<double> stats(L * pitch, 0.0);
  for (size_t c = 0; c < items.size(); ++c) {  // chunk order: independent of the thread count
    double* dst = stats.data() + items[c].segment * pitch;
    const double* src = partials.data() + c * pitch;
    for (int64_t j = 0; j < pitch; ++j) dst[j] += src[j];
  }
  return stats;
}

std::vector<double> segment_stats(DType dtype, const void* query, int64_t query_stride, const std::vector<Row>& bank,
                                  const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end,
                                  bool diff) {
  switch (dtype) {
    case DType::F32:
      return segment_stats_cpu<float>(query, query_stride, bank, seg_begin, seg_end, diff);
    case DType::F64:
      return segment_stats_cpu<double>(query, query_stride, bank, seg_begin, seg_end, diff);
    case DType::F16:
      return segment_stats_cpu<f16_t>(query, query_stride, bank, seg_begin, seg_end, diff);
    case DType::BF16:
      return segment_stats_cpu<bf16_t>(query, query_stride, bank, seg_begin, seg_end, diff);
  }
  return {};
}

void store_values(DType out_dtype, const std::vector<double>& values, uintptr_t out) {
  if (out == 0) return;
  if (out_dtype == DType::F64) {
    std::copy(values.begin(), values.end(), reinterpret_cast<double*>(out));
  } else {
    std::transform(values.begin(), values.end(), reinterpret_cast<float*>(out),
                   [](double v) { return static_cast<float>(v); });
  }
}

// Checked arguments of one similarity call, with the included segments resolved to [begin, end) ranges.
struct SimilarityCall {
  int device;
  uintptr_t stream;
  DType dtype;
  DType out_dtype;
  const void* query;
  int64_t query_stride;
  std::vector<uintptr_t> bank_ptrs;
  std::vector<int64_t> bank_strides;
  std::vector<int64_t> seg_begin, seg_end;
  int metric;
  double scale, eps;
  uintptr_t weights, scores;
};

SimilarityCall check_call(int device, uintptr_t stream, const std::string& dtype_name, int64_t d, uintptr_t query,
                          int64_t query_stride, const std::vector<uintptr_t>& bank_ptrs,
                          const std::vector<int64_t>& bank_strides, const std::vector<int64_t>& offsets,
                          const std::vector<bool>& include, int metric, double scale, double eps,
                          const std::string& out_dtype_name, uintptr_t weights, uintptr_t scores) {
  SimilarityCall call{device,
                      stream,
                      dtype_from_name(dtype_name),
                      dtype_from_name(out_dtype_name),
                      reinterpret_cast<const void*>(query),
                      query_stride,
                      bank_ptrs,
                      bank_strides,
                      {},
                      {},
                      metric,
                      scale,
                      eps,
                      weights,
                      scores};
  if (d < 1) throw ArgumentError("similarity: d must be >= 1");
  if (bank_ptrs.empty()) throw ArgumentError("similarity: the bank is empty (K = 0)");
  if (bank_ptrs.size() != bank_strides.size()) throw ArgumentError("similarity: bank ptrs/strides lengths differ");
  if (query == 0 || weights == 0) throw ArgumentError("similarity: null query or weights pointer");
  for (uintptr_t p : bank_ptrs)
    if (p == 0) throw ArgumentError("similarity: null bank row pointer");
  if (call.out_dtype != DType::F32 && call.out_dtype != DType::F64)
    throw ArgumentError("similarity: weights must be float32 or float64");
  if (metric != kMetricL2 && metric != kMetricLayerL2 && metric != kMetricLayerCos)
    throw ArgumentError("similarity: unknown metric code " + std::to_string(metric));
  if (!std::isfinite(scale)) throw ArgumentError("similarity: scale must be finite");
  if (!std::isfinite(eps) || eps < 0) throw ArgumentError("similarity: eps must be finite and >= 0");
  if (offsets.size() < 2 || include.size() + 1 != offsets.size())
    throw ArgumentError("similarity: need L + 1 >= 2 offsets and L include flags");
  for (size_t l = 0; l + 1 < offsets.size(); ++l) {
    if (offsets[l] < 0 || offsets[l] > offsets[l + 1] || offsets[l + 1] > d)
      throw ArgumentError("similarity: offsets must be non-decreasing within [0, d]");
    if (include[l]) {
      call.seg_begin.push_back(offsets[l]);
      call.seg_end.push_back(offsets[l + 1]);
    }
  }
  if (call.seg_begin.empty()) throw ArgumentError("similarity: no segment is included");
  return call;
}

// The CUDA form of a checked call (the segments' tables, the outputs; no blend).
cuda::SimilarityArgs device_args(const SimilarityCall& c) {
  cuda::SimilarityArgs a;
  a.dtype = c.dtype;
  a.out_dtype = c.out_dtype;
  a.query = c.query;
  a.query_stride = c.query_stride;
  for (size_t k = 0; k < c.bank_ptrs.size(); ++k)
    a.bank.push_back({reinterpret_cast<const void*>(c.bank_ptrs[k]), c.bank_strides[k]});
  a.seg_begin = c.seg_begin;
  a.seg_end = c.seg_end;
  a.metric = c.metric;
  a.scale = c.scale;
  a.eps = c.eps;
  a.weights = reinterpret_cast<void*>(c.weights);
  a.scores = reinterpret_cast<void*>(c.scores);
  return a;
}

// The weights (and scores) of a checked call on the CPU; returns the weights in double.
std::vector<double> run_weights_cpu(const SimilarityCall& c) {
  const int64_t K = static_cast<int64_t>(c.bank_ptrs.size());
  std::vector<double> alpha(K);
  std::vector<Row> bank(K);
  for (int64_t k = 0; k < K; ++k) bank[k] = {reinterpret_cast<const void*>(c.bank_ptrs[k]), c.bank_strides[k]};
  const std::vector<double> stats =
      segment_stats(c.dtype, c.query, c.query_stride, bank, c.seg_begin, c.seg_end, c.metric == kMetricL2);
  const int64_t L = static_cast<int64_t>(c.seg_begin.size());
  const int64_t pitch = similarity_pitch(K);
  for (int64_t l = 0; l < L; ++l) {
    const double* s = stats.data() + l * pitch;
    if (!std::isfinite(s[0])) throw ArgumentError("similarity: the query holds non-finite values (inf or nan)");
    for (int64_t k = 0; k < K; ++k)
      if (!std::isfinite(s[1 + 3 * k]) || !std::isfinite(s[2 + 3 * k]) || !std::isfinite(s[3 + 3 * k]))
        throw ArgumentError("similarity: bank row " + std::to_string(k) + " holds non-finite values (inf or nan)");
  }
  std::vector<double> scores(K);
  for (int64_t k = 0; k < K; ++k) scores[k] = similarity_score(c.metric, stats.data(), L, K, k, c.eps);
  similarity_softmax(c.metric, scores.data(), K, c.scale, alpha.data());
  store_values(c.out_dtype, alpha, c.weights);
  store_values(c.out_dtype, scores, c.scores);
  return alpha;
}

// Returns 0, or the device scratch bytes a CUDA call needs (see Scratch).
size_t similarity_weights(int device, uintptr_t stream, const std::string& dtype, int64_t d, uintptr_t query,
                          int64_t query_stride, const std::vector<uintptr_t>& bank_ptrs,
                          const std::vector<int64_t>& bank_strides, const std::vector<int64_t>& offsets,
                          const std::vector<bool>& include, int metric, double scale, double eps,
                          const std::string& out_dtype, uintptr_t weights, uintptr_t scores, uintptr_t scratch,
                          size_t scratch_bytes) {
  const SimilarityCall call = check_call(device, stream, dtype, d, query, query_stride, bank_ptrs, bank_strides,
                                         offsets, include, metric, scale, eps, out_dtype, weights, scores);
  if (device >= 0)  // the weights stay on the device: no host copy, no wait
    return PFK_CUDA_CALL(
        cuda::similarity_weights(device, stream, device_args(call), as_scratch(scratch, scratch_bytes)));
  run_weights_cpu(call);
  return 0;
}

size_t similarity_combine(int device, uintptr_t stream, const std::string& dtype, int64_t d, uintptr_t query,
                          int64_t query_stride, const std::vector<uintptr_t>& bank_ptrs,
                          const std::vector<int64_t>& bank_strides, const std::vector<int64_t>& offsets,
                          const std::vector<bool>& include, int metric, double scale, double eps,
                          const std::string& out_dtype, uintptr_t weights, uintptr_t scores,
                          const std::string& models_dtype, int64_t model_dim, uintptr_t out, int64_t out_stride,
                          const std::vector<uintptr_t>& model_ptrs, const std::vector<int64_t>& model_strides,
                          uintptr_t scratch, size_t scratch_bytes) {
  const SimilarityCall call = check_call(device, stream, dtype, d, query, query_stride, bank_ptrs, bank_strides,
                                         offsets, include, metric, scale, eps, out_dtype, weights, scores);
  if (model_dim < 1) throw ArgumentError("similarity_combine: model_dim must be >= 1");
  if (model_ptrs.size() != bank_ptrs.size() || model_strides.size() != model_ptrs.size())
    throw ArgumentError("similarity_combine: need one model row per bank row");
  if (out == 0) throw ArgumentError("similarity_combine: out is a null pointer");
  for (uintptr_t p : model_ptrs)
    if (p == 0) throw ArgumentError("similarity_combine: null model row pointer");
  const DType mdt = dtype_from_name(models_dtype);
  void* o = reinterpret_cast<void*>(out);
  if (device < 0) {
    const std::vector<double> alpha = run_weights_cpu(call);
    std::vector<WeightedRow> rows;
    for (size_t k = 0; k < model_ptrs.size(); ++k)
      if (alpha[k] != 0.0)  // an underflowed weight: that model is not read
        rows.push_back({reinterpret_cast<const void*>(model_ptrs[k]), model_strides[k], alpha[k]});
    weighted_sum_cpu(mdt, model_dim, o, out_stride, rows, false);
    return 0;
  }
#ifdef PYFEDKERN_WITH_CUDA
  // The blend reads the weights on the device (a row whose weight underflows to 0 is not read): one scratch holds
  // the weights pass's work, the weights in the models' accumulator type, and the blend's tables.
  cuda::SimilarityArgs a = device_args(call);
  cuda::WeightedSumCall blend;
  blend.d = model_dim;
  blend.out = o;
  blend.out_stride = out_stride;
  for (size_t k = 0; k < model_ptrs.size(); ++k)
    blend.rows.push_back({reinterpret_cast<const void*>(model_ptrs[k]), model_strides[k]});
  const size_t align = 256;
  const size_t sim_bytes = (cuda::similarity_scratch_bytes(a) + align - 1) / align * align;
  const size_t weight_bytes = (model_ptrs.size() * sizeof(double) + align - 1) / align * align;
  blend.device_weights = reinterpret_cast<void*>(scratch + sim_bytes);  // written by the weights pass
  const size_t need = sim_bytes + weight_bytes + cuda::weighted_sum_scratch_bytes(mdt, blend);
  if (scratch_bytes < need) return need;
  unsigned char* base = reinterpret_cast<unsigned char*>(scratch);
  a.blend_weights = base + sim_bytes;
  a.blend_weights_f64 = mdt == DType::F64;
  cuda::similarity_weights(device, stream, a, {base, sim_bytes});
  return cuda::weighted_sum(device, stream, mdt, blend,
                            {base + sim_bytes + weight_bytes, need - sim_bytes - weight_bytes});
#else
  return PFK_CUDA_CALL(0);
#endif
}

}  // namespace

void bind_similarity(py::module_& m) {
  m.def("similarity_weights", &similarity_weights, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("query"), py::arg("query_stride"), py::arg("bank_ptrs"), py::arg("bank_strides"), py::arg("offsets"),
        py::arg("include"), py::arg("metric"), py::arg("scale"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("weights"), py::arg("scores"), py::arg("scratch"), py::arg("scratch_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Softmax weights over the bank rows of -scale*distance (+scale*cosine) to the query; see similarity.h.");
  m.def("similarity_combine", &similarity_combine, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("query"), py::arg("query_stride"), py::arg("bank_ptrs"), py::arg("bank_strides"), py::arg("offsets"),
        py::arg("include"), py::arg("metric"), py::arg("scale"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("weights"), py::arg("scores"), py::arg("models_dtype"), py::arg("model_dim"), py::arg("out"),
        py::arg("out_stride"), py::arg("model_ptrs"), py::arg("model_strides"), py::arg("scratch"),
        py::arg("scratch_bytes"), py::call_guard<py::gil_scoped_release>(),
        "similarity_weights, then out = sum_k weights[k] * model_k with the aggregation kernel.");
}

}  // namespace pfk
