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
__global__ void sumsq_partial_kernel(int64_t d, int64_t nvec, DevCombo<T> k, double* __restrict__ partials) {
  using Acc = typename AccOf<T>::type;
  double sum = 0.0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < nvec; p += step) {
    Acc v[kPack<T>];
    combo_pack<T, HasG1, HasD>(k, p, v);
#pragma unroll
    for (int i = 0; i < kPack<T>; ++i) sum += static_cast<double>(v[i]) * static_cast<double>(v[i]);
  }
  for (int64_t i = nvec * kPack<T> + first; i < d; i += step) {
    const double v = static_cast<double>(combo_at<T, HasG1, HasD>(k, i));
    sum += v * v;
  }
  const double total = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename Acc>
__global__ void norm_finalize_kernel(const double* __restrict__ partials, int count, Acc* __restrict__ norm_out) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  const double total = block_sum(sum);
  if (threadIdx.x == 0) norm_out[0] = static_cast<Acc>(sqrt(total));
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
  for (int64_t it = first; it < nvec; it += step) {
    const int64_t v = nvec - 1 - it;  // last packs first: see update_kernel
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
  for (int64_t it = first; it < nvec; it += step) {
    // Last packs first: the norm pass before this kernel read them last, so the end of its inputs may still be in
    // L2 (up to 50 MB on an H100) when this pass starts; the result is the same in any order.
    const int64_t p = nvec - 1 - it;
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
  double* partials = static_cast<double*>(workspace);
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

// Row forms ---------------------------------------------------------------------------------------------------
// Row r of every vector starts at ptr + r * row_stride. A norm per row: blockIdx.x is the partial (exactly
// fedspeed_row_partials(d) of them, a function of d only), blockIdx.y the row (rows beyond the grid's y limit loop);
// one block per row then adds its partials in a fixed tree order. Round end adds the rows into acc and h_sum in row
// order, one thread per element, so the sums never race and do not depend on the launch.

constexpr int64_t kMaxGridY = 65535;

template <typename T>
__device__ __forceinline__ DevCombo<T> combo_row(DevCombo<T> k, int64_t r, int64_t r1, int64_t r2, int64_t ra) {
  if (k.g1 != nullptr) k.g1 += r * r1;
  k.g2 += r * r2;
  if (k.anchor != nullptr) k.anchor += r * ra;
  return k;
}

template <typename T, bool HasG1, bool HasD>
__global__ void rows_sumsq_partial_kernel(int64_t rows, int64_t d, DevCombo<T> k, int64_t r1, int64_t r2, int64_t ra,
                                          double* __restrict__ partials) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {  // uniform in the block: block_sum may synchronise
    const DevCombo<T> kr = combo_row(k, r, r1, r2, ra);
    double sum = 0.0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
      const double v = static_cast<double>(combo_at<T, HasG1, HasD>(kr, i));
      sum += v * v;
    }
    const double total = block_sum(sum);
    if (threadIdx.x == 0) partials[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

template <typename Acc>
__global__ void rows_norm_finalize_kernel(const double* __restrict__ partials, int count, int64_t rows,
                                          Acc* __restrict__ norm_out, int64_t norm_stride) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    double sum = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[r * count + i];
    const double total = block_sum(sum);
    if (threadIdx.x == 0) norm_out[r * norm_stride] = static_cast<Acc>(sqrt(total));
    __syncthreads();
  }
}

template <typename T>
__global__ void rows_perturb_kernel(int64_t rows, int64_t d, const T* x, int64_t xr, int64_t sx, const T* g, int64_t gr,
                                    int64_t sg, T* out, int64_t outr, int64_t so, typename AccOf<T>::type rho,
                                    typename AccOf<T>::type eps, const typename AccOf<T>::type* __restrict__ norm,
                                    int64_t norm_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    Acc s = rho;
    if (norm != nullptr) {
      const Acc denom = norm[r * norm_stride] + eps;
      s = denom > Acc(0) ? rho / denom : Acc(0);  // zero gradient with eps = 0: no perturbation
    }
    const T* xrow = x + r * xr;
    const T* grow = g + r * gr;
    T* orow = out + r * outr;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
      orow[i * so] = Store<T>::from(to_acc(xrow[i * sx]) + s * to_acc(grow[i * sg]));
    }
  }
}

