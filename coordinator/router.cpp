#include "coordinator/router.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/model/kv_layout.h"

namespace duet {

namespace {

// The most free KV blocks, then the fewest sequences, then the lowest index,
// among the instances that take whole requests (decode or colocated).
std::optional<size_t> roomiest(std::span<const InstanceLoad> loads) {
  std::optional<size_t> best;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (loads[i].role == InstanceRole::kPrefill) continue;
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

// Attempt ids of re-runs: above any id the service gives (it counts from 1).
constexpr uint64_t kRerunIdBase = uint64_t{1} << 62;

// Tokens per KV block of an instance: its stats', else the engine's default.
int64_t tokens_per_block(const InstanceStats& stats) {
  return stats.kv_block_tokens > 0 ? stats.kv_block_tokens : KvLayout::kDefaultBlockSize;
}

}  // namespace

Route ColocatedPolicy::pick(std::span<const InstanceLoad> loads, const InstanceRequest&) const {
  const std::optional<size_t> target = roomiest(loads);
  DUET_ASSERT(target.has_value() && loads[*target].role == InstanceRole::kBoth,
              "a colocated policy picks among colocated instances");
  return {*target, std::nullopt};
}

Route DisaggregatedPolicy::pick(std::span<const InstanceLoad> loads, const InstanceRequest&) const {
  const std::optional<size_t> decode = roomiest(loads);
  DUET_ASSERT(decode.has_value(), "a disaggregated policy needs a decode instance");
  if (loads[*decode].role == InstanceRole::kBoth) return {*decode, std::nullopt};
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
  return {*decode, prefill};  // no prefill instance: the decode instance computes the prompt
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
                                 std::unique_ptr<RoutingPolicy> policy, int max_retries)
    : RoutedInstances(colocated(instances), std::move(policy), max_retries) {}

RoutedInstances::RoutedInstances(std::vector<RoutedInstance> instances,
                                 std::unique_ptr<RoutingPolicy> policy, int max_retries)
    : instances_(std::move(instances)), policy_(std::move(policy)), max_retries_(max_retries) {
  DUET_REQUIRE(!instances_.empty(), "the router needs at least one instance");
  DUET_ASSERT(policy_ != nullptr, "the router needs a policy");
  info_ = instances_.front().client->info();
  for (size_t i = 1; i < instances_.size(); ++i) check_same_model(i, instances_[i].client->info());
  // The books of each, in order (the vectors grow one instance at a time).
  std::vector<RoutedInstance> all = std::move(instances_);
  instances_.clear();
  for (RoutedInstance& instance : all) {
    instances_.push_back(instance);
    book_new_instance();
  }
  n_started_ = instances_.size();
}

void RoutedInstances::check_same_model(size_t index, const InstanceInfo& other) {
  auto differ = [&](std::string_view what, const auto& a, const auto& b) {
    DUET_REQUIRE(a == b,
                 "instances 0 and {} serve different models: {} {} vs {}; start every instance "
                 "with the same model",
                 index, what, a, b);
  };
  differ("model", info_.model_name, other.model_name);
  differ("context", info_.n_ctx, other.n_ctx);
  differ("vocabulary", info_.n_vocab, other.n_vocab);
  DUET_REQUIRE(info_.end_of_generation == other.end_of_generation,
               "instances 0 and {} serve different models: their end-of-generation tokens "
               "differ; start every instance with the same model",
               index);
  info_.kv_capacity_tokens = std::min(info_.kv_capacity_tokens, other.kv_capacity_tokens);
}

void RoutedInstances::book_new_instance() {
  const size_t i = instances_.size() - 1;
  sequences_.push_back(0);
  pending_blocks_.push_back(0);
  routed_.push_back(0);
  queued_prompt_.push_back(0);
  lost_.push_back(false);
  lost_why_.emplace_back();
  membership_.emplace_back();
  switching_to_.emplace_back();
  // Keyed by the engine's own block size, which an instance reports from its start.
  prefixes_.emplace_back(tokens_per_block(instances_[i].client->stats()));
  instances_[i].client->set_event_handler(
      [this, i](std::span<const InstanceEvent> events) { on_events(i, events); });
}

void RoutedInstances::handed_over(Placement& placement) {
  if (!placement.prefill) return;
  queued_prompt_[*placement.prefill] -= placement.prompt_tokens;
  placement.prefill.reset();
}

size_t RoutedInstances::size() const {
  std::lock_guard lock(mutex_);
  return instances_.size();
}

RoutedInstances::~RoutedInstances() {
  for (const RoutedInstance& instance : instances_) instance.client->set_event_handler({});
}

void RoutedInstances::set_event_handler(EventHandler handler) {
  std::lock_guard lock(mutex_);
  handler_ = std::move(handler);
}

std::vector<InstanceStats> RoutedInstances::all_stats() const {
  // Outside the lock: an instance's stats() takes its own lock.
  std::vector<InstanceClient*> clients;
  {
    std::lock_guard lock(mutex_);
    for (const RoutedInstance& instance : instances_) clients.push_back(instance.client);
  }
  std::vector<InstanceStats> stats;
  for (InstanceClient* client : clients) stats.push_back(client->stats());
  return stats;
}

std::optional<RoutedInstances::Attempt> RoutedInstances::place(
    RequestId id, InstanceRequest request, Placement& placement,
    std::span<const InstanceStats> stats) {
  // The policy sees the live instances only; `live[k]` is the k-th one's index.
  std::vector<InstanceLoad> loads;
  std::vector<size_t> live;
  size_t n_prefill = 0;
  // (An instance that joined since `stats` was taken waits for the next request.)
  for (size_t i = 0; i < std::min(instances_.size(), stats.size()); ++i) {
    if (lost_[i] || membership_[i].draining || switching_to_[i]) continue;
    InstanceLoad load;
    load.role = instances_[i].role;
    load.kv_blocks_free = stats[i].kv_blocks_free - pending_blocks_[i];
    load.kv_blocks_total = stats[i].kv_blocks_total;
    load.sequences = sequences_[i];
    load.queued_prompt_tokens = queued_prompt_[i];
    n_prefill += load.role == InstanceRole::kPrefill ? 1 : 0;
    loads.push_back(load);
    live.push_back(i);
  }
  const bool has_target = std::any_of(loads.begin(), loads.end(), [](const InstanceLoad& load) {
    return load.role != InstanceRole::kPrefill;
  });
  if (!has_target) return std::nullopt;
  if (n_prefill > 1) {
    // The prompt's keys hashed once per block size, not once per instance.
    std::map<int64_t, std::vector<uint64_t>> keys;
    for (size_t k = 0; k < loads.size(); ++k) {
      if (loads[k].role != InstanceRole::kPrefill) continue;
      const PrefixMemory& memory = prefixes_[live[k]];
      auto [it, fresh] = keys.try_emplace(memory.block_size());
      if (fresh) it->second = memory.lookup_keys(request.prompt);
      loads[k].prefix_tokens = memory.cached_tokens_of(it->second);
    }
  }
  const Route route = policy_->pick(loads, request);
  DUET_ASSERT(route.target < loads.size() && (!route.prefill || *route.prefill < loads.size()),
              "the policy picked an instance outside the {}", loads.size());
  const size_t target = live[route.target];
  std::optional<size_t> prefill;
  if (route.prefill) prefill = live[*route.prefill];
  const int64_t block_tokens = tokens_per_block(stats[target]);
  const auto prompt_tokens = static_cast<int64_t>(request.prompt.size());
  // The prompt and the first generated token.
  placement.instance = target;
  placement.pending_blocks = (prompt_tokens + 1 + block_tokens - 1) / block_tokens;
  placement.prefill = prefill;
  placement.prompt_tokens = prompt_tokens;
  placement.attempt = request.id;
  attempts_[request.id] = id;
  ++sequences_[target];
  pending_blocks_[target] += placement.pending_blocks;
  ++routed_[target];
  request.prefill_peer = -1;
  if (prefill) {
    queued_prompt_[*prefill] += prompt_tokens;
    ++routed_[*prefill];
    if (n_prefill > 1) prefixes_[*prefill].remember(request.prompt);
    request.prefill_peer = instances_[*prefill].peer;
    request.prefill_tp = instances_[*prefill].tp;
  }
  return Attempt{std::move(request), target, instances_[target].client};
}

void RoutedInstances::unbook(const Placement& placement) {
  attempts_.erase(placement.attempt);
  --sequences_[placement.instance];
  pending_blocks_[placement.instance] -= placement.pending_blocks;
  if (placement.prefill) queued_prompt_[*placement.prefill] -= placement.prompt_tokens;
}

void RoutedInstances::submit(InstanceRequest request) {
  const std::vector<InstanceStats> stats = all_stats();
  const RequestId id = request.id;
  std::optional<Attempt> attempt;
  {
    std::lock_guard lock(mutex_);
    DUET_ASSERT(!placements_.contains(id), "request {} submitted twice", id.value);
    Placement placement;
    placement.request = request;
    placement.arrival = next_arrival_++;
    // The first attempt goes by the request's own id.
    attempt = place(id, std::move(request), placement, stats);
    if (!attempt && rerun_wait_.count() > 0) {
      // It waits for an instance as a lost one's request does (tick()).
      placement.waits_until = std::chrono::steady_clock::now() + rerun_wait_;
      waiting_.emplace(placement.arrival, id);
      placements_.emplace(id, std::move(placement));
      spdlog::warn("request {}: no live instance can take it; it waits up to {} ms for one",
                   id.value, rerun_wait_.count());
      return;
    }
    if (!attempt) {
      throw Error(ErrorKind::kInvalidArgument,
                  "no live instance can take it: every instance it needs was lost");
    }
    placement.started = true;
    placements_.emplace(id, std::move(placement));
  }
  try {
    attempt->client->submit(std::move(attempt->request));
  } catch (...) {
    // Not placed after all: undo the bookkeeping, and let the caller refuse it.
    std::lock_guard lock(mutex_);
    const Placement& placement = placements_.at(id);
    unbook(placement);
    --routed_[placement.instance];
    if (placement.prefill) --routed_[*placement.prefill];
    placements_.erase(id);
    throw;
  }
}

void RoutedInstances::cancel(RequestId id) {
  InstanceClient* target = nullptr;
  RequestId attempt;
  EventHandler handler;
  InstanceEvent cancelled{.id = id, .finished = true, .finish = InstanceFinish::kCancelled};
  {
    std::lock_guard lock(mutex_);
    const auto it = placements_.find(id);
    if (it == placements_.end()) return;  // finished or unknown
    if (it->second.waits_until) {
      // No attempt runs: it ends here.
      cancelled.retries = it->second.retries;
      waiting_.erase(it->second.arrival);
      placements_.erase(it);
      handler = handler_;
    } else {
      target = instances_[it->second.instance].client;
      attempt = it->second.attempt;
    }
  }
  if (target != nullptr) {
    target->cancel(attempt);
  } else if (handler) {
    handler(std::span(&cancelled, 1));
  }
}

// Under mutex_: `id`'s attempt is over without its end (its instance lost,
// or a transfer that failed there): the request is booked again as a new
// attempt (into `reruns`), or ended (into `ended`) when it had in fact
// finished, is out of re-runs, or no live instance can take it. `avoid`: an
// instance not to use when another can take it.
void RoutedInstances::again(RequestId id, std::optional<size_t> avoid,
                            std::span<const InstanceStats> stats, std::vector<Attempt>& reruns,
                            std::vector<InstanceEvent>& ended) {
  Placement& placement = placements_.at(id);
  const InstanceRequest& original = placement.request;
  const auto n_delivered = static_cast<int64_t>(placement.delivered.size());
  // Ended already, though the end was lost with the instance?
  const bool ended_by_token =
      n_delivered > 0 && !original.ignore_eos &&
      std::find(info_.end_of_generation.begin(), info_.end_of_generation.end(),
                placement.delivered.back()) != info_.end_of_generation.end();
  if (ended_by_token || n_delivered >= original.max_tokens) {
    ended.push_back(
        {.id = id,
         .finished = true,
         .finish = ended_by_token ? InstanceFinish::kEndOfGeneration : InstanceFinish::kLength,
         .retries = placement.retries});
    placements_.erase(id);
    return;
  }
  std::optional<Attempt> attempt;
  if (placement.retries < max_retries_) attempt = rerun(id, placement, avoid, stats);
  if (!attempt && placement.retries < max_retries_ && rerun_wait_.count() > 0) {
    placement.waits_until = std::chrono::steady_clock::now() + rerun_wait_;
    waiting_.emplace(placement.arrival, id);
    spdlog::warn("request {}: no live instance can take it; it waits up to {} ms for one", id.value,
                 rerun_wait_.count());
    return;
  }
  if (!attempt) {
    ++failover_.failed_after_retries;
    ended.push_back({.id = id,
                     .finished = true,
                     .finish = InstanceFinish::kFailed,
                     .error = ServeError{ServeErrorKind::kUnavailable,
                                         placement.retries < max_retries_
                                             ? std::string("its instance was lost, and no live "
                                                           "instance can take it")
                                             : fmt::format("its instance was lost again after {} "
                                                           "re-run(s)",
                                                           placement.retries)},
                     .retries = placement.retries});
    placements_.erase(id);
    return;
  }
  ++placement.retries;
  ++failover_.reruns;
  reruns.push_back(std::move(*attempt));
}

std::optional<RoutedInstances::Attempt> RoutedInstances::rerun(
    RequestId id, Placement& placement, std::optional<size_t> avoid,
    std::span<const InstanceStats> stats) {
  const InstanceRequest& original = placement.request;
  const auto n_delivered = static_cast<int64_t>(placement.delivered.size());
  InstanceRequest request = original;
  request.id = RequestId{kRerunIdBase + next_attempt_++};
  request.prompt.insert(request.prompt.end(), placement.delivered.begin(),
                        placement.delivered.end());
  request.max_tokens = original.max_tokens - n_delivered;
  request.n_prompt = static_cast<int64_t>(original.prompt.size());
  // Away from `avoid` when another instance can take it.
  bool avoiding = false;
  for (size_t k = 0; avoid && !lost_[*avoid] && k < instances_.size(); ++k)
    avoiding =
        avoiding || (k != *avoid && !lost_[k] && instances_[k].role == instances_[*avoid].role);
  if (avoiding) lost_[*avoid] = true;
  std::optional<Attempt> attempt = place(id, std::move(request), placement, stats);
  if (avoiding) lost_[*avoid] = false;
  return attempt;
}

void RoutedInstances::set_rerun_wait(std::chrono::milliseconds wait) {
  std::lock_guard lock(mutex_);
  rerun_wait_ = wait;
}

void RoutedInstances::tick() {
  {
    std::lock_guard lock(mutex_);
    if (waiting_.empty()) return;
  }
  const std::vector<InstanceStats> stats = all_stats();
  std::vector<Attempt> reruns;
  std::vector<InstanceEvent> ended;
  EventHandler handler;
  {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      const RequestId id = it->second;
      Placement& placement = placements_.at(id);
      std::optional<Attempt> attempt = rerun(id, placement, std::nullopt, stats);
      if (attempt) {
        spdlog::info("request {}: an instance can take it now", id.value);
        placement.waits_until.reset();
        if (placement.started) {
          ++placement.retries;
          ++failover_.reruns;
        }
        placement.started = true;
        reruns.push_back(std::move(*attempt));
      } else if (now >= *placement.waits_until) {
        ++failover_.failed_after_retries;
        ended.push_back(
            {.id = id,
             .finished = true,
             .finish = InstanceFinish::kFailed,
             .error = ServeError{ServeErrorKind::kUnavailable,
                                 fmt::format("no live instance could take it within {} ms",
                                             rerun_wait_.count())},
             .retries = placement.retries});
        placements_.erase(id);
      } else {
        ++it;
        continue;
      }
      it = waiting_.erase(it);
    }
    handler = handler_;
  }
  submit_reruns(reruns, ended);
  if (handler && !ended.empty()) handler(ended);
}

// Outside mutex_: submits the re-runs; one refused ends its request (into `ended`).
void RoutedInstances::submit_reruns(std::vector<Attempt>& reruns,
                                    std::vector<InstanceEvent>& ended) {
  for (Attempt& attempt : reruns) {
    const RequestId attempt_id = attempt.request.id;
    try {
      attempt.client->submit(std::move(attempt.request));
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex_);
      const auto it = attempts_.find(attempt_id);
      if (it == attempts_.end()) continue;
      const RequestId id = it->second;
      Placement& placement = placements_.at(id);
      unbook(placement);
      if (rerun_wait_.count() > 0) {
        // Its instance went between the placement and the submit: it waits
        // for another, as when none could take it.
        placement.waits_until = std::chrono::steady_clock::now() + rerun_wait_;
        waiting_.emplace(placement.arrival, id);
        spdlog::warn(
            "request {}: the re-run was refused ({}); it waits up to {} ms for an "
            "instance",
            id.value, e.what(), rerun_wait_.count());
        continue;
      }
      ++failover_.failed_after_retries;
      ended.push_back({.id = id,
                       .finished = true,
                       .finish = InstanceFinish::kFailed,
                       .error = ServeError{ServeErrorKind::kUnavailable,
                                           fmt::format("its instance was lost, and the re-run "
                                                       "was refused: {}",
                                                       e.what())},
                       .retries = placement.retries});
      placements_.erase(id);
    }
  }
}

