// Differential-privacy kernels (CPU).
//
// clip_accumulate: out = sum_k s_k * (u_k - c) with s_k = min(1, C / ||u_k - c||), in two passes over the rows: the
// norms (float64 partial sums per column chunk, combined in chunk order), then the scaled sum (column tiles that stay
// in L1 while every row streams through once, rows added in row order). Results do not depend on the thread count.
//
// gaussian_noise: x += std * z, z standard normal from a counter-based generator: ARS-5 (AES rounds, Salmon et al.
// 2011) keyed by the 64-bit seed, its counter (block index, 64-bit stream), the blocks' 32-bit words turned into
// normals by Box-Muller, two words for two normals. The logarithm, sine and cosine are polynomials of +, -, *, / and
// sqrt only (the build uses -ffp-contract=off), so the NumPy reference (pyfedkern.reference.dp) computes the same
// bits, and so does every ISA (one vector code, 8 floats or 4 doubles per vector, for SSE2, AVX2 and AVX-512) and
// every AES path (portable tables, AES-NI, VAES). Word j of the stream (word j % 4 of block j / 4) feeds element j.
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
// The words come from ARS-5 (below), in portable code or in AES-NI/VAES instructions, with the same bits. Box-Muller
// is written once with GCC vector extensions (32-byte vectors of floats or doubles) and compiled for each ISA, which
// maps the vectors to its registers. Every lane performs the same IEEE operations as the reference's scalar code, so
// every ISA and every AES path gives the same bits.

// ARS-5 (Salmon et al. 2011): block = AES rounds of the 128-bit counter (block index, stream) under round keys that
// start at (seed, 0) and add a Weyl increment to each 64-bit half per round; the last round omits MixColumns. Five
// rounds is where its authors found it Crush-resistant (BigCrush without failures), and what Intel's MKL ships.
constexpr int kArsRounds = 5;
constexpr uint64_t kWeylLo = 0x9E3779B97F4A7C15ull, kWeylHi = 0xBB67AE8584CAA73Bull;
constexpr int kBlocks = 64;                   // ARS blocks (four 32-bit words each) per chunk
constexpr int64_t kChunkElems = 4 * kBlocks;  // elements per chunk: one per word

// The round keys as 64-bit halves (lo, hi): the same memory as four little-endian 32-bit words.
struct ArsKey {
  uint64_t k[kArsRounds + 1][2];
};
inline ArsKey ars_key(uint64_t seed) {
  ArsKey key{};
  for (int r = 0; r <= kArsRounds; ++r) key.k[r][0] = seed + uint64_t(r) * kWeylLo, key.k[r][1] = uint64_t(r) * kWeylHi;
  return key;
}

// How the AES rounds run: portable table code, AES-NI on 16-byte vectors, or VAES on 32-byte vectors (AVX2 and up).
enum class Aes { Soft, Ni, Vaes };

inline Aes cpu_aes() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const Aes aes = !__builtin_cpu_supports("aes")                                 ? Aes::Soft
                         : __builtin_cpu_supports("vaes") && cpu_isa() != Isa::Baseline ? Aes::Vaes
                                                                                        : Aes::Ni;
  return aes;
#else
  return Aes::Soft;
#endif
}

