// Robust aggregation kernels: coordinate-wise order statistics of K rows (median, trimmed mean, Bulyan's mean of
// the values closest to the median, weighted median).
//
// Selection, not sorting per coordinate: the d coordinates are cut into tiles of B columns; a tile's K rows are
// copied into a [K, B] buffer that stays in L1 (each row read once, contiguously), and a sorting network, pruned
// to the output ranks the rule needs, runs across the B columns at once: each compare-exchange of ranks (a, b) is a
// vectorised min/max of two buffer rows. Batcher's odd-even merge network for the next power of two, with the
// comparators past K dropped (the missing ranks act as +inf, which those comparators would never move). The
// network's first levels sort each aligned group of 8 ranks; for contiguous rows they run in registers while the
// tile is copied (copy_sorted_groups), and only the comparators from the first one across groups on run on the
// buffer. Trimmed means with a small cut run no network (trimmed_sums: the extremes held in registers). Every
// coordinate is computed alone, so results do not depend on the thread count.
#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings.h"
#include "half.h"
#include "parallel.h"
#include "simd.h"
#include "types.h"

namespace pfk {
namespace {

enum class Rule : int { Median = 0, Trimmed = 1, Closest = 2, WeightedMedian = 3 };

using Comparator = std::pair<int, int>;

// Batcher's odd-even merge sort on n ranks, pruned to the comparators that can affect a rank in `needed`.
std::vector<Comparator> selection_network(int n, const std::vector<bool>& needed) {
  int p2 = 1;
  while (p2 < n) p2 <<= 1;
  std::vector<Comparator> all;
  for (int p = 1; p < p2; p <<= 1)
    for (int k = p; k >= 1; k >>= 1)
      for (int j = k % p; j + k < p2; j += 2 * k)
        for (int i = 0; i < std::min(k, p2 - j - k); ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p) && i + j + k < n) all.emplace_back(i + j, i + j + k);
  std::vector<bool> live = needed;
  std::vector<Comparator> kept;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (live[it->first] || live[it->second]) {
      live[it->first] = live[it->second] = true;
      kept.push_back(*it);
    }
  }
  std::reverse(kept.begin(), kept.end());
  return kept;
}

constexpr int64_t kChunk = 4096;           // coordinates per parallel chunk (fixed: results never depend on threads)
constexpr int64_t kTileBytes = 32 * 1024;  // the [K, B] tile buffer: L1-sized (K = 64: 128 columns)

struct Plan {
  Rule rule;
  int64_t K;
  int64_t param;  // Trimmed: values cut at each end; Closest: values averaged
  std::vector<Comparator> network;
  size_t late;            // network[late:] are the comparators from the first one across groups of 8 ranks on
  const double* weights;  // WeightedMedian: K positive weights
};

// Compare-exchange of two tile rows over the first n columns, rounded up to whole 32-byte vectors (tile rows are
// multiples of 16 values; the lanes past n hold finite leftovers that no result reads). Written on GCC vector types
// so that both rows are stored unconditionally: the scalar form `lo[j] = a < b ? a : b` becomes a masked store
// behind a data-dependent branch. The same lane-wise select on every ISA, so results do not depend on it.
template <typename V>
PFK_ALWAYS_INLINE void compare_exchange(V* __restrict__ lo, V* __restrict__ hi, int64_t n) {
  typedef V Vec __attribute__((vector_size(32)));
  constexpr int64_t L = 32 / sizeof(V);
  for (int64_t j = 0; j < n; j += L) {
    Vec a, b;
    __builtin_memcpy(&a, lo + j, sizeof(Vec));
    __builtin_memcpy(&b, hi + j, sizeof(Vec));
    const auto less = a < b;
    const Vec mn = less ? a : b, mx = less ? b : a;
    __builtin_memcpy(lo + j, &mn, sizeof(Vec));
    __builtin_memcpy(hi + j, &mx, sizeof(Vec));
  }
}

// Asks for columns [from, min(to, end)) of a contiguous row in L2, a cache line at a time: the next tile or block of
// a row while this one is worked on. K interleaved streams defeat the hardware prefetchers, and rows beyond the
// last-level cache would otherwise be read at memory latency.
template <typename T>
PFK_ALWAYS_INLINE void prefetch_columns(const T* row, int64_t from, int64_t to, int64_t end) {
  for (int64_t j = from; j < std::min(end, to); j += 64 / int64_t(sizeof(T))) __builtin_prefetch(row + j, 0, 2);
}

// Batcher's odd-even merge sort of 8 vectors in registers (19 compare-exchanges, each lane sorted alone): the
// network's levels within aligned groups of 8 ranks. Only the first m vectors are values (the rest +inf): the
// compare-exchanges that reach past them change nothing and are skipped.
template <typename Vec>
PFK_ALWAYS_INLINE void sort8(Vec* v, int m) {
  constexpr int kPairs[19][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {1, 2}, {5, 6},
                                 {0, 4}, {1, 5}, {2, 6}, {3, 7}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}};
