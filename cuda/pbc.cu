// CUDA FedPBC server kernels (see csrc/pbc.cpp): one thread per column element (or per 16 bytes of columns when
// every row is contiguous and 16-byte aligned) in a grid-stride loop; each element walks its rows in the order
// given, so results are deterministic. fp32 accumulation for 16-bit storage. Row tables travel in the kernel
// parameters (cuda_common.cuh).
#include <algorithm>
#include <vector>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

constexpr int kThreads = 256;

// Element j of row r (rows are written through the same table they are read from).
template <typename T>
__device__ __forceinline__ T& at(const RowRef& r, int64_t j) {
  return const_cast<T*>(static_cast<const T*>(r.ptr))[j * r.stride];
}

template <typename T>
__device__ __forceinline__ T* row_ptr(const RowRef& r) {
  return const_cast<T*>(static_cast<const T*>(r.ptr));
}

// Kernels: packs of W elements for the first nvec * W columns when every row is contiguous and aligned to W
// elements (nvec = 0 otherwise), then element by element.
template <typename T, int W, size_t NB>
__global__ void agg_bcast_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, RowTables t, int64_t d,
                                 T* __restrict__ server, int64_t server_stride, int64_t nvec) {
  using Acc = typename AccOf<T>::type;
  const RowRef* rows = table_at<RowRef>(table_base(block, global), t.rows);
  const int K = static_cast<int>(t.count);
  const Acc inv_k = Acc(1) / Acc(K);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    Acc acc[W], x[W];
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = Acc(0);
    int k = 0;
    for (; k + 4 <= K; k += 4) {  // four rows' loads issued together (as weighted_sum), then added in row order
      Acc xs[4][W];
#pragma unroll
      for (int j = 0; j < 4; ++j) load_pack<W>(row_ptr<T>(rows[k + j]), v, xs[j]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] = acc[i] + xs[j][i];
      }
    }
    for (; k < K; ++k) {
      load_pack<W>(row_ptr<T>(rows[k]), v, x);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = acc[i] + x[i];
    }
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = to_acc(Store<T>::from(acc[i] * inv_k));  // the stored mean, exactly
    store_pack<W>(server, v, acc);
    for (int k = 0; k < K; ++k) store_pack<W>(row_ptr<T>(rows[k]), v, acc);
  }
  for (int64_t j = nvec * W + first; j < d; j += step) {
    Acc acc = Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + to_acc(at<T>(rows[k], j));
    const T mean = Store<T>::from(acc * inv_k);
    server[j * server_stride] = mean;
    for (int k = 0; k < K; ++k) at<T>(rows[k], j) = mean;
  }
}

template <typename T, int W, size_t NB>
__global__ void weighted_delta_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, RowTables t,
                                      int64_t d, T* __restrict__ x, int64_t x_stride, int64_t nvec) {
  using Acc = typename AccOf<T>::type;
  const unsigned char* base = table_base(block, global);
  const RowRef* rows = table_at<RowRef>(base, t.rows);
  const Acc* weights = table_at<Acc>(base, t.weights);
  const int K = static_cast<int>(t.count);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    Acc xb[W], acc[W], r[W];
    load_pack<W>(x, v, xb);
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = Acc(0);
    int k = 0;
    for (; k + 4 <= K; k += 4) {  // four rows' loads issued together (as weighted_sum), then added in row order
      Acc rs[4][W];
#pragma unroll
      for (int j = 0; j < 4; ++j) load_pack<W>(row_ptr<T>(rows[k + j]), v, rs[j]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const Acc w = weights[k + j];
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] = acc[i] + w * (rs[j][i] - xb[i]);
      }
    }
    for (; k < K; ++k) {
      const Acc w = weights[k];
      load_pack<W>(row_ptr<T>(rows[k]), v, r);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = acc[i] + w * (r[i] - xb[i]);
    }
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = xb[i] + acc[i];
    store_pack<W>(x, v, acc);
  }
  for (int64_t j = nvec * W + first; j < d; j += step) {
    const Acc base_x = to_acc(x[j * x_stride]);
    Acc acc = Acc(0);
    for (int k = 0; k < K; ++k) acc = acc + weights[k] * (to_acc(at<T>(rows[k], j)) - base_x);
    x[j * x_stride] = Store<T>::from(base_x + acc);
  }
}

// Offsets of MIFA's tables: `count` update rows, `count` memory rows, then `all_count` rows to re-sum.
struct MifaTables {
  int64_t count;
  int64_t updates;
  int64_t memory;
  int64_t all_count;
  int64_t all;
};

