// Similarity kernels of the dynamic initial-model method: softmax weights over K stored vectors of
// −scale·distance (or +scale·cosine) to a query, whole-vector or per segment, and the blend Σ_k α_k·models_k.
//
// One streaming pass: the included segments are cut into fixed chunks; for each chunk the query slice is loaded
// once into an L1-resident buffer and every bank row streams over it, accumulating per segment Σq², and per row
// Σq·b, Σb² and Σ(q − b)². Sums run in the storage's accumulator (float for 32/16-bit storage) over 16 lanes and
// short blocks, then in double; chunk partials are added in chunk order, so results never depend on the thread
// count. The scores and the max-subtracted softmax are computed in double (similarity.h); the blend is the
// aggregation kernel (aggregate.h).
#include "similarity.h"

#include <algorithm>
#include <cmath>
#include <string>
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

constexpr int64_t kChunk = 4096;  // elements per work item: the query slice stays in L1 while K rows stream by
constexpr int64_t kBlock = 256;   // elements summed in the storage accumulator before moving to double
constexpr int kLanes = 16;        // independent partial sums: the inner loops vectorise without reassociation

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

// Writes partial[0] = Σq² and partial[1 + 3k + (0, 1, 2)] = (Σq·b_k, Σb_k², Σ(q − b_k)²) over one chunk.
template <typename T, bool Contiguous>
PFK_ALWAYS_INLINE void chunk_stats_body(const WorkItem& item, const T* query, int64_t query_stride,
                                        const std::vector<Row>& bank, double* partial) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = item.end - item.begin;
  Acc q[kChunk];
  {
    const T* src = query + item.begin * (Contiguous ? 1 : query_stride);
    for (int64_t j = 0; j < n; ++j) q[j] = to_acc(src[j * (Contiguous ? 1 : query_stride)]);
  }
  double q_lanes[kLanes] = {};
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    Acc sq[kLanes] = {};
    int64_t j = b0;
    for (; j + kLanes <= b1; j += kLanes)
      for (int l = 0; l < kLanes; ++l) sq[l] = sq[l] + q[j + l] * q[j + l];
    for (int l = 0; j < b1; ++j, ++l) sq[l] = sq[l] + q[j] * q[j];
    for (int l = 0; l < kLanes; ++l) q_lanes[l] += static_cast<double>(sq[l]);
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += q_lanes[l];
  partial[0] = total;

  for (size_t k = 0; k < bank.size(); ++k) {
    const int64_t s = Contiguous ? 1 : bank[k].stride;
    const T* __restrict__ r = static_cast<const T*>(bank[k].ptr) + item.begin * s;
    double dot_l[kLanes] = {}, bb_l[kLanes] = {}, dd_l[kLanes] = {};
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
      const int64_t b1 = std::min(n, b0 + kBlock);
      Acc dot[kLanes] = {}, bb[kLanes] = {}, dd[kLanes] = {};
      int64_t j = b0;
      for (; j + kLanes <= b1; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const Acc a = q[j + l];
          const Acc b = to_acc(r[(j + l) * s]);
          const Acc e = a - b;
          dot[l] = dot[l] + a * b;
          bb[l] = bb[l] + b * b;
          dd[l] = dd[l] + e * e;
        }
      }
      for (int l = 0; j < b1; ++j, ++l) {
        const Acc a = q[j];
        const Acc b = to_acc(r[j * s]);
        const Acc e = a - b;
        dot[l] = dot[l] + a * b;
        bb[l] = bb[l] + b * b;
        dd[l] = dd[l] + e * e;
      }
      for (int l = 0; l < kLanes; ++l) {
        dot_l[l] += static_cast<double>(dot[l]);
        bb_l[l] += static_cast<double>(bb[l]);
        dd_l[l] += static_cast<double>(dd[l]);
      }
    }
    double dot_t = 0.0, bb_t = 0.0, dd_t = 0.0;
    for (int l = 0; l < kLanes; ++l) {
      dot_t += dot_l[l];
      bb_t += bb_l[l];
      dd_t += dd_l[l];
    }
    partial[1 + 3 * k] = dot_t;
    partial[2 + 3 * k] = bb_t;
    partial[3 + 3 * k] = dd_t;
  }
}

