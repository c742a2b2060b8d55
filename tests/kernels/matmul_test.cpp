// Matrix products against a double-precision reference computed from exactly
// the inputs the kernel sees (dequantized weights, dequantized packed
// activations, and for Q4_1 the activation blocks' stored sums), on every ISA
// path this CPU runs; the quantized paths
// bit-identical to the scalar one; and batch invariance: a row's result does
// not depend on the batch around it, its place in it, the thread count, or how
// the weight rows are split.
#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/model/dtype.h"
#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/matmul_reference.h"

namespace duet::cpu {
namespace {

using test_support::make_weights_with;
using test_support::packed_values;
using test_support::random_activations;
using test_support::reference_matmul;
using test_support::Weights;

bool is_quantized(DType type) { return type != DType::kF32 && type != DType::kF16; }

Weights make_weights(DType type, int64_t k, int64_t n_out, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return make_weights_with(type, k, n_out, [&](int64_t j, std::vector<float>& row) {
    const float offset = j % 3 == 0 ? 0.5f : 0.0f;  // some rows off-centre (Q4_1's min)
    for (float& v : row) v = normal(rng) * 0.1f + offset;
  });
}

// Q4_1 times Q8_1 as the format defines it: per block, d_w d_x sum(q_w q_x)
// plus m_w s_x, where s_x is the activation block's stored d_x * sum(q_x)
// rounded to half (not the sum of its dequantized values), as in llama.cpp.
std::vector<double> reference_matmul_q4_1(const Weights& w, const PackedActivations& packed) {
  size_t x_row_bytes = 0;
  const uint8_t* x_rows = packed.rows(DType::kQ4_1, &x_row_bytes);
  const int64_t n_x = packed.n_rows(), nb = w.k / kQuantBlock;
  std::vector<double> y(static_cast<size_t>(n_x * w.n_out));
  for (int64_t i = 0; i < n_x; ++i) {
    const auto* xb = reinterpret_cast<const BlockQ8_1*>(x_rows + i * x_row_bytes);
    for (int64_t j = 0; j < w.n_out; ++j) {
      const auto* wb = reinterpret_cast<const BlockQ4_1*>(w.bytes.data() + j * w.row_bytes);
      double sum = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        int64_t dot = 0;
        for (int e = 0; e < kQuantBlock; ++e) {
          const int q = e < 16 ? (wb[b].qs[e] & 0x0f) : (wb[b].qs[e - 16] >> 4);
          dot += q * xb[b].qs[e];
        }
        sum += static_cast<double>(fp16_to_fp32(wb[b].d)) * fp16_to_fp32(xb[b].d) *
                   static_cast<double>(dot) +
               static_cast<double>(fp16_to_fp32(wb[b].m)) * fp16_to_fp32(xb[b].s);
      }
      y[i * w.n_out + j] = sum;
    }
  }
  return y;
}

// Runs matmul for x (n_x, k) into a fresh (n_x, n_out) buffer.
std::vector<float> run_matmul(const KernelTable& kernels, const WeightMatrix& w,
                              const std::vector<float>& x, int64_t n_x, ThreadPool& pool) {
  PackedActivations packed;
  packed.pack(kernels, x.data(), n_x, w.k, {w.type}, pool);
  std::vector<float> y(static_cast<size_t>(n_x * w.n_out), NAN);
  matmul(kernels, w, packed, y.data(), w.n_out, pool);
  return y;
}

bool bitwise_equal(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

std::string shape_name(DType type, int64_t k, int64_t n_out, int64_t n_x) {
  return std::string(dtype_name(type)) + " k=" + std::to_string(k) +
         " n_out=" + std::to_string(n_out) + " n_x=" + std::to_string(n_x);
}

class MatmulTest : public ::testing::TestWithParam<DType> {};

// matmul against the double reference on every ISA, and the quantized types
// bit-identical across ISAs.
TEST_P(MatmulTest, MatchesReferenceOnEveryIsa) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 100);
  ThreadPool pool(2);
  std::vector<int64_t> ks = {32, 64, 576, 1536};
  if (!is_quantized(type)) ks.insert(ks.end(), {40, 100, 7});  // scalar tails of the 8-lane loop
  int n_cases = 0;
  for (int64_t k : ks) {
    for (int64_t n_out : {1, 3, 33, 100}) {
      const Weights w = make_weights(type, k, n_out, rng);
      for (int64_t n_x : {1, 2, 3, 4, 5, 7, 64, 65}) {
        SCOPED_TRACE(shape_name(type, k, n_out, n_x));
        const std::vector<float> x = random_activations(n_x, k, rng);
        // The scalar path's packed activations define the reference; every
        // path must pack them identically.
        PackedActivations scalar_packed;
        scalar_packed.pack(scalar_kernel_table(), x.data(), n_x, k, {type}, pool);
        const std::vector<double> ref =
            type == DType::kQ4_1
                ? reference_matmul_q4_1(w, scalar_packed)
                : reference_matmul(w.values, packed_values(scalar_packed, type), k, n_out, n_x);
        double ref_max = 0.0;
        for (double v : ref) ref_max = std::max(ref_max, std::fabs(v));
        ASSERT_GT(ref_max, 0.0);

        std::vector<float> scalar_y;
        for (Isa isa : supported_isas()) {
          SCOPED_TRACE(std::string(isa_name(isa)));
          const KernelTable& kernels = kernel_table(isa);
          PackedActivations packed;
          packed.pack(kernels, x.data(), n_x, k, {type}, pool);
          size_t rb = 0, scalar_rb = 0;
          const uint8_t* rows = packed.rows(type, &rb);
          const uint8_t* scalar_rows = scalar_packed.rows(type, &scalar_rb);
          ASSERT_EQ(rb, scalar_rb);
          ASSERT_EQ(std::memcmp(rows, scalar_rows, rb * n_x), 0) << "packed activations differ";

          std::vector<float> y(static_cast<size_t>(n_x * n_out), NAN);
          matmul(kernels, w.matrix(), packed, y.data(), n_out, pool);
          double max_diff = 0.0;
          for (size_t e = 0; e < y.size(); ++e) {
            max_diff = std::max(max_diff, std::fabs(static_cast<double>(y[e]) - ref[e]));
          }
          EXPECT_LT(max_diff / ref_max, 1e-5)
              << "max |diff| " << max_diff << " max |ref| " << ref_max;
          if (isa == Isa::kScalar) {
            scalar_y = y;
          } else if (is_quantized(type)) {
            for (size_t e = 0; e < y.size(); ++e) {
              ASSERT_EQ(std::bit_cast<uint32_t>(y[e]), std::bit_cast<uint32_t>(scalar_y[e]))
                  << "differs from the scalar path at row " << e / n_out << " column " << e % n_out
                  << ": " << y[e] << " vs " << scalar_y[e];
            }
          }
          ++n_cases;
        }
      }
    }
  }
  EXPECT_GT(n_cases, 0);
}