void RoutedInstances::on_events(size_t instance, std::span<const InstanceEvent> events) {
  EventHandler handler;
  std::vector<InstanceEvent> out;
  out.reserve(events.size());
  std::vector<RequestId> retry;
  std::vector<Attempt> reruns;
  // Stats outside the lock (for a re-run's placement), only when one may be needed.
  const bool may_rerun = std::any_of(events.begin(), events.end(), [](const InstanceEvent& e) {
    return e.finished && e.finish == InstanceFinish::kFailed && e.error &&
           e.error->kind == ServeErrorKind::kUnavailable;
  });
  const std::vector<InstanceStats> stats = may_rerun ? all_stats() : std::vector<InstanceStats>{};
  {
    std::lock_guard lock(mutex_);
    if (lost_[instance]) return;  // a lost instance's late events: its requests run elsewhere
    for (const InstanceEvent& event : events) {
      const auto attempt = attempts_.find(event.id);
      if (attempt == attempts_.end()) continue;  // an old attempt's, or unknown
      const RequestId id = attempt->second;
      Placement& placement = placements_.at(id);
      DUET_ASSERT(placement.instance == instance, "request {} sent to instance {}, events from {}",
                  id.value, placement.instance, instance);
      if (event.admitted || event.finished) {
        pending_blocks_[instance] -= placement.pending_blocks;
        placement.pending_blocks = 0;
      }
      if (event.token >= 0 || event.finished) handed_over(placement);
      if (event.token >= 0) placement.delivered.push_back(event.token);
      if (event.finished && event.finish == InstanceFinish::kFailed && event.error &&
          event.error->kind == ServeErrorKind::kUnavailable) {
        // The instance could not get the request's KV (a transfer that timed
        // out, a peer lost): the request goes again, elsewhere if it can.
        spdlog::warn("request {}: {}; re-running it", id.value, event.error->message);
        unbook(placement);
        retry.push_back(id);
        continue;
      }
      InstanceEvent translated = event;
      translated.id = id;
      if (event.finished) {
        translated.retries = placement.retries;
        --sequences_[instance];
        attempts_.erase(attempt);
        placements_.erase(id);
      }
      out.push_back(std::move(translated));
    }
    for (RequestId id : retry) again(id, instance, stats, reruns, out);
    finish_role_changes();
    handler = handler_;
  }
  submit_reruns(reruns, out);
  if (handler && !out.empty()) handler(out);
}

