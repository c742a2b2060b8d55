// Percentiles and medians (common/stats.h) against numpy.percentile's
// default ("linear") on known sets.
#include "common/stats.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

constexpr double kEps = 1e-9;

TEST(PercentileTest, MatchesNumpyLinearOnOneToHundred) {
  std::vector<double> values(100);
  std::iota(values.rbegin(), values.rend(), 1.0);  // 100 down to 1: any order
  EXPECT_NEAR(*percentile(values, 50), 50.5, kEps);
  EXPECT_NEAR(*percentile(values, 90), 90.1, kEps);
  EXPECT_NEAR(*percentile(values, 99), 99.01, kEps);
  EXPECT_NEAR(*percentile(values, 0), 1.0, kEps);
  EXPECT_NEAR(*percentile(values, 100), 100.0, kEps);
  EXPECT_NEAR(*percentile(values, 25), 25.75, kEps);
  const std::vector<double> sorted(values.rbegin(), values.rend());
  EXPECT_NEAR(sorted_percentile(sorted, 90), 90.1, kEps);
}

TEST(PercentileTest, SmallSets) {
  EXPECT_NEAR(*percentile({7.5}, 0), 7.5, kEps);
  EXPECT_NEAR(*percentile({7.5}, 99), 7.5, kEps);
  // numpy.percentile([10, 20, 40], 75) == 30.
  EXPECT_NEAR(*percentile({40, 10, 20}, 75), 30.0, kEps);
  EXPECT_FALSE(percentile({}, 50).has_value());
}

TEST(PercentileTest, RejectsOutOfRangeP) {
  EXPECT_THROW(percentile({1, 2}, -1), Error);
  EXPECT_THROW(percentile({1, 2}, 100.5), Error);
  EXPECT_THROW(percentile({}, 101), Error);
}

TEST(MedianTest, MiddleOrMeanOfTheTwoMiddles) {
  EXPECT_EQ(median({3, 1, 2}), 2.0);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(median({-1}), -1.0);
  EXPECT_THROW(median({}), Error);
}

}  // namespace
}  // namespace duet
