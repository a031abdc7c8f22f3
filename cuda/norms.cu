// CUDA feature-norm kernels: one warp per row computes the row's L2 norm (and the argmax of its logits); a second
// kernel reduces the norms per class, one block per class, in a fixed order (deterministic, no float atomics).
// Scratch comes from the caller's library and labels are checked on the device, so a call neither allocates nor
// synchronises: an out-of-range label turns every class sum and mean into NaN and every count into -1.
#include <cmath>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "half.h"

namespace pfk::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int o = kWarp / 2; o >= 1; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of squares is accumulated in double, so it stays exact enough at any row length (a float sum stops
// growing once it reaches 2^24 times the squares' size).
template <typename T>
__device__ __forceinline__ typename AccOf<T>::type warp_row_norm(const T* __restrict__ row, int64_t D, int64_t s,
                                                                 int lane) {
  using Acc = typename AccOf<T>::type;
  double acc = 0.0;
  for (int64_t j = lane; j < D; j += kWarp) {
    const double v = static_cast<double>(to_acc(row[j * s]));
    acc += v * v;
  }
  return static_cast<Acc>(sqrt(warp_sum(acc)));
}

// Whether (v, i) beats (bv, bi) as an argmax: NaN first, then the larger value, then the lower index.
__device__ __forceinline__ bool beats(float v, int64_t i, float bv, int64_t bi) {
  const bool vn = isnan(v), bn = isnan(bv);
  if (vn != bn) return vn;
  if (!vn && v != bv) return v > bv;
  return i < bi;
}

template <typename T>
__device__ int64_t warp_row_argmax(const T* __restrict__ row, int64_t C, int64_t s, int lane) {
  float best_v = -INFINITY;
  int64_t best = C;  // sentinel: loses to any real index with an equal value
  for (int64_t j = lane; j < C; j += kWarp) {
    const float v = static_cast<float>(to_acc(row[j * s]));
    if (best == C || beats(v, j, best_v, best)) best_v = v, best = j;
  }
#pragma unroll
  for (int o = kWarp / 2; o >= 1; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, best, o);
    if (oi != C && (best == C || beats(ov, oi, best_v, best))) best_v = ov, best = oi;
  }
  return best;
}

template <typename L>
__device__ __forceinline__ int64_t label_at(const void* labels, int64_t r, int64_t stride) {
  return static_cast<int64_t>(static_cast<const L*>(labels)[r * stride]);
}

// One warp per row: norms (storage dtype and accumulator copy for the class reduction) and hit flags.
template <typename T, typename L>
__global__ void row_norms_kernel(int64_t B, int64_t D, const T* __restrict__ f, int64_t fs0, int64_t fs1,
                                 const void* labels, int64_t label_stride, int64_t C, const T* __restrict__ logits,
                                 int64_t ls0, int64_t ls1, T* __restrict__ norms,
                                 typename AccOf<T>::type* __restrict__ acc_norms, int* __restrict__ hits) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; r < B; r += warps) {
    const auto nrm = warp_row_norm(f + r * fs0, D, fs1, lane);
    int64_t pred = -1;
    if (logits != nullptr) pred = warp_row_argmax(logits + r * ls0, C, ls1, lane);
    if (lane == 0) {
      norms[r] = Store<T>::from(nrm);
      if (acc_norms != nullptr) acc_norms[r] = nrm;
      if (hits != nullptr) hits[r] = pred == label_at<L>(labels, r, label_stride) ? 1 : 0;
    }
  }
}

