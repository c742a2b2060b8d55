// The router: the colocated policy's order (most free KV blocks, then fewest
// sequences, then lowest index), and RoutedInstances over real engine threads
// (LocalInstance on a tiny fixture model): a burst spreads over both
// instances, greedy tokens equal one instance's own, cancel reaches the
// instance that holds the request, stats are summed, a prompt goes to the
// prefill instance its prefix went to, and instances serving different
// models are refused. No MPI.
#include "coordinator/router.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/local_instance.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

InstanceLoad load(InstanceRole role, int64_t free, int64_t sequences, int64_t queued = 0,
                  int64_t prefix = 0) {
  InstanceLoad l;
  l.role = role;
  l.kv_blocks_free = free;
  l.kv_blocks_total = 100;
  l.sequences = sequences;
  l.queued_prompt_tokens = queued;
  l.prefix_tokens = prefix;
  return l;
}

TEST(ColocatedPolicy, MostFreeBlocksThenFewestSequencesThenLowestIndex) {
  const ColocatedPolicy policy;
  const InstanceRequest request;
  auto pick = [&](std::vector<InstanceLoad> loads) {
    const Route route = policy.pick(loads, request);
    EXPECT_FALSE(route.prefill.has_value());
    return route.target;
  };
  constexpr auto kBoth = InstanceRole::kBoth;
  EXPECT_EQ(pick({load(kBoth, 10, 0)}), 0u);
  EXPECT_EQ(pick({load(kBoth, 10, 0), load(kBoth, 20, 5)}), 1u);  // free blocks first
  EXPECT_EQ(pick({load(kBoth, 20, 3), load(kBoth, 20, 2), load(kBoth, 20, 2)}),
            1u);  // then sequences, lowest index
  EXPECT_EQ(pick({load(kBoth, 20, 0), load(kBoth, 20, 0)}), 0u);
  EXPECT_EQ(policy.name(), "colocated");
}

TEST(DisaggregatedPolicy, PrefillByQueuedPromptThenPrefixDecodeByRoom) {
  const DisaggregatedPolicy policy;
  const InstanceRequest request;
  constexpr auto kPrefill = InstanceRole::kPrefill;
  constexpr auto kDecode = InstanceRole::kDecode;
  // Prefill: fewest queued prompt tokens, whatever their KV or sequences.
  Route r = policy.pick(
      std::vector<InstanceLoad>{load(kPrefill, 0, 9, 500), load(kPrefill, 90, 0, 700),
                                load(kDecode, 10, 0), load(kDecode, 30, 4), load(kDecode, 30, 2)},
      request);
  EXPECT_EQ(r.prefill, std::optional<size_t>(0));
  EXPECT_EQ(r.target, 4u);  // most free blocks, then fewest sequences
  // Ties on queued tokens: the longest likely prefix-cache hit.
  r = policy.pick(std::vector<InstanceLoad>{load(kPrefill, 0, 0, 100, 16),
                                            load(kPrefill, 0, 0, 100, 64), load(kDecode, 10, 0)},
                  request);
  EXPECT_EQ(r.prefill, std::optional<size_t>(1));
  EXPECT_EQ(r.target, 2u);
  EXPECT_EQ(policy.name(), "disaggregated");
  EXPECT_EQ(make_routing_policy(ClusterMode::kDisaggregated)->name(), "disaggregated");
  EXPECT_EQ(make_routing_policy(ClusterMode::kColocated)->name(), "colocated");
}

// Collects the merged events by request. While held, an engine thread that
// delivers a token stays in the handler (so before its next step) until
// release(): a test can then act between two steps deterministically.
class Collector {
 public:
  void on_events(std::span<const InstanceEvent> events) {
    std::unique_lock lock(mutex_);
    bool any_token = false, past_early = false;
    for (const InstanceEvent& e : events) {
      any_token = any_token || e.token >= 0;
      Output& out = outputs_[e.id];
      if (e.token >= 0) out.tokens.push_back(e.token);
      past_early = past_early || static_cast<int64_t>(out.tokens.size()) > early_tokens_;
      if (e.finished) {
        EXPECT_FALSE(out.finished) << "two finished events for request " << e.id.value;
        out.finished = true;
        out.finish = e.finish;
      }
    }
    changed_.notify_all();
    if (any_token)
      changed_.wait(lock, [&] { return !paused_ && (!held_ || (!gate_open() && !past_early)); });
  }

