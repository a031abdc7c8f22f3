// Portable IEEE float16 / bfloat16 <-> float32 conversions (round to nearest even), host and device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)
#define PFK_HD __host__ __device__ __forceinline__
#else
#define PFK_HD inline
#endif

namespace pfk {

PFK_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

PFK_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

PFK_HD float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

PFK_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

PFK_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

PFK_HD uint16_t float_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#endif
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to +-inf
  if (a < 0x38800000u) {  // result is subnormal or zero: round a * 2^24 to an integer, ties to even
    const float scaled = bits_to_float(a) * 16777216.0f;
    uint32_t q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias exponent 127 -> 15 and round the dropped 13 bits
  return static_cast<uint16_t>(sign | (a >> 13));
}

// Storage type -> float conversion used by templated kernels. T is float, double or a 16-bit tag type.
struct f16_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

PFK_HD float to_acc(f16_t v) {
  return f16_to_float(v.bits);
}
PFK_HD float to_acc(bf16_t v) {
  return bf16_to_float(v.bits);
}
PFK_HD float to_acc(float v) {
  return v;
}
PFK_HD double to_acc(double v) {
  return v;
}

template <typename T>
struct Store;
template <>
struct Store<float> {
  PFK_HD static float from(float a) { return a; }
};
template <>
struct Store<double> {
  PFK_HD static double from(double a) { return a; }
};
template <>
struct Store<f16_t> {
  PFK_HD static f16_t from(float a) { return f16_t{float_to_f16(a)}; }
};
template <>
struct Store<bf16_t> {
  PFK_HD static bf16_t from(float a) { return bf16_t{float_to_bf16(a)}; }
};

// Accumulator type: float for float32 and 16-bit storage, double for float64.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

}  // namespace pfk
