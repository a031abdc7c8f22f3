// CUDA FedPBC server kernels (see csrc/pbc.cpp): one thread per column element in a grid-stride loop; each
// element walks its rows in the order given, so results are deterministic. fp32 accumulation for 16-bit storage.
#include <vector>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

struct DevRow {
  void* ptr;
  int64_t stride;
};

template <typename T>
__device__ __forceinline__ T& at(const DevRow& r, int64_t j) {
  return static_cast<T*>(r.ptr)[j * r.stride];
}

template <typename T>
__global__ void agg_bcast_kernel(const DevRow* __restrict__ rows, int K, int64_t d, T* __restrict__ server,
                                 int64_t server_stride) {
  using Acc = typename AccOf<T>::type;
  const Acc inv_k = Acc(1) / Acc(K);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < d; j += step) {
    Acc acc = Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + to_acc(at<T>(rows[k], j));
    const T mean = Store<T>::from(acc * inv_k);
    server[j * server_stride] = mean;
    for (int k = 0; k < K; ++k) at<T>(rows[k], j) = mean;
  }
}

template <typename T>
__global__ void weighted_delta_kernel(const DevRow* __restrict__ rows, const double* __restrict__ weights, int K,
                                      int64_t d, T* __restrict__ x, int64_t x_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < d; j += step) {
    const Acc base = to_acc(x[j * x_stride]);
    Acc acc = Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + Acc(weights[k]) * (to_acc(at<T>(rows[k], j)) - base);
    x[j * x_stride] = Store<T>::from(base + acc);
  }
}

template <typename T>
__global__ void mifa_kernel(DevRow x, DevRow total, const DevRow* __restrict__ updates,
                            const DevRow* __restrict__ memory, int K, const DevRow* __restrict__ all_memory, int M,
                            int64_t d, double coef, bool subtract_x) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < d; j += step) {
    const Acc xv = to_acc(at<T>(x, j));
    Acc sv = to_acc(at<T>(total, j));
    for (int k = 0; k < K; ++k) {
      const Acc u = to_acc(at<T>(updates[k], j));
      const T stored = Store<T>::from(subtract_x ? u - xv : u);
      T& mem = at<T>(memory[k], j);
      sv = sv + (to_acc(stored) - to_acc(mem));
      mem = stored;
    }
    if (M > 0) {
      sv = Acc(0);
      for (int i = 0; i < M; ++i) sv = sv + to_acc(at<T>(all_memory[i], j));
    }
    const T s = Store<T>::from(sv);
    at<T>(total, j) = s;
    at<T>(x, j) = Store<T>::from(xv + Acc(coef) * to_acc(s));
  }
}

std::vector<DevRow> to_dev(const std::vector<PbcRow>& rows) {
  std::vector<DevRow> out;
  out.reserve(rows.size());
  for (const auto& r : rows) out.push_back({r.ptr, r.stride});
  return out;
}

constexpr int kThreads = 256;

template <typename T>
void launch_agg_bcast(int device, cudaStream_t stream, int64_t d, const std::vector<PbcRow>& rows, void* server,
                      int64_t server_stride) {
  const std::vector<DevRow> table = to_dev(rows);
  StreamCopy<DevRow> dev_rows(table.data(), table.size(), stream);
  agg_bcast_kernel<T><<<grid_for(device, d, kThreads), kThreads, 0, stream>>>(
      dev_rows.get(), static_cast<int>(table.size()), d, static_cast<T*>(server), server_stride);
  check(cudaGetLastError(), "pbc_agg_bcast kernel launch");
}

template <typename T>
void launch_weighted_delta(int device, cudaStream_t stream, int64_t d, const std::vector<PbcRow>& rows,
                           const std::vector<double>& weights, void* x, int64_t x_stride) {
  const std::vector<DevRow> table = to_dev(rows);
  StreamCopy<DevRow> dev_rows(table.data(), table.size(), stream);
  StreamCopy<double> dev_weights(weights.data(), weights.size(), stream);
  weighted_delta_kernel<T><<<grid_for(device, d, kThreads), kThreads, 0, stream>>>(
      dev_rows.get(), dev_weights.get(), static_cast<int>(table.size()), d, static_cast<T*>(x), x_stride);
  check(cudaGetLastError(), "weighted_delta kernel launch");
}

template <typename T>
void launch_mifa(int device, cudaStream_t stream, int64_t d, const MifaArgs& a) {
  const std::vector<DevRow> upd = to_dev(a.updates), mem = to_dev(a.memory), all = to_dev(a.all_memory);
  StreamCopy<DevRow> dev_upd(upd.data(), upd.size(), stream);
  StreamCopy<DevRow> dev_mem(mem.data(), mem.size(), stream);
  StreamCopy<DevRow> dev_all(all.data(), all.size(), stream);
  mifa_kernel<T><<<grid_for(device, d, kThreads), kThreads, 0, stream>>>(
      DevRow{a.x.ptr, a.x.stride}, DevRow{a.total.ptr, a.total.stride}, dev_upd.get(), dev_mem.get(),
      static_cast<int>(upd.size()), dev_all.get(), static_cast<int>(all.size()), d, a.coef, a.subtract_x);
  check(cudaGetLastError(), "mifa_update kernel launch");
}

}  // namespace

void pbc_agg_bcast(int device, uintptr_t stream_handle, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                   void* server, int64_t server_stride) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_agg_bcast<float>(device, stream, d, rows, server, server_stride);
    case DType::F64:
      return launch_agg_bcast<double>(device, stream, d, rows, server, server_stride);
    case DType::F16:
      return launch_agg_bcast<f16_t>(device, stream, d, rows, server, server_stride);
    case DType::BF16:
      return launch_agg_bcast<bf16_t>(device, stream, d, rows, server, server_stride);
  }
}

void weighted_delta(int device, uintptr_t stream_handle, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                    const std::vector<double>& weights, void* x, int64_t x_stride) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_weighted_delta<float>(device, stream, d, rows, weights, x, x_stride);
    case DType::F64:
      return launch_weighted_delta<double>(device, stream, d, rows, weights, x, x_stride);
    case DType::F16:
      return launch_weighted_delta<f16_t>(device, stream, d, rows, weights, x, x_stride);
    case DType::BF16:
      return launch_weighted_delta<bf16_t>(device, stream, d, rows, weights, x, x_stride);
  }
}

void mifa_update(int device, uintptr_t stream_handle, DType dtype, int64_t d, const MifaArgs& args) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_mifa<float>(device, stream, d, args);
    case DType::F64:
      return launch_mifa<double>(device, stream, d, args);
    case DType::F16:
      return launch_mifa<f16_t>(device, stream, d, args);
    case DType::BF16:
      return launch_mifa<bf16_t>(device, stream, d, args);
  }
}

}  // namespace pfk::cuda
