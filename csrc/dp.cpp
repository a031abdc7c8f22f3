// Differential-privacy kernels (CPU).
//
// clip_accumulate: out = sum_k s_k * (u_k - c) with s_k = min(1, C / ||u_k - c||), in two passes over the rows: the
// norms (float64 partial sums per column chunk, combined in chunk order), then the scaled sum (column tiles that stay
// in L1 while every row streams through once, rows added in row order). Results do not depend on the thread count.
//
// gaussian_noise: x += std * z, z standard normal from a counter-based generator: Philox4x32-10 (Salmon et al. 2011)
// keyed by the 64-bit seed, its counter (block index, 64-bit stream), each block's four 32-bit words turned into four
// normals by Box-Muller. The logarithm, sine and cosine are polynomials of +, -, *, / and sqrt only (the build uses
// -ffp-contract=off), so the NumPy reference (pyfedkern.reference.dp) computes the same bits, and so does every ISA
// (one vector code, 8 floats or 4 doubles per vector, for SSE2, AVX2 and AVX-512). Element i of the vector takes lane
// (i % 256) / 64 of block (i / 256) * 64 + i % 64: 64 blocks fill 256 consecutive elements, lane by lane.
#include <pybind11/numpy.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "bindings.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

// gaussian_noise's 32-byte vectors never cross a call (its kernels are flattened): GCC's note that passing them
// without AVX would change the ABI does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

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
//
// Written once with GCC vector extensions (32-byte vectors of floats or doubles) and compiled for each ISA, which
// maps the vectors to its registers; the only ISA-specific code is the high half of a 32x32-bit product. Every lane
// performs the same IEEE operations as the reference's scalar code, so all ISAs give the same bits.

// GCC reports Philox's state arrays as maybe uninitialised in the AVX-512 build (they are initialised).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

// Box-Muller's vectors: 32 bytes of A (8 floats or 4 doubles) and the integer vectors of the same lanes.
template <typename A>
struct Lanes;
template <>
struct Lanes<float> {
  static constexpr int kN = 8;
  using V = float __attribute__((vector_size(32)));     // the values
  using U = uint32_t __attribute__((vector_size(32)));  // their bits
  using I = int32_t __attribute__((vector_size(32)));   // comparison masks
  using W = uint32_t __attribute__((vector_size(32)));  // the generator's words
  using J = int32_t __attribute__((vector_size(32)));   // int32 lanes
  using B = uint32_t;
  static constexpr int kMant = 23, kExpBias = 126;  // frexp's: m in [0.5, 1)
};
template <>
struct Lanes<double> {
  static constexpr int kN = 4;
  using V = double __attribute__((vector_size(32)));
  using U = uint64_t __attribute__((vector_size(32)));
  using I = int64_t __attribute__((vector_size(32)));
  using W = uint32_t __attribute__((vector_size(16)));
  using J = int32_t __attribute__((vector_size(16)));
  using B = uint64_t;
  static constexpr int kMant = 52, kExpBias = 1022;
};

// Philox's state: one 32-bit word of 8 consecutive blocks per vector, two such vectors interleaved (for latency).
constexpr int kPhiloxLanes = 8, kPhiloxVectors = 2;
using w32v = uint32_t __attribute__((vector_size(4 * kPhiloxLanes)));