template <typename T, bool HasG1, bool HasD>
__global__ void rows_update_kernel(int64_t rows, int64_t d, T* x, int64_t xr, int64_t sx, DevCombo<T> k, int64_t r1,
                                   int64_t r2, int64_t ra, typename AccOf<T>::type x_coef, typename AccOf<T>::type lr,
                                   typename AccOf<T>::type clip_norm, const typename AccOf<T>::type* __restrict__ norm,
                                   int64_t norm_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    Acc scale = Acc(1);
    if (norm != nullptr) scale = fmin(Acc(1), clip_norm / (norm[r * norm_stride] + Acc(1e-6)));
    const DevCombo<T> kr = combo_row(k, r, r1, r2, ra);
    T* xrow = x + r * xr;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
      const Acc xv = to_acc(xrow[i * sx]);
      const Acc v = combo_at<T, HasG1, HasD>(kr, i);
      xrow[i * sx] = Store<T>::from(xv - lr * (scale * v + x_coef * xv));
    }
  }
}

template <typename T, bool HasAcc, bool IncludeH, bool HasHsum>
__global__ void rows_round_end_kernel(int64_t rows, int64_t d, T* h, int64_t hr, int64_t sh, const T* xk, int64_t kr,
                                      int64_t sk, const T* xt, int64_t tr, int64_t st, T* acc, int64_t sa, T* hs,
                                      int64_t ss, typename AccOf<T>::type w) {
  using Acc = typename AccOf<T>::type;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < d; i += step) {
    Acc a = HasAcc ? to_acc(acc[i * sa]) : Acc(0);
    Acc sum = HasHsum ? to_acc(hs[i * ss]) : Acc(0);
    for (int64_t r = 0; r < rows; ++r) {  // row order, as the 1-D kernel called row after row
      const Acc xl = to_acc(xk[r * kr + i * sk]);
      const Acc delta = xl - to_acc(xt[r * tr + i * st]);
      const Acc hn = to_acc(h[r * hr + i * sh]) + delta;
      h[r * hr + i * sh] = Store<T>::from(hn);
      if constexpr (HasAcc) a = to_acc(Store<T>::from(a + w * (IncludeH ? xl + hn : xl)));
      if constexpr (HasHsum) sum = to_acc(Store<T>::from(sum + delta));
    }
    if constexpr (HasAcc) acc[i * sa] = Store<T>::from(a);
    if constexpr (HasHsum) hs[i * ss] = Store<T>::from(sum);
  }
}

dim3 rows_grid(int device, int64_t rows, int64_t d) {
  const unsigned y = static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY);
  const unsigned wanted = grid_for(device, d * rows, kThreads) / y;  // spread the machine over the rows
  const int64_t per_row = (d + kThreads - 1) / kThreads;
  const unsigned x = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < per_row ? wanted : per_row));
  return dim3(x, y);
}

// ||combo|| of every row into norm_out (device memory), the workspace holding rows * partials partial sums.
template <typename T, bool HasG1, bool HasD>
void rows_device_norm(cudaStream_t stream, int64_t rows, int64_t d, const DevCombo<T>& k, int64_t r1, int64_t r2,
                      int64_t ra, void* workspace, void* norm_out, int64_t norm_stride) {
  using Acc = typename AccOf<T>::type;
  const int partials = static_cast<int>(fedspeed_row_partials(d));
  const dim3 grid(static_cast<unsigned>(partials), static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
  double* parts = static_cast<double*>(workspace);
  rows_sumsq_partial_kernel<T, HasG1, HasD><<<grid, kThreads, 0, stream>>>(rows, d, k, r1, r2, ra, parts);
  check(cudaGetLastError(), "fedspeed rows norm partial kernel launch");
  const unsigned blocks = static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY);
  rows_norm_finalize_kernel<Acc>
      <<<blocks, kThreads, 0, stream>>>(parts, partials, rows, static_cast<Acc*>(norm_out), norm_stride);
  check(cudaGetLastError(), "fedspeed rows norm finalize kernel launch");
}

template <typename T>
void perturb_rows(int device, cudaStream_t stream, const PerturbArgs& a) {
  using Acc = typename AccOf<T>::type;
  const Acc* norm = nullptr;
  if (a.normalize) {
    if (!a.norm_out) throw ArgumentError("fedspeed_perturb_rows: CUDA needs a device norm_out");
    rows_device_norm<T, false, false>(stream, a.rows, a.d, make_combo<T>({}, a.g, {}, 0.0, 1.0, 0.0), 0, a.g.row_stride,
                                      0, a.workspace, a.norm_out, a.norm_stride);
    norm = static_cast<const Acc*>(a.norm_out);
  }
  rows_perturb_kernel<T><<<rows_grid(device, a.rows, a.d), kThreads, 0, stream>>>(
      a.rows, a.d, static_cast<const T*>(a.x.ptr), a.x.row_stride, a.x.stride, static_cast<const T*>(a.g.ptr),
      a.g.row_stride, a.g.stride, static_cast<T*>(a.out.ptr), a.out.row_stride, a.out.stride, static_cast<Acc>(a.rho),
      static_cast<Acc>(a.eps), norm, a.norm_stride);
  check(cudaGetLastError(), "fedspeed rows perturb kernel launch");
}