// The portable AES round: S-box from the GF(2^8) inverse and the affine map, and T0[x] = the column (2S, S, S, 3S).
constexpr uint8_t gf_mul(uint8_t a, uint8_t b) {
  uint8_t p = 0;
  for (int i = 0; i < 8; ++i, b >>= 1) {
    if (b & 1) p ^= a;
    a = uint8_t((a << 1) ^ (a & 0x80 ? 0x1B : 0));
  }
  return p;
}
struct AesTables {
  uint8_t sbox[256];
  uint32_t t0[256];
};
constexpr AesTables make_aes_tables() {
  AesTables t{};
  for (int x = 0; x < 256; ++x) {
    uint8_t inv = 1, sq = uint8_t(x);  // x^254 = x^2 x^4 ... x^128 (0 for 0)
    for (int i = 1; i < 8; ++i) sq = gf_mul(sq, sq), inv = gf_mul(inv, sq);
    const auto rotl8 = [](uint8_t v, int n) { return uint8_t((v << n) | (v >> (8 - n))); };
    const uint8_t s = uint8_t(inv ^ rotl8(inv, 1) ^ rotl8(inv, 2) ^ rotl8(inv, 3) ^ rotl8(inv, 4) ^ 0x63);
    t.sbox[x] = s;
    t.t0[x] = uint32_t(gf_mul(s, 2)) | uint32_t(s) << 8 | uint32_t(s) << 16 | uint32_t(gf_mul(s, 3)) << 24;
  }
  return t;
}
constexpr AesTables kAes = make_aes_tables();

inline uint32_t rotl32(uint32_t v, int n) {
  return (v << n) | (v >> (32 - n));
}

// One AES round on four little-endian words (byte r of column c = byte r of word c): ShiftRows, SubBytes,
// MixColumns unless `last`, then the round key.
inline void aes_round_soft(uint32_t* s, const uint64_t* key, bool last) {
  uint32_t k[4];
  std::memcpy(k, key, sizeof(k));
  uint32_t o[4];
  for (int c = 0; c < 4; ++c) {
    const uint8_t a0 = uint8_t(s[c]), a1 = uint8_t(s[(c + 1) % 4] >> 8), a2 = uint8_t(s[(c + 2) % 4] >> 16),
                  a3 = uint8_t(s[(c + 3) % 4] >> 24);
    o[c] = last ? uint32_t(kAes.sbox[a0]) | uint32_t(kAes.sbox[a1]) << 8 | uint32_t(kAes.sbox[a2]) << 16 |
                      uint32_t(kAes.sbox[a3]) << 24
                : kAes.t0[a0] ^ rotl32(kAes.t0[a1], 8) ^ rotl32(kAes.t0[a2], 16) ^ rotl32(kAes.t0[a3], 24);
  }
  for (int c = 0; c < 4; ++c) s[c] = o[c] ^ k[c];
}

// ARS-5 of blocks first .. first + 63 to w[4 * b + word].
inline void ars_blocks_soft(uint64_t first, const ArsKey& key, uint64_t stream, uint32_t* w) {
  for (int b = 0; b < kBlocks; ++b) {
    const uint64_t ctr[2] = {(first + uint64_t(b)) ^ key.k[0][0], stream ^ key.k[0][1]};
    uint32_t s[4];
    std::memcpy(s, ctr, sizeof(s));
    for (int r = 1; r <= kArsRounds; ++r) aes_round_soft(s, key.k[r], r == kArsRounds);
    std::memcpy(w + 4 * b, s, sizeof(s));
  }
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("aes"))) inline void ars_blocks_ni(uint64_t first, const ArsKey& key, uint64_t stream,
                                                         uint32_t* w) {
  constexpr int kV = 8;  // blocks in flight
  __m128i rk[kArsRounds + 1];
  for (int r = 0; r <= kArsRounds; ++r) rk[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key.k[r]));
  for (int b = 0; b < kBlocks; b += kV) {
    const __m128i base = _mm_set_epi64x(static_cast<int64_t>(stream), static_cast<int64_t>(first + uint64_t(b)));
    __m128i v[kV];
    for (int j = 0; j < kV; ++j) v[j] = _mm_xor_si128(_mm_add_epi64(base, _mm_set_epi64x(0, j)), rk[0]);
    for (int r = 1; r < kArsRounds; ++r) {
      for (int j = 0; j < kV; ++j) v[j] = _mm_aesenc_si128(v[j], rk[r]);
    }
    for (int j = 0; j < kV; ++j) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + 4 * (b + j)), _mm_aesenclast_si128(v[j], rk[kArsRounds]));
    }
  }
}
__attribute__((target("avx2,aes,vaes"))) inline void ars_blocks_vaes(uint64_t first, const ArsKey& key, uint64_t stream,
                                                                     uint32_t* w) {
  constexpr int kV = 8;  // vectors of two blocks in flight
  __m256i rk[kArsRounds + 1];
  for (int r = 0; r <= kArsRounds; ++r) {
    rk[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key.k[r])));
  }
  const int64_t s = static_cast<int64_t>(stream);
  for (int b = 0; b < kBlocks; b += 2 * kV) {
    const uint64_t at = first + uint64_t(b);
    const __m256i base = _mm256_set_epi64x(s, static_cast<int64_t>(at + 1), s, static_cast<int64_t>(at));
    __m256i v[kV];
    for (int j = 0; j < kV; ++j) {
      v[j] = _mm256_xor_si256(_mm256_add_epi64(base, _mm256_set_epi64x(0, 2 * j, 0, 2 * j)), rk[0]);
    }
    for (int r = 1; r < kArsRounds; ++r) {
      for (int j = 0; j < kV; ++j) v[j] = _mm256_aesenc_epi128(v[j], rk[r]);
    }
    for (int j = 0; j < kV; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 4 * (b + 2 * j)),
                          _mm256_aesenclast_epi128(v[j], rk[kArsRounds]));
    }
  }
}
#endif
template <Aes M>
inline void ars_blocks(uint64_t first, const ArsKey& key, uint64_t stream, uint32_t* w) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (M == Aes::Vaes) return ars_blocks_vaes(first, key, stream, w);
  if constexpr (M == Aes::Ni) return ars_blocks_ni(first, key, stream, w);