// The high 32 bits of the lanes' 64-bit products a * b (even lanes, then the odd lanes shifted down, blended).
// The kernels below are plain `inline` and flattened into one function per ISA, where these intrinsics inline.
#if defined(__x86_64__) && defined(__GNUC__)
inline __m128i mulhi_sse2(__m128i x, __m128i y) {
  const __m128i even_hi = _mm_srli_epi64(_mm_mul_epu32(x, y), 32);
  const __m128i odd_hi = _mm_mul_epu32(_mm_srli_epi64(x, 32), _mm_srli_epi64(y, 32));
  const __m128i odd = _mm_set_epi32(-1, 0, -1, 0);
  return _mm_or_si128(_mm_andnot_si128(odd, even_hi), _mm_and_si128(odd, odd_hi));
}
inline w32v mulhi_sse2(w32v a, w32v b) {
  using q32v = uint32_t __attribute__((vector_size(16)));
  const q32v a0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), a1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const q32v b0 = __builtin_shufflevector(b, b, 0, 1, 2, 3), b1 = __builtin_shufflevector(b, b, 4, 5, 6, 7);
  const q32v h0 = reinterpret_cast<q32v>(mulhi_sse2(reinterpret_cast<__m128i>(a0), reinterpret_cast<__m128i>(b0)));
  const q32v h1 = reinterpret_cast<q32v>(mulhi_sse2(reinterpret_cast<__m128i>(a1), reinterpret_cast<__m128i>(b1)));
  return __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 4, 5, 6, 7);
}
__attribute__((target("avx2"))) inline w32v mulhi_avx2(w32v a, w32v b) {
  const __m256i x = reinterpret_cast<__m256i>(a), y = reinterpret_cast<__m256i>(b);
  const __m256i even_hi = _mm256_srli_epi64(_mm256_mul_epu32(x, y), 32);
  const __m256i odd_hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(y, 32));
  return reinterpret_cast<w32v>(_mm256_blend_epi32(even_hi, odd_hi, 0xAA));
}
#endif
template <Isa I>
inline w32v mulhi(w32v a, w32v b) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (I == Isa::Baseline) return mulhi_sse2(a, b);
  return mulhi_avx2(a, b);  // AVX-512 too, on 256-bit vectors
#else
  w32v h;
  for (int l = 0; l < kPhiloxLanes; ++l) h[l] = static_cast<uint32_t>((uint64_t(a[l]) * b[l]) >> 32);
  return h;
#endif
}

// Philox4x32-10 of 16 consecutive blocks from first_block (a multiple of 16): their words to w[word][at + b].
template <Isa I>
inline void philox_blocks(uint64_t first_block, uint32_t k0, uint32_t k1, uint64_t stream, uint32_t (*w)[kBlocks],
                          int at) {
  constexpr int kV = kPhiloxVectors;
  w32v iota;
  for (int l = 0; l < kPhiloxLanes; ++l) iota[l] = static_cast<uint32_t>(l);
  const w32v hi = w32v{} + static_cast<uint32_t>(first_block >> 32);  // shared: the low words do not wrap
  const w32v s0 = w32v{} + static_cast<uint32_t>(stream), s1 = w32v{} + static_cast<uint32_t>(stream >> 32);
  w32v c0[kV], c1[kV], c2[kV], c3[kV];
  for (int v = 0; v < kV; ++v) {
    c0[v] = iota + static_cast<uint32_t>(first_block + uint64_t(v * kPhiloxLanes));
    c1[v] = hi, c2[v] = s0, c3[v] = s1;
  }
  const w32v m0 = w32v{} + kPhiloxM0, m1 = w32v{} + kPhiloxM1;
  uint32_t key0 = k0, key1 = k1;
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    for (int v = 0; v < kV; ++v) {
      const w32v h0 = mulhi<I>(c0[v], m0), h1 = mulhi<I>(c2[v], m1);
      const w32v l0 = c0[v] * m0, l1 = c2[v] * m1;
      c0[v] = h1 ^ c1[v] ^ key0, c1[v] = l1;
      c2[v] = h0 ^ c3[v] ^ key1, c3[v] = l0;
    }
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  for (int v = 0; v < kV; ++v) {
    const int b = at + v * kPhiloxLanes;
    std::memcpy(&w[0][b], &c0[v], sizeof(w32v));
    std::memcpy(&w[1][b], &c1[v], sizeof(w32v));
    std::memcpy(&w[2][b], &c2[v], sizeof(w32v));
    std::memcpy(&w[3][b], &c3[v], sizeof(w32v));
  }
}

// ln(v) for positive normal v: v = m * 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1).
template <typename A>
inline typename Lanes<A>::V log_lanes(typename Lanes<A>::V v) {
  using L = Lanes<A>;
  using V = typename L::V;
  using U = typename L::U;
  using B = typename L::B;
  const U bits = reinterpret_cast<U>(v);
  V e = __builtin_convertvector(__builtin_convertvector(bits >> L::kMant, typename L::J) - L::kExpBias, V);
  V m = reinterpret_cast<V>((bits & ((B(1) << L::kMant) - 1)) | (B(L::kExpBias) << L::kMant));
  const auto low = m < A(kSqrtHalf);
  m = low ? m + m : m;
  e = low ? e - A(1) : e;
  const V s = (m - A(1)) / (m + A(1));
  const V s2 = s * s;
  V t = V{} + kLogCoef<A>[Normal<A>::kLogTerms - 1];
  for (int j = Normal<A>::kLogTerms - 2; j >= 0; --j) t = t * s2 + kLogCoef<A>[j];
  return e * A(kLn2) + (s + s) * t;
}

