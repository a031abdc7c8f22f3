// CUDA FedSpeed step kernels (see csrc/fedspeed.h). A norm is two deterministic passes: a fixed grid (its size
// depends on d only) writes one partial sum of squares per block into the workspace, then one block adds the
// partials in a fixed tree order and stores the norm in norm_out. The elementwise kernel reads that device
// scalar, so no value ever travels to the host and nothing synchronises the device.
#include <initializer_list>

#include "cuda_common.cuh"
#include "cuda_launchers.h"
#include "fedspeed.h"
#include "half.h"

namespace pfk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kItemsPerThread = 16;  // elements each thread of the partial-sum pass covers on average

template <typename T>
struct DevCombo {
  using Acc = typename AccOf<T>::type;
  const T* g1;
  int64_t s1;
  const T* g2;
  int64_t s2;
  const T* anchor;
  int64_t sa;
  Acc a1, a2, c;
};

// Elements of a 16-byte pack: the vectorised body of the elementwise kernels handles `nvec` packs when every
// vector is contiguous and 16-byte aligned (nvec = 0 otherwise); the element loop after it does the rest.
template <typename T>
constexpr int kPack = 16 / sizeof(T);

template <typename T, bool HasG1, bool HasD>
__device__ __forceinline__ void combo_pack(const DevCombo<T>& k, int64_t pack, typename AccOf<T>::type (&v)[kPack<T>]) {
  using Acc = typename AccOf<T>::type;
  Acc a[kPack<T>];
  load_pack<kPack<T>>(k.g2, pack, v);
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) v[i] = k.a2 * v[i];
  if constexpr (HasG1) {
    load_pack<kPack<T>>(k.g1, pack, a);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) v[i] = k.a1 * a[i] + v[i];
  }
  if constexpr (HasD) {
    load_pack<kPack<T>>(k.anchor, pack, a);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) v[i] = v[i] + k.c * a[i];
  }
}

template <typename T, bool HasG1, bool HasD>
__device__ __forceinline__ typename AccOf<T>::type combo_at(const DevCombo<T>& k, int64_t i) {
  using Acc = typename AccOf<T>::type;
  Acc v = k.a2 * to_acc(k.g2[i * k.s2]);
  if constexpr (HasG1) v = k.a1 * to_acc(k.g1[i * k.s1]) + v;
  if constexpr (HasD) v = v + k.c * to_acc(k.anchor[i * k.sa]);
  return v;
}

// Sum of the block's values in a fixed tree order; the result is valid in thread 0.
template <typename Acc>
__device__ Acc block_sum(Acc v) {
  __shared__ Acc shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] = shared[threadIdx.x] + shared[threadIdx.x + width];
    __syncthreads();
  }
  return shared[0];
}

template <typename T, bool HasG1, bool HasD>
__global__ void sumsq_partial_kernel(int64_t d, int64_t nvec, DevCombo<T> k,
                                     typename AccOf<T>::type* __restrict__ partials) {
  using Acc = typename AccOf<T>::type;
  Acc sum = Acc(0);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < nvec; p += step) {
    Acc v[kPack<T>];
    combo_pack<T, HasG1, HasD>(k, p, v);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) sum = sum + v[i] * v[i];
  }
  for (int64_t i = nvec * kPack<T> + first; i < d; i += step) {
    const Acc v = combo_at<T, HasG1, HasD>(k, i);
    sum = sum + v * v;
  }
  const Acc total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename Acc>
__global__ void norm_finalize_kernel(const Acc* __restrict__ partials, int count, Acc* __restrict__ norm_out) {
  Acc sum = Acc(0);
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum = sum + partials[i];
  const Acc total = block_sum(sum);
  if (threadIdx.x == 0) norm_out[0] = sqrt(total);
}

