// pyfedkern's CPU thread pool (see parallel.h for why it is not OpenMP's).
//
// One job runs at a time. Its chunks are grouped into at most 65,535 units, and the units are split into one
// contiguous segment per thread: each thread claims units from its own segment first (the same thread gets the
// same part of the data in every call, as with a static schedule), then from the others' (work stealing). Each
// segment's claim word packs (job number, next unit, end): a compare-and-swap claims a unit only while that job is
// the current one and the segment has units left, so a worker that wakes late finds nothing to do and never touches
// a finished job, and the caller, which takes units too, waits only for units a worker has claimed, spinning for at
// most kSpinMicroseconds before it sleeps. Workers sleep on a condition variable between jobs (they never spin). A
// second caller that finds the pool busy, and any loop nested in a unit, runs on its own thread. A forked child
// starts a new pool.
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

constexpr int64_t kMaxUnits = 0xffff;   // units of a job (16 bits of a claim word)
constexpr int kMaxSegments = 256;       // threads of a job
constexpr int kSpinMicroseconds = 200;  // the caller's wait for running units before it sleeps

// A segment's claim word: job number (32 bits) | next unit (16) | end unit (16).
constexpr uint64_t claim_word(uint64_t job, int64_t next, int64_t end) {
  return (job << 32) | (static_cast<uint64_t>(next) << 16) | static_cast<uint64_t>(end);
}

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
    if (t_in_pool || !busy_.try_lock()) {
      for (int64_t c = 0; c < nchunks; ++c) body(ctx, c);
      return;
    }
    t_in_pool = true;
    threads = std::min(threads, kMaxSegments);
    try {
      for (; workers_ < threads - 1; ++workers_) std::thread([this, i = workers_ + 1] { work_forever(i); }).detach();
    } catch (const std::system_error&) {  // no more threads allowed: run with the workers there are
      threads = workers_ + 1;
    }
    const int64_t group = (nchunks + kMaxUnits - 1) / kMaxUnits;
    const int64_t units = (nchunks + group - 1) / group;
    body_.store(body, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    group_.store(group, std::memory_order_relaxed);
    segments_.store(threads, std::memory_order_relaxed);
    const uint64_t job = (job_.load(std::memory_order_relaxed) + 1) & 0xffffffffu;  // 32 bits of a claim word
    for (int s = 0; s < threads; ++s)
      claims_[s].word.store(claim_word(job, units * s / threads, units * (s + 1) / threads), std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    job_.store(job, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);
      tickets_ = threads - 1;
    }
    for (int i = 0; i < threads - 1; ++i) wake_.notify_one();
    drain(0);
    // Units still running are a few microseconds from their end: spin for them rather than sleep, since a
    // sleeping caller on a busy machine may wait a whole time slice to be scheduled again.
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
    while (done_.load(std::memory_order_acquire) != units && std::chrono::steady_clock::now() < spin_end) cpu_relax();
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lock(mu_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == units; });
      tickets_ = 0;  // workers not yet awake stay asleep
      std::swap(error, error_);
    }
    t_in_pool = false;
    busy_.unlock();
    if (error) std::rethrow_exception(error);
  }

 private:
  void work_forever(int self) {
    t_in_pool = true;
    pthread_setname_np(pthread_self(), "pyfedkern");
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return tickets_ > 0; });
        --tickets_;
      }
      drain(self);
    }
  }

  // Claims and runs units of the current job, from segment `self` on, until none is left; then counts them done.
  void drain(int self) {
    const uint64_t job = job_.load(std::memory_order_acquire);
    const auto body = body_.load(std::memory_order_relaxed);
    void* const ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t n = nchunks_.load(std::memory_order_relaxed);
    const int64_t group = group_.load(std::memory_order_relaxed);
    const int segments = segments_.load(std::memory_order_relaxed);
    int64_t ran = 0;
    for (int k = 0; k < segments; ++k) {
      std::atomic<uint64_t>& claim = claims_[(self + k) % segments].word;
      uint64_t w = claim.load(std::memory_order_acquire);
      for (;;) {
        const int64_t next = static_cast<int64_t>((w >> 16) & 0xffff), end = static_cast<int64_t>(w & 0xffff);
        if ((w >> 32) != job || next >= end) break;
        // Success proves `job` is current and unfinished, so body, ctx, n and group (published before it) are its.
        if (!claim.compare_exchange_weak(w, w + (uint64_t{1} << 16), std::memory_order_acq_rel,
                                         std::memory_order_acquire))
          continue;
        try {
          for (int64_t c = next * group; c < std::min(n, (next + 1) * group); ++c) body(ctx, c);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!error_) error_ = std::current_exception();
        }
        ++ran;
        w = claim.load(std::memory_order_acquire);
      }
    }
    const int64_t units = (n + group - 1) / group;
    if (ran > 0 && done_.fetch_add(ran, std::memory_order_acq_rel) + ran == units) {
      {
        std::lock_guard<std::mutex> lock(mu_);
      }  // the caller is waiting, or has not checked done_ yet
      finished_.notify_one();
    }
  }

  struct alignas(64) Claim {
    std::atomic<uint64_t> word{0};
  };

  std::mutex busy_;  // held by the caller running a job
  int workers_ = 0;  // started workers, numbered 1..workers_ (only the job's caller changes it)
  Claim claims_[kMaxSegments];
  alignas(64) std::atomic<int64_t> done_{0};  // units run, added by each thread when it finds no more
  alignas(64) std::atomic<uint64_t> job_{0};
  std::atomic<detail::ChunkBody> body_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> nchunks_{0}, group_{1};
  std::atomic<int> segments_{1};
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
