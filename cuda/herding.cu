// CUDA herding kernels: the greedy herding order on float64 Gram matrices (one warp per client with the running
// inner products c in registers up to tau = 512; above, one block per client with c in shared or global memory),
// the masked row sum that forms each client's message, and GraB's online balancing (two kernels per gradient, the
// decision read on the device: no host synchronisation). Per-client tables travel in the kernel parameters and
// scratch comes from the caller's library (cuda_common.cuh).
#include <math_constants.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kWarpGreedyLimit = 512;   // clients with ld <= this run one warp each (greedy_warp_kernel)
constexpr int64_t kSharedGramLimit = 4096;  // larger ones with ld <= this keep c (8 * ld bytes) in shared memory
constexpr int64_t kGrabChunk = 4096;        // elements per block in the GraB kernels (fixed: deterministic sums)

// Block-wide minimum of one double per thread (NaN ignored), returned to every thread.
__device__ __forceinline__ double block_min(double v, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmin(v, __shfl_down_sync(0xffffffffu, v, offset));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) v = fmin(v, scratch[w]);
    scratch[0] = v;
  }
  __syncthreads();
  const double result = scratch[0];
  __syncthreads();
  return result;
}

// Block-wide minimum of one int per thread, returned to every thread.
__device__ __forceinline__ int block_min(int v, int* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_down_sync(0xffffffffu, v, offset));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) v = min(v, scratch[w]);
    scratch[0] = v;
  }
  __syncthreads();
  const int result = scratch[0];
  __syncthreads();
  return result;
}

// One client per block: k greedy steps, each a minimum over the remaining scores 2 c_m + G_mm, then the lowest
// index within tie_tolerance of it (the same rule as the CPU loop), then c += G[j, :].
// Offsets of the greedy kernel's tables: one tau and one k per client.
struct GreedyTables {
  int64_t taus;
  int64_t ks;
};

template <bool SharedC, size_t NB>
__global__ void greedy_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, GreedyTables t,
                              const double* __restrict__ gram, int64_t ld, double rel_tol, int64_t* __restrict__ order,
                              int64_t kmax, uint8_t* __restrict__ mask, double* __restrict__ sq_norm,
                              double* __restrict__ c_global) {
  extern __shared__ double c_shared[];
  __shared__ double dscratch[kWarps];
  __shared__ int iscratch[kWarps];
  constexpr int kNone = 0x7fffffff;
  const unsigned char* base = table_base(block, global);
  const int64_t client = blockIdx.x;
  const int tau = static_cast<int>(table_at<int64_t>(base, t.taus)[client]);
  const int64_t k = table_at<int64_t>(base, t.ks)[client];
  const double* G = gram + client * ld * ld;
  uint8_t* taken = mask + client * ld;
  double* c = SharedC ? c_shared : c_global + client * ld;
  const int tid = threadIdx.x;
  for (int64_t m = tid; m < ld; m += kThreads) {
    taken[m] = 0;
    if (m < tau) c[m] = 0.0;
  }
  __syncthreads();
  double s2 = 0.0, picked = 0.0;  // kept identical in every thread
  for (int64_t step = 0; step < k; ++step) {
    double local = CUDART_INF;
    for (int m = tid; m < tau; m += kThreads) {  // each thread owns the same m's for c and taken: no races
      if (!taken[m]) local = fmin(local, 2.0 * c[m] + G[static_cast<int64_t>(m) * ld + m]);
    }
    const double best = block_min(local, dscratch);
    int first_tied = kNone, first_left = kNone;
    for (int m = tid; m < tau; m += kThreads) {
      if (taken[m]) continue;
      const double gmm = G[static_cast<int64_t>(m) * ld + m];
      if (first_left == kNone) first_left = m;
      if (first_tied == kNone && 2.0 * c[m] + gmm <= best + tie_tolerance(rel_tol, gmm, picked)) first_tied = m;
    }
    int j = block_min(first_tied, iscratch);
    if (j == kNone) j = block_min(first_left, iscratch);  // only NaN scores left (uniform branch)
    const double gjj = G[static_cast<int64_t>(j) * ld + j];
    s2 += 2.0 * c[j] + gjj;  // c[j] was last written by its owner before the barriers in block_min
    picked += gjj;
    __syncthreads();  // every thread has read c[j] before it changes
    if (tid == 0) order[client * kmax + step] = j;
    if (j % kThreads == tid) taken[j] = 1;
    const double* row = G + static_cast<int64_t>(j) * ld;
    for (int m = tid; m < tau; m += kThreads) c[m] += row[m];
  }
  for (int64_t step = k + tid; step < kmax; step += kThreads) order[client * kmax + step] = -1;
  if (tid == 0) sq_norm[client] = s2;
}