#endif
  ars_blocks_soft(first, key, stream, w);
}

// The float type's constants of Box-Muller: bits of the uniforms taken from a 32-bit word, the polynomials' terms.
template <typename A>
struct Normal;
template <>
struct Normal<float> {
  static constexpr int kBits = 24;  // the word's top 24 bits
  static constexpr int kLogTerms = 5, kSinTerms = 5, kCosTerms = 5;
};
template <>
struct Normal<double> {
  static constexpr int kBits = 32;
  static constexpr int kLogTerms = 12, kSinTerms = 9, kCosTerms = 10;
};

constexpr double kLn2 = 0.6931471805599453, kHalfPi = 1.5707963267948966;

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
  static constexpr int kMant = 23, kExpBias = 127;
  static constexpr B kHalfRoot = 0x3F3504F3u;  // float(sqrt(1/2))'s bits
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
  static constexpr int kMant = 52, kExpBias = 1023;
  static constexpr B kHalfRoot = 0x3FE6A09E667F3BCDull;
};

// c[0] + c[1] q + ... + c[N-1] q^(N-1) by second-order Horner: the even and the odd coefficients in q^2, then
// even + q * odd (half the dependent steps of Horner's rule).
template <typename A, size_t N>
inline typename Lanes<A>::V poly_lanes(const std::array<A, N>& c, typename Lanes<A>::V q) {
  using V = typename Lanes<A>::V;
  static_assert(N >= 2, "two coefficients or more");
  constexpr int kEven = (N - 1) / 2 * 2, kOdd = (N - 2) / 2 * 2 + 1;
  const V q2 = q * q;
  V even = V{} + c[kEven], odd = V{} + c[kOdd];
  for (int j = kEven - 2; j >= 0; j -= 2) even = even * q2 + c[j];
  for (int j = kOdd - 2; j >= 1; j -= 2) odd = odd * q2 + c[j];
  return even + q * odd;
}

template <typename A>
inline typename Lanes<A>::V sqrt_lanes(typename Lanes<A>::V v) {
  typename Lanes<A>::V r;
  for (int l = 0; l < Lanes<A>::kN; ++l) r[l] = std::sqrt(v[l]);  // one vector square root
  return r;
}

