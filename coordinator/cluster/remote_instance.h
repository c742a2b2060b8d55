// Instances on other ranks of an mpirun job, as the coordinator (rank 0) sees
// them. A RemoteInstance is the InstanceClient of one instance leader: submit and
// cancel become SubmitRequest and Cancel messages on the control channel, the
// leader's StepEvents come back as one EventHandler call per engine step, and its
// latest StatsReport is its stats (at most one step old). RemoteCluster owns one
// per instance and the one dispatcher thread that routes everything the leaders
// send by source rank. On rank 0: handshake, await_instances_ready, RemoteCluster,
// serve, shut_down.
//
// The dispatcher holds the lease on every instance (coordinator/cluster/liveness.h):
// judged at least four times per lease, after applying every message that had arrived
// (docs/FAILURES.md, "Suspect before lost"), and at once when a rank's TCP control
// connection ends. A lost instance's ranks are told (RanksLost) and forgotten by the
// channel, its RemoteInstance refuses new requests, the loss handler runs; its late
// messages are dropped, and a lost rank that speaks again is told again.
//
// Instances may join while the cluster serves (coordinator/cluster/join_listener.h):
// judge_join and admit give one an address on the channel and an instance id,
// its InstanceReady makes it a RemoteInstance (the joined handler routes to
// it), and it leaves with Leaving (drain: the leaving handler) then
// Leaving{done} (the left handler); its lease holds from admission until then.
//
// Threads: submit, cancel, stats and info from any thread; every handler on the
// dispatcher thread; RemoteCluster built, shut down and destroyed on the main thread.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/control_plane/control_channel.h"
#include "common/serving.h"
#include "coordinator/cluster/liveness.h"

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
  // From then on submit throws and cancel is dropped.
  void mark_lost();

 private:
  ControlChannel& channel_;
  const Rank leader_;
  const InstanceInfo info_;

  mutable std::mutex mutex_;  // guards the members below
  EventHandler handler_;
  InstanceStats stats_;
  bool lost_ = false;
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

// The most ranks an instance that joins may have.
inline constexpr int32_t kMaxJoinTp = 64;

class RemoteCluster final {
 public:
  // `channel` outlives the cluster; `ready` from await_instances_ready.
  // Starts the dispatcher thread; the leases start now.
  RemoteCluster(ControlChannel& channel, const ClusterSpec& spec,
                const std::vector<InstanceReady>& ready, std::chrono::milliseconds lease);
  // Shuts down (as shut_down) if that was not done.
  ~RemoteCluster();
  RemoteCluster(const RemoteCluster&) = delete;
  RemoteCluster& operator=(const RemoteCluster&) = delete;

  // The instances the cluster started with, in spec order; owned by the cluster.
  std::vector<InstanceClient*> instances() const;

  // Membership. Handlers run on the dispatcher thread; set them before serving.
  struct MembershipHandlers {
    // Instance `instance_id` joined and is ready at address `member` (its
    // KV transfer's address too); `client` is owned by the cluster.
    // Throwing refuses it (its leader is told to shut down, with the reason).
    std::function<void(int32_t instance_id, Rank member, int32_t tp, InstanceClient* client,
                       InstanceRole role, const std::string& host)>
        joined;
    // It leaves: send it nothing new.
    std::function<void(int32_t instance_id)> leaving;
    // It drained and is gone (not a loss).
    std::function<void(int32_t instance_id, const std::string& reason)> left;
  };
  void set_membership_handlers(MembershipHandlers handlers);
  // Where the job's instance ranks listen for the KV links of prefill and
  // decode members (worker/transfer/kv_member_links.h); none: the cluster
  // takes no such member. Before serving.
  void set_kv_links(std::vector<KvLinkAddress> links);
  // Any thread: whether `request` may join a cluster of `mode` serving the
  // model of `fingerprint`; accepted, with the address and instance id it is
  // to take (reserved, never reused), or refused with a one-line reason.
  JoinVerdict judge_join(const JoinRequest& request, ClusterMode mode,
                         const std::string& fingerprint);
  // Any thread: an accepted join (its verdict), whose authenticated control
  // connection is `socket` (owned from now on): its lease starts now.
  void admit(const JoinVerdict& verdict, const JoinRequest& request, int socket);

  // Called on the dispatcher thread with the index of each instance lost,
  // after its ranks were told and forgotten. Set it before serving.
  using LossHandler = std::function<void(const InstanceLoss& loss)>;
  void set_loss_handler(LossHandler handler);
  // Called on the dispatcher thread after every pass (at least four times a
  // lease): the router's tick. Set it before serving.
  void set_tick_handler(std::function<void()> handler);
  // Each instance's liveness, in spec order (any thread).
  std::vector<Liveness::InstanceView> liveness() const;
  uint64_t epoch() const;

  // Sends Shutdown to every leader, closes the channel (collective: every
  // rank closes) and joins the dispatcher, which delivers what arrived
  // before the close. Returns whether every rank closed within `timeout`.
  // Call once, after the fronts stopped submitting.
  bool shut_down(const std::string& reason,
                 std::chrono::milliseconds timeout = std::chrono::seconds(30));

 private:
  void dispatch();  // the dispatcher thread
  // The dispatcher thread: one received message, to the leases and to its
  // instance.
  void apply(const ReceivedMessage& received);
  // The dispatcher thread: the leases judged at `now`, losses acted on.
  void check_leases(std::chrono::steady_clock::time_point now);
  void lose(const InstanceLoss& loss);
  // The dispatcher thread: a member's InstanceReady, Leaving.
  void member_ready(Rank source, const InstanceReady& ready);
  void member_leaving(Rank source, const Leaving& leaving);
  // Under mutex_: the KV listeners of every instance neither lost nor gone.
  std::vector<KvLinkAddress> live_kv_links() const;

  ControlChannel& channel_;
  // The instances it started with (immutable) and those that joined since
  // (appended by the dispatcher thread, under mutex_).
  std::vector<std::unique_ptr<RemoteInstance>> instances_;
  size_t n_started_ = 0;
  // The dispatcher thread's: each instance's leader.
  std::map<Rank, RemoteInstance*> by_leader_;
  mutable std::mutex mutex_;  // guards the members below
  ClusterSpec spec_;          // grows as members are admitted
  Liveness liveness_;
  LossHandler on_lost_;
  std::function<void()> on_tick_;
  MembershipHandlers membership_;
  struct Member {
    int32_t instance_id = 0;
    InstanceRole role = InstanceRole::kBoth;
    std::string host;
    int32_t tp = 1;  // its ranks: its address and the next tp - 1
    bool ready = false, leaving = false, left = false;
  };
  std::map<Rank, Member> members_;  // by address
  // Every KV listener: the job's instance ranks', then each prefill or
  // decode member's.
  std::map<Rank, KvLinkAddress> kv_links_;
  int next_member_ = 0;  // the next address to give
  int next_instance_id_ = 0;
  bool shut_down_ = false;  // guarded by mutex_
  std::thread dispatcher_;  // last: starts after everything above exists
};

}  // namespace duet
