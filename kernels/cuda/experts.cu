#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxExpertWords = 16;  // 512 experts' taken flags

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// One thread per row: the softmax (expf, summed in double), the n_used largest in decreasing
// order (ties: the lower index) and their probabilities over their clamped sum.
__global__ void route_kernel(const float* __restrict__ logits, int64_t n_rows, int64_t n_experts,
                             int64_t n_used, int32_t* picked, float* weights) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n_rows) return;
  const float* x = logits + r * n_experts;
  float max = -INFINITY;
  for (int64_t i = 0; i < n_experts; ++i) max = fmaxf(max, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n_experts; ++i) sum += static_cast<double>(expf(x[i] - max));
  const float inv = static_cast<float>(1.0 / sum);
  unsigned taken[kMaxExpertWords] = {};
  double picked_sum = 0.0;
  for (int64_t j = 0; j < n_used; ++j) {
    int64_t best = -1;
    float best_p = 0.0f;
    for (int64_t i = 0; i < n_experts; ++i) {
      if (taken[i / 32] & (1u << (i % 32))) continue;
      const float p = expf(x[i] - max) * inv;
      if (best < 0 || p > best_p) {
        best = i;
        best_p = p;
      }
    }
    taken[best / 32] |= 1u << (best % 32);
    picked[r * n_used + j] = static_cast<int32_t>(best);
    weights[r * n_used + j] = best_p;
    picked_sum += static_cast<double>(best_p);
  }
  const float divisor = fmaxf(static_cast<float>(picked_sum), 6.103515625e-5f);
  for (int64_t j = 0; j < n_used; ++j) weights[r * n_used + j] /= divisor;
}

__global__ void gather_kernel(const float* __restrict__ x, int64_t width,
                              const int32_t* __restrict__ rows, int64_t n, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n * width) out[i] = x[rows[i / width] * width + i % width];
}

__global__ void scatter_kernel(const float* __restrict__ y, int64_t width,
                               const int32_t* __restrict__ slots, int64_t n,
                               const float* __restrict__ weights, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * width) return;
  const int32_t slot = slots[i / width];
  out[slot * width + i % width] = y[i] * weights[slot];
}

__global__ void sum_picks_kernel(const float* __restrict__ picks, int64_t n_rows, int64_t n_used,
                                 int64_t width, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_rows * width) return;
  const float* row = picks + (i / width) * n_used * width + i % width;
  float sum = row[0];
  for (int64_t j = 1; j < n_used; ++j) sum += row[j * width];
  out[i] = sum;
}

}  // namespace

void route_experts(const float* logits, int64_t n_rows, const RouterShape& shape, int32_t* picked,
                   float* weights, CudaBackend& backend) {
  DUET_ASSERT(shape.n_experts <= 32 * kMaxExpertWords && shape.n_used <= shape.n_experts,
              "{} of {} experts", shape.n_used, shape.n_experts);
  if (n_rows == 0) return;
  route_kernel<<<blocks_for(n_rows), kThreads, 0, static_cast<cudaStream_t>(backend.stream())>>>(
      logits, n_rows, shape.n_experts, shape.n_used, picked, weights);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n, float* out,
                 CudaBackend& backend) {
  if (n == 0) return;
  gather_kernel<<<blocks_for(n * width), kThreads, 0,
                  static_cast<cudaStream_t>(backend.stream())>>>(x, width, rows, n, out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void scatter_weighted(const float* y, int64_t width, const int32_t* slots, int64_t n,
                      const float* weights, float* out, CudaBackend& backend) {
  if (n == 0) return;
  scatter_kernel<<<blocks_for(n * width), kThreads, 0,
                   static_cast<cudaStream_t>(backend.stream())>>>(y, width, slots, n, weights, out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out,
               CudaBackend& backend) {
  if (n_rows == 0) return;
  sum_picks_kernel<<<blocks_for(n_rows * width), kThreads, 0,
                     static_cast<cudaStream_t>(backend.stream())>>>(picks, n_rows, n_used, width,
                                                                    out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void zero(float* x, int64_t n, CudaBackend& backend) {
  DUET_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(float),
                                  static_cast<cudaStream_t>(backend.stream())));
}

}  // namespace duet::cuda
