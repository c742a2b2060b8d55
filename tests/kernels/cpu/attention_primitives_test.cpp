// The attention primitives of every ISA path (kq_scores, kqv_sum,
// kqv_sum_tile, softmax_exp) against their definitions in kernel_table.h and
// lane_math.h, bit for bit; and lane_math.h's exponential and lane tree.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/model/fp16.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/lane_math.h"
#include "tests/kernels/cpu/float_vectors.h"

namespace duet::cpu {
namespace {

// ---------------------------------------------------------------------------
// The primitives, against the definitions in kernel_table.h.

void kq_scores_definition(const uint16_t* q, const uint16_t* k, int64_t n_rows, int64_t dim,
                          int groups, float* out) {
  for (int64_t t = 0; t < n_rows; ++t) {
    const uint16_t* kr = k + t * dim;
    float acc[4][16] = {};
    const int64_t n_whole = groups == 1 ? dim : dim - dim % 64;
    for (int64_t c = 0; c < n_whole / 16; ++c) {
      float* a = acc[groups == 1 ? 0 : c % 4];
      for (int l = 0; l < 16; ++l) {
        a[l] = std::fma(fp16_to_fp32(q[c * 16 + l]), fp16_to_fp32(kr[c * 16 + l]), a[l]);
      }
    }
    float lanes[16];
    for (int l = 0; l < 16; ++l) {
      lanes[l] = groups == 1 ? acc[0][l] : (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    double sum = lane_tree_sum16(lanes);
    for (int64_t e = n_whole; e < dim; ++e) {
      sum += static_cast<double>(fp16_to_fp32(q[e])) * static_cast<double>(fp16_to_fp32(kr[e]));
    }
    out[t] = static_cast<float>(sum);
  }
}

std::vector<uint16_t> random_halves(size_t n, std::mt19937& rng) {
  std::vector<uint16_t> h(n);
  const std::vector<float> f = random_floats(n, 1.0f, rng);
  for (size_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(f[i]);
  return h;
}

// Segments (16 rows of dim halves each) in separate buffers, as the blocks of
// a paged cache are, covering n_keys rows.
struct Segments {
  std::vector<std::vector<uint16_t>> buffers;
  std::vector<const uint16_t*> pointers;
  Segments(int64_t n_keys, int64_t dim, std::mt19937& rng) {
    for (int64_t t0 = 0; t0 < n_keys; t0 += 16) {
      buffers.push_back(random_halves(static_cast<size_t>(16 * dim), rng));
    }
    for (const auto& b : buffers) pointers.push_back(b.data());
  }
  const uint16_t* row(int64_t t, int64_t dim) const {
    return buffers[static_cast<size_t>(t / 16)].data() + t % 16 * dim;
  }
};

TEST(AttentionPrimitives, KqScoresFollowTheContract) {
  std::mt19937 rng(21);
  for (int64_t dim : {16, 32, 64, 80, 128, 144, 272}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys : {1, 5, 16, 17, 40}) {
        for (int64_t n_q : {1, 3, 4, 7, 24, 32}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys) + " heads " + std::to_string(n_q));
          const std::vector<uint16_t> q = random_halves(static_cast<size_t>(n_q * dim), rng);
          const Segments k(n_keys, dim, rng);
          const int64_t ld_out = n_keys + 3;  // padding the kernel must not write
          std::vector<float> expected(static_cast<size_t>(n_q * ld_out), NAN);
          for (int64_t h = 0; h < n_q; ++h) {
            for (int64_t t = 0; t < n_keys; ++t) {
              kq_scores_definition(q.data() + h * dim, k.row(t, dim), 1, dim, groups,
                                   expected.data() + h * ld_out + t);
            }
          }
          for (Isa isa : supported_isas()) {
            std::vector<float> out(expected.size(), NAN);
            kernel_table(isa).kq_scores(q.data(), n_q, k.pointers.data(), n_keys, dim, groups,
                                        out.data(), ld_out);
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);  // NaN padding included
          }
        }
      }
    }
  }
}

