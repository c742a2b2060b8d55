// Matrix products against a double-precision reference computed from exactly
// the inputs the kernel sees (dequantized weights, dequantized packed
// activations, and for Q4_1 the activation blocks' stored sums), on every ISA
// path this CPU runs; the quantized paths
// bit-identical to the scalar one; and batch invariance: a row's result does
// not depend on the batch around it, its place in it, the thread count, or how
// the weight rows are split.
#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/model/dtype.h"
#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/cpu/matmul_checks.h"
#include "tests/kernels/cpu/matmul_reference.h"

namespace duet::cpu {
namespace {

using namespace test_support;

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
        const std::vector<double> ref = type == DType::kQ4_1
                                            ? reference_matmul_q4_1(w, scalar_packed)
                                            : reference_matmul(w, scalar_packed);
        ASSERT_NO_FATAL_FAILURE(check_matches_reference_on_every_isa(
            w, x, n_x, scalar_packed, ref, /*bit_identical=*/is_quantized(type), pool));
        n_cases += static_cast<int>(supported_isas().size());
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
  std::vector<int64_t> ks = {64, 576};
  if (!is_quantized(type)) ks.push_back(100);  // the scalar tail after the 8-lane loop
  // Sub-batches of every tile remainder at several offsets.
  const BatchLayouts layouts{.sub_batch_sizes = {2, 3, 4, 5, 6, 7, 8, 9, 63, 64, 65},
                             .starts = {0, 1, 3},
                             .weight_splits = {1, 2, 7, 31, 32, 33, 50}};
  for (int64_t k : ks) {
    const int64_t n_out = 75;  // three weight tasks (32 + 32 + 11)
    const Weights w = make_weights(type, k, n_out, rng);
    const std::vector<float> x = random_activations(n_x, k, rng);
    ASSERT_NO_FATAL_FAILURE(check_batch_invariance(w, x, n_x, layouts));
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
    ASSERT_NO_FATAL_FAILURE(
        check_dot_tile_splits(w, x, n_x, {1, 2, 3, 5, 16, 37}, {1, 2, 3, 4, 5, 11}, pool));
  }
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, MatmulTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_0,
                                           DType::kQ4_1, DType::kQ5_0),
                         dtype_param_name);

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
      expect_shared_pack_serves(isa, make_weights(type, k, n_out, rng), shared, x, n_x, pool);
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
// the AVX-512 GEMM's rows in chunks of 1024 (one chunk, 4 and a block, the 8B
// shape's ffn_down, 32), each of several activation tiles carrying its own
// accumulators from chunk to chunk, up to the longest it takes (k = 32768)
// and the first it leaves to the row tiles; the AVX2 GEMM's rows in chunks of 4096 (a last chunk of
// one block, the 8B shape's ffn_down) over more than one block of 16 weight
// groups, and activation rows in one pass or two. Every path bit-identical to
// the scalar one.
TEST(Matmul, BatchedShapeEdgesMatchScalar) {
  std::mt19937 rng(600);
  ThreadPool pool(1);
  for (DType type : {DType::kQ4_1, DType::kQ8_0, DType::kQ4_0}) {
    for (int64_t k : {32, 4096, 4128, 14336, 32768, 32800}) {
      const int64_t n_out = 37;
      const Weights w = make_weights(type, k, n_out, rng);
      for (int64_t n_x : {2, 3, 5, 8, 9, 15, 17, 33, 40, 64}) {
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

// Q4_0 interleaved by 8 rows: every path, decode (AVX2's own kernel, which
// AVX-512 runs too) and batched (the GEMMs' panels packed from the groups),
// bit-identical to the scalar path on the file's rows, also when
// threads split the rows; and the layout gives back the file's rows.
TEST(Matmul, InterleavedQ4_0MatchesRowsOnEveryIsa) {
  std::mt19937 rng(700);
  for (int64_t k : {32, 4096, 14336}) {
    for (int64_t n_out : {8, 136}) {
      ASSERT_NO_FATAL_FAILURE(check_interleaved_matches_rows(
          make_weights(DType::kQ4_0, k, n_out, rng), {1, 2, 4, 5, 7, 33, 64}, rng));
    }
  }
}

// Q8_0 and Q4_1 interleaved by 16 rows: every path (AVX-512's lane-per-row
// kernels, 3 activation rows a tile; the others by rows) bit-identical to
// the scalar path on the file's rows, for decode's one activation row, every
// tail of the tiles, and threads splitting rows.
TEST(Matmul, InterleavedQ8_0AndQ4_1MatchRowsOnEveryIsa) {
  std::mt19937 rng(710);
  for (DType type : {DType::kQ8_0, DType::kQ4_1}) {
    for (int64_t k : {32, 4096, 14336}) {
      for (int64_t n_out : {16, 48}) {
        ASSERT_NO_FATAL_FAILURE(check_interleaved_matches_rows(make_weights(type, k, n_out, rng),
                                                               {1, 2, 3, 4, 5, 7, 33, 64}, rng));
      }
    }
  }
}

// Integer extremes through the 16-row layouts: Q8_0 weights of -128 and 127
// (the format holds -128 though the quantizer never writes it), Q4_1 nibbles
// of 15, Q4_0 weights of -8 and 7, against activations of +127, -127 and
// alternating, so any
// saturating or overflowing integer step would show.
TEST(Matmul, InterleavedExtremesMatchRowsOnEveryIsa) {
  const int64_t k = 8 * kQuantBlock, n_out = 16, n_x = 4;
  for (DType type : {DType::kQ8_0, DType::kQ4_1, DType::kQ4_0}) {
    SCOPED_TRACE(dtype_name(type));
    const WeightLayout layout =
        type == DType::kQ4_0 ? WeightLayout::kInterleaved16 : WeightLayout::kInterleaved;
    Weights w = zeroed_weights(type, k, n_out);
    for (int64_t j = 0; j < n_out; ++j) {
      uint8_t* row = w.bytes.data() + j * w.row_bytes;
      for (int64_t b = 0; b < k / kQuantBlock; ++b) {
        if (type == DType::kQ8_0) {
          auto& blk = reinterpret_cast<BlockQ8_0*>(row)[b];
          blk.d = fp32_to_fp16(0.01f);
          std::memset(blk.qs, j % 2 ? 0x80 : 0x7f, sizeof(blk.qs));  // -128 or 127
        } else if (type == DType::kQ4_1) {
          auto& blk = reinterpret_cast<BlockQ4_1*>(row)[b];
          blk.d = fp32_to_fp16(0.01f);
          blk.m = fp32_to_fp16(j % 2 ? -0.5f : 0.25f);
          std::memset(blk.qs, 0xff, sizeof(blk.qs));  // 15
        } else {
          auto& blk = reinterpret_cast<BlockQ4_0*>(row)[b];
          blk.d = fp32_to_fp16(0.01f);
          std::memset(blk.qs, j % 2 ? 0x00 : 0xff, sizeof(blk.qs));  // -8 or 7
        }
      }
      dequantize_row(type, row, w.values.data() + j * k, k);
    }
    std::vector<float> x(static_cast<size_t>(n_x * k));
    for (int64_t i = 0; i < n_x; ++i) {
      for (int64_t e = 0; e < k; ++e) {
        const float alternating = e % 2 ? 1.0f : -1.0f;
        x[i * k + e] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? -1.0f : alternating;
      }
    }
    ThreadPool pool(1);
    const std::vector<float> scalar = run_matmul(scalar_kernel_table(), w.matrix(), x, n_x, pool);
    std::vector<uint8_t> bytes(w.bytes.size());
    const WeightMatrix interleaved = interleave(w.matrix(), layout, bytes.data());
    for (Isa isa : supported_isas()) {
      const std::vector<float> y = run_matmul(kernel_table(isa), interleaved, x, n_x, pool);
      EXPECT_TRUE(bitwise_equal(y.data(), scalar.data(), y.size())) << isa_name(isa);
    }
    // The products themselves, not only agreement: a wrapped or saturated
    // integer would be off by far more than rounding (Q8_1 keeps the
    // activations' sum, which Q4_1's mins multiply, in half precision).
    PackedActivations packed;
    packed.pack(scalar_kernel_table(), x.data(), n_x, k, {type}, pool);
    const std::vector<double> ref = reference_matmul(w, packed);
    for (size_t e = 0; e < scalar.size(); ++e) {
      EXPECT_NEAR(scalar[e], ref[e], 1e-3 * max_abs(ref)) << "output " << e;
    }
  }
}

// Q4_0 interleaved by 16 rows (the AVX-512 path's layout): its lane-per-row
// kernel at every activation count (8 rows a tile), the others by rows.
TEST(Matmul, InterleavedQ4_0By16MatchesRowsOnEveryIsa) {
  std::mt19937 rng(720);
  for (int64_t k : {32, 4096, 14336}) {
    for (int64_t n_out : {16, 48}) {
      ASSERT_NO_FATAL_FAILURE(check_interleaved_matches_rows(
          make_weights(DType::kQ4_0, k, n_out, rng), {1, 2, 5, 7, 8, 9, 33, 64}, rng,
          WeightLayout::kInterleaved16));
    }
  }
}

// Which layout a matrix takes: Q4_0 by 16 rows where the path asks for it
// and the rows fill its groups, else by 8 where the path takes that, else
// the file's rows; the other types by their groups or not at all.
TEST(Matmul, PreferredLayoutFallsBackByGroup) {
  KernelTable kernels = scalar_kernel_table();
  kernels.interleave_q4_0 = kernels.interleave_q4_0_by_16 = kernels.interleave_q8_0 = true;
  const auto layout = [&](DType type, int64_t n_out) {
    return preferred_layout(kernels, make_weight_matrix(type, nullptr, 64, n_out));
  };
  EXPECT_EQ(layout(DType::kQ4_0, 32), WeightLayout::kInterleaved16);
  EXPECT_EQ(layout(DType::kQ4_0, 24), WeightLayout::kInterleaved);
  EXPECT_EQ(layout(DType::kQ4_0, 20), WeightLayout::kRows);
  EXPECT_EQ(layout(DType::kQ8_0, 32), WeightLayout::kInterleaved);
  EXPECT_EQ(layout(DType::kQ8_0, 24), WeightLayout::kRows);
  EXPECT_EQ(layout(DType::kQ4_1, 32), WeightLayout::kRows);  // not asked for
  EXPECT_EQ(layout(DType::kF32, 32), WeightLayout::kRows);   // no layout
  kernels.interleave_q4_0 = false;
  EXPECT_EQ(layout(DType::kQ4_0, 24), WeightLayout::kRows);
}

TEST(Matmul, ActivationTypes) {
  EXPECT_EQ(activation_type(DType::kF32), DType::kF32);
  EXPECT_EQ(activation_type(DType::kF16), DType::kF16);
  EXPECT_EQ(activation_type(DType::kQ8_0), DType::kQ8_0);
  EXPECT_EQ(activation_type(DType::kQ4_0), DType::kQ8_0);
  EXPECT_EQ(activation_type(DType::kQ4_1), DType::kQ8_1);
  EXPECT_EQ(activation_type(DType::kQ5_0), DType::kQ8_0);
  EXPECT_EQ(activation_type(DType::kQ4_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kQ6_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kBF16), DType::kBF16);
  EXPECT_EQ(activation_type(DType::kQ5_K), DType::kQ8_K);
  EXPECT_THROW(activation_type(DType::kQ3_K), std::exception);
}

}  // namespace
}  // namespace duet::cpu
