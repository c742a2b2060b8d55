// Role changes while serving (RoutedInstances::change_role): the router's
// part of them, over scripted instances whose events the test sends, so that
// every step is deterministic. An instance changing role gets no new work,
// finishes what it runs (requests it decodes, prompts it computes for
// others), then takes work of its new role; colocated instances take whole
// requests beside decode ones; the refusals name their reason. The real
// engines under mpirun: tests/mpi/test_role_change.py. Also the rerun wait:
// a lost instance's request that no live instance can take waits for one
// to join, or fails once its wait runs out. No MPI.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/error.h"
#include "coordinator/router.h"

namespace duet {
namespace {

// An instance that records what it is sent; the test delivers its events.
class ScriptedInstance final : public InstanceClient {
 public:
  ScriptedInstance() { info_ = {"tiny", 256, 100, 256, {2}}; }
  const InstanceInfo& info() const override { return info_; }
  void set_event_handler(EventHandler handler) override { handler_ = std::move(handler); }
  void submit(InstanceRequest request) override {
    if (refuse) throw Error(ErrorKind::kInvalidArgument, "refused");
    submitted.push_back(std::move(request));
  }
  void cancel(RequestId id) override { cancelled.push_back(id); }
  InstanceStats stats() const override {
    InstanceStats s;
    s.kv_blocks_total = s.kv_blocks_free = 64;
    s.kv_block_tokens = 16;
    return s;
  }
  void emit(std::vector<InstanceEvent> events) { handler_(events); }
  // Its request `k`'s first token, then (optionally) its end.
  void token(size_t k, int32_t token, bool finished = false) {
    emit({{.id = submitted.at(k).id,
           .admitted = true,
           .token = token,
           .finished = finished,
           .finish = InstanceFinish::kLength}});
  }

  std::vector<InstanceRequest> submitted;
  std::vector<RequestId> cancelled;
  bool refuse = false;  // submit throws (the instance went meanwhile)

 private:
  InstanceInfo info_;
  EventHandler handler_;
};

constexpr auto kPrefill = InstanceRole::kPrefill;
constexpr auto kDecode = InstanceRole::kDecode;
constexpr auto kBoth = InstanceRole::kBoth;

InstanceRequest request(uint64_t id) {
  InstanceRequest r;
  r.id = RequestId{id};
  r.prompt = {1, 5, 7, 9};
  r.max_tokens = 4;
  return r;
}

// A disaggregated cluster: instances with KV links, transfer addresses 10, 11, ...
struct Cluster {
  explicit Cluster(std::vector<InstanceRole> roles, bool kv_links = true) {
    instances.resize(roles.size());
    std::vector<RoutedInstance> routed;
    for (size_t i = 0; i < roles.size(); ++i)
      routed.push_back({&instances[i], roles[i], static_cast<int32_t>(10 + i), kv_links});
    router.emplace(std::move(routed), make_routing_policy(ClusterMode::kDisaggregated));
    router->set_event_handler([this](std::span<const InstanceEvent> events) {
      std::lock_guard lock(mutex);
      for (const InstanceEvent& e : events) {
        if (e.token >= 0) tokens[e.id.value].push_back(e.token);
        if (e.finished) finished[e.id.value] = e.finish;
      }
    });
  }
  std::string switching_to(size_t i) { return router->health().instances.at(i).switching_to; }

