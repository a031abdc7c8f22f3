// CPU threading for pyfedkern kernels: a process-wide thread count, and a parallel loop over fixed-size chunks.
//
// Chunk boundaries never depend on the thread count, so neither do results. A loop whose total work is below
// two grains runs on the calling thread and wakes nobody (as torch's grain sizes do): on a machine whose cores
// are busy (other processes, torch's own OpenMP threads), waking a thread for microseconds of work costs a
// scheduler time slice, milliseconds, whenever that thread is not scheduled at once. Larger loops run on
// pyfedkern's own small pool (parallel.cpp): the caller works too and chunks are claimed from a shared counter,
// so the caller never waits for a worker that has not started, and idle workers block at once instead of
// spinning against torch's threads.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pfk {

// Threads the kernels may use: the CPUs this process may run on, or OMP_NUM_THREADS when it is set.
int default_num_threads();
int num_threads();
void set_num_threads(int n);

// Work, in units of about one element read or written, worth one thread: 40-80 µs of memory-bound work, so that a
// second thread joins only loops that last well beyond the time a sleeping worker needs to wake (30-50 µs).
constexpr int64_t kGrain = int64_t{1} << 19;

namespace detail {
using ChunkBody = void (*)(void* ctx, int64_t chunk);
// Runs body(ctx, c) for every c in [0, nchunks) on the calling thread and at most threads - 1 pool workers.
void run_chunks(int64_t nchunks, int threads, ChunkBody body, void* ctx);
}  // namespace detail

// Calls fn(chunk_index, begin, end) for every chunk [begin, end) of [0, n) of `chunk` elements, on at most one
// thread per kGrain of `work` (the whole loop's work in kGrain's units, e.g. elements read + written).
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, int64_t work, Fn&& fn) {
  if (n <= 0) return;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  auto run = [&](int64_t c) {
    const int64_t begin = c * chunk;
    fn(c, begin, std::min(n, begin + chunk));
  };
  const int64_t threads = std::min<int64_t>({num_threads(), nchunks, work / kGrain});
  if (threads < 2) {
    for (int64_t c = 0; c < nchunks; ++c) run(c);
    return;
  }
  detail::run_chunks(
      nchunks, static_cast<int>(threads), [](void* ctx, int64_t c) { (*static_cast<decltype(run)*>(ctx))(c); }, &run);
}

}  // namespace pfk
