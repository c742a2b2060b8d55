#include "common/error.h"

namespace duet {

std::string_view error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kNotFound:
      return "not found";
    case ErrorKind::kCorruptFile:
      return "corrupt file";
    case ErrorKind::kUnsupported:
      return "unsupported";
    case ErrorKind::kInternal:
      return "internal error";
  }
  return "unknown error";
}

void throw_assert_failure(const char* condition, const char* file, int line,
                          const std::string& detail) {
  std::string message = duet::format("internal error: {} failed at {}:{}", condition, file, line);
  if (!detail.empty()) message += ": " + detail;
  throw Error(ErrorKind::kInternal, message);
}

}  // namespace duet
