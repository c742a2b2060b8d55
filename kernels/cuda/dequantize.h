// GPU twin of cpu::dequantize_row for the weight types F32, F16, Q8_0, Q4_0
// and Q4_1 (BF16 and the K-quants: not yet on the GPU): converts n_rows rows
// of k stored elements to floats on device 0.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace duet::cuda {

// host_rows: n_rows * dtype_row_bytes(type, k) bytes; host_out: n_rows * k
// floats. Copies in, runs one kernel, copies out. Throws duet::Error
// (kUnsupported) without a device or for another type.
void dequantize_rows(DType type, const void* host_rows, int64_t n_rows, int64_t k, float* host_out);

}  // namespace duet::cuda
