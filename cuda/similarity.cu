// CUDA similarity kernels: per-segment statistics of a query and K bank rows in one streaming pass, then the
// scores and the max-subtracted softmax (csrc/similarity.h), all on the caller's stream.
//
// Pass 1: each block takes one chunk of 4096 elements of an included segment; every thread keeps its 16 query
// values (as double) in registers and reuses them for all K rows (coalesced loads), sums in double over its 16
// elements and then across the block, and writes the chunk's 1 + 3K partials. Pass 2: one block per
// segment adds its chunks' partials in chunk order (deterministic). Pass 3: one block computes the K scores and
// the softmax in double and writes the weights.
#include <vector>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"
#include "similarity.h"

namespace pfk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;
constexpr int64_t kChunk = static_cast<int64_t>(kThreads) * kPerThread;
constexpr int kWarps = kThreads / 32;

struct DeviceRow {
  const void* ptr;
  int64_t stride;
};

struct DeviceItem {
  int64_t segment;
  int64_t begin;
  int64_t end;
};

// Sum of three per-thread values over the block, in double, fixed order; the result is valid in thread 0.
__device__ void block_sum3(double v[3], double* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < 3; ++i) v[i] += __shfl_down_sync(0xffffffffu, v[i], off);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < 3; ++i) shared[warp * 3 + i] = v[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < 3; ++i) {
      double total = 0.0;
      for (int w = 0; w < kWarps; ++w) total += shared[w * 3 + i];
      v[i] = total;
    }
  }
  __syncthreads();
}

// Diff: the rows' statistic is Σ(q − b)² (the l2 metric); otherwise Σq·b and Σb². All products and sums in double
// (16-bit and float values convert exactly), like the CPU kernel.
template <typename T, bool Diff>
__global__ void __launch_bounds__(kThreads)
    chunk_stats_kernel(const T* __restrict__ query, int64_t query_stride, const DeviceRow* __restrict__ bank, int K,
                       const DeviceItem* __restrict__ items, int64_t num_items, double* __restrict__ partials) {
  __shared__ double shared[3 * kWarps];
  const int64_t pitch = similarity_pitch(K);
  for (int64_t it = blockIdx.x; it < num_items; it += gridDim.x) {
    const DeviceItem item = items[it];
    double q[kPerThread];
    double v[3] = {0.0, 0.0, 0.0};
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t e = item.begin + static_cast<int64_t>(i) * kThreads + threadIdx.x;
      q[i] = e < item.end ? static_cast<double>(to_acc(query[e * query_stride])) : 0.0;
      v[0] += q[i] * q[i];
    }
    block_sum3(v, shared);
    double* out = partials + it * pitch;
    if (threadIdx.x == 0) out[0] = v[0];
    for (int k = 0; k < K; ++k) {
      const T* __restrict__ r = static_cast<const T*>(bank[k].ptr);
      const int64_t s = bank[k].stride;
      double w[3] = {0.0, 0.0, 0.0};
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t e = item.begin + static_cast<int64_t>(i) * kThreads + threadIdx.x;
        if (e < item.end) {
          const double b = static_cast<double>(to_acc(r[e * s]));
          if (Diff) {
            w[2] += (q[i] - b) * (q[i] - b);
          } else {
            w[0] += q[i] * b;
            w[1] += b * b;
          }
        }
      }
      block_sum3(w, shared);
      if (threadIdx.x == 0) {
        out[1 + 3 * k] = w[0];
        out[2 + 3 * k] = w[1];
        out[3 + 3 * k] = w[2];
      }
    }
  }
}

// stats[l][j] = Σ over segment l's chunks (in order) of partials[chunk][j].
__global__ void segment_sum_kernel(const double* __restrict__ partials, int64_t pitch,
                                   const int64_t* __restrict__ first_item, double* __restrict__ stats) {
  const int64_t l = blockIdx.x;
  for (int64_t j = threadIdx.x; j < pitch; j += blockDim.x) {
    double total = 0.0;
    for (int64_t it = first_item[l]; it < first_item[l + 1]; ++it) total += partials[it * pitch + j];
    stats[l * pitch + j] = total;
  }
}

// Scores (NaN for a row whose statistics are not finite, which makes every weight NaN) and softmax weights.
template <typename Out>
__global__ void finalize_kernel(int metric, const double* __restrict__ stats, int64_t L, int64_t K, double eps,
                                double scale, double* __restrict__ scores, double* __restrict__ alpha,
                                Out* __restrict__ weights_out, Out* __restrict__ scores_out) {
  const int64_t pitch = similarity_pitch(K);
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    bool finite = true;
    for (int64_t l = 0; l < L; ++l) {
      const double* s = stats + l * pitch;
      finite = finite && isfinite(s[0]) && isfinite(s[1 + 3 * k]) && isfinite(s[2 + 3 * k]) && isfinite(s[3 + 3 * k]);
    }
    scores[k] = finite ? similarity_score(metric, stats, L, K, k, eps) : nan("");
  }
  __syncthreads();
  if (threadIdx.x == 0) similarity_softmax(metric, scores, K, scale, alpha);
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    weights_out[k] = static_cast<Out>(alpha[k]);
    if (scores_out != nullptr) scores_out[k] = static_cast<Out>(scores[k]);
  }
}