// Row i of a batch is bitwise the row computed alone, or in any other batch at
// any position, with any thread count; column ranges of the weights computed
// separately give the same columns.
TEST_P(MatmulTest, BatchInvariantOnEveryIsa) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 200);
  const int64_t n_x = 70;  // two activation tasks (64 + 6)
  ThreadPool pool1(1), pool2(2), pool3(3);
  ThreadPool* pools[] = {&pool1, &pool2, &pool3};
  std::vector<int64_t> ks = {64, 576};
  if (!is_quantized(type)) ks.push_back(100);  // the scalar tail after the 8-lane loop
  for (int64_t k : ks) {
    const int64_t n_out = 75;  // three weight tasks (32 + 32 + 11)
    const Weights w = make_weights(type, k, n_out, rng);
    const std::vector<float> x = random_activations(n_x, k, rng);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + shape_name(type, k, n_out, n_x));
      const KernelTable& kernels = kernel_table(isa);
      const std::vector<float> full = run_matmul(kernels, w.matrix(), x, n_x, pool1);

      // Each row alone (decode shape), with every pool.
      for (ThreadPool* pool : pools) {
        for (int64_t i = 0; i < n_x; ++i) {
          const std::vector<float> xi(x.begin() + i * k, x.begin() + (i + 1) * k);
          const std::vector<float> yi = run_matmul(kernels, w.matrix(), xi, 1, *pool);
          ASSERT_TRUE(bitwise_equal(yi.data(), full.data() + i * n_out, n_out))
              << "row " << i << " alone, " << pool->size() << " threads";
        }
      }
      // Sub-batches of every tile remainder at several offsets.
      for (int64_t n : {2, 3, 4, 5, 6, 7, 8, 9, 63, 64, 65}) {
        for (int64_t start : {int64_t{0}, int64_t{1}, int64_t{3}, n_x - n}) {
          const std::vector<float> xs(x.begin() + start * k, x.begin() + (start + n) * k);
          for (ThreadPool* pool : pools) {
            const std::vector<float> ys = run_matmul(kernels, w.matrix(), xs, n, *pool);
            ASSERT_TRUE(bitwise_equal(ys.data(), full.data() + start * n_out, n * n_out))
                << "rows [" << start << ", " << start + n << "), " << pool->size() << " threads";
          }
        }
      }
      // The whole batch reversed: every row at another position.
      std::vector<float> reversed(x.size());
      for (int64_t i = 0; i < n_x; ++i) {
        std::copy_n(x.begin() + i * k, k, reversed.begin() + (n_x - 1 - i) * k);
      }
      for (ThreadPool* pool : pools) {
        const std::vector<float> yr = run_matmul(kernels, w.matrix(), reversed, n_x, *pool);
        for (int64_t i = 0; i < n_x; ++i) {
          ASSERT_TRUE(
              bitwise_equal(yr.data() + (n_x - 1 - i) * n_out, full.data() + i * n_out, n_out))
              << "row " << i << " at position " << n_x - 1 - i << ", " << pool->size()
              << " threads";
        }
      }
      // Weight rows split into ranges, written into the full output with ldy.
      for (int64_t split : {1, 2, 7, 31, 32, 33, 50}) {
        PackedActivations packed;
        packed.pack(kernels, x.data(), n_x, k, {type}, pool2);
        std::vector<float> y(full.size(), NAN);
        matmul(kernels, w.rows(0, split), packed, y.data(), n_out, pool2);
        matmul(kernels, w.rows(split, n_out - split), packed, y.data() + split, n_out, pool3);
        ASSERT_TRUE(bitwise_equal(y.data(), full.data(), full.size())) << "split at " << split;
      }
    }
  }
}

