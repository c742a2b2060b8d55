// The layout planner: for a model (a profile), a traffic shape and an SLO,
// which cluster layout gives the most goodput per GPU at each cluster size.
//
// A layout's goodput is the highest request rate at which at least
// `attainment` of the requests meet the SLO (DistServe's definition), found
// by simulating the traffic shape at growing, then bisected, rates on the
// real engine and router (sim/simulator.h); per GPU, divided by the
// cluster's GPUs (idle ones included). The candidates at N GPUs:
//   colocated      N / tp instances of each tp the profile has;
//   disaggregated  every (prefill tp, decode tp) pair the profile has, the
//                  prefill instances taking each share of the GPUs in
//                  `prefill_shares` (rounded to whole instances, at least one
//                  of each kind), the decode instances the rest.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"
#include "sim/profile.h"
#include "worker/engine.h"

namespace CLI {
class App;
}

namespace duet::sim {

struct PlanOptions {
  std::vector<int> gpus = {8, 16, 32, 64, 128, 256, 512, 1024};
  loadgen::Slo slo;
  double attainment = 0.9;  // share of requests that must meet the SLO
  // The traffic: lengths (and the arrival pattern, stretched to each rate)
  // of `mix` (make_trace's chat, long, mixed) or of a trace file.
  std::string mix = "chat";
  std::vector<loadgen::PlannedRequest> trace;  // used when not empty
  int64_t requests_per_instance = 40;          // simulated requests per probe, per instance
  int64_t min_requests = 400;
  double span_s = 20;    // seconds of arrivals per probe, at least (a held rate, not a burst)
  std::vector<int> tps;  // empty: every tp the profile has
  std::vector<double> prefill_shares = {0.125, 0.2, 0.25, 1.0 / 3, 0.4, 0.5, 0.6, 2.0 / 3, 0.75};
  int refine = 6;  // candidates searched finely per cluster size, at most
  // From the second size on, keep the disaggregated shapes (tp pair and
  // share) that came within 90% of the best disaggregated figure at the size
  // before, and the best one's neighbouring shares; each kept shape's search
  // starts from its figure there. Goodput per GPU changes slowly with the
  // cluster's size, so this finds the same layouts with a fraction of the
  // probes.
  bool prune = true;
  int jobs = 1;                      // candidates searched at once (threads)
  std::ostream* progress = nullptr;  // a line per cluster size, when set
  EngineConfig engine;
  std::string transfer_path;
  uint64_t seed = 0;
};

struct LayoutGoodput {
  ClusterSpec cluster;
  std::string layout;          // describe_layout
  int gpus = 0;                // used by the layout (<= the cluster size)
  double rate = 0;             // req/s at which the attainment holds
  double goodput_per_gpu = 0;  // rate / cluster size, req/s
  double attainment = 0;       // reached at `rate`
  double ttft_p99 = 0;         // seconds, at `rate`
  double tpot_p99 = 0;
  bool refined = false;
};

struct PlanResult {
  int gpus = 0;
  std::vector<LayoutGoodput> ranked;  // best first
  std::optional<LayoutGoodput> best_colocated;
  std::optional<LayoutGoodput> best_disaggregated;
};

// The search, `jobs` candidates at a time, is in two passes: every candidate
// coarsely (fewer simulated requests, a shorter span, a wide bracket), then
// finely (all the requests, a narrow bracket around the coarse figure) those
// within 80% of the best coarse figure (at most `refine`), the best colocated
// and the best disaggregated one; `ranked` puts the fine figures first.
// Throws duet::Error (kInvalidArgument) without an SLO, or for a profile
// with no tp that fits.
std::vector<PlanResult> plan_layouts(const Profile& profile, const PlanOptions& options);

// The cluster sizes' best layouts, a runner-up list and the colocated
// baseline, as a markdown table.
void print_plan(std::ostream& out, const std::vector<PlanResult>& results, int runners_up = 3);

// `duet-sim plan`'s flags and command.
struct PlanFlags {
  std::string profile;
  std::string gpus = "8,16,32,64,128,256,512,1024";
  std::string slo;
  double attainment = 0.9;
  std::string mix = "chat";
  std::string trace;
  std::string tps;
  int64_t requests_per_instance = 40;
  int64_t min_requests = 400;
  double span_s = 20;
  int refine = 6;
  bool no_prune = false;
  int jobs = 0;  // 0: the machine's hardware threads
  std::string transfer;
  uint64_t seed = 0;
  std::string json;
  std::string plot;
  EngineConfig engine;  // set by the caller from its engine flags
};
void add_plan_flags(CLI::App& app, PlanFlags& flags);
int plan_command(const PlanFlags& flags, std::ostream& out);

}  // namespace duet::sim
