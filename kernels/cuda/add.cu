#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

// x[i] += y[i % period]: a plain add when period == n, a bias per row otherwise.
__global__ void add_kernel(float* x, const float* __restrict__ y, int64_t n, int64_t period) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i % period];
}

void launch_add(float* x, const float* y, int64_t n, int64_t period, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  add_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
               static_cast<cudaStream_t>(backend.stream())>>>(x, y, n, period);
  DUET_CUDA_CHECK(cudaGetLastError());
}

__global__ void scale_kernel(float* x, int64_t n, float factor) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= factor;
}

}  // namespace

void scale(float* x, int64_t n, float factor, CudaBackend& backend) {
  if (n == 0) return;
  const int threads = 256;
  scale_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                 static_cast<cudaStream_t>(backend.stream())>>>(x, n, factor);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void add_in_place(float* x, const float* y, int64_t n, CudaBackend& backend) {
  launch_add(x, y, n, n, backend);
}

void add_bias(float* x, const float* bias, int64_t n_rows, int64_t dim, CudaBackend& backend) {
  launch_add(x, bias, n_rows * dim, dim, backend);
}

}  // namespace duet::cuda