template <typename T>
__global__ void perturb_kernel(int64_t d, int64_t nvec, const T* x, int64_t sx, const T* g, int64_t sg, T* out,
                               int64_t so, typename AccOf<T>::type rho, typename AccOf<T>::type eps,
                               const typename AccOf<T>::type* __restrict__ norm) {
  using Acc = typename AccOf<T>::type;
  Acc s = rho;
  if (norm != nullptr) {
    const Acc denom = norm[0] + eps;
    s = denom > Acc(0) ? rho / denom : Acc(0);  // zero gradient with eps = 0: no perturbation
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    Acc xv[kPack<T>], gv[kPack<T>];
    load_pack<kPack<T>>(x, v, xv);
    load_pack<kPack<T>>(g, v, gv);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) xv[i] = xv[i] + s * gv[i];
    store_pack<kPack<T>>(out, v, xv);
  }
  for (int64_t i = nvec * kPack<T> + first; i < d; i += step) {
    out[i * so] = Store<T>::from(to_acc(x[i * sx]) + s * to_acc(g[i * sg]));
  }
}

template <typename T, bool HasG1, bool HasD>
__global__ void update_kernel(int64_t d, int64_t nvec, T* x, int64_t sx, DevCombo<T> k, typename AccOf<T>::type x_coef,
                              typename AccOf<T>::type lr, typename AccOf<T>::type clip_norm,
                              const typename AccOf<T>::type* __restrict__ norm) {
  using Acc = typename AccOf<T>::type;
  Acc scale = Acc(1);
  if (norm != nullptr) scale = fmin(Acc(1), clip_norm / (norm[0] + Acc(1e-6)));
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < nvec; p += step) {
    Acc xv[kPack<T>], v[kPack<T>];
    load_pack<kPack<T>>(x, p, xv);
    combo_pack<T, HasG1, HasD>(k, p, v);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) xv[i] = xv[i] - lr * (scale * v[i] + x_coef * xv[i]);
    store_pack<kPack<T>>(x, p, xv);
  }
  for (int64_t i = nvec * kPack<T> + first; i < d; i += step) {
    const Acc xv = to_acc(x[i * sx]);
    const Acc v = combo_at<T, HasG1, HasD>(k, i);
    x[i * sx] = Store<T>::from(xv - lr * (scale * v + x_coef * xv));
  }
}

template <typename T, bool HasAcc, bool IncludeH, bool HasHsum>
__global__ void round_end_kernel(int64_t d, int64_t nvec, T* h, int64_t sh, const T* xk, int64_t sk, const T* xt,
                                 int64_t st, T* acc, int64_t sa, T* hs, int64_t ss, typename AccOf<T>::type w) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < nvec; p += step) {
    Acc xl[kPack<T>], xg[kPack<T>], hv[kPack<T>], delta[kPack<T>];
    load_pack<kPack<T>>(xk, p, xl);
    load_pack<kPack<T>>(xt, p, xg);
    load_pack<kPack<T>>(h, p, hv);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) delta[i] = xl[i] - xg[i], hv[i] = hv[i] + delta[i];
    store_pack<kPack<T>>(h, p, hv);
    if constexpr (HasAcc) {
      Acc av[kPack<T>];
      load_pack<kPack<T>>(acc, p, av);
#pragma unroll
      for (int i = 0; i < kPack<T>; ++i) av[i] = av[i] + w * (IncludeH ? xl[i] + hv[i] : xl[i]);
      store_pack<kPack<T>>(acc, p, av);
    }
    if constexpr (HasHsum) {
      Acc sv[kPack<T>];
      load_pack<kPack<T>>(hs, p, sv);
#pragma unroll
      for (int i = 0; i < kPack<T>; ++i) sv[i] = sv[i] + delta[i];
      store_pack<kPack<T>>(hs, p, sv);
    }
  }
  for (int64_t i = nvec * kPack<T> + first; i < d; i += step) {
    const Acc xl = to_acc(xk[i * sk]);
    const Acc delta = xl - to_acc(xt[i * st]);
    const Acc hn = to_acc(h[i * sh]) + delta;
    h[i * sh] = Store<T>::from(hn);
    if constexpr (HasAcc) {
      const Acc upload = IncludeH ? xl + hn : xl;
      acc[i * sa] = Store<T>::from(to_acc(acc[i * sa]) + w * upload);
    }
    if constexpr (HasHsum) hs[i * ss] = Store<T>::from(to_acc(hs[i * ss]) + delta);
  }
}

