// The coordinator's leases on the instances of an mpirun cluster: which are
// alive, which are lost, and since when. No MPI and no clock of its own:
// the caller feeds it what the ranks send and the time, and asks it which
// instances it has lost (tests drive it in milliseconds).
//
// Every instance rank heartbeats to the coordinator every lease / 6, also
// when idle (worker/rank_liveness.h); any message from a rank counts as a
// heartbeat. An instance is lost, once and for good, when
// - any of its ranks has been silent for longer than the lease (a dead
//   process, a SIGSTOP, a host gone), or
// - its leader has been inside an engine step, with no progress, for longer
//   than the lease (its progress counter, which moves with every step and
//   every layer of a long one, stood still while busy: a hung collective, a
//   wedged GPU, a follower that died under it), or
// - the control channel's TCP connection to any of its ranks ended before
//   that rank closed it (its process died, or its host is cut off: common/
//   mpi/control_channel.h), at the next check, without waiting out the lease.
// Each loss raises the cluster's epoch by one. Ranks told of a loss apply it
// and report the epoch they have applied in their heartbeats; a lost rank
// that wakes up (SIGCONT) is told again, and leaves.
//
// Thread affinity: none; the owner serializes calls (RemoteCluster's lock).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"

namespace duet {

struct InstanceLoss {
  int32_t instance_id = 0;
  std::vector<Rank> ranks;  // every rank of the instance, leader first
  uint64_t epoch = 0;       // the cluster's epoch this loss made
  std::string reason;       // "rank 3 silent for 3012 ms (lease 3000 ms)"
};

class Liveness final {
 public:
  using Clock = std::chrono::steady_clock;

  // Every instance of `spec` starts alive, as if each rank had just spoken.
  Liveness(const ClusterSpec& spec, std::chrono::milliseconds lease, Clock::time_point now);

  // Any message from `rank`: it lives. Ranks in no instance are ignored.
  void heard_from(Rank rank, Clock::time_point now);
  // A heartbeat: heard_from, and the leader's step counter and busy flag.
  void on_heartbeat(const Heartbeat& beat, Clock::time_point now);
  // `rank`'s control connection ended (`why`: "closed the connection"): its
  // instance is lost at the next check(). Ranks in no instance, and lost
  // instances, are ignored; the first end of an instance's ranks names it.
  void connection_lost(Rank rank, const std::string& why);

  // The instances lost since the last call, each once, in instance order.
  std::vector<InstanceLoss> check(Clock::time_point now);

  bool lost(int32_t instance_id) const;
  bool rank_lost(Rank rank) const;
  // Every rank of every lost instance, in rank order.
  std::vector<Rank> lost_ranks() const;
  int n_lost() const;
  uint64_t epoch() const { return epoch_; }
  std::chrono::milliseconds lease() const { return lease_; }

  // For stats: each instance's state, in instance order.
  struct InstanceView {
    int32_t instance_id = 0;
    bool lost = false;
    uint64_t epoch = 0;  // the epoch its loss made; 0 while alive
    int64_t step = -1;   // its leader's last reported step
    std::string reason;  // why it was lost
  };
  std::vector<InstanceView> view() const;

 private:
  struct Watched {
    int32_t instance_id = 0;
    std::vector<Rank> ranks;
    std::vector<Clock::time_point> last_heard;  // by position in ranks
    int64_t step = -1;
    bool busy = false;
    Clock::time_point step_moved_at;  // when the step last moved, or busy began
    bool lost = false;
    uint64_t lost_epoch = 0;
    std::string reason;
    std::string connection_lost;  // why, once a rank's control connection ended
  };
  // The instance and position of `rank`, or nullptr.
  Watched* find(Rank rank, size_t* position);

  const std::chrono::milliseconds lease_;
  std::vector<Watched> instances_;
  // Every instance rank's instance (index) and position in it: each message
  // is looked up here, so a cluster of thousands of ranks costs no scan.
  std::map<Rank, std::pair<size_t, size_t>> where_;
  uint64_t epoch_ = 0;
};

}  // namespace duet
