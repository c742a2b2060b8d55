// The coordinator's leases (coordinator/cluster/liveness.h), on a clock the
// test moves: silence (suspect past the lease, lost past the grace), a
// stalled step, a follower's silence, an ended control connection, the
// coordinator's own pauses, and what a lost instance's late messages change
// (nothing).
#include "coordinator/cluster/liveness.h"

#include <gtest/gtest.h>

namespace duet {
namespace {

using namespace std::chrono_literals;
using Clock = Liveness::Clock;

// A prefill instance on rank 1, a TP=2 decode instance on ranks 2 (leader) and 3.
ClusterSpec spec() { return parse_cluster_flags(1, 1, 1, 2, ClusterMode::kDisaggregated); }

Heartbeat beat(int32_t instance, int rank, int64_t step, bool busy) {
  return Heartbeat{instance, Rank{rank}, 0, step, busy};
}

// Every rank but `silent` beats at `now`.
void all_beat(Liveness& live, Clock::time_point now, int silent = -1) {
  for (int rank = 1; rank <= 3; ++rank) {
    if (rank == silent) continue;
    live.on_heartbeat(beat(rank == 1 ? 0 : 1, rank, rank == 3 ? -1 : 10, false), now);
  }
}

TEST(Liveness, BeatingInstancesStayAlive) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 3000ms, t0);
  for (int i = 1; i <= 20; ++i) {
    all_beat(live, t0 + i * 500ms);
    EXPECT_TRUE(live.check(t0 + i * 500ms).empty());
  }
  EXPECT_EQ(live.n_lost(), 0);
  EXPECT_EQ(live.epoch(), 0u);
}

TEST(Liveness, ASilentRankLosesItsInstanceOnce) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 3000ms, t0);
  EXPECT_EQ(live.grace(), 1000ms);
  for (int i = 1; i <= 8; ++i) all_beat(live, t0 + i * 500ms, /*silent=*/2);
  EXPECT_TRUE(live.check(t0 + 3000ms).empty());  // exactly the lease: not yet
  EXPECT_FALSE(live.view()[1].suspect);
  EXPECT_TRUE(live.check(t0 + 3001ms).empty());  // past the lease: suspect
  EXPECT_TRUE(live.view()[1].suspect);
  EXPECT_EQ(live.view()[1].reason, "rank 2 silent for 3001 ms");
  EXPECT_TRUE(live.check(t0 + 4000ms).empty());  // the lease and the grace: not yet
  const std::vector<InstanceLoss> losses = live.check(t0 + 4001ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].ranks, (std::vector<Rank>{Rank{2}, Rank{3}}));
  EXPECT_EQ(losses[0].epoch, 1u);
  EXPECT_EQ(losses[0].reason, "rank 2 silent for 4001 ms (lease 3000 ms + grace 1000 ms)");
  EXPECT_FALSE(live.view()[1].suspect);
  EXPECT_EQ(live.view()[1].reason, losses[0].reason);
  EXPECT_TRUE(live.lost(1));
  EXPECT_TRUE(live.rank_lost(Rank{2}));
  EXPECT_TRUE(live.rank_lost(Rank{3}));
  EXPECT_FALSE(live.rank_lost(Rank{1}));
  // Reported once; a late heartbeat (a SIGCONT) does not bring it back.
  live.on_heartbeat(beat(1, 2, 11, false), t0 + 4500ms);
  EXPECT_TRUE(live.check(t0 + 4500ms).empty());
  EXPECT_TRUE(live.lost(1));
  EXPECT_EQ(live.n_lost(), 1);
}

TEST(Liveness, AnEndedConnectionLosesItsInstanceWithoutWaitingForTheLease) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 3000ms, t0);
  all_beat(live, t0 + 100ms);
  live.connection_lost(Rank{0}, "closed the connection");  // the coordinator: ignored
  live.connection_lost(Rank{3}, "closed the connection");  // a follower
  live.connection_lost(Rank{2}, "Connection reset by peer");
  all_beat(live, t0 + 200ms);  // beats that had been queued change nothing
  const std::vector<InstanceLoss> losses = live.check(t0 + 200ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].ranks, (std::vector<Rank>{Rank{2}, Rank{3}}));
  EXPECT_EQ(losses[0].epoch, 1u);
  EXPECT_EQ(losses[0].reason, "rank 3's control connection ended (closed the connection)");
  EXPECT_FALSE(live.lost(0));
  // Once: a lost instance's ends are ignored.
  live.connection_lost(Rank{2}, "closed the connection");
  EXPECT_TRUE(live.check(t0 + 300ms).empty());
  EXPECT_EQ(live.n_lost(), 1);
}