// Two normals per lane from two words (Box-Muller): sqrt(-2 ln u1) * (cos, sin)(2 pi u2), u1 = (a' + 1) / 2^bits
// in (0, 1] and u2 = b' / 2^bits in [0, 1) from the words' top bits a', b'. u1 = m 2^e with m in [sqrt(1/2),
// sqrt(2)) (adding the bits of 1 minus those of sqrt(1/2) carries into the exponent exactly when the significand is
// at least sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1). The angle's quadrant from b's top 2 bits, sine and cosine by
// polynomials in x^2 on [0, pi/4] (the rest of the quadrant by symmetry). kGroups groups of lanes at once, their
// radii statement by statement, so the CPU has a second group's work while one waits on its division and square
// root: group k's words a[k], b[k]; its cosine normals z to out[2 L k ..], its sine normals to the L after them
// (with `add`: out += std * z there).
constexpr int kGroups = 2;
template <typename A>
inline void box_muller_lanes(const typename Lanes<A>::W* a, const typename Lanes<A>::W* b, A* out, A std, bool add) {
  using L = Lanes<A>;
  using V = typename L::V;
  using U = typename L::U;
  using J = typename L::J;
  using IM = typename L::I;
  using B = typename L::B;
  constexpr int kBits = Normal<A>::kBits;
  V n1[kGroups], e[kGroups], m[kGroups], s[kGroups], r[kGroups];
  U bits[kGroups];
  for (int k = 0; k < kGroups; ++k) {  // exactly, through int32 conversions
    if constexpr (kBits < 32) {
      n1[k] = __builtin_convertvector(reinterpret_cast<J>(a[k] >> (32 - kBits)), V) + A(1);
    } else {
      n1[k] = (__builtin_convertvector(reinterpret_cast<J>(a[k] ^ 0x80000000u), V) + A(2147483648.0)) + A(1);
    }
  }
  for (int k = 0; k < kGroups; ++k)
    bits[k] = reinterpret_cast<U>(n1[k]) + ((B(L::kExpBias) << L::kMant) - L::kHalfRoot);
  for (int k = 0; k < kGroups; ++k) {
    e[k] = __builtin_convertvector(__builtin_convertvector(bits[k] >> L::kMant, J) - (L::kExpBias + kBits), V);
  }
  for (int k = 0; k < kGroups; ++k) m[k] = reinterpret_cast<V>((bits[k] & ((B(1) << L::kMant) - 1)) + L::kHalfRoot);
  for (int k = 0; k < kGroups; ++k) s[k] = (m[k] - A(1)) / (m[k] + A(1));
  for (int k = 0; k < kGroups; ++k) {
    r[k] = sqrt_lanes<A>(e[k] * A(-2 * kLn2) + (s[k] * A(-4)) * poly_lanes<A>(kLogCoef<A>, s[k] * s[k]));
  }
  for (int k = 0; k < kGroups; ++k) {
    const J f = reinterpret_cast<J>(b[k] >> (32 - kBits)) & ((1 << (kBits - 2)) - 1);
    const J swap32 = f > (1 << (kBits - 3));
    const J g = swap32 ? (1 << (kBits - 2)) - f : f;  // angle g / 2^(bits-2) * pi/2 in [0, pi/4]
    const V x = __builtin_convertvector(g, V) * A(kHalfPi / double(1u << (kBits - 2)));
    const V x2 = x * x;
    const V sx = x * poly_lanes<A>(kSinCoef<A>, x2);
    const V pc = poly_lanes<A>(kCosCoef<A>, x2);
    const IM swap = __builtin_convertvector(swap32, IM);
    const V sq = swap ? pc : sx;  // sine and cosine of the angle within the quadrant
    const V cq = swap ? sx : pc;
    // quadrants 0-3: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s); a sign is the sign bit flipped
    // (quadrant bits 31 and 30 of b: odd = bit 30, sine's sign = bit 31, cosine's = bit 31 xor bit 30)
    const J q1 = reinterpret_cast<J>(b[k]), q0 = reinterpret_cast<J>(b[k] << 1);
    const IM odd = __builtin_convertvector(q0 >> 31, IM);
    constexpr B kSign = B(1) << (8 * sizeof(A) - 1);
    const U sin_sign = reinterpret_cast<U>(__builtin_convertvector(q1 >> 31, IM)) & kSign;
    const U cos_sign = reinterpret_cast<U>(__builtin_convertvector((q1 ^ q0) >> 31, IM)) & kSign;
    const V zc = r[k] * reinterpret_cast<V>(reinterpret_cast<U>(odd ? sq : cq) ^ cos_sign);
    const V zs = r[k] * reinterpret_cast<V>(reinterpret_cast<U>(odd ? cq : sq) ^ sin_sign);
    V o0 = zc, o1 = zs;
    if (add) {
      std::memcpy(&o0, out + 2 * L::kN * k, sizeof(V));
      std::memcpy(&o1, out + 2 * L::kN * k + L::kN, sizeof(V));
      o0 = o0 + std * zc;
      o1 = o1 + std * zs;
    }
    std::memcpy(out + 2 * L::kN * k, &o0, sizeof(V));
    std::memcpy(out + 2 * L::kN * k + L::kN, &o1, sizeof(V));
  }
}