template <typename A>
inline typename Lanes<A>::V sqrt_lanes(typename Lanes<A>::V v) {
  typename Lanes<A>::V r;
  for (int l = 0; l < Lanes<A>::kN; ++l) r[l] = std::sqrt(v[l]);  // one vector square root
  return r;
}

// Two normals per lane from two words (Box-Muller): sqrt(-2 ln u1) * (cos, sin)(2 pi u2), u1 = (a' + 1) / 2^bits
// in (0, 1] and u2 = b' / 2^bits in [0, 1) from the words' top bits a', b'; the angle's quadrant from b's top 2 bits,
// sine and cosine by Horner's rule in x^2 on [0, pi/4] (the rest of the quadrant by symmetry).
template <typename A>
inline void box_muller_lanes(typename Lanes<A>::W a, typename Lanes<A>::W b, A* z_cos, A* z_sin) {
  using L = Lanes<A>;
  using V = typename L::V;
  using U = typename L::U;
  using J = typename L::J;
  using IM = typename L::I;
  constexpr int kBits = Normal<A>::kBits;
  V n1;  // exactly, through int32 conversions
  if constexpr (kBits < 32) {
    n1 = __builtin_convertvector(reinterpret_cast<J>(a >> (32 - kBits)), V) + A(1);
  } else {
    n1 = (__builtin_convertvector(reinterpret_cast<J>(a ^ 0x80000000u), V) + A(2147483648.0)) + A(1);
  }
  const V r = sqrt_lanes<A>(A(-2) * log_lanes<A>(n1 * A(1.0 / double(uint64_t(1) << kBits))));
  const J quadrant = reinterpret_cast<J>(b >> 30);
  const J f = reinterpret_cast<J>(b >> (32 - kBits)) & ((1 << (kBits - 2)) - 1);
  const J swap32 = f > (1 << (kBits - 3));
  const J g = swap32 ? (1 << (kBits - 2)) - f : f;  // angle g / 2^(bits-2) * pi/2 in [0, pi/4]
  const V x = __builtin_convertvector(g, V) * A(kHalfPi / double(1u << (kBits - 2)));
  const V x2 = x * x;
  V ps = V{} + kSinCoef<A>[Normal<A>::kSinTerms - 1];
  for (int j = Normal<A>::kSinTerms - 2; j >= 0; --j) ps = ps * x2 + kSinCoef<A>[j];
  V pc = V{} + kCosCoef<A>[Normal<A>::kCosTerms - 1];
  for (int j = Normal<A>::kCosTerms - 2; j >= 0; --j) pc = pc * x2 + kCosCoef<A>[j];
  const V sx = x * ps;
  const IM swap = __builtin_convertvector(swap32, IM);
  const V s = swap ? pc : sx;  // sine and cosine of the angle within the quadrant
  const V c = swap ? sx : pc;
  // quadrants 0-3: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s); a sign is the sign bit flipped
  const IM odd = __builtin_convertvector((quadrant & 1) != 0, IM);
  constexpr typename L::B kSign = typename L::B(1) << (8 * sizeof(A) - 1);
  const U sin_sign = reinterpret_cast<U>(__builtin_convertvector((quadrant & 2) != 0, IM)) & kSign;
  const U cos_sign = reinterpret_cast<U>(__builtin_convertvector(((quadrant + 1) & 2) != 0, IM)) & kSign;
  const V zc = r * reinterpret_cast<V>(reinterpret_cast<U>(odd ? s : c) ^ cos_sign);
  const V zs = r * reinterpret_cast<V>(reinterpret_cast<U>(odd ? c : s) ^ sin_sign);
  std::memcpy(z_cos, &zc, sizeof(V));
  std::memcpy(z_sin, &zs, sizeof(V));
}

