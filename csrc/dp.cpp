// Differential-privacy kernels (CPU).
//
// clip_accumulate: out = sum_k s_k * (u_k - c) with s_k = min(1, C / ||u_k - c||), in two passes over the rows: the
// norms (float64 partial sums per column chunk, combined in chunk order), then the scaled sum (column tiles that stay
// in L1 while every row streams through once, rows added in row order). Results do not depend on the thread count.
//
// gaussian_noise: x += std * z, z standard normal from a counter-based generator: Philox4x32-10 (Salmon et al. 2011)
// keyed by the 64-bit seed, its counter (block index, 64-bit stream), each block's four 32-bit words turned into four
// normals by Box-Muller. The logarithm, sine and cosine are polynomials of +, -, *, / and sqrt only (the build uses
// -ffp-contract=off), so the NumPy reference (pyfedkern.reference.dp) computes the same bits. Element i of the vector
// takes lane (i % 256) / 64 of block (i / 256) * 64 + i % 64: 64 blocks fill 256 consecutive elements, lane by lane.
#include <pybind11/numpy.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

// ---- clip_accumulate ------------------------------------------------------------------------------------------

constexpr int64_t kNormChunk = 4096;  // columns per partial norm
constexpr int64_t kTile = 4096;       // columns per accumulator tile (16-32 KiB, in L1)

template <typename T>
PFK_ALWAYS_INLINE void sq_norms_chunk_body(int64_t begin, int64_t end, const std::vector<RowRef>& rows, const T* center,
                                           int64_t center_stride, double* partial) {
  for (size_t k = 0; k < rows.size(); ++k) {
    const T* __restrict__ u = static_cast<const T*>(rows[k].ptr);
    const int64_t s = rows[k].stride;
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = begin;
    for (; j + 8 <= end; j += 8) {
      for (int l = 0; l < 8; ++l) {
        const double c = center ? double(to_acc(center[(j + l) * center_stride])) : 0.0;
        const double v = double(to_acc(u[(j + l) * s])) - c;
        lane[l] += v * v;
      }
    }
    double total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; j < end; ++j) {
      const double c = center ? double(to_acc(center[j * center_stride])) : 0.0;
      const double v = double(to_acc(u[j * s])) - c;
      total += v * v;
    }
    partial[k] = total;
  }
}

PFK_ISA_DISPATCH(template <typename T>, <T>, void, sq_norms_chunk,
                 (int64_t begin, int64_t end, const std::vector<RowRef>& rows, const T* center, int64_t center_stride,
                  double* partial),
                 (begin, end, rows, center, center_stride, partial), sq_norms_chunk_body)

