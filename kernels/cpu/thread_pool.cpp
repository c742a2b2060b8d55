#include "kernels/cpu/thread_pool.h"

#include "common/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DUET_CPU_RELAX() _mm_pause()
#else
#define DUET_CPU_RELAX() std::this_thread::yield()
#endif

namespace duet::cpu {
namespace {
// About 50-100 microseconds of spinning before a worker sleeps.
constexpr int kSpinIterations = 20000;
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads) {
  DUET_REQUIRE(n_threads >= 1 && n_threads <= 1024, "thread count must be 1..1024, got {}",
               n_threads);
  workers_.reserve(n_threads - 1);
  for (int t = 1; t < n_threads; ++t) workers_.emplace_back([this, t] { worker_main(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::drain(int thread) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= n_tasks_) return;
    fn_(context_, task, thread);
  }
}

void ThreadPool::run(int64_t n_tasks, TaskFn fn, void* context) {
  if (n_tasks <= 0) return;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(context, task, 0);
    return;
  }
  fn_ = fn;
  context_ = context;
  n_tasks_ = n_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  n_busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  drain(0);
  while (n_busy_.load(std::memory_order_acquire) != 0) DUET_CPU_RELAX();
}

void ThreadPool::worker_main(int thread) {
  uint32_t seen = 0;
  for (;;) {
    int spins = 0;
    uint32_t now = generation_.load(std::memory_order_acquire);
    while (now == seen && spins < kSpinIterations) {
      DUET_CPU_RELAX();
      ++spins;
      now = generation_.load(std::memory_order_acquire);
    }
    while (now == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      now = generation_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load(std::memory_order_acquire)) return;
    drain(thread);
    n_busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace duet::cpu