// Block c < C: sum and count of the norms of class c; block C: the number of hits. Fixed-order tree reductions.
template <typename T, typename L>
__global__ void class_reduce_kernel(int64_t B, const void* labels, int64_t label_stride, int64_t C,
                                    const typename AccOf<T>::type* __restrict__ acc_norms, const int* __restrict__ hits,
                                    T* __restrict__ class_sum, T* __restrict__ class_mean, int64_t* __restrict__ counts,
                                    int64_t* __restrict__ correct) {
  __shared__ double sums[kThreads];
  __shared__ long long cnts[kThreads];
  const int64_t c = blockIdx.x;
  double s = 0.0;
  long long n = 0;
  int bad = 0;  // an out-of-range label seen by this thread
  for (int64_t r = threadIdx.x; r < B; r += blockDim.x) {
    const int64_t label = label_at<L>(labels, r, label_stride);
    bad |= label < 0 || label >= C;
    if (c == C) {
      n += hits[r];
    } else if (label == c) {
      s += static_cast<double>(acc_norms[r]);
      ++n;
    }
  }
  sums[threadIdx.x] = s;
  cnts[threadIdx.x] = n;
  if (__syncthreads_or(bad)) {
    if (threadIdx.x != 0) return;
    using Acc = typename AccOf<T>::type;
    if (c < C) {
      class_sum[c] = Store<T>::from(static_cast<Acc>(NAN));
      class_mean[c] = Store<T>::from(static_cast<Acc>(NAN));
      counts[c] = -1;
    } else {
      *correct = -1;
    }
    return;
  }
  for (int w = blockDim.x / 2; w >= 1; w /= 2) {
    if (threadIdx.x < w) {
      sums[threadIdx.x] += sums[threadIdx.x + w];
      cnts[threadIdx.x] += cnts[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  using Acc = typename AccOf<T>::type;
  if (c < C) {
    class_sum[c] = Store<T>::from(static_cast<Acc>(sums[0]));
    class_mean[c] = Store<T>::from(static_cast<Acc>(cnts[0] > 0 ? sums[0] / static_cast<double>(cnts[0]) : 0.0));
    counts[c] = cnts[0];
  } else {
    *correct = cnts[0];
  }
}

template <typename T, typename L>
__global__ void backward_kernel(int64_t B, int64_t D, const T* __restrict__ f, int64_t fs0, int64_t fs1,
                                const void* labels, int64_t label_stride, int64_t C,
                                const typename AccOf<T>::type* __restrict__ grad_norms,
                                const typename AccOf<T>::type* __restrict__ class_coef, T* __restrict__ grad) {
  using Acc = typename AccOf<T>::type;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; r < B; r += warps) {
    const T* row = f + r * fs0;
    const Acc nrm = warp_row_norm(row, D, fs1, lane);
    Acc coef = grad_norms != nullptr ? grad_norms[r] : Acc(0);
    if (class_coef != nullptr) {
      const int64_t label = label_at<L>(labels, r, label_stride);
      coef += label >= 0 && label < C ? class_coef[label] : static_cast<Acc>(NAN);  // an out-of-range label: NaN
    }
    const Acc scale = nrm > Acc(0) ? coef / nrm : Acc(0);
    for (int64_t j = lane; j < D; j += kWarp) grad[r * D + j] = Store<T>::from(scale * to_acc(row[j * fs1]));
  }
}

// Scratch of a forward call: the norms in the accumulator type (for the class reduction), then the hit flags.
template <typename T>
size_t forward_scratch(int64_t B, bool with_classes, bool with_logits, size_t* hits_offset) {
  const size_t norms = with_classes ? (B * sizeof(typename AccOf<T>::type) + 255) / 256 * 256 : 0;
  *hits_offset = norms;
  return norms + (with_logits ? B * sizeof(int) : 0);
}

template <typename T, typename L>
size_t forward(int device, cudaStream_t stream, int64_t B, int64_t D, const void* features, int64_t fs0, int64_t fs1,
               const void* labels, int64_t label_stride, int64_t C, const void* logits, int64_t ls0, int64_t ls1,
               void* norms, void* class_sum, void* class_mean, int64_t* counts, int64_t* correct, Scratch scratch) {
  using Acc = typename AccOf<T>::type;
  const bool with_classes = labels != nullptr;
  size_t hits_offset = 0;
  const size_t need = forward_scratch<T>(B, with_classes, logits != nullptr, &hits_offset);
  if (need > scratch.bytes) return need;
  Acc* acc_norms = with_classes ? static_cast<Acc*>(scratch.ptr) : nullptr;
  int* hits =
      logits != nullptr ? reinterpret_cast<int*>(static_cast<unsigned char*>(scratch.ptr) + hits_offset) : nullptr;
  const unsigned grid = grid_for(device, B * kWarp, kThreads);
  row_norms_kernel<T, L><<<grid, kThreads, 0, stream>>>(B, D, static_cast<const T*>(features), fs0, fs1, labels,
                                                        label_stride, C, static_cast<const T*>(logits), ls0, ls1,
                                                        static_cast<T*>(norms), acc_norms, hits);
  check(cudaGetLastError(), "class_feature_norms row kernel launch");
  if (!with_classes) return 0;
  const unsigned blocks = static_cast<unsigned>(C + (logits != nullptr ? 1 : 0));
  class_reduce_kernel<T, L><<<blocks, kThreads, 0, stream>>>(B, labels, label_stride, C, acc_norms, hits,
                                                             static_cast<T*>(class_sum), static_cast<T*>(class_mean),
                                                             counts, correct);
  check(cudaGetLastError(), "class_feature_norms class kernel launch");
  return 0;
}

template <typename T, typename L>
size_t backward(int device, cudaStream_t stream, int64_t B, int64_t D, const void* features, int64_t fs0, int64_t fs1,
                const void* labels, int64_t label_stride, int64_t C, const void* grad_norms, const void* class_coef,
                void* grad) {
  using Acc = typename AccOf<T>::type;
  const unsigned grid = grid_for(device, B * kWarp, kThreads);
  backward_kernel<T, L><<<grid, kThreads, 0, stream>>>(B, D, static_cast<const T*>(features), fs0, fs1, labels,
                                                       label_stride, C, static_cast<const Acc*>(grad_norms),
                                                       static_cast<const Acc*>(class_coef), static_cast<T*>(grad));
  check(cudaGetLastError(), "class_feature_norms backward kernel launch");
  return 0;
}

template <template <typename, typename> class Op, typename... Args>
size_t dispatch(DType dtype, bool labels_int32, Args&&... args) {
  auto by_label = [&](auto tag) {
    using T = decltype(tag);
    if (labels_int32) return Op<T, int32_t>::run(args...);
    return Op<T, int64_t>::run(args...);
  };
  switch (dtype) {
    case DType::F32:
      return by_label(float{});
    case DType::F64:
      return by_label(double{});
    case DType::F16:
      return by_label(f16_t{});
    case DType::BF16:
      return by_label(bf16_t{});
  }
  return size_t{0};
}

template <typename T, typename L>
struct ForwardOp {
  template <typename... Args>
  static size_t run(Args&&... args) {
    return forward<T, L>(args...);
  }
};

template <typename T, typename L>
struct BackwardOp {
  template <typename... Args>
  static size_t run(Args&&... args) {
    return backward<T, L>(args...);
  }
};

}  // namespace

size_t class_feature_norms(int device, uintptr_t stream, DType dtype, bool labels_int32, int64_t B, int64_t D,
                           const void* features, int64_t f_stride0, int64_t f_stride1, const void* labels,
                           int64_t label_stride, int64_t C, const void* logits, int64_t logit_stride0,
                           int64_t logit_stride1, void* norms, void* class_sum, void* class_mean, int64_t* counts,
                           int64_t* correct, Scratch scratch) {
  DeviceGuard guard(device);
  return dispatch<ForwardOp>(dtype, labels_int32, device, as_stream(stream), B, D, features, f_stride0, f_stride1,
                             labels, label_stride, C, logits, logit_stride0, logit_stride1, norms, class_sum,
                             class_mean, counts, correct, scratch);
}

void class_feature_norms_backward(int device, uintptr_t stream, DType dtype, bool labels_int32, int64_t B, int64_t D,
                                  const void* features, int64_t f_stride0, int64_t f_stride1, const void* labels,
                                  int64_t label_stride, int64_t C, const void* grad_norms, const void* class_coef,
                                  void* grad) {
  DeviceGuard guard(device);
  dispatch<BackwardOp>(dtype, labels_int32, device, as_stream(stream), B, D, features, f_stride0, f_stride1, labels,
                       label_stride, C, grad_norms, class_coef, grad);
}

}  // namespace pfk::cuda
