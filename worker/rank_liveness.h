// An instance rank's side of liveness (coordinator/cluster/liveness.h):
// heartbeats to the coordinator, and the coordinator's RanksLost applied.
//
// - Heartbeats: a thread of its own sends one every `interval` (lease / 6),
//   also while the rank loads its model or idles, carrying the engine's step
//   counter, whether it is inside a step (the leader's; a follower sends -1)
//   and the newest loss epoch this rank applied.
// - RanksLost is applied on the control channel's communication thread (an
//   intercept), even while the main thread waits in a collective: the channel
//   and the KV transfer forget the lost ranks, MPI will not be finalized (it
//   could wait on them forever), and when the list names any rank of this
//   instance, this one included, the rank leaves at once (exit code 0).
// - The control channel's TCP link to the coordinator ending (it counted this
//   rank lost, or is gone) makes the rank leave the same way.
// Thread affinity: construct and destroy on the rank's main thread; watch() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/control_channel.h"
#include "common/control_plane/mpi_runtime.h"
#include "worker/instance_server.h"
#include "worker/local_instance.h"
#include "worker/transfer/kv_transfer.h"

namespace duet {

class RankLiveness final {
 public:
  // `transfer` may be null (a colocated instance moves no KV), `mpi` too (a
  // joined instance, outside any MPI job). All outlive this.
  // `on_lost` (a joined instance, which rejoins): called once, on the
  // channel's thread, with why, where a rank of the job would leave the
  // process (its instance lost, or its link to the coordinator ended).
  using LostHandler = std::function<void(const std::string& why)>;
  RankLiveness(ControlChannel& channel, KvTransfer* transfer, MpiRuntime* mpi,
               const InstanceSpec& instance, std::chrono::milliseconds interval,
               LostHandler on_lost = {});
  ~RankLiveness();  // stops the heartbeats and removes the intercept
  RankLiveness(const RankLiveness&) = delete;
  RankLiveness& operator=(const RankLiveness&) = delete;

  // The leader: where its heartbeats read the engine's progress (an empty
  // function: none, as before the engine exists and after it stops).
  void watch(std::function<EngineProgress()> progress);
  // Also told which ranks are lost, before the transfer is (a joined
  // group's leader passes them to its followers, which hear nothing from the
  // coordinator); an empty function: no one. Runs under the liveness's
  // lock: once also_tell({}) returns, it is not running.
  using PeersLost = std::function<void(std::span<const Rank> ranks)>;
  void also_tell(PeersLost peers_lost);

 private:
  void beat_until_stopped();                   // the heartbeat thread
  bool apply(const ReceivedMessage& message);  // the communication thread
  void leave_unheard(const std::string& why);  // the communication thread
  // Leaves the process, or (on_lost_) hands the loss to the caller once.
  void lost(const std::string& why);

  ControlChannel& channel_;
  KvTransfer* const transfer_;
  MpiRuntime* const mpi_;
  const InstanceSpec instance_;
  const Rank rank_;
  const std::chrono::milliseconds interval_;
  std::atomic<uint64_t> epoch_{0};
  const LostHandler on_lost_;
  std::atomic<bool> lost_{false};

  std::mutex mutex_;  // guards the members below
  std::condition_variable wake_;
  bool stop_ = false;
  std::function<EngineProgress()> progress_;
  PeersLost also_tell_;

  std::thread thread_;  // last: starts after everything above exists
};

// For an instance that outlives its loss (a joined member, a rank that
// rejoins): the loss stops the InstanceServer it serves, whether it comes
// while the server runs or before it starts. lost() is RankLiveness's
// LostHandler (the channel's thread); the rest from the serving thread.
class LossLatch final {
 public:
  void lost(const std::string& why);
  // Before serve(): the server to stop (stopped at once if the loss came
  // already); null after it.
  void serving(InstanceServer* server);
  bool is_lost() const;

 private:
  mutable std::mutex mutex_;
  bool lost_ = false;
  InstanceServer* server_ = nullptr;
};

}  // namespace duet
