// duet-bench's results: the JSON file (configuration, then per run its
// summary and every request; layout at report_json) and the human tables on
// stdout. In the JSON, times of requests are seconds since the run's start,
// latencies of summaries milliseconds.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "loadgen/record.h"
#include "loadgen/stats.h"

namespace duet::loadgen {

struct RunResult {
  std::string label;                   // "rate 4 req/s", "concurrency 8"
  std::optional<double> rate;          // open loop; infinity: all at once
  std::optional<int64_t> concurrency;  // closed loop
  std::vector<RequestRecord> records;
  Summary summary;
};

// {"n_requests", "n_ok", "errors": {kind: n}, "duration_s", "request_rate",
//  "output_token_rate", "total_token_rate", "goodput", "goodput_fraction",
//  "ttft_ms"|"tpot_ms"|"itl_ms"|"e2e_ms": {"n", "mean", "p50", "p90", "p99", "max"},
//  "short_requests": ok requests that got fewer tokens than asked}
nlohmann::json summary_json(const Summary& summary, std::span<const RequestRecord> records);
// {"index", "scheduled_s", "sent_s", "first_token_s"|null, "finished_s",
//  "token_times_s": [...], "prompt_tokens", "output_tokens", "received_tokens", "ok",
//  "error_kind", "error_message", "server_ttft_s"|null, "server_tpot_s"|null,
//  "server_e2e_s"|null, "meets_slo"}
nlohmann::json record_json(const RequestRecord& record, const Slo& slo);
// {"tool": "duet-bench", "version": 1, "config": {...as given...},
//  "slo": {"ttft_ms": x|null, "tpot_ms": y|null},
//  "runs": [{"label", "rate" (req/s; null: closed loop; "inf": all at once),
//            "concurrency" (null: open loop), "summary": summary_json,
//            "requests": [record_json...]}]}
// One run without a sweep is simply a list of one.
nlohmann::json report_json(const nlohmann::json& config, const Slo& slo,
                           const std::vector<RunResult>& runs);
// Writes `report` to `path`; throws duet::Error when it cannot.
void write_json(const std::filesystem::path& path, const nlohmann::json& report);

// The table of one run: counts, throughput, goodput, and the latency
// distributions (mean, p50, p90, p99, max in ms), errors by kind.
void print_run(std::ostream& out, const RunResult& run, const Slo& slo);
// One line per run, for sweeps: rate, throughput, goodput, TTFT and TPOT p50/p99.
void print_sweep(std::ostream& out, const std::vector<RunResult>& runs);

}  // namespace duet::loadgen
