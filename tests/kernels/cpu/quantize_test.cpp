// Number formats and quantizers: every IEEE half and bfloat16 bit pattern
// round trips, fp32 -> fp16 matches the F16C instruction, each block format
// stays within its error bound, and every ISA path's activation quantizers
// write the scalar reference's bytes exactly.
#include "kernels/cpu/quantize.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/model/dtype.h"
#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"

namespace duet::cpu {
namespace {

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// ---------------------------------------------------------------------------
// IEEE half.

TEST(Fp16, EveryHalfRoundTrips) {
  int n_nan = 0;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    const uint16_t back = fp32_to_fp16(f);
    const bool is_nan_pattern = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    ASSERT_EQ(std::isnan(f), is_nan_pattern) << std::hex << h;
    if (is_nan_pattern) {
      ++n_nan;
      EXPECT_TRUE(std::isnan(fp16_to_fp32(back))) << std::hex << h << " -> " << back;
      EXPECT_EQ(back & 0x8000u, h & 0x8000u) << "NaN sign, " << std::hex << h;
    } else {
      ASSERT_EQ(back, h) << std::hex << "half " << h << " -> float " << f;
    }
  }
  EXPECT_EQ(n_nan, 2 * 1023);
}

TEST(Fp16, KnownValues) {
  EXPECT_EQ(fp16_to_fp32(0x3c00), 1.0f);
  EXPECT_EQ(fp16_to_fp32(0xc000), -2.0f);
  EXPECT_EQ(fp16_to_fp32(0x7bff), 65504.0f);
  EXPECT_EQ(fp16_to_fp32(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(fp16_to_fp32(0x0400), 0x1p-14f);  // smallest normal
  EXPECT_EQ(fp16_to_fp32(0x7c00), INFINITY);
  EXPECT_EQ(bits(fp16_to_fp32(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(fp32_to_fp16(65519.0f), 0x7bff);           // below the halfway point to 65536
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7c00);           // a tie, rounded to even: infinity
  EXPECT_EQ(fp32_to_fp16(1e10f), 0x7c00);
  EXPECT_EQ(fp32_to_fp16(-1e10f), 0xfc00);
  EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);    // tie between 0 and the smallest subnormal
  EXPECT_EQ(fp32_to_fp16(0x1.8p-24f), 0x0002);  // tie between 1 and 2 subnormal steps
  EXPECT_EQ(fp32_to_fp16(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00);      // tie, to even
  EXPECT_EQ(fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie, to even
  EXPECT_EQ(fp32_to_fp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-std::numeric_limits<float>::denorm_min()), 0x8000);
}

__attribute__((target("f16c"))) uint16_t f16c_fp32_to_fp16(float f) {
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("f16c"))) float f16c_fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

bool half_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// Compares with the hardware conversion; NaNs need only stay NaN (payloads differ).
void expect_matches_f16c(float f, int* n_failures) {
  const uint16_t ours = fp32_to_fp16(f);
  const uint16_t hw = f16c_fp32_to_fp16(f);
  const bool same =
      half_is_nan(hw) ? half_is_nan(ours) && (ours & 0x8000u) == (hw & 0x8000u) : ours == hw;
  if (!same && ++*n_failures <= 10) {
    ADD_FAILURE() << "fp32_to_fp16(" << f << " = 0x" << std::hex << bits(f) << ") = 0x" << ours
                  << ", F16C gives 0x" << hw;
  }
}

TEST(Fp16, MatchesF16cConversion) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C";
  int n_failures = 0;
  // Every half widens exactly as the hardware does (signalling NaNs come back quiet).
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float ours = fp16_to_fp32(static_cast<uint16_t>(h));
    const float hw = f16c_fp16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(hw)) {
      EXPECT_TRUE(std::isnan(ours)) << std::hex << h;
    } else {
      EXPECT_EQ(bits(ours), bits(hw)) << std::hex << h;
    }
  }
  std::mt19937 rng(1234);
  // Any bit pattern: NaNs, infinities, huge and tiny values.
  for (int i = 0; i < 1'000'000; ++i) expect_matches_f16c(from_bits(rng()), &n_failures);
  // Magnitudes around the half range, 2^-26 .. 2^17, where rounding happens.
  std::uniform_int_distribution<uint32_t> exponent(127 - 26, 127 + 17);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  for (int i = 0; i < 2'000'000; ++i) {
    const uint32_t sign = (rng() & 1u) << 31;
    expect_matches_f16c(from_bits(sign | exponent(rng) << 23 | mantissa(rng)), &n_failures);
  }
  // Exact ties and their neighbours: for normal halves the 13 dropped bits are
  // 0x1000; for subnormal halves (|f| < 2^-14) the tie sits at (m + 1/2) 2^-24.
  for (int i = 0; i < 500'000; ++i) {
    const uint32_t sign = (rng() & 1u) << 31;
    const uint32_t e = 127 - 14 + rng() % 31;  // normal halves
    const uint32_t tie = sign | e << 23 | (mantissa(rng) & ~0x1fffu) | 0x1000u;
    for (int delta : {-1, 0, 1}) expect_matches_f16c(from_bits(tie + delta), &n_failures);
  }
  for (int m = 0; m < 1024; ++m) {
    const float tie = (static_cast<float>(m) + 0.5f) * 0x1p-24f;
    for (float f : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1.0f), -tie}) {
      expect_matches_f16c(f, &n_failures);
    }
  }
  // Every float from the largest half to 2^17 (the overflow boundary), every
  // 7th float from 2^-27 to 2^-14 (the subnormal halves), and a sample of the
  // float subnormals (all round to zero).
  for (uint32_t b = bits(65504.0f); b <= bits(131072.0f); ++b) {
    expect_matches_f16c(from_bits(b), &n_failures);
    expect_matches_f16c(-from_bits(b), &n_failures);
  }
  for (uint32_t b = bits(0x1p-27f); b <= bits(0x1p-14f); b += 7) {
    expect_matches_f16c(from_bits(b), &n_failures);
  }
  for (uint32_t b = 0; b < (1u << 23); b += 4099) expect_matches_f16c(from_bits(b), &n_failures);
  EXPECT_EQ(n_failures, 0);
}