#pragma GCC unroll 19
  for (int c = 0; c < 19; ++c) {
    if (kPairs[c][1] >= m) continue;
    const Vec a = v[kPairs[c][0]], b = v[kPairs[c][1]];
    const auto less = a < b;
    v[kPairs[c][0]] = less ? a : b;
    v[kPairs[c][1]] = less ? b : a;
  }
}

// Copies columns [t0, t0 + n) of K contiguous rows into the [K, B] tile with each aligned group of 8 rows sorted per
// column (ranks past K act as +inf and are not stored; lanes past n are stored as 0). Returns false when a value
// read is NaN or infinite.
template <typename T, typename V>
PFK_ALWAYS_INLINE bool copy_sorted_groups(const std::vector<RowRef>& rows, int64_t K, int64_t t0, int64_t n,
                                          int64_t end, V* __restrict__ buf, int64_t B) {
  typedef V Vec __attribute__((vector_size(32)));
  constexpr int64_t L = 32 / sizeof(V);
  Vec bad = Vec{};
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    const int64_t m = std::min<int64_t>(8, K - k0);
    for (int64_t j = 0; j < n; j += L) {
      Vec v[8];
      if (m == 8 && j + L <= n) {
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
          const T* src = static_cast<const T*>(rows[k0 + r].ptr) + t0 + j;
          V lanes[L];
          for (int64_t l = 0; l < L; ++l) lanes[l] = to_acc(src[l]);
          __builtin_memcpy(&v[r], lanes, sizeof(Vec));
          bad = bad + v[r] * V(0);  // NaN once any value is NaN or infinite
        }
      } else if (j + L <= n) {  // the last, partial group of rows: whole vectors, ranks past K as +inf
        for (int r = 0; r < 8; ++r) {
          if (r < m) {
            const T* src = static_cast<const T*>(rows[k0 + r].ptr) + t0 + j;
            V lanes[L];
            for (int64_t l = 0; l < L; ++l) lanes[l] = to_acc(src[l]);
            __builtin_memcpy(&v[r], lanes, sizeof(Vec));
            bad = bad + v[r] * V(0);
          } else {
            v[r] = Vec{} + std::numeric_limits<V>::infinity();
          }
        }
      } else {
        for (int r = 0; r < 8; ++r) {
          V lanes[L];
          const T* src = r < m ? static_cast<const T*>(rows[k0 + r].ptr) + t0 + j : nullptr;
          for (int64_t l = 0; l < L; ++l)
            lanes[l] = r >= m ? std::numeric_limits<V>::infinity() : j + l < n ? to_acc(src[l]) : V(0);
          __builtin_memcpy(&v[r], lanes, sizeof(Vec));
          if (r < m) bad = bad + v[r] * V(0);
        }
      }
      if (m == 8)
        sort8(v, 8);
      else
        sort8(v, static_cast<int>(m));
      for (int64_t r = 0; r < m; ++r) __builtin_memcpy(buf + (k0 + r) * B + j, &v[r], sizeof(Vec));
    }
    for (int64_t r = k0; r < k0 + m; ++r) prefetch_columns(static_cast<const T*>(rows[r].ptr), t0 + B, t0 + 2 * B, end);
  }
  for (int64_t l = 0; l < L; ++l)
    if (bad[l] != V(0)) return false;
  return true;
}

// Trimmed sum without sorting, for a cut of C values per side: per lane, the C smallest and the C largest values
// seen so far are held in registers (lo, hi; each sorted), and each further row is pushed through them, a chain of
// C compare-exchanges per side (2C(K - 2C) in all, against several hundred for a sorting network at K = 50). The value
// that leaves both is neither among the C smallest nor the C largest of all K (more rows only push it further out),
// so it is kept: it is added to the float64 sums, the kept values of each coordinate in row order of leaving.
template <typename V, int C>
PFK_ALWAYS_INLINE void trimmed_sums(const V* buf, int64_t B, int64_t n, int64_t K, double* __restrict__ acc) {
  typedef V Vec __attribute__((vector_size(32)));
  typedef double Acc __attribute__((vector_size(32)));
  constexpr int64_t L = 32 / sizeof(V);
  constexpr int A = sizeof(V) == 4 ? 2 : 1;  // float64 accumulators per vector of values
  for (int64_t j = 0; j < n; j += L) {
    Vec lo[C], hi[C], v, t;
    Acc s[A] = {};
    for (int c = 0; c < C; ++c) {
      lo[c] = Vec{} + std::numeric_limits<V>::infinity();
      hi[c] = Vec{} - std::numeric_limits<V>::infinity();
    }
    for (int64_t k = 0; k < K; ++k) {
      __builtin_memcpy(&v, buf + k * B + j, sizeof(Vec));
      for (int c = 0; c < C; ++c) {  // v leaves as the largest of lo and v
        t = v < lo[c] ? v : lo[c];
        v = v < lo[c] ? lo[c] : v;
        lo[c] = t;
      }
      if (k < C) continue;           // v is a +inf placeholder: lo holds the first rows
      for (int c = 0; c < C; ++c) {  // v leaves as the smallest of hi and v
        t = hi[c] < v ? v : hi[c];
        v = hi[c] < v ? hi[c] : v;
        hi[c] = t;
      }
      if (k < 2 * C) continue;  // v is a -inf placeholder: hi holds the next rows
      if constexpr (A == 2) {
        s[0] += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), Acc);
        s[1] += __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), Acc);
      } else {
        s[0] += v;
      }
    }
    __builtin_memcpy(acc + j, s, sizeof(s));
  }
}

