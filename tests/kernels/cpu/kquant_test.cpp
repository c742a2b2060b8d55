// BF16, Q4_K, Q5_K and Q6_K weights (and their activation types BF16 and Q8_K):
// the block layouts against hand-built blocks and hand-computed values, the
// Q8_K quantizer against llama.cpp's rounding, matmul on every ISA path
// against a double reference computed from the dequantized inputs, every
// path bit-identical to the scalar one, and batch invariance (a row alone, in
// batches of 1..9 rows at any position, with 1, 2 or 3 threads, any split of
// the weight rows).
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
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/cpu/matmul_checks.h"
#include "tests/kernels/cpu/matmul_reference.h"

namespace duet::cpu {
namespace {

using namespace test_support;

// ---------------------------------------------------------------------------
// Hand-built blocks.

// A Q4_K block with the given 6-bit scales and mins, packed as the layout
// comment in quant_blocks.h describes, and q(e) = (7e + 3) % 16.
BlockQ4_K hand_q4_k(const uint8_t* sc, const uint8_t* m) {
  BlockQ4_K b{};
  b.d = fp32_to_fp16(0.5f);
  b.dmin = fp32_to_fp16(0.25f);
  for (int s = 0; s < 4; ++s) {
    b.scales[s] = static_cast<uint8_t>(sc[s] | ((sc[s + 4] >> 4) << 6));
    b.scales[s + 4] = static_cast<uint8_t>(m[s] | ((m[s + 4] >> 4) << 6));
    b.scales[s + 8] = static_cast<uint8_t>((sc[s + 4] & 15) | ((m[s + 4] & 15) << 4));
  }
  for (int e = 0; e < kSuperBlock; ++e) {
    const int q = (7 * e + 3) % 16, g = e / 64, l = e % 64;
    if (l < 32) {
      b.qs[32 * g + l] = static_cast<uint8_t>(b.qs[32 * g + l] | q);
    } else {
      b.qs[32 * g + l - 32] = static_cast<uint8_t>(b.qs[32 * g + l - 32] | (q << 4));
    }
  }
  return b;
}

// A Q6_K block with d = 0.125, the given scales and q(e) = (5e + 1) % 64.
BlockQ6_K hand_q6_k(const int8_t* scales) {
  BlockQ6_K b{};
  b.d = fp32_to_fp16(0.125f);
  std::memcpy(b.scales, scales, 16);
  for (int e = 0; e < kSuperBlock; ++e) {
    const int q = (5 * e + 1) % 64, h = e / 128, part = (e % 128) / 32, l = e % 32;
    uint8_t& low = b.ql[64 * h + 32 * (part & 1) + l];
    low = static_cast<uint8_t>(low | (part < 2 ? (q & 15) : ((q & 15) << 4)));
    b.qh[32 * h + l] = static_cast<uint8_t>(b.qh[32 * h + l] | ((q >> 4) << (2 * part)));
  }
  return b;
}

constexpr uint8_t kSc[8] = {1, 2, 3, 63, 17, 33, 48, 5};
constexpr uint8_t kMin[8] = {0, 1, 62, 7, 20, 40, 63, 9};
constexpr int8_t kQ6Scales[16] = {-128, 127, -1, 5, 0, 64, -64, 3, 9, -7, 100, -100, 1, 2, 33, -33};

TEST(KQuantBlocks, Q4_KDequantizesToHandComputedValues) {
  const BlockQ4_K b = hand_q4_k(kSc, kMin);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc = 0, m = 0;
    q4_k_scale_min(b.scales, s, &sc, &m);
    EXPECT_EQ(sc, kSc[s]) << "sub-block " << s;
    EXPECT_EQ(m, kMin[s]) << "sub-block " << s;
  }
  float out[kSuperBlock];
  dequantize_row(DType::kQ4_K, &b, out, kSuperBlock);
  for (int e = 0; e < kSuperBlock; ++e) {
    const float expected =
        0.5f * kSc[e / 32] * static_cast<float>((7 * e + 3) % 16) - 0.25f * kMin[e / 32];
    ASSERT_EQ(out[e], expected) << "element " << e;
  }
}

TEST(KQuantBlocks, Q6_KDequantizesToHandComputedValues) {
  const BlockQ6_K b = hand_q6_k(kQ6Scales);
  // The scale d is the block's last two bytes.
  const auto* bytes = reinterpret_cast<const uint8_t*>(&b);
  EXPECT_EQ(bytes[208] | (bytes[209] << 8), fp32_to_fp16(0.125f));
  float out[kSuperBlock];
  dequantize_row(DType::kQ6_K, &b, out, kSuperBlock);
  for (int e = 0; e < kSuperBlock; ++e) {
    const float expected = 0.125f * kQ6Scales[e / 16] * static_cast<float>((5 * e + 1) % 64 - 32);
    ASSERT_EQ(out[e], expected) << "element " << e;
  }
}

TEST(KQuantBlocks, Q8_KQuantizesLikeLlamaCpp) {
  // The largest magnitude maps to -127 (d = -1 here), ties round to even.
  std::vector<float> x(2 * kSuperBlock, 0.0f);
  x[0] = 127.0f;
  x[1] = -63.5f;  // 63.5 -> 64
  x[2] = 0.5f;    // -0.5 -> 0
  x[3] = 1.5f;    // -1.5 -> -2
  x[20] = -2.5f;  // 2.5 -> 2
  // The second block is all zeros: d = 0, qs and bsums 0.
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    BlockQ8_K b[2];
    std::memset(b, 0x5a, sizeof(b));
    kernel_table(isa).quantize_q8_k(x.data(), b, 2 * kSuperBlock);
    EXPECT_EQ(b[0].d, -1.0f);
    EXPECT_EQ(b[0].qs[0], -127);
    EXPECT_EQ(b[0].qs[1], 64);
    EXPECT_EQ(b[0].qs[2], 0);
    EXPECT_EQ(b[0].qs[3], -2);
    EXPECT_EQ(b[0].qs[20], 2);
    EXPECT_EQ(b[0].bsums[0], -127 + 64 + 0 - 2);
    EXPECT_EQ(b[0].bsums[1], 2);
    for (int s = 2; s < 16; ++s) EXPECT_EQ(b[0].bsums[s], 0);
    EXPECT_EQ(b[1].d, 0.0f);
    for (int j = 0; j < kSuperBlock; ++j) ASSERT_EQ(b[1].qs[j], 0);
    for (int s = 0; s < 16; ++s) EXPECT_EQ(b[1].bsums[s], 0);
  }
}