// x[begin:end] += std * z. Each group of 2L elements (L = lanes: 8 floats or 4 doubles) takes the group's 2L words
// (words 4b .. 4b + 3 of block b, in block order): the first L words are the lanes' u1, the next L their u2, and the
// group's first L elements are the cosine normals, the next L the sine ones.
template <typename A, Aes M>
inline void noise_span_body(int64_t begin, int64_t end, A* x, int64_t stride, A std, const ArsKey& key,
                            uint64_t stream) {
  constexpr int kL = Lanes<A>::kN;
  using W = typename Lanes<A>::W;
  alignas(32) uint32_t w[4 * kBlocks];
  alignas(32) A z[kChunkElems];
  for (int64_t at = begin; at < end; at += kChunkElems) {  // begin is a multiple of kChunkElems
    ars_blocks<M>(static_cast<uint64_t>(at / 4), key, stream, w);
    const int64_t n = std::min(kChunkElems, end - at);
    const bool direct = stride == 1 && n == kChunkElems;  // add into x as the normals come, else through z
    A* out = direct ? x + at : z;
    for (int g = 0; g < kChunkElems; g += 2 * kL * kGroups) {
      W u1[kGroups], u2[kGroups];
      for (int k = 0; k < kGroups; ++k) {
        std::memcpy(&u1[k], w + g + 2 * kL * k, sizeof(W));
        std::memcpy(&u2[k], w + g + 2 * kL * k + kL, sizeof(W));
      }
      box_muller_lanes<A>(u1, u2, out + g, std, direct);
    }
    if (direct) continue;
    A* __restrict__ xs = x + at * stride;
    if (stride == 1) {
      for (int64_t j = 0; j < n; ++j) xs[j] = xs[j] + std * z[j];
    } else {
      for (int64_t j = 0; j < n; ++j) xs[j * stride] = xs[j * stride] + std * z[j];
    }
  }
}

// One flattened function per ISA and AES path (flatten inlines the kernels and the AES intrinsics into each).
#define PFK_NOISE_PARAMS int64_t begin, int64_t end, A *x, int64_t stride, A std, const ArsKey &key, uint64_t stream
#define PFK_NOISE_ARGS begin, end, x, stride, std, key, stream
#define PFK_NOISE_SPAN(suffix, attrs, aes)                                    \
  template <typename A>                                                       \
  attrs __attribute__((flatten)) void noise_span_##suffix(PFK_NOISE_PARAMS) { \
    noise_span_body<A, aes>(PFK_NOISE_ARGS);                                  \
  }
