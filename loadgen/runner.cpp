#include "loadgen/runner.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>

#include "common/error.h"

namespace duet::loadgen {
namespace {

// Records handed back by the client's thread. Thread-safe.
class Collector {
 public:
  explicit Collector(size_t n) : records_(n) {}

  void add(RequestRecord record) {
    {
      std::lock_guard lock(mutex_);
      const auto index = static_cast<size_t>(record.index);
      if (!record.ok) ++n_failed_;
      records_.at(index) = std::move(record);
      ++n_done_;
    }
    changed_.notify_one();
  }

  // Waits until `deadline` or until more than `n_seen` requests are done;
  // returns the number done.
  int64_t wait(int64_t n_seen, Clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    changed_.wait_until(lock, deadline, [&] { return n_done_ > n_seen; });
    return n_done_;
  }

  int64_t n_failed() {
    std::lock_guard lock(mutex_);
    return n_failed_;
  }

  std::vector<RequestRecord> take() {
    std::lock_guard lock(mutex_);
    return std::move(records_);
  }

 private:
  std::mutex mutex_;  // guards everything below
  std::condition_variable changed_;
  std::vector<RequestRecord> records_;
  int64_t n_done_ = 0;
  int64_t n_failed_ = 0;
};

// A one-line progress bar on stderr: redrawn in place on a terminal, a line
// every few seconds otherwise (logs). The run's thread only.
class Progress {
 public:
  Progress(bool enabled, std::string label, int64_t n)
      : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0), label_(std::move(label)), n_(n) {}

  // How long the runner may sleep before the next redraw.
  Clock::duration period() const {
    return tty_ ? std::chrono::milliseconds(250) : std::chrono::seconds(10);
  }

  void draw(double now, int64_t n_sent, int64_t n_done, int64_t n_failed, bool final = false) {
    if (!enabled_ || (!final && now < next_draw_)) return;
    next_draw_ = now + std::chrono::duration<double>(period()).count();
    constexpr int kWidth = 30;
    const int filled = n_ == 0 ? kWidth : static_cast<int>(kWidth * n_done / n_);
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    const std::string line = fmt::format("{}[{}] {}/{} done, {} failed, {} in flight, {:.1f} s",
                                         label_.empty() ? "" : label_ + " ", bar, n_done, n_,
                                         n_failed, n_sent - n_done, now);
    if (tty_) {
      std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), final ? "\n" : "");
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }

 private:
  const bool enabled_;
  const bool tty_;
  const std::string label_;
  const int64_t n_;
  double next_draw_ = 0;
};

}  // namespace

std::vector<RequestRecord> run(Client& client, const PromptSource& prompts, std::mt19937_64& rng,
                               const RunOptions& options) {
  const auto n = static_cast<int64_t>(options.requests.size());
  DUET_REQUIRE(!options.concurrency || *options.concurrency >= 1,
               "--concurrency must be at least 1, got {}", *options.concurrency);
  std::vector<ClientRequest> requests;
  requests.reserve(options.requests.size());
  for (const PlannedRequest& planned : options.requests) {
    // A trace that carries its prompts is sent as it is (shared prefixes included).
    requests.push_back(ClientRequest{
        planned.prompt_ids.empty() ? prompts.draw(planned.prompt_tokens, rng) : planned.prompt_ids,
        planned.output_tokens, options.stream});
  }

  Collector collector(options.requests.size());
  Progress progress(options.progress, options.label, n);
  const RunClock clock;  // the origin: now
  int64_t n_sent = 0, n_done = 0;
  const auto send_next = [&](double scheduled) {
    const PlannedRequest& planned = options.requests[static_cast<size_t>(n_sent)];
    RequestRecord record;
    record.index = n_sent;
    record.scheduled = scheduled;
    record.prompt_tokens = planned.prompt_tokens;
    record.output_tokens = planned.output_tokens;
    client.send(std::move(requests[static_cast<size_t>(n_sent)]), std::move(record), clock,
                [&collector](RequestRecord done) { collector.add(std::move(done)); });
    ++n_sent;
  };

  while (n_done < n) {
    // Send everything due now.
    Clock::time_point next_arrival = Clock::time_point::max();
    while (n_sent < n) {
      if (options.concurrency) {
        if (n_sent - n_done >= *options.concurrency) break;
        send_next(clock.now());
        continue;
      }
      const double at = options.requests[static_cast<size_t>(n_sent)].at;
      if (clock.now() < at) {
        next_arrival = clock.origin + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(at));
        break;
      }
      send_next(at);
    }
    progress.draw(clock.now(), n_sent, n_done, collector.n_failed());
    // Sleep until the next arrival, a completion or the next redraw.
    n_done = collector.wait(n_done, std::min(next_arrival, Clock::now() + progress.period()));
  }
  progress.draw(clock.now(), n_sent, n_done, collector.n_failed(), /*final=*/true);
  return collector.take();
}

}  // namespace duet::loadgen