// ggml's nearest_int: the float magic-number rounding (half to even).
int ggml_nearest_int(float fval) {
  const float val = fval + 12582912.0f;
  int32_t i = 0;
  std::memcpy(&i, &val, sizeof(i));
  return (i & 0x007fffff) - 0x00400000;
}

TEST(KQuantBlocks, Q8_KMatchesGgmlReferenceOnRandomRows) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 4 * kSuperBlock;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng) * (trial % 2 ? 3.0f : 0.01f);
    if (trial % 5 == 0) x[trial] = -40.0f;  // a negative largest magnitude (d > 0)
    for (Isa isa : supported_isas()) {
      std::vector<BlockQ8_K> got(n / kSuperBlock);
      kernel_table(isa).quantize_q8_k(x.data(), got.data(), n);
      for (int64_t b = 0; b < n / kSuperBlock; ++b) {
        const float* xb = x.data() + b * kSuperBlock;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < kSuperBlock; ++j) {
          if (std::fabs(xb[j]) > amax) {
            amax = std::fabs(xb[j]);
            max = xb[j];
          }
        }
        const float iscale = -127.0f / max;
        ASSERT_EQ(std::bit_cast<uint32_t>(got[b].d), std::bit_cast<uint32_t>(1 / iscale));
        for (int j = 0; j < kSuperBlock; ++j) {
          ASSERT_EQ(got[b].qs[j], std::min(127, ggml_nearest_int(iscale * xb[j])))
              << isa_name(isa) << " block " << b << " element " << j;
        }
        for (int s = 0; s < 16; ++s) {
          int sum = 0;
          for (int j = 0; j < 16; ++j) sum += got[b].qs[16 * s + j];
          ASSERT_EQ(got[b].bsums[s], sum);
        }
      }
    }
  }
}

