// The cluster simulator: layouts, determinism, a queue with a known answer
// (M/D/1), disaggregated requests through the real router and engine, and
// prefix caching from a trace's token ids, the rebalancer on a traffic shift.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/error.h"
#include "loadgen/stats.h"
#include "sim/planner.h"
#include "sim/sim_instance.h"
#include "sim/simulator.h"

namespace duet::sim {
namespace {

// A model of the size of the default one, with a step cost the tests state.
Profile stated_profile(const StepCost& step, int64_t kv_tokens = 1 << 20) {
  Profile p;
  p.source = "roofline";
  p.device = "stated";
  p.model.name = "test";
  p.model.n_layers = 30;
  p.model.n_embd = 576;
  p.model.n_heads = 9;
  p.model.n_kv_heads = 3;
  p.model.head_dim = 64;
  p.model.n_ff = 1536;
  p.model.n_vocab = 49152;
  p.model.n_ctx = 8192;
  p.model.kv_bytes_per_token = 30 * 2 * 3 * 64 * 2;
  for (int tp : {1, 2}) {
    InstanceProfile instance;
    instance.tp = tp;
    instance.step = step;
    instance.kv_capacity_tokens = kv_tokens;
    p.instances.push_back(instance);
  }
  p.transfers.push_back({"tcp", LinkCost{1e-4, 1e9}, {}});
  return p;
}

// 10 ms per step plus 1 ms per 10 rows: prefill costs, decode batches share.
StepCost simple_cost() {
  StepCost c;
  c.token_knots = {1, 512};
  c.knot_seconds = {0.010, 0.010 + 511 * 1e-4};
  return c;
}

std::vector<loadgen::PlannedRequest> poisson(int64_t n, double rate, int64_t prompt, int64_t output,
                                             uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<double> at = loadgen::arrival_times(n, rate, 1.0, rng);
  std::vector<loadgen::PlannedRequest> trace;
  for (double t : at) trace.push_back({t, prompt, output});
  return trace;
}

TEST(ClusterLayout, ParsesTheShortForms) {
  const ClusterSpec two = parse_cluster_layout("2C");
  EXPECT_EQ(two.mode, ClusterMode::kColocated);
  ASSERT_EQ(two.instances.size(), 2u);
  EXPECT_EQ(two.instances[1].role, InstanceRole::kBoth);

  const ClusterSpec disagg = parse_cluster_layout("4P@tp2+8D@tp4");
  EXPECT_EQ(disagg.mode, ClusterMode::kDisaggregated);
  EXPECT_EQ(disagg.count(InstanceRole::kPrefill), 4);
  EXPECT_EQ(disagg.count(InstanceRole::kDecode), 8);
  EXPECT_EQ(disagg.instances.front().tp, 2);
  EXPECT_EQ(disagg.instances.back().tp, 4);
  EXPECT_EQ(disagg.required_world_size(), 1 + 4 * 2 + 8 * 4);
  EXPECT_EQ(describe_layout(disagg), "4P@tp2+8D@tp4");
  EXPECT_EQ(describe_layout(parse_cluster_layout("1P+2D")), "1P+2D");

  for (const char* bad : {"", "P", "2X", "1C+1P", "1P", "2D", "1P@tp0+1D", "1P@x2+1D", "0C"})
    EXPECT_THROW(parse_cluster_layout(bad), Error) << bad;
}

TEST(Simulator, TheSameTraceGivesTheSameReport) {
  const Profile profile = stated_profile(simple_cost());
  const auto trace = loadgen::make_trace("mixed", 300, 4.0, 11);
  for (const char* layout : {"2C", "1P+2D", "2P+1D"}) {
    SimOptions options;
    options.cluster = parse_cluster_layout(layout);
    options.seed = 5;
    const SimResult a = simulate(profile, options, trace);
    const SimResult b = simulate(profile, options, trace);
    ASSERT_EQ(a.records.size(), trace.size());
    for (size_t i = 0; i < trace.size(); ++i) {
      const loadgen::RequestRecord& x = a.records[i];
      const loadgen::RequestRecord& y = b.records[i];
      ASSERT_TRUE(x.ok) << layout << " request " << i << ": " << x.error_message;
      EXPECT_EQ(x.received_tokens, trace[i].output_tokens);
      EXPECT_EQ(x.token_times, y.token_times) << layout << " request " << i;
      EXPECT_EQ(x.finished, y.finished);
    }
    EXPECT_EQ(a.simulated_s, b.simulated_s);
    EXPECT_EQ(a.events, b.events);
    int64_t routed = 0;  // by the instances that report the requests (prefill ones count too)
    for (const InstanceReport& i : a.instances)
      if (i.role != InstanceRole::kPrefill) routed += i.routed;
    EXPECT_EQ(routed, static_cast<int64_t>(trace.size())) << layout;
  }
}

// One server, one request at a time, a constant service time S, Poisson
// arrivals at utilisation rho: the mean wait is rho S / (2 (1 - rho))
// (Pollaczek-Khinchine). A request of one output token is one step, so its
// TTFT is its wait plus S.
TEST(Simulator, AnMD1QueueWaitsAsTheFormulaSays) {
  constexpr double kService = 0.010;
  constexpr double kRho = 0.7;
  constexpr int64_t kRequests = 100'000;
  StepCost constant;
  constant.token_knots = {1};
  constant.knot_seconds = {kService};
  const Profile profile = stated_profile(constant);
  SimOptions options;
  options.cluster = parse_cluster_layout("1C");
  options.engine.scheduler.max_running = 1;
  const auto trace = poisson(kRequests, kRho / kService, 16, 1, 2026);
  const SimResult result = simulate(profile, options, trace);
  double wait = 0;
  double lindley = 0;  // the wait of request i by Lindley's recursion on the same arrivals
  for (size_t i = 0; i < result.records.size(); ++i) {
    const loadgen::RequestRecord& r = result.records[i];
    ASSERT_TRUE(r.ok && r.first_token);
    if (i > 0) lindley = std::max(0.0, lindley + kService - (trace[i].at - trace[i - 1].at));
    ASSERT_NEAR(*r.first_token - r.sent - kService, lindley, 1e-9) << "request " << i;
    wait += *r.first_token - r.sent - kService;
  }
  wait /= kRequests;
  // The sample mean of 100,000 correlated waits has a standard error of
  // about 1.5% here; the seed is fixed, so the check is deterministic.
  const double expected = kRho * kService / (2 * (1 - kRho));
  EXPECT_NEAR(wait, expected, 0.02 * expected) << "mean wait " << wait * 1e3 << " ms";
}

TEST(Simulator, DisaggregatedTtftIsPrefillThenTransferThenTheFirstToken) {
  // One request alone: the prefill instance computes the prompt in one step
  // (10 ms + 63 * 0.1 ms), the rows cross the link, the decode instance emits
  // the first token at once and decodes the rest at 10 ms a step.
  const Profile profile = stated_profile(simple_cost());
  SimOptions options;
  options.cluster = parse_cluster_layout("1P+1D");
  const std::vector<loadgen::PlannedRequest> trace = {{0.5, 64, 5}};
  const SimResult result = simulate(profile, options, trace);
  const loadgen::RequestRecord& r = result.records.at(0);
  ASSERT_TRUE(r.ok) << r.error_message;
  const double latency = profile.transfers[0].cost.latency_s;
  const double prefill = 0.010 + 63 * 1e-4;
  const double bytes = 64 * profile.model.kv_bytes_per_token;
  const double tail = std::max(latency + bytes / 30 / 1e9, latency + bytes / 1e9 - prefill);
  // The order crosses the link first (its latency), then the prefill step, then the rows.
  EXPECT_NEAR(*r.first_token - r.sent, latency + prefill + tail, 1e-9);
  ASSERT_EQ(r.token_times.size(), 5u);
  for (size_t i = 1; i < r.token_times.size(); ++i)
    EXPECT_NEAR(r.token_times[i] - r.token_times[i - 1], 0.010, 1e-9);
  EXPECT_EQ(result.instances[0].steps, 1);
  EXPECT_EQ(result.instances[1].steps, 4);
  EXPECT_EQ(result.instances[1].routed, 1);
}

TEST(Simulator, ATracesTokenIdsReachThePrefixCache) {
  // Two requests with the same 256-token prompt, far apart: the second finds
  // its first 240 tokens (15 full blocks) cached and prefills 16 rows.
  const Profile profile = stated_profile(simple_cost());
  std::vector<int32_t> prompt(256);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(100 + i);
  std::vector<loadgen::PlannedRequest> trace = {{0.0, 256, 1, prompt}, {5.0, 256, 1, prompt}};
  SimOptions options;
  options.cluster = parse_cluster_layout("1C");
  const SimResult shared = simulate(profile, options, trace);
  trace[1].prompt_ids[0] = 7;  // no shared prefix
  const SimResult distinct = simulate(profile, options, trace);
  const auto ttft = [](const SimResult& r) {
    return *r.records[1].first_token - r.records[1].sent;
  };
  EXPECT_NEAR(ttft(distinct), 0.010 + 255 * 1e-4, 1e-9);
  EXPECT_NEAR(ttft(shared), 0.010 + 15 * 1e-4, 1e-9);
}

TEST(Simulator, ARequestTooLongForTheModelFailsAndTheRestGoOn) {
  const Profile profile = stated_profile(simple_cost());
  SimOptions options;
  options.cluster = parse_cluster_layout("1P+1D");
  const std::vector<loadgen::PlannedRequest> trace = {{0.0, 9000, 10}, {0.1, 32, 3}};
  const SimResult result = simulate(profile, options, trace);
  EXPECT_FALSE(result.records[0].ok);
  EXPECT_EQ(result.records[0].error_kind, "invalid_argument");
  EXPECT_TRUE(result.records[1].ok);
}

TEST(Simulator, InstancesSharingTooFewCoresSlowDown) {
  // Two colocated instances, one request each at once: on cores of their
  // own both prefill in one step's time; sharing one core, the second step
  // to start takes twice as long.
  const Profile profile = stated_profile(simple_cost());
  const std::vector<loadgen::PlannedRequest> trace = {{0.0, 64, 1}, {0.0, 64, 1}};
  SimOptions options;
  options.cluster = parse_cluster_layout("2C");
  const double step = 0.010 + 63 * 1e-4;
  const SimResult own = simulate(profile, options, trace);
  EXPECT_NEAR(own.records[0].finished, step, 1e-9);
  EXPECT_NEAR(own.records[1].finished, step, 1e-9);
  options.host_cores = 1;
  const SimResult shared = simulate(profile, options, trace);
  EXPECT_NEAR(shared.records[0].finished, step, 1e-9);
  EXPECT_NEAR(shared.records[1].finished, 2 * step, 1e-9);
}

TEST(Simulator, AStepBesideAnotherOnTheHostTakesTheNeighbourSlowdown) {
  // Two cores for two instances: no time sharing, but the second step to
  // start runs beside the first and takes the profile's slowdown; a step
  // alone does not.
  Profile profile = stated_profile(simple_cost());
  profile.host.neighbour_slowdown = 1.25;
  const double step = 0.010 + 63 * 1e-4;
  SimOptions options;
  options.cluster = parse_cluster_layout("2C");
  options.host_cores = 2;
  const std::vector<loadgen::PlannedRequest> together = {{0.0, 64, 1}, {0.0, 64, 1}};
  const SimResult both = simulate(profile, options, together);
  EXPECT_NEAR(both.records[0].finished, step, 1e-9);
  EXPECT_NEAR(both.records[1].finished, 1.25 * step, 1e-9);
  const std::vector<loadgen::PlannedRequest> apart = {{0.0, 64, 1}, {1.0, 64, 1}};
  const SimResult alone = simulate(profile, options, apart);
  EXPECT_NEAR(alone.records[1].finished - 1.0, step, 1e-9);
  options.neighbour_slowdown = 1.0;  // the option overrides the profile
  EXPECT_NEAR(simulate(profile, options, together).records[1].finished, step, 1e-9);
  options.host_cores = 0;  // hosts of their own: no sharing at all
  options.neighbour_slowdown.reset();
  EXPECT_NEAR(simulate(profile, options, together).records[1].finished, step, 1e-9);
}

TEST(Simulator, RefusesWhatTheProfileCannotCost) {
  const Profile profile = stated_profile(simple_cost());
  SimOptions options;
  options.cluster = parse_cluster_layout("1P@tp4+1D");
  EXPECT_THROW(simulate(profile, options, {}), Error);
  options.cluster = parse_cluster_layout("1P+1D");
  options.transfer_path = "nvlink";
  EXPECT_THROW(simulate(profile, options, {}), Error);
}

// Long prompts with short answers (prefill-bound: one prefill instance
// falls behind), then short prompts with long answers (decode-bound: one
// decode instance's batch makes every token slow).
std::vector<loadgen::PlannedRequest> shifting_trace() {
  std::vector<loadgen::PlannedRequest> trace = poisson(120, 3.0, 2000, 8, 3);
  const double shift = trace.back().at + 1;
  for (loadgen::PlannedRequest r : poisson(640, 16.0, 64, 200, 4)) {
    r.at += shift;
    trace.push_back(r);
  }
  return trace;
}

int64_t met(const SimResult& result, const loadgen::Slo& slo) {
  return std::count_if(result.records.begin(), result.records.end(),
                       [&](const loadgen::RequestRecord& r) { return loadgen::meets_slo(r, slo); });
}

TEST(Simulator, TheRebalancerFollowsATrafficShiftAndBeatsEitherFixedSplit) {
  // 4 ms a step and 0.2 ms a row: a 2000-token prompt takes 0.42 s (3 a
  // second keep one prefill instance 125% busy, two 63%); 16 requests a
  // second of 200 tokens keep 36 rows on one decode instance (11 ms a step,
  // over the 10 ms TPOT target), 9 rows each on two (6 ms).
  StepCost cost;
  cost.token_knots = {1, 512};
  cost.knot_seconds = {0.004, 0.004 + 511 * 2e-4};
  const Profile profile = stated_profile(cost);
  const std::vector<loadgen::PlannedRequest> trace = shifting_trace();
  const loadgen::Slo slo{1.0, 0.010};
  SimOptions options;
  options.cluster = parse_cluster_layout("1P+2D");
  options.rebalance = RebalancerOptions{.slo = {1.0, 0.010}};
  const SimResult moved = simulate(profile, options, trace);
  ASSERT_EQ(moved.role_changes.size(), 2u);
  // Prompts wait first: a decode instance turns prefill; then tokens crowd
  // and a prefill instance turns decode.
  EXPECT_EQ(moved.role_changes[0].from, InstanceRole::kDecode);
  EXPECT_EQ(moved.role_changes[0].to, InstanceRole::kPrefill);
  EXPECT_LT(moved.role_changes[0].at, trace[119].at);
  EXPECT_EQ(moved.role_changes[1].from, InstanceRole::kPrefill);
  EXPECT_EQ(moved.role_changes[1].to, InstanceRole::kDecode);
  EXPECT_GT(moved.role_changes[1].at, trace[120].at);
  EXPECT_GE(moved.role_changes[1].at, moved.role_changes[0].at + 10.0);  // the cooldown
  for (size_t i = 0; i < trace.size(); ++i) {
    ASSERT_TRUE(moved.records[i].ok) << i << ": " << moved.records[i].error_message;
    EXPECT_EQ(moved.records[i].received_tokens, trace[i].output_tokens);
  }
  // The same trace again gives the same changes.
  const SimResult again = simulate(profile, options, trace);
  ASSERT_EQ(again.role_changes.size(), 2u);
  EXPECT_EQ(again.role_changes[1].at, moved.role_changes[1].at);

  options.rebalance.reset();
  const SimResult chat_split = simulate(profile, options, trace);
  options.cluster = parse_cluster_layout("2P+1D");
  const SimResult document_split = simulate(profile, options, trace);
  EXPECT_TRUE(chat_split.role_changes.empty());
  EXPECT_GT(met(moved, slo), met(chat_split, slo));
  EXPECT_GT(met(moved, slo), met(document_split, slo));

  options.cluster = parse_cluster_layout("2C");
  options.rebalance = RebalancerOptions{.slo = {1.0, 0.010}};
  EXPECT_THROW(simulate(profile, options, trace), Error);  // colocated: no roles to move
}

TEST(SimInstance, ACancelledImportEndsAndItsOrderIsWithdrawn) {
  // Two requests from one decode instance to one prefill instance: the first
  // keeps the prefill busy for a 512-token step while the second's order
  // waits there; the second is cancelled meanwhile, so its order is
  // withdrawn before it runs, and nothing of it is left on either side.
  const Profile profile = stated_profile(simple_cost());
  EventQueue clock;
  SharedCores cores;
  const SimTransfer transfer{LinkCost{0.001, 1e9}, profile.model.kv_bytes_per_token,
                             profile.model.n_layers};
  EngineConfig config;
  config.n_kv_blocks = 128;
  const InstanceInfo info{"test", profile.model.n_ctx, profile.model.n_vocab, 128 * 16, {}};
  SimInstance* decode_address = nullptr;
  SimInstance prefill(
      clock, 1, simple_cost(), config, info, profile.model, transfer, 0,
      [&](int32_t p) { return p == 1 ? decode_address : nullptr; }, cores);
  SimInstance decode(
      clock, 1, simple_cost(), config, info, profile.model, transfer, 1,
      [&](int32_t p) { return p == 0 ? &prefill : nullptr; }, cores);
  decode_address = &decode;
  std::vector<InstanceEvent> events;
  decode.set_event_handler([&](std::span<const InstanceEvent> batch) {
    events.insert(events.end(), batch.begin(), batch.end());
  });
  for (uint64_t id : {1, 2}) {
    InstanceRequest request;
    request.id = RequestId{id};
    request.prompt.assign(id == 1 ? 511 : 64, static_cast<int32_t>(id));
    request.max_tokens = 5;
    request.ignore_eos = true;
    request.prefill_peer = 0;
    decode.submit(std::move(request));
  }
  clock.at(0.010, [&] { decode.cancel(RequestId{2}); });
  clock.run();

  int64_t first_tokens = 0;
  bool second_cancelled = false;
  for (const InstanceEvent& e : events) {
    if (e.id.value == 1 && e.token >= 0) ++first_tokens;
    if (e.id.value == 2) {
      EXPECT_TRUE(e.finished && e.finish == InstanceFinish::kCancelled);
      EXPECT_LT(e.token, 0);
      second_cancelled = true;
    }
  }
  EXPECT_EQ(first_tokens, 5);
  EXPECT_TRUE(second_cancelled);
  EXPECT_EQ(prefill.steps(), 1) << "the withdrawn order still ran";
  for (const SimInstance* instance : {&prefill, &decode}) {
    EXPECT_EQ(instance->stats().running, 0);
    EXPECT_EQ(instance->stats().waiting, 0);
  }
}

TEST(Planner, FindsAHigherRateForMoreGpusAndRanksLayouts) {
  const Profile profile = stated_profile(simple_cost());
  PlanOptions options;
  options.gpus = {2, 4};
  options.slo.ttft = 0.5;
  options.slo.tpot = 0.05;
  options.requests_per_instance = 30;
  options.min_requests = 100;
  options.span_s = 10;
  options.prefill_shares = {0.25, 0.5};
  const std::vector<PlanResult> plan = plan_layouts(profile, options);
  ASSERT_EQ(plan.size(), 2u);
  for (const PlanResult& r : plan) {
    ASSERT_FALSE(r.ranked.empty());
    ASSERT_TRUE(r.best_colocated);
    EXPECT_GT(r.ranked.front().goodput_per_gpu, 0);
    EXPECT_GE(r.ranked.front().attainment, options.attainment);
    EXPECT_GE(r.ranked.front().goodput_per_gpu, r.best_colocated->goodput_per_gpu * 0.999);
  }
  EXPECT_GT(plan[1].ranked.front().rate, plan[0].ranked.front().rate);
}

// Two threads search the candidates of a size at once; each probe is its own
// simulation, so the plan is the same as one thread's, figure for figure.
TEST(Planner, GivesTheSamePlanOnTwoThreadsAsOnOne) {
  const Profile profile = stated_profile(simple_cost());
  PlanOptions options;
  options.gpus = {4, 8};
  options.slo.ttft = 0.5;
  options.slo.tpot = 0.05;
  options.requests_per_instance = 20;
  options.min_requests = 80;
  options.span_s = 5;
  options.jobs = 1;
  const std::vector<PlanResult> one = plan_layouts(profile, options);
  options.jobs = 2;
  const std::vector<PlanResult> two = plan_layouts(profile, options);
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) {
    ASSERT_EQ(one[i].ranked.size(), two[i].ranked.size());
    for (size_t k = 0; k < one[i].ranked.size(); ++k) {
      EXPECT_EQ(one[i].ranked[k].layout, two[i].ranked[k].layout);
      EXPECT_EQ(one[i].ranked[k].rate, two[i].ranked[k].rate);
      EXPECT_EQ(one[i].ranked[k].refined, two[i].ranked[k].refined);
    }
  }
}

// From the second size on, only the disaggregated shapes near the best one
// at the size before are searched (and every colocated one): fewer layouts,
// and a best layout no worse than a little under the full search's.
TEST(Planner, PrunesByTheSizeBeforeAndKeepsTheBest) {
  const Profile profile = stated_profile(simple_cost());
  PlanOptions options;
  options.gpus = {8, 16};
  options.slo.ttft = 0.5;
  options.slo.tpot = 0.05;
  options.requests_per_instance = 20;
  options.min_requests = 80;
  options.span_s = 5;
  options.jobs = 2;
  options.prune = false;
  const std::vector<PlanResult> full = plan_layouts(profile, options);
  options.prune = true;
  const std::vector<PlanResult> pruned = plan_layouts(profile, options);
  ASSERT_EQ(full.size(), 2u);
  ASSERT_EQ(pruned.size(), 2u);
  EXPECT_EQ(pruned[0].ranked.size(), full[0].ranked.size()) << "the first size is searched whole";
  EXPECT_LT(pruned[1].ranked.size(), full[1].ranked.size());
  ASSERT_TRUE(pruned[1].best_colocated && pruned[1].best_disaggregated);
  EXPECT_EQ(pruned[1].best_colocated->layout, full[1].best_colocated->layout);
  EXPECT_GE(pruned[1].ranked.front().goodput_per_gpu, 0.9 * full[1].ranked.front().goodput_per_gpu);
}

}  // namespace
}  // namespace duet::sim
