// CUDA aggregation kernel: out = (accumulate ? out : 0) + sum_k w_k * u_k, one pass over memory, fp32
// accumulation for 16-bit storage. Contiguous 16-byte-aligned inputs use 16-byte vector loads.
#include <vector>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

template <typename T>
struct DeviceRow {
  const T* ptr;
  int64_t stride;
  typename AccOf<T>::type weight;
};

template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

template <typename T>
__global__ void weighted_sum_vec_kernel(T* __restrict__ out, const DeviceRow<T>* __restrict__ rows, int K, int64_t d,
                                        bool accumulate) {
  using Acc = typename AccOf<T>::type;
  constexpr int N = 16 / sizeof(T);
  using P = Pack<T, N>;
  const int64_t nvec = d / N;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    Acc acc[N];
    if (accumulate) {
      const P p = reinterpret_cast<const P*>(out)[v];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = to_acc(p.v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = Acc(0);
    }
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const Acc w = rows[k].weight;
      const P p = reinterpret_cast<const P*>(rows[k].ptr)[v];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = acc[i] + w * to_acc(p.v[i]);
    }
    P r;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = Store<T>::from(acc[i]);
    reinterpret_cast<P*>(out)[v] = r;
  }
  for (int64_t i = nvec * N + first; i < d; i += step) {  // the last d % N elements
    Acc acc = accumulate ? to_acc(out[i]) : Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + rows[k].weight * to_acc(rows[k].ptr[i]);
    out[i] = Store<T>::from(acc);
  }
}

template <typename T>
__global__ void weighted_sum_strided_kernel(T* __restrict__ out, int64_t out_stride,
                                            const DeviceRow<T>* __restrict__ rows, int K, int64_t d, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
    Acc acc = accumulate ? to_acc(out[i * out_stride]) : Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + rows[k].weight * to_acc(rows[k].ptr[i * rows[k].stride]);
    out[i * out_stride] = Store<T>::from(acc);
  }
}

template <typename T>
void launch(int device, cudaStream_t stream, int64_t d, void* out, int64_t out_stride,
            const std::vector<WeightedRow>& rows, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  std::vector<DeviceRow<T>> table;
  table.reserve(rows.size());
  bool vectorizable = out_stride == 1 && aligned16(out);
  for (const auto& r : rows) {
    table.push_back({static_cast<const T*>(r.ptr), r.stride, static_cast<Acc>(r.weight)});
    vectorizable = vectorizable && r.stride == 1 && aligned16(r.ptr);
  }
  StreamCopy<DeviceRow<T>> device_table(table.data(), table.size(), stream);
  constexpr int kThreads = 256;
  const int K = static_cast<int>(table.size());
  T* o = static_cast<T*>(out);
  if (vectorizable) {
    const int64_t work = d / (16 / static_cast<int64_t>(sizeof(T))) + 1;
    weighted_sum_vec_kernel<T>
        <<<grid_for(device, work, kThreads), kThreads, 0, stream>>>(o, device_table.get(), K, d, accumulate);
  } else {
    weighted_sum_strided_kernel<T>
        <<<grid_for(device, d, kThreads), kThreads, 0, stream>>>(o, out_stride, device_table.get(), K, d, accumulate);
  }
  check(cudaGetLastError(), "weighted_sum kernel launch");
}

}  // namespace

void weighted_sum(int device, uintptr_t stream_handle, DType dtype, int64_t d, void* out, int64_t out_stride,
                  const std::vector<WeightedRow>& rows, bool accumulate) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch<float>(device, stream, d, out, out_stride, rows, accumulate);
    case DType::F64:
      return launch<double>(device, stream, d, out, out_stride, rows, accumulate);
    case DType::F16:
      return launch<f16_t>(device, stream, d, out, out_stride, rows, accumulate);
    case DType::BF16:
      return launch<bf16_t>(device, stream, d, out, out_stride, rows, accumulate);
  }
}

}  // namespace pfk::cuda