TEST(Liveness, AFollowersSilenceLosesTheWholeInstance) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  all_beat(live, t0 + 800ms, /*silent=*/3);
  EXPECT_TRUE(live.check(t0 + 1500ms).empty());
  const std::vector<InstanceLoss> losses = live.check(t0 + 1501ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].reason, "rank 3 silent for 1501 ms (lease 1000 ms + grace 500 ms)");
  EXPECT_EQ(live.lost_ranks(), (std::vector<Rank>{Rank{2}, Rank{3}}));
}

TEST(Liveness, ALeaderBusyInOneStepPastTheLeaseIsStalled) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  // Instance 0 idles at step 10 for long (not a stall), then enters step 11
  // and never leaves it, still beating.
  for (int i = 1; i <= 10; ++i) {
    all_beat(live, t0 + i * 200ms);
    EXPECT_TRUE(live.check(t0 + i * 200ms).empty());
  }
  for (int i = 11; i <= 15; ++i) {
    all_beat(live, t0 + i * 200ms, /*silent=*/1);
    live.on_heartbeat(beat(0, 1, 10, true), t0 + i * 200ms);  // busy since 2200 ms
    EXPECT_TRUE(live.check(t0 + i * 200ms).empty()) << i;
  }
  for (int i = 16; i <= 18; ++i) {  // past the lease: suspect, not lost
    all_beat(live, t0 + i * 200ms + 100ms, /*silent=*/1);
    live.on_heartbeat(beat(0, 1, 10, true), t0 + i * 200ms + 100ms);
    EXPECT_TRUE(live.check(t0 + i * 200ms + 100ms).empty()) << i;
    EXPECT_TRUE(live.view()[0].suspect) << i;
  }
  all_beat(live, t0 + 3800ms, /*silent=*/1);
  live.on_heartbeat(beat(0, 1, 10, true), t0 + 3800ms);
  const std::vector<InstanceLoss> losses = live.check(t0 + 3800ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 0);
  EXPECT_EQ(
      losses[0].reason,
      "stalled: no progress inside an engine step for 1600 ms (lease 1000 ms + grace 500 ms)");
}

TEST(Liveness, ABusyLeaderWhoseStepsMoveIsAlive) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  for (int i = 1; i <= 30; ++i) {
    all_beat(live, t0 + i * 200ms, /*silent=*/1);
    live.on_heartbeat(beat(0, 1, 100 + i, true), t0 + i * 200ms);
    EXPECT_TRUE(live.check(t0 + i * 200ms).empty()) << i;
  }
}

TEST(Liveness, EachLossRaisesTheEpochAndAnyMessageCounts) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  // Rank 1 sends events, not heartbeats: it lives. Ranks 2 and 3 say nothing.
  live.heard_from(Rank{1}, t0 + 900ms);
  live.heard_from(Rank{0}, t0 + 900ms);  // the coordinator: in no instance, ignored
  std::vector<InstanceLoss> losses = live.check(t0 + 1501ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].epoch, 1u);
  losses = live.check(t0 + 2401ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 0);
  EXPECT_EQ(losses[0].epoch, 2u);
  EXPECT_EQ(live.epoch(), 2u);
  const std::vector<Liveness::InstanceView> view = live.view();
  ASSERT_EQ(view.size(), 2u);
  EXPECT_TRUE(view[0].lost && view[1].lost);
  EXPECT_EQ(view[0].epoch, 2u);
  EXPECT_EQ(view[1].epoch, 1u);
}

TEST(Liveness, OneLateHeartbeatMakesASuspectNotALoss) {
  // The cascade this guards against: under CPU pressure a healthy rank's
  // heartbeat came 1.25 s late with a 1 s lease, and its instance was lost.
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  all_beat(live, t0 + 100ms);
  all_beat(live, t0 + 1300ms, /*silent=*/2);  // rank 2 descheduled since 100 ms
  EXPECT_TRUE(live.check(t0 + 1350ms).empty());
  EXPECT_TRUE(live.view()[1].suspect);
  EXPECT_EQ(live.n_suspected(), 1);
  EXPECT_EQ(live.take_notices(),
            (std::vector<std::string>{"instance 1 is suspect: rank 2 silent for 1250 ms (lease "
                                      "1000 ms)"}));
  EXPECT_TRUE(live.check(t0 + 1450ms).empty());  // still suspect: raised once
  EXPECT_TRUE(live.take_notices().empty());
  live.on_heartbeat(beat(1, 2, 10, false), t0 + 1460ms);  // it speaks: cleared
  EXPECT_TRUE(live.check(t0 + 1500ms).empty());
  EXPECT_FALSE(live.view()[1].suspect);
  EXPECT_EQ(live.n_cleared(), 1);
  EXPECT_EQ(live.take_notices(),
            (std::vector<std::string>{"instance 1 is no longer suspect: heard again after up to "
                                      "1350 ms (lease 1000 ms)"}));
  EXPECT_EQ(live.n_lost(), 0);
  EXPECT_EQ(live.epoch(), 0u);
}

