// Placement of requests across instances (docs/ARCHITECTURE.md, step 3). A
// RoutingPolicy (value-free, chosen at start-up) names the instance for one
// request from each instance's load: the router's own current view
// (InstanceLoad), not the instances' stats, which are a step old and would
// send a whole burst to one instance. RoutedInstances is an InstanceClient
// over several InstanceClients: the Service sees one instance. Disaggregated,
// a request is submitted to its decode instance (which reports all its events)
// and names the prefill instance that computes its prompt (prefill_peer).
//
// A lost instance (instance_lost) gets no new work. Each request on it, and
// each that its instance fails kUnavailable, goes again in order of arrival
// (on another instance when one can take it) as a new attempt with an id of
// its own: its prompt followed by the tokens delivered, max_tokens less those
// (the same tokens follow: docs/FAILURES.md, "What Duet does"). One lost in
// prefill has its old attempt cancelled on its decode instance first. After
// max_retries re-runs, or with no live instance that can take it, it ends
// kUnavailable; with a rerun wait (set_rerun_wait), one that no live
// instance can take waits that long for one (a replacement that joins, a
// rank that rejoins, a role change), placed at the first tick() that finds
// one, and so does a new request. An old attempt's events are dropped.
//
// Roles are the router's alone: an engine runs what it is sent (a whole
// request, a prompt to ship, or a request whose KV comes from a peer), so an
// instance with KV links (a disaggregated cluster's) can change role while it
// serves (change_role): no new work of the old role, what it runs finishes,
// then work of the new role. A disaggregated cluster may so hold colocated
// instances beside prefill and decode ones.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/serving.h"
#include "coordinator/cluster_admin.h"
#include "coordinator/prefix_memory.h"

namespace duet {

struct InstanceLoad {
  InstanceRole role = InstanceRole::kBoth;
  int64_t kv_blocks_free = 0;  // reported free, less the prompts sent but not yet admitted
  int64_t kv_blocks_total = 0;
  int64_t sequences = 0;  // sent and not finished (running + waiting)
  // Prefill instances: prompt tokens sent and not yet handed over.
  int64_t queued_prompt_tokens = 0;
  // Prefill instances: leading tokens of this request's prompt that prompts
  // recently sent there share, in the instance's blocks: a guess at its
  // prefix-cache hit (coordinator/prefix_memory.h).
  int64_t prefix_tokens = 0;
};

// Where one request goes: `target` gets it (and its events come from there);
// `prefill`, when set, computes its prompt.
struct Route {
  size_t target = 0;
  std::optional<size_t> prefill;
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy() = default;
  virtual std::string_view name() const = 0;
  // Indexes into `loads` (one per instance, at least one, with the roles
  // the policy serves). Called under the router's lock: pure and quick.
  virtual Route pick(std::span<const InstanceLoad> loads, const InstanceRequest& request) const = 0;
};

// Colocated instances (each runs both phases): the most free KV blocks, then
// the fewest sequences, then the lowest index.
class ColocatedPolicy final : public RoutingPolicy {
 public:
  std::string_view name() const override { return "colocated"; }
  Route pick(std::span<const InstanceLoad> loads, const InstanceRequest& request) const override;
};

// Prefill and decode instances. Prefill: the fewest queued prompt tokens,
// then the longest likely prefix-cache hit, then the lowest index. Decode:
// the most free KV blocks, then the fewest sequences, then the lowest index,
// among the decode and the colocated instances (which a role change may
// leave in the cluster); a colocated one computes the prompt itself.
class DisaggregatedPolicy final : public RoutingPolicy {
 public:
  std::string_view name() const override { return "disaggregated"; }
  Route pick(std::span<const InstanceLoad> loads, const InstanceRequest& request) const override;
};
// (Disaggregated with no prefill instance among `loads`: the decode instance
// computes the prompt itself, Route::prefill empty.)

std::unique_ptr<RoutingPolicy> make_routing_policy(ClusterMode mode);

// One instance behind the router.
struct RoutedInstance {
  InstanceClient* client = nullptr;
  InstanceRole role = InstanceRole::kBoth;
  int32_t peer = -1;  // its transfer address (leader's MPI rank), for prefill instances
  // It can ship a prompt's KV and receive one (a disaggregated cluster's
  // instance): it may change to any role. Without, only colocated.
  bool kv_links = false;
  int32_t tp = 1;  // its ranks: `peer` and the next tp - 1 addresses
};

class RoutedInstances final : public InstanceClient, public ClusterAdmin {
 public:
  // The instances outlive the router; they must agree on the model (name,
  // context, vocabulary, end-of-generation ids), else duet::Error
  // (kInvalidArgument) names the first difference. info() is the first
  // instance's, with the smallest kv_capacity_tokens of all (a sequence must
  // fit wherever it goes). Installs an event handler on every instance.
  // `max_retries`: re-runs of one request after losses, at most.
  RoutedInstances(std::vector<RoutedInstance> instances, std::unique_ptr<RoutingPolicy> policy,
                  int max_retries = 2);
  // Colocated instances.
  RoutedInstances(const std::vector<InstanceClient*>& instances,
                  std::unique_ptr<RoutingPolicy> policy, int max_retries = 2);
  ~RoutedInstances() override;  // removes the instances' handlers
  RoutedInstances(const RoutedInstances&) = delete;
  RoutedInstances& operator=(const RoutedInstances&) = delete;

