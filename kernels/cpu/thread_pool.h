// A fixed pool of compute threads for data-parallel kernels.
//
// parallel_for hands out task indices dynamically; the calling thread takes
// part. Between jobs a worker spins briefly (so the next layer's kernel starts
// without a wake-up) and then blocks on a futex, so an idle pool uses no CPU.
// One caller at a time: the pool belongs to one compute thread.
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
      (*static_cast<Fn*>(context))(task, thread);
    };
    run(n_tasks, trampoline, &fn);
  }

 private:
  using TaskFn = void (*)(void* context, int64_t task, int thread);

  void run(int64_t n_tasks, TaskFn fn, void* context);
  void worker_main(int thread);
  void drain(int thread);

  const int n_threads_;
  std::vector<std::thread> workers_;
  // Job state: written by the caller before bumping generation_.
  TaskFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> n_busy_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace duet::cpu
