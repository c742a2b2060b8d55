// What duet-bench and duet-sim read from their command lines alike, and the
// plot both write: rates, SLOs, the open-loop plan of a run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace duet::loadgen {

// `text` split at `separator`, empty parts dropped.
std::vector<std::string> split(const std::string& text, char separator);
// The whole of `text` as a number; throws duet::Error naming `what`.
double parse_number(const std::string& text, const char* what);
// "4", "1,2,4", "inf" (all at once). Throws duet::Error.
std::vector<double> parse_rates(const std::string& text);
// "ttft=500,tpot=50" (milliseconds; either may be left out). Throws duet::Error.
Slo parse_slo(const std::string& text);
std::string format_rate(double rate);  // "rate 4 req/s", "rate inf"

// What a run sends, before arrival times: a trace's first n_requests rows, or
// n_requests of synthetic lengths (LengthSpec texts) drawn from `seed`.
struct WorkloadOptions {
  std::string trace;  // empty: synthetic
  int64_t n_requests = 100;
  std::string input_len = "128";
  std::string output_len = "128";
  uint64_t seed = 0;
};
// Throws duet::Error for an empty trace or a malformed length.
std::vector<PlannedRequest> make_workload(const WorkloadOptions& options);

// How an open-loop run's arrivals are made.
struct ArrivalOptions {
  bool from_trace = false;  // the workload's times are a trace's
  double time_scale = 1;    // a trace replayed at its own times, this much faster
  double burstiness = 1;    // synthetic arrivals: gamma shape (1: Poisson)
  uint64_t seed = 0;
};

// The requests of one open-loop run at `rate` (nullopt: the trace's own
// times, scaled by time_scale). A trace is stretched so that its mean rate
// is `rate`; synthetic lengths get arrivals at `rate` from one seed, the
// same pattern for every rate.
std::vector<PlannedRequest> open_loop_plan(const std::vector<PlannedRequest>& workload,
                                           std::optional<double> rate,
                                           const ArrivalOptions& options);

// Runs `script` (bench/plot_bench.py, or $DUET_BENCH_PLOT_SCRIPT) on a JSON
// report to write `png_path`; `tool` prefixes the messages. A missing
// matplotlib is a message, not a failure.
void plot(const std::string& tool, const std::string& script, const std::string& json_path,
          const std::string& png_path);

}  // namespace duet::loadgen
