// Weight matrices on the GPU, laid out for coalesced 16-byte loads.
//
// GGUF interleaves each quantization block's scale with its quants (20 bytes
// for Q4_1, 18 for Q4_0, 34 for Q8_0), which no 16-byte load can align with.
// Upload splits them: the quants of every row, block after block (16 bytes a
// Q4 block, 32 a Q8_0 block), then the F16 scales (and Q4_1's mins) of every
// block, in the same order. F16 stays as stored. Every other type (F32, BF16,
// the K-quants) is converted to F16 on upload, so any model the CPU loads
// runs on the GPU, at F16's size for those tensors.
#pragma once

#include <cstdint>

#include "common/model/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/backend.h"

namespace duet::cuda {

// n_out rows of k elements on the device; k is a multiple of 32.
struct DeviceWeight {
  DType type = DType::kF16;  // kQ4_0, kQ4_1, kQ8_0 or kF16
  int64_t k = 0;
  int64_t n_out = 0;
  const uint8_t* quants = nullptr;  // quantized: (n_out * k / 32) blocks of quants; F16: the values
  const uint16_t* scales = nullptr;  // (n_out * k / 32) F16 scales (d); quantized types only
  const uint16_t* mins = nullptr;    // (n_out * k / 32) F16 mins (m); Q4_1 only
  DeviceBuffer storage;              // owns all of the above

  size_t bytes() const { return storage.bytes(); }
};

// Copies (and repacks) a host weight to the device; waits for the copy.
// Throws kUnsupported for k not a multiple of 32.
DeviceWeight upload_weight(const cpu::WeightMatrix& weight, CudaBackend& backend);

// A float vector (norm weights, biases) on the device.
DeviceBuffer upload_floats(const float* values, int64_t n, CudaBackend& backend);

}  // namespace duet::cuda