// ---------------------------------------------------------------------------
// bfloat16.

TEST(Bf16, EveryBf16RoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = bf16_to_fp32(static_cast<uint16_t>(h));
    const uint16_t back = fp32_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_fp32(back))) << std::hex << h << " -> " << back;
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

// Round to nearest even by comparing distances in double.
uint16_t reference_fp32_to_bf16(float f) {
  const uint32_t x = bits(f);
  const uint32_t down = x & 0xffff0000u;
  const uint32_t up = down + 0x10000u;  // next magnitude; 0x7f80 is infinity
  const auto magnitude = [](uint32_t b) {
    if ((b & 0x7f800000u) == 0x7f800000u) return std::ldexp(1.0, 128);  // as if unbounded
    return std::fabs(static_cast<double>(from_bits(b)));
  };
  const double a = std::fabs(static_cast<double>(f));
  const double d_down = a - magnitude(down), d_up = magnitude(up) - a;
  if (d_down < d_up) return static_cast<uint16_t>(down >> 16);
  if (d_up < d_down) return static_cast<uint16_t>(up >> 16);
  return static_cast<uint16_t>(((down >> 16) & 1u) ? up >> 16 : down >> 16);
}

TEST(Bf16, RoundsToNearestEven) {
  std::mt19937 rng(99);
  int n_failures = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    uint32_t x = rng();
    if (i % 2 == 1) x = (x & 0xffff0000u) | 0x8000u | (i % 4 == 1 ? 0u : (rng() & 1u));  // ties
    const float f = from_bits(x);
    const uint16_t ours = fp32_to_bf16(f);
    if (std::isnan(f)) {
      if (!std::isnan(bf16_to_fp32(ours)) && ++n_failures <= 10) ADD_FAILURE() << std::hex << x;
      continue;
    }
    if (ours != reference_fp32_to_bf16(f) && ++n_failures <= 10) {
      ADD_FAILURE() << std::hex << "fp32_to_bf16(0x" << x << ") = 0x" << ours << ", expected 0x"
                    << reference_fp32_to_bf16(f);
    }
  }
  EXPECT_EQ(n_failures, 0);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to infinity
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie, to even
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie, to even
}