  const InstanceInfo& info() const override { return info_; }
  // The handler gets every instance's events, on that instance's event
  // thread: with several local instances, from several threads at once.
  void set_event_handler(EventHandler handler) override;
  void submit(InstanceRequest request) override;
  void cancel(RequestId id) override;
  // The sum over the live instances (kv_block_tokens: the first instance's).
  InstanceStats stats() const override;
  Health health() const override;

  // An instance that joined while serving (any thread): it must serve the
  // same model as the others (else duet::Error, kInvalidArgument, naming the
  // difference); from now on it takes new work. Returns its index. `host`
  // is reported in health().
  size_t add_instance(RoutedInstance instance, std::string host = {});
  // Instance `instance` leaves (any thread): no new work goes there; what it
  // runs finishes there. Reported as draining in health().
  void drain_instance(size_t instance);
  // A draining instance is gone: as instance_lost (what it still held, which
  // should be nothing, runs again), but reported as left, not lost.
  void instance_left(size_t instance, std::string reason);

  // How long a re-run, or a new request, that no live instance can take
  // waits for one (above); 0, the default: it ends (is refused) at once.
  // Before serving.
  void set_rerun_wait(std::chrono::milliseconds wait);
  // Any thread, every so often (the coordinator's dispatcher: a few times a
  // lease): the waiting re-runs that an instance can take now go there, in
  // order of arrival; those past their wait end kUnavailable.
  void tick();

  // Instance `instance` is lost (any thread; once is enough, again is a
  // no-op): no new work goes there, and its requests are re-run (above).
  // `epoch` and `reason` are reported in health().
  void instance_lost(size_t instance, uint64_t epoch = 0, std::string reason = {});
  bool lost(size_t instance) const;

  // ClusterAdmin. Refused: an instance out of range, lost, leaving or left;
  // prefill or decode for an instance without KV links; a change that would
  // leave no live instance to decode (decode or colocated). Asked while the
  // instance still finishes its old role's work, the new role replaces the
  // one it waits for (its current role: it stays). Logged, counted in
  // health() (role_changes), and shown there while it waits (switching_to).
  std::string change_role(int64_t instance, InstanceRole role) override;
  // Instance `instance`'s role now (what it takes new work as).
  InstanceRole role(size_t instance) const;

  // Each instance as a rebalancer weighs it (coordinator/rebalancer.h), in order.
  struct RoleView {
    InstanceRole role = InstanceRole::kBoth;
    bool taking_work = false;  // live, not leaving, not changing role
    bool switching = false;    // changing role: waits for its work to end
    bool kv_links = false;
    int64_t sequences = 0;             // requests on it (decoded, or run whole)
    int64_t queued_prompt_tokens = 0;  // prompts it computes for others, not handed over
  };
  std::vector<RoleView> role_views() const;

  struct FailoverCounters {
    int64_t reruns = 0;                // attempts submitted again after a loss
    int64_t failed_after_retries = 0;  // ended kUnavailable: out of retries or of instances
  };
  FailoverCounters failover_counters() const;

  size_t size() const;
  const RoutingPolicy& policy() const { return *policy_; }
  // Each instance's own stats, in order.
  std::vector<InstanceStats> instance_stats() const;
  // Requests sent to each instance so far, in order (cumulative).
  std::vector<int64_t> routed_counts() const;

 private:
  struct Placement {
    size_t instance = 0;
    int64_t pending_blocks = 0;  // until admitted
    std::optional<size_t> prefill;
    int64_t prompt_tokens = 0;  // queued at `prefill` until the first token
    // For a re-run: the request as the client sent it, the tokens delivered.
    InstanceRequest request;  // its prompt is the original one
    std::vector<int32_t> delivered;
    RequestId attempt;  // the id the instance knows this attempt by
    int32_t retries = 0;
    uint64_t arrival = 0;  // order of arrival at the router
    // Waiting for an instance to take it (no attempt runs) until then.
    std::optional<std::chrono::steady_clock::time_point> waits_until;
    bool started = false;  // an attempt was placed (the next is a re-run)
  };
  struct Attempt {
    InstanceRequest request;  // to submit (attempt id, prefill peer set)
    size_t target = 0;
    InstanceClient* client = nullptr;  // target's
  };

