// Drives one run: sends the planned requests through a Client and collects
// their records.
//
// Open loop (no concurrency given): request i is sent at its planned time
// `at` after the run's start, whether or not earlier ones have finished, so
// a slow server meets the same arrivals as a fast one (its queue grows, not
// the load shrinks). Closed loop (concurrency C): C requests are kept in
// flight; each finished one makes room for the next, and `at` is ignored.
// Every record's times are on one steady clock whose origin is the run's
// start; `scheduled` is the planned time (open loop) or the moment a slot
// freed up (closed loop).
//
// The run's thread is the caller's: it sleeps until the next arrival or
// completion (no busy-waiting), and redraws a progress line on stderr.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "loadgen/client.h"
#include "loadgen/prompts.h"
#include "loadgen/record.h"
#include "loadgen/workload.h"

namespace duet::loadgen {

struct RunOptions {
  std::vector<PlannedRequest> requests;  // in arrival order; `at` ascending (open loop)
  std::optional<int64_t> concurrency;    // closed loop with this many in flight (>= 1)
  bool stream = true;
  bool progress = true;  // the progress line on stderr
  std::string label;     // names the run on the progress line ("rate 4/s")
};

// Draws every prompt from `prompts` with `rng` (before the clock starts),
// runs, and returns one record per planned request, in arrival order. Failed
// requests are records too. Blocks until every request has finished or
// failed (clients time requests out).
std::vector<RequestRecord> run(Client& client, const PromptSource& prompts, std::mt19937_64& rng,
                               const RunOptions& options);

}  // namespace duet::loadgen
