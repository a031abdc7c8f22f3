// CUDA similarity kernels: per-segment statistics of a query and K bank rows in one streaming pass, then the
// scores and the max-subtracted softmax (csrc/similarity.h), all on the caller's stream, with the row and segment
// tables in the kernel parameters and the partial sums in scratch from the caller's library: no allocation, no
// host synchronisation. A non-finite query or bank value makes every weight NaN (the CPU raises instead).
//
// Pass 1: each block takes one chunk of 4096 elements of an included segment; every thread keeps its 16 query
// values (as double) in registers and reuses them for all K rows (coalesced loads), sums in double over its 16
// elements and then across the block, and writes the chunk's 1 + 3K partials. Pass 2: one block per
// segment adds its chunks' partials in chunk order (deterministic). Pass 3: one block computes the K scores and
// the softmax in double and writes the weights (and, for similarity_combine, the blend's copy of them).
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

// Offsets of a call's tables: K bank rows; per included segment its [begin, end) and first chunk (L + 1 entries,
// the last one the number of chunks).
struct SimTables {
  int64_t K;
  int64_t bank;
  int64_t L;
  int64_t seg_begin;
  int64_t seg_end;
  int64_t first_chunk;
};

// Sum of N per-thread values over the block, in double, each in the same fixed order (a warp tree, then the warps
// in order); the results are valid in thread 0.
template <int N>
__device__ void block_sum(double (&v)[N], double* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_down_sync(0xffffffffu, v[i], off);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) shared[warp * N + i] = v[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      double total = 0.0;
      for (int w = 0; w < kWarps; ++w) total += shared[w * N + i];
      v[i] = total;
    }
  }
  __syncthreads();
}

constexpr int kRowsPerSum = 4;  // bank rows whose statistics share one block reduction (fewer barriers)

// Diff: the rows' statistic is Σ(q − b)² (the l2 metric); otherwise Σq·b and Σb². All products and sums in double
// (16-bit and float values convert exactly), like the CPU kernel.
template <typename T, bool Diff, size_t NB>
__global__ void __launch_bounds__(kThreads)
    chunk_stats_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, SimTables t,
                       const T* __restrict__ query, int64_t query_stride, double* __restrict__ partials) {
  constexpr int S = Diff ? 1 : 2;  // statistics per row
  __shared__ double shared[kRowsPerSum * S * kWarps];
  __shared__ double query_warps[2][kWarps];  // per-warp Σq², double-buffered by chunk parity
  const unsigned char* base = table_base(block, global);
  const RowRef* bank = table_at<RowRef>(base, t.bank);
  const int64_t* seg_begin = table_at<int64_t>(base, t.seg_begin);
  const int64_t* seg_end = table_at<int64_t>(base, t.seg_end);
  const int64_t* first_chunk = table_at<int64_t>(base, t.first_chunk);
  const int K = static_cast<int>(t.K);
  const int64_t pitch = similarity_pitch(K);
  const int64_t num_items = first_chunk[t.L];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int parity = 0;
  for (int64_t it = blockIdx.x; it < num_items; it += gridDim.x, parity ^= 1) {
    int64_t lo = 0, hi = t.L - 1;  // the segment l with first_chunk[l] <= it < first_chunk[l + 1]
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first_chunk[mid] <= it) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t item_begin = seg_begin[lo] + (it - first_chunk[lo]) * kChunk;
    const int64_t item_end = min(item_begin + kChunk, seg_end[lo]);
    double q[kPerThread];
    double qq = 0.0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t e = item_begin + static_cast<int64_t>(i) * kThreads + threadIdx.x;
      q[i] = e < item_end ? static_cast<double>(to_acc(query[e * query_stride])) : 0.0;
      qq += q[i] * q[i];
    }
    // Σq² reduced as block_sum does (warp tree, then the warps in order) without a barrier of its own: thread 0
    // adds the warps' sums after the first row group's block_sum, whose barriers order these writes before it. A
    // warp can be one chunk ahead of thread 0 at most (the next block_sum waits for it): two buffers suffice.
    for (int off = 16; off > 0; off >>= 1) qq += __shfl_down_sync(0xffffffffu, qq, off);
    if (lane == 0) query_warps[parity][warp] = qq;
    double* out = partials + it * pitch;
    for (int k0 = 0; k0 < K; k0 += kRowsPerSum) {
      double w[kRowsPerSum * S] = {};
#pragma unroll
      for (int g = 0; g < kRowsPerSum; ++g) {
        if (k0 + g >= K) break;
        const T* __restrict__ r = static_cast<const T*>(bank[k0 + g].ptr);
        const int64_t s = bank[k0 + g].stride;
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          const int64_t e = item_begin + static_cast<int64_t>(i) * kThreads + threadIdx.x;
          if (e < item_end) {
            const double b = static_cast<double>(to_acc(r[e * s]));
            if (Diff) {
              w[g] += (q[i] - b) * (q[i] - b);
            } else {
              w[2 * g] += q[i] * b;
              w[2 * g + 1] += b * b;
            }
          }
        }
      }
      block_sum(w, shared);
      if (threadIdx.x == 0) {
        if (k0 == 0) {
          double total = 0.0;
          for (int w2 = 0; w2 < kWarps; ++w2) total += query_warps[parity][w2];
          out[0] = total;
        }
        for (int g = 0; g < kRowsPerSum && k0 + g < K; ++g) {
          const int k = k0 + g;
          out[1 + 3 * k] = Diff ? 0.0 : w[2 * g];
          out[2 + 3 * k] = Diff ? 0.0 : w[2 * g + 1];
          out[3 + 3 * k] = Diff ? w[g] : 0.0;
        }
      }
    }
  }
}