// Warp-wide minima (every lane gets the result).
__device__ __forceinline__ double warp_min(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmin(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ int warp_min(int v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// greedy_kernel's loop with one warp per client and no block barrier, for ld <= 32 * PerLane: lane l owns
// m = l + 32 i (i < PerLane) and keeps c_m, G_mm and whether m is taken in registers. The same operations in the
// same order as greedy_kernel, so the same picks and the same bits.
template <int PerLane, size_t NB>
__global__ void greedy_warp_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, GreedyTables t,
                                   const double* __restrict__ gram, int64_t ld, double rel_tol,
                                   int64_t* __restrict__ order, int64_t kmax, uint8_t* __restrict__ mask,
                                   double* __restrict__ sq_norm) {
  constexpr int kNone = 0x7fffffff;
  const unsigned char* base = table_base(block, global);
  const int64_t client = blockIdx.x;
  const int tau = static_cast<int>(table_at<int64_t>(base, t.taus)[client]);
  const int64_t k = table_at<int64_t>(base, t.ks)[client];
  const double* G = gram + client * ld * ld;
  const int lane = threadIdx.x;
  double c[PerLane], diag[PerLane];
  unsigned taken = 0;  // bit i: m = lane + 32 i has been picked
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int m = lane + 32 * i;
    c[i] = 0.0;
    diag[i] = m < tau ? G[static_cast<int64_t>(m) * ld + m] : 0.0;
  }
  double s2 = 0.0, picked = 0.0;  // identical in every lane
  for (int64_t step = 0; step < k; ++step) {
    double local = CUDART_INF;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {
      if (lane + 32 * i < tau && !((taken >> i) & 1u)) local = fmin(local, 2.0 * c[i] + diag[i]);
    }
    const double best = warp_min(local);
    int first_tied = kNone, first_left = kNone;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {  // ascending m within the lane
      const int m = lane + 32 * i;
      if (m >= tau || ((taken >> i) & 1u)) continue;
      if (first_left == kNone) first_left = m;
      if (first_tied == kNone && 2.0 * c[i] + diag[i] <= best + tie_tolerance(rel_tol, diag[i], picked)) {
        first_tied = m;
      }
    }
    int j = warp_min(first_tied);
    if (j == kNone) j = warp_min(first_left);  // only NaN scores left (uniform branch)
    const int owner = j & 31, slot = j >> 5;
    double cj = 0.0, gjj = 0.0;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {  // register select: the slot index is not known at compile time
      if (i == slot) {
        cj = c[i];
        gjj = diag[i];
      }
    }
    cj = __shfl_sync(0xffffffffu, cj, owner);
    gjj = __shfl_sync(0xffffffffu, gjj, owner);
    s2 += 2.0 * cj + gjj;
    picked += gjj;
    if (lane == 0) order[client * kmax + step] = j;
    if (lane == owner) taken |= 1u << slot;
    const double* row = G + static_cast<int64_t>(j) * ld;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {
      const int m = lane + 32 * i;
      if (m < tau) c[i] += row[m];
    }
  }
  for (int64_t step = k + lane; step < kmax; step += 32) order[client * kmax + step] = -1;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int m = lane + 32 * i;
    if (m < ld) mask[client * ld + m] = static_cast<uint8_t>((taken >> i) & 1u);
  }
  if (lane == 0) sq_norm[client] = s2;
}

// Calls fn(std::integral_constant<int, P>) with the smallest P in {1, 2, 4, 8, 16} such that 32 P >= ld (ld <= 512;
// P = 32 would spill registers).
template <typename Fn>
void with_per_lane(int64_t ld, Fn&& fn) {
  if (ld <= 32) {
    fn(std::integral_constant<int, 1>{});
  } else if (ld <= 64) {
    fn(std::integral_constant<int, 2>{});
  } else if (ld <= 128) {
    fn(std::integral_constant<int, 4>{});
  } else if (ld <= 256) {
    fn(std::integral_constant<int, 8>{});
  } else {
    fn(std::integral_constant<int, 16>{});
  }
}

