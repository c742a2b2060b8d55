#include "sim/profile.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "common/stats.h"
#include "sim/nnls.h"

namespace duet::sim {
namespace {

void require_knots(std::span<const int64_t> token_knots) {
  DUET_REQUIRE(!token_knots.empty(), "a step cost needs at least one token knot");
  for (size_t i = 0; i < token_knots.size(); ++i) {
    DUET_REQUIRE(token_knots[i] >= 1, "token knots start at >= 1, got {}", token_knots[i]);
    DUET_REQUIRE(i == 0 || token_knots[i] > token_knots[i - 1],
                 "token knots must increase: {} after {}", token_knots[i], token_knots[i - 1]);
  }
}

void require_sample(const StepSample& sample, size_t index) {
  const StepShape& s = sample.shape;
  DUET_REQUIRE(std::isfinite(sample.seconds) && sample.seconds > 0,
               "step sample {} takes {} s; a sample's seconds must be > 0", index, sample.seconds);
  DUET_REQUIRE(s.n_tokens >= 0 && s.n_sequences >= 0 && s.n_logit_rows >= 0 &&
                   s.n_decode_attention >= 0 && s.n_attention >= s.n_decode_attention,
               "step sample {} has a negative count (tokens {}, sequences {}, attention {} of "
               "which decode {}, logit rows {})",
               index, s.n_tokens, s.n_sequences, s.n_attention, s.n_decode_attention,
               s.n_logit_rows);
}

// A step cost's unknowns after the knots, in the fit's column order.
constexpr int64_t kLinearTerms = 4;

}  // namespace

std::vector<double> knot_weights(std::span<const int64_t> token_knots, int64_t n_tokens) {
  const size_t k = token_knots.size();
  std::vector<double> w(k, 0.0);
  if (k == 0) return w;
  if (k == 1 || n_tokens <= token_knots[0]) {
    w[0] = 1;
    return w;
  }
  // The segment [knots[i], knots[i + 1]] holding n_tokens, or the last one.
  size_t i = 0;
  while (i + 2 < k && n_tokens > token_knots[i + 1]) ++i;
  const double t = static_cast<double>(n_tokens - token_knots[i]) /
                   static_cast<double>(token_knots[i + 1] - token_knots[i]);
  w[i] = 1 - t;
  w[i + 1] = t;
  return w;
}

double StepCost::weights(int64_t n_tokens) const {
  DUET_REQUIRE(token_knots.size() == knot_seconds.size(), "{} token knots but {} knot seconds",
               token_knots.size(), knot_seconds.size());
  const std::vector<double> w = knot_weights(token_knots, n_tokens);
  double seconds = 0;
  for (size_t i = 0; i < w.size(); ++i) seconds += w[i] * knot_seconds[i];
  return seconds;
}

double StepCost::operator()(const StepShape& shape) const {
  const auto n = [](int64_t count) { return static_cast<double>(count); };
  return weights(shape.n_tokens) + per_sequence * n(shape.n_sequences) +
         per_decode_attention * n(shape.n_decode_attention) +
         per_prefill_attention * n(shape.n_attention - shape.n_decode_attention) +
         per_logit_row * n(shape.n_logit_rows);
}

// Row i of the system is sample i's terms divided by its seconds, its target
// 1: the squared error summed is that of (fitted - measured) / measured.
StepCost fit_step_cost(std::span<const StepSample> samples, std::vector<int64_t> token_knots) {
  DUET_REQUIRE(!samples.empty(), "fitting a step cost needs at least one sample");
  require_knots(token_knots);
  for (size_t i = 0; i < samples.size(); ++i) require_sample(samples[i], i);

  const int64_t k = static_cast<int64_t>(token_knots.size());
  DenseMatrix a(static_cast<int64_t>(samples.size()), k + kLinearTerms);
  std::vector<double> b(samples.size(), 1.0);
  for (size_t r = 0; r < samples.size(); ++r) {
    const StepShape& s = samples[r].shape;
    const double inv = 1.0 / samples[r].seconds;
    const int64_t row = static_cast<int64_t>(r);
    const std::vector<double> w = knot_weights(token_knots, s.n_tokens);
    for (int64_t c = 0; c < k; ++c) a(row, c) = w[c] * inv;
    a(row, k + 0) = static_cast<double>(s.n_sequences) * inv;
    a(row, k + 1) = static_cast<double>(s.n_decode_attention) * inv;
    a(row, k + 2) = static_cast<double>(s.n_attention - s.n_decode_attention) * inv;
    a(row, k + 3) = static_cast<double>(s.n_logit_rows) * inv;
  }
  const std::vector<double> x = nonnegative_least_squares(a, b);

  StepCost cost;
  cost.token_knots = std::move(token_knots);
  cost.knot_seconds.assign(x.begin(), x.begin() + k);
  cost.per_sequence = x[k + 0];
  cost.per_decode_attention = x[k + 1];
  cost.per_prefill_attention = x[k + 2];
  cost.per_logit_row = x[k + 3];
  return cost;
}

std::vector<FitResidual> fit_residuals(const StepCost& cost, std::span<const StepSample> samples) {
  std::vector<FitResidual> residuals;
  residuals.reserve(samples.size());
  for (const StepSample& sample : samples) {
    residuals.push_back({sample.shape, sample.seconds, cost(sample.shape)});
  }
  return residuals;
}

FitQuality fit_quality(std::span<const FitResidual> residuals) {
  FitQuality quality;
  quality.n_samples = static_cast<int64_t>(residuals.size());
  if (residuals.empty()) return quality;
  std::vector<double> errors;
  errors.reserve(residuals.size());
  for (size_t i = 0; i < residuals.size(); ++i) {
    const FitResidual& r = residuals[i];
    DUET_REQUIRE(r.measured_s > 0, "residual {} was measured at {} s; it must be > 0", i,
                 r.measured_s);
    errors.push_back(std::abs(r.fitted_s - r.measured_s) / r.measured_s);
  }
  std::sort(errors.begin(), errors.end());
  quality.median_rel_error = sorted_percentile(errors, 50);
  quality.p90_rel_error = sorted_percentile(errors, 90);
  quality.max_rel_error = errors.back();
  return quality;
}

double LinkCost::seconds(double bytes) const {
  DUET_REQUIRE(bytes_per_s > 0, "a link of {} bytes/s", bytes_per_s);
  return latency_s + bytes / bytes_per_s;
}

// seconds = latency + bytes * inverse, least squares over the samples with
// both kept >= 0: the unconstrained line when it qualifies, else the better
// of the two lines with one term at 0. An inverse of 0 (time that does not
// grow with bytes) is an infinite bytes_per_s.
LinkCost fit_link_cost(std::span<const LinkSample> samples) {
  DUET_REQUIRE(!samples.empty(), "fitting a link cost needs at least one sample");
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const LinkSample& s = samples[i];
    DUET_REQUIRE(std::isfinite(s.bytes) && s.bytes >= 0, "link sample {} has {} bytes", i, s.bytes);
    DUET_REQUIRE(std::isfinite(s.seconds) && s.seconds > 0,
                 "link sample {} takes {} s; a sample's seconds must be > 0", i, s.seconds);
    sx += s.bytes, sy += s.seconds, sxx += s.bytes * s.bytes, sxy += s.bytes * s.seconds;
  }
  const double n = static_cast<double>(samples.size());
  const auto sse = [&](double latency, double inverse) {
    double sum = 0;
    for (const LinkSample& s : samples) {
      const double e = latency + inverse * s.bytes - s.seconds;
      sum += e * e;
    }
    return sum;
  };
  const auto cost = [](double latency, double inverse) {
    return LinkCost{latency, inverse > 0 ? 1.0 / inverse : std::numeric_limits<double>::infinity()};
  };

