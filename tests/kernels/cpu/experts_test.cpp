// The mixture of experts' ops against plain references: the router's picks
// and weights on every ISA (the same bits everywhere), its ties and clamp,
// and the order in which the picks are summed.
#include "kernels/cpu/experts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {
namespace {

// The softmax in double, the top k by probability, their weights renormalized.
void reference_route(const float* logits, int64_t n, int64_t k, std::vector<int32_t>& picked,
                     std::vector<double>& weights) {
  std::vector<double> p(static_cast<size_t>(n));
  const double max = *std::max_element(logits, logits + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += p[static_cast<size_t>(i)] = std::exp(logits[i] - max);
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)];
  });
  picked.assign(order.begin(), order.begin() + k);
  double picked_sum = 0.0;
  for (int32_t e : picked) picked_sum += p[static_cast<size_t>(e)] / sum;
  weights.clear();
  for (int32_t e : picked) weights.push_back(p[static_cast<size_t>(e)] / sum / picked_sum);
}

TEST(Experts, RouterPicksTheMostProbableAndNormalizesTheirWeights) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  // 8 of 128 (Qwen3-30B-A3B), 2 of 8 (Mixtral), 3 of 8, and sizes around the 16-wide chunks.
  const std::pair<int64_t, int64_t> shapes[] = {{128, 8}, {8, 2}, {8, 3}, {17, 4}, {40, 40}};
  for (const auto& [n_experts, n_used] : shapes) {
    const int64_t n_rows = 9;
    std::vector<float> logits(static_cast<size_t>(n_rows * n_experts));
    for (float& x : logits) x = normal(rng);
    std::vector<int32_t> first_picked;
    std::vector<float> first_weights;
    for (Isa isa : supported_isas()) {
      std::vector<int32_t> picked(static_cast<size_t>(n_rows * n_used));
      std::vector<float> weights(picked.size());
      route_experts(kernel_table(isa), logits.data(), n_rows, {n_experts, n_used}, picked.data(),
                    weights.data());
      for (int64_t r = 0; r < n_rows; ++r) {
        std::vector<int32_t> want;
        std::vector<double> want_weights;
        reference_route(logits.data() + r * n_experts, n_experts, n_used, want, want_weights);
        float sum = 0.0f;
        for (int64_t j = 0; j < n_used; ++j) {
          const auto at = static_cast<size_t>(r * n_used + j);
          EXPECT_EQ(picked[at], want[static_cast<size_t>(j)])
              << n_experts << " experts, row " << r << ", pick " << j;
          EXPECT_NEAR(weights[at], want_weights[static_cast<size_t>(j)], 1e-6);
          sum += weights[at];
        }
        EXPECT_NEAR(sum, 1.0f, 1e-5f);
      }
      if (first_picked.empty()) {
        first_picked = picked;
        first_weights = weights;
      }
      EXPECT_EQ(picked, first_picked) << isa_name(isa);
      EXPECT_EQ(weights, first_weights) << isa_name(isa) << " differs from the first ISA's bits";
    }
  }
}

TEST(Experts, TiesGoToTheLowerExpertAndOnePickWeighsOne) {
  const float logits[] = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f, -1.0f};
  int32_t picked[3];
  float weights[3];
  route_experts(kernel_table(best_isa()), logits, 1, {6, 3}, picked, weights);
  EXPECT_EQ(std::vector<int32_t>(picked, picked + 3), (std::vector<int32_t>{1, 3, 4}));
  EXPECT_EQ(weights[0], weights[1]);
  route_experts(kernel_table(best_isa()), logits, 1, {6, 1}, picked, weights);
  EXPECT_EQ(picked[0], 1);
  EXPECT_EQ(weights[0], 1.0f);
}