PFK_NOISE_SPAN(baseline, , Aes::Soft)
#if defined(__x86_64__) && defined(__GNUC__)
PFK_NOISE_SPAN(baseline_ni, __attribute__((target("aes"))), Aes::Ni)
PFK_NOISE_SPAN(avx2, __attribute__((target("avx2"))), Aes::Soft)
PFK_NOISE_SPAN(avx2_ni, __attribute__((target("avx2,aes"))), Aes::Ni)
PFK_NOISE_SPAN(avx2_vaes, __attribute__((target("avx2,aes,vaes"))), Aes::Vaes)
#define PFK_AVX512 "avx512f,avx512bw,avx512vl,avx2"
PFK_NOISE_SPAN(avx512, __attribute__((target(PFK_AVX512))), Aes::Soft)
PFK_NOISE_SPAN(avx512_ni, __attribute__((target(PFK_AVX512 ",aes"))), Aes::Ni)
PFK_NOISE_SPAN(avx512_vaes, __attribute__((target(PFK_AVX512 ",aes,vaes"))), Aes::Vaes)
#undef PFK_AVX512
#endif
template <typename A>
void noise_span(PFK_NOISE_PARAMS, Isa isa, Aes aes) {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool ni = aes == Aes::Ni, vaes = aes == Aes::Vaes;  // (Vaes only with AVX2 or AVX-512)
  switch (isa) {
    case Isa::Avx512:
      return vaes ? noise_span_avx512_vaes<A>(PFK_NOISE_ARGS)
             : ni ? noise_span_avx512_ni<A>(PFK_NOISE_ARGS)
                  : noise_span_avx512<A>(PFK_NOISE_ARGS);
    case Isa::Avx2:
      return vaes ? noise_span_avx2_vaes<A>(PFK_NOISE_ARGS)
             : ni ? noise_span_avx2_ni<A>(PFK_NOISE_ARGS)
                  : noise_span_avx2<A>(PFK_NOISE_ARGS);
    default:
      if (ni) return noise_span_baseline_ni<A>(PFK_NOISE_ARGS);
  }
#endif
  noise_span_baseline<A>(PFK_NOISE_ARGS);
}
#undef PFK_NOISE_SPAN
#undef PFK_NOISE_PARAMS
#undef PFK_NOISE_ARGS

// ARS-5's words of blocks first_block .. first_block + n - 1 to out[4 * i + word], one function per AES path.
template <Aes M>
inline void ars_span_body(uint64_t first_block, int64_t n, const ArsKey& key, uint64_t stream, uint32_t* out) {
  alignas(32) uint32_t w[4 * kBlocks];
  for (int64_t done = 0; done < n; done += kBlocks) {
    ars_blocks<M>(first_block + uint64_t(done), key, stream, w);
    std::memcpy(out + 4 * done, w, sizeof(uint32_t) * 4 * std::min<int64_t>(kBlocks, n - done));
  }
}
__attribute__((flatten)) void ars_span_soft(uint64_t first_block, int64_t n, const ArsKey& key, uint64_t stream,
                                            uint32_t* out) {
  ars_span_body<Aes::Soft>(first_block, n, key, stream, out);
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("aes"), flatten)) void ars_span_ni(uint64_t first_block, int64_t n, const ArsKey& key,
                                                         uint64_t stream, uint32_t* out) {
  ars_span_body<Aes::Ni>(first_block, n, key, stream, out);
}
__attribute__((target("avx2,aes,vaes"), flatten)) void ars_span_vaes(uint64_t first_block, int64_t n, const ArsKey& key,
                                                                     uint64_t stream, uint32_t* out) {
  ars_span_body<Aes::Vaes>(first_block, n, key, stream, out);
}
#endif
void ars_span(uint64_t first_block, int64_t n, const ArsKey& key, uint64_t stream, uint32_t* out, Aes aes) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (aes == Aes::Vaes) return ars_span_vaes(first_block, n, key, stream, out);
  if (aes == Aes::Ni) return ars_span_ni(first_block, n, key, stream, out);
#endif
  ars_span_soft(first_block, n, key, stream, out);
}

constexpr int64_t kNoiseSpan = 64 * kChunkElems;  // elements per parallel chunk (a multiple of a generator chunk)

