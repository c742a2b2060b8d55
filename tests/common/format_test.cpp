// duet::format (common/format.h) against fmt::format, whose "{}" it stands
// in for where fmt is not installed: the same text for every kind of value
// the error messages pass, and its rules for mismatched placeholders.
#include "common/format.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace duet {
namespace {

template <typename T>
void expect_like_fmt(T value) {
  EXPECT_EQ(format("{}", value), fmt::format("{}", value)) << fmt::format("{}", value);
}

TEST(Format, IntegersAsFmtWritesThem) {
  expect_like_fmt(0);
  expect_like_fmt(-17);
  expect_like_fmt(int64_t{-9223372036854775807LL - 1});
  expect_like_fmt(uint64_t{18446744073709551615ULL});
  expect_like_fmt(static_cast<int8_t>(-5));
  expect_like_fmt(static_cast<uint8_t>(250));
  expect_like_fmt(size_t{49152});
}

TEST(Format, FloatingPointInShortestRoundTripForm) {
  for (double v : {0.0, -0.0, 1.0, -1.5, 0.1, 1.0 / 3.0, 1e-4, 1.2345e-5, 123456789.0, 1e15, 1e16,
                   1.5e16, 6.02214076e23, 5e-324, 1.7976931348623157e308}) {
    expect_like_fmt(v);
  }
  for (float v : {0.0f, 1e-6f, 0.7f, 3.14159265f, 65504.0f, 1e10f, 1e20f, 16777216.0f}) {
    expect_like_fmt(v);
  }
  expect_like_fmt(std::numeric_limits<double>::infinity());
  expect_like_fmt(-std::numeric_limits<float>::infinity());
  expect_like_fmt(std::nan(""));
}

TEST(Format, StringsBoolsCharsAndPaths) {
  expect_like_fmt(std::string("a string"));
  expect_like_fmt(std::string_view("a view"));
  expect_like_fmt("a literal");
  expect_like_fmt(true);
  expect_like_fmt(false);
  expect_like_fmt('x');
  EXPECT_EQ(format("{}", std::filesystem::path("models/m.gguf")), "models/m.gguf");
}

TEST(Format, PlaceholdersInOrderAndEscapedBraces) {
  EXPECT_EQ(format("{}: offset {}: {}", "m.gguf", 24, "bad"), "m.gguf: offset 24: bad");
  EXPECT_EQ(format("{{}} and {{{}}}", 5), fmt::format("{{}} and {{{}}}", 5));
  EXPECT_EQ(format("no placeholders"), "no placeholders");
  EXPECT_EQ(format("lone } and { stay"), "lone } and { stay");
}

TEST(Format, MismatchesShowInsteadOfThrowing) {
  EXPECT_EQ(format("{} and {}", 1), "1 and {}");
  EXPECT_EQ(format("only {}", 1, 2), "only 1 2");
}

TEST(Format, JoinAsFmtJoin) {
  const std::vector<int64_t> shape = {896, 49152, 1};
  EXPECT_EQ(join(shape, ", "), fmt::format("{}", fmt::join(shape, ", ")));
  EXPECT_EQ(join(std::vector<int>{}, "x"), "");
  EXPECT_EQ(join(std::vector<double>{0.5, 1e20}, "|"),
            fmt::format("{}", fmt::join(std::vector<double>{0.5, 1e20}, "|")));
}

}  // namespace
}  // namespace duet