// kqv_sum as kernel_table.h defines it, spelled out loop by loop.
void kqv_sum_definition(const float* p, const std::vector<std::vector<uint16_t>>& segments,
                        int64_t n_keys, int64_t dim, int groups, float* out) {
  std::vector<float> lanes(static_cast<size_t>(4 * 16 * dim), 0.0f);
  for (int64_t t = 0; t < n_keys; ++t) {
    const int64_t m = t / 16, s = t % 16, g = m % groups;
    for (int64_t d = 0; d < dim; ++d) {
      float& lane = lanes[static_cast<size_t>((g * 16 + s) * dim + d)];
      lane = std::fma(fp16_to_fp32(segments[static_cast<size_t>(m)][s * dim + d]), p[t], lane);
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    float g[16];
    for (int64_t s = 0; s < 16; ++s) {
      auto at = [&](int64_t group) {
        return lanes[static_cast<size_t>((group * 16 + s) * dim + d)];
      };
      g[s] = groups == 1 ? at(0) : (at(0) + at(2)) + (at(1) + at(3));
    }
    out[d] = lane_tree_sum16(g);
  }
}

TEST(AttentionPrimitives, KqvSumFollowsTheContract) {
  std::mt19937 rng(22);
  for (int64_t dim : {16, 32, 36, 64, 80, 128, 200}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys : {1, 7, 16, 17, 64, 100, 250}) {
        for (int64_t n_q : {1, 2, 3, 4, 7}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys) + " heads " + std::to_string(n_q));
          const int64_t ld_p = n_keys + 5;
          const std::vector<float> p = random_floats(static_cast<size_t>(n_q * ld_p), 0.3f, rng);
          const Segments v(n_keys, dim, rng);
          std::vector<float> expected(static_cast<size_t>(n_q * dim));
          for (int64_t h = 0; h < n_q; ++h) {
            kqv_sum_definition(p.data() + h * ld_p, v.buffers, n_keys, dim, groups,
                               expected.data() + h * dim);
          }
          for (Isa isa : supported_isas()) {
            std::vector<float> out(expected.size() + 1, NAN);
            kernel_table(isa).kqv_sum(p.data(), ld_p, n_q, v.pointers.data(), n_keys, dim, groups,
                                      out.data());
            EXPECT_TRUE(std::isnan(out.back())) << isa_name(isa) << " wrote past the last head";
            out.pop_back();
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);
          }
        }
      }
    }
  }
}

// A tile of rows with one more key each, across several of the tile
// kernel's key blocks, against the definition row by row.
TEST(AttentionPrimitives, KqvSumTileFollowsTheContract) {
  std::mt19937 rng(23);
  for (int64_t dim : {16, 36, 64, 80, 128}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys0 : {1, 15, 16, 127, 300}) {
        for (auto [n_q, n_rows] :
             {std::pair<int64_t, int64_t>{1, 1}, {3, 8}, {2, 5}, {4, 3}, {5, 2}}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys0) + " heads " + std::to_string(n_q) +
                       " rows " + std::to_string(n_rows));
          const int64_t n_keys = n_keys0 + n_rows - 1;
          const int64_t ld_p = n_keys + 3;
          const int64_t ld_out = n_q * dim + 7;
          const std::vector<float> p =
              random_floats(static_cast<size_t>(n_rows * n_q * ld_p), 0.3f, rng);
          const Segments v(n_keys, dim, rng);
          std::vector<float> expected(static_cast<size_t>(n_rows * ld_out), NAN);
          for (int64_t r = 0; r < n_rows; ++r) {
            for (int64_t h = 0; h < n_q; ++h) {
              kqv_sum_definition(p.data() + (r * n_q + h) * ld_p, v.buffers, n_keys0 + r, dim,
                                 groups, expected.data() + r * ld_out + h * dim);
            }
          }
          for (Isa isa : supported_isas()) {
            const KernelTable& kernels = kernel_table(isa);
            if (kernels.kqv_sum_tile == nullptr) continue;
            std::vector<float> out(expected.size(), NAN);
            kernels.kqv_sum_tile(p.data(), ld_p, n_q, n_rows, n_keys0, v.pointers.data(), dim,
                                 groups, out.data(), ld_out);
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);
          }
        }
      }
    }
  }
}

TEST(AttentionPrimitives, SoftmaxExpFollowsTheContract) {
  std::mt19937 rng(23);
  for (int64_t n : {1, 5, 15, 16, 17, 33, 100, 257}) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> x =
          random_floats(static_cast<size_t>(n), variant == 2 ? 40.0f : 3.0f, rng);
      if (variant == 1 && n > 1) x[rng() % n] = -INFINITY;  // a masked score
      const float max = *std::max_element(x.begin(), x.end());
      std::vector<float> expected(x.size());
      double expected_sum = 0.0;
      for (int64_t i = 0; i < n; i += 16) {
        float chunk[16] = {};
        for (int64_t l = 0; l < 16 && i + l < n; ++l) {
          chunk[l] = expected[i + l] = ggml_expf(x[i + l] - max);
        }
        expected_sum += static_cast<double>(lane_tree_sum16(chunk));
      }
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n) + " variant " +
                     std::to_string(variant));
        std::vector<float> y(x.size() + 1, NAN);  // one guard element
        const double sum = kernel_table(isa).softmax_exp(x.data(), n, max, y.data());
        EXPECT_TRUE(std::isnan(y.back())) << "wrote past n";
        y.pop_back();
        EXPECT_TRUE(bitwise_equal(y, expected));
        EXPECT_EQ(std::bit_cast<uint64_t>(sum), std::bit_cast<uint64_t>(expected_sum));
        // In place, as attention calls it.
        std::vector<float> inplace = x;
        const double sum2 = kernel_table(isa).softmax_exp(inplace.data(), n, max, inplace.data());
        EXPECT_TRUE(bitwise_equal(inplace, expected));
        EXPECT_EQ(std::bit_cast<uint64_t>(sum2), std::bit_cast<uint64_t>(expected_sum));
      }
    }
  }
}