PFK_ISA_DISPATCH(template <typename T PFK_COMMA bool Contiguous>, <T PFK_COMMA Contiguous>, void, chunk_stats,
                 (const WorkItem& item, const T* query, int64_t query_stride, const std::vector<Row>& bank,
                  double* partial),
                 (item, query, query_stride, bank, partial), chunk_stats_body)

// Segment statistics [L][1 + 3K] (similarity.h layout) of the included segments [seg_begin[l], seg_end[l]).
template <typename T>
std::vector<double> segment_stats_cpu(const void* query, int64_t query_stride, const std::vector<Row>& bank,
                                      const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end) {
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
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t c, int64_t, int64_t) {
    double* out = partials.data() + c * pitch;
    if (contiguous) {
      chunk_stats<T, true>(items[c], q, 1, bank, out);
    } else {
      chunk_stats<T, false>(items[c], q, query_stride, bank, out);
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
                                  const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end) {
  switch (dtype) {
    case DType::F32:
      return segment_stats_cpu<float>(query, query_stride, bank, seg_begin, seg_end);
    case DType::F64:
      return segment_stats_cpu<double>(query, query_stride, bank, seg_begin, seg_end);
    case DType::F16:
      return segment_stats_cpu<f16_t>(query, query_stride, bank, seg_begin, seg_end);
    case DType::BF16:
      return segment_stats_cpu<bf16_t>(query, query_stride, bank, seg_begin, seg_end);
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

// The weights (and scores) of a checked call; returns the weights in double on the host.
std::vector<double> run_weights(const SimilarityCall& c) {
  const int64_t K = static_cast<int64_t>(c.bank_ptrs.size());
  std::vector<double> alpha(K);
  if (c.device >= 0) {
    PFK_CUDA_CALL(cuda::similarity_weights(c.device, c.stream, c.dtype, c.query, c.query_stride, c.bank_ptrs,
                                           c.bank_strides, c.seg_begin, c.seg_end, c.metric, c.scale, c.eps,
                                           c.out_dtype, reinterpret_cast<void*>(c.weights),
                                           reinterpret_cast<void*>(c.scores), alpha.data()));
    for (double a : alpha)
      if (!std::isfinite(a)) throw ArgumentError("similarity: the query or the bank holds non-finite values");
    return alpha;
  }
  std::vector<Row> bank(K);
  for (int64_t k = 0; k < K; ++k) bank[k] = {reinterpret_cast<const void*>(c.bank_ptrs[k]), c.bank_strides[k]};
  const std::vector<double> stats = segment_stats(c.dtype, c.query, c.query_stride, bank, c.seg_begin, c.seg_end);
  const int64_t L = static_cast<int64_t>(c.seg_begin.size());
  const int64_t pitch = similarity_pitch(K);
  for (int64_t l = 0; l < L; ++l) {
    const double* s = stats.data() + l * pitch;
    if (!std::isfinite(s[0])) throw ArgumentError("similarity: the query holds non-finite values (inf or nan)");
    for (int64_t k = 0; k < K; ++k)
      if (!std::isfinite(s[2 + 3 * k]) || !std::isfinite(s[3 + 3 * k]))
        throw ArgumentError("similarity: bank row " + std::to_string(k) + " holds non-finite values (inf or nan)");
  }
  std::vector<double> scores(K);
  for (int64_t k = 0; k < K; ++k) scores[k] = similarity_score(c.metric, stats.data(), L, K, k, c.eps);
  similarity_softmax(c.metric, scores.data(), K, c.scale, alpha.data());
  store_values(c.out_dtype, alpha, c.weights);
  store_values(c.out_dtype, scores, c.scores);
  return alpha;
}

void similarity_weights(int device, uintptr_t stream, const std::string& dtype, int64_t d, uintptr_t query,
                        int64_t query_stride, const std::vector<uintptr_t>& bank_ptrs,
                        const std::vector<int64_t>& bank_strides, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& include, int metric, double scale, double eps,
                        const std::string& out_dtype, uintptr_t weights, uintptr_t scores) {
  const SimilarityCall call = check_call(device, stream, dtype, d, query, query_stride, bank_ptrs, bank_strides,
                                         offsets, include, metric, scale, eps, out_dtype, weights, scores);
  if (device >= 0) {
    // Weights stay on the device: no host copy, no wait.
    PFK_CUDA_CALL(cuda::similarity_weights(device, stream, call.dtype, call.query, query_stride, bank_ptrs,
                                           bank_strides, call.seg_begin, call.seg_end, metric, scale, eps,
                                           call.out_dtype, reinterpret_cast<void*>(weights),
                                           reinterpret_cast<void*>(scores), nullptr));
    return;
  }
  run_weights(call);
}

void similarity_combine(int device, uintptr_t stream, const std::string& dtype, int64_t d, uintptr_t query,
                        int64_t query_stride, const std::vector<uintptr_t>& bank_ptrs,
                        const std::vector<int64_t>& bank_strides, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& include, int metric, double scale, double eps,
                        const std::string& out_dtype, uintptr_t weights, uintptr_t scores,
                        const std::string& models_dtype, int64_t model_dim, uintptr_t out, int64_t out_stride,
                        const std::vector<uintptr_t>& model_ptrs, const std::vector<int64_t>& model_strides) {
  const SimilarityCall call = check_call(device, stream, dtype, d, query, query_stride, bank_ptrs, bank_strides,
                                         offsets, include, metric, scale, eps, out_dtype, weights, scores);
  if (model_dim < 1) throw ArgumentError("similarity_combine: model_dim must be >= 1");
  if (model_ptrs.size() != bank_ptrs.size() || model_strides.size() != model_ptrs.size())
    throw ArgumentError("similarity_combine: need one model row per bank row");
  if (out == 0) throw ArgumentError("similarity_combine: out is a null pointer");
  const std::vector<double> alpha = run_weights(call);
  std::vector<WeightedRow> rows;
  for (size_t k = 0; k < model_ptrs.size(); ++k) {
    if (alpha[k] == 0.0) continue;  // an underflowed weight: that model is not read
    if (model_ptrs[k] == 0) throw ArgumentError("similarity_combine: null model row pointer");
    rows.push_back({reinterpret_cast<const void*>(model_ptrs[k]), model_strides[k], alpha[k]});
  }
  const DType mdt = dtype_from_name(models_dtype);
  void* o = reinterpret_cast<void*>(out);
  if (device < 0) {
    weighted_sum_cpu(mdt, model_dim, o, out_stride, rows, false);
  } else {
    PFK_CUDA_CALL(cuda::weighted_sum(device, stream, mdt, model_dim, o, out_stride, rows, false));
  }
}

}  // namespace

void bind_similarity(py::module_& m) {
  m.def("similarity_weights", &similarity_weights, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("query"), py::arg("query_stride"), py::arg("bank_ptrs"), py::arg("bank_strides"), py::arg("offsets"),
        py::arg("include"), py::arg("metric"), py::arg("scale"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("weights"), py::arg("scores"), py::call_guard<py::gil_scoped_release>(),
        "Softmax weights over the bank rows of -scale*distance (+scale*cosine) to the query; see similarity.h.");
  m.def("similarity_combine", &similarity_combine, py::arg("device"), py::arg("stream"), py::arg("dtype"), py::arg("d"),
        py::arg("query"), py::arg("query_stride"), py::arg("bank_ptrs"), py::arg("bank_strides"), py::arg("offsets"),
        py::arg("include"), py::arg("metric"), py::arg("scale"), py::arg("eps"), py::arg("out_dtype"),
        py::arg("weights"), py::arg("scores"), py::arg("models_dtype"), py::arg("model_dim"), py::arg("out"),
        py::arg("out_stride"), py::arg("model_ptrs"), py::arg("model_strides"),
        py::call_guard<py::gil_scoped_release>(),
        "similarity_weights, then out = sum_k weights[k] * model_k with the aggregation kernel.");
}

}  // namespace pfk
