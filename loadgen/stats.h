// The serving metrics papers report, computed from request records.
//
// Conventions (vLLM's benchmark_serving and the DistServe/Splitwise papers):
// TTFT = first token - sent; TPOT = (finished - first token) / (tokens - 1),
// per request, over requests with at least 2 tokens; ITL = every gap between
// consecutive streamed chunks; E2E = finished - sent. Percentiles are
// common/stats.h's (numpy's default: linear between order statistics).
// Goodput counts the requests that succeeded and met every SLO given, per
// second of the run.
// Failed requests count in the totals and by error kind; they have no latency.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loadgen/record.h"

namespace duet::loadgen {

struct Distribution {
  int64_t n = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};
Distribution distribution(std::vector<double> values);  // all zero when empty

struct Slo {
  std::optional<double> ttft;  // seconds
  std::optional<double> tpot;  // seconds
};

struct Summary {
  int64_t n_requests = 0;
  int64_t n_ok = 0;
  std::map<std::string, int64_t> errors;  // by kind
  double duration = 0;                    // first sent to last finished, seconds
  double request_rate = 0;                // ok requests / duration
  double output_token_rate = 0;           // received tokens of ok requests / duration
  double total_token_rate = 0;            // (prompt + received) tokens of ok requests / duration
  Distribution ttft, tpot, itl, e2e;
  double goodput = 0;           // ok requests meeting the SLO / duration
  double goodput_fraction = 0;  // of all requests
};

// Sent to first token; none without a token.
std::optional<double> ttft_of(const RequestRecord& r);
// First token to finish over the tokens after the first (the server's count
// when it gave one, else the chunks seen); none with fewer than two tokens.
std::optional<double> tpot_of(const RequestRecord& r);

// Whether an ok request meets `slo` (a request with one token has no TPOT and meets it).
bool meets_slo(const RequestRecord& r, const Slo& slo);

Summary summarize(std::span<const RequestRecord> records, const Slo& slo);

}  // namespace duet::loadgen
