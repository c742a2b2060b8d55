#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

// One thread per output element; consecutive threads read consecutive
// columns of one slice row.
__global__ void assemble_kernel(const float* __restrict__ slices, int64_t n_rows, int64_t stride,
                                int64_t n_cols, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_rows * n_cols) return;
  const int64_t row = i / n_cols, col = i % n_cols;
  const int64_t slice = col / stride, within = col % stride;
  out[i] = slices[(slice * n_rows + row) * stride + within];
}

// One thread per output element; a linear search over at most kMaxParts parts.
__global__ void assemble_parts_kernel(const float* __restrict__ slices, int64_t slot,
                                      ColumnParts parts, int64_t n_rows, float* __restrict__ out) {
  const int64_t n_cols = parts.begin[parts.n_parts];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_rows * n_cols) return;
  const int64_t row = i / n_cols, col = i % n_cols;
  int p = 0;
  while (col >= parts.begin[p + 1]) ++p;
  const int64_t width = parts.begin[p + 1] - parts.begin[p];
  out[i] = slices[p * slot + row * width + (col - parts.begin[p])];
}

}  // namespace

void assemble_parts(const float* slices, int64_t slot, const ColumnParts& parts, int64_t n_rows,
                    float* out, CudaBackend& backend) {
  DUET_ASSERT(parts.n_parts >= 1 && parts.n_parts <= kMaxParts, "{} column parts", parts.n_parts);
  const int64_t n = n_rows * parts.begin[parts.n_parts];
  if (n == 0) return;
  const int threads = 256;
  assemble_parts_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                          static_cast<cudaStream_t>(backend.stream())>>>(slices, slot, parts,
                                                                         n_rows, out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void assemble_slices(const float* slices, int64_t n_slices, int64_t n_rows, int64_t stride,
                     int64_t n_cols, float* out, CudaBackend& backend) {
  DUET_ASSERT(n_cols <= n_slices * stride, "{} columns from {} slices of {}", n_cols, n_slices,
              stride);
  const int64_t n = n_rows * n_cols;
  if (n == 0) return;
  const int threads = 256;
  assemble_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                    static_cast<cudaStream_t>(backend.stream())>>>(slices, n_rows, stride, n_cols,
                                                                   out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