  const double spread = sxx - sx * sx / n;  // n * variance of bytes
  if (spread > 0) {
    const double inverse = (sxy - sx * sy / n) / spread;
    const double latency = (sy - inverse * sx) / n;
    if (inverse >= 0 && latency >= 0) return cost(latency, inverse);
  }
  // One term at 0: a line through the origin, or a constant.
  const double through_origin = sxx > 0 ? sxy / sxx : 0.0;
  const double constant = sy / n;
  if (sxx > 0 && sse(0, through_origin) <= sse(constant, 0)) return cost(0, through_origin);
  return cost(constant, 0);
}

const InstanceProfile& Profile::instance(int tp) const {
  std::vector<int> have;
  for (const InstanceProfile& instance : instances) {
    if (instance.tp == tp) return instance;
    have.push_back(instance.tp);
  }
  throw Error(ErrorKind::kInvalidArgument,
              duet::format("the profile ({}) has no instance of tp {}; it has tp [{}]", device, tp,
                           duet::join(have, ", ")));
}

const TransferProfile& Profile::transfer(std::string_view path) const {
  std::vector<std::string> have;
  for (const TransferProfile& transfer : transfers) {
    if (transfer.path == path) return transfer;
    have.push_back(transfer.path);
  }
  throw Error(ErrorKind::kInvalidArgument,
              duet::format("the profile ({}) has no KV transfer path '{}'; it has [{}]", device,
                           path, duet::join(have, ", ")));
}

}  // namespace duet::sim
