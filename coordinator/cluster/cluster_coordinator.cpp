#include "coordinator/cluster/cluster_coordinator.h"

#include <spdlog/spdlog.h>

#include <utility>
#include <vector>

#include "common/error.h"

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
// role and its leader's rank (its transfer address); a disaggregated
// cluster's all have KV links, so any may change role.
std::vector<RoutedInstance> routed_instances(const RemoteCluster& cluster,
                                             const ClusterSpec& spec) {
  std::vector<RoutedInstance> instances;
  const std::vector<InstanceClient*> clients = cluster.instances();
  for (size_t i = 0; i < spec.instances.size(); ++i) {
    instances.push_back({clients[i], spec.instances[i].role, spec.instances[i].leader().value,
                         spec.mode == ClusterMode::kDisaggregated, spec.instances[i].tp});
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
    if (const std::optional<size_t> index = routed_index(loss.instance_id))
      routed_.instance_lost(*index, loss.epoch, loss.reason);
  });
  RemoteCluster::MembershipHandlers membership;
  membership.joined = [this](int32_t id, Rank member, int32_t tp, InstanceClient* client,
                             InstanceRole role, const std::string& host) {
    // Its address on the channel is its transfer address too; in a
    // disaggregated cluster it has KV links with every instance, so it may
    // change role as theirs may.
    const size_t index = routed_.add_instance(
        {client, role, member.value, spec_.mode == ClusterMode::kDisaggregated, tp}, host);
    std::lock_guard lock(mutex_);
    routed_index_[id] = index;
  };
  membership.leaving = [this](int32_t id) {
    if (const std::optional<size_t> index = routed_index(id)) routed_.drain_instance(*index);
  };
  membership.left = [this](int32_t id, const std::string& reason) {
    if (const std::optional<size_t> index = routed_index(id)) routed_.instance_left(*index, reason);
  };
  cluster_.set_membership_handlers(std::move(membership));
  cluster_.set_kv_links(options.kv_links);
  routed_.set_rerun_wait(options.rerun_wait);
  cluster_.set_tick_handler([this] { routed_.tick(); });
  if (options.join_port) {
    DUET_REQUIRE(options.cluster_key.has_value(), "--join-port needs --cluster-key FILE");
    join_ = std::make_unique<JoinListener>(cluster_, *options.cluster_key, spec.mode,
                                           options.model_fingerprint, *options.join_port);
  }
  spdlog::info("cluster: {}; routing: {}; instance lease {} ms, up to {} re-run(s) per request",
               spec.describe(), routed_.policy().name(), options.instance_lease.count(),
               options.max_retries);
}

std::optional<size_t> ClusterCoordinator::routed_index(int32_t instance_id) const {
  if (instance_id >= 0 && static_cast<size_t>(instance_id) < spec_.instances.size())
    return static_cast<size_t>(instance_id);
  std::lock_guard lock(mutex_);
  const auto it = routed_index_.find(instance_id);
  if (it == routed_index_.end()) return std::nullopt;
  return it->second;
}

std::optional<uint16_t> ClusterCoordinator::join_port() const {
  if (!join_) return std::nullopt;
  return join_->port();
}

bool ClusterCoordinator::shut_down(const std::string& reason, std::chrono::milliseconds timeout) {
  join_.reset();  // no one joins a cluster that ends
  // Where the requests went, for logs (and tests).
  const std::vector<int64_t> routed_counts = routed_.routed_counts();
  const std::vector<InstanceStats> stats = routed_.instance_stats();
  for (size_t i = 0; i < spec_.instances.size(); ++i) {
    spdlog::info("instance {} (rank {}): {} requests routed, {} tokens generated", i,
                 spec_.instances[i].leader().value, routed_counts[i], stats[i].generated_tokens);
  }
  std::lock_guard lock(mutex_);
  for (const auto& [id, index] : routed_index_) {
    spdlog::info("instance {} (joined): {} requests routed, {} tokens generated", id,
                 routed_counts.at(index), stats.at(index).generated_tokens);
  }
  return cluster_.shut_down(reason, timeout);
}

}  // namespace duet
