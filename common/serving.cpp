#include "common/serving.h"

namespace duet {

std::string_view serve_error_kind_name(ServeErrorKind kind) {
  switch (kind) {
    case ServeErrorKind::kInvalidArgument:
      return "invalid_argument";
    case ServeErrorKind::kTooLong:
      return "too_long";
    case ServeErrorKind::kNotFound:
      return "not_found";
    case ServeErrorKind::kUnauthenticated:
      return "unauthenticated";
    case ServeErrorKind::kOverloaded:
      return "overloaded";
    case ServeErrorKind::kUnavailable:
      return "unavailable";
    case ServeErrorKind::kInternal:
      return "internal";
  }
  return "internal";
}

}  // namespace duet