template <typename A>
void gaussian_noise_typed(int64_t d, void* x, int64_t stride, double std, uint64_t seed, uint64_t stream, Isa isa,
                          Aes aes) {
  A* xs = static_cast<A*>(x);
  const ArsKey key = ars_key(seed);
  parallel_chunks(d, kNoiseSpan, 16 * d, [&](int64_t, int64_t begin, int64_t end) {
    noise_span<A>(begin, end, xs, stride, A(std), key, stream, isa, aes);
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

// The AES path named by `name` ("" for the CPU's best with `isa`), refused when this CPU or `isa` lacks it.
Aes aes_from_name(const std::string& name, Isa isa) {
  if (name.empty()) return cpu_aes() == Aes::Vaes && isa == Isa::Baseline ? Aes::Ni : cpu_aes();
  const Aes aes = name == "soft"    ? Aes::Soft
                  : name == "aesni" ? Aes::Ni
                  : name == "vaes"
                      ? Aes::Vaes
                      : throw ArgumentError("aes must be '', 'soft', 'aesni' or 'vaes', got '" + name + "'");
  if (static_cast<int>(aes) > static_cast<int>(cpu_aes())) throw ArgumentError("aes " + name + ": not on this CPU");
  if (aes == Aes::Vaes && isa == Isa::Baseline) throw ArgumentError("aes vaes needs isa avx2 or avx512");
  return aes;
}

void gaussian_noise(const std::string& dtype_name, int64_t d, uintptr_t x, int64_t stride, double std, uint64_t seed,
                    uint64_t stream, const std::string& isa_name, const std::string& aes_name) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("gaussian_noise: d must be >= 1");
  if (x == 0) throw ArgumentError("gaussian_noise: x is a null pointer");
  if (!std::isfinite(std) || std < 0) throw ArgumentError("gaussian_noise: std must be finite and >= 0");
  const Isa isa = isa_from_name(isa_name);
  const Aes aes = aes_from_name(aes_name, isa);
  void* p = reinterpret_cast<void*>(x);
  switch (dtype) {
    case DType::F32:
      return gaussian_noise_typed<float>(d, p, stride, std, seed, stream, isa, aes);
    case DType::F64:
      return gaussian_noise_typed<double>(d, p, stride, std, seed, stream, isa, aes);
    default:
      throw ArgumentError("gaussian_noise: x must be float32 or float64");
  }
}

void ars4x32_5(uint64_t seed, uint64_t stream, uint64_t first_block, py::array_t<uint32_t, py::array::c_style>& out,
               const std::string& aes_name) {
  if (out.ndim() != 2 || out.shape(1) != 4 || out.shape(0) < 1) throw ArgumentError("out must be [n, 4], n >= 1");
  const Aes aes = aes_from_name(aes_name, cpu_isa());
  uint32_t* o = out.mutable_data();
  const int64_t n = out.shape(0);
  py::gil_scoped_release release;
  ars_span(first_block, n, ars_key(seed), stream, o, aes);
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
        py::arg("std"), py::arg("seed"), py::arg("stream"), py::arg("isa") = "", py::arg("aes") = "",
        py::call_guard<py::gil_scoped_release>(),
        "x += std * z, z standard normal from ARS-5 (key: seed; counter: block, stream) and Box-Muller. CPU only. "
        "isa: '' (the CPU's best) or a vector ISA this CPU has ('baseline', 'avx2', 'avx512'); aes: '' (the best) "
        "or an AES path this CPU has ('soft', 'aesni', 'vaes'); both for tests, every choice gives the same bits.");
  m.def(
      "ars4x32_5", &ars4x32_5, py::arg("seed"), py::arg("stream"), py::arg("first_block"), py::arg("out"),
      py::arg("aes") = "",
      "out[i] = the four 32-bit words of ARS-5 block first_block + i (key: seed; counter: block, stream), out a "
      "[n, 4] uint32 array: gaussian_noise's raw bits (for tests and the benchmark's limit). aes as gaussian_noise's.");
}

}  // namespace pfk
