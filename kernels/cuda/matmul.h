// GPU twin of cpu::matmul: y (n_x, n_out) = x (n_x, k) . W^T, y row i at
// y + i * ldy, all device pointers.
//
// Small batches (n_x <= kGemvMaxRows, decode) run a fused dequantize-GEMV:
// one warp per output row streams the weight once with 16-byte loads, several
// blocks in flight per lane, for all n_x activation rows at once. Larger
// batches (prefill, big decode batches) dequantize a quantized weight tile by
// tile into F16 scratch small enough to stay in L2 (an F16 weight is used as
// stored) and multiply with cuBLAS (F16 inputs, F32 accumulation, tensor
// cores). Activations stay F32 in the GEMV and are rounded to F16 for cuBLAS;
// the CPU rounds them to 8-bit blocks, so the two agree to that rounding, not
// bit for bit.
#pragma once

#include <cstdint>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/weights.h"

namespace duet::cuda {

inline constexpr int64_t kGemvMaxRows = 8;

void matmul(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
            CudaBackend& backend);

// The two paths by name, for the checks and the benchmark.
void matmul_gemv(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
                 CudaBackend& backend);
void matmul_gemm(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
                 CudaBackend& backend);

// Scratch bytes enough for matmul_gemm of n_x rows by any weight of at most
// k columns and n_out rows, whatever its type (the larger batches' F16
// activations and dequantized tile). A caller that reserves this up front
// (CudaBackend::reserve_scratch) keeps the scratch from moving during a step.
size_t gemm_scratch_bound(int64_t k, int64_t n_out, int64_t n_x);

// Dequantizes rows [row0, row0 + n_rows) of w into out (n_rows, k) F16
// (IEEE half bits), device memory, 16-byte aligned.
void dequantize_f16(const DeviceWeight& w, int64_t row0, int64_t n_rows, uint16_t* out,
                    CudaBackend& backend);

}  // namespace duet::cuda