template <typename T>
PFK_ALWAYS_INLINE void clipped_tile_body(int64_t begin, int64_t end, T* out, int64_t out_stride,
                                         const std::vector<RowRef>& rows, const std::vector<double>& scales,
                                         const T* center, int64_t center_stride) {
  using Acc = typename AccOf<T>::type;
  const int64_t n = end - begin;
  Acc acc[kTile];
  Acc c[kTile];
  for (int64_t j = 0; j < n; ++j) {
    acc[j] = Acc(0);
    c[j] = center ? to_acc(center[(begin + j) * center_stride]) : Acc(0);
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    const int64_t s = rows[k].stride;
    const T* __restrict__ u = static_cast<const T*>(rows[k].ptr) + begin * s;
    const Acc w = Acc(scales[k]);
    if (s == 1) {
      for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + w * (to_acc(u[j]) - c[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + w * (to_acc(u[j * s]) - c[j]);
    }
  }
  for (int64_t j = 0; j < n; ++j) out[(begin + j) * out_stride] = Store<T>::from(acc[j]);
}

PFK_ISA_DISPATCH(template <typename T>, <T>, void, clipped_tile,
                 (int64_t begin, int64_t end, T* out, int64_t out_stride, const std::vector<RowRef>& rows,
                  const std::vector<double>& scales, const T* center, int64_t center_stride),
                 (begin, end, out, out_stride, rows, scales, center, center_stride), clipped_tile_body)

template <typename T>
void clip_accumulate_typed(int64_t d, void* out, int64_t out_stride, const std::vector<RowRef>& rows,
                           const void* center, int64_t center_stride, double clip, double* norms) {
  const T* c = static_cast<const T*>(center);
  const int64_t k = static_cast<int64_t>(rows.size());
  const int64_t chunks = (d + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(static_cast<size_t>(chunks * k));
  parallel_chunks(d, kNormChunk, k * d, [&](int64_t chunk, int64_t begin, int64_t end) {
    sq_norms_chunk<T>(begin, end, rows, c, center_stride, partial.data() + chunk * k);
  });
  std::vector<double> scales(static_cast<size_t>(k));
  for (int64_t r = 0; r < k; ++r) {
    double sq = 0.0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) sq += partial[chunk * k + r];
    norms[r] = std::sqrt(sq);
    scales[r] = norms[r] > clip ? clip / norms[r] : (norms[r] <= clip ? 1.0 : norms[r]);  // NaN norms stay NaN
  }
  T* o = static_cast<T*>(out);
  parallel_chunks(d, kTile, (k + 1) * d, [&](int64_t, int64_t begin, int64_t end) {
    clipped_tile<T>(begin, end, o, out_stride, rows, scales, c, center_stride);
  });
}

void clip_accumulate(const std::string& dtype_name, int64_t d, uintptr_t out, int64_t out_stride,
                     const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides, uintptr_t base,
                     int64_t step_bytes, int64_t count, int64_t col_stride, uintptr_t center, int64_t center_stride,
                     double clip, const py::array_t<double, py::array::c_style>& norms) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("clip_accumulate: d must be >= 1");
  if (out == 0) throw ArgumentError("clip_accumulate: out is a null pointer");
  if (!(clip > 0)) throw ArgumentError("clip_accumulate: clip must be > 0");
  const std::vector<RowRef> rows = make_rows(ptrs, strides, base, step_bytes, count, col_stride);
  if (rows.empty()) throw ArgumentError("clip_accumulate: need at least one row");
  if (static_cast<size_t>(norms.size()) != rows.size()) throw ArgumentError("clip_accumulate: one norm per row");
  double* nrm = const_cast<double*>(norms.data());  // the caller's fresh float64 buffer
  void* o = reinterpret_cast<void*>(out);
  const void* c = reinterpret_cast<const void*>(center);
  switch (dtype) {
    case DType::F32:
      return clip_accumulate_typed<float>(d, o, out_stride, rows, c, center_stride, clip, nrm);
    case DType::F64:
      return clip_accumulate_typed<double>(d, o, out_stride, rows, c, center_stride, clip, nrm);
    case DType::F16:
      return clip_accumulate_typed<f16_t>(d, o, out_stride, rows, c, center_stride, clip, nrm);
    case DType::BF16:
      return clip_accumulate_typed<bf16_t>(d, o, out_stride, rows, c, center_stride, clip, nrm);
  }
}

// ---- gaussian_noise -------------------------------------------------------------------------------------------

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
constexpr int kBlocks = 64;                   // Philox blocks per chunk
constexpr int64_t kChunkElems = 4 * kBlocks;  // elements per chunk

// The float type's constants of Box-Muller: bits of the uniforms taken from a 32-bit word, the polynomials' degrees.
template <typename A>
struct Normal;
template <>
struct Normal<float> {
  static constexpr int kBits = 24;  // the word's top 24 bits
  static constexpr int kLogTerms = 6, kSinTerms = 5, kCosTerms = 6;
};
template <>
struct Normal<double> {
  static constexpr int kBits = 32;
  static constexpr int kLogTerms = 12, kSinTerms = 9, kCosTerms = 10;
};

constexpr double kLn2 = 0.6931471805599453, kSqrtHalf = 0.7071067811865476, kHalfPi = 1.5707963267948966;

constexpr double factorial(int n) {
  return n <= 1 ? 1.0 : n * factorial(n - 1);
}

// The polynomials' coefficients, rounded once from double: ln's 1/(2j+1), sin's (-1)^j/(2j+1)!, cos's (-1)^j/(2j)!.
template <typename A, int N, int Kind>
constexpr std::array<A, N> coefficients() {
  std::array<A, N> c{};
  for (int j = 0; j < N; ++j) {
    const double sign = j % 2 ? -1.0 : 1.0;
    c[j] = Kind == 0 ? A(1.0 / (2 * j + 1)) : Kind == 1 ? A(sign / factorial(2 * j + 1)) : A(sign / factorial(2 * j));
  }
  return c;
}
template <typename A>
constexpr std::array<A, Normal<A>::kLogTerms> kLogCoef = coefficients<A, Normal<A>::kLogTerms, 0>();
template <typename A>
constexpr std::array<A, Normal<A>::kSinTerms> kSinCoef = coefficients<A, Normal<A>::kSinTerms, 1>();
template <typename A>
constexpr std::array<A, Normal<A>::kCosTerms> kCosCoef = coefficients<A, Normal<A>::kCosTerms, 2>();

// ln(v) for a positive normal v: v = m * 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1).
template <typename A, typename U>
PFK_ALWAYS_INLINE A log_positive(A n) {
  constexpr int kMant = std::numeric_limits<A>::digits - 1;
  constexpr int kExpBias = std::numeric_limits<A>::max_exponent - 2;  // frexp's: m in [0.5, 1)
  U bits;
  std::memcpy(&bits, &n, sizeof(A));
  A e = A(static_cast<int32_t>(bits >> kMant) - kExpBias);
  const U mbits = (bits & ((U(1) << kMant) - 1)) | (U(kExpBias) << kMant);
  A m;
  std::memcpy(&m, &mbits, sizeof(A));
  const bool low = m < A(kSqrtHalf);
  m = low ? m + m : m;
  e = low ? e - A(1) : e;
  const A s = (m - A(1)) / (m + A(1));
  const A s2 = s * s;
  A t = kLogCoef<A>[Normal<A>::kLogTerms - 1];
  for (int j = Normal<A>::kLogTerms - 2; j >= 0; --j) t = t * s2 + kLogCoef<A>[j];
  return e * A(kLn2) + (s + s) * t;
}

// A uint32 as A, exactly, through int32 conversions (vectorisable, unlike uint64 -> floating point without AVX-512).
template <typename A>
PFK_ALWAYS_INLINE A from_u32(uint32_t v) {
  return A(static_cast<int32_t>(v ^ 0x80000000u)) + A(2147483648.0);
}

// Two normals from two 32-bit words (Box-Muller): sqrt(-2 ln u1) * (cos, sin)(2 pi u2).
template <typename A>
PFK_ALWAYS_INLINE void box_muller(uint32_t a, uint32_t b, A& z_cos, A& z_sin) {
  using U = std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>;
  constexpr int kBits = Normal<A>::kBits;
  // u1 = n1 / 2^bits in (0, 1], n1 = (a >> (32 - bits)) + 1, converted exactly through int32 (vectorisable)
  const A n1 = kBits < 32 ? A(static_cast<int32_t>(a >> (32 - kBits))) + A(1) : from_u32<A>(a) + A(1);
  const A ln_u1 = log_positive<A, U>(n1 * A(1.0 / double(uint64_t(1) << kBits)));
  const A r = std::sqrt(A(-2) * ln_u1);
  const uint32_t n2 = b >> (32 - kBits);  // u2 = n2 / 2^bits in [0, 1): quadrant, then the angle within it
  const uint32_t quadrant = n2 >> (kBits - 2);
  const uint32_t f = n2 & ((1u << (kBits - 2)) - 1);
  const uint32_t half = 1u << (kBits - 3);
  const bool swap = f > half;
  const uint32_t g = swap ? (1u << (kBits - 2)) - f : f;  // angle g / 2^(bits-2) * pi/2 in [0, pi/4]
  const A x = A(static_cast<int32_t>(g)) * A(kHalfPi / double(1u << (kBits - 2)));
  const A x2 = x * x;
  // sin x = x * sum_j (-1)^j x^2j / (2j+1)!, cos x = sum_j (-1)^j x^2j / (2j)!, by Horner's rule in x^2
  A ps = A(0), pc = A(0);
  for (int j = Normal<A>::kSinTerms - 1; j >= 0; --j) ps = ps * x2 + kSinCoef<A>[j];
  for (int j = Normal<A>::kCosTerms - 1; j >= 0; --j) pc = pc * x2 + kCosCoef<A>[j];
  const A sx = x * ps;
  const A s = swap ? pc : sx;  // sin and cos of the angle within the quadrant
  const A c = swap ? sx : pc;
  const bool odd = quadrant & 1u;  // quadrants 0-3: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s)
  const A sin_t = (odd ? c : s) * A(quadrant & 2u ? -1.0 : 1.0);
  const A cos_t = (odd ? s : c) * A((quadrant + 1u) & 2u ? -1.0 : 1.0);
  z_cos = r * cos_t;
  z_sin = r * sin_t;
}

// Normals of one chunk of 64 blocks (256 elements), lane-major: z[lane * 64 + b].
template <typename A>
PFK_ALWAYS_INLINE void normal_chunk_body(uint64_t first_block, uint32_t k0, uint32_t k1, uint64_t stream, A* z) {
  // The 64 blocks' counters side by side, one Philox round at a time (a loop over lanes the compiler vectorises).
  uint32_t c0[kBlocks], c1[kBlocks], c2[kBlocks], c3[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    const uint64_t block = first_block + static_cast<uint64_t>(b);
    c0[b] = static_cast<uint32_t>(block), c1[b] = static_cast<uint32_t>(block >> 32);
    c2[b] = static_cast<uint32_t>(stream), c3[b] = static_cast<uint32_t>(stream >> 32);
  }
  uint32_t key0 = k0, key1 = k1;
  for (int r = 0; r < 10; ++r) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint64_t p0 = uint64_t(kPhiloxM0) * c0[b], p1 = uint64_t(kPhiloxM1) * c2[b];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[b] ^ key0, n1 = static_cast<uint32_t>(p1);
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[b] ^ key1, n3 = static_cast<uint32_t>(p0);
      c0[b] = n0, c1[b] = n1, c2[b] = n2, c3[b] = n3;
    }
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  for (int b = 0; b < kBlocks; ++b) box_muller<A>(c0[b], c1[b], z[b], z[kBlocks + b]);
  for (int b = 0; b < kBlocks; ++b) box_muller<A>(c2[b], c3[b], z[2 * kBlocks + b], z[3 * kBlocks + b]);
}