// stats[l][j] = Σ over segment l's chunks (in order) of partials[chunk][j].
template <size_t NB>
__global__ void segment_sum_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, SimTables t,
                                   const double* __restrict__ partials, double* __restrict__ stats) {
  const int64_t* first_chunk = table_at<int64_t>(table_base(block, global), t.first_chunk);
  const int64_t pitch = similarity_pitch(t.K);
  const int64_t l = blockIdx.x;
  for (int64_t j = threadIdx.x; j < pitch; j += blockDim.x) {
    double total = 0.0;
    for (int64_t it = first_chunk[l]; it < first_chunk[l + 1]; ++it) total += partials[it * pitch + j];
    stats[l * pitch + j] = total;
  }
}

// Scores (NaN for a row whose statistics are not finite, which makes every weight NaN) and softmax weights.
template <typename Out>
__global__ void finalize_kernel(int metric, const double* __restrict__ stats, int64_t L, int64_t K, double eps,
                                double scale, double* __restrict__ scores, double* __restrict__ alpha,
                                Out* __restrict__ weights_out, Out* __restrict__ scores_out,
                                float* __restrict__ blend_f32, double* __restrict__ blend_f64) {
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
    if (blend_f32 != nullptr) blend_f32[k] = static_cast<float>(alpha[k]);
    if (blend_f64 != nullptr) blend_f64[k] = alpha[k];
  }
}

struct Plan {
  ArgPack pack;
  SimTables t{};
  int64_t num_items = 0;
  size_t tables_bytes = 0;  // scratch for tables that do not fit the parameter block
  size_t work_bytes = 0;    // scratch for partials, statistics, scores and weights (doubles)
};

Plan make_plan(const SimilarityArgs& a) {
  Plan p;
  const int64_t K = static_cast<int64_t>(a.bank.size());
  const int64_t L = static_cast<int64_t>(a.seg_begin.size());
  std::vector<int64_t> first_chunk(L + 1, 0);
  for (int64_t l = 0; l < L; ++l)
    first_chunk[l + 1] = first_chunk[l] + (a.seg_end[l] - a.seg_begin[l] + kChunk - 1) / kChunk;
  p.num_items = first_chunk[L];
  p.t.K = K;
  p.t.L = L;
  p.t.bank = p.pack.add(a.bank);
  p.t.seg_begin = p.pack.add(a.seg_begin);
  p.t.seg_end = p.pack.add(a.seg_end);
  p.t.first_chunk = p.pack.add(first_chunk);
  p.tables_bytes = tables_scratch_bytes(p.pack);
  const int64_t pitch = similarity_pitch(K);
  p.work_bytes = sizeof(double) * static_cast<size_t>(p.num_items * pitch + L * pitch + 2 * K);
  return p;
}

