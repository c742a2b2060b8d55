// The coordinator's leases on the instances of an mpirun cluster: which are alive,
// suspect or lost, and since when. No MPI and no clock of its own: the caller feeds
// it what the ranks send (stamped with its arrival) and the time, and asks which
// instances are lost (tests drive it in milliseconds).
//
// Every instance rank heartbeats every lease / 6, also when idle
// (worker/rank_liveness.h); any message from a rank counts as one. A rank silent
// past the lease makes its instance suspect (logged only; any word clears it). The
// instance is lost, once and for good, when the silence lasts the lease plus
// grace_for(lease); when its leader has been that long inside one engine step with
// its progress counter (every step, every layer) standing still; or at the next
// check after a rank's control connection ended (connection_lost). Each loss raises
// the epoch by one; ranks report the epoch they applied in their heartbeats, and a
// lost rank that wakes up is told again, and leaves. Why suspect before lost:
// docs/FAILURES.md, "Suspect before lost: no false losses on a loaded machine".
//
// Thread affinity: none; the owner serializes calls (RemoteCluster's lock).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
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

  // How long past the lease a silence must last to be a loss: half the
  // lease, at most 1 s.
  static std::chrono::milliseconds grace_for(std::chrono::milliseconds lease);

  // An instance that joined while serving (its ranks are member addresses,
  // never used before): alive from `now`, as if each rank had just spoken.
  void add_instance(const InstanceSpec& instance, Clock::time_point now);
  // An instance that left after draining: never judged again (its silence
  // and its connection's end are not a loss). Ignored for a lost one.
  void retire(int32_t instance_id);

  // Any message from `rank`, which arrived at `arrived`: it lives. Ranks in
  // no instance are ignored.
  void heard_from(Rank rank, Clock::time_point arrived);
  // A heartbeat: heard_from, and the leader's step counter and busy flag.
  void on_heartbeat(const Heartbeat& beat, Clock::time_point arrived);
  // The coordinator was not running from `from` to `to` (its dispatcher
  // overslept): that time does not count as anyone's silence.
  void coordinator_paused(Clock::time_point from, Clock::time_point to);
  // `rank`'s control connection ended (`why`: "closed the connection"): its
  // instance is lost at the next check(). Ranks in no instance, and lost
  // instances, are ignored; the first end of an instance's ranks names it.
  void connection_lost(Rank rank, const std::string& why);

  // The instances lost since the last call, each once, in instance order.
  std::vector<InstanceLoss> check(Clock::time_point now);
  // What changed short of a loss since the last call, one log line each:
  // instances that became suspect, and suspects heard again.
  std::vector<std::string> take_notices();

  bool lost(int32_t instance_id) const;
  bool rank_lost(Rank rank) const;
  // Every rank of every lost instance, in rank order.
  std::vector<Rank> lost_ranks() const;
  int n_lost() const;
  uint64_t epoch() const { return epoch_; }
  std::chrono::milliseconds lease() const { return lease_; }
  std::chrono::milliseconds grace() const { return grace_; }
  // Suspicions raised, and those cleared by the rank speaking again (each a
  // loss that one late heartbeat would have made).
  int64_t n_suspected() const { return n_suspected_; }
  int64_t n_cleared() const { return n_cleared_; }

  // For stats: each instance's state, in instance order.
  struct InstanceView {
    int32_t instance_id = 0;
    bool lost = false;
    bool suspect = false;
    uint64_t epoch = 0;  // the epoch its loss made; 0 while alive
    int64_t step = -1;   // its leader's last reported step
    std::string reason;  // why it was lost, or why it is suspect
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
    bool suspect = false;
    std::string suspicion;              // why, while suspect
    std::chrono::milliseconds worst{};  // the longest silence while suspect
    bool lost = false;
    bool retired = false;  // left after draining
    uint64_t lost_epoch = 0;
    std::string reason;
    std::string connection_lost;  // why, once a rank's control connection ended
  };
  struct Pause {
    Clock::time_point from, to;
  };
  // The instance and position of `rank`, or nullptr.
  Watched* find(Rank rank, size_t* position);
  // `now - since`, less the coordinator's pauses in between.
  std::chrono::milliseconds silence(Clock::time_point since, Clock::time_point now) const;
  // The longest silence of `watched`'s ranks or of its busy leader's step
  // and what it is, or an empty reason when within the lease.
  std::pair<std::chrono::milliseconds, std::string> worst_silence(const Watched& watched,
                                                                  Clock::time_point now) const;

  const std::chrono::milliseconds lease_;
  const std::chrono::milliseconds grace_;
  std::deque<Pause> pauses_;  // oldest first; dropped once older than any silence that counts
  std::vector<std::string> notices_;
  int64_t n_suspected_ = 0;
  int64_t n_cleared_ = 0;
  std::vector<Watched> instances_;
  // Every instance rank's instance (index) and position in it: each message
  // is looked up here, so a cluster of thousands of ranks costs no scan.
  std::map<Rank, std::pair<size_t, size_t>> where_;
  uint64_t epoch_ = 0;
};

}  // namespace duet
