// Instances on other ranks of an mpirun job, as the coordinator (rank 0) sees
// them.
//
// A RemoteInstance is the InstanceClient of one instance leader: submit and
// cancel become SubmitRequest and Cancel messages on the control channel, the
// leader's StepEvents come back as one EventHandler call per engine step, and
// its StatsReports are kept as the latest stats (at most one step old).
//
// RemoteCluster owns one RemoteInstance per instance of the spec and the one
// dispatcher thread that receives everything the leaders send and routes it
// to the right RemoteInstance by source rank. Its life on rank 0:
//
//   handshake -> await_instances_ready -> RemoteCluster (dispatcher runs)
//   -> ... serve ... -> shut_down (Shutdown to every leader, channel closed
//   collectively, dispatcher joined)
//
// Thread affinity: submit, cancel, stats and info from any thread (the
// fronts', the dispatcher's). Event handlers run on the dispatcher thread.
// Construct, shut_down and destroy RemoteCluster on the main thread.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/mpi/control_channel.h"
#include "common/serving.h"

namespace duet {

class RemoteInstance final : public InstanceClient {
 public:
  // `channel` outlives the instance. `ready` is the leader's InstanceReady.
  RemoteInstance(ControlChannel& channel, Rank leader, const InstanceReady& ready);

  const InstanceInfo& info() const override { return info_; }
  void set_event_handler(EventHandler handler) override;
  // Once the channel is closing, submit throws (the service refuses the
  // request) and cancel is logged and dropped: close only after the fronts
  // stopped (RemoteCluster::shut_down).
  void submit(InstanceRequest request) override;
  void cancel(RequestId id) override;
  InstanceStats stats() const override;

  Rank leader() const { return leader_; }

  // The dispatcher thread.
  void on_step_events(std::span<const InstanceEvent> events);
  void on_stats(const InstanceStats& stats);

 private:
  ControlChannel& channel_;
  const Rank leader_;
  const InstanceInfo info_;

  mutable std::mutex mutex_;  // guards the members below
  EventHandler handler_;
  InstanceStats stats_;
};

// Rank 0, right after the handshake: waits for every leader's InstanceReady.
// Throws duet::Error naming the instance when one could not start (its error)
// or did not answer within `timeout`; the caller then shuts the cluster down
// (shut_down_leaders) and closes the channel. Returned in instance order.
std::vector<InstanceReady> await_instances_ready(ControlChannel& channel, const ClusterSpec& spec,
                                                 std::chrono::milliseconds timeout);

// Sends Shutdown{reason} to every leader of `spec` (a failed start; a normal
// end goes through RemoteCluster::shut_down).
void shut_down_leaders(ControlChannel& channel, const ClusterSpec& spec, const std::string& reason);

class RemoteCluster final {
 public:
  // `channel` outlives the cluster; `ready` from await_instances_ready.
  // Starts the dispatcher thread.
  RemoteCluster(ControlChannel& channel, const ClusterSpec& spec,
                const std::vector<InstanceReady>& ready);
  // Shuts down (as shut_down) if that was not done.
  ~RemoteCluster();
  RemoteCluster(const RemoteCluster&) = delete;
  RemoteCluster& operator=(const RemoteCluster&) = delete;

  // In spec order; owned by the cluster.
  std::vector<InstanceClient*> instances() const;

  // Sends Shutdown to every leader, closes the channel (collective: every
  // rank closes) and joins the dispatcher, which delivers what arrived
  // before the close. Returns whether every rank closed within `timeout`.
  // Call once, after the fronts stopped submitting.
  bool shut_down(const std::string& reason,
                 std::chrono::milliseconds timeout = std::chrono::seconds(30));

 private:
  void dispatch();  // the dispatcher thread

  ControlChannel& channel_;
  std::vector<std::unique_ptr<RemoteInstance>> instances_;  // immutable after construction
  bool shut_down_ = false;                                  // main thread
  std::thread dispatcher_;  // last: starts after everything above exists
};

}  // namespace duet