  void on_events(size_t instance,
                 std::span<const InstanceEvent> events);  // instance's event thread
  // Under mutex_: the prompt's handover from its prefill instance is over.
  void handed_over(Placement& placement);
  // Under mutex_: routes `request` (attempt id set) for `id` over the live
  // instances and books it; nullopt when no live instance can take it.
  std::optional<Attempt> place(RequestId id, InstanceRequest request, Placement& placement,
                               std::span<const InstanceStats> stats);
  // Under mutex_: the bookkeeping of placement's current attempt undone.
  void unbook(const Placement& placement);
  void again(RequestId id, std::optional<size_t> avoid, std::span<const InstanceStats> stats,
             std::vector<Attempt>& reruns, std::vector<InstanceEvent>& ended);
  // Under mutex_: `id`'s next attempt, placed (away from `avoid` when another
  // instance can take it) and booked; nullopt when no live instance can take it.
  std::optional<Attempt> rerun(RequestId id, Placement& placement, std::optional<size_t> avoid,
                               std::span<const InstanceStats> stats);
  void submit_reruns(std::vector<Attempt>& reruns, std::vector<InstanceEvent>& ended);
  std::vector<InstanceStats> all_stats() const;  // outside mutex_
  // Under mutex_: the model of `instance` agrees with the first instance's
  // (else duet::Error); narrows info_'s capacity to it.
  void check_same_model(size_t index, const InstanceInfo& other);
  // Under mutex_: the per-instance books of instances_.back().
  void book_new_instance();
  // `instance` lost or left: `record` (under mutex_) says which, then it
  // gets no more work and its requests go again (outside mutex_).
  void take_out(size_t instance, const std::function<void()>& record);
  // Under mutex_: each instance waiting to change role whose old work is
  // done takes its new role.
  void finish_role_changes();
  // Under mutex_: `instance` gets no more work; its requests go again.
  void remove_instance(size_t instance,
                       std::vector<std::pair<InstanceClient*, RequestId>>& withdrawn,
                       std::vector<Attempt>& reruns, std::vector<InstanceEvent>& ended,
                       std::span<const InstanceStats> stats);

  // Grows when an instance joins (under mutex_); read under mutex_, but for
  // the constructor and destructor.
  std::vector<RoutedInstance> instances_;
  const std::unique_ptr<RoutingPolicy> policy_;
  InstanceInfo info_;

  const int max_retries_;
  std::chrono::milliseconds rerun_wait_{0};

  mutable std::mutex mutex_;  // guards the members below
  EventHandler handler_;
  // Looked up for every token event: hashed, not ordered (a loss sorts by arrival).
  struct IdHash {
    size_t operator()(RequestId id) const { return std::hash<uint64_t>{}(id.value); }
  };
  std::unordered_map<RequestId, Placement, IdHash> placements_;  // submitted, not finished
  std::unordered_map<RequestId, RequestId, IdHash> attempts_;    // live attempt id -> request id
  std::vector<bool> lost_;  // per instance: lost or left (no work, its events dropped)
  struct Membership {
    bool joined = false, draining = false, left = false;
    std::string host;
  };
  std::vector<Membership> membership_;  // per instance
  int64_t joins_ = 0, leaves_ = 0, role_changes_ = 0;
  // Per instance: the role it takes once what it runs is done (a change_role
  // in progress: it gets no new work meanwhile).
  std::vector<std::optional<InstanceRole>> switching_to_;
  size_t n_started_ = 0;                                    // instances given to the constructor
  std::vector<std::pair<uint64_t, std::string>> lost_why_;  // per instance: epoch, reason
  std::map<uint64_t, RequestId> waiting_;  // re-runs that wait (Placement::waits_until), by arrival
  uint64_t next_arrival_ = 0;
  uint64_t next_attempt_ = 1;
  FailoverCounters failover_;
  std::vector<int64_t> sequences_;       // per instance: placements there
  std::vector<int64_t> pending_blocks_;  // per instance: sum of pending_blocks
  std::vector<int64_t> routed_;          // per instance: cumulative submits
  std::vector<int64_t> queued_prompt_;   // per instance: prompt tokens not handed over
  // Per instance: the prompts sent there to prefill (prefill instances only).
  std::vector<PrefixMemory> prefixes_;
};

}  // namespace duet
