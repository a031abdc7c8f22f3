// pyfedkern's CPU thread pool (see parallel.h for why it is not OpenMP's).
//
// One job runs at a time. Its chunks are claimed from `claim_`, which packs (job number << 32 | next chunk): a
// compare-and-swap claims a chunk only while that job is the current one and has chunks left, so a worker that
// wakes late finds nothing to do and never touches a finished job. The caller claims chunks too, then waits only
// for chunks a worker has claimed, spinning for at most kSpinMicroseconds before it sleeps. Workers sleep on a
// condition variable between jobs (they never spin). A second caller that finds the pool busy, and any loop
// nested in a chunk, runs on its own thread. A forked child starts a new pool.
#include "parallel.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

namespace pfk {

int default_num_threads() {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int requested = std::atoi(env);  // "4" or "4,2": the outer level
    if (requested > 0) n = requested;
  }
  return std::max(1, n);
}

namespace {

std::atomic<int> g_num_threads{default_num_threads()};
thread_local bool t_in_pool = false;  // a pool worker, or a caller running a job: nested loops run serially

constexpr uint64_t kChunkMask = 0xffffffffu;
constexpr int kSpinMicroseconds = 200;  // the caller's wait for running chunks before it sleeps

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  void run(int64_t nchunks, int threads, detail::ChunkBody body, void* ctx) {
    if (t_in_pool || static_cast<uint64_t>(nchunks) >= kChunkMask || !busy_.try_lock()) {
      for (int64_t c = 0; c < nchunks; ++c) body(ctx, c);
      return;
    }
    t_in_pool = true;
    try {
      for (; workers_ < threads - 1; ++workers_) std::thread([this] { work_forever(); }).detach();
    } catch (const std::system_error&) {  // no more threads allowed: run with the workers there are
      threads = workers_ + 1;
    }
    body_.store(body, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    job_ = (job_ + 1) & kChunkMask;
    claim_.store(job_ << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);
      tickets_ = threads - 1;
    }
    for (int i = 0; i < threads - 1; ++i) wake_.notify_one();
    drain();
    // Chunks still running are a few microseconds from their end: spin for them rather than sleep, since a
    // sleeping caller on a busy machine may wait a whole time slice to be scheduled again.
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
    while (done_.load(std::memory_order_acquire) != nchunks && std::chrono::steady_clock::now() < spin_end) cpu_relax();
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lock(mu_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == nchunks; });
      tickets_ = 0;  // workers not yet awake stay asleep
      std::swap(error, error_);
    }
    t_in_pool = false;
    busy_.unlock();
    if (error) std::rethrow_exception(error);
  }

 private:
  void work_forever() {
    t_in_pool = true;
    pthread_setname_np(pthread_self(), "pyfedkern");
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return tickets_ > 0; });
        --tickets_;
      }
      drain();
    }
  }

  // Claims and runs chunks of the current job until none is left.
  void drain() {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      const auto body = body_.load(std::memory_order_relaxed);
      void* const ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t n = nchunks_.load(std::memory_order_relaxed);
      if (static_cast<int64_t>(c & kChunkMask) >= n) return;
      // Success proves c's job is still current, so body, ctx and n (published before it) are that job's.
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      try {
        body(ctx, static_cast<int64_t>(c & kChunkMask));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        {
          std::lock_guard<std::mutex> lock(mu_);
        }  // the caller is waiting, or has not checked done_ yet
        finished_.notify_one();
      }
      c = claim_.load(std::memory_order_acquire);
    }
  }

  std::mutex busy_;  // held by the caller running a job
  int workers_ = 0;  // started workers (only the job's caller changes it)
  uint64_t job_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<detail::ChunkBody> body_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> nchunks_{0};
  std::atomic<int64_t> done_{0};
  std::mutex mu_;  // guards tickets_ and error_, and pairs with the two condition variables
  std::condition_variable wake_, finished_;
  int tickets_ = 0;  // workers still to wake for the current job
  std::exception_ptr error_;
};

// Never destroyed: its detached workers may still be waiting when the process exits.
std::atomic<Pool*> g_pool{nullptr};

Pool* pool() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
  (void)registered;
  Pool* current = g_pool.load(std::memory_order_acquire);
  if (current != nullptr) return current;
  Pool* fresh = new Pool();
  if (g_pool.compare_exchange_strong(current, fresh)) return fresh;
  delete fresh;  // another thread installed one first
  return current;
}

}  // namespace

int num_threads() {
  return g_num_threads.load(std::memory_order_relaxed);
}

void set_num_threads(int n) {
  g_num_threads.store(std::max(1, n), std::memory_order_relaxed);
}

namespace detail {
void run_chunks(int64_t nchunks, int threads, ChunkBody body, void* ctx) {
  pool()->run(nchunks, threads, body, ctx);
}
}  // namespace detail

}  // namespace pfk