TEST(KQuantBlocks, SimpleQuantizersStayClose) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 2 * kSuperBlock;
  for (DType type : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    for (float offset : {0.0f, 0.5f, -0.5f}) {
      std::vector<float> x(n), back(n);
      for (float& v : x) v = normal(rng) + offset;
      std::vector<uint8_t> bytes(dtype_row_bytes(type, n));
      quantize_row(type, x.data(), bytes.data(), n);
      dequantize_row(type, bytes.data(), back.data(), n);
      double err = 0.0, norm = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        err += (x[i] - back[i]) * (x[i] - back[i]);
        norm += x[i] * x[i];
      }
      // Relative RMS error of a 4-bit (5-bit, 6-bit) format with 6-bit (6-bit, 8-bit) scales.
      const double bound = type == DType::kQ4_K ? 0.12 : type == DType::kQ5_K ? 0.06 : 0.03;
      EXPECT_LT(std::sqrt(err / norm), bound) << dtype_name(type) << " offset " << offset;
    }
    std::vector<float> zeros(n, 0.0f), back(n, 1.0f);
    std::vector<uint8_t> bytes(dtype_row_bytes(type, n));
    quantize_row(type, zeros.data(), bytes.data(), n);
    dequantize_row(type, bytes.data(), back.data(), n);
    for (float v : back) ASSERT_EQ(v, 0.0f) << dtype_name(type);
  }
}

TEST(KQuantBlocks, Bf16ConversionMatchesScalarOnEveryIsa) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(1001);
  for (float& v : x) v = normal(rng) * 100.0f;
  x[0] = NAN;
  x[1] = INFINITY;
  x[2] = -0.0f;
  x[3] = 1.0f + 0x1p-8f;  // a tie, to even
  std::vector<uint16_t> want(x.size());
  convert_row_bf16(x.data(), want.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(want[3], fp32_to_bf16(1.0f));
  for (Isa isa : supported_isas()) {
    std::vector<uint16_t> got(x.size());
    kernel_table(isa).convert_bf16(x.data(), got.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(got, want) << isa_name(isa);
  }
}

// The hand-built blocks against hand-computed dot products: exact integer
// sums scaled once, so every path must land within float rounding of them.
TEST(KQuantBlocks, HandBuiltDotProductsOnEveryIsa) {
  std::vector<float> x(kSuperBlock);
  for (int e = 0; e < kSuperBlock; ++e) x[e] = static_cast<float>((e * 37) % 255 - 127);  // d = -1
  x[0] = -127.0f;
  std::vector<BlockQ8_K> xq(1);
  quantize_row_q8_k(x.data(), xq.data(), kSuperBlock);
  ASSERT_EQ(xq[0].d, 1.0f);
  const BlockQ4_K q4 = hand_q4_k(kSc, kMin);
  const BlockQ6_K q6 = hand_q6_k(kQ6Scales);
  double want4 = 0.0, want6 = 0.0;
  for (int e = 0; e < kSuperBlock; ++e) {
    want4 += (0.5 * kSc[e / 32] * ((7 * e + 3) % 16) - 0.25 * kMin[e / 32]) * xq[0].qs[e];
    want6 += 0.125 * kQ6Scales[e / 16] * ((5 * e + 1) % 64 - 32) * xq[0].qs[e];
  }
  for (Isa isa : supported_isas()) {
    const KernelTable& kernels = kernel_table(isa);
    float got4 = NAN, got6 = NAN;
    kernels.dot_q4_k(reinterpret_cast<const uint8_t*>(&q4), sizeof(q4), 1,
                     reinterpret_cast<const uint8_t*>(xq.data()), sizeof(BlockQ8_K), 1, kSuperBlock,
                     &got4, 1);
    kernels.dot_q6_k(reinterpret_cast<const uint8_t*>(&q6), sizeof(q6), 1,
                     reinterpret_cast<const uint8_t*>(xq.data()), sizeof(BlockQ8_K), 1, kSuperBlock,
                     &got6, 1);
    EXPECT_NEAR(got4, want4, std::fabs(want4) * 1e-6) << isa_name(isa);
    EXPECT_NEAR(got6, want6, std::fabs(want6) * 1e-6) << isa_name(isa);
  }
}

// ---------------------------------------------------------------------------
// Matrix products.

Weights make_weights(DType type, int64_t k, int64_t n_out, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return make_weights_with(type, k, n_out, [&](int64_t j, std::vector<float>& row) {
    const float offset = j % 3 == 0 ? 0.5f : 0.0f;  // some rows off-centre (Q4_K's mins)
    for (int64_t e = 0; e < k; ++e) {
      // Every fifth row has a zero sub-block (scale 0) and a large one.
      const bool zero = j % 5 == 1 && e >= 32 && e < 64;
      const float big = j % 5 == 1 && e >= 96 && e < 112 ? 20.0f : 1.0f;
      row[e] = zero ? 0.0f : (normal(rng) * 0.1f + offset) * big;
    }
  });
}

std::vector<int64_t> test_ks(DType type) {
  if (type == DType::kBF16) return {32, 64, 256, 576, 7, 40, 100};  // and tails past 32-chunks
  return {256, 512, 1536};
}

class KQuantMatmulTest : public ::testing::TestWithParam<DType> {};

TEST_P(KQuantMatmulTest, MatchesReferenceAndScalarOnEveryIsa) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 100);
  ThreadPool pool(2);
  int n_cases = 0;
  for (int64_t k : test_ks(type)) {
    for (int64_t n_out : {1, 3, 33, 100}) {
      const Weights w = make_weights(type, k, n_out, rng);
      for (int64_t n_x : {1, 2, 3, 5, 8, 9, 17}) {
        SCOPED_TRACE(shape_name(type, k, n_out, n_x));
        const std::vector<float> x = random_activations(n_x, k, rng);
        PackedActivations scalar_packed;
        scalar_packed.pack(scalar_kernel_table(), x.data(), n_x, k, {type}, pool);
        ASSERT_NO_FATAL_FAILURE(check_matches_reference_on_every_isa(
            w, x, n_x, scalar_packed, reference_matmul(w, scalar_packed), /*bit_identical=*/true,
            pool));
        n_cases += static_cast<int>(supported_isas().size());
      }
    }
  }
  EXPECT_GT(n_cases, 0);
}