template <typename T, typename Block>
void launch_stats(int device, cudaStream_t stream, bool diff, const Block& block, const void* global, SimTables t,
                  const void* query, int64_t query_stride, int64_t num_items, double* partials) {
  if (num_items == 0) return;
  const unsigned grid = grid_for(device, num_items * kThreads, kThreads);
  const T* q = static_cast<const T*>(query);
  if (diff) {
    chunk_stats_kernel<T, true><<<grid, kThreads, 0, stream>>>(block, global, t, q, query_stride, partials);
  } else {
    chunk_stats_kernel<T, false><<<grid, kThreads, 0, stream>>>(block, global, t, q, query_stride, partials);
  }
}

}  // namespace

size_t similarity_scratch_bytes(const SimilarityArgs& args) {
  const Plan p = make_plan(args);
  return p.tables_bytes + p.work_bytes;
}

size_t similarity_weights(int device, uintptr_t stream_handle, const SimilarityArgs& a, Scratch scratch) {
  Plan p = make_plan(a);
  if (p.tables_bytes + p.work_bytes > scratch.bytes) return p.tables_bytes + p.work_bytes;
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  const int64_t K = p.t.K, L = p.t.L, pitch = similarity_pitch(K);
  double* partials = reinterpret_cast<double*>(static_cast<unsigned char*>(scratch.ptr) + p.tables_bytes);
  double* stats = partials + p.num_items * pitch;
  double* d_scores = stats + L * pitch;
  double* d_alpha = d_scores + K;
  const bool diff = a.metric == kMetricL2;
  with_tables(p.pack, stream, scratch, "similarity", [&](const auto& block, const void* global) {
    switch (a.dtype) {
      case DType::F32:
        launch_stats<float>(device, stream, diff, block, global, p.t, a.query, a.query_stride, p.num_items, partials);
        break;
      case DType::F64:
        launch_stats<double>(device, stream, diff, block, global, p.t, a.query, a.query_stride, p.num_items, partials);
        break;
      case DType::F16:
        launch_stats<f16_t>(device, stream, diff, block, global, p.t, a.query, a.query_stride, p.num_items, partials);
        break;
      case DType::BF16:
        launch_stats<bf16_t>(device, stream, diff, block, global, p.t, a.query, a.query_stride, p.num_items, partials);
        break;
    }
    check(cudaGetLastError(), "similarity chunk_stats launch");
    segment_sum_kernel<<<static_cast<unsigned>(L), kThreads, 0, stream>>>(block, global, p.t, partials, stats);
    check(cudaGetLastError(), "similarity segment_sum launch");
  });
  float* blend_f32 = a.blend_weights_f64 ? nullptr : static_cast<float*>(a.blend_weights);
  double* blend_f64 = a.blend_weights_f64 ? static_cast<double*>(a.blend_weights) : nullptr;
  if (a.out_dtype == DType::F64) {
    finalize_kernel<double><<<1, kThreads, 0, stream>>>(a.metric, stats, L, K, a.eps, a.scale, d_scores, d_alpha,
                                                        static_cast<double*>(a.weights), static_cast<double*>(a.scores),
                                                        blend_f32, blend_f64);
  } else {
    finalize_kernel<float><<<1, kThreads, 0, stream>>>(a.metric, stats, L, K, a.eps, a.scale, d_scores, d_alpha,
                                                       static_cast<float*>(a.weights), static_cast<float*>(a.scores),
                                                       blend_f32, blend_f64);
  }
  check(cudaGetLastError(), "similarity finalize launch");
  return 0;
}

}  // namespace pfk::cuda
