// CUDA aggregation kernel: out = (accumulate ? out : 0) + sum_k w_k * u_k, one pass over memory, fp32
// accumulation for 16-bit storage. The rows (a table of pointers and strides, or a stack read without one) and host
// weights travel in the kernel's parameters (cuda_common.cuh); device weights are read where they are. Contiguous
// rows use 16-byte vector accesses when every row and the output are 16-byte aligned, else 8-byte ones when they
// are 8-byte aligned (a flat model of odd length makes every other row of a stack 8-byte aligned only). A row whose
// weight is 0 is not read.
#include <algorithm>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

// Row k's address and element stride, from the table or the stack.
struct RowsView {
  const RowRef* table;
  RowStack stack;
  __device__ __forceinline__ const void* ptr(int k) const {
    return table != nullptr ? table[k].ptr : static_cast<const unsigned char*>(stack.base) + k * stack.step_bytes;
  }
  __device__ __forceinline__ int64_t stride(int k) const {
    return table != nullptr ? table[k].stride : stack.col_stride;
  }
};

template <size_t NB>
__device__ __forceinline__ RowsView rows_of(const ArgBlock<NB>& block, const void* global, const RowTables& t) {
  return {t.rows >= 0 ? table_at<RowRef>(table_base(block, global), t.rows) : nullptr, t.stack};
}

template <typename T, size_t NB>
__device__ __forceinline__ const typename AccOf<T>::type* weights_of(const ArgBlock<NB>& block, const void* global,
                                                                     const RowTables& t,
                                                                     const typename AccOf<T>::type* device_weights) {
  return device_weights != nullptr ? device_weights
                                   : table_at<typename AccOf<T>::type>(table_base(block, global), t.weights);
}

// W elements per access in the body, then the last d % W elements one by one. Rows are read four at a time (four
// loads in flight per thread) and added in row order. SkipZero: the weights may hold zeros, whose rows are neither
// read nor added (device weights, or a stack with zero weights); otherwise every row of the table is read.
template <typename T, int W, bool SkipZero, size_t NB>
__global__ void weighted_sum_vec_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, RowTables t,
                                        const typename AccOf<T>::type* device_weights, T* __restrict__ out, int64_t d,
                                        bool accumulate) {
  using Acc = typename AccOf<T>::type;
  const RowsView rows = rows_of(block, global, t);
  const Acc* weights = weights_of<T>(block, global, t, device_weights);
  const int K = static_cast<int>(t.count);
  const int64_t nvec = d / W;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t it = first; it < nvec; it += step) {
    // Last packs first: rows just written or read front to back (a training step, similarity's statistics pass)
    // still have their end in L2 when this pass starts; each element's sum is the same in any order.
    const int64_t v = nvec - 1 - it;
    Acc acc[W];
    if (accumulate) {
      load_pack<W>(out, v, acc);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = Acc(0);
    }
    int k = 0;
    for (; k + 4 <= K; k += 4) {
      Acc w[4], x[4][W];
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = weights[k + j];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // the four loads are issued together (predicated on the weights)
        if (!SkipZero || w[j] != Acc(0)) load_pack<W>(static_cast<const T*>(rows.ptr(k + j)), v, x[j]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (SkipZero && w[j] == Acc(0)) continue;
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] = acc[i] + w[j] * x[j][i];
      }
    }
    for (; k < K; ++k) {
      const Acc w = weights[k];
      if (SkipZero && w == Acc(0)) continue;
      Acc x[W];
      load_pack<W>(static_cast<const T*>(rows.ptr(k)), v, x);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = acc[i] + w * x[i];
    }
    store_pack<W>(out, v, acc);
  }
  for (int64_t i = nvec * W + first; i < d; i += step) {
    Acc acc = accumulate ? to_acc(out[i]) : Acc(0);
    for (int k = 0; k < K; ++k) {
      const Acc w = weights[k];
      if (!SkipZero || w != Acc(0)) acc = acc + w * to_acc(static_cast<const T*>(rows.ptr(k))[i]);
    }
    out[i] = Store<T>::from(acc);
  }
}

template <typename T, size_t NB>
__global__ void weighted_sum_strided_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, RowTables t,
                                            const typename AccOf<T>::type* device_weights, T* __restrict__ out,
                                            int64_t out_stride, int64_t d, bool accumulate) {
  using Acc = typename AccOf<T>::type;
  const RowsView rows = rows_of(block, global, t);
  const Acc* weights = weights_of<T>(block, global, t, device_weights);
  const int K = static_cast<int>(t.count);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
    Acc acc = accumulate ? to_acc(out[i * out_stride]) : Acc(0);
    for (int k = 0; k < K; ++k) {
      const Acc w = weights[k];
      if (w != Acc(0)) acc = acc + w * to_acc(static_cast<const T*>(rows.ptr(k))[i * rows.stride(k)]);
    }
    out[i * out_stride] = Store<T>::from(acc);
  }
}

// The call's parameter tables: the row table (a list only), then (host weights only) one weight per row.
template <typename T>
RowTables pack_tables(const WeightedSumCall& c, ArgPack& pack) {
  using Acc = typename AccOf<T>::type;
  RowTables t{};
  if (c.stack.count > 0) {
    t.count = c.stack.count;
    t.stack = c.stack;
  } else {
    t.count = static_cast<int64_t>(c.rows.size());
    t.rows = pack.add(c.rows);
  }
  if (c.device_weights == nullptr) t.weights = pack.add(std::vector<Acc>(c.weights.begin(), c.weights.end()));
  return t;
}

// 16 or 8 when every row and the output are contiguous and aligned to that many bytes, else 0 (strided kernel).
int access_width(const WeightedSumCall& c) {
  if (c.out_stride != 1) return 0;
  int width = common_alignment({c.out});
  if (c.stack.count > 0) {
    if (c.stack.col_stride != 1) return 0;
    const int step = common_alignment({reinterpret_cast<const void*>(c.stack.step_bytes)});
    width = std::min({width, common_alignment({c.stack.base}), step});
  }
  for (const auto& r : c.rows) {
    if (r.stride != 1) return 0;
    width = std::min(width, common_alignment({r.ptr}));
  }
  return width;
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
  const RowTables t = pack_tables<T>(c, pack);
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  if (t.count == 0 && c.accumulate) return 0;  // nothing to add
  constexpr int kThreads = 256;
  const auto* dw = static_cast<const Acc*>(c.device_weights);
  T* o = static_cast<T*>(c.out);
  const int width = access_width(c);
  bool zeros = dw != nullptr;
  for (double w : c.weights) zeros = zeros || w == 0.0;
  with_tables(pack, stream, scratch, "weighted_sum", [&](const auto& block, const void* global) {
    if (width > 0) {
      with_pack_width<T>(width, [&](auto w) {
        constexpr int W = decltype(w)::value;
        const unsigned grid = grid_for(device, c.d / W + 1, kThreads);
        if (zeros) {
          weighted_sum_vec_kernel<T, W, true>
              <<<grid, kThreads, 0, stream>>>(block, global, t, dw, o, c.d, c.accumulate);
        } else {
          weighted_sum_vec_kernel<T, W, false>
              <<<grid, kThreads, 0, stream>>>(block, global, t, dw, o, c.d, c.accumulate);
        }
      });
    } else {
      weighted_sum_strided_kernel<T><<<grid_for(device, c.d, kThreads), kThreads, 0, stream>>>(
          block, global, t, dw, o, c.out_stride, c.d, c.accumulate);
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
