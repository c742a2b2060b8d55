// Rank 0 of an mpirun cluster (`duet serve`): the instances on the other
// ranks behind one router, for the service and its fronts.
//
// Its life, right after the handshake: the constructor waits until every
// instance reports ready, then routes over them (RemoteCluster under
// RoutedInstances, with the spec's mode's policy); the caller serves its
// fronts over router(); shut_down() logs where the requests went and ends
// the cluster (Shutdown to every leader, the channel closed collectively).
// A failure before the cluster exists (the coordinator's own start, or an
// instance that cannot start) ends it with abort_cluster, so that every rank
// still closes the channel together.
//
// With a join port, instances may join while it serves (join_listener.h): each
// is added to the router once ready, drained when it leaves, and re-run from
// when it is lost, as any other.
//
// Thread affinity: construct, shut_down and destroy on the main thread; the
// router is called from any thread (coordinator/router.h).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/control_channel.h"
#include "common/net/cluster_auth.h"
#include "coordinator/cluster/join_listener.h"
#include "coordinator/cluster/remote_instance.h"
#include "coordinator/router.h"

namespace duet {

// Sends Shutdown{reason} to every leader and closes the channel (collective:
// every rank closes), waiting up to `timeout`.
void abort_cluster(ControlChannel& channel, const ClusterSpec& spec, const std::string& reason,
                   std::chrono::milliseconds timeout);

struct ClusterCoordinatorOptions {
  std::chrono::milliseconds ready_timeout{300'000};
  std::chrono::milliseconds close_timeout{30'000};
  std::chrono::milliseconds instance_lease{3'000};  // coordinator/cluster/liveness.h
  int max_retries = 2;  // re-runs of one request after losses (coordinator/router.h)
  // How long a re-run that no live instance can take waits for one
  // (RoutedInstances::set_rerun_wait).
  std::chrono::milliseconds rerun_wait{0};
  // Instances may join on this port (coordinator/cluster/join_listener.h),
  // proving `cluster_key`, when serving the model of `model_fingerprint`.
  std::optional<uint16_t> join_port;
  std::optional<ClusterKey> cluster_key;
  std::string model_fingerprint;
  // Where the instance ranks listen for joined instances' KV links (a
  // disaggregated cluster on CPUs): RemoteCluster::set_kv_links.
  std::vector<KvLinkAddress> kv_links;
};

class ClusterCoordinator final {
 public:
  // `channel` outlives the coordinator. Waits up to `ready_timeout` for
  // every instance's InstanceReady; when one cannot start or does not
  // answer, aborts the cluster (abort_cluster, waiting up to `close_timeout`)
  // and throws duet::Error naming it. Then holds a lease on every instance
  // and re-runs the requests of any it loses.
  ClusterCoordinator(ControlChannel& channel, const ClusterSpec& spec,
                     const ClusterCoordinatorOptions& options);
  ClusterCoordinator(const ClusterCoordinator&) = delete;
  ClusterCoordinator& operator=(const ClusterCoordinator&) = delete;

  // Every instance behind the router; owned by the coordinator.
  RoutedInstances& router() { return routed_; }
  // The port instances join on, when they may.
  std::optional<uint16_t> join_port() const;
  // Each instance's liveness, in spec order (any thread).
  std::vector<Liveness::InstanceView> liveness() const { return cluster_.liveness(); }

  // Logs the requests routed to each instance and its generated tokens, then
  // ends the cluster (RemoteCluster::shut_down). Returns whether every rank
  // closed the channel within `timeout`. Call once, after the fronts stopped
  // submitting, and before destroying what calls into the router (the
  // service): it joins the thread that delivers the instances' events.
  bool shut_down(const std::string& reason, std::chrono::milliseconds timeout);

 private:
  // The router's index of an instance (by its id), or nullopt for one that
  // never got to the router (a member refused, or lost before it was ready).
  std::optional<size_t> routed_index(int32_t instance_id) const;

  const ClusterSpec spec_;
  RemoteCluster cluster_;
  RoutedInstances routed_;                  // over cluster_'s instances
  mutable std::mutex mutex_;                // guards routed_index_
  std::map<int32_t, size_t> routed_index_;  // joined instances: id -> router index
  std::unique_ptr<JoinListener> join_;      // last: admits into everything above
};

}  // namespace duet
