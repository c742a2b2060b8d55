#include <cmath>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

// One thread per (row, head, rotated pair). theta_i = pos * base^(-2i/n_rot)
// is built by repeated multiplication, as the CPU twin (and ggml) does, so
// the angles round alike.
__global__ void rope_kernel(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim,
                            const int32_t* __restrict__ positions, RopeStyle style, int64_t n_rot,
                            float theta_scale, float freq_scale,
                            const float* __restrict__ freq_factors) {
  const int64_t half = n_rot / 2;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_rows * n_heads * half) return;
  const int64_t i = t % half;
  const int64_t head = t / half;  // row * n_heads + h
  const int64_t row = head / n_heads;
  float theta = static_cast<float>(positions[row]);
  for (int64_t j = 0; j < i; ++j) theta *= theta_scale;
  const float factor = freq_factors != nullptr ? freq_factors[i] : 1.0f;
  const float angle = freq_scale * (theta / factor);
  float sin_angle, cos_angle;
  sincosf(angle, &sin_angle, &cos_angle);
  float* v = x + head * head_dim;
  const int64_t a = style == RopeStyle::kAdjacentPairs ? 2 * i : i;
  const int64_t b = style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
  const float x0 = v[a], x1 = v[b];
  v[a] = fmaf(x0, cos_angle, -(x1 * sin_angle));
  v[b] = fmaf(x0, sin_angle, x1 * cos_angle);
}

}  // namespace

void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params, CudaBackend& backend) {
  DUET_ASSERT(params.n_rot <= head_dim && params.n_rot % 2 == 0, "n_rot {} head_dim {}",
              params.n_rot, head_dim);
  const int64_t n = n_rows * n_heads * (params.n_rot / 2);
  if (n == 0) return;
  const float theta_scale = std::pow(params.freq_base, -2.0f / static_cast<float>(params.n_rot));
  const int threads = 256;
  rope_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                static_cast<cudaStream_t>(backend.stream())>>>(
      x, n_rows, n_heads, head_dim, positions, params.style, params.n_rot, theta_scale,
      params.freq_scale, params.freq_factors);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
