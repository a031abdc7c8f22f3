// Seeded permutations that equal NumPy's `np.random.default_rng(entropy).permutation(n)` bit for bit, for many
// (entropy, n) rows in one call. Each row runs NumPy's chain natively:
//   SeedSequence (pool of 4 uint32 words) -> 4 uint64 seed words -> PCG64 (128-bit LCG, XSL-RR output)
//   -> Generator.permutation: arange(n), then for i = n-1 down to 1 swap a[i] with a[j], j uniform in [0, i]
//      by masked rejection sampling on 32-bit draws (two per 64-bit output, low half first).
// Rows are independent, so the result does not depend on the thread count.
#include <array>
#include <utility>
#include <vector>

#include "bindings.h"
#include "parallel.h"
#include "types.h"

namespace pfk {
namespace {

// ---- SeedSequence ----------------------------------------------------------------------------------------

constexpr int kPoolSize = 4;
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875;  // hashing of entropy words into the pool
constexpr uint32_t kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;  // hashing of pool words into the output state
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr int kXShift = 16;

// A multiplicative hash whose multiplier advances with every word hashed.
class Hasher {
 public:
  Hasher(uint32_t init, uint32_t mult) : h_(init), mult_(mult) {}
  uint32_t operator()(uint32_t value) {
    value ^= h_;
    h_ *= mult_;
    value *= h_;
    return value ^ (value >> kXShift);
  }

 private:
  uint32_t h_, mult_;
};

uint32_t mix(uint32_t x, uint32_t y) {
  const uint32_t r = kMixMultL * x - kMixMultR * y;
  return r ^ (r >> kXShift);
}

// The 4 uint64 words SeedSequence(entropy).generate_state(4, uint64) gives for the entropy words given.
std::array<uint64_t, 4> seed_state(const std::vector<uint32_t>& entropy) {
  Hasher hash_a(kInitA, kMultA);
  std::array<uint32_t, kPoolSize> pool;
  for (size_t i = 0; i < kPoolSize; ++i) pool[i] = hash_a(i < entropy.size() ? entropy[i] : 0u);
  for (int src = 0; src < kPoolSize; ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hash_a(pool[src]));
    }
  }
  for (size_t src = kPoolSize; src < entropy.size(); ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) pool[dst] = mix(pool[dst], hash_a(entropy[src]));
  }
  Hasher hash_b(kInitB, kMultB);
  std::array<uint64_t, 4> state;
  for (int i = 0; i < 4; ++i) {  // 8 uint32 words cycling over the pool, read little-endian as 4 uint64
    const uint64_t lo = hash_b(pool[(2 * i) % kPoolSize]);
    const uint64_t hi = hash_b(pool[(2 * i + 1) % kPoolSize]);
    state[i] = lo | (hi << 32);
  }
  return state;
}

// ---- PCG64 -----------------------------------------------------------------------------------------------

using u128 = unsigned __int128;

class Pcg64 {
 public:
  // Seeded as NumPy seeds PCG64 from a SeedSequence: initial state from words 0-1, stream from words 2-3 (the
  // first word of each pair is the high half).
  explicit Pcg64(const std::array<uint64_t, 4>& words) {
    const u128 initial = (u128(words[0]) << 64) | words[1];
    const u128 stream = (u128(words[2]) << 64) | words[3];
    inc_ = (stream << 1) | 1u;
    state_ = 0;
    step();
    state_ += initial;
    step();
  }

  uint64_t next64() {  // advance, then output the new state
    step();
    const uint64_t hi = static_cast<uint64_t>(state_ >> 64);
    const uint64_t x = hi ^ static_cast<uint64_t>(state_);
    const unsigned rot = static_cast<unsigned>(hi >> 58);
    return (x >> rot) | (x << ((64u - rot) & 63u));
  }

  uint32_t next32() {  // the low half of a 64-bit output, then its high half on the next call
    if (has_half_) {
      has_half_ = false;
      return half_;
    }
    const uint64_t v = next64();
    half_ = static_cast<uint32_t>(v >> 32);
    has_half_ = true;
    return static_cast<uint32_t>(v);
  }