// ---------------------------------------------------------------------------
// Block formats: round-trip error within the format's bound.

// A row with a few hard blocks: zeros, one nonzero element, constant values,
// very different magnitudes, all-negative and all-positive blocks.
std::vector<float> test_row(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    float* xb = x.data() + b * kQuantBlock;
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
    for (int j = 0; j < kQuantBlock; ++j) xb[j] = normal(rng) * scale;
    switch (b % 8) {
      case 1:
        std::fill(xb, xb + kQuantBlock, 0.0f);
        break;
      case 2:
        std::fill(xb, xb + kQuantBlock, 0.0f);
        xb[rng() % kQuantBlock] = -3.0f;
        break;
      case 3:
        std::fill(xb, xb + kQuantBlock, 0.75f);
        break;
      case 4:
        for (int j = 0; j < kQuantBlock; ++j) xb[j] = -std::fabs(xb[j]);
        break;
      case 5:
        for (int j = 0; j < kQuantBlock; ++j) xb[j] = std::fabs(xb[j]) + 5 * scale;
        break;
      default:
        break;
    }
  }
  return x;
}

constexpr int64_t kRowLength = 64 * kQuantBlock;

// A block's value of largest magnitude, with its sign.
float signed_max(const float* xb) {
  float max = 0.0f;
  for (int j = 0; j < kQuantBlock; ++j) {
    if (std::fabs(xb[j]) > std::fabs(max)) max = xb[j];
  }
  return max;
}

TEST(BlockFormats, Q8_0WithinHalfAStep) {
  std::mt19937 rng(1);
  for (int iter = 0; iter < 20; ++iter) {
    const std::vector<float> x = test_row(kRowLength, rng);
    std::vector<BlockQ8_0> q(kRowLength / kQuantBlock);
    std::vector<float> y(kRowLength);
    quantize_row_q8_0(x.data(), q.data(), kRowLength);
    dequantize_row(DType::kQ8_0, q.data(), y.data(), kRowLength);
    for (int64_t b = 0; b < kRowLength / kQuantBlock; ++b) {
      float amax = 0.0f;
      for (int j = 0; j < kQuantBlock; ++j)
        amax = std::max(amax, std::fabs(x[b * kQuantBlock + j]));
      const float d = amax / 127.0f;
      ASSERT_EQ(q[b].d, fp32_to_fp16(d)) << "block " << b;
      const double d_half = fp16_to_fp32(q[b].d);
      // Half a step, plus up to 127 times the scale's rounding to half.
      const double bound = 0.5 * d + 127.0 * std::fabs(d - d_half) + 1e-6 * amax;
      for (int j = 0; j < kQuantBlock; ++j) {
        const int64_t e = b * kQuantBlock + j;
        ASSERT_LE(std::abs(q[b].qs[j]), 127);
        ASSERT_LE(std::fabs(static_cast<double>(x[e]) - y[e]), bound)
            << "element " << e << " x " << x[e] << " step " << d;
      }
    }
  }
}

TEST(BlockFormats, Q8_1WithinHalfAStepAndSumMatches) {
  std::mt19937 rng(2);
  for (int iter = 0; iter < 20; ++iter) {
    const std::vector<float> x = test_row(kRowLength, rng);
    std::vector<BlockQ8_1> q(kRowLength / kQuantBlock);
    std::vector<BlockQ8_0> q0(kRowLength / kQuantBlock);
    std::vector<float> y(kRowLength);
    quantize_row_q8_1(x.data(), q.data(), kRowLength);
    quantize_row_q8_0(x.data(), q0.data(), kRowLength);
    dequantize_row(DType::kQ8_1, q.data(), y.data(), kRowLength);
    for (int64_t b = 0; b < kRowLength / kQuantBlock; ++b) {
      // The same values and scale as Q8_0.
      ASSERT_EQ(q[b].d, q0[b].d);
      ASSERT_EQ(std::memcmp(q[b].qs, q0[b].qs, kQuantBlock), 0) << "block " << b;
      float amax = 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < kQuantBlock; ++j) {
        amax = std::max(amax, std::fabs(x[b * kQuantBlock + j]));
        sum += q[b].qs[j];
      }
      const float d = amax / 127.0f;
      // s is the unrounded scale times the integer sum, rounded to half once.
      ASSERT_EQ(q[b].s, fp32_to_fp16(d * static_cast<float>(sum))) << "block " << b;
      const double bound = 0.5 * d + 127.0 * std::fabs(d - fp16_to_fp32(q[b].d)) + 1e-6 * amax;
      for (int j = 0; j < kQuantBlock; ++j) {
        const int64_t e = b * kQuantBlock + j;
        ASSERT_LE(std::fabs(static_cast<double>(x[e]) - y[e]), bound) << "element " << e;
      }
    }
  }
}

