// The cluster simulator: a trace through a cluster of any size, on a
// profile's cost model, with the serving system's own code.
//
// Every instance is the real Engine (sim/sim_instance.h: a step-time
// model in place of the forward pass, no KV memory); the requests go through
// the real router (coordinator/router.h RoutedInstances with the policy the
// cluster's mode names), exactly as `duet serve` places them. What is
// modelled: the seconds of each step (the profile's StepCost for the
// instance's tp, slowed when instances share too few cores), the KV transfer
// between instances (the profile's link for the chosen path), and nothing
// else: the coordinator, the client and the network to it take no time.
//
// Deterministic: the same profile, options and trace give the same records.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "coordinator/rebalancer.h"
#include "loadgen/record.h"
#include "loadgen/workload.h"
#include "sim/profile.h"
#include "worker/engine.h"

namespace duet::sim {

struct SimOptions {
  ClusterSpec cluster;  // roles and tp; ranks are not used
  // Each instance's engine as `duet serve` configures it. n_kv_blocks 0:
  // the profile's KV capacity for the instance's tp.
  EngineConfig engine;
  // The KV transfer path between prefill and decode instances (a name in the
  // profile's transfers); empty: the profile's first. Colocated needs none.
  std::string transfer_path;
  int max_retries = 2;
  uint64_t seed = 0;  // prompt ids of requests whose trace row has none
  // The cores all instances share (a CPU cluster on one host, one compute
  // thread per rank; sim_instance.h SharedCores); 0: each has its own.
  int host_cores = 0;
  // With host_cores: a step's slowdown beside another running step; unset:
  // the profile's (HostSharing).
  std::optional<double> neighbour_slowdown;
  // Online rebalancing of a disaggregated cluster, the rule `duet serve
  // --rebalance auto` runs (coordinator/rebalancer.h RebalanceLoop), looking
  // every `interval` of simulated time at the requests finished lately;
  // unset: roles stay as the cluster names them.
  std::optional<RebalancerOptions> rebalance;
};

// One role change the rebalancer made.
struct RoleChange {
  double at = 0;  // simulated seconds
  size_t instance = 0;
  InstanceRole from = InstanceRole::kBoth;
  InstanceRole to = InstanceRole::kBoth;
  std::string why;
};

struct InstanceReport {
  InstanceRole role = InstanceRole::kBoth;  // at the end (the rebalancer may change it)
  int tp = 1;
  int64_t routed = 0;  // requests the router sent there (decode or colocated)
  int64_t steps = 0;
  double busy_s = 0;  // simulated seconds in steps
  int64_t preemptions = 0;
};

struct SimResult {
  std::vector<loadgen::RequestRecord> records;  // in trace order
  std::vector<InstanceReport> instances;        // in cluster order
  std::vector<RoleChange> role_changes;         // in time order
  double simulated_s = 0;                       // the last event's time
  double wall_s = 0;                            // what simulating took
  int64_t events = 0;
};

// A short form of a cluster for the command line: "2C" (two colocated
// instances), "1P+2D" (one prefill, two decode), each count optionally with
// its tp: "4P@tp2+8D@tp4", "16C@tp2". Throws duet::Error (kInvalidArgument).
ClusterSpec parse_cluster_layout(std::string_view text);
// The short form of a spec whose instances of one role share a tp; else the
// instance count by role and tp ("2P@tp1+1P@tp2+3D@tp1").
std::string describe_layout(const ClusterSpec& spec);

// Requests are recorded as duet-bench records them (loadgen/record.h:
// sent at their arrival, every token at the end of the step that made it),
// so the same summaries, JSON report and plots apply. Prompts are the
// trace's token ids when it has them (prefix caching then behaves as it
// would), else distinct random ids per request (no prefix is shared, as
// duet-bench's corpus windows share none). Every request ignores
// end-of-generation: it gets exactly its output tokens.
// Throws duet::Error (kInvalidArgument) for a spec the profile cannot cost
// (a tp it lacks, a transfer path it lacks) or an invalid spec.
SimResult simulate(const Profile& profile, const SimOptions& options,
                   std::span<const loadgen::PlannedRequest> trace);

}  // namespace duet::sim
