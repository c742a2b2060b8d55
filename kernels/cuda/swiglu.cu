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

}  // namespace

void silu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  silu_mul_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                    static_cast<cudaStream_t>(backend.stream())>>>(gate, up, out, n);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