  // Until resume(), token events block their engine thread whatever the
  // hold: a burst submitted meanwhile waits in the instances' queues, so that
  // each instance admits the whole of it at its next step, however late the
  // submitting thread gets to its last request.
  void pause() {
    std::lock_guard lock(mutex_);
    paused_ = true;
  }
  void resume() {
    std::lock_guard lock(mutex_);
    paused_ = false;
    changed_.notify_all();
  }

  // Token events block their engine thread until release().
  void hold() { hold_once_each_has_a_token({}, 0); }
  // hold() from the moment each of `ids` has a token, or a request has more
  // than `early_tokens`; until then tokens flow, so that a request admitted
  // a step or two after another on the same instance still gets its first
  // one (holding at once would stop that instance after its first request's
  // token), and none runs far ahead.
  void hold_once_each_has_a_token(std::vector<RequestId> ids, int64_t early_tokens) {
    std::lock_guard lock(mutex_);
    held_ = true;
    gate_ = std::move(ids);
    early_tokens_ = early_tokens;
  }
  void release() {
    std::lock_guard lock(mutex_);
    held_ = false;
    gate_.clear();
    changed_.notify_all();
  }

  // Waits until `id` has at least one token.
  void wait_for_token(RequestId id) {
    std::unique_lock lock(mutex_);
    EXPECT_TRUE(changed_.wait_for(lock, 60s, [&] { return !outputs_[id].tokens.empty(); }))
        << "request " << id.value << " got no token";
  }

  struct Output {
    std::vector<int32_t> tokens;
    bool finished = false;
    InstanceFinish finish = InstanceFinish::kFailed;
  };

  Output wait(RequestId id) {
    std::unique_lock lock(mutex_);
    EXPECT_TRUE(changed_.wait_for(lock, 60s, [&] { return outputs_[id].finished; }))
        << "request " << id.value << " did not finish";
    return outputs_[id];
  }

 private:
  // Under mutex_: every request of the gate has a token.
  bool gate_open() {
    for (RequestId id : gate_)
      if (outputs_[id].tokens.empty()) return false;
    return true;
  }

  bool paused_ = false;
  bool held_ = false;
  std::vector<RequestId> gate_;
  int64_t early_tokens_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<RequestId, Output> outputs_;
};

class RoutedInstancesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LlamaModel::load(testing::fixture_path("fixtures/tiny/tiny_q4_1_gqa_tied.gguf"));
    pool_ = std::make_unique<cpu::ThreadPool>(1);
  }

  std::unique_ptr<LocalInstance> make_instance(std::string name = "tiny") {
    EngineConfig config;
    config.n_kv_blocks = 64;
    return std::make_unique<LocalInstance>(*model_, cpu::kernel_table(cpu::best_isa()), *pool_,
                                           config, std::move(name));
  }

  static InstanceRequest request(uint64_t id, int32_t first_token, int64_t max_tokens) {
    InstanceRequest r;
    r.id = RequestId{id};
    r.prompt = {first_token, 5, 7, 11, first_token};
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    return r;  // temperature 0 by default: greedy
  }

  static void expect_all_free(const InstanceClient& instance) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    InstanceStats s;
    do {
      s = instance.stats();
      if (s.running == 0 && s.waiting == 0 && s.kv_blocks_free == s.kv_blocks_total) return;
      std::this_thread::sleep_for(2ms);
    } while (std::chrono::steady_clock::now() < deadline);
    ADD_FAILURE() << "KV not freed: running " << s.running << ", free " << s.kv_blocks_free << "/"
                  << s.kv_blocks_total;
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<cpu::ThreadPool> pool_;
};

