#include "common/stats.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace duet {

double sorted_percentile(std::span<const double> sorted, double p) {
  DUET_REQUIRE(p >= 0.0 && p <= 100.0, "percentile must be in [0, 100], got {}", p);
  DUET_ASSERT(!sorted.empty(), "the percentile of no values");
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return sorted[lo] + frac * (sorted[hi] - sorted[lo]);
}

std::optional<double> percentile(std::vector<double> values, double p) {
  DUET_REQUIRE(p >= 0.0 && p <= 100.0, "percentile must be in [0, 100], got {}", p);
  if (values.empty()) return std::nullopt;
  std::sort(values.begin(), values.end());
  return sorted_percentile(values, p);
}

double median(std::vector<double> values) {
  DUET_REQUIRE(!values.empty(), "the median of no values");
  std::sort(values.begin(), values.end());
  return sorted_percentile(values, 50);
}

}  // namespace duet