// Normals of one chunk of 64 blocks (256 elements), lane-major: z[lane * 64 + b], lanes 0 and 1 from the blocks'
// words 0 and 1 (cos, sin), lanes 2 and 3 from words 2 and 3.
template <typename A, Isa I>
inline void normal_chunk(uint64_t first_block, uint32_t k0, uint32_t k1, uint64_t stream, A* z) {
  alignas(32) uint32_t w[4][kBlocks];
  for (int b = 0; b < kBlocks; b += kPhiloxVectors * kPhiloxLanes) {
    philox_blocks<I>(first_block + uint64_t(b), k0, k1, stream, w, b);
  }
  using W = typename Lanes<A>::W;
  for (int b = 0; b < kBlocks; b += Lanes<A>::kN) {
    for (int h = 0; h < 2; ++h) {
      W u, v;
      std::memcpy(&u, &w[2 * h][b], sizeof(W));
      std::memcpy(&v, &w[2 * h + 1][b], sizeof(W));
      box_muller_lanes<A>(u, v, z + 2 * h * kBlocks + b, z + (2 * h + 1) * kBlocks + b);
    }
  }
}

template <typename A, Isa I>
inline void noise_span_body(int64_t begin, int64_t end, A* x, int64_t stride, A std, uint32_t k0, uint32_t k1,
                            uint64_t stream) {
  alignas(32) A z[kChunkElems];
  for (int64_t at = begin; at < end; at += kChunkElems) {  // begin is a multiple of kChunkElems
    normal_chunk<A, I>(static_cast<uint64_t>(at / kChunkElems) * kBlocks, k0, k1, stream, z);
    const int64_t n = std::min(kChunkElems, end - at);
    A* __restrict__ xs = x + at * stride;
    if (stride == 1) {
      for (int64_t j = 0; j < n; ++j) xs[j] = xs[j] + std * z[j];
    } else {
      for (int64_t j = 0; j < n; ++j) xs[j * stride] = xs[j * stride] + std * z[j];
    }
  }
}

// One flattened function per ISA (simd.h's targets; flatten inlines the ISA-specific multiply into each).
#define PFK_NOISE_PARAMS \
  int64_t begin, int64_t end, A *x, int64_t stride, A std, uint32_t k0, uint32_t k1, uint64_t stream
#define PFK_NOISE_ARGS begin, end, x, stride, std, k0, k1, stream
template <typename A>
__attribute__((flatten)) void noise_span_baseline(PFK_NOISE_PARAMS) {
  noise_span_body<A, Isa::Baseline>(PFK_NOISE_ARGS);
}
#if defined(__x86_64__) && defined(__GNUC__)
template <typename A>
__attribute__((target("avx2"), flatten)) void noise_span_avx2(PFK_NOISE_PARAMS) {
  noise_span_body<A, Isa::Avx2>(PFK_NOISE_ARGS);
}
template <typename A>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"), flatten)) void noise_span_avx512(PFK_NOISE_PARAMS) {
  noise_span_body<A, Isa::Avx512>(PFK_NOISE_ARGS);
}
#endif
template <typename A>
void noise_span(PFK_NOISE_PARAMS, Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (isa) {
    case Isa::Avx512:
      return noise_span_avx512<A>(PFK_NOISE_ARGS);
    case Isa::Avx2:
      return noise_span_avx2<A>(PFK_NOISE_ARGS);
    default:
      break;
  }
#endif
  noise_span_baseline<A>(PFK_NOISE_ARGS);
}

// Philox4x32-10's words of blocks first_block .. first_block + n - 1 to out[word * n + i], one function per ISA.
template <Isa I>
inline void philox_span_body(uint64_t first_block, int64_t n, uint32_t k0, uint32_t k1, uint64_t stream,
                             uint32_t* out) {
  alignas(32) uint32_t w[4][kBlocks];
  const uint64_t skip = first_block % kBlocks;  // chunks of 64 blocks from a multiple of 64
  for (int64_t done = 0; done < n;) {
    const uint64_t chunk = done ? first_block + uint64_t(done) : first_block - skip;
    for (int b = 0; b < kBlocks; b += kPhiloxVectors * kPhiloxLanes) philox_blocks<I>(chunk + b, k0, k1, stream, w, b);
    const int64_t from = done ? 0 : int64_t(skip), count = std::min<int64_t>(kBlocks - from, n - done);
    for (int k = 0; k < 4; ++k) std::memcpy(out + k * n + done, &w[k][from], sizeof(uint32_t) * count);
    done += count;
  }
}
__attribute__((flatten)) void philox_span_baseline(uint64_t first_block, int64_t n, uint32_t k0, uint32_t k1,
                                                   uint64_t stream, uint32_t* out) {
  philox_span_body<Isa::Baseline>(first_block, n, k0, k1, stream, out);
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"), flatten)) void philox_span_avx2(uint64_t first_block, int64_t n, uint32_t k0,
                                                               uint32_t k1, uint64_t stream, uint32_t* out) {
  philox_span_body<Isa::Avx2>(first_block, n, k0, k1, stream, out);
}
#endif
void philox_span(uint64_t first_block, int64_t n, uint32_t k0, uint32_t k1, uint64_t stream, uint32_t* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_isa() != Isa::Baseline) return philox_span_avx2(first_block, n, k0, k1, stream, out);
#endif
  philox_span_baseline(first_block, n, k0, k1, stream, out);
}
#undef PFK_NOISE_PARAMS
#undef PFK_NOISE_ARGS
#pragma GCC diagnostic pop

