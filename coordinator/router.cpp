#include "coordinator/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/model/kv_layout.h"

namespace duet {

namespace {

// The most free KV blocks, then the fewest sequences, then the lowest index,
// among the instances of `role`.
std::optional<size_t> roomiest(std::span<const InstanceLoad> loads, InstanceRole role) {
  std::optional<size_t> best;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (loads[i].role != role) continue;
    if (!best) {
      best = i;
      continue;
    }
    const InstanceLoad& a = loads[i];
    const InstanceLoad& b = loads[*best];
    if (a.kv_blocks_free > b.kv_blocks_free ||
        (a.kv_blocks_free == b.kv_blocks_free && a.sequences < b.sequences))
      best = i;
  }
  return best;
}

// Tokens per KV block of an instance: its stats', else the engine's default.
int64_t tokens_per_block(const InstanceStats& stats) {
  return stats.kv_block_tokens > 0 ? stats.kv_block_tokens : KvLayout::kDefaultBlockSize;
}

}  // namespace

Route ColocatedPolicy::pick(std::span<const InstanceLoad> loads, const InstanceRequest&) const {
  const std::optional<size_t> target = roomiest(loads, InstanceRole::kBoth);
  DUET_ASSERT(target.has_value(), "a colocated policy picks among colocated instances");
  return {*target, std::nullopt};
}

Route DisaggregatedPolicy::pick(std::span<const InstanceLoad> loads, const InstanceRequest&) const {
  const std::optional<size_t> decode = roomiest(loads, InstanceRole::kDecode);
  DUET_ASSERT(decode.has_value(), "a disaggregated policy needs a decode instance");
  std::optional<size_t> prefill;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (loads[i].role != InstanceRole::kPrefill) continue;
    if (!prefill) {
      prefill = i;
      continue;
    }
    const InstanceLoad& a = loads[i];
    const InstanceLoad& b = loads[*prefill];
    if (a.queued_prompt_tokens < b.queued_prompt_tokens ||
        (a.queued_prompt_tokens == b.queued_prompt_tokens && a.prefix_tokens > b.prefix_tokens))
      prefill = i;
  }
  DUET_ASSERT(prefill.has_value(), "a disaggregated policy needs a prefill instance");
  return {*decode, prefill};
}

std::unique_ptr<RoutingPolicy> make_routing_policy(ClusterMode mode) {
  switch (mode) {
    case ClusterMode::kColocated:
      return std::make_unique<ColocatedPolicy>();
    case ClusterMode::kDisaggregated:
      return std::make_unique<DisaggregatedPolicy>();
  }
  throw_assert_failure("known enum value", __FILE__, __LINE__, "unknown cluster mode");
}

namespace {

std::vector<RoutedInstance> colocated(const std::vector<InstanceClient*>& clients) {
  std::vector<RoutedInstance> out;
  for (InstanceClient* client : clients) out.push_back({client, InstanceRole::kBoth, -1});
  return out;
}

}  // namespace

RoutedInstances::RoutedInstances(const std::vector<InstanceClient*>& instances,
                                 std::unique_ptr<RoutingPolicy> policy)
    : RoutedInstances(colocated(instances), std::move(policy)) {}

RoutedInstances::RoutedInstances(std::vector<RoutedInstance> instances,
                                 std::unique_ptr<RoutingPolicy> policy)
    : instances_(std::move(instances)), policy_(std::move(policy)) {
  DUET_REQUIRE(!instances_.empty(), "the router needs at least one instance");
  DUET_ASSERT(policy_ != nullptr, "the router needs a policy");
  info_ = instances_.front().client->info();
  for (size_t i = 1; i < instances_.size(); ++i) {
    const InstanceInfo& other = instances_[i].client->info();
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
  const size_t n = instances_.size();
  sequences_.assign(n, 0);
  pending_blocks_.assign(n, 0);
  routed_.assign(n, 0);
  queued_prompt_.assign(n, 0);
  prefixes_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    // Keyed by the engine's own block size, which an instance reports from its start.
    prefixes_.emplace_back(tokens_per_block(instances_[i].client->stats()));
    instances_[i].client->set_event_handler(
        [this, i](std::span<const InstanceEvent> events) { on_events(i, events); });
  }
}

void RoutedInstances::handed_over(Placement& placement) {
  if (!placement.prefill) return;
  queued_prompt_[*placement.prefill] -= placement.prompt_tokens;
  placement.prefill.reset();
}

RoutedInstances::~RoutedInstances() {
  for (const RoutedInstance& instance : instances_) instance.client->set_event_handler({});
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
    const InstanceStats s = instances_[i].client->stats();
    loads[i].role = instances_[i].role;
    loads[i].kv_blocks_free = s.kv_blocks_free;
    loads[i].kv_blocks_total = s.kv_blocks_total;
    block_tokens[i] = tokens_per_block(s);
  }
  size_t target = 0;
  std::optional<size_t> prefill;
  const auto prompt_tokens = static_cast<int64_t>(request.prompt.size());
  {
    std::lock_guard lock(mutex_);
    size_t n_prefill = 0;
    for (size_t i = 0; i < instances_.size(); ++i) {
      loads[i].kv_blocks_free -= pending_blocks_[i];
      loads[i].sequences = sequences_[i];
      loads[i].queued_prompt_tokens = queued_prompt_[i];
      n_prefill += instances_[i].role == InstanceRole::kPrefill ? 1 : 0;
    }
    if (n_prefill > 1) {
      for (size_t i = 0; i < instances_.size(); ++i) {
        if (instances_[i].role == InstanceRole::kPrefill)
          loads[i].prefix_tokens = prefixes_[i].cached_tokens(request.prompt);
      }
    }
    const Route route = policy_->pick(loads, request);
    target = route.target;
    prefill = route.prefill;
    DUET_ASSERT(target < instances_.size() && (!prefill || *prefill < instances_.size()),
                "the policy picked an instance outside the {}", instances_.size());
    // The prompt and the first generated token.
    const int64_t blocks = (prompt_tokens + 1 + block_tokens[target] - 1) / block_tokens[target];
    placements_[request.id] = Placement{target, blocks, prefill, prompt_tokens};
    ++sequences_[target];
    pending_blocks_[target] += blocks;
    ++routed_[target];
    if (prefill) {
      queued_prompt_[*prefill] += prompt_tokens;
      ++routed_[*prefill];
      if (n_prefill > 1) prefixes_[*prefill].remember(request.prompt);
      request.prefill_peer = instances_[*prefill].peer;
    }
  }
  const RequestId id = request.id;
  try {
    instances_[target].client->submit(std::move(request));
  } catch (...) {
    // Not placed after all: undo the bookkeeping, and let the caller refuse it.
    std::lock_guard lock(mutex_);
    Placement placement = placements_.at(id);
    placements_.erase(id);
    --sequences_[target];
    pending_blocks_[target] -= placement.pending_blocks;
    --routed_[target];
    if (placement.prefill) --routed_[*placement.prefill];
    handed_over(placement);
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
  instances_[target].client->cancel(id);
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
      if (event.token >= 0 || event.finished) handed_over(placement);
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
    const InstanceStats s = instances_[i].client->stats();
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
  for (const RoutedInstance& instance : instances_) out.push_back(instance.client->stats());
  return out;
}

std::vector<int64_t> RoutedInstances::routed_counts() const {
  std::lock_guard lock(mutex_);
  return routed_;
}

}  // namespace duet
