// Online rebalancing of a disaggregated cluster (`duet serve --rebalance auto
// --slo ttft=MS,tpot=MS`): a thread of the coordinator that watches the
// latency of the requests that finished lately against the SLO and moves one
// instance at a time between prefill and decode (RoutedInstances::change_role).
//
// The rule (decide_rebalance): over the requests finished in the last window
// (and since the last change took effect), when the 90th percentile of TTFT
// is over its target while TPOT's is below 80% of its own, prompts wait for
// prefill capacity: the decode instance with the fewest requests becomes
// prefill, if another instance still decodes. The mirror image moves the
// prefill instance with the fewest queued prompt tokens to decode, if another
// prefill instance remains. Both over target is a cluster too small for its
// load, not a split to change: nothing moves (it is logged). A side without
// a target (or without samples: fewer than min_samples) counts as within it.
// After a change, nothing moves until it took effect and a cooldown passed,
// and only requests finished since count, so one burst moves one instance.
//
// Decisions are logged with their reason and counted in /metrics
// (duet_rebalance_decisions_total{to=...}).
//
// The same look judges the cluster's size (judge_capacity): how many live
// instances the load wants, published as duet_cluster_instances_wanted for
// a launcher that adds joined instances or asks them to leave
// (launch/local.sh, DUET_MAX_EXTRA). In a colocated cluster that is all it does.
//
// Threads: its own; the router and the service are thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "coordinator/router.h"
#include "coordinator/service.h"

namespace duet {

// Targets in seconds; 0: that side is not judged.
struct SloTargets {
  double ttft_s = 0;
  double tpot_s = 0;
};

// "ttft=MS,tpot=MS" (milliseconds; either may be left out, not both). Throws
// duet::Error (kInvalidArgument) naming what is wrong.
SloTargets parse_slo(std::string_view text);

// The 90th percentiles of the requests finished lately, and how many there were.
struct RebalanceSignals {
  double ttft_p90_s = 0;
  double tpot_p90_s = 0;
  int64_t n_ttft = 0;
  int64_t n_tpot = 0;
};

struct RebalanceDecision {
  size_t instance = 0;
  InstanceRole to = InstanceRole::kPrefill;
  std::string why;  // one line, for the log
};

// The change to make now, if any (the rule above). `instances` in router order.
std::optional<RebalanceDecision> decide_rebalance(
    std::span<const RoutedInstances::RoleView> instances, const RebalanceSignals& signals,
    const SloTargets& slo, int64_t min_samples);

// Whether the cluster has the instances its load needs, for a launcher that
// adds joined instances or asks them to leave (launch/local.sh reads it from
// duet_cluster_instances_wanted): kMore when a side misses its target and no
// role change helps (`change` is empty: both sides over, one instance left
// on the other side, or a colocated cluster, which has no split to change);
// kFewer when every side with a target is under half of it (with enough
// samples), or when nothing finished lately and nothing runs (`idle`).
enum class CapacityCall { kKeep, kMore, kFewer };
CapacityCall judge_capacity(const RebalanceSignals& signals, const SloTargets& slo,
                            int64_t min_samples, bool change, bool idle);

// The 90th percentile (nearest rank) of `values`, 0 when empty; sorts them.
double percentile90(std::vector<double>& values);

struct RebalancerOptions {
  SloTargets slo;
  std::chrono::milliseconds interval{1000};   // how often it looks
  std::chrono::milliseconds window{10000};    // the requests it looks at: finished this recently
  std::chrono::milliseconds cooldown{10000};  // after a change took effect
  int64_t min_samples = 4;
};

// The rule through time, on any clock (seconds from any origin): what
// happened since the last change, the cooldown, the "nothing moves" notes.
// Rebalancer drives it from the steady clock; the simulator (sim/simulator.h)
// from simulated time, so a plan can try the very rule `duet serve` runs.
// The caller makes the change it returns (RoutedInstances::change_role) and
// logs it. One thread.
class RebalanceLoop final {
 public:
  // The requests that finished at or after `since` (seconds, the loop's clock).
  using Recent = std::function<Metrics::RecentLatency(double since)>;

  explicit RebalanceLoop(RebalancerOptions options) : options_(options) {}

  // One look at time `now`: the change to make, if any. Logs (warn) once
  // when both sides go over their targets, again only after they did not.
  // A change in the number of live instances (a join, a leave, a loss)
  // counts as a change taking effect: fresh samples, then the cooldown.
  std::optional<RebalanceDecision> look(double now,
                                        std::span<const RoutedInstances::RoleView> instances,
                                        const Recent& recent);

  // The live instances the load wants, as of the last look: their count,
  // one more or one fewer (judge_capacity); their count while a change
  // waits or cools down. 0 before the first look.
  int64_t instances_wanted() const { return instances_wanted_; }

  const RebalancerOptions& options() const { return options_; }

 private:
  const RebalancerOptions options_;
  // When the last change took effect (requests before it do not count), and
  // until when nothing moves.
  double counted_from_ = 0;
  double quiet_until_ = 0;
  bool waiting_for_change_ = false;
  bool both_over_ = false;  // the last look found both sides over: said once
  int64_t live_ = -1;       // live instances at the last look
  int64_t instances_wanted_ = 0;
};

class Rebalancer final {
 public:
  // Both outlive it. Starts its thread.
  Rebalancer(RoutedInstances& router, Service& service, RebalancerOptions options);
  ~Rebalancer();  // stops and joins the thread
  Rebalancer(const Rebalancer&) = delete;
  Rebalancer& operator=(const Rebalancer&) = delete;

 private:
  void run();
  void look();

  RoutedInstances& router_;
  Service& service_;
  const std::chrono::steady_clock::time_point origin_;  // the loop's time 0
  RebalanceLoop loop_;                                  // the thread's
  std::mutex mutex_;                                    // guards stopping_
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