// One column element of MIFA's update given its x and running-sum values (scalar form of the pack body below).
template <typename T, int W, size_t NB>
__global__ void mifa_kernel(const __grid_constant__ ArgBlock<NB> block, const void* global, MifaTables t, RowRef x,
                            RowRef total, int64_t d, double coef, bool subtract_x, int64_t nvec) {
  using Acc = typename AccOf<T>::type;
  const unsigned char* base = table_base(block, global);
  const RowRef* updates = table_at<RowRef>(base, t.updates);
  const RowRef* memory = table_at<RowRef>(base, t.memory);
  const RowRef* all_memory = table_at<RowRef>(base, t.all);
  const int K = static_cast<int>(t.count), M = static_cast<int>(t.all_count);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    Acc xv[W], sv[W], u[W], mem[W];  // mem: the rows re-summed
    load_pack<W>(row_ptr<T>(x), v, xv);
    load_pack<W>(row_ptr<T>(total), v, sv);
    // Four clients at a time: their eight loads are issued before any store (updates, memory rows and x are
    // disjoint, checked by the Python layer), then each client's delta is stored and summed in order.
    for (int k0 = 0; k0 < K; k0 += 4) {
      const int n = K - k0 < 4 ? K - k0 : 4;
      Acc ub[4][W], mb[4][W];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < n) {
          load_pack<W>(row_ptr<T>(updates[k0 + j]), v, ub[j]);
          load_pack<W>(row_ptr<T>(memory[k0 + j]), v, mb[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < n) {
#pragma unroll
          for (int i = 0; i < W; ++i) {
            u[i] = to_acc(Store<T>::from(subtract_x ? ub[j][i] - xv[i] : ub[j][i]));  // the stored delta
            sv[i] = sv[i] + (u[i] - mb[j][i]);
          }
          store_pack<W>(row_ptr<T>(memory[k0 + j]), v, u);
        }
      }
    }
    if (M > 0) {
#pragma unroll
      for (int i = 0; i < W; ++i) sv[i] = Acc(0);
      for (int m = 0; m < M; ++m) {
        load_pack<W>(row_ptr<T>(all_memory[m]), v, mem);
#pragma unroll
        for (int i = 0; i < W; ++i) sv[i] = sv[i] + mem[i];
      }
    }
#pragma unroll
    for (int i = 0; i < W; ++i) sv[i] = to_acc(Store<T>::from(sv[i]));
    store_pack<W>(row_ptr<T>(total), v, sv);
#pragma unroll
    for (int i = 0; i < W; ++i) xv[i] = xv[i] + Acc(coef) * sv[i];
    store_pack<W>(row_ptr<T>(x), v, xv);
  }
  for (int64_t j = nvec * W + first; j < d; j += step) {
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

std::vector<RowRef> to_refs(const std::vector<PbcRow>& rows) {
  std::vector<RowRef> out;
  out.reserve(rows.size());
  for (const auto& r : rows) out.push_back({r.ptr, r.stride});
  return out;
}

// The access width (16 or 8 bytes) every row and the vector `out` allow when all are contiguous, else 0.
int access_width(std::initializer_list<const std::vector<PbcRow>*> row_sets, std::initializer_list<PbcRow> vectors) {
  int width = 16;
  for (const PbcRow& v : vectors) {
    if (v.stride != 1) return 0;
    width = std::min(width, common_alignment({v.ptr}));
  }
  for (const auto* rows : row_sets) {
    for (const PbcRow& r : *rows) {
      if (r.stride != 1) return 0;
      width = std::min(width, common_alignment({r.ptr}));
    }
  }
  return width;
}

// Calls launch(W, nvec, grid) with W elements per access (1 and no packs when width is 0).
template <typename T, typename Launch>
void with_width(int device, int width, int64_t d, Launch&& launch) {
  if (width == 0) {
    launch(std::integral_constant<int, 1>{}, int64_t{0}, grid_for(device, d, kThreads));
    return;
  }
  with_pack_width<T>(width, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const int64_t nvec = d / W;
    launch(w, nvec, grid_for(device, nvec + (d - nvec * W), kThreads));
  });
}

template <typename T>
size_t launch_agg_bcast(int device, cudaStream_t stream, int64_t d, const std::vector<PbcRow>& rows, void* server,
                        int64_t server_stride, Scratch scratch) {
  ArgPack pack;
  RowTables t{};
  t.count = static_cast<int64_t>(rows.size());
  t.rows = pack.add(to_refs(rows));
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  with_tables(pack, stream, scratch, "pbc_agg_bcast", [&](const auto& block, const void* global) {
    with_width<T>(
        device, access_width({&rows}, {{server, server_stride}}), d, [&](auto w, int64_t nvec, unsigned grid) {
          agg_bcast_kernel<T, decltype(w)::value>
              <<<grid, kThreads, 0, stream>>>(block, global, t, d, static_cast<T*>(server), server_stride, nvec);
        });
  });
  check(cudaGetLastError(), "pbc_agg_bcast kernel launch");
  return 0;
}