// Trimmed sums for cuts up to kMaxPushCut per side (the register chains above); false for larger cuts.
constexpr int64_t kMaxPushCut = 8;
template <typename V>
PFK_ALWAYS_INLINE bool trimmed_sums_by_cut(const V* buf, int64_t B, int64_t n, int64_t K, int64_t cut, double* acc) {
  switch (cut) {
#define PFK_TRIMMED_CASE(C)                \
  case C:                                  \
    trimmed_sums<V, C>(buf, B, n, K, acc); \
    return true;
    PFK_TRIMMED_CASE(1)
    PFK_TRIMMED_CASE(2)
    PFK_TRIMMED_CASE(3)
    PFK_TRIMMED_CASE(4)
    PFK_TRIMMED_CASE(5)
    PFK_TRIMMED_CASE(6)
    PFK_TRIMMED_CASE(7)
    PFK_TRIMMED_CASE(8)
#undef PFK_TRIMMED_CASE
    default:
      return false;
  }
}

// Mean of sorted ranks [first, last) of column j, summed in ascending order in double.
template <typename V>
PFK_ALWAYS_INLINE double ranks_mean(const V* buf, int64_t B, int64_t j, int64_t first, int64_t last) {
  double s = 0.0;
  for (int64_t r = first; r < last; ++r) s += static_cast<double>(buf[r * B + j]);
  return s / static_cast<double>(last - first);
}

template <typename V>
double median_of_sorted(const V* buf, int64_t B, int64_t j, int64_t K) {
  if (K % 2) return static_cast<double>(buf[(K / 2) * B + j]);
  return (static_cast<double>(buf[(K / 2 - 1) * B + j]) + static_cast<double>(buf[(K / 2) * B + j])) * 0.5;
}

// Bulyan: mean of the `beta` sorted values closest to the median (equal distances: the smaller value first).
template <typename V>
double closest_mean(const V* buf, int64_t B, int64_t j, int64_t K, int64_t beta) {
  const double m = median_of_sorted(buf, B, j, K);
  int64_t lo = (K - 1) / 2, hi = lo + 1;
  for (int64_t t = 0; t < beta; ++t) {
    if (lo >= 0 && (hi >= K || m - static_cast<double>(buf[lo * B + j]) <= static_cast<double>(buf[hi * B + j]) - m))
      --lo;
    else
      ++hi;
  }
  return ranks_mean(buf, B, j, lo + 1, hi);
}

// Weighted median of column j (values ordered by value then row; see pyfedkern.reference.robust).
template <typename V>
double weighted_median(const V* buf, int64_t B, int64_t j, int64_t K, const double* w,
                       std::vector<std::pair<V, int64_t>>& order) {
  for (int64_t k = 0; k < K; ++k) order[k] = {buf[k * B + j], k};
  std::sort(order.begin(), order.end());
  double total = 0.0;
  for (int64_t k = 0; k < K; ++k) total += w[order[k].second];
  double c = 0.0;
  for (int64_t r = 0; r < K; ++r) {
    c += w[order[r].second];
    if (2.0 * c >= total) {  // total is the same running sum: rank K - 1 always qualifies
      if (2.0 * c == total && r + 1 < K)
        return (static_cast<double>(order[r].first) + static_cast<double>(order[r + 1].first)) * 0.5;
      return static_cast<double>(order[r].first);
    }
  }
  return static_cast<double>(order[K - 1].first);
}

template <typename T>
PFK_ALWAYS_INLINE void store(T* out, double v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    *out = static_cast<T>(v);
  } else {
    *out = Store<T>::from(static_cast<float>(v));
  }
}

