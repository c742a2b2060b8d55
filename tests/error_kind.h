// The ErrorKind a call throws, for tests that expect a duet::Error.
#pragma once

#include <gtest/gtest.h>

#include "common/error.h"

namespace duet::testing {

// Runs f and returns the kind of the duet::Error it throws; a call that throws
// none fails the test (and reads as kInternal).
template <typename F>
ErrorKind error_kind_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "no duet::Error thrown";
  return ErrorKind::kInternal;
}

}  // namespace duet::testing