  std::vector<ScriptedInstance> instances;
  std::optional<RoutedInstances> router;
  std::mutex mutex;
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, InstanceFinish> finished;
};

TEST(DisaggregatedPolicy, ColocatedInstancesTakeWholeRequests) {
  const DisaggregatedPolicy policy;
  auto load = [](InstanceRole role, int64_t free) {
    InstanceLoad l;
    l.role = role;
    l.kv_blocks_free = free;
    l.kv_blocks_total = 100;
    return l;
  };
  const InstanceRequest r;
  // The roomiest of the decode and colocated instances; a colocated one needs no prefill.
  Route route = policy.pick(
      std::vector<InstanceLoad>{load(kPrefill, 90), load(kDecode, 10), load(kBoth, 30)}, r);
  EXPECT_EQ(route.target, 2u);
  EXPECT_FALSE(route.prefill.has_value());
  route = policy.pick(
      std::vector<InstanceLoad>{load(kPrefill, 90), load(kDecode, 40), load(kBoth, 30)}, r);
  EXPECT_EQ(route.target, 1u);
  EXPECT_EQ(route.prefill, std::optional<size_t>(0));
}

TEST(RoleChange, PrefillBecomesDecodeOnceItsPromptsAreHandedOver) {
  Cluster c({kPrefill, kDecode});
  c.router->submit(request(1));
  ASSERT_EQ(c.instances[1].submitted.size(), 1u);
  EXPECT_EQ(c.instances[1].submitted[0].prefill_peer, 10);  // prompt computed by instance 0

  const std::string said = c.router->change_role(0, kDecode);
  EXPECT_NE(said.find("once its"), std::string::npos) << said;
  EXPECT_EQ(c.router->role(0), kPrefill);  // its queued prompt is not handed over yet
  EXPECT_EQ(c.switching_to(0), "decode");
  // Meanwhile new requests get no prefill peer: the decode instance computes them.
  c.router->submit(request(2));
  ASSERT_EQ(c.instances[1].submitted.size(), 2u);
  EXPECT_EQ(c.instances[1].submitted[1].prefill_peer, -1);
  EXPECT_TRUE(c.instances[0].submitted.empty());

  c.instances[1].token(0, 42);  // request 1's first token: its KV was handed over
  EXPECT_EQ(c.router->role(0), kDecode);
  EXPECT_EQ(c.switching_to(0), "");
  EXPECT_EQ(c.router->health().role_changes, 1);
  // Now two decode instances: the next request goes to the roomier by
  // sequences (instance 0 has none), and no instance computes prompts for others.
  c.router->submit(request(3));
  ASSERT_EQ(c.instances[0].submitted.size(), 1u);
  EXPECT_EQ(c.instances[0].submitted[0].prefill_peer, -1);
  // Nothing was lost on the way.
  c.instances[1].token(0, 43, true);
  c.instances[1].token(1, 44, true);
  c.instances[0].token(0, 45, true);
  std::lock_guard lock(c.mutex);
  EXPECT_EQ(c.finished.size(), 3u);
  EXPECT_EQ(c.tokens[1], (std::vector<int32_t>{42, 43}));
}

TEST(RoleChange, DecodeBecomesPrefillOnceItsRequestsFinish) {
  Cluster c({kPrefill, kDecode, kDecode});
  c.router->submit(request(1));  // to instance 1 (lowest index among equals)
  c.router->submit(request(2));  // to instance 2
  ASSERT_EQ(c.instances[1].submitted.size(), 1u);
  ASSERT_EQ(c.instances[2].submitted.size(), 1u);
  c.router->change_role(1, kPrefill);
  c.router->submit(request(3));  // not to instance 1
  EXPECT_EQ(c.instances[1].submitted.size(), 1u);
  EXPECT_EQ(c.instances[2].submitted.size(), 2u);
  c.instances[1].token(0, 42);
  EXPECT_EQ(c.switching_to(1), "prefill");  // still decoding request 1
  c.instances[1].token(0, 43, true);
  EXPECT_EQ(c.router->role(1), kPrefill);
  // Two prefill instances now; the next request's prompt may go to either,
  // by queued prompt tokens: instance 0 holds requests 2 and 3's, so instance 1.
  c.router->submit(request(4));
  ASSERT_EQ(c.instances[2].submitted.size(), 3u);
  EXPECT_EQ(c.instances[2].submitted[2].prefill_peer, 11);
}

TEST(RoleChange, ColocatedBesideDisaggregated) {
  Cluster c({kPrefill, kDecode});
  EXPECT_NE(c.router->change_role(1, kBoth).find("now both"), std::string::npos);
  c.router->submit(request(1));
  ASSERT_EQ(c.instances[1].submitted.size(), 1u);
  EXPECT_EQ(c.instances[1].submitted[0].prefill_peer, -1);  // computes its own prompt
  EXPECT_EQ(c.router->health().instances[1].role, "both");
}

TEST(RoleChange, CalledOffOrRedirectedWhileWaiting) {
  Cluster c({kPrefill, kDecode, kDecode});
  c.router->submit(request(1));
  c.router->change_role(1, kPrefill);
  EXPECT_EQ(c.switching_to(1), "prefill");
  c.router->change_role(1, kBoth);  // replaces the role it waits for
  EXPECT_EQ(c.switching_to(1), "both");
  EXPECT_NE(c.router->change_role(1, kDecode).find("stays decode"), std::string::npos);
  EXPECT_EQ(c.switching_to(1), "");
  EXPECT_NE(c.router->change_role(1, kDecode).find("already"), std::string::npos);
  EXPECT_EQ(c.router->health().role_changes, 0);
}

TEST(RoleChange, LostWhileWaitingRunsItsRequestsElsewhere) {
  Cluster c({kPrefill, kDecode, kDecode});
  c.router->submit(request(1));
  c.router->change_role(1, kPrefill);
  c.router->instance_lost(1, 1, "silent");
  ASSERT_EQ(c.instances[2].submitted.size(), 1u);  // re-run on the other decode instance
  EXPECT_EQ(c.switching_to(1), "");
  EXPECT_EQ(c.router->role(1), kDecode);
}

TEST(RoleChange, Refusals) {
  auto refused = [](Cluster& c, int64_t instance, InstanceRole role, const std::string& why) {
    try {
      c.router->change_role(instance, role);
      ADD_FAILURE() << "instance " << instance << " took " << instance_role_name(role);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  Cluster c({kPrefill, kDecode, kDecode});
  refused(c, 3, kDecode, "instances 0 to 2");
  refused(c, -1, kDecode, "instances 0 to 2");
  c.router->change_role(1, kPrefill);  // instance 2 still decodes
  refused(c, 2, kPrefill, "no live instance would be left to decode");
  c.router->instance_lost(0, 1, "silent");
  refused(c, 0, kDecode, "it was lost");
  c.router->drain_instance(2);
  refused(c, 2, kBoth, "it is leaving");

  Cluster colocated({kBoth, kBoth}, /*kv_links=*/false);
  refused(colocated, 0, kPrefill, "no KV links");
  refused(colocated, 1, kDecode, "no KV links");
  EXPECT_NE(colocated.router->change_role(0, kBoth).find("already"), std::string::npos);
}

// With a rerun wait, a lost instance's request that no live instance can
// take waits (a replacement joins, say) instead of failing at once, and a
// new request waits instead of being refused.
TEST(RerunWait, ARequestWaitsForAnInstanceThatJoinsThenGoesOn) {
  Cluster c({kPrefill, kDecode});
  c.router->set_rerun_wait(std::chrono::seconds(60));
  c.router->submit(request(1));
  c.instances[1].token(0, 42);
  c.router->instance_lost(1);  // the only decode instance
  c.router->tick();
  {
    std::lock_guard lock(c.mutex);
    EXPECT_TRUE(c.finished.empty());
  }
  c.router->submit(request(2));  // a new request waits too, rather than being refused
  ScriptedInstance joined;
  c.router->add_instance({&joined, kDecode, 20, true});
  EXPECT_TRUE(joined.submitted.empty());  // placed at the next tick
  c.router->tick();
  ASSERT_EQ(joined.submitted.size(), 2u);  // in order of arrival
  const InstanceRequest& again = joined.submitted[0];
  EXPECT_EQ(again.prompt, (std::vector<int32_t>{1, 5, 7, 9, 42}));  // what was delivered
  EXPECT_EQ(again.max_tokens, 3);
  EXPECT_EQ(again.prefill_peer, 10);
  EXPECT_EQ(joined.submitted[1].prompt, (std::vector<int32_t>{1, 5, 7, 9}));
  EXPECT_EQ(joined.submitted[1].max_tokens, 4);
  joined.token(0, 43, true);
  joined.token(1, 44, true);
  std::lock_guard lock(c.mutex);
  EXPECT_EQ(c.tokens[1], (std::vector<int32_t>{42, 43}));
  EXPECT_EQ(c.finished[1], InstanceFinish::kLength);
  EXPECT_EQ(c.tokens[2], (std::vector<int32_t>{44}));
  EXPECT_EQ(c.router->failover_counters().reruns, 1);  // request 2 never ran before
}

TEST(RerunWait, ARerunRefusedByItsInstanceWaitsAgain) {
  Cluster c({kPrefill, kDecode});
  c.router->set_rerun_wait(std::chrono::seconds(60));
  c.router->submit(request(1));
  c.router->instance_lost(1);
  ScriptedInstance joined;
  joined.refuse = true;
  c.router->add_instance({&joined, kDecode, 20, true});
  c.router->tick();  // placed there, refused: it waits again
  {
    std::lock_guard lock(c.mutex);
    EXPECT_TRUE(c.finished.empty());
  }
  joined.refuse = false;
  c.router->tick();
  ASSERT_EQ(joined.submitted.size(), 1u);
  joined.token(0, 42, true);
  std::lock_guard lock(c.mutex);
  EXPECT_EQ(c.finished[1], InstanceFinish::kLength);
  EXPECT_EQ(c.router->failover_counters().failed_after_retries, 0);
}

TEST(RerunWait, AWaitThatRunsOutFailsAndACancelledWaitEnds) {
  Cluster c({kPrefill, kDecode});
  c.router->set_rerun_wait(std::chrono::milliseconds(1));
  c.router->submit(request(1));
  c.router->submit(request(2));
  c.router->instance_lost(1);
  c.router->cancel(RequestId{2});  // no attempt runs: it ends at once
  {
    std::lock_guard lock(c.mutex);
    EXPECT_EQ(c.finished[2], InstanceFinish::kCancelled);
    EXPECT_FALSE(c.finished.contains(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  c.router->tick();
  std::lock_guard lock(c.mutex);
  EXPECT_EQ(c.finished[1], InstanceFinish::kFailed);
  EXPECT_EQ(c.router->failover_counters().failed_after_retries, 1);
  EXPECT_TRUE(c.instances[1].cancelled.empty());  // nothing was sent to the lost instance
}

}  // namespace
}  // namespace duet
