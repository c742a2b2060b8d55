#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "common/model/fp16.h"

namespace duet::cpu {

void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* outr = out + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(xr[i] * xr[i]);
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * scale * weight[i];
  }
}

void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params) {
  const int64_t half = params.n_rot / 2;
  DUET_ASSERT(half <= 512 && params.n_rot <= head_dim, "n_rot {} head_dim {}", params.n_rot,
              head_dim);
  const float theta_scale = std::pow(params.freq_base, -2.0f / static_cast<float>(params.n_rot));
  float cos_table[512];
  float sin_table[512];
  for (int64_t r = 0; r < n_rows; ++r) {
    // theta_i = pos * base^(-2i / n_rot), built by repeated multiplication as ggml does.
    float theta = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float factor = params.freq_factors != nullptr ? params.freq_factors[i] : 1.0f;
      const float angle = params.freq_scale * (theta / factor);
      cos_table[i] = std::cos(angle);
      sin_table[i] = std::sin(angle);
      theta *= theta_scale;
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (r * n_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = params.style == RopeStyle::kAdjacentPairs ? 2 * i : i;
        const int64_t b = params.style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
        const float x0 = v[a], x1 = v[b];
        // The fused forms are the ones llama.cpp's compiler emits for
        // x0*cos - x1*sin and x0*sin + x1*cos; matching them keeps the two
        // engines bit-identical here.
        v[a] = std::fma(x0, cos_table[i], -(x1 * sin_table[i]));
        v[b] = std::fma(x0, sin_table[i], x1 * cos_table[i]);
      }
    }
  }
}

namespace {

// Calls fn(r0, r1) over [0, n_rows) in a few contiguous ranges per thread.
template <typename Fn>
void for_row_ranges(int64_t n_rows, ThreadPool& pool, Fn&& fn) {
  const int64_t n_tasks = std::min<int64_t>(n_rows, 4 * pool.size());
  pool.parallel_for(n_tasks, [&](int64_t task, int) {
    fn(task * n_rows / n_tasks, (task + 1) * n_rows / n_tasks);
  });
}

}  // namespace

void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps, ThreadPool& pool) {
  for_row_ranges(n_rows, pool, [&](int64_t r0, int64_t r1) {
    rms_norm(x + r0 * dim, weight, out + r0 * dim, r1 - r0, dim, eps);
  });
}

void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params, ThreadPool& pool) {
  for_row_ranges(n_rows, pool, [&](int64_t r0, int64_t r1) {
    rope(x + r0 * n_heads * head_dim, r1 - r0, n_heads, head_dim, positions + r0, params);
  });
}

void add_in_place(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void scale(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

namespace {

// ggml's table: every F16 input's GELU, rounded to F16 (ggml_cpu_init).
const std::vector<uint16_t>& gelu_table() {
  static const std::vector<uint16_t> table = [] {
    constexpr float kCoefA = 0.044715f;
    constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
    std::vector<uint16_t> t(1 << 16);
    for (size_t i = 0; i < t.size(); ++i) {
      const float f = fp16_to_fp32(static_cast<uint16_t>(i));
      t[i] =
          fp32_to_fp16(0.5f * f * (1.0f + std::tanh(kSqrt2OverPi * f * (1.0f + kCoefA * f * f))));
    }
    return t;
  }();
  return table;
}

float gelu_from(const std::vector<uint16_t>& table, float x) {
  if (x <= -10.0f) return 0.0f;
  if (x >= 10.0f) return x;
  return fp16_to_fp32(table[fp32_to_fp16(x)]);
}

}  // namespace

float gelu(float x) { return gelu_from(gelu_table(), x); }

void gelu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width,
              ThreadPool& pool) {
  const std::vector<uint16_t>& table = gelu_table();  // built before the threads read it
  for_row_ranges(n_rows, pool, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * width; i < r1 * width; ++i) out[i] = gelu_from(table, gate[i]) * up[i];
  });
}

void softmax_in_place(float* x, int64_t n) {
  const float max = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace duet::cpu
