// The rebalancer's rule (coordinator/rebalancer.h) on hand-made signals: which
// side misses its SLO decides the direction, the instance moved is the one
// with the least work, a side is never emptied of what it needs, and both
// sides over target (or too few samples) move nothing; the call on the
// cluster's size, and the loop through time. Also --slo's parsing and the
// percentile. The thread itself runs under mpirun:
// tests/mpi/test_rebalance.py.
#include "coordinator/rebalancer.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/error.h"

namespace duet {
namespace {

using View = RoutedInstances::RoleView;
constexpr auto kPrefill = InstanceRole::kPrefill;
constexpr auto kDecode = InstanceRole::kDecode;
constexpr auto kBoth = InstanceRole::kBoth;

View instance(InstanceRole role, int64_t sequences = 0, int64_t queued = 0) {
  return {role, true, false, true, sequences, queued};
}

RebalanceSignals signals(double ttft_s, double tpot_s, int64_t n = 10) {
  return {ttft_s, tpot_s, n, n};
}

const SloTargets kSlo{2.0, 0.1};

TEST(ParseSlo, MillisecondsPerSide) {
  SloTargets slo = parse_slo("ttft=2000,tpot=100");
  EXPECT_DOUBLE_EQ(slo.ttft_s, 2.0);
  EXPECT_DOUBLE_EQ(slo.tpot_s, 0.1);
  slo = parse_slo("tpot=50.5");
  EXPECT_DOUBLE_EQ(slo.ttft_s, 0);
  EXPECT_DOUBLE_EQ(slo.tpot_s, 0.0505);
  for (const char* bad : {"", "ttft", "ttft=", "ttft=-1", "ttft=0", "ttft=2s", "itl=5",
                          "ttft=100,,tpot=5", "ttft=nan"}) {
    EXPECT_THROW(parse_slo(bad), Error) << bad;
  }
}

TEST(Percentile90, NearestRank) {
  std::vector<double> v{5, 1, 4, 2, 3, 10, 9, 8, 7, 6};
  EXPECT_DOUBLE_EQ(percentile90(v), 9);
  std::vector<double> one{0.5};
  EXPECT_DOUBLE_EQ(percentile90(one), 0.5);
  std::vector<double> none;
  EXPECT_DOUBLE_EQ(percentile90(none), 0);
  std::vector<double> eleven{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  EXPECT_DOUBLE_EQ(percentile90(eleven), 10);
}

TEST(DecideRebalance, SlowFirstTokensMoveTheLeastBusyDecodeInstanceToPrefill) {
  const std::vector<View> cluster{instance(kPrefill, 0, 900), instance(kDecode, 5),
                                  instance(kDecode, 2), instance(kDecode, 7)};
  const auto d = decide_rebalance(cluster, signals(3.0, 0.05), kSlo, 4);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->instance, 2u);
  EXPECT_EQ(d->to, kPrefill);
  EXPECT_NE(d->why.find("TTFT p90 3000 ms over the SLO's 2000 ms"), std::string::npos) << d->why;
}

TEST(DecideRebalance, SlowTokensMoveTheLeastQueuedPrefillInstanceToDecode) {
  const std::vector<View> cluster{instance(kPrefill, 0, 900), instance(kPrefill, 0, 300),
                                  instance(kDecode, 9)};
  const auto d = decide_rebalance(cluster, signals(0.5, 0.2), kSlo, 4);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->instance, 1u);
  EXPECT_EQ(d->to, kDecode);
}

TEST(DecideRebalance, NothingMovesWithoutAClearSide) {
  const std::vector<View> cluster{instance(kPrefill), instance(kPrefill), instance(kDecode),
                                  instance(kDecode)};
  EXPECT_FALSE(decide_rebalance(cluster, signals(1.0, 0.05), kSlo, 4));  // both within
  EXPECT_FALSE(decide_rebalance(cluster, signals(3.0, 0.2), kSlo, 4));   // both over
  // Over on one side, but the other near its own target (above 80%).
  EXPECT_FALSE(decide_rebalance(cluster, signals(3.0, 0.09), kSlo, 4));
  EXPECT_FALSE(decide_rebalance(cluster, signals(1.7, 0.2), kSlo, 4));
  // Too few samples.
  EXPECT_FALSE(decide_rebalance(cluster, signals(3.0, 0.05, 3), kSlo, 4));
}

TEST(DecideRebalance, NeverEmptiesASide) {
  // The only instance that decodes stays; the only prefill instance stays.
  EXPECT_FALSE(decide_rebalance(std::vector<View>{instance(kPrefill), instance(kDecode)},
                                signals(3.0, 0.05), kSlo, 4));
  EXPECT_FALSE(
      decide_rebalance(std::vector<View>{instance(kPrefill), instance(kDecode), instance(kDecode)},
                       signals(0.5, 0.2), kSlo, 4));
  // A colocated instance still decodes: a decode instance may go to prefill beside it.
  const auto d =
      decide_rebalance(std::vector<View>{instance(kPrefill), instance(kBoth), instance(kDecode)},
                       signals(3.0, 0.05), kSlo, 4);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->instance, 2u);
  // Instances not taking work (lost, leaving, changing role) are neither moved nor counted.
  std::vector<View> cluster{instance(kPrefill), instance(kDecode), instance(kDecode)};
  cluster[2].taking_work = false;
  EXPECT_FALSE(decide_rebalance(cluster, signals(3.0, 0.05), kSlo, 4));
}