// The shapes where the batched K-quant paths change strategy: below and at
// the activation rows they start from, passes of rows sized by k (several,
// with every tail), the AVX2 panel's longest rows (k = 32768) and the first
// it leaves to the row tiles; for the AVX-512 tiles, groups of 16 activation
// rows and of 8 weight rows, whole and cut short. Every path bit-identical to
// the scalar one.
TEST_P(KQuantMatmulTest, BatchedShapeEdgesMatchScalar) {
  const DType type = GetParam();
  if (type == DType::kBF16) GTEST_SKIP() << "no batched K-quant path for BF16";
  std::mt19937 rng(static_cast<uint32_t>(type) + 700);
  ThreadPool pool(1);
  struct Shape {
    int64_t k, n_out;
    std::vector<int64_t> n_xs;
  };
  const std::vector<Shape> shapes = {
      {256, 5, {7, 8, 15, 64, 65, 130}},
      {8192, 5, {7, 8, 15, 64, 65, 130}},
      {32768, 5, {7, 8, 15, 64, 65, 130}},
      {33024, 5, {7, 8, 15, 64, 65, 130}},
      {512, 21, {8, 16, 17, 31, 32, 47, 64}},
      {768, 8, {9, 16, 48}},
      {1024, 16, {24, 40}},
  };
  for (const Shape& shape : shapes) {
    const int64_t k = shape.k, n_out = shape.n_out;
    const Weights w = make_weights(type, k, n_out, rng);
    for (int64_t n_x : shape.n_xs) {
      SCOPED_TRACE(shape_name(type, k, n_out, n_x));
      const std::vector<float> x = random_activations(n_x, k, rng);
      const std::vector<float> scalar = run_matmul(scalar_kernel_table(), w.matrix(), x, n_x, pool);
      for (Isa isa : supported_isas()) {
        const std::vector<float> y = run_matmul(kernel_table(isa), w.matrix(), x, n_x, pool);
        EXPECT_TRUE(bitwise_equal(y.data(), scalar.data(), y.size())) << isa_name(isa);
      }
    }
  }
}

// Q4_K and Q6_K interleaved by 16 rows: the layout gives back the file's
// rows, and every path (AVX-512's lane-per-row kernels; the others by rows)
// is bit-identical to the scalar path on the file's rows, for decode's one
// activation row, every tail of the 8-row tiles, and threads splitting rows.
void check_interleaved_type(DType type) {
  std::mt19937 rng(900);
  for (int64_t k : {256, 4096, 14336}) {
    for (int64_t n_out : {16, 48}) {
      ASSERT_NO_FATAL_FAILURE(check_interleaved_matches_rows(make_weights(type, k, n_out, rng),
                                                             {1, 2, 7, 8, 9, 33, 64}, rng));
    }
  }
}

