// CPU threading for pyfedkern kernels: one process-wide thread count, and a parallel loop over fixed-size
// chunks. Chunk boundaries never depend on the thread count, so neither do results.
#pragma once

#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pfk {

int num_threads();
void set_num_threads(int n);
bool openmp_enabled();

// Calls fn(chunk_index, begin, end) for every chunk [begin, end) of [0, n) of `chunk` elements.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const int nt = static_cast<int>(std::min<int64_t>(num_threads(), nchunks));
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t begin = c * chunk;
    fn(c, begin, std::min(n, begin + chunk));
  }
  (void)nt;
}

}  // namespace pfk
