// Helpers shared by pyfedkern's CUDA sources: error checks, device selection, launch sizing, and the per-call
// argument tables that travel inside kernel parameters.
//
// An op call in the steady state neither allocates device memory nor synchronises: small per-call tables (row
// pointers, strides, weights, segment offsets) are packed into an ArgPack and passed by value as a
// `__grid_constant__` kernel parameter (a CUDA graph captures them with the launch), and device scratch comes from
// the caller's library (torch's caching allocator, cupy's pool) through the Python layer. Only a table larger
// than kLargeArgs bytes is copied into that scratch, asynchronously from pageable memory, which a graph cannot
// capture (refused with a clear error during capture).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "half.h"
#include "types.h"

namespace pfk::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("pyfedkern CUDA error in ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
}

// Makes `device` current for this host thread while in scope (this runtime's state only; torch's is separate).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

inline cudaStream_t as_stream(uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

int sm_count(int device);  // multiprocessors of `device`, queried once per device (runtime.cu)

// Blocks for a grid-stride loop over `work` items with `threads` per block: enough to fill every SM.
inline unsigned grid_for(int device, int64_t work, int threads) {
  const int64_t wanted = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * 16;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- Vector access ------------------------------------------------------------------------------------------

// W elements of T read or written as one access of W * sizeof(T) bytes (16 or 8).
template <typename T, int W>
struct alignas(W * sizeof(T)) Pack {
  T v[W];
};

template <int W, typename T, typename Acc>
__device__ __forceinline__ void load_pack(const T* p, int64_t pack, Acc (&out)[W]) {
  const Pack<T, W> q = reinterpret_cast<const Pack<T, W>*>(p)[pack];
#pragma unroll
  for (int i = 0; i < W; ++i) out[i] = to_acc(q.v[i]);
}

template <int W, typename T, typename Acc>
__device__ __forceinline__ void store_pack(T* p, int64_t pack, const Acc (&in)[W]) {
  Pack<T, W> q;
#pragma unroll
  for (int i = 0; i < W; ++i) q.v[i] = Store<T>::from(in[i]);
  reinterpret_cast<Pack<T, W>*>(p)[pack] = q;
}

// The access width in bytes (16 or 8) that every given address allows, or 0 when one is not 8-byte aligned.
inline int common_alignment(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return (bits & 15u) == 0 ? 16 : ((bits & 7u) == 0 ? 8 : 0);
}

// Calls fn(std::integral_constant<int, W>) with W = elements of T per access for `bytes` (16 or 8; W >= 1).
template <typename T, typename Fn>
void with_pack_width(int bytes, Fn&& fn) {
  if (bytes == 16) {
    fn(std::integral_constant<int, 16 / sizeof(T)>{});
  } else {
    fn(std::integral_constant<int, (8 / sizeof(T) > 0 ? 8 / sizeof(T) : 1)>{});
  }
}

// ---- Per-call argument tables --------------------------------------------------------------------------------

constexpr size_t kSmallArgs = 1024;  // bytes of the parameter block of most calls
constexpr size_t kLargeArgs = 8192;  // the largest parameter block; bigger tables go through device scratch

template <size_t N>
struct alignas(16) ArgBlock {
  unsigned char bytes[N];
};

// Host-side builder of a call's tables: each add() appends a 16-byte aligned array and returns its byte offset.
class ArgPack {
 public:
  ArgPack() { bytes_.reserve(kSmallArgs); }
  template <typename U>
  int64_t add(const U* data, size_t n) {
    const size_t offset = (bytes_.size() + 15) & ~size_t(15);
    bytes_.resize(offset + n * sizeof(U));
    if (n) std::memcpy(bytes_.data() + offset, data, n * sizeof(U));
    return static_cast<int64_t>(offset);
  }
  template <typename U>
  int64_t add(const std::vector<U>& v) {
    return add(v.data(), v.size());
  }
  size_t size() const { return bytes_.size(); }
  const unsigned char* data() const { return bytes_.data(); }

 private:
  std::vector<unsigned char> bytes_;
};

// Bytes of scratch a launch needs beyond what it was given: the op returns this to Python, which allocates it and
// calls again. Every launcher checks it before launching anything.
inline size_t tables_scratch_bytes(const ArgPack& pack) {
  return pack.size() <= kLargeArgs ? 0 : (pack.size() + 255) & ~size_t(255);
}

// Where a kernel reads its tables: its own parameter block, or device memory when the tables did not fit.
template <size_t N>
__device__ __forceinline__ const unsigned char* table_base(const ArgBlock<N>& block, const void* global) {
  return global != nullptr ? static_cast<const unsigned char*>(global) : block.bytes;
}

template <typename U>
__device__ __forceinline__ const U* table_at(const unsigned char* base, int64_t offset) {
  return reinterpret_cast<const U*>(base + offset);
}

void refuse_if_capturing(cudaStream_t stream, const char* what);  // runtime.cu

// Calls launch(block, global) with the smallest parameter block that holds the pack, or with the pack copied into
// the first tables_scratch_bytes(pack) bytes of `scratch` (which the caller has checked is large enough).
template <typename Launch>
void with_tables(const ArgPack& pack, cudaStream_t stream, Scratch scratch, const char* what, Launch&& launch) {
  const size_t n = pack.size();
  if (n <= kSmallArgs) {
    ArgBlock<kSmallArgs> block;
    if (n) std::memcpy(block.bytes, pack.data(), n);
    launch(block, nullptr);
  } else if (n <= kLargeArgs) {
    ArgBlock<kLargeArgs> block;
    std::memcpy(block.bytes, pack.data(), n);
    launch(block, nullptr);
  } else {
    if (scratch.bytes < tables_scratch_bytes(pack))
      throw ArgumentError(std::string(what) + ": internal error: argument tables need device scratch");
    refuse_if_capturing(stream, what);
    check(cudaMemcpyAsync(scratch.ptr, pack.data(), n, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (tables)");
    ArgBlock<kSmallArgs> unused{};
    launch(unused, scratch.ptr);
  }
}

}  // namespace pfk::cuda
