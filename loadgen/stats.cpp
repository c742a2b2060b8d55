#include "loadgen/stats.h"

#include <algorithm>
#include <limits>

#include "common/stats.h"

namespace duet::loadgen {
namespace {

// The server's count of tokens when it gave one, else the chunks we saw.
int64_t tokens_of(const RequestRecord& r) {
  return r.received_tokens > 0 ? r.received_tokens : static_cast<int64_t>(r.token_times.size());
}

}  // namespace

std::optional<double> ttft_of(const RequestRecord& r) {
  if (!r.first_token) return std::nullopt;
  return *r.first_token - r.sent;
}

std::optional<double> tpot_of(const RequestRecord& r) {
  const int64_t tokens = tokens_of(r);
  if (!r.first_token || tokens < 2) return std::nullopt;
  return (r.finished - *r.first_token) / static_cast<double>(tokens - 1);
}

Distribution distribution(std::vector<double> values) {
  Distribution d;
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  d.n = static_cast<int64_t>(values.size());
  double sum = 0;
  for (const double v : values) sum += v;
  d.mean = sum / static_cast<double>(values.size());
  d.p50 = sorted_percentile(values, 50);
  d.p90 = sorted_percentile(values, 90);
  d.p99 = sorted_percentile(values, 99);
  d.max = values.back();
  return d;
}

// A TTFT bound needs a first token to be met: an ok request that streamed
// nothing cannot show it met one. A request with fewer than two tokens has no
// TPOT and meets any TPOT bound. Bounds are inclusive.
bool meets_slo(const RequestRecord& r, const Slo& slo) {
  if (!r.ok) return false;
  if (slo.ttft) {
    const std::optional<double> ttft = ttft_of(r);
    if (!ttft || *ttft > *slo.ttft) return false;
  }
  if (slo.tpot) {
    const std::optional<double> tpot = tpot_of(r);
    if (tpot && *tpot > *slo.tpot) return false;
  }
  return true;
}

Summary summarize(std::span<const RequestRecord> records, const Slo& slo) {
  Summary s;
  s.n_requests = static_cast<int64_t>(records.size());
  if (records.empty()) return s;

  double first_sent = std::numeric_limits<double>::infinity();
  double last_finished = -std::numeric_limits<double>::infinity();
  int64_t ok_prompt_tokens = 0, ok_received_tokens = 0, n_good = 0;
  std::vector<double> ttfts, tpots, itls, e2es;
  for (const RequestRecord& r : records) {
    first_sent = std::min(first_sent, r.sent);
    last_finished = std::max(last_finished, r.finished);
    if (!r.ok) {
      ++s.errors[r.error_kind.empty() ? std::string("unknown") : r.error_kind];
      continue;
    }
    ++s.n_ok;
    ok_prompt_tokens += r.prompt_tokens;
    ok_received_tokens += tokens_of(r);
    if (const std::optional<double> ttft = ttft_of(r)) ttfts.push_back(*ttft);
    if (const std::optional<double> tpot = tpot_of(r)) tpots.push_back(*tpot);
    for (size_t i = 1; i < r.token_times.size(); ++i) {
      itls.push_back(r.token_times[i] - r.token_times[i - 1]);
    }
    e2es.push_back(r.finished - r.sent);
    if (meets_slo(r, slo)) ++n_good;
  }

  s.duration = std::max(0.0, last_finished - first_sent);
  if (s.duration > 0) {
    s.request_rate = static_cast<double>(s.n_ok) / s.duration;
    s.output_token_rate = static_cast<double>(ok_received_tokens) / s.duration;
    s.total_token_rate = static_cast<double>(ok_prompt_tokens + ok_received_tokens) / s.duration;
    s.goodput = static_cast<double>(n_good) / s.duration;
  }
  s.goodput_fraction = static_cast<double>(n_good) / static_cast<double>(s.n_requests);
  s.ttft = distribution(std::move(ttfts));
  s.tpot = distribution(std::move(tpots));
  s.itl = distribution(std::move(itls));
  s.e2e = distribution(std::move(e2es));
  return s;
}

}  // namespace duet::loadgen