template <typename A>
PFK_ALWAYS_INLINE void noise_span_body(int64_t begin, int64_t end, A* x, int64_t stride, A std, uint32_t k0,
                                       uint32_t k1, uint64_t stream) {
  A z[kChunkElems];
  for (int64_t at = begin; at < end; at += kChunkElems) {  // begin is a multiple of kChunkElems
    normal_chunk_body<A>(static_cast<uint64_t>(at / kChunkElems) * kBlocks, k0, k1, stream, z);
    const int64_t n = std::min(kChunkElems, end - at);
    A* __restrict__ xs = x + at * stride;
    if (stride == 1) {
      for (int64_t j = 0; j < n; ++j) xs[j] = xs[j] + std * z[j];
    } else {
      for (int64_t j = 0; j < n; ++j) xs[j * stride] = xs[j * stride] + std * z[j];
    }
  }
}

PFK_ISA_DISPATCH(template <typename A>, <A>, void, noise_span,
                 (int64_t begin, int64_t end, A* x, int64_t stride, A std, uint32_t k0, uint32_t k1, uint64_t stream),
                 (begin, end, x, stride, std, k0, k1, stream), noise_span_body)

constexpr int64_t kNoiseSpan = 64 * kChunkElems;  // elements per parallel chunk (a multiple of a generator chunk)