 private:
  static constexpr u128 kMult = (u128(2549297995355413924ULL) << 64) | 4865540595714422341ULL;
  void step() { state_ = state_ * kMult + inc_; }

  u128 state_, inc_;
  uint32_t half_ = 0;
  bool has_half_ = false;
};

// ---- Generator.permutation -------------------------------------------------------------------------------

// Uniform in [0, max]: draws masked to the bit width of max until one is <= max.
uint32_t uniform_at_most(Pcg64& gen, uint32_t max) {
  if (max == 0) return 0;
  uint32_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  uint32_t value;
  do {
    value = gen.next32() & mask;
  } while (value > max);
  return value;
}

void permutation(Pcg64& gen, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = i;
  for (int64_t i = n - 1; i > 0; --i) std::swap(out[i], out[uniform_at_most(gen, static_cast<uint32_t>(i))]);
}

// ---- entry point from Python -----------------------------------------------------------------------------

constexpr int64_t kMaxSize = int64_t{1} << 32;  // larger rows would draw 64-bit bounded integers (not supported)
constexpr int64_t kRowsPerChunk = 32;

// Row r: entropy = seed_words followed by keys[r, 0..key_len), n = sizes[r]; writes the permutations one after
// another into out (int64, sum of sizes).
void seeded_permutations(const std::vector<uint32_t>& seed_words, uintptr_t keys, int64_t rows, int64_t key_len,
                         uintptr_t sizes, uintptr_t out) {
  if (rows < 0 || key_len < 0) throw ArgumentError("seeded_permutations: rows and key_len must be >= 0");
  if (seed_words.empty()) throw ArgumentError("seeded_permutations: seed_words is empty");
  if (rows == 0) return;
  if (sizes == 0 || (key_len > 0 && keys == 0)) throw ArgumentError("seeded_permutations: null pointer");
  const int64_t* key_rows = reinterpret_cast<const int64_t*>(keys);
  const int64_t* n = reinterpret_cast<const int64_t*>(sizes);
  std::vector<int64_t> offsets(static_cast<size_t>(rows) + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (n[r] < 0 || n[r] > kMaxSize) throw ArgumentError("seeded_permutations: sizes must be in [0, 2**32]");
    offsets[r + 1] = offsets[r] + n[r];
  }
  for (int64_t i = 0; i < rows * key_len; ++i) {
    if (key_rows[i] < 0 || key_rows[i] > int64_t{0xffffffff})
      throw ArgumentError("seeded_permutations: keys must be in [0, 2**32)");
  }
  if (offsets[rows] > 0 && out == 0) throw ArgumentError("seeded_permutations: null output pointer");
  int64_t* o = reinterpret_cast<int64_t*>(out);
  const size_t n_seed = seed_words.size();
  const int64_t work = 8 * offsets[rows] + 64 * rows;  // a bounded draw and a swap per item, a seeding per row
  parallel_chunks(rows, kRowsPerChunk, work, [&](int64_t, int64_t begin, int64_t end) {
    std::vector<uint32_t> entropy(seed_words);
    entropy.resize(n_seed + static_cast<size_t>(key_len));
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < key_len; ++c) entropy[n_seed + c] = static_cast<uint32_t>(key_rows[r * key_len + c]);
      Pcg64 gen(seed_state(entropy));
      permutation(gen, n[r], o + offsets[r]);
    }
  });
}

}  // namespace

void bind_sampling(py::module_& m) {
  m.def("seeded_permutations", &seeded_permutations, py::arg("seed_words"), py::arg("keys"), py::arg("rows"),
        py::arg("key_len"), py::arg("sizes"), py::arg("out"), py::call_guard<py::gil_scoped_release>(),
        "Row r: numpy.random.default_rng(seed_words + keys[r]).permutation(sizes[r]) (keys int64 [rows, key_len], "
        "sizes int64 [rows]), written one after another into out (int64, sum of sizes).");
}

}  // namespace pfk
