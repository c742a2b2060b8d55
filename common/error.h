// Typed errors for Duet.
//
// DUET_REQUIRE checks the caller's input and throws duet::Error with a clear
// message; DUET_ASSERT checks our own invariants and throws an internal error
// that names the file and line. Both are exceptions so that a server can turn
// them into typed replies at its boundary and keep serving.
//
// Messages are made by duet::format (common/format.h): "{}" placeholders only,
// no format specs, so that this header needs nothing but the standard library.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "common/format.h"

namespace duet {

enum class ErrorKind {
  kInvalidArgument,  // the caller asked for something malformed or impossible
  kNotFound,         // a file, tensor or key that should exist does not
  kCorruptFile,      // a file's bytes contradict its own format
  kUnsupported,      // well-formed, but a feature Duet does not implement
  kInternal,         // a broken invariant of ours
};

std::string_view error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

inline std::string assert_detail() { return {}; }
template <typename... Args>
std::string assert_detail(std::string_view pattern, const Args&... args) {
  return ::duet::format(pattern, args...);
}

[[noreturn]] void throw_assert_failure(const char* condition, const char* file, int line,
                                       const std::string& detail);

}  // namespace duet

// The caller's fault: `DUET_REQUIRE(n > 0, "n must be positive, got {}", n)`.
#define DUET_REQUIRE(cond, ...)                                                              \
  do {                                                                                       \
    if (!(cond)) [[unlikely]]                                                                \
      throw ::duet::Error(::duet::ErrorKind::kInvalidArgument, ::duet::format(__VA_ARGS__)); \
  } while (0)

// Our fault: `DUET_ASSERT(i < size)` or `DUET_ASSERT(i < size, "i={}", i)`.
#define DUET_ASSERT(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) [[unlikely]]                                                                      \
      ::duet::throw_assert_failure(#cond, __FILE__, __LINE__, ::duet::assert_detail(__VA_ARGS__)); \
  } while (0)