// Copies columns [t0, t0 + n) of K rows (any strides) into the [K, B] tile; probe[j] becomes NaN when a value of
// column j is NaN or infinite.
template <typename T, typename V>
PFK_ALWAYS_INLINE void copy_tile(const std::vector<RowRef>& rows, int64_t K, int64_t t0, int64_t n, int64_t end, V* buf,
                                 int64_t B, V* __restrict__ probe) {
  std::fill(probe, probe + n, V(0));
  for (int64_t k = 0; k < K; ++k) {
    const T* r = static_cast<const T*>(rows[k].ptr);
    const int64_t s = rows[k].stride;
    V* __restrict__ dst = buf + k * B;
    if (s == 1) {
      for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(r[t0 + j]);
      prefetch_columns(r, t0 + B, t0 + 2 * B, end);
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(r[(t0 + j) * s]);
    }
    for (int64_t j = 0; j < n; ++j) probe[j] = probe[j] + dst[j] * V(0);  // NaN once any value is NaN or infinite
  }
}

// One chunk [begin, end) of coordinates; returns false when a value read was NaN or infinite.
template <typename T>
PFK_ALWAYS_INLINE bool robust_chunk_body(int64_t begin, int64_t end, T* out, int64_t out_stride,
                                         const std::vector<RowRef>& rows, const Plan& plan) {
  using V = typename AccOf<T>::type;
  const int64_t K = plan.K;
  const int64_t B = std::max<int64_t>(16, std::min<int64_t>(256, (kTileBytes / (K * int64_t(sizeof(V)))) & ~15));
  std::vector<V> buf(static_cast<size_t>(K * B));
  std::vector<V> probe(static_cast<size_t>(B));
  std::vector<double> sums(static_cast<size_t>(B));
  std::vector<std::pair<V, int64_t>> order(plan.rule == Rule::WeightedMedian ? K : 0);
  const bool network = plan.rule != Rule::WeightedMedian && !(plan.rule == Rule::Trimmed && plan.param <= kMaxPushCut);
  const bool grouped = network && std::all_of(rows.begin(), rows.end(), [](const RowRef& r) { return r.stride == 1; });
  const size_t first_comparator = grouped ? plan.late : 0;
  bool finite = true;
  for (int64_t t0 = begin; t0 < end; t0 += B) {
    const int64_t n = std::min(B, end - t0);
    T* o = out + t0 * out_stride;
    if (grouped) {
      if (!copy_sorted_groups<T, V>(rows, K, t0, n, end, buf.data(), B)) return false;
    } else {
      copy_tile<T, V>(rows, K, t0, n, end, buf.data(), B, probe.data());
      for (int64_t j = 0; j < n; ++j) finite = finite && probe[j] == V(0);
      if (!finite) return false;
    }
    if (plan.rule == Rule::Trimmed && trimmed_sums_by_cut(buf.data(), B, n, K, plan.param, sums.data())) {
      const double kept = static_cast<double>(K - 2 * plan.param);
      for (int64_t j = 0; j < n; ++j) store(o + j * out_stride, sums[j] / kept);
      continue;
    }
    for (size_t c = first_comparator; c < plan.network.size(); ++c)
      compare_exchange(buf.data() + plan.network[c].first * B, buf.data() + plan.network[c].second * B, n);
    if (plan.rule == Rule::Median || plan.rule == Rule::Trimmed) {
      // Sum the kept ranks row by row (vectorised across the tile), in ascending rank order per coordinate.
      const int64_t first = plan.rule == Rule::Median ? (K - 1) / 2 : plan.param;
      const int64_t last = plan.rule == Rule::Median ? K / 2 + 1 : K - plan.param;
      double* __restrict__ acc = sums.data();
      std::fill(acc, acc + n, 0.0);
      for (int64_t r = first; r < last; ++r) {
        const V* __restrict__ row = buf.data() + r * B;
        for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(row[j]);
      }
      const double scale = 1.0 / static_cast<double>(last - first);  // 1 or 1/2 for the median: exact
      if (plan.rule == Rule::Median) {
        for (int64_t j = 0; j < n; ++j) store(o + j * out_stride, acc[j] * scale);
      } else {
        for (int64_t j = 0; j < n; ++j) store(o + j * out_stride, acc[j] / static_cast<double>(last - first));
      }
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      const double v = plan.rule == Rule::Closest ? closest_mean(buf.data(), B, j, K, plan.param)
                                                  : weighted_median(buf.data(), B, j, K, plan.weights, order);
      store(o + j * out_stride, v);
    }
  }
  return true;
}

PFK_ISA_DISPATCH(template <typename T>, <T>, bool, robust_chunk,
                 (int64_t begin, int64_t end, T* out, int64_t out_stride, const std::vector<RowRef>& rows,
                  const Plan& plan),
                 (begin, end, out, out_stride, rows, plan), robust_chunk_body)