TEST_F(RoutedInstancesTest, ABurstSpreadsAndGreedyTokensEqualOneInstancesOwn) {
  constexpr int kRequests = 16;
  // One instance alone: the reference tokens.
  std::map<RequestId, std::vector<int32_t>> expected;
  {
    std::unique_ptr<LocalInstance> alone = make_instance();
    Collector collector;
    alone->set_event_handler([&](auto events) { collector.on_events(events); });
    for (int i = 0; i < kRequests; ++i) alone->submit(request(i + 1, 20 + i, 6 + i % 3));
    for (int i = 0; i < kRequests; ++i) {
      const RequestId id{static_cast<uint64_t>(i + 1)};
      expected[id] = collector.wait(id).tokens;
    }
    alone->set_event_handler({});
  }

  std::unique_ptr<LocalInstance> a = make_instance();
  std::unique_ptr<LocalInstance> b = make_instance();
  RoutedInstances routed(std::vector<InstanceClient*>{a.get(), b.get()},
                         std::make_unique<ColocatedPolicy>());
  EXPECT_EQ(routed.info().model_name, "tiny");
  EXPECT_EQ(routed.stats().kv_blocks_total, a->stats().kv_blocks_total * 2);
  Collector collector;
  routed.set_event_handler([&](auto events) { collector.on_events(events); });
  for (int i = 0; i < kRequests; ++i) routed.submit(request(i + 1, 20 + i, 6 + i % 3));
  for (int i = 0; i < kRequests; ++i) {
    const RequestId id{static_cast<uint64_t>(i + 1)};
    const Collector::Output out = collector.wait(id);
    EXPECT_EQ(out.finish, InstanceFinish::kLength);
    EXPECT_EQ(out.tokens, expected[id]) << "request " << id.value;
  }
  const std::vector<int64_t> counts = routed.routed_counts();
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[0] + counts[1], kRequests);
  // Equal free blocks in a burst: the fewest sequences decides, so it alternates.
  EXPECT_GE(counts[0], kRequests / 4);
  EXPECT_GE(counts[1], kRequests / 4);
  expect_all_free(routed);
  const std::vector<InstanceStats> each = routed.instance_stats();
  EXPECT_GT(each[0].generated_tokens, 0);
  EXPECT_GT(each[1].generated_tokens, 0);
  EXPECT_EQ(routed.stats().generated_tokens, each[0].generated_tokens + each[1].generated_tokens);
}

TEST_F(RoutedInstancesTest, CancelReachesTheInstanceThatHoldsTheRequest) {
  std::unique_ptr<LocalInstance> a = make_instance();
  std::unique_ptr<LocalInstance> b = make_instance();
  RoutedInstances routed(std::vector<InstanceClient*>{a.get(), b.get()},
                         std::make_unique<ColocatedPolicy>());
  Collector collector;
  routed.set_event_handler([&](auto events) { collector.on_events(events); });
  // Two long requests, one per instance; cancel both between two steps.
  collector.hold();
  routed.submit(request(1, 30, 200));
  routed.submit(request(2, 31, 200));
  EXPECT_EQ(routed.routed_counts(), (std::vector<int64_t>{1, 1}));
  collector.wait_for_token(RequestId{1});
  collector.wait_for_token(RequestId{2});
  routed.cancel(RequestId{2});
  routed.cancel(RequestId{1});
  collector.release();
  EXPECT_EQ(collector.wait(RequestId{1}).finish, InstanceFinish::kCancelled);
  EXPECT_EQ(collector.wait(RequestId{2}).finish, InstanceFinish::kCancelled);
  routed.cancel(RequestId{1});   // finished: ignored
  routed.cancel(RequestId{99});  // unknown: ignored
  expect_all_free(*a);
  expect_all_free(*b);
}

