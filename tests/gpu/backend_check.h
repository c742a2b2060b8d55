// The main() of a GPU check whose cases run on one CudaBackend: skipped on a
// machine without a GPU, the device named, the cases run, the exit status
// reported (tests/gpu/gpu_check.h).
#pragma once

#include <cstdio>

#include "kernels/cuda/backend.h"
#include "tests/gpu/gpu_check.h"

namespace duet::gpu_check {

// Runs `cases` (which call run_case) on device 0 and returns main()'s status.
template <typename Cases>
int run_on_backend(Cases&& cases) {
  if (no_gpu()) return kSkipped;
  cuda::CudaBackend backend(0);
  std::printf("device: %s\n", backend.name().c_str());
  cases(backend);
  return finish();
}

}  // namespace duet::gpu_check