template <typename T>
bool robust_typed(int64_t d, void* out, int64_t out_stride, const std::vector<RowRef>& rows, const Plan& plan) {
  const int64_t nchunks = (d + kChunk - 1) / kChunk;
  std::vector<char> ok(static_cast<size_t>(nchunks), 1);
  const int64_t work = (plan.K + 1) * d * (plan.network.size() > 64 ? 2 : 1);
  parallel_chunks(d, kChunk, work, [&](int64_t c, int64_t begin, int64_t end) {
    ok[c] = robust_chunk<T>(begin, end, static_cast<T*>(out), out_stride, rows, plan) ? 1 : 0;
  });
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; });
}

// Krum's Gram product -----------------------------------------------------------------------------------------------
//
// G = (X − s)(X − s)ᵀ of K rows (s: row `shift`, or none), float64 [K, K]. The columns are cut into at most
// kGramGroups fixed ranges (fewer when d or K² is large; never dependent on the thread count), each summed into its
// own float64 [K, K] partial, and the partials are added in order. Within a range, blocks of kGramCols columns are
// read in place (unshifted contiguous rows of the accumulation type V: float, or double for float64 rows) or packed
// (shifted, converted to V) into a [K, B] buffer; the upper triangle is then computed from them in tiles of 4 × 3 rows
// (12 accumulators: AVX2's 16 registers), each pair in one vector of L lanes (lane l: the columns ≡ l mod L, one fused
// multiply-add per column in column order), the lanes added in double in a fixed order and the block's sum added to the
// partial. A fused multiply-add rounds once on every machine (the CPU's FMA on x86 with AVX2 and FMA, std::fma
// elsewhere), so each entry is exactly the same on every ISA and for any row position in a tile (duplicate rows give
// identical entries), and its rounding error is at most about (B/L + 2) units of V's roundoff times Σ|y_ic·y_jc| (y =
// fl(x − s)).
constexpr int64_t kGramCols = 512;  // columns per packed block: each float lane sums 64 products
constexpr int64_t kGramGroups = 16;
constexpr int64_t kGramTileI = 4, kGramTileJ = 3;

// Lane-wise a·b + c rounded once (std::fma: one vfmadd instruction where the function is compiled for FMA).
template <typename Vec>
PFK_ALWAYS_INLINE Vec fused_multiply_add(Vec a, Vec b, Vec c) {
  constexpr int L = sizeof(Vec) / sizeof(a[0]);
  for (int l = 0; l < L; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
}

template <typename T, typename V>
PFK_ALWAYS_INLINE void gram_pack(const std::vector<RowRef>& rows, int64_t shift, int64_t c0, int64_t n, int64_t end,
                                 V* __restrict__ buf, V* __restrict__ s) {
  if (shift >= 0) {
    const T* r = static_cast<const T*>(rows[shift].ptr);
    const int64_t st = rows[shift].stride;
    for (int64_t j = 0; j < n; ++j) s[j] = to_acc(r[(c0 + j) * st]);
  } else {
    std::fill(s, s + n, V(0));
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    const T* r = static_cast<const T*>(rows[k].ptr);
    const int64_t st = rows[k].stride;
    V* __restrict__ dst = buf + k * kGramCols;
    if (st == 1) {
      for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(r[c0 + j]) - s[j];
      prefetch_columns(r, c0 + kGramCols, c0 + 2 * kGramCols, end);
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(r[(c0 + j) * st]) - s[j];
    }
    std::fill(dst + n, dst + kGramCols, V(0));
  }
}

template <typename Vec>
PFK_ALWAYS_INLINE double lane_sum(Vec v) {
  constexpr int L = sizeof(Vec) / sizeof(v[0]);
  double h[L];
  for (int l = 0; l < L; ++l) h[l] = static_cast<double>(v[l]);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) h[l] += h[l + w];
  return h[0];
}

