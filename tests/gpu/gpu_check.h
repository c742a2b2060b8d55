// A minimal test harness for the GPU checks, which build where only CUDA is
// installed (no GoogleTest): named cases, checks that report and count
// failures, and the normalized error every twin comparison uses.
//
// A check binary exits 0 when every check passed, 1 when one failed, and
// kSkipped (ctest's SKIP_RETURN_CODE) on a machine without a GPU, saying so.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"

namespace duet::gpu_check {

inline constexpr int kSkipped = 77;

struct State {
  int failures = 0;
  std::string current;
};
inline State& state() {
  static State s;
  return s;
}

// True, having said so, on a machine without a CUDA device: main then
// returns kSkipped.
inline bool no_gpu() {
  if (!cuda::list_devices().empty()) return false;
  std::printf("no CUDA device: skipped\n");
  return true;
}

// Records a failure of the running case with a printf-style message.
template <typename... Args>
void fail(const char* format, Args... args) {
  ++state().failures;
  std::fprintf(stderr, "  FAILED in %s: ", state().current.c_str());
  if constexpr (sizeof...(Args) == 0) {
    std::fputs(format, stderr);
  } else {
    std::fprintf(stderr, format, args...);
  }
  std::fputc('\n', stderr);
}

// ||a - b|| / ||b|| over all elements (0 when both are zero).
inline double normalized_error(std::span<const float> a, std::span<const float> b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// Checks that `got` is within `tolerance` normalized error of `want` and
// prints the figure either way.
inline bool expect_close(const char* what, std::span<const float> got, std::span<const float> want,
                         double tolerance) {
  const double error = normalized_error(got, want);
  const bool ok = error <= tolerance;
  std::printf("    %-44s normalized error %.3g (tolerance %.1g)%s\n", what, error, tolerance,
              ok ? "" : "  <-- FAILED");
  if (!ok) fail("%s: normalized error %.3g > %.3g", what, error, tolerance);
  return ok;
}

// Runs one named case; an exception fails it.
inline void run_case(const char* name, const std::function<void()>& body) {
  state().current = name;
  std::printf("[ case ] %s\n", name);
  const int before = state().failures;
  try {
    body();
  } catch (const std::exception& e) {
    fail("exception: %s", e.what());
  }
  std::printf("[ %s ] %s\n", state().failures == before ? "  ok" : "FAIL", name);
}

// The exit status of a check binary.
inline int finish() {
  if (state().failures == 0) {
    std::printf("all checks passed\n");
    return 0;
  }
  std::printf("%d check(s) failed\n", state().failures);
  return 1;
}

}  // namespace duet::gpu_check

#define GPU_EXPECT(cond)                                                          \
  do {                                                                            \
    if (!(cond)) ::duet::gpu_check::fail("%s:%d: %s", __FILE__, __LINE__, #cond); \
  } while (0)