template <typename T, size_t NB>
__global__ void masked_sum_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global,
                                  int64_t clients_offset, const uint8_t* __restrict__ mask, int64_t mask_stride,
                                  int64_t d, T* __restrict__ out, int64_t out_row_stride, int64_t out_col_stride) {
  using Acc = typename AccOf<T>::type;
  const MatrixView y = table_at<MatrixView>(table_base(block, global), clients_offset)[blockIdx.y];
  const uint8_t* mk = mask + static_cast<int64_t>(blockIdx.y) * mask_stride;
  T* o = out + static_cast<int64_t>(blockIdx.y) * out_row_stride;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < d; j += step) {
    Acc acc = Acc(0);
    const T* col = static_cast<const T*>(y.ptr) + j * y.col_stride;
    int64_t r = 0;
    for (; r + 4 <= y.rows; r += 4) {  // four rows' loads in flight, then added in row order
      bool in[4];
      Acc x[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        in[q] = mk[r + q] != 0;
        x[q] = in[q] ? to_acc(col[(r + q) * y.row_stride]) : Acc(0);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (in[q]) acc = acc + x[q];
      }
    }
    for (; r < y.rows; ++r) {
      if (mk[r]) acc = acc + to_acc(col[r * y.row_stride]);
    }
    o[j * out_col_stride] = Store<T>::from(acc);
  }
}

// Block sum of one double per thread in a fixed tree order.
__device__ __forceinline__ double block_sum(double v, double* warp_sums) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  return total;
}