template <typename T>
DevCombo<T> make_combo(const StridedVec& g1, const StridedVec& g2, const StridedVec& anchor, double a1, double a2,
                       double c) {
  using Acc = typename AccOf<T>::type;
  return {static_cast<const T*>(g1.ptr),
          g1.stride,
          static_cast<const T*>(g2.ptr),
          g2.stride,
          static_cast<const T*>(anchor.ptr),
          anchor.stride,
          static_cast<Acc>(a1),
          static_cast<Acc>(a2),
          static_cast<Acc>(c)};
}

// Packs the elementwise kernels process vectorised: d / kPack when every given vector is contiguous and 16-byte
// aligned, else 0. Null vectors (absent operands) do not count.
template <typename T>
int64_t packs(int64_t d, std::initializer_list<StridedVec> vectors) {
  for (const StridedVec& v : vectors)
    if (v.ptr != nullptr && (v.stride != 1 || !aligned16(v.ptr))) return 0;
  return d / kPack<T>;
}

// Threads for a launch with nvec packs and the elements after them.
int64_t work_items(int64_t d, int64_t nvec, int pack) {
  return nvec + (d - nvec * pack);
}

// Blocks of the partial-sum pass: a function of d only, so the reduction order is the same on every GPU.
int partial_blocks(int64_t d) {
  const int64_t wanted = (d + kThreads * kItemsPerThread - 1) / (kThreads * kItemsPerThread);
  return static_cast<int>(wanted < 1 ? 1 : (wanted < kFedSpeedMaxPartials ? wanted : kFedSpeedMaxPartials));
}

// ||combo|| into norm_out (device memory), using the workspace for the per-block partial sums.
template <typename T, bool HasG1, bool HasD>
void device_norm(cudaStream_t stream, int64_t d, int64_t nvec, const DevCombo<T>& k, void* workspace, void* norm_out) {
  using Acc = typename AccOf<T>::type;
  const int blocks = partial_blocks(d);
  Acc* partials = static_cast<Acc*>(workspace);
  sumsq_partial_kernel<T, HasG1, HasD><<<blocks, kThreads, 0, stream>>>(d, nvec, k, partials);
  check(cudaGetLastError(), "fedspeed norm partial kernel launch");
  norm_finalize_kernel<Acc><<<1, kThreads, 0, stream>>>(partials, blocks, static_cast<Acc*>(norm_out));
  check(cudaGetLastError(), "fedspeed norm finalize kernel launch");
}

template <typename T>
void perturb(int device, cudaStream_t stream, const PerturbArgs& a) {
  using Acc = typename AccOf<T>::type;
  const Acc* norm = nullptr;
  if (a.normalize) {
    if (!a.norm_out) throw ArgumentError("fedspeed_perturb: CUDA needs a device norm_out");
    device_norm<T, false, false>(stream, a.d, packs<T>(a.d, {a.g}), make_combo<T>({}, a.g, {}, 0.0, 1.0, 0.0),
                                 a.workspace, a.norm_out);
    norm = static_cast<const Acc*>(a.norm_out);
  }
  const int64_t nvec = packs<T>(a.d, {a.x, a.g, a.out});
  perturb_kernel<T><<<grid_for(device, work_items(a.d, nvec, kPack<T>), kThreads), kThreads, 0, stream>>>(
      a.d, nvec, static_cast<const T*>(a.x.ptr), a.x.stride, static_cast<const T*>(a.g.ptr), a.g.stride,
      static_cast<T*>(a.out.ptr), a.out.stride, static_cast<Acc>(a.rho), static_cast<Acc>(a.eps), norm);
  check(cudaGetLastError(), "fedspeed perturb kernel launch");
}