// Adds the Gram product of columns [begin, end) into the [K, K] partial (upper triangle).
template <typename T>
PFK_ALWAYS_INLINE void gram_range_body(const std::vector<RowRef>& rows, int64_t shift, int64_t begin, int64_t end,
                                       double* __restrict__ partial) {
  using V = typename AccOf<T>::type;
  typedef V Vec __attribute__((vector_size(32)));
  constexpr int64_t L = 32 / sizeof(V);
  const int64_t K = static_cast<int64_t>(rows.size());
  // Rows past K (a tile's overhang) read zeros and feed only products that are dropped. The packing buffer (K rows
  // and the shift's slice) is allocated when a block is first packed.
  const std::vector<V> zeros(static_cast<size_t>((kGramTileI + kGramTileJ) * kGramCols), V(0));
  std::vector<V> buf;
  std::vector<const V*> at(static_cast<size_t>(K + kGramTileI + kGramTileJ));  // each row's current block
  for (int64_t k = K; k < K + kGramTileI + kGramTileJ; ++k) at[k] = zeros.data() + (k - K) * kGramCols;
  // Unshifted contiguous rows of the accumulation type are read in place (whole blocks): no copy.
  const bool in_place = std::is_same_v<T, V> && shift < 0 &&
                        std::all_of(rows.begin(), rows.end(), [](const RowRef& r) { return r.stride == 1; });
  for (int64_t c0 = begin; c0 < end; c0 += kGramCols) {
    const int64_t n = std::min(kGramCols, end - c0);
    if (in_place && n == kGramCols) {
      for (int64_t k = 0; k < K; ++k) {
        const V* r = static_cast<const V*>(rows[k].ptr);
        at[k] = r + c0;
        prefetch_columns(r, c0 + kGramCols, c0 + 2 * kGramCols, end);
      }
    } else {
      if (buf.empty()) buf.resize(static_cast<size_t>((K + 1) * kGramCols));
      gram_pack<T, V>(rows, shift, c0, n, end, buf.data(), buf.data() + K * kGramCols);
      for (int64_t k = 0; k < K; ++k) at[k] = buf.data() + k * kGramCols;
    }
    const int64_t nv = (n + L - 1) / L;
    for (int64_t i0 = 0; i0 < K; i0 += kGramTileI) {
      for (int64_t j0 = i0; j0 < K; j0 += kGramTileJ) {
        Vec acc[kGramTileI][kGramTileJ] = {};
        for (int64_t v = 0; v < nv; ++v) {
          Vec x[kGramTileI], y[kGramTileJ];
#pragma GCC unroll 4
          for (int64_t i = 0; i < kGramTileI; ++i) __builtin_memcpy(&x[i], at[i0 + i] + v * L, sizeof(Vec));
#pragma GCC unroll 3
          for (int64_t j = 0; j < kGramTileJ; ++j) __builtin_memcpy(&y[j], at[j0 + j] + v * L, sizeof(Vec));
#pragma GCC unroll 4
          for (int64_t i = 0; i < kGramTileI; ++i)
#pragma GCC unroll 3
            for (int64_t j = 0; j < kGramTileJ; ++j) acc[i][j] = fused_multiply_add(x[i], y[j], acc[i][j]);
        }
        for (int64_t i = 0; i < kGramTileI; ++i)
          for (int64_t j = 0; j < kGramTileJ; ++j)
            if (i0 + i < K && j0 + j < K && i0 + i <= j0 + j) partial[(i0 + i) * K + j0 + j] += lane_sum(acc[i][j]);
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T>
__attribute__((target("avx2,fma"))) void gram_range_fma(const std::vector<RowRef>& rows, int64_t shift, int64_t begin,
                                                        int64_t end, double* partial) {
  gram_range_body<T>(rows, shift, begin, end, partial);
}
#endif

template <typename T>
void gram_range(const std::vector<RowRef>& rows, int64_t shift, int64_t begin, int64_t end, double* partial) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool hardware = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (hardware) return gram_range_fma<T>(rows, shift, begin, end, partial);
#endif
  gram_range_body<T>(rows, shift, begin, end, partial);
}

template <typename T>
void gram_typed(const std::vector<RowRef>& rows, int64_t d, int64_t shift, double* out) {
  const int64_t K = static_cast<int64_t>(rows.size());
  const int64_t blocks = (d + kGramCols - 1) / kGramCols;
  const int64_t groups = std::max<int64_t>(1, std::min({kGramGroups, blocks, (int64_t{1} << 22) / (K * K)}));
  const int64_t per = (blocks + groups - 1) / groups * kGramCols;  // columns per group, whole blocks
  const int64_t ngroups = (d + per - 1) / per;
  std::vector<double> partials(static_cast<size_t>(ngroups * K * K), 0.0);
  parallel_chunks(ngroups, 1, K * d + K * K * d / 16, [&](int64_t g, int64_t, int64_t) {
    gram_range<T>(rows, shift, g * per, std::min(d, (g + 1) * per), partials.data() + g * K * K);
  });
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i; j < K; ++j) {
      double s = 0.0;
      for (int64_t g = 0; g < ngroups; ++g) s += partials[(g * K + i) * K + j];
      out[i * K + j] = out[j * K + i] = s;
    }
}

// Krum's squared distances: the probe that picks the Gram product's shift, the product, and the check of the pick.

constexpr int64_t kProbeRuns = 16;  // the probe reads 16 runs of 16 adjacent columns spread over d

// The value of rank ⌊K/2⌋ (from 0) of v[0..K) (NaN counts as +inf).
double middle(const double* v, int64_t K) {
  std::vector<double> c(v, v + K);
  for (double& x : c)
    if (std::isnan(x)) x = std::numeric_limits<double>::infinity();
  const auto m = c.begin() + K / 2;
  std::nth_element(c.begin(), m, c.end());
  return *m;
}

// The row of a symmetric [K, K] distance matrix with the smallest middle distance to the rows (itself included;
// ties: lowest index). A row farther than that from over half of the rows is never it.
int64_t medoid(const double* dist, int64_t K) {
  int64_t best = 0;
  double best_mid = std::numeric_limits<double>::infinity();
  for (int64_t k = 0; k < K; ++k) {
    const double m = middle(dist + k * K, K);
    if (k == 0 || m < best_mid) best = k, best_mid = m;
  }
  return best;
}

// The shift of the Gram product from a float64 sample of the columns (kProbeRuns runs of kProbeRuns adjacent
// columns, run r from column r·⌊d/runs⌋; every column when d ≤ runs²): -1 (none) when the raw rows' middle squared
// norm is at most their middle squared distance to their medoid, else the medoid.
template <typename T>
int64_t probe_shift(const std::vector<RowRef>& rows, int64_t d) {
  const int64_t K = static_cast<int64_t>(rows.size());
  const bool all = d <= kProbeRuns * kProbeRuns;
  const int64_t S = all ? d : kProbeRuns * kProbeRuns;
  std::vector<double> sample(static_cast<size_t>(K * S)), norms(static_cast<size_t>(K)),
      dist(static_cast<size_t>(K * K));
  for (int64_t k = 0; k < K; ++k) {
    const T* r = static_cast<const T*>(rows[k].ptr);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t col = all ? s : (s / kProbeRuns) * (d / kProbeRuns) + s % kProbeRuns;
      sample[k * S + s] = static_cast<double>(to_acc(r[col * rows[k].stride]));
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    double n = 0.0;
    for (int64_t s = 0; s < S; ++s) n += sample[k * S + s] * sample[k * S + s];
    norms[k] = n;
  }
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i; j < K; ++j) {
      double dot = 0.0;
      for (int64_t s = 0; s < S; ++s) dot += sample[i * S + s] * sample[j * S + s];
      dist[i * K + j] = dist[j * K + i] = norms[i] + norms[j] - 2.0 * dot;  // coarse only for extreme offsets
    }
  const int64_t k = medoid(dist.data(), K);
  return middle(norms.data(), K) <= middle(dist.data() + k * K, K) ? -1 : k;
}

// The Gram matrix of the rows shifted by `shift` (-2: the probe's pick, -1: none, else that row) into gram and the
// squared distances max(0, G_ii + G_jj − 2G_ij) into dist. If the middle ‖x_k − s‖² is above 4 times the middle
// distance to the distances' medoid (a misleading pick), the product is taken once more shifted by that medoid.
// Returns the shift used (-1: none), or -2 when a Gram entry is not finite.
template <typename T>
int64_t distances_typed(const std::vector<RowRef>& rows, int64_t d, int64_t shift, double* gram, double* dist) {
  const int64_t K = static_cast<int64_t>(rows.size());
  if (shift == -2) shift = probe_shift<T>(rows, d);
  std::vector<double> diag(static_cast<size_t>(K));
  for (int attempt = 0;; ++attempt) {
    gram_typed<T>(rows, d, shift, gram);
    if (!std::all_of(gram, gram + K * K, [](double v) { return std::isfinite(v); })) return -2;
    for (int64_t k = 0; k < K; ++k) diag[k] = gram[k * K + k];
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j)
        dist[i * K + j] = i == j ? 0.0 : std::max(diag[i] + diag[j] - 2.0 * gram[i * K + j], 0.0);
    const int64_t best = medoid(dist, K);
    if (attempt > 0 || middle(diag.data(), K) <= 4.0 * middle(dist + best * K, K)) break;
    shift = best;
  }
  return shift;
}

