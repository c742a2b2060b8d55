// Scalar reference conversions between float rows and the stored types.
//
// These are the portable path and the ground truth the ISA paths are tested
// against. Activation quantizers (Q8_0, Q8_1, Q8_K) round half to even, as
// every ISA path does, so all paths quantize activations bit-identically.
// Dequantization follows ggml's dequantize_row_* expression by expression, so
// it gives ggml's floats bit for bit.
#pragma once

#include <cstdint>

#include "common/model/dtype.h"

namespace duet::cpu {

// x: (n) floats -> n / 32 blocks. n must be a multiple of 32.
void quantize_row_q8_0(const float* x, void* out, int64_t n);
void quantize_row_q8_1(const float* x, void* out, int64_t n);
// x: (n) floats -> n / 256 Q8_K blocks (llama.cpp's quantize_row_q8_K_ref).
void quantize_row_q8_k(const float* x, void* out, int64_t n);

// Weight quantizers (ggml's reference rounding), used to make test weights.
void quantize_row_q4_0(const float* x, void* out, int64_t n);
void quantize_row_q4_1(const float* x, void* out, int64_t n);
// Simple K-quant weight quantizers for tests (n a multiple of 256): valid
// blocks that dequantize close to x, not ggml's error-minimizing search.
void quantize_row_q4_k(const float* x, void* out, int64_t n);
void quantize_row_q5_k(const float* x, void* out, int64_t n);
void quantize_row_q6_k(const float* x, void* out, int64_t n);

void convert_row_f16(const float* x, void* out, int64_t n);
void convert_row_bf16(const float* x, void* out, int64_t n);

// Any row of a supported stored type (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0,
// Q8_1, Q4_K, Q5_K, Q6_K, Q8_K) to floats.
void dequantize_row(DType type, const void* row, float* out, int64_t n);

// Quantizes a row of any of those types (test helper).
void quantize_row(DType type, const float* x, void* out, int64_t n);

}  // namespace duet::cpu