// The probabilities' last step: scaled by 1 / sum, rounded to F16, element
// by element, on every ISA; nothing past n written.
TEST(AttentionPrimitives, ScaleRoundF16FollowsTheContract) {
  std::mt19937 rng(25);
  // Values that round to F16 subnormals or to zero, and exact ties between
  // two F16 values (1 + 2^-11, 2^-14 + 2^-25), as small probabilities do.
  const float specials[] = {
      0.0f,     1.0f + 0x1p-11f, 0x1p-14f + 0x1p-25f, 0x1p-20f,        0x1.8p-24f,      0x1p-26f,
      0x1p-30f, 65504.0f,        0x1.ffep+15f,        1.0f + 0x1p-10f, 0.5f + 0x1p-12f, 0x1p-24f};
  for (int64_t n : {1, 7, 8, 12, 15, 16, 17, 100, 257}) {
    std::vector<float> x = random_floats(static_cast<size_t>(n), 2.0f, rng);
    for (size_t i = 0; i < x.size(); i += 2) x[i] = specials[i / 2 % std::size(specials)];
    const float factor = n % 2 == 0 ? 1.0f : 1.0f / 37.25f;
    std::vector<float> expected(x.size());
    for (size_t i = 0; i < x.size(); ++i) expected[i] = fp16_to_fp32(fp32_to_fp16(x[i] * factor));
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n));
      std::vector<float> y = x;
      y.push_back(NAN);  // one guard element
      kernel_table(isa).scale_round_f16(y.data(), n, factor);
      EXPECT_TRUE(std::isnan(y.back())) << "wrote past n";
      y.pop_back();
      EXPECT_TRUE(bitwise_equal(y, expected));
    }
  }
}

// llama.cpp's AVX-512 ggml_v_expf (which ggml_expf reproduces) adds the
// polynomial's constant 1 inside an FMA before scaling, one rounding more than
// the ARM routine its "1.45358 plus 0.5 ulps" comment comes from: measured
// here, 2.22 ulp and 2.25e-7 relative at worst on [-80, 80].
TEST(LaneMath, GgmlExpfIsAccurate) {
  double max_rel = 0.0, max_ulp = 0.0;
  float worst_rel = 0.0f, worst_ulp = 0.0f;
  std::mt19937 rng(24);
  std::uniform_real_distribution<float> uniform(-80.0f, 80.0f);
  auto check = [&](float x) {
    const double exact = std::exp(static_cast<double>(x));
    const double diff = std::fabs(ggml_expf(x) - exact);
    const float nearest = static_cast<float>(exact);
    const double ulp = std::nextafter(nearest, INFINITY) - static_cast<double>(nearest);
    if (diff / exact > max_rel) {
      max_rel = diff / exact;
      worst_rel = x;
    }
    if (diff / ulp > max_ulp) {
      max_ulp = diff / ulp;
      worst_ulp = x;
    }
  };
  for (int i = 0; i <= 2'000'000; ++i) check(-80.0f + 160.0f * static_cast<float>(i) / 2e6f);
  for (int i = 0; i < 1'000'000; ++i) check(uniform(rng));
  for (float x = -1.0f; x <= 1.0f; x += 1.0f / 4096) check(x);
  EXPECT_LT(max_ulp, 2.5) << "worst at x = " << worst_ulp;
  EXPECT_LT(max_rel, 2.5e-7) << "worst at x = " << worst_rel;
  std::printf("  ggml_expf on [-80, 80]: max error %.3f ulp (x = %.9g), %.3g relative (x = %.9g)\n",
              max_ulp, worst_ulp, max_rel, worst_rel);
  EXPECT_EQ(ggml_expf(0.0f), 1.0f);
  EXPECT_EQ(ggml_expf(-INFINITY), 0.0f);
  EXPECT_EQ(ggml_expf(-1000.0f), 0.0f);
  EXPECT_EQ(ggml_expf(INFINITY), INFINITY);
  EXPECT_EQ(ggml_expf(89.0f), INFINITY);
  EXPECT_EQ(ggml_expf(1000.0f), INFINITY);
  EXPECT_TRUE(std::isnan(ggml_expf(NAN)));
}

TEST(LaneMath, LaneTreeSumPairsLaneWithLanePlus8First) {
  float v[16] = {};
  v[0] = 1e8f;
  v[1] = 1.0f;
  v[8] = -1e8f;  // cancels lane 0 before the 1 is added; a left-to-right sum would lose the 1
  EXPECT_EQ(lane_tree_sum16(v), 1.0f);
  for (int l = 0; l < 16; ++l) v[l] = static_cast<float>(l + 1);
  EXPECT_EQ(lane_tree_sum16(v), 136.0f);
}

}  // namespace
}  // namespace duet::cpu
