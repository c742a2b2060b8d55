#include "kernels/cpu/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"

namespace duet::cpu {
namespace {

// llama.cpp's clamp of the picked probabilities' sum (the smallest normal F16).
constexpr float kMinWeightSum = 6.103515625e-5f;

}  // namespace

void route_experts(const KernelTable& kernels, const float* logits, int64_t n_rows,
                   const RouterShape& shape, int32_t* picked, float* weights) {
  const int64_t n = shape.n_experts;
  const int64_t k = shape.n_used;
  DUET_ASSERT(k >= 1 && k <= n, "{} of {} experts", k, n);
  std::vector<float> probs(static_cast<size_t>(n));
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* x = logits + r * n;
    const float max = *std::max_element(x, x + n);
    const int64_t whole = n / 16 * 16;
    double sum = whole > 0 ? kernels.softmax_exp(x, whole, max, probs.data()) : 0.0;
    for (int64_t i = whole; i < n; ++i) {
      probs[static_cast<size_t>(i)] = std::exp(x[i] - max);
      sum += static_cast<double>(probs[static_cast<size_t>(i)]);
    }
    const auto inv = static_cast<float>(1.0 / sum);
    for (float& p : probs) p *= inv;

    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      const float pa = probs[static_cast<size_t>(a)], pb = probs[static_cast<size_t>(b)];
      return pa > pb || (pa == pb && a < b);
    });
    int32_t* row_picked = picked + r * k;
    float* row_weights = weights + r * k;
    double picked_sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      row_picked[j] = order[static_cast<size_t>(j)];
      row_weights[j] = probs[static_cast<size_t>(row_picked[j])];
      picked_sum += static_cast<double>(row_weights[j]);
    }
    const float divisor = std::max(static_cast<float>(picked_sum), kMinWeightSum);
    for (int64_t j = 0; j < k; ++j) row_weights[j] /= divisor;
  }
}

void router_logits(const KernelTable& kernels, const float* x, int64_t n_rows, const float* w,
                   int64_t n_experts, int64_t k, std::span<const uint8_t> one_token, float* out,
                   ThreadPool& pool) {
  DUET_ASSERT(static_cast<int64_t>(one_token.size()) == n_rows, "{} rows, {} flags", n_rows,
              one_token.size());
  const bool tiny_blas = k % 16 == 0 && n_experts % 4 == 0;
  pool.parallel_for(n_rows, [&](int64_t r, int) {
    const int groups = one_token[static_cast<size_t>(r)] != 0 || !tiny_blas ? 4 : 1;
    kernels.dot_f32_lanes(w, n_experts, x + r * k, k, groups, out + r * n_experts);
  });
}

void gather_rows(const float* x, int64_t width, std::span<const int32_t> rows, float* out) {
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out + static_cast<int64_t>(i) * width, x + rows[i] * width,
                static_cast<size_t>(width) * sizeof(float));
  }
}

void scatter_weighted(const float* y, int64_t width, std::span<const int32_t> slots,
                      const float* weights, float* out) {
  for (size_t i = 0; i < slots.size(); ++i) {
    const float w = weights[slots[i]];
    const float* from = y + static_cast<int64_t>(i) * width;
    float* to = out + slots[i] * width;
    for (int64_t d = 0; d < width; ++d) to[d] = from[d] * w;
  }
}

void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = picks + r * n_used * width;
    float* o = out + r * width;
    std::copy_n(row, width, o);
    for (int64_t j = 1; j < n_used; ++j) {
      const float* p = row + j * width;
      for (int64_t d = 0; d < width; ++d) o[d] += p[d];
    }
  }
}

}  // namespace duet::cpu