TEST(Experts, RowsMoveToAndFromAnExpertAndPicksSumLeftToRight) {
  // x: 3 rows of width 2.
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> rows = {2, 0};
  std::vector<float> gathered(4);
  gather_rows(x.data(), 2, rows, gathered.data());
  EXPECT_EQ(gathered, (std::vector<float>{5, 6, 1, 2}));

  // Two rows of 2 picks each: slots 0..3; the expert wrote slots 3 and 0.
  const std::vector<float> weights = {0.5f, 0.25f, 0.125f, 2.0f};
  std::vector<float> picks(8, 0.0f);
  scatter_weighted(gathered.data(), 2, std::vector<int32_t>{3, 0}, weights.data(), picks.data());
  EXPECT_EQ(picks, (std::vector<float>{0.5f, 1.0f, 0, 0, 0, 0, 10.0f, 12.0f}));

  // The order matters in floats: (1e8 + 1) - 1e8 is 0, 1e8 + (1 - 1e8) is not computed.
  const std::vector<float> three = {1e8f, 1.0f, -1e8f};
  float out = 0.0f;
  sum_picks(three.data(), 1, 3, 1, &out);
  EXPECT_EQ(out, (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(out, 0.0f);
}

// llama.cpp's two F32 dot products, written out: ggml_vec_dot_f32 (4 groups
// of 16 lanes over 64-chunks, (g0 + g2) + (g1 + g3), the AVX-512 lane tree,
// then the tail by FMA) and tinyBLAS (one group over 16-chunks, the tree).
float llama_cpp_dot_f32(const float* w, const float* x, int64_t k, bool one_token) {
  float g[4][16] = {};
  const int64_t chunk = one_token ? 64 : 16;
  const int64_t whole = k / chunk * chunk;
  for (int64_t c = 0; c < whole; c += 16) {
    float* lanes = g[one_token ? (c / 16) % 4 : 0];
    for (int l = 0; l < 16; ++l) lanes[l] = std::fma(w[c + l], x[c + l], lanes[l]);
  }
  float v[16];
  for (int l = 0; l < 16; ++l)
    v[l] = one_token ? (g[0][l] + g[2][l]) + (g[1][l] + g[3][l]) : g[0][l];
  float h[8], q[4];
  for (int l = 0; l < 8; ++l) h[l] = v[l + 8] + v[l];
  for (int l = 0; l < 4; ++l) q[l] = h[l + 4] + h[l];
  float sum = (q[0] + q[2]) + (q[1] + q[3]);
  for (int64_t e = whole; e < k; ++e) sum = std::fma(w[e], x[e], sum);
  return sum;
}

// The router's logits: each row in the order of its token's role, the same
// bits on every ISA, and close to the exact product.
TEST(Experts, RouterLogitsTakeLlamaCppsOrderOfEachRowsToken) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // k: whole 64-chunks, a 16-chunk tail, a tail of 4; experts: tinyBLAS's multiple of 4 or not.
  for (const int64_t k : {2048, 80, 100}) {
    for (const int64_t n_experts : {8, 6}) {
      const int64_t n_rows = 5;
      std::vector<float> w(static_cast<size_t>(n_experts * k)), x(static_cast<size_t>(n_rows * k));
      for (float& v : w) v = normal(rng) / std::sqrt(static_cast<float>(k));
      for (float& v : x) v = normal(rng);
      const std::vector<uint8_t> one_token = {0, 0, 1, 0, 1};
      for (Isa isa : supported_isas()) {
        ThreadPool pool(2);
        std::vector<float> out(static_cast<size_t>(n_rows * n_experts));
        router_logits(kernel_table(isa), x.data(), n_rows, w.data(), n_experts, k, one_token,
                      out.data(), pool);
        const bool tiny_blas = k % 16 == 0 && n_experts % 4 == 0;
        for (int64_t r = 0; r < n_rows; ++r) {
          for (int64_t j = 0; j < n_experts; ++j) {
            const float* wj = w.data() + j * k;
            const float* xr = x.data() + r * k;
            const float want = llama_cpp_dot_f32(wj, xr, k, one_token[r] != 0 || !tiny_blas);
            EXPECT_EQ(out[static_cast<size_t>(r * n_experts + j)], want)
                << isa_name(isa) << ", k " << k << ", row " << r << ", expert " << j;
            double exact = 0.0;
            for (int64_t e = 0; e < k; ++e) exact += static_cast<double>(wj[e]) * xr[e];
            EXPECT_NEAR(out[static_cast<size_t>(r * n_experts + j)], exact, 1e-5);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace duet::cpu
