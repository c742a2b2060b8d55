// duet-kv-transfer-bench's report, printed by rank 2: Markdown tables of the
// medians on stdout, and everything (every rep) in one JSON object.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "bench/kv_transfer/ttft_phase.h"
#include "sim/link/rig.h"
#include "sim/link/transfer_phases.h"

namespace duet::kv_bench {

using Json = nlohmann::json;

// Phase 1's baselines, each rep's seconds.
struct RawTimes {
  std::vector<double> spinning;     // bench_raw without a poll
  std::vector<double> polled;       // under the transfer's progress model
  std::vector<double> polled_huge;  // the same, its buffers on huge pages
  std::vector<double> blocks;       // bench_raw_blocks
};

// Phases 1 and 2 against each other.
void report_transfer(const Shape& shape, const Args& args, const ClockSync& sync,
                     const RawTimes& raw, const TransferTimes& transfer, Json& json);
// Phase 3.
void report_ttft(const Shape& shape, const Args& args, const TtftTimes& t, Json& json);

}  // namespace duet::kv_bench