// An instance lost mid-stream: its requests go again to the other one, with
// the tokens already delivered as part of the prompt, and continue with
// exactly the tokens one instance alone gives them, greedy and seeded; the
// finished event counts the re-run. Lost twice (no instance left): a
// kUnavailable error.
TEST_F(RoutedInstancesTest, ALostInstancesRequestsContinueWithTheSameTokens) {
  auto seeded = [](uint64_t id, int32_t first_token) {
    InstanceRequest r = request(id, first_token, 24);
    r.sampling.temperature = 0.9f;
    r.sampling.seed = 1000 + id;
    r.sampling.top_p = 0.95f;
    return r;
  };
  const std::vector<InstanceRequest> requests = {request(1, 40, 24), seeded(2, 41),
                                                 request(3, 42, 24), seeded(4, 43)};
  std::map<RequestId, std::vector<int32_t>> expected;
  {
    std::unique_ptr<LocalInstance> alone = make_instance();
    Collector collector;
    alone->set_event_handler([&](auto events) { collector.on_events(events); });
    for (const InstanceRequest& r : requests) alone->submit(r);
    for (const InstanceRequest& r : requests) expected[r.id] = collector.wait(r.id).tokens;
    alone->set_event_handler({});
  }

  std::unique_ptr<LocalInstance> a = make_instance();
  std::unique_ptr<LocalInstance> b = make_instance();
  RoutedInstances routed(std::vector<InstanceClient*>{a.get(), b.get()},
                         std::make_unique<ColocatedPolicy>(), /*max_retries=*/1);
  std::map<RequestId, int32_t> retries;
  std::mutex retries_mutex;
  Collector collector;
  routed.set_event_handler([&](std::span<const InstanceEvent> events) {
    {
      std::lock_guard lock(retries_mutex);
      for (const InstanceEvent& e : events)
        if (e.finished) retries[e.id] = e.retries;
    }
    collector.on_events(events);
  });
  // Each request has 1 to 8 of its 24 tokens when instance a is lost. Paused
  // while submitting: an instance that ran its first request past 8 tokens
  // before its second arrived would hold before that one's first token.
  collector.hold_once_each_has_a_token({RequestId{1}, RequestId{2}, RequestId{3}, RequestId{4}}, 8);
  collector.pause();
  for (const InstanceRequest& r : requests) routed.submit(r);
  EXPECT_EQ(routed.routed_counts(), (std::vector<int64_t>{2, 2}));
  collector.resume();
  for (const InstanceRequest& r : requests) collector.wait_for_token(r.id);
  routed.instance_lost(0);  // between two steps: what a delivered stays delivered
  EXPECT_TRUE(routed.lost(0));
  EXPECT_EQ(routed.health().n_lost, 1);
  EXPECT_TRUE(routed.health().serving);
  collector.release();
  for (const InstanceRequest& r : requests) {
    const Collector::Output out = collector.wait(r.id);
    EXPECT_EQ(out.finish, InstanceFinish::kLength) << "request " << r.id.value;
    EXPECT_EQ(out.tokens, expected[r.id]) << "request " << r.id.value;
  }
  EXPECT_EQ(routed.failover_counters().reruns, 2);
  {
    std::lock_guard lock(retries_mutex);
    EXPECT_EQ(retries[RequestId{1}] + retries[RequestId{2}] + retries[RequestId{3}] +
                  retries[RequestId{4}],
              2);
  }
  EXPECT_EQ(routed.routed_counts()[1], 4);  // the two re-runs went to b
  expect_all_free(*b);

  // The last instance lost: what runs ends kUnavailable, and nothing more is taken.
  collector.hold();
  routed.submit(request(5, 44, 200));
  collector.wait_for_token(RequestId{5});
  routed.instance_lost(1);
  collector.release();
  const Collector::Output out = collector.wait(RequestId{5});
  EXPECT_EQ(out.finish, InstanceFinish::kFailed);
  EXPECT_EQ(routed.failover_counters().failed_after_retries, 1);
  EXPECT_FALSE(routed.health().serving);
  EXPECT_THROW(routed.submit(request(6, 45, 4)), Error);
}

// Disaggregated: among prefill instances with equal queues, the prompt goes
// where a prompt with its prefix went (whole blocks of the engine's size).
// The prefill instances only report stats here; the decode instance computes
// every prompt itself (no prefill_peer rank: -1).
TEST_F(RoutedInstancesTest, PrefillGoesWhereItsPrefixWasSent) {
  std::unique_ptr<LocalInstance> p0 = make_instance();
  std::unique_ptr<LocalInstance> p1 = make_instance();
  std::unique_ptr<LocalInstance> d = make_instance();
  RoutedInstances routed({{p0.get(), InstanceRole::kPrefill, -1},
                          {p1.get(), InstanceRole::kPrefill, -1},
                          {d.get(), InstanceRole::kDecode, -1}},
                         std::make_unique<DisaggregatedPolicy>());
  Collector collector;
  routed.set_event_handler([&](auto events) { collector.on_events(events); });
  auto prompt_request = [](uint64_t id, std::vector<int32_t> prompt) {
    InstanceRequest r = request(id, 0, 2);
    r.prompt = std::move(prompt);
    return r;
  };
  std::vector<int32_t> a(40), b(40);
  std::iota(a.begin(), a.end(), 10);
  std::iota(b.begin(), b.end(), 60);
  std::vector<int32_t> b_prefix(b.begin(), b.begin() + 2 * KvLayout::kDefaultBlockSize);
  for (int32_t t = 0; t < 8; ++t) b_prefix.push_back(120 + t);

  // Keep the engine between two steps, so that no prompt is handed over
  // (each stays queued at its prefill instance) while the others are placed.
  collector.hold();
  routed.submit(request(1, 30, 4));  // prefill 0 (ties: the lowest index)
  collector.wait_for_token(RequestId{1});
  routed.submit(prompt_request(2, a));  // prefill 0: queues are equal again
  routed.submit(prompt_request(3, b));  // prefill 1: 0 has a queued
  EXPECT_EQ(routed.routed_counts(), (std::vector<int64_t>{2, 1, 3}));
  // Equal queues (40 tokens each): the 32 tokens prefill 1 likely caches win.
  routed.submit(prompt_request(4, b_prefix));
  EXPECT_EQ(routed.routed_counts(), (std::vector<int64_t>{2, 2, 4}));
  collector.release();
  for (uint64_t id = 1; id <= 4; ++id)
    EXPECT_EQ(collector.wait(RequestId{id}).finish, InstanceFinish::kLength);
  expect_all_free(*d);
}

