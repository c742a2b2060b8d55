#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

constexpr int kThreads = 256;

// One thread block per row: each square rounded to F32 and summed in F64, as
// the CPU does (per thread, then a tree of the partial sums: the same sum to
// F64 rounding); then the CPU's F32 arithmetic for the scale. out may alias x
// (each element is read, then written, by one thread), so x is not restrict.
__global__ void rms_norm_kernel(const float* x, const float* __restrict__ weight, float* out,
                                int64_t dim, float eps) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
  float* outr = out + static_cast<int64_t>(blockIdx.x) * dim;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += static_cast<double>(xr[i] * xr[i]);
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float mean = static_cast<float>(partial[0] / static_cast<double>(dim));
  const float scale = 1.0f / sqrtf(mean + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) outr[i] = xr[i] * scale * weight[i];
}

}  // namespace

void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps, CudaBackend& backend) {
  if (n_rows == 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(n_rows), kThreads, 0,
                    static_cast<cudaStream_t>(backend.stream())>>>(x, weight, out, dim, eps);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