// Device scratch freed in stream order.
class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    check(cudaMallocAsync(&ptr_, bytes, stream), "cudaMallocAsync");
  }
  ~StreamScratch() { cudaFreeAsync(ptr_, stream_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  double* get() const { return static_cast<double*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

template <typename T>
void launch_stats(int device, cudaStream_t stream, bool diff, const void* query, int64_t query_stride,
                  const DeviceRow* bank, int K, const DeviceItem* items, int64_t num_items, double* partials) {
  if (num_items == 0) return;
  const unsigned grid = grid_for(device, num_items * kThreads, kThreads);
  const T* q = static_cast<const T*>(query);
  if (diff) {
    chunk_stats_kernel<T, true><<<grid, kThreads, 0, stream>>>(q, query_stride, bank, K, items, num_items, partials);
  } else {
    chunk_stats_kernel<T, false><<<grid, kThreads, 0, stream>>>(q, query_stride, bank, K, items, num_items, partials);
  }
}

}  // namespace

void similarity_weights(int device, uintptr_t stream_handle, DType dtype, const void* query, int64_t query_stride,
                        const std::vector<uintptr_t>& bank_ptrs, const std::vector<int64_t>& bank_strides,
                        const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end, int metric,
                        double scale, double eps, DType out_dtype, void* weights, void* scores, double* host_alpha) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  const int K = static_cast<int>(bank_ptrs.size());
  const int64_t L = static_cast<int64_t>(seg_begin.size());
  const int64_t pitch = similarity_pitch(K);
  std::vector<DeviceRow> rows(K);
  for (int k = 0; k < K; ++k) rows[k] = {reinterpret_cast<const void*>(bank_ptrs[k]), bank_strides[k]};
  std::vector<DeviceItem> items;
  std::vector<int64_t> first_item(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) {
    first_item[l] = static_cast<int64_t>(items.size());
    for (int64_t b = seg_begin[l]; b < seg_end[l]; b += kChunk)
      items.push_back({l, b, b + kChunk < seg_end[l] ? b + kChunk : seg_end[l]});
  }
  first_item[L] = static_cast<int64_t>(items.size());
  const int64_t num_items = first_item[L];

  StreamCopy<DeviceRow> d_rows(rows.data(), rows.size(), stream);
  StreamCopy<DeviceItem> d_items(items.data(), items.size(), stream);
  StreamCopy<int64_t> d_first(first_item.data(), first_item.size(), stream);
  // scratch: chunk partials, segment statistics, scores, weights (doubles)
  const int64_t n_partials = num_items * pitch, n_stats = L * pitch;
  StreamScratch scratch(sizeof(double) * static_cast<size_t>(n_partials + n_stats + 2 * K), stream);
  double* partials = scratch.get();
  double* stats = partials + n_partials;
  double* d_scores = stats + n_stats;
  double* d_alpha = d_scores + K;

  const bool diff = metric == kMetricL2;
  switch (dtype) {
    case DType::F32:
      launch_stats<float>(device, stream, diff, query, query_stride, d_rows.get(), K, d_items.get(), num_items,
                          partials);
      break;
    case DType::F64:
      launch_stats<double>(device, stream, diff, query, query_stride, d_rows.get(), K, d_items.get(), num_items,
                           partials);
      break;
    case DType::F16:
      launch_stats<f16_t>(device, stream, diff, query, query_stride, d_rows.get(), K, d_items.get(), num_items,
                          partials);
      break;
    case DType::BF16:
      launch_stats<bf16_t>(device, stream, diff, query, query_stride, d_rows.get(), K, d_items.get(), num_items,
                           partials);
      break;
  }
  check(cudaGetLastError(), "similarity chunk_stats launch");
  segment_sum_kernel<<<static_cast<unsigned>(L), kThreads, 0, stream>>>(partials, pitch, d_first.get(), stats);
  check(cudaGetLastError(), "similarity segment_sum launch");
  if (out_dtype == DType::F64) {
    finalize_kernel<double><<<1, kThreads, 0, stream>>>(metric, stats, L, K, eps, scale, d_scores, d_alpha,
                                                        static_cast<double*>(weights), static_cast<double*>(scores));
  } else {
    finalize_kernel<float><<<1, kThreads, 0, stream>>>(metric, stats, L, K, eps, scale, d_scores, d_alpha,
                                                       static_cast<float*>(weights), static_cast<float*>(scores));
  }
  check(cudaGetLastError(), "similarity finalize launch");
  if (host_alpha != nullptr) {
    check(cudaMemcpyAsync(host_alpha, d_alpha, sizeof(double) * K, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
}

}  // namespace pfk::cuda