// An instance joins while serving: new work reaches it, and its tokens are
// one instance's own. Draining, it gets nothing new but finishes what it runs;
// once it left, health counts it left, not lost.
TEST_F(RoutedInstancesTest, AJoinedInstanceTakesWorkThenDrainsAndLeaves) {
  std::map<RequestId, std::vector<int32_t>> expected;
  {
    std::unique_ptr<LocalInstance> alone = make_instance();
    Collector collector;
    alone->set_event_handler([&](auto events) { collector.on_events(events); });
    for (uint64_t id = 1; id <= 6; ++id) alone->submit(request(id, 40 + id, 16));
    for (uint64_t id = 1; id <= 6; ++id)
      expected[RequestId{id}] = collector.wait(RequestId{id}).tokens;
    alone->set_event_handler({});
  }
  // The instances outlive the router.
  std::unique_ptr<LocalInstance> a = make_instance();
  std::unique_ptr<LocalInstance> b = make_instance();
  std::unique_ptr<LocalInstance> other = make_instance("other");
  RoutedInstances routed(std::vector<InstanceClient*>{a.get()},
                         std::make_unique<ColocatedPolicy>());
  Collector collector;
  routed.set_event_handler(
      [&](std::span<const InstanceEvent> events) { collector.on_events(events); });
  EXPECT_THROW(routed.add_instance({other.get(), InstanceRole::kBoth, -1}, "h"), Error);
  EXPECT_EQ(routed.add_instance({b.get(), InstanceRole::kBoth, -1}, "node-b"), 1u);
  EXPECT_EQ(routed.size(), 2u);
  for (uint64_t id = 1; id <= 4; ++id) routed.submit(request(id, 40 + id, 16));
  // How they spread depends on when each instance admits; b takes the
  // second at least (a holds the first's blocks then).
  const std::vector<int64_t> before = routed.routed_counts();
  EXPECT_EQ(before[0] + before[1], 4);
  EXPECT_GE(before[1], 1);
  InstanceClient::Health health = routed.health();
  EXPECT_EQ(health.joins, 1);
  EXPECT_TRUE(health.instances[1].joined);
  EXPECT_EQ(health.instances[1].host, "node-b");

  routed.drain_instance(1);
  EXPECT_TRUE(routed.health().instances[1].draining);
  for (uint64_t id = 5; id <= 6; ++id) routed.submit(request(id, 40 + id, 16));
  EXPECT_EQ(routed.routed_counts(),
            (std::vector<int64_t>{before[0] + 2, before[1]}));  // none to the draining one
  for (uint64_t id = 1; id <= 6; ++id) {
    const Collector::Output out = collector.wait(RequestId{id});
    EXPECT_EQ(out.finish, InstanceFinish::kLength) << "request " << id;
    EXPECT_EQ(out.tokens, expected[RequestId{id}]) << "request " << id;
  }
  expect_all_free(*b);
  routed.instance_left(1, "drained");
  health = routed.health();
  EXPECT_EQ(health.leaves, 1);
  EXPECT_EQ(health.n_lost, 0);
  EXPECT_TRUE(health.instances[1].left);
  EXPECT_FALSE(health.instances[1].lost);
  EXPECT_EQ(routed.failover_counters().reruns, 0);
}

TEST_F(RoutedInstancesTest, InstancesServingDifferentModelsAreRefused) {
  std::unique_ptr<LocalInstance> a = make_instance("tiny");
  std::unique_ptr<LocalInstance> b = make_instance("other");
  try {
    RoutedInstances routed(std::vector<InstanceClient*>{a.get(), b.get()},
                           std::make_unique<ColocatedPolicy>());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("different models"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace duet