// The dot tile functions called directly: any split of the weight rows and
// activation rows into tiles writes the same bits.
TEST_P(MatmulTest, DotTileSplitsAreBitIdentical) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 300);
  ThreadPool pool(1);
  std::vector<int64_t> ks = {32, 96, 576};
  if (!is_quantized(type)) ks.insert(ks.end(), {7, 100});
  for (int64_t k : ks) {
    const int64_t n_out = 37, n_x = 11;
    const Weights w = make_weights(type, k, n_out, rng);
    const std::vector<float> x = random_activations(n_x, k, rng);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + shape_name(type, k, n_out, n_x));
      const KernelTable& kernels = kernel_table(isa);
      const DotTileFn dot = type == DType::kF32    ? kernels.dot_f32
                            : type == DType::kF16  ? kernels.dot_f16
                            : type == DType::kQ8_0 ? kernels.dot_q8_0
                            : type == DType::kQ4_0 ? kernels.dot_q4_0
                                                   : kernels.dot_q4_1;
      PackedActivations packed;
      packed.pack(kernels, x.data(), n_x, k, {type}, pool);
      size_t x_stride = 0;
      const uint8_t* xr = packed.rows(type, &x_stride);
      const int64_t ldy = n_out + 5;  // a padded output stride
      std::vector<float> whole(static_cast<size_t>(n_x * ldy), NAN);
      dot(w.bytes.data(), w.row_bytes, n_out, xr, x_stride, n_x, k, whole.data(), ldy);
      for (int64_t tile_w : {1, 2, 3, 5, 16, 37}) {
        for (int64_t tile_x : {1, 2, 3, 4, 5, 11}) {
          std::vector<float> y(whole.size(), NAN);
          for (int64_t j0 = 0; j0 < n_out; j0 += tile_w) {
            for (int64_t i0 = 0; i0 < n_x; i0 += tile_x) {
              const int64_t nw = std::min(tile_w, n_out - j0), nx = std::min(tile_x, n_x - i0);
              dot(w.bytes.data() + j0 * w.row_bytes, w.row_bytes, nw, xr + i0 * x_stride, x_stride,
                  nx, k, y.data() + i0 * ldy + j0, ldy);
            }
          }
          for (int64_t i = 0; i < n_x; ++i) {
            ASSERT_TRUE(bitwise_equal(y.data() + i * ldy, whole.data() + i * ldy, n_out))
                << "tiles of " << tile_w << " weight rows x " << tile_x << " activation rows, row "
                << i;
            for (int64_t j = n_out; j < ldy; ++j) {
              ASSERT_TRUE(std::isnan(y[i * ldy + j])) << "wrote past n_w at row " << i;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, MatmulTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_0,
                                           DType::kQ4_1),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

TEST(Matmul, OnePackServesSeveralWeightTypes) {
  std::mt19937 rng(400);
  ThreadPool pool(2);
  const int64_t k = 128, n_out = 9, n_x = 6;
  const std::vector<float> x = random_activations(n_x, k, rng);
  for (Isa isa : supported_isas()) {
    const KernelTable& kernels = kernel_table(isa);
    PackedActivations shared;
    shared.pack(kernels, x.data(), n_x, k,
                {DType::kQ4_1, DType::kQ8_0, DType::kQ4_0, DType::kF16, DType::kF32}, pool);
    for (DType type : {DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
      const Weights w = make_weights(type, k, n_out, rng);
      std::vector<float> y(static_cast<size_t>(n_x * n_out));
      matmul(kernels, w.matrix(), shared, y.data(), n_out, pool);
      const std::vector<float> alone = run_matmul(kernels, w.matrix(), x, n_x, pool);
      EXPECT_TRUE(bitwise_equal(y.data(), alone.data(), y.size()))
          << isa_name(isa) << " " << dtype_name(type);
    }
  }
}

// One PackedActivations reused across steps of different sizes and types
// (as the forward pass reuses it) gives what a fresh one gives.
TEST(Matmul, ReusedPackMatchesFreshPack) {
  std::mt19937 rng(500);
  ThreadPool pool(2);
  const int64_t k = 96, n_out = 40;
  for (Isa isa : supported_isas()) {
    const KernelTable& kernels = kernel_table(isa);
    PackedActivations reused;
    for (int64_t n_x : {65, 1, 7, 130, 2}) {
      for (DType type : {DType::kQ4_1, DType::kQ8_0, DType::kF16, DType::kQ4_0, DType::kF32}) {
        const Weights w = make_weights(type, k, n_out, rng);
        const std::vector<float> x = random_activations(n_x, k, rng);
        reused.pack(kernels, x.data(), n_x, k, {type}, pool);
        EXPECT_EQ(reused.n_rows(), n_x);
        std::vector<float> y(static_cast<size_t>(n_x * n_out), NAN);
        matmul(kernels, w.matrix(), reused, y.data(), n_out, pool);
        EXPECT_TRUE(
            bitwise_equal(y.data(), run_matmul(kernels, w.matrix(), x, n_x, pool).data(), y.size()))
            << isa_name(isa) << " " << dtype_name(type) << " n_x " << n_x;
      }
    }
  }
}

// The shapes where the batched kernels change strategy: weight rows that do
// not fill a group of 4, activation rows in several chunks with every tail,
// the longest rows the AVX-512 GEMM takes (k = 4096) and the first it leaves
// to the row tiles. Every path bit-identical to the scalar one.
TEST(Matmul, BatchedShapeEdgesMatchScalar) {
  std::mt19937 rng(600);
  ThreadPool pool(1);
  for (DType type : {DType::kQ4_1, DType::kQ8_0, DType::kQ4_0}) {
    for (int64_t k : {32, 4096, 4128}) {
      const int64_t n_out = 13;
      const Weights w = make_weights(type, k, n_out, rng);
      for (int64_t n_x : {3, 5, 8, 9, 15, 17, 33, 40}) {
        SCOPED_TRACE(shape_name(type, k, n_out, n_x));
        const std::vector<float> x = random_activations(n_x, k, rng);
        const std::vector<float> scalar =
            run_matmul(scalar_kernel_table(), w.matrix(), x, n_x, pool);
        for (Isa isa : supported_isas()) {
          const std::vector<float> y = run_matmul(kernel_table(isa), w.matrix(), x, n_x, pool);
          EXPECT_TRUE(bitwise_equal(y.data(), scalar.data(), y.size())) << isa_name(isa);
        }
      }
    }
  }
}

TEST(Matmul, ActivationTypes) {
  EXPECT_EQ(activation_type(DType::kF32), DType::kF32);
  EXPECT_EQ(activation_type(DType::kF16), DType::kF16);
  EXPECT_EQ(activation_type(DType::kQ8_0), DType::kQ8_0);
  EXPECT_EQ(activation_type(DType::kQ4_0), DType::kQ8_0);
  EXPECT_EQ(activation_type(DType::kQ4_1), DType::kQ8_1);
  EXPECT_EQ(activation_type(DType::kQ4_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kQ6_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kBF16), DType::kBF16);
  EXPECT_THROW(activation_type(DType::kQ5_K), std::exception);
}

}  // namespace
}  // namespace duet::cpu
