// duet-cuda-bench's rig (bench/cuda_bench.cpp runs it): how many repetitions
// each measurement takes, the JSON the figures go to, and the timing of GPU
// work from the host.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/stats.h"
#include "kernels/cuda/backend.h"

namespace duet::cuda_bench {

// The two rooflines the model's figures are set against.
struct Rooflines {
  double copy_gbps = 0;    // device copy, read + write
  double gemm_tflops = 0;  // cuBLAS F16 GEMM
};

inline constexpr double kGiga = 1e9;
inline constexpr double kTera = 1e12;

// Warm-up runs and timed repetitions of one measurement.
struct Reps {
  int warmup = 0;
  int timed = 0;
};

struct Plan {
  Reps copy, gemm, gemv, prefill, model_prefill;
  int64_t prefill_rows = 0;  // synthetic prefill batch
};

inline Plan make_plan(bool quick) {
  if (quick) return {{2, 5}, {2, 5}, {2, 10}, {1, 3}, {1, 3}, 1024};
  return {{3, 20}, {3, 20}, {3, 30}, {2, 10}, {2, 10}, 2048};
}

// ---------------------------------------------------------------------------
// JSON, written by hand: nested objects and arrays of numbers and strings.

class JsonWriter {
 public:
  // An object or array (bracket '{' or '['); key empty inside arrays.
  void open(std::string_view key, char bracket) {
    raw(key, std::string(1, bracket));
    first_.push_back(true);
  }
  void close(char bracket) {
    first_.pop_back();
    out_ += '\n' + std::string(2 * first_.size(), ' ') + bracket;
    if (first_.empty()) out_ += '\n';
  }
  void number(std::string_view key, double v) {
    char text[64];
    std::snprintf(text, sizeof text, "%.9g", v);
    raw(key, std::isfinite(v) ? text : "null");
  }
  void integer(std::string_view key, int64_t v) { raw(key, std::to_string(v)); }
  void boolean(std::string_view key, bool v) { raw(key, v ? "true" : "false"); }
  void string(std::string_view key, std::string_view v) { raw(key, quoted(v)); }
  const std::string& text() const { return out_; }

 private:
  // The separator, indentation and key, then the value's text.
  void raw(std::string_view key, std::string_view value) {
    if (!first_.empty()) {
      out_ += first_.back() ? "\n" : ",\n";
      first_.back() = false;
      out_.append(2 * first_.size(), ' ');
    }
    if (!key.empty()) out_ += quoted(key) + ": ";
    out_ += value;
  }
  static std::string quoted(std::string_view s) {
    std::string q = "\"";
    for (const char c : s) {
      if (c == '"' || c == '\\') q += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        char escape[8];
        std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
        q += escape;
      } else {
        q += c;
      }
    }
    return q + '"';
  }

  std::string out_;
  std::vector<bool> first_;  // per open level: no value written yet
};

// ---------------------------------------------------------------------------
// Timing

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// Median seconds of `body` (which queues GPU work) over reps.timed runs after
// reps.warmup ones, each bracketed by synchronize().
template <typename Body>
double time_median(cuda::CudaBackend& backend, Reps reps, Body&& body) {
  for (int i = 0; i < reps.warmup; ++i) body();
  backend.synchronize();
  std::vector<double> seconds;
  for (int i = 0; i < reps.timed; ++i) {
    const Clock::time_point t0 = Clock::now();
    body();
    backend.synchronize();
    seconds.push_back(seconds_between(t0, Clock::now()));
  }
  return median(std::move(seconds));
}

}  // namespace duet::cuda_bench