InstanceStats RoutedInstances::stats() const {
  std::vector<InstanceClient*> live;
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < instances_.size(); ++i) {
      if (!lost_[i]) live.push_back(instances_[i].client);
    }
  }
  InstanceStats sum;
  for (InstanceClient* client : live) {
    const InstanceStats s = client->stats();
    sum.running += s.running;
    sum.waiting += s.waiting;
    sum.kv_blocks_total += s.kv_blocks_total;
    sum.kv_blocks_free += s.kv_blocks_free;
    if (sum.kv_block_tokens == 0) sum.kv_block_tokens = s.kv_block_tokens;
    sum.steps += s.steps;
    sum.prompt_tokens += s.prompt_tokens;
    sum.prefix_hit_tokens += s.prefix_hit_tokens;
    sum.generated_tokens += s.generated_tokens;
    sum.preemptions += s.preemptions;
    sum.kv_blocks_quarantined += s.kv_blocks_quarantined;
    sum.send_bytes_abandoned += s.send_bytes_abandoned;
  }
  return sum;
}

std::vector<InstanceStats> RoutedInstances::instance_stats() const { return all_stats(); }

std::vector<int64_t> RoutedInstances::routed_counts() const {
  std::lock_guard lock(mutex_);
  return routed_;
}

}  // namespace duet