TEST(KQuantInterleaved, Q4_KMatchesRowsOnEveryIsa) { check_interleaved_type(DType::kQ4_K); }

// Q6_K's kernel unpacks as it goes for up to 8 rows and into a panel above.
TEST(KQuantInterleaved, Q6_KMatchesRowsOnEveryIsa) { check_interleaved_type(DType::kQ6_K); }

// Integer extremes: every weight and activation at the largest magnitude its
// format holds, so any saturating or overflowing integer step would show, in
// the file's rows and (Q4_K, Q6_K) interleaved by 16.
class KQuantExtremeTest : public ::testing::TestWithParam<DType> {};

TEST_P(KQuantExtremeTest, ExtremeBlocksAgreeOnEveryIsa) {
  const DType type = GetParam();
  // 9 activation rows: the 16-row kernels' panel path too (above 8).
  const int64_t k = 4 * kSuperBlock, n_out = 16, n_x = 9;
  Weights w = zeroed_weights(type, k, n_out);
  for (int64_t j = 0; j < n_out; ++j) {
    uint8_t* row = w.bytes.data() + j * w.row_bytes;
    const int64_t p = j % 4;  // the row's pattern
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
      if (type == DType::kQ4_K) {
        auto& blk = reinterpret_cast<BlockQ4_K*>(row)[b];
        blk.d = fp32_to_fp16(0.01f);
        blk.dmin = fp32_to_fp16(0.02f);
        std::memset(blk.scales, p % 2 ? 0xff : 0x3f,
                    sizeof(blk.scales));  // sc = m = 63 (or low bits)
        std::memset(blk.qs, p < 2 ? 0xff : 0x0f, sizeof(blk.qs));
      } else if (type == DType::kQ5_K) {
        auto& blk = reinterpret_cast<BlockQ5_K*>(row)[b];
        blk.d = fp32_to_fp16(0.01f);
        blk.dmin = fp32_to_fp16(0.02f);
        std::memset(blk.scales, p % 2 ? 0xff : 0x3f, sizeof(blk.scales));
        std::memset(blk.qs, p < 2 ? 0xff : 0x0f, sizeof(blk.qs));
        std::memset(blk.qh, p < 2 ? 0xff : 0x00, sizeof(blk.qh));  // q = 31 or 15
      } else {
        auto& blk = reinterpret_cast<BlockQ6_K*>(row)[b];
        blk.d = fp32_to_fp16(0.01f);
        std::memset(blk.scales, p % 2 ? 0x80 : 0x7f, sizeof(blk.scales));  // -128 or 127
        std::memset(blk.ql, p < 2 ? 0xff : 0x00, sizeof(blk.ql));
        std::memset(blk.qh, p < 2 ? 0xff : 0x00, sizeof(blk.qh));  // q = 63 or 0
      }
    }
    dequantize_row(type, row, w.values.data() + j * k, k);
  }
  std::vector<float> x(static_cast<size_t>(n_x * k));
  for (int64_t i = 0; i < n_x; ++i) {
    for (int64_t e = 0; e < k; ++e) {
      const float alternating = e % 2 ? 1.0f : -1.0f;
      x[i * k + e] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? -1.0f : alternating;  // all +127, all -127
    }
  }
  ThreadPool pool(1);
  PackedActivations scalar_packed;
  scalar_packed.pack(scalar_kernel_table(), x.data(), n_x, k, {type}, pool);
  const std::vector<double> ref = reference_matmul(w, scalar_packed);
  const double ref_max = max_abs(ref);
  std::vector<float> scalar_y;
  for (Isa isa : supported_isas()) {
    const std::vector<float> y = run_matmul(kernel_table(isa), w.matrix(), x, n_x, pool);
    for (size_t e = 0; e < y.size(); ++e) {
      EXPECT_LT(std::fabs(y[e] - ref[e]) / ref_max, 1e-5) << isa_name(isa) << " output " << e;
    }
    if (isa == Isa::kScalar) {
      scalar_y = y;
    } else {
      EXPECT_TRUE(bitwise_equal(y.data(), scalar_y.data(), y.size())) << isa_name(isa);
    }
  }
  if (type == DType::kQ5_K) return;  // kept in the file's rows
  std::vector<uint8_t> bytes(w.bytes.size());
  const WeightMatrix interleaved = interleave(w.matrix(), WeightLayout::kInterleaved, bytes.data());
  for (Isa isa : supported_isas()) {
    const std::vector<float> y = run_matmul(kernel_table(isa), interleaved, x, n_x, pool);
    EXPECT_TRUE(bitwise_equal(y.data(), scalar_y.data(), y.size()))
        << isa_name(isa) << ", interleaved";
  }
}