TEST(BlockFormats, Q4_0WithinHalfAStep) {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 20; ++iter) {
    const std::vector<float> x = test_row(kRowLength, rng);
    std::vector<BlockQ4_0> q(kRowLength / kQuantBlock);
    std::vector<float> y(kRowLength);
    quantize_row_q4_0(x.data(), q.data(), kRowLength);
    dequantize_row(DType::kQ4_0, q.data(), y.data(), kRowLength);
    for (int64_t b = 0; b < kRowLength / kQuantBlock; ++b) {
      const float* xb = x.data() + b * kQuantBlock;
      const float max = signed_max(xb);
      const float d = max / -8.0f;  // max itself maps to -8 steps exactly
      ASSERT_EQ(q[b].d, fp32_to_fp16(d)) << "block " << b;
      const double step = std::fabs(d);
      const double scale_error = 8.0 * std::fabs(d - fp16_to_fp32(q[b].d));
      for (int j = 0; j < kQuantBlock; ++j) {
        const int e = j < 16 ? (q[b].qs[j] & 0x0f) : (q[b].qs[j - 16] >> 4);
        // Levels run -8..7 steps; a value beyond 7.5 steps on the side opposite
        // `max` clamps to 7 and may be off by up to a whole step.
        const double bound = (e == 15 ? step : 0.5 * step) + scale_error + 1e-6 * step;
        ASSERT_LE(std::fabs(static_cast<double>(xb[j]) - y[b * kQuantBlock + j]), bound)
            << "block " << b << " element " << j << " x " << xb[j] << " step " << step;
      }
    }
  }
}

TEST(BlockFormats, Q5_0WithinHalfAStep) {
  std::mt19937 rng(5);
  for (int iter = 0; iter < 20; ++iter) {
    const std::vector<float> x = test_row(kRowLength, rng);
    std::vector<BlockQ5_0> q(kRowLength / kQuantBlock);
    std::vector<float> y(kRowLength);
    quantize_row(DType::kQ5_0, x.data(), q.data(), kRowLength);
    dequantize_row(DType::kQ5_0, q.data(), y.data(), kRowLength);
    for (int64_t b = 0; b < kRowLength / kQuantBlock; ++b) {
      const float* xb = x.data() + b * kQuantBlock;
      const float max = signed_max(xb);
      const float d = max / -16.0f;  // max maps to -16 steps exactly
      ASSERT_EQ(q[b].d, fp32_to_fp16(d)) << "block " << b;
      const double step = std::fabs(d);
      const double scale_error = 16.0 * std::fabs(d - fp16_to_fp32(q[b].d));
      uint32_t qh;
      std::memcpy(&qh, q[b].qh, sizeof qh);
      for (int j = 0; j < kQuantBlock; ++j) {
        const int e = (j < 16 ? (q[b].qs[j] & 0x0f) : (q[b].qs[j - 16] >> 4)) |
                      static_cast<int>((qh >> j) & 1) << 4;
        // Levels run -16..15 steps; beyond 15.5 on the far side clamps to 15.
        const double bound = (e == 31 ? step : 0.5 * step) + scale_error + 1e-6 * step;
        ASSERT_LE(std::fabs(static_cast<double>(xb[j]) - y[b * kQuantBlock + j]), bound)
            << "block " << b << " element " << j << " x " << xb[j] << " step " << step;
      }
    }
  }
  // One hand-made block: element j is (j - 16) steps of 0.5 (its fifth bit set for j >= 16).
  BlockQ5_0 block{};
  block.d = fp32_to_fp16(0.5f);
  uint32_t qh = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    const int level = j;  // stored level; value (level - 16) * d
    if (j < 16) {
      block.qs[j] = static_cast<uint8_t>((block.qs[j] & 0xf0) | (level & 0x0f));
    } else {
      block.qs[j - 16] = static_cast<uint8_t>((block.qs[j - 16] & 0x0f) | (level & 0x0f) << 4);
    }
    qh |= static_cast<uint32_t>(level >> 4) << j;
  }
  std::memcpy(block.qh, &qh, sizeof qh);
  float values[kQuantBlock];
  dequantize_row(DType::kQ5_0, &block, values, kQuantBlock);
  for (int j = 0; j < kQuantBlock; ++j) EXPECT_EQ(values[j], 0.5f * (j - 16)) << j;
}

