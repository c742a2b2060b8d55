#include "coordinator/cluster/cluster_coordinator.h"

#include <spdlog/spdlog.h>

#include <utility>
#include <vector>

namespace duet {
namespace {

// Every instance's InstanceReady, or the cluster aborted and the error rethrown.
std::vector<InstanceReady> await_ready(ControlChannel& channel, const ClusterSpec& spec,
                                       std::chrono::milliseconds ready_timeout,
                                       std::chrono::milliseconds close_timeout) {
  try {
    return await_instances_ready(channel, spec, ready_timeout);
  } catch (const std::exception& e) {
    abort_cluster(channel, spec, e.what(), close_timeout);
    throw;
  }
}

// The cluster's instances as the router places over them: each with its
// role and its leader's rank (its transfer address).
std::vector<RoutedInstance> routed_instances(const RemoteCluster& cluster,
                                             const ClusterSpec& spec) {
  std::vector<RoutedInstance> instances;
  const std::vector<InstanceClient*> clients = cluster.instances();
  for (size_t i = 0; i < spec.instances.size(); ++i) {
    instances.push_back({clients[i], spec.instances[i].role, spec.instances[i].leader().value});
  }
  return instances;
}

}  // namespace

void abort_cluster(ControlChannel& channel, const ClusterSpec& spec, const std::string& reason,
                   std::chrono::milliseconds timeout) {
  shut_down_leaders(channel, spec, reason);
  channel.close(timeout);
}

ClusterCoordinator::ClusterCoordinator(ControlChannel& channel, const ClusterSpec& spec,
                                       const ClusterCoordinatorOptions& options)
    : spec_(spec),
      cluster_(channel, spec,
               await_ready(channel, spec, options.ready_timeout, options.close_timeout),
               options.instance_lease),
      routed_(routed_instances(cluster_, spec), make_routing_policy(spec.mode),
              options.max_retries) {
  cluster_.set_loss_handler([this](const InstanceLoss& loss) {
    routed_.instance_lost(static_cast<size_t>(loss.instance_id), loss.epoch, loss.reason);
  });
  spdlog::info("cluster: {}; routing: {}; instance lease {} ms, up to {} re-run(s) per request",
               spec.describe(), routed_.policy().name(), options.instance_lease.count(),
               options.max_retries);
}

bool ClusterCoordinator::shut_down(const std::string& reason, std::chrono::milliseconds timeout) {
  // Where the requests went, for logs (and tests).
  const std::vector<int64_t> routed_counts = routed_.routed_counts();
  const std::vector<InstanceStats> stats = routed_.instance_stats();
  for (size_t i = 0; i < spec_.instances.size(); ++i) {
    spdlog::info("instance {} (rank {}): {} requests routed, {} tokens generated", i,
                 spec_.instances[i].leader().value, routed_counts[i], stats[i].generated_tokens);
  }
  return cluster_.shut_down(reason, timeout);
}

}  // namespace duet
