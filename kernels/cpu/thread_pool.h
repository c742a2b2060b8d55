// A fixed pool of compute threads for data-parallel kernels.
//
// parallel_for hands out task indices dynamically; the calling thread takes
// part and returns as soon as every task has run, without waiting for workers
// that were asleep and found nothing left (a busy machine must not make every
// kernel wait for a descheduled thread). Between jobs a worker spins briefly,
// so the next layer's kernel starts without a wake-up, then blocks on a futex:
// an idle pool uses no CPU. One caller at a time: the pool belongs to one
// compute thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace duet::cpu {

class ThreadPool final {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(task, thread) for every task in [0, n_tasks); returns when all ran.
  // `thread` is in [0, size()), unique among concurrently running calls.
  template <typename Fn>
  void parallel_for(int64_t n_tasks, Fn&& fn) {
    auto trampoline = [](void* context, int64_t task, int thread) {
      (*static_cast<std::remove_reference_t<Fn>*>(context))(task, thread);
    };
    run(n_tasks, trampoline, &fn);
  }

 private:
  using TaskFn = void (*)(void* context, int64_t task, int thread);

  // One parallel_for call; lives on the caller's stack while it runs.
  struct Job {
    TaskFn fn;
    void* context;
    int64_t n_tasks;
    std::atomic<int64_t> next_task{0};
    std::atomic<int64_t> n_done{0};
  };

  void run(int64_t n_tasks, TaskFn fn, void* context);
  void worker_main(int thread);
  static void drain(Job& job, int thread);

  const int n_threads_;
  std::vector<std::thread> workers_;
  std::atomic<Job*> job_{nullptr};       // the job being run, or null
  std::atomic<int> n_inside_{0};         // workers that may be touching *job_
  std::atomic<uint32_t> generation_{0};  // bumped per job, futex for sleepers
  std::atomic<bool> stop_{false};
};

}  // namespace duet::cpu
