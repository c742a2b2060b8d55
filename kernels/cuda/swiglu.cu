#include <cuda_fp16.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

// SiLU (KernelTable::silu_mul's).
struct Silu {
  __device__ float operator()(float g) const { return g / (1.0f + expf(-g)); }
};

// cpu::gelu: GELU's tanh form on the F16 rounding of g, rounded to F16
// (CUDA's tanhf, not the C library's: within its rounding of the CPU's).
struct GeluF16 {
  __device__ float operator()(float g) const {
    if (g <= -10.0f) return 0.0f;
    if (g >= 10.0f) return g;
    const float f = __half2float(__float2half_rn(g));
    const float t =
        0.5f * f *
        (1.0f + tanhf(0.79788456080286535587989211986876f * f * (1.0f + 0.044715f * f * f)));
    return __half2float(__float2half_rn(t));
  }
};

// out[i] = act(gate[i]) * up[i]
template <typename Activation>
__global__ void gated_kernel(const float* gate, const float* __restrict__ up, float* out,
                             int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = Activation()(gate[i]) * up[i];
}

template <typename Activation>
void launch_gated(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  gated_kernel<Activation><<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                             static_cast<cudaStream_t>(backend.stream())>>>(gate, up, out, n);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gelu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  launch_gated<GeluF16>(gate, up, out, n, backend);
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend) {
  launch_gated<Silu>(gate, up, out, n, backend);
}

}  // namespace duet::cuda
