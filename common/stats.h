// Order statistics of measurements, defined once for every report (the load
// generator's TTFT/TPOT percentiles, the benchmarks' medians, the tests'
// error summaries): numpy.percentile's default ("linear"), so a figure
// printed here and one computed from the same samples in Python agree.
#pragma once

#include <optional>
#include <span>
#include <vector>

namespace duet {

// The p-th percentile (p in [0, 100]) of `sorted` (ascending, not empty): the
// value at rank p/100 * (n - 1), interpolated linearly between the two order
// statistics around it. Throws duet::Error (kInvalidArgument) for p outside
// [0, 100].
double sorted_percentile(std::span<const double> sorted, double p);

// The same of `values` in any order; nullopt when empty.
std::optional<double> percentile(std::vector<double> values, double p);

// The 50th percentile of `values` (not empty): the middle value, or the mean
// of the two middle ones.
double median(std::vector<double> values);

}  // namespace duet