template <typename T, bool HasG1, bool HasD>
void update_rows_flags(int device, cudaStream_t stream, const UpdateArgs& a) {
  using Acc = typename AccOf<T>::type;
  const DevCombo<T> k = make_combo<T>(a.g1, a.g2, a.anchor, a.a1, a.a2, a.c);
  const int64_t r1 = a.g1.row_stride, r2 = a.g2.row_stride, ra = a.anchor.row_stride;
  const Acc* norm = nullptr;
  if (a.clip_norm > 0.0) {
    if (!a.norm_out) throw ArgumentError("fedspeed_update_rows: CUDA needs a device norm_out");
    rows_device_norm<T, HasG1, HasD>(stream, a.rows, a.d, k, r1, r2, ra, a.workspace, a.norm_out, a.norm_stride);
    norm = static_cast<const Acc*>(a.norm_out);
  }
  rows_update_kernel<T, HasG1, HasD><<<rows_grid(device, a.rows, a.d), kThreads, 0, stream>>>(
      a.rows, a.d, static_cast<T*>(a.x.ptr), a.x.row_stride, a.x.stride, k, r1, r2, ra, static_cast<Acc>(a.x_coef),
      static_cast<Acc>(a.lr), static_cast<Acc>(a.clip_norm), norm, a.norm_stride);
  check(cudaGetLastError(), "fedspeed rows update kernel launch");
}

template <typename T>
void update_rows(int device, cudaStream_t stream, const UpdateArgs& a) {
  const bool g1 = a.g1.ptr != nullptr, anchor = a.anchor.ptr != nullptr;
  if (g1 && anchor) return update_rows_flags<T, true, true>(device, stream, a);
  if (g1) return update_rows_flags<T, true, false>(device, stream, a);
  if (anchor) return update_rows_flags<T, false, true>(device, stream, a);
  return update_rows_flags<T, false, false>(device, stream, a);
}

template <typename T, bool HasAcc, bool IncludeH, bool HasHsum>
void round_end_rows_flags(int device, cudaStream_t stream, const RoundEndArgs& a) {
  using Acc = typename AccOf<T>::type;
  rows_round_end_kernel<T, HasAcc, IncludeH, HasHsum><<<grid_for(device, a.d, kThreads), kThreads, 0, stream>>>(
      a.rows, a.d, static_cast<T*>(a.h.ptr), a.h.row_stride, a.h.stride, static_cast<const T*>(a.x_local.ptr),
      a.x_local.row_stride, a.x_local.stride, static_cast<const T*>(a.x_global.ptr), a.x_global.row_stride,
      a.x_global.stride, static_cast<T*>(a.acc.ptr), a.acc.stride, static_cast<T*>(a.h_sum.ptr), a.h_sum.stride,
      static_cast<Acc>(a.weight));
  check(cudaGetLastError(), "fedspeed rows round-end kernel launch");
}

template <typename T>
void round_end_rows(int device, cudaStream_t stream, const RoundEndArgs& a) {
  const bool acc = a.acc.ptr != nullptr, hs = a.h_sum.ptr != nullptr;
  if (acc && a.include_h)
    return hs ? round_end_rows_flags<T, true, true, true>(device, stream, a)
              : round_end_rows_flags<T, true, true, false>(device, stream, a);
  if (acc)
    return hs ? round_end_rows_flags<T, true, false, true>(device, stream, a)
              : round_end_rows_flags<T, true, false, false>(device, stream, a);
  return hs ? round_end_rows_flags<T, false, false, true>(device, stream, a)
            : round_end_rows_flags<T, false, false, false>(device, stream, a);
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

void fedspeed_perturb_rows(int device, uintptr_t stream, DType dtype, const PerturbArgs& args) {
  PFK_FEDSPEED_DISPATCH(perturb_rows)
}

void fedspeed_update_rows(int device, uintptr_t stream, DType dtype, const UpdateArgs& args) {
  PFK_FEDSPEED_DISPATCH(update_rows)
}

void fedspeed_round_end_rows(int device, uintptr_t stream, DType dtype, const RoundEndArgs& args) {
  PFK_FEDSPEED_DISPATCH(round_end_rows)
}

#undef PFK_FEDSPEED_DISPATCH

}  // namespace pfk::cuda
