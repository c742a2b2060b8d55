// Helpers shared by the fuzz targets: a check that aborts (so that libFuzzer reports the input),
// "this call must throw duet::Error of this kind", and a sink that keeps reads alive.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "common/error.h"

// A broken property: print where and why, then abort so that libFuzzer saves the input.
#define DUET_FUZZ_CHECK(cond, ...)                                                       \
  do {                                                                                   \
    if (!(cond)) [[unlikely]] {                                                          \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "  " __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                        \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

namespace duet::fuzz {

// The input is bad, not our code: any duet::Error but an internal one (a failed DUET_ASSERT,
// which is a bug of ours and must reach the fuzzer).
inline void require_not_internal(const Error& error) {
  DUET_FUZZ_CHECK(error.kind() != ErrorKind::kInternal, "internal error: %s", error.what());
}

// Runs `fn`, which must throw duet::Error of `kind`; anything else aborts (another exception type
// escapes to libFuzzer, which reports it as a crash).
template <typename Fn>
void expect_error(ErrorKind kind, const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const Error& error) {
    DUET_FUZZ_CHECK(error.kind() == kind, "%s: threw '%s' (%s), expected %s", what, error.what(),
                    error_kind_name(error.kind()).data(), error_kind_name(kind).data());
    return;
  }
  DUET_FUZZ_CHECK(false, "%s: returned, expected duet::Error (%s)", what,
                  error_kind_name(kind).data());
}

// Keeps `value` (and so the loads that made it) from being optimized away.
template <typename T>
inline void keep(const T& value) {
  asm volatile("" : : "r,m"(value) : "memory");
}

}  // namespace duet::fuzz