TEST(BlockFormats, Q4_1WithinHalfAStep) {
  std::mt19937 rng(4);
  for (int iter = 0; iter < 20; ++iter) {
    const std::vector<float> x = test_row(kRowLength, rng);
    std::vector<BlockQ4_1> q(kRowLength / kQuantBlock);
    std::vector<float> y(kRowLength);
    quantize_row_q4_1(x.data(), q.data(), kRowLength);
    dequantize_row(DType::kQ4_1, q.data(), y.data(), kRowLength);
    for (int64_t b = 0; b < kRowLength / kQuantBlock; ++b) {
      const float* xb = x.data() + b * kQuantBlock;
      const float min = *std::min_element(xb, xb + kQuantBlock);
      const float max = *std::max_element(xb, xb + kQuantBlock);
      const float d = (max - min) / 15.0f;
      ASSERT_EQ(q[b].d, fp32_to_fp16(d));
      ASSERT_EQ(q[b].m, fp32_to_fp16(min));
      const double bound = 0.5 * d + 15.0 * std::fabs(d - fp16_to_fp32(q[b].d)) +
                           std::fabs(min - fp16_to_fp32(q[b].m)) +
                           1e-6 * std::max(std::fabs(min), std::fabs(max));
      for (int j = 0; j < kQuantBlock; ++j) {
        ASSERT_LE(std::fabs(static_cast<double>(xb[j]) - y[b * kQuantBlock + j]), bound)
            << "block " << b << " element " << j << " x " << xb[j] << " step " << d;
      }
    }
  }
}

TEST(BlockFormats, ZeroRowsStayZero) {
  const std::vector<float> zeros(kRowLength, 0.0f);
  for (DType type : {DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ8_0, DType::kQ8_1,
                     DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> q(dtype_row_bytes(type, kRowLength));
    std::vector<float> y(kRowLength, 1.0f);
    quantize_row(type, zeros.data(), q.data(), kRowLength);
    dequantize_row(type, q.data(), y.data(), kRowLength);
    for (float v : y) ASSERT_EQ(v, 0.0f) << dtype_name(type);
  }
}

TEST(BlockFormats, Q8RoundsTiesToEven) {
  // amax = 127 makes the step exactly 1, so x.5 values are exact ties.
  float x[kQuantBlock];
  for (int j = 0; j < kQuantBlock; ++j) x[j] = static_cast<float>(j - 16) + 0.5f;
  x[31] = 127.0f;
  BlockQ8_0 q;
  quantize_row_q8_0(x, &q, kQuantBlock);
  EXPECT_EQ(fp16_to_fp32(q.d), 1.0f);
  for (int j = 0; j < 31; ++j) {
    EXPECT_EQ(q.qs[j], static_cast<int8_t>(std::nearbyint(x[j]))) << x[j];
    EXPECT_EQ(q.qs[j] % 2, 0) << x[j];
  }
  EXPECT_EQ(q.qs[31], 127);
}

// ---------------------------------------------------------------------------
// Every ISA's activation quantizers against the scalar reference, byte for byte.

std::vector<std::vector<float>> activation_rows(std::mt19937& rng) {
  std::vector<std::vector<float>> rows;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n : {32, 64, 96, 576, 1536, 4096}) {
    for (float scale : {1e-3f, 1.0f, 37.5f, 3e4f}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = normal(rng) * scale;
      rows.push_back(x);
    }
    rows.push_back(std::vector<float>(static_cast<size_t>(n), 0.0f));  // all zero
    rows.push_back(test_row(n, rng));
    // Exact ties: each block's amax is 127 * 2^e, so the inverse step is
    // 2^-e and (m + 1/2) 2^e lands exactly halfway.
    std::vector<float> ties(static_cast<size_t>(n));
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
      const int e = static_cast<int>(rng() % 16) - 8;
      for (int j = 0; j < kQuantBlock; ++j) {
        const int m = static_cast<int>(rng() % 253) - 126;  // -126..126
        ties[b * kQuantBlock + j] = std::ldexp(static_cast<float>(m) + 0.5f, e);
      }
      ties[b * kQuantBlock + rng() % kQuantBlock] = std::ldexp(rng() % 2 ? 127.0f : -127.0f, e);
    }
    rows.push_back(ties);
    // Integers and halves on a step of 1 (amax 127), incl. negative zero.
    std::vector<float> steps(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      steps[i] = static_cast<float>(static_cast<int>(i % 255) - 127) / 2.0f;
    for (int64_t b = 0; b < n / kQuantBlock; ++b) steps[b * kQuantBlock] = 127.0f;
    steps[1] = -0.0f;
    rows.push_back(steps);
  }
  return rows;
}