INSTANTIATE_TEST_SUITE_P(KQuantTypes, KQuantExtremeTest,
                         ::testing::Values(DType::kQ4_K, DType::kQ5_K, DType::kQ6_K),
                         dtype_param_name);

// Row i of a batch is bitwise the row computed alone or in any smaller batch
// at any position, with any thread count; any split of the weight rows gives
// the same columns.
TEST_P(KQuantMatmulTest, BatchInvariantOnEveryIsa) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 200);
  const int64_t n_x = 70;    // two activation tasks (64 + 6)
  const int64_t n_out = 75;  // three weight tasks (32 + 32 + 11)
  const int64_t k = type == DType::kBF16 ? 100 : 512;
  const Weights w = make_weights(type, k, n_out, rng);
  const std::vector<float> x = random_activations(n_x, k, rng);
  const BatchLayouts layouts{.sub_batch_sizes = {1, 2, 3, 4, 5, 6, 7, 8, 9},
                             .starts = {0, 1, 3, 13},
                             .weight_splits = {1, 7, 32, 33, 50}};
  ASSERT_NO_FATAL_FAILURE(check_batch_invariance(w, x, n_x, layouts));
}

// The dot tile functions called directly: any tiling writes the same bits
// and nothing past n_w.
TEST_P(KQuantMatmulTest, DotTileSplitsAreBitIdentical) {
  const DType type = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(type) + 300);
  ThreadPool pool(1);
  const int64_t k = type == DType::kBF16 ? 72 : 768;
  const int64_t n_out = 37, n_x = 11;
  const Weights w = make_weights(type, k, n_out, rng);
  const std::vector<float> x = random_activations(n_x, k, rng);
  ASSERT_NO_FATAL_FAILURE(
      check_dot_tile_splits(w, x, n_x, {1, 2, 5, 37}, {1, 2, 3, 4, 7, 8, 9, 11}, pool));
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, KQuantMatmulTest,
                         ::testing::Values(DType::kBF16, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K),
                         dtype_param_name);

TEST(KQuantMatmul, OnePackServesEveryWeightType) {
  std::mt19937 rng(400);
  ThreadPool pool(2);
  const int64_t k = 512, n_out = 9, n_x = 6;
  const std::vector<float> x = random_activations(n_x, k, rng);
  const DType types[] = {DType::kQ4_K, DType::kBF16, DType::kQ6_K, DType::kQ4_1,
                         DType::kQ8_0, DType::kF16,  DType::kF32};
  for (Isa isa : supported_isas()) {
    const KernelTable& kernels = kernel_table(isa);
    PackedActivations shared;
    shared.pack(kernels, x.data(), n_x, k,
                {DType::kQ4_K, DType::kBF16, DType::kQ6_K, DType::kQ4_1, DType::kQ8_0, DType::kF16,
                 DType::kF32},
                pool);
    for (DType type : types) {
      expect_shared_pack_serves(isa, make_weights(type, k, n_out, rng), shared, x, n_x, pool);
    }
  }
}

TEST(KQuantMatmul, TypesAreWired) {
  EXPECT_EQ(activation_type(DType::kBF16), DType::kBF16);
  EXPECT_EQ(activation_type(DType::kQ4_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kQ5_K), DType::kQ8_K);
  EXPECT_EQ(activation_type(DType::kQ6_K), DType::kQ8_K);
  EXPECT_THROW(activation_type(DType::kQ3_K), std::exception);
  for (DType type : {DType::kBF16, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    EXPECT_TRUE(dtype_is_supported_weight(type)) << dtype_name(type);
  }
  for (DType type : {DType::kQ2_K, DType::kQ3_K, DType::kQ8_K}) {
    EXPECT_FALSE(dtype_is_supported_weight(type)) << dtype_name(type);
  }
}

}  // namespace
}  // namespace duet::cpu