TEST(Liveness, TheCoordinatorsOwnPauseIsNoOnesSilence) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  all_beat(live, t0 + 1000ms);
  // The coordinator overslept from 1250 to 3250 ms: the heartbeats sent
  // meanwhile had not been taken off the wire, and silence is 2000 ms less.
  live.coordinator_paused(t0 + 1250ms, t0 + 3250ms);
  EXPECT_TRUE(live.check(t0 + 3300ms).empty());
  EXPECT_FALSE(live.view()[0].suspect);
  EXPECT_FALSE(live.view()[1].suspect);
  // A rank that is really silent is still lost once lease + grace of the
  // coordinator's own running time has passed since its last word: 250 ms
  // before the pause and 1250 ms after it.
  all_beat(live, t0 + 4400ms, /*silent=*/2);
  EXPECT_TRUE(live.check(t0 + 4500ms).empty());
  EXPECT_TRUE(live.view()[1].suspect);
  const std::vector<InstanceLoss> losses = live.check(t0 + 4501ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].reason, "rank 2 silent for 1501 ms (lease 1000 ms + grace 500 ms)");
  // Overlapping pauses count once.
  Liveness other(spec(), 1000ms, t0);
  other.coordinator_paused(t0, t0 + 1000ms);
  other.coordinator_paused(t0 + 500ms, t0 + 1200ms);
  EXPECT_TRUE(other.check(t0 + 2500ms).empty());  // 1300 ms of silence: suspect
  EXPECT_TRUE(other.view()[0].suspect);
  EXPECT_EQ(other.check(t0 + 2701ms).size(), 2u);  // 1501 ms: both lost
}

TEST(Liveness, ARealSilenceIsFoundWithinTheLeasePlusOneSecond) {
  // A SIGSTOP at a 1 s lease, checked every lease / 4 as the dispatcher
  // does: lost within lease + 1 s of the last word.
  const auto t0 = Clock::now();
  Liveness live(spec(), 1000ms, t0);
  Clock::time_point lost_at{};
  for (auto t = t0 + 250ms; t <= t0 + 5000ms && lost_at == Clock::time_point{}; t += 250ms) {
    all_beat(live, t, /*silent=*/2);
    if (!live.check(t).empty()) lost_at = t;
  }
  ASSERT_NE(lost_at, Clock::time_point{});
  EXPECT_LE(lost_at - t0, 2000ms);
}

// A member that joined (address 10, instance 2) is watched from its
// admission like any instance; once it left (retired), neither its silence
// nor its connection's end is a loss.
TEST(Liveness, AJoinedInstanceIsWatchedUntilItLeaves) {
  const auto t0 = Clock::now();
  Liveness live(spec(), 3000ms, t0);
  live.add_instance(InstanceSpec{2, InstanceRole::kBoth, 1, {Rank{10}}}, t0 + 1000ms);
  all_beat(live, t0 + 3000ms);
  EXPECT_TRUE(live.check(t0 + 3000ms).empty());  // the member's lease began at its admission
  all_beat(live, t0 + 5000ms);
  const std::vector<InstanceLoss> lost = live.check(t0 + 5600ms);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].instance_id, 2);
  EXPECT_EQ(lost[0].ranks, std::vector<Rank>{Rank{10}});

  live.add_instance(InstanceSpec{3, InstanceRole::kBoth, 1, {Rank{11}}}, t0 + 5600ms);
  live.on_heartbeat(beat(3, 11, 4, false), t0 + 6000ms);
  live.retire(3);
  live.connection_lost(Rank{11}, "closed the connection");
  all_beat(live, t0 + 20000ms);
  EXPECT_TRUE(live.check(t0 + 20000ms).empty());
  EXPECT_FALSE(live.lost(3));
}

}  // namespace
}  // namespace duet