template <typename A>
void gaussian_noise_typed(int64_t d, void* x, int64_t stride, double std, uint64_t seed, uint64_t stream) {
  A* xs = static_cast<A*>(x);
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  parallel_chunks(d, kNoiseSpan, 16 * d, [&](int64_t, int64_t begin, int64_t end) {
    noise_span<A>(begin, end, xs, stride, A(std), k0, k1, stream);
  });
}

void gaussian_noise(const std::string& dtype_name, int64_t d, uintptr_t x, int64_t stride, double std, uint64_t seed,
                    uint64_t stream) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("gaussian_noise: d must be >= 1");
  if (x == 0) throw ArgumentError("gaussian_noise: x is a null pointer");
  if (!std::isfinite(std) || std < 0) throw ArgumentError("gaussian_noise: std must be finite and >= 0");
  switch (dtype) {
    case DType::F32:
      return gaussian_noise_typed<float>(d, reinterpret_cast<void*>(x), stride, std, seed, stream);
    case DType::F64:
      return gaussian_noise_typed<double>(d, reinterpret_cast<void*>(x), stride, std, seed, stream);
    default:
      throw ArgumentError("gaussian_noise: x must be float32 or float64");
  }
}

}  // namespace

void bind_dp(py::module_& m) {
  m.def("clip_accumulate", &clip_accumulate, py::arg("dtype"), py::arg("d"), py::arg("out"), py::arg("out_stride"),
        py::arg("ptrs"), py::arg("strides"), py::arg("base"), py::arg("step_bytes"), py::arg("count"),
        py::arg("col_stride"), py::arg("center"), py::arg("center_stride"), py::arg("clip"), py::arg("norms"),
        py::call_guard<py::gil_scoped_release>(),
        "out = sum_k min(1, clip / ||row_k - center||) (row_k - center) (center 0: no center); the norms go to "
        "`norms` (float64, one per row). CPU only.");
  m.def("gaussian_noise", &gaussian_noise, py::arg("dtype"), py::arg("d"), py::arg("x"), py::arg("stride"),
        py::arg("std"), py::arg("seed"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "x += std * z, z standard normal from Philox4x32-10 (key: seed; counter: block, stream) and Box-Muller. "
        "CPU only.");
}

}  // namespace pfk
