// The coordinator's metrics, rendered in the Prometheus text format.
//
// Counters and histograms are updated by the service as requests finish or
// are refused; gauges (running and waiting sequences, KV usage, prefix-cache
// hit rate) come from a stats snapshot at render time. Output tokens per
// second is a gauge over the last few seconds besides the token counter, so a
// dashboard without rate() still shows it. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/serving.h"

namespace duet {

struct RequestTimings;
struct ServiceStats;
enum class ServeFinish;

// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  const std::vector<double>& upper_bounds() const { return bounds_; }
  const std::vector<int64_t>& counts() const { return counts_; }  // per bucket, not cumulative
  int64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // bounds_.size() + 1 (the last is +Inf)
  int64_t count_ = 0;
  double sum_ = 0;
};

class Metrics final {
 public:
  using Clock = std::chrono::steady_clock;

  Metrics();
  void record_finished(ServeFinish finish, const RequestTimings& timings);
  void record_refused(ServeErrorKind kind);
  void record_tokens(int64_t n_tokens, Clock::time_point now);
  // A front ("http", "rpc") refused a connection: it had max_connections open.
  void record_connection_refused(std::string_view front);

  // Prometheus text exposition (version 0.0.4) of the counters, histograms
  // and the gauges of `stats`.
  std::string render(const ServiceStats& stats, Clock::time_point now) const;

  int64_t requests_with_outcome(std::string_view outcome) const;

  // The TTFT (requests with a token) and TPOT (with two) of the requests that
  // finished well (stop or length) at `since` or later, within the last
  // minute: the rebalancer's signals (coordinator/rebalancer.h).
  struct RecentLatency {
    std::vector<double> ttft_s;
    std::vector<double> tpot_s;
  };
  RecentLatency recent_latency(Clock::time_point since) const;
  // The rebalancer moved an instance to `role` ("prefill", "decode").
  void record_rebalance(std::string_view role);
  // The live instances the rebalancer finds the load wants; rendered once set.
  void set_instances_wanted(int64_t n);

 private:
  double tokens_per_second(Clock::time_point now) const;  // mutex_ held

  mutable std::mutex mutex_;
  std::map<std::string, int64_t, std::less<>>
      outcomes_;  // "stop", "length", "refused_overloaded", ...
  Histogram queue_;
  Histogram ttft_;
  Histogram tpot_;
  Histogram e2e_;
  int64_t prompt_tokens_ = 0;
  int64_t completion_tokens_ = 0;
  int64_t cached_tokens_ = 0;
  int64_t generated_tokens_ = 0;
  std::map<std::string, int64_t, std::less<>> connections_refused_;  // by front
  std::deque<std::pair<Clock::time_point, int64_t>> recent_tokens_;  // the last window's steps
  Clock::time_point first_tokens_{};  // of the first record_tokens (the rate's window starts there)
  struct Finished {
    Clock::time_point at;
    double ttft_s = -1, tpot_s = -1;  // -1: not measured
  };
  std::deque<Finished> recent_finished_;  // the last minute's, at most kRecentFinished
  std::map<std::string, int64_t, std::less<>> rebalances_;  // by the role given
  int64_t instances_wanted_ = 0;                            // 0: not set
};

}  // namespace duet
