// duet-kv-transfer-bench's report, printed by rank 2: Markdown tables of the
// medians on stdout, and everything (every rep) in one JSON object.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "bench/kv_transfer/rig.h"
#include "bench/kv_transfer/transfer_phases.h"
#include "bench/kv_transfer/ttft_phase.h"

namespace duet::kv_bench {

using Json = nlohmann::json;

// Phases 1 and 2 against each other (`raw`: bench_raw's seconds spinning,
// `raw_polled`: under the transfer's progress model).
void report_transfer(const Shape& shape, const Args& args, const ClockSync& sync,
                     const std::vector<double>& raw, const std::vector<double>& raw_polled,
                     const std::vector<double>& raw_blocks, const TransferTimes& transfer,
                     Json& json);
// Phase 3.
void report_ttft(const Shape& shape, const Args& args, const TtftTimes& t, Json& json);

}  // namespace duet::kv_bench
