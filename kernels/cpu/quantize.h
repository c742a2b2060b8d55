// Scalar reference conversions between float rows and the stored types.
//
// These are the portable path and the ground truth the ISA paths are tested
// against. Activation quantizers (Q8_0, Q8_1) round half to even, as every
// ISA path does, so all paths quantize activations bit-identically.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace duet::cpu {

// x: (n) floats -> n / 32 blocks. n must be a multiple of 32.
void quantize_row_q8_0(const float* x, void* out, int64_t n);
void quantize_row_q8_1(const float* x, void* out, int64_t n);

// Weight quantizers (ggml's reference rounding), used to make test weights.
void quantize_row_q4_0(const float* x, void* out, int64_t n);
void quantize_row_q4_1(const float* x, void* out, int64_t n);

void convert_row_f16(const float* x, void* out, int64_t n);
void convert_row_bf16(const float* x, void* out, int64_t n);

// Any row of a supported stored type (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q8_1) to floats.
void dequantize_row(DType type, const void* row, float* out, int64_t n);

// Quantizes a row of any of those types (test helper).
void quantize_row(DType type, const float* x, void* out, int64_t n);

}  // namespace duet::cpu
