// The coordinator's leases (coordinator/cluster/liveness.h), on a clock the
// test moves: silence, a stalled step, a follower's silence, an ended
// control connection, and what a lost instance's late messages change
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
  for (int i = 1; i <= 6; ++i) all_beat(live, t0 + i * 500ms, /*silent=*/2);
  EXPECT_TRUE(live.check(t0 + 3000ms).empty());  // exactly the lease: not yet
  const std::vector<InstanceLoss> losses = live.check(t0 + 3001ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].ranks, (std::vector<Rank>{Rank{2}, Rank{3}}));
  EXPECT_EQ(losses[0].epoch, 1u);
  EXPECT_EQ(losses[0].reason, "rank 2 silent for 3001 ms (lease 3000 ms)");
  EXPECT_TRUE(live.lost(1));
  EXPECT_TRUE(live.rank_lost(Rank{2}));
  EXPECT_TRUE(live.rank_lost(Rank{3}));
  EXPECT_FALSE(live.rank_lost(Rank{1}));
  // Reported once; a late heartbeat (a SIGCONT) does not bring it back.
  live.on_heartbeat(beat(1, 2, 11, false), t0 + 4000ms);
  EXPECT_TRUE(live.check(t0 + 4000ms).empty());
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
  const std::vector<InstanceLoss> losses = live.check(t0 + 1500ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].reason, "rank 3 silent for 1500 ms (lease 1000 ms)");
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
  all_beat(live, t0 + 3300ms, /*silent=*/1);
  live.on_heartbeat(beat(0, 1, 10, true), t0 + 3300ms);
  const std::vector<InstanceLoss> losses = live.check(t0 + 3300ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 0);
  EXPECT_EQ(losses[0].reason,
            "stalled: no progress inside an engine step for 1100 ms (lease 1000 ms)");
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
  std::vector<InstanceLoss> losses = live.check(t0 + 1500ms);
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses[0].instance_id, 1);
  EXPECT_EQ(losses[0].epoch, 1u);
  losses = live.check(t0 + 2000ms);
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

}  // namespace
}  // namespace duet