constexpr int64_t kNoiseSpan = 64 * kChunkElems;  // elements per parallel chunk (a multiple of a generator chunk)

template <typename A>
void gaussian_noise_typed(int64_t d, void* x, int64_t stride, double std, uint64_t seed, uint64_t stream, Isa isa) {
  A* xs = static_cast<A*>(x);
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  parallel_chunks(d, kNoiseSpan, 16 * d, [&](int64_t, int64_t begin, int64_t end) {
    noise_span<A>(begin, end, xs, stride, A(std), k0, k1, stream, isa);
  });
}

// The ISA named by `name` ("" for the CPU's best), refused when this CPU lacks it.
Isa isa_from_name(const std::string& name) {
  if (name.empty()) return cpu_isa();
  const Isa isa = name == "baseline" ? Isa::Baseline
                  : name == "avx2"   ? Isa::Avx2
                  : name == "avx512"
                      ? Isa::Avx512
                      : throw ArgumentError("isa must be '', 'baseline', 'avx2' or 'avx512', got '" + name + "'");
  if (static_cast<int>(isa) > static_cast<int>(cpu_isa())) throw ArgumentError("isa " + name + ": not on this CPU");
  return isa;
}

void gaussian_noise(const std::string& dtype_name, int64_t d, uintptr_t x, int64_t stride, double std, uint64_t seed,
                    uint64_t stream, const std::string& isa_name) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("gaussian_noise: d must be >= 1");
  if (x == 0) throw ArgumentError("gaussian_noise: x is a null pointer");
  if (!std::isfinite(std) || std < 0) throw ArgumentError("gaussian_noise: std must be finite and >= 0");
  const Isa isa = isa_from_name(isa_name);
  switch (dtype) {
    case DType::F32:
      return gaussian_noise_typed<float>(d, reinterpret_cast<void*>(x), stride, std, seed, stream, isa);
    case DType::F64:
      return gaussian_noise_typed<double>(d, reinterpret_cast<void*>(x), stride, std, seed, stream, isa);
    default:
      throw ArgumentError("gaussian_noise: x must be float32 or float64");
  }
}

void philox4x32_10(uint64_t seed, uint64_t stream, uint64_t first_block,
                   py::array_t<uint32_t, py::array::c_style>& out) {
  if (out.ndim() != 2 || out.shape(0) != 4 || out.shape(1) < 1) throw ArgumentError("out must be [4, n], n >= 1");
  uint32_t* o = out.mutable_data();
  const int64_t n = out.shape(1);
  py::gil_scoped_release release;
  philox_span(first_block, n, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), stream, o);
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
        py::arg("std"), py::arg("seed"), py::arg("stream"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>(),
        "x += std * z, z standard normal from Philox4x32-10 (key: seed; counter: block, stream) and Box-Muller. "
        "CPU only. isa: '' (the CPU's best) or a vector ISA this CPU has ('baseline', 'avx2', 'avx512'), for tests.");
  m.def("philox4x32_10", &philox4x32_10, py::arg("seed"), py::arg("stream"), py::arg("first_block"), py::arg("out"),
        "out[word, i] = word `word` of Philox4x32-10 block first_block + i (key: seed; counter: block, stream), "
        "out a [4, n] uint32 array: gaussian_noise's raw bits (for tests and the benchmark's limit).");
}

}  // namespace pfk