template <typename T>
__global__ void grab_dot_kernel(const T* __restrict__ row, int64_t cs, int64_t d, typename AccOf<T>::type* mean,
                                const typename AccOf<T>::type* __restrict__ s, typename AccOf<T>::type divisor,
                                bool running_mean, double* __restrict__ partial) {
  using Acc = typename AccOf<T>::type;
  __shared__ double warp_sums[kWarps];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kGrabChunk;
  const int64_t hi = min(d, lo + kGrabChunk);
  double dot = 0.0;
  for (int64_t j = lo + threadIdx.x; j < hi; j += kThreads) {
    const Acc v = to_acc(row[j * cs]);
    const Acc m = running_mean ? mean[j] + (v - mean[j]) / divisor : mean[j] + v / divisor;
    mean[j] = m;
    dot += static_cast<double>(s[j]) * static_cast<double>(v - m);
  }
  const double total = block_sum(dot, warp_sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

template <typename T>
__global__ void grab_update_kernel(const T* __restrict__ row, int64_t cs, int64_t d,
                                   const typename AccOf<T>::type* __restrict__ mean, typename AccOf<T>::type* s,
                                   typename AccOf<T>::type* g, const double* __restrict__ partial, int nparts,
                                   uint8_t* picked) {
  using Acc = typename AccOf<T>::type;
  __shared__ int pick;
  if (threadIdx.x == 0) {
    double dot = 0.0;
    for (int p = 0; p < nparts; ++p) dot += partial[p];
    pick = dot < 0.0;
    if (blockIdx.x == 0) *picked = pick ? 1 : 0;
  }
  __syncthreads();
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kGrabChunk;
  const int64_t hi = min(d, lo + kGrabChunk);
  for (int64_t j = lo + threadIdx.x; j < hi; j += kThreads) {
    const Acc v = to_acc(row[j * cs]);
    const Acc z = v - mean[j];
    if (pick) {
      s[j] = s[j] + z;
      g[j] = g[j] + v;
    } else {
      s[j] = s[j] - z;
    }
  }
}

template <typename T>
size_t launch_masked_sum(int device, cudaStream_t stream, int64_t d, const std::vector<MatrixView>& clients,
                         const uint8_t* mask, int64_t mask_stride, void* out, int64_t out_row_stride,
                         int64_t out_col_stride, Scratch scratch) {
  ArgPack pack;
  const int64_t offset = pack.add(clients);
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  const dim3 grid(grid_for(device, d, kThreads), static_cast<unsigned>(clients.size()));
  with_tables(pack, stream, scratch, "herding masked sum", [&](const auto& block, const void* global) {
    masked_sum_kernel<T><<<grid, kThreads, 0, stream>>>(block, global, offset, mask, mask_stride, d,
                                                        static_cast<T*>(out), out_row_stride, out_col_stride);
  });
  check(cudaGetLastError(), "herding masked sum kernel launch");
  return 0;
}

template <typename T>
size_t launch_grab(cudaStream_t stream, const MatrixView& y, int64_t d, void* mean, void* s, void* g, uint8_t* picked,
                   int64_t first_step, int64_t tau, bool running_mean, Scratch scratch) {
  using Acc = typename AccOf<T>::type;
  const int64_t nparts = (d + kGrabChunk - 1) / kGrabChunk;
  if (const size_t need = static_cast<size_t>(nparts) * sizeof(double); need > scratch.bytes) return need;
  double* partial = static_cast<double*>(scratch.ptr);
  Acc* mu = static_cast<Acc*>(mean);
  Acc* sp = static_cast<Acc*>(s);
  Acc* gp = static_cast<Acc*>(g);
  const T* base = static_cast<const T*>(y.ptr);
  for (int64_t r = 0; r < y.rows; ++r) {
    const T* row = base + r * y.row_stride;
    const Acc divisor = running_mean ? Acc(first_step + r) : Acc(tau);
    grab_dot_kernel<T><<<static_cast<unsigned>(nparts), kThreads, 0, stream>>>(row, y.col_stride, d, mu, sp, divisor,
                                                                               running_mean, partial);
    grab_update_kernel<T><<<static_cast<unsigned>(nparts), kThreads, 0, stream>>>(
        row, y.col_stride, d, mu, sp, gp, partial, static_cast<int>(nparts), picked + r);
  }
  check(cudaGetLastError(), "GraB kernel launch");
  return 0;
}

}  // namespace

size_t herding_greedy(int device, uintptr_t stream_handle, const double* gram, int64_t ld,
                      const std::vector<int64_t>& taus, const std::vector<int64_t>& ks, double rel_tol, int64_t* order,
                      int64_t kmax, uint8_t* mask, double* sq_norm, Scratch scratch) {
  const size_t n = taus.size();
  ArgPack pack;
  GreedyTables t{};
  t.taus = pack.add(taus);
  t.ks = pack.add(ks);
  const size_t tables = tables_scratch_bytes(pack);
  const bool shared_c = ld <= kSharedGramLimit;
  const size_t need = tables + (shared_c ? 0 : n * static_cast<size_t>(ld) * sizeof(double));
  if (need > scratch.bytes) return need;
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  const unsigned blocks = static_cast<unsigned>(n);
  double* c = reinterpret_cast<double*>(static_cast<unsigned char*>(scratch.ptr) + tables);
  with_tables(pack, stream, scratch, "herding greedy", [&](const auto& block, const void* global) {
    if (ld <= kWarpGreedyLimit) {
      with_per_lane(ld, [&](auto per_lane) {
        greedy_warp_kernel<decltype(per_lane)::value>
            <<<blocks, 32, 0, stream>>>(block, global, t, gram, ld, rel_tol, order, kmax, mask, sq_norm);
      });
    } else if (shared_c) {
      const size_t shared = static_cast<size_t>(ld) * sizeof(double);
      greedy_kernel<true><<<blocks, kThreads, shared, stream>>>(block, global, t, gram, ld, rel_tol, order, kmax, mask,
                                                                sq_norm, nullptr);
    } else {
      greedy_kernel<false>
          <<<blocks, kThreads, 0, stream>>>(block, global, t, gram, ld, rel_tol, order, kmax, mask, sq_norm, c);
    }
  });
  check(cudaGetLastError(), "herding greedy kernel launch");
  return 0;
}

size_t herding_masked_sum(int device, uintptr_t stream_handle, DType dtype, int64_t d,
                          const std::vector<MatrixView>& clients, const uint8_t* mask, int64_t mask_stride, void* out,
                          int64_t out_row_stride, int64_t out_col_stride, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_masked_sum<float>(device, stream, d, clients, mask, mask_stride, out, out_row_stride,
                                      out_col_stride, scratch);
    case DType::F64:
      return launch_masked_sum<double>(device, stream, d, clients, mask, mask_stride, out, out_row_stride,
                                       out_col_stride, scratch);
    case DType::F16:
      return launch_masked_sum<f16_t>(device, stream, d, clients, mask, mask_stride, out, out_row_stride,
                                      out_col_stride, scratch);
    case DType::BF16:
      return launch_masked_sum<bf16_t>(device, stream, d, clients, mask, mask_stride, out, out_row_stride,
                                       out_col_stride, scratch);
  }
  return 0;
}

size_t grab_steps(int device, uintptr_t stream_handle, DType dtype, const MatrixView& y, int64_t d, void* mean, void* s,
                  void* g, uint8_t* picked, int64_t first_step, int64_t tau, bool running_mean, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_grab<float>(stream, y, d, mean, s, g, picked, first_step, tau, running_mean, scratch);
    case DType::F64:
      return launch_grab<double>(stream, y, d, mean, s, g, picked, first_step, tau, running_mean, scratch);
    case DType::F16:
      return launch_grab<f16_t>(stream, y, d, mean, s, g, picked, first_step, tau, running_mean, scratch);
    case DType::BF16:
      return launch_grab<bf16_t>(stream, y, d, mean, s, g, picked, first_step, tau, running_mean, scratch);
  }
  return 0;
}

}  // namespace pfk::cuda