// Entry point from Python: see distances_typed.
int64_t robust_distances(const std::string& dtype_name, int64_t d, uintptr_t gram, uintptr_t dist,
                         const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides, uintptr_t base,
                         int64_t step_bytes, int64_t count, int64_t col_stride, int64_t shift) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("robust_distances: d must be >= 1");
  if (gram == 0 || dist == 0) throw ArgumentError("robust_distances: null output pointer");
  const std::vector<RowRef> rows = make_rows(ptrs, strides, base, step_bytes, count, col_stride);
  const int64_t K = static_cast<int64_t>(rows.size());
  if (K < 1) throw ArgumentError("robust_distances: need at least one row");
  if (shift < -2 || shift >= K) throw ArgumentError("robust_distances: shift out of range");
  double* g = reinterpret_cast<double*>(gram);
  double* o = reinterpret_cast<double*>(dist);
  switch (dtype) {
    case DType::F32:
      return distances_typed<float>(rows, d, shift, g, o);
    case DType::F64:
      return distances_typed<double>(rows, d, shift, g, o);
    case DType::F16:
      return distances_typed<f16_t>(rows, d, shift, g, o);
    case DType::BF16:
      return distances_typed<bf16_t>(rows, d, shift, g, o);
  }
  return -2;
}

// Entry point from Python (arguments validated there): writes the rule's [d] result into out and returns whether
// every value read was finite (false: the output is incomplete, and the Python layer names the offending row).
bool robust_coordinate(const std::string& dtype_name, int64_t d, uintptr_t out, int64_t out_stride,
                       const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides, uintptr_t base,
                       int64_t step_bytes, int64_t count, int64_t col_stride, int rule, int64_t param,
                       const py::array_t<double, py::array::c_style>& weights) {
  const DType dtype = dtype_from_name(dtype_name);
  if (d < 1) throw ArgumentError("robust_coordinate: d must be >= 1");
  if (out == 0) throw ArgumentError("robust_coordinate: out is a null pointer");
  if (rule < 0 || rule > 3) throw ArgumentError("robust_coordinate: unknown rule");
  const std::vector<RowRef> rows = make_rows(ptrs, strides, base, step_bytes, count, col_stride);
  const int64_t K = static_cast<int64_t>(rows.size());
  if (K < 1) throw ArgumentError("robust_coordinate: need at least one row");
  Plan plan{static_cast<Rule>(rule), K, param, {}, 0, nullptr};
  std::vector<bool> needed(static_cast<size_t>(K), false);
  switch (plan.rule) {
    case Rule::Median:
      needed[K / 2] = true;
      if (K % 2 == 0) needed[K / 2 - 1] = true;
      break;
    case Rule::Trimmed:
      if (param < 0 || 2 * param >= K) throw ArgumentError("robust_coordinate: trimmed cut out of range");
      if (param > kMaxPushCut)  // smaller cuts: register chains (trimmed_sums); none: the rows' plain sum
        for (int64_t r = param; r < K - param; ++r) needed[r] = true;
      break;
    case Rule::Closest:
      if (param < 1 || param > K) throw ArgumentError("robust_coordinate: closest count out of range");
      std::fill(needed.begin(), needed.end(), true);
      break;
    case Rule::WeightedMedian:
      if (weights.size() != K) throw ArgumentError("robust_coordinate: one weight per row is needed");
      plan.weights = weights.data();
      break;
  }
  if (plan.rule != Rule::WeightedMedian) plan.network = selection_network(static_cast<int>(K), needed);
  while (plan.late < plan.network.size() && plan.network[plan.late].first / 8 == plan.network[plan.late].second / 8)
    ++plan.late;
  void* o = reinterpret_cast<void*>(out);
  switch (dtype) {
    case DType::F32:
      return robust_typed<float>(d, o, out_stride, rows, plan);
    case DType::F64:
      return robust_typed<double>(d, o, out_stride, rows, plan);
    case DType::F16:
      return robust_typed<f16_t>(d, o, out_stride, rows, plan);
    case DType::BF16:
      return robust_typed<bf16_t>(d, o, out_stride, rows, plan);
  }
  return true;
}

}  // namespace