TEST(DecideRebalance, ASideWithoutATargetIsNotJudged) {
  const std::vector<View> cluster{instance(kPrefill), instance(kDecode), instance(kDecode)};
  const SloTargets ttft_only{2.0, 0};
  EXPECT_TRUE(decide_rebalance(cluster, signals(3.0, 9.0), ttft_only, 4));
  const SloTargets tpot_only{0, 0.1};
  EXPECT_FALSE(decide_rebalance(cluster, signals(30.0, 0.05), tpot_only, 4));
}

TEST(JudgeCapacity, MoreWhenATargetIsMissedAndNoRoleChangeHelps) {
  // A colocated cluster (no change possible) over either target.
  EXPECT_EQ(judge_capacity(signals(3.0, 0.05), kSlo, 4, false, false), CapacityCall::kMore);
  EXPECT_EQ(judge_capacity(signals(1.0, 0.2), kSlo, 4, false, false), CapacityCall::kMore);
  // A role change is on its way: it gets its chance first.
  EXPECT_EQ(judge_capacity(signals(3.0, 0.05), kSlo, 4, true, false), CapacityCall::kKeep);
  // Too few samples judge nothing.
  EXPECT_EQ(judge_capacity(signals(3.0, 0.2, 3), kSlo, 4, false, false), CapacityCall::kKeep);
}

TEST(JudgeCapacity, FewerUnderHalfOfEveryTargetOrIdle) {
  EXPECT_EQ(judge_capacity(signals(0.9, 0.04), kSlo, 4, false, false), CapacityCall::kFewer);
  EXPECT_EQ(judge_capacity(signals(1.1, 0.04), kSlo, 4, false, false), CapacityCall::kKeep);
  EXPECT_EQ(judge_capacity(signals(0.9, 0.06), kSlo, 4, false, false), CapacityCall::kKeep);
  // A side without a target does not hold it back; one without samples does.
  EXPECT_EQ(judge_capacity(signals(0.9, 5.0), SloTargets{2.0, 0}, 4, false, false),
            CapacityCall::kFewer);
  EXPECT_EQ(judge_capacity(signals(0, 0, 0), kSlo, 4, false, false), CapacityCall::kKeep);
  EXPECT_EQ(judge_capacity(signals(0, 0, 0), kSlo, 4, false, true), CapacityCall::kFewer);
}

// The loop over time on a colocated cluster: what it wants, and a change of
// the count restarting the samples and the cooldown.
TEST(RebalanceLoop, WantsOneMoreThenWaitsForTheNewInstanceThenOneFewerOnceIdle) {
  RebalanceLoop loop(RebalancerOptions{.slo = kSlo});
  std::vector<View> cluster{instance(kBoth, 4)};
  double finished_at = 0;  // every sample "finished" then
  RebalanceSignals now_signals = signals(3.0, 0.05);
  const auto recent = [&](double since) {
    Metrics::RecentLatency r;
    if (finished_at >= since)
      r = {std::vector<double>(10, now_signals.ttft_p90_s),
           std::vector<double>(10, now_signals.tpot_p90_s)};
    return r;
  };
  finished_at = 1;
  EXPECT_FALSE(loop.look(1, cluster, recent));
  EXPECT_EQ(loop.instances_wanted(), 2);
  // The launcher's instance joins at 5 s: fresh samples and a cooldown.
  cluster.push_back(instance(kBoth, 1));
  loop.look(5, cluster, recent);
  EXPECT_EQ(loop.instances_wanted(), 2);
  finished_at = 10;  // still slow, but finished during the cooldown (until 15 s)
  loop.look(10, cluster, recent);
  EXPECT_EQ(loop.instances_wanted(), 2);
  finished_at = 16;
  now_signals = signals(0.5, 0.02);  // comfortable: under half of both targets
  loop.look(16, cluster, recent);
  EXPECT_EQ(loop.instances_wanted(), 1);
  // Nothing finished for a whole window and nothing runs: fewer, never below 1.
  cluster = {instance(kBoth)};
  loop.look(17, cluster, recent);  // the count changed: cooldown until 27 s
  EXPECT_EQ(loop.instances_wanted(), 1);
  finished_at = -1;
  loop.look(30, cluster, recent);
  EXPECT_EQ(loop.instances_wanted(), 1);
}

}  // namespace
}  // namespace duet
