// CUDA aggregation kernel: out = (accumulate ? out : 0) + sum_k w_k * u_k, one pass over memory, fp32
// accumulation for 16-bit storage. The row table (pointer, stride) and host weights travel in the kernel's
// parameters (cuda_common.cuh); device weights are read where they are. Contiguous 16-byte-aligned inputs use
// 16-byte vector loads. A row whose weight is 0 is not read.
#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

template <typename T, size_t NB>
__global__ void weighted_sum_vec_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global,
                                        RowTables tables, const typename AccOf<T>::type* device_weights,
                                        T* __restrict__ out, int64_t d, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  constexpr int N = 16 / sizeof(T);
  using P = Pack<T, N>;
  const unsigned char* base = table_base(block, global);
  const RowRef* rows = table_at<RowRef>(base, tables.rows);
  const Acc* weights = device_weights != nullptr ? device_weights : table_at<Acc>(base, tables.weights);
  const int K = static_cast<int>(tables.count);
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
      const Acc w = weights[k];
      if (w == Acc(0)) continue;
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
    for (int k = 0; k < K; ++k) {
      const Acc w = weights[k];
      if (w != Acc(0)) acc = acc + w * to_acc(static_cast<const T*>(rows[k].ptr)[i]);
    }
    out[i] = Store<T>::from(acc);
  }
}

template <typename T, size_t NB>
__global__ void weighted_sum_strided_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global,
                                            RowTables tables, const typename AccOf<T>::type* device_weights,
                                            T* __restrict__ out, int64_t out_stride, int64_t d, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  const unsigned char* base = table_base(block, global);
  const RowRef* rows = table_at<RowRef>(base, tables.rows);
  const Acc* weights = device_weights != nullptr ? device_weights : table_at<Acc>(base, tables.weights);
  const int K = static_cast<int>(tables.count);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
    Acc acc = accumulate ? to_acc(out[i * out_stride]) : Acc(0);
    for (int k = 0; k < K; ++k) {
      const Acc w = weights[k];
      if (w != Acc(0)) acc = acc + w * to_acc(static_cast<const T*>(rows[k].ptr)[i * rows[k].stride]);
    }
    out[i * out_stride] = Store<T>::from(acc);
  }
}

// The call's parameter tables: the rows, then (host weights only) one accumulator-typed weight per row.
template <typename T>
RowTables pack_tables(const WeightedSumCall& c, ArgPack& pack) {
  using Acc = typename AccOf<T>::type;
  RowTables tables{};
  tables.count = static_cast<int64_t>(c.rows.size());
  tables.rows = pack.add(c.rows);
  if (c.device_weights == nullptr) tables.weights = pack.add(std::vector<Acc>(c.weights.begin(), c.weights.end()));
  return tables;
}

template <typename T>
size_t scratch_bytes(const WeightedSumCall& c) {
  ArgPack pack;
  pack_tables<T>(c, pack);
  return tables_scratch_bytes(pack);
}

template <typename T>
size_t launch(int device, cudaStream_t stream, const WeightedSumCall& c, Scratch scratch) {
  using Acc = typename AccOf<T>::type;
  ArgPack pack;
  const RowTables tables = pack_tables<T>(c, pack);
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  if (tables.count == 0 && c.accumulate) return 0;  // nothing to add
  bool vectorizable = c.out_stride == 1 && aligned16(c.out);
  for (const auto& r : c.rows) vectorizable = vectorizable && r.stride == 1 && aligned16(r.ptr);
  constexpr int kThreads = 256;
  const auto* dw = static_cast<const Acc*>(c.device_weights);
  T* o = static_cast<T*>(c.out);
  with_tables(pack, stream, scratch, "weighted_sum", [&](const auto& block, const void* global) {
    if (vectorizable) {
      const int64_t work = c.d / (16 / static_cast<int64_t>(sizeof(T))) + 1;
      weighted_sum_vec_kernel<T>
          <<<grid_for(device, work, kThreads), kThreads, 0, stream>>>(block, global, tables, dw, o, c.d, c.accumulate);
    } else {
      weighted_sum_strided_kernel<T><<<grid_for(device, c.d, kThreads), kThreads, 0, stream>>>(
          block, global, tables, dw, o, c.out_stride, c.d, c.accumulate);
    }
  });
  check(cudaGetLastError(), "weighted_sum kernel launch");
  return 0;
}

}  // namespace

size_t weighted_sum_scratch_bytes(DType dtype, const WeightedSumCall& call) {
  switch (dtype) {
    case DType::F32:
      return scratch_bytes<float>(call);
    case DType::F64:
      return scratch_bytes<double>(call);
    case DType::F16:
      return scratch_bytes<f16_t>(call);
    case DType::BF16:
      return scratch_bytes<bf16_t>(call);
  }
  return 0;
}

size_t weighted_sum(int device, uintptr_t stream_handle, DType dtype, const WeightedSumCall& call, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch<float>(device, stream, call, scratch);
    case DType::F64:
      return launch<double>(device, stream, call, scratch);
    case DType::F16:
      return launch<f16_t>(device, stream, call, scratch);
    case DType::BF16:
      return launch<bf16_t>(device, stream, call, scratch);
  }
  return 0;
}

}  // namespace pfk::cuda
