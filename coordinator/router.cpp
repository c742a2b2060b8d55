#include "coordinator/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/kv_layout.h"

namespace duet {

size_t ColocatedPolicy::pick(std::span<const InstanceLoad> loads, const InstanceRequest&) const {
  DUET_ASSERT(!loads.empty(), "a policy picks among at least one instance");
  size_t best = 0;
  for (size_t i = 1; i < loads.size(); ++i) {
    const InstanceLoad& a = loads[i];
    const InstanceLoad& b = loads[best];
    if (a.kv_blocks_free > b.kv_blocks_free ||
        (a.kv_blocks_free == b.kv_blocks_free && a.sequences < b.sequences))
      best = i;
  }
  return best;
}

std::unique_ptr<RoutingPolicy> make_routing_policy(ClusterMode mode) {
  switch (mode) {
    case ClusterMode::kColocated:
      return std::make_unique<ColocatedPolicy>();
    case ClusterMode::kDisaggregated:
      break;
  }
  throw Error(ErrorKind::kUnsupported,
              fmt::format("{} mode is not supported yet: serve with --mode colocated",
                          cluster_mode_name(mode)));
}

RoutedInstances::RoutedInstances(std::vector<InstanceClient*> instances,
                                 std::unique_ptr<RoutingPolicy> policy)
    : instances_(std::move(instances)), policy_(std::move(policy)) {
  DUET_REQUIRE(!instances_.empty(), "the router needs at least one instance");
  DUET_ASSERT(policy_ != nullptr, "the router needs a policy");
  info_ = instances_.front()->info();
  for (size_t i = 1; i < instances_.size(); ++i) {
    const InstanceInfo& other = instances_[i]->info();
    auto differ = [&](std::string_view what, const auto& a, const auto& b) {
      DUET_REQUIRE(a == b,
                   "instances 0 and {} serve different models: {} {} vs {}; start every instance "
                   "with the same model",
                   i, what, a, b);
    };
    differ("model", info_.model_name, other.model_name);
    differ("context", info_.n_ctx, other.n_ctx);
    differ("vocabulary", info_.n_vocab, other.n_vocab);
    DUET_REQUIRE(info_.end_of_generation == other.end_of_generation,
                 "instances 0 and {} serve different models: their end-of-generation tokens "
                 "differ; start every instance with the same model",
                 i);
    info_.kv_capacity_tokens = std::min(info_.kv_capacity_tokens, other.kv_capacity_tokens);
  }
  sequences_.assign(instances_.size(), 0);
  pending_blocks_.assign(instances_.size(), 0);
  routed_.assign(instances_.size(), 0);
  for (size_t i = 0; i < instances_.size(); ++i) {
    instances_[i]->set_event_handler(
        [this, i](std::span<const InstanceEvent> events) { on_events(i, events); });
  }
}

RoutedInstances::~RoutedInstances() {
  for (InstanceClient* instance : instances_) instance->set_event_handler({});
}

void RoutedInstances::set_event_handler(EventHandler handler) {
  std::lock_guard lock(mutex_);
  handler_ = std::move(handler);
}

void RoutedInstances::submit(InstanceRequest request) {
  // Stats first, outside the lock: an instance's stats() takes its own lock.
  std::vector<InstanceLoad> loads(instances_.size());
  std::vector<int64_t> block_tokens(instances_.size());
  for (size_t i = 0; i < instances_.size(); ++i) {
    const InstanceStats s = instances_[i]->stats();
    loads[i].kv_blocks_free = s.kv_blocks_free;
    loads[i].kv_blocks_total = s.kv_blocks_total;
    block_tokens[i] = s.kv_block_tokens > 0 ? s.kv_block_tokens : KvLayout::kDefaultBlockSize;
  }
  size_t target = 0;
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < instances_.size(); ++i) {
      loads[i].kv_blocks_free -= pending_blocks_[i];
      loads[i].sequences = sequences_[i];
    }
    target = policy_->pick(loads, request);
    DUET_ASSERT(target < instances_.size(), "the policy picked instance {} of {}", target,
                instances_.size());
    // The prompt and the first generated token.
    const auto tokens = static_cast<int64_t>(request.prompt.size()) + 1;
    const int64_t blocks = (tokens + block_tokens[target] - 1) / block_tokens[target];
    placements_[request.id] = Placement{target, blocks};
    ++sequences_[target];
    pending_blocks_[target] += blocks;
    ++routed_[target];
  }
  const RequestId id = request.id;
  try {
    instances_[target]->submit(std::move(request));
  } catch (...) {
    // Not placed after all: undo the bookkeeping, and let the caller refuse it.
    std::lock_guard lock(mutex_);
    const Placement placement = placements_.at(id);
    placements_.erase(id);
    --sequences_[target];
    pending_blocks_[target] -= placement.pending_blocks;
    --routed_[target];
    throw;
  }
}

void RoutedInstances::cancel(RequestId id) {
  size_t target = 0;
  {
    std::lock_guard lock(mutex_);
    const auto it = placements_.find(id);
    if (it == placements_.end()) return;  // finished or unknown
    target = it->second.instance;
  }
  instances_[target]->cancel(id);
}

void RoutedInstances::on_events(size_t instance, std::span<const InstanceEvent> events) {
  EventHandler handler;
  {
    std::lock_guard lock(mutex_);
    for (const InstanceEvent& event : events) {
      const auto it = placements_.find(event.id);
      if (it == placements_.end()) continue;
      Placement& placement = it->second;
      DUET_ASSERT(placement.instance == instance, "request {} sent to instance {}, events from {}",
                  event.id.value, placement.instance, instance);
      if (event.admitted || event.finished) {
        pending_blocks_[instance] -= placement.pending_blocks;
        placement.pending_blocks = 0;
      }
      if (event.finished) {
        --sequences_[instance];
        placements_.erase(it);
      }
    }
    handler = handler_;
  }
  if (handler) handler(events);
}

InstanceStats RoutedInstances::stats() const {
  InstanceStats sum;
  for (size_t i = 0; i < instances_.size(); ++i) {
    const InstanceStats s = instances_[i]->stats();
    sum.running += s.running;
    sum.waiting += s.waiting;
    sum.kv_blocks_total += s.kv_blocks_total;
    sum.kv_blocks_free += s.kv_blocks_free;
    if (i == 0) sum.kv_block_tokens = s.kv_block_tokens;
    sum.steps += s.steps;
    sum.prompt_tokens += s.prompt_tokens;
    sum.prefix_hit_tokens += s.prefix_hit_tokens;
    sum.generated_tokens += s.generated_tokens;
    sum.preemptions += s.preemptions;
  }
  return sum;
}

std::vector<InstanceStats> RoutedInstances::instance_stats() const {
  std::vector<InstanceStats> out;
  for (InstanceClient* instance : instances_) out.push_back(instance->stats());
  return out;
}

std::vector<int64_t> RoutedInstances::routed_counts() const {
  std::lock_guard lock(mutex_);
  return routed_;
}

}  // namespace duet