TEST(ActivationQuantizers, EveryIsaMatchesScalarByteForByte) {
  std::mt19937 rng(5);
  const std::vector<std::vector<float>> rows = activation_rows(rng);
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const KernelTable& kernels = kernel_table(isa);
    EXPECT_EQ(kernels.isa, isa);
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<float>& x = rows[r];
      const auto n = static_cast<int64_t>(x.size());
      for (DType type : {DType::kQ8_0, DType::kQ8_1, DType::kF16}) {
        const size_t row_bytes = dtype_row_bytes(type, n);
        std::vector<uint8_t> expected(row_bytes), actual(row_bytes, 0xcd);
        ConvertRowFn fn = type == DType::kQ8_0   ? kernels.quantize_q8_0
                          : type == DType::kQ8_1 ? kernels.quantize_q8_1
                                                 : kernels.convert_f16;
        quantize_row(type, x.data(), expected.data(), n);
        fn(x.data(), actual.data(), n);
        ASSERT_EQ(actual, expected) << dtype_name(type) << " row " << r << " of " << n;
      }
    }
  }
}

// Blocks whose largest magnitude is below 127 / FLT_MAX (~3.7e-37, e.g.
// subnormal noise) have a scale that rounds to 0 in half precision, so they
// must dequantize to zeros, identically on every path.
TEST(ActivationQuantizers, TinyBlocksDequantizeToZeroOnEveryIsa) {
  for (float amax : {1e-36f, 3e-37f, 1e-38f, 1e-40f, std::numeric_limits<float>::denorm_min()}) {
    std::vector<float> x(2 * kQuantBlock, 0.0f);
    for (int j = 0; j < kQuantBlock; ++j) x[j] = j % 3 == 0 ? 0.0f : (j % 2 ? amax : -amax / 2);
    x[1] = amax;
    x[kQuantBlock + 5] = 1.0f;  // a normal block after it
    for (DType type : {DType::kQ8_0, DType::kQ8_1}) {
      std::vector<uint8_t> expected(dtype_row_bytes(type, 2 * kQuantBlock));
      quantize_row(type, x.data(), expected.data(), 2 * kQuantBlock);
      std::vector<float> y(x.size(), 1.0f);
      dequantize_row(type, expected.data(), y.data(), 2 * kQuantBlock);
      for (int j = 0; j < kQuantBlock; ++j) {
        ASSERT_EQ(y[j], 0.0f) << dtype_name(type) << " amax " << amax << " element " << j;
      }
      EXPECT_NEAR(y[kQuantBlock + 5], 1.0f, 1e-3f);
      for (Isa isa : supported_isas()) {
        std::vector<uint8_t> actual(expected.size());
        const KernelTable& kernels = kernel_table(isa);
        (type == DType::kQ8_0 ? kernels.quantize_q8_0 : kernels.quantize_q8_1)(
            x.data(), actual.data(), 2 * kQuantBlock);
        EXPECT_EQ(actual, expected) << isa_name(isa) << " " << dtype_name(type) << " amax " << amax;
      }
    }
  }
}

}  // namespace
}  // namespace duet::cpu
