#include <cuda_fp16.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

__global__ void silu_mul_kernel(const float* gate, const float* __restrict__ up, float* out,
                                int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  out[i] = g / (1.0f + expf(-g)) * up[i];
}

// cpu::gelu: GELU's tanh form on the F16 rounding of g, rounded to F16
// (CUDA's tanhf, not the C library's: within its rounding of the CPU's).
__global__ void gelu_mul_kernel(const float* gate, const float* __restrict__ up, float* out,
                                int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  float y;
  if (g <= -10.0f) {
    y = 0.0f;
  } else if (g >= 10.0f) {
    y = g;
  } else {
    const float f = __half2float(__float2half_rn(g));
    const float t =
        0.5f * f *
        (1.0f + tanhf(0.79788456080286535587989211986876f * f * (1.0f + 0.044715f * f * f)));
    y = __half2float(__float2half_rn(t));
  }
  out[i] = y * up[i];
}

}  // namespace

void gelu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  gelu_mul_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                    static_cast<cudaStream_t>(backend.stream())>>>(gate, up, out, n);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  silu_mul_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                    static_cast<cudaStream_t>(backend.stream())>>>(gate, up, out, n);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