template <typename T>
size_t launch_weighted_delta(int device, cudaStream_t stream, int64_t d, const std::vector<PbcRow>& rows,
                             const std::vector<double>& weights, void* x, int64_t x_stride, Scratch scratch) {
  using Acc = typename AccOf<T>::type;
  ArgPack pack;
  RowTables t{};
  t.count = static_cast<int64_t>(rows.size());
  t.rows = pack.add(to_refs(rows));
  t.weights = pack.add(std::vector<Acc>(weights.begin(), weights.end()));
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  with_tables(pack, stream, scratch, "weighted_delta", [&](const auto& block, const void* global) {
    with_width<T>(device, access_width({&rows}, {{x, x_stride}}), d, [&](auto w, int64_t nvec, unsigned grid) {
      weighted_delta_kernel<T, decltype(w)::value>
          <<<grid, kThreads, 0, stream>>>(block, global, t, d, static_cast<T*>(x), x_stride, nvec);
    });
  });
  check(cudaGetLastError(), "weighted_delta kernel launch");
  return 0;
}

template <typename T>
size_t launch_mifa(int device, cudaStream_t stream, int64_t d, const MifaArgs& a, Scratch scratch) {
  ArgPack pack;
  MifaTables t{};
  t.count = static_cast<int64_t>(a.updates.size());
  t.updates = pack.add(to_refs(a.updates));
  t.memory = pack.add(to_refs(a.memory));
  t.all_count = static_cast<int64_t>(a.all_memory.size());
  t.all = pack.add(to_refs(a.all_memory));
  if (const size_t need = tables_scratch_bytes(pack); need > scratch.bytes) return need;
  const int width = access_width({&a.updates, &a.memory, &a.all_memory}, {a.x, a.total});
  with_tables(pack, stream, scratch, "mifa_update", [&](const auto& block, const void* global) {
    with_width<T>(device, width, d, [&](auto w, int64_t nvec, unsigned grid) {
      mifa_kernel<T, decltype(w)::value><<<grid, kThreads, 0, stream>>>(block, global, t, RowRef{a.x.ptr, a.x.stride},
                                                                        RowRef{a.total.ptr, a.total.stride}, d, a.coef,
                                                                        a.subtract_x, nvec);
    });
  });
  check(cudaGetLastError(), "mifa_update kernel launch");
  return 0;
}

}  // namespace

size_t pbc_agg_bcast(int device, uintptr_t stream_handle, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                     void* server, int64_t server_stride, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_agg_bcast<float>(device, stream, d, rows, server, server_stride, scratch);
    case DType::F64:
      return launch_agg_bcast<double>(device, stream, d, rows, server, server_stride, scratch);
    case DType::F16:
      return launch_agg_bcast<f16_t>(device, stream, d, rows, server, server_stride, scratch);
    case DType::BF16:
      return launch_agg_bcast<bf16_t>(device, stream, d, rows, server, server_stride, scratch);
  }
  return 0;
}

size_t weighted_delta(int device, uintptr_t stream_handle, DType dtype, int64_t d, const std::vector<PbcRow>& rows,
                      const std::vector<double>& weights, void* x, int64_t x_stride, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_weighted_delta<float>(device, stream, d, rows, weights, x, x_stride, scratch);
    case DType::F64:
      return launch_weighted_delta<double>(device, stream, d, rows, weights, x, x_stride, scratch);
    case DType::F16:
      return launch_weighted_delta<f16_t>(device, stream, d, rows, weights, x, x_stride, scratch);
    case DType::BF16:
      return launch_weighted_delta<bf16_t>(device, stream, d, rows, weights, x, x_stride, scratch);
  }
  return 0;
}

size_t mifa_update(int device, uintptr_t stream_handle, DType dtype, int64_t d, const MifaArgs& args, Scratch scratch) {
  DeviceGuard guard(device);
  const cudaStream_t stream = as_stream(stream_handle);
  switch (dtype) {
    case DType::F32:
      return launch_mifa<float>(device, stream, d, args, scratch);
    case DType::F64:
      return launch_mifa<double>(device, stream, d, args, scratch);
    case DType::F16:
      return launch_mifa<f16_t>(device, stream, d, args, scratch);
    case DType::BF16:
      return launch_mifa<bf16_t>(device, stream, d, args, scratch);
  }
  return 0;
}

}  // namespace pfk::cuda