void bind_robust(py::module_& m) {
  m.def("robust_coordinate", &robust_coordinate, py::arg("dtype"), py::arg("d"), py::arg("out"), py::arg("out_stride"),
        py::arg("ptrs"), py::arg("strides"), py::arg("base"), py::arg("step_bytes"), py::arg("count"),
        py::arg("col_stride"), py::arg("rule"), py::arg("param"), py::arg("weights"),
        py::call_guard<py::gil_scoped_release>(),
        "Coordinate-wise rule over K rows (0 median, 1 trimmed mean cutting `param` per side, 2 mean of the `param` "
        "values closest to the median, 3 weighted median); returns False when a value read was not finite.");
  m.def("robust_distances", &robust_distances, py::arg("dtype"), py::arg("d"), py::arg("gram"), py::arg("dist"),
        py::arg("ptrs"), py::arg("strides"), py::arg("base"), py::arg("step_bytes"), py::arg("count"),
        py::arg("col_stride"), py::arg("shift"), py::call_guard<py::gil_scoped_release>(),
        "Krum's float64 [K, K] Gram matrix of the rows shifted by `shift` (-2: the probe's pick, -1: none, else that "
        "row; re-taken around the medoid if the pick misled) and squared distances; returns the shift used, -2 when "
        "not finite.");
}

}  // namespace pfk
