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
  stop_.store(true);
  generation_.fetch_add(1);
  generation_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::drain(Job& job, int thread) {
  for (;;) {
    const int64_t task = job.next_task.fetch_add(1, std::memory_order_relaxed);
    if (task >= job.n_tasks) return;
    job.fn(job.context, task, thread);
    job.n_done.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(int64_t n_tasks, TaskFn fn, void* context) {
  if (n_tasks <= 0) return;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(context, task, 0);
    return;
  }
  Job job{fn, context, n_tasks};
  job_.store(&job);
  generation_.fetch_add(1);
  generation_.notify_all();
  drain(job, 0);
  while (job.n_done.load(std::memory_order_acquire) != n_tasks) DUET_CPU_RELAX();
  // No worker may enter `job` from here on; wait out those already inside.
  job_.store(nullptr);
  while (n_inside_.load() != 0) DUET_CPU_RELAX();
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
      generation_.wait(seen);
      now = generation_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load()) return;
    // Announce before looking, so the caller cannot retire the job between
    // our load of job_ and our use of it (both sequentially consistent).
    n_inside_.fetch_add(1);
    if (Job* job = job_.load()) drain(*job, thread);
    n_inside_.fetch_sub(1);
  }
}

}  // namespace duet::cpu