template <typename T, bool HasG1, bool HasD>
void update_flags(int device, cudaStream_t stream, const UpdateArgs& a) {
  using Acc = typename AccOf<T>::type;
  const DevCombo<T> k = make_combo<T>(a.g1, a.g2, a.anchor, a.a1, a.a2, a.c);
  const Acc* norm = nullptr;
  if (a.clip_norm > 0.0) {
    if (!a.norm_out) throw ArgumentError("fedspeed_update: CUDA needs a device norm_out");
    device_norm<T, HasG1, HasD>(stream, a.d, packs<T>(a.d, {a.g1, a.g2, a.anchor}), k, a.workspace, a.norm_out);
    norm = static_cast<const Acc*>(a.norm_out);
  }
  const int64_t nvec = packs<T>(a.d, {a.x, a.g1, a.g2, a.anchor});
  update_kernel<T, HasG1, HasD><<<grid_for(device, work_items(a.d, nvec, kPack<T>), kThreads), kThreads, 0, stream>>>(
      a.d, nvec, static_cast<T*>(a.x.ptr), a.x.stride, k, static_cast<Acc>(a.x_coef), static_cast<Acc>(a.lr),
      static_cast<Acc>(a.clip_norm), norm);
  check(cudaGetLastError(), "fedspeed update kernel launch");
}

template <typename T>
void update(int device, cudaStream_t stream, const UpdateArgs& a) {
  const bool g1 = a.g1.ptr != nullptr, anchor = a.anchor.ptr != nullptr;
  if (g1 && anchor) return update_flags<T, true, true>(device, stream, a);
  if (g1) return update_flags<T, true, false>(device, stream, a);
  if (anchor) return update_flags<T, false, true>(device, stream, a);
  return update_flags<T, false, false>(device, stream, a);
}

template <typename T, bool HasAcc, bool IncludeH, bool HasHsum>
void round_end_flags(int device, cudaStream_t stream, const RoundEndArgs& a) {
  using Acc = typename AccOf<T>::type;
  const int64_t nvec = packs<T>(a.d, {a.h, a.x_local, a.x_global, a.acc, a.h_sum});
  round_end_kernel<T, HasAcc, IncludeH, HasHsum>
      <<<grid_for(device, work_items(a.d, nvec, kPack<T>), kThreads), kThreads, 0, stream>>>(
          a.d, nvec, static_cast<T*>(a.h.ptr), a.h.stride, static_cast<const T*>(a.x_local.ptr), a.x_local.stride,
          static_cast<const T*>(a.x_global.ptr), a.x_global.stride, static_cast<T*>(a.acc.ptr), a.acc.stride,
          static_cast<T*>(a.h_sum.ptr), a.h_sum.stride, static_cast<Acc>(a.weight));
  check(cudaGetLastError(), "fedspeed round-end kernel launch");
}

template <typename T>
void round_end(int device, cudaStream_t stream, const RoundEndArgs& a) {
  const bool acc = a.acc.ptr != nullptr, hs = a.h_sum.ptr != nullptr;
  if (acc && a.include_h)
    return hs ? round_end_flags<T, true, true, true>(device, stream, a)
              : round_end_flags<T, true, true, false>(device, stream, a);
  if (acc)
    return hs ? round_end_flags<T, true, false, true>(device, stream, a)
              : round_end_flags<T, true, false, false>(device, stream, a);
  return hs ? round_end_flags<T, false, false, true>(device, stream, a)
            : round_end_flags<T, false, false, false>(device, stream, a);
}

}  // namespace

#define PFK_FEDSPEED_DISPATCH(fn)           \
  DeviceGuard guard(device);                \
  const cudaStream_t s = as_stream(stream); \
  switch (dtype) {                          \
    case DType::F32:                        \
      return fn<float>(device, s, args);    \
    case DType::F64:                        \
      return fn<double>(device, s, args);   \
    case DType::F16:                        \
      return fn<f16_t>(device, s, args);    \
    case DType::BF16:                       \
      return fn<bf16_t>(device, s, args);   \
  }

void fedspeed_perturb(int device, uintptr_t stream, DType dtype, const PerturbArgs& args) {
  PFK_FEDSPEED_DISPATCH(perturb)
}

void fedspeed_update(int device, uintptr_t stream, DType dtype, const UpdateArgs& args) {
  PFK_FEDSPEED_DISPATCH(update)
}

void fedspeed_round_end(int device, uintptr_t stream, DType dtype, const RoundEndArgs& args) {
  PFK_FEDSPEED_DISPATCH(round_end)
}

#undef PFK_FEDSPEED_DISPATCH

}  // namespace pfk::cuda
