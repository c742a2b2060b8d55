// RoutedInstances' membership (router.h): instances that join, drain, leave,
// are lost, or change role while the cluster serves, and the health that
// reports them. Placement and events are in router.cpp.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "coordinator/router.h"

namespace duet {

size_t RoutedInstances::add_instance(RoutedInstance instance, std::string host) {
  std::lock_guard lock(mutex_);
  const size_t index = instances_.size();
  // The same model, and a capacity that every request placed since fits.
  const int64_t capacity = info_.kv_capacity_tokens;
  check_same_model(index, instance.client->info());
  DUET_REQUIRE(info_.kv_capacity_tokens == capacity,
               "instance {} holds {} tokens per sequence, fewer than the cluster's {}; start it "
               "with at least as much KV cache",
               index, instance.client->info().kv_capacity_tokens, capacity);
  instances_.push_back(instance);
  book_new_instance();
  membership_.back() = {true, false, false, std::move(host)};
  ++joins_;
  return index;
}

void RoutedInstances::drain_instance(size_t instance) {
  std::lock_guard lock(mutex_);
  DUET_ASSERT(instance < instances_.size(), "instance {} of {}", instance, instances_.size());
  membership_[instance].draining = true;
}

void RoutedInstances::remove_instance(size_t instance,
                                      std::vector<std::pair<InstanceClient*, RequestId>>& withdrawn,
                                      std::vector<Attempt>& reruns,
                                      std::vector<InstanceEvent>& ended,
                                      std::span<const InstanceStats> stats) {
  lost_[instance] = true;
  switching_to_[instance].reset();
  sequences_[instance] = 0;  // its counters start again (it gets no work)
  pending_blocks_[instance] = 0;
  queued_prompt_[instance] = 0;
  // Its requests, and those whose prompt it was computing, by arrival.
  std::vector<std::pair<uint64_t, RequestId>> hit;
  for (const auto& [id, placement] : placements_) {
    if (placement.waits_until) continue;  // no attempt of it runs anywhere
    if (placement.instance == instance || placement.prefill == instance)
      hit.emplace_back(placement.arrival, id);
  }
  std::sort(hit.begin(), hit.end());
  for (const auto& [arrival, id] : hit) {
    Placement& placement = placements_.at(id);
    if (placement.instance != instance)
      withdrawn.emplace_back(instances_[placement.instance].client, placement.attempt);
    unbook(placement);
    again(id, std::nullopt, stats, reruns, ended);
  }
}

void RoutedInstances::instance_lost(size_t instance, uint64_t epoch, std::string reason) {
  take_out(instance, [&] { lost_why_[instance] = {epoch, std::move(reason)}; });
}

void RoutedInstances::instance_left(size_t instance, std::string reason) {
  take_out(instance, [&] {
    lost_why_[instance] = {0, std::move(reason)};
    membership_[instance].draining = false;
    membership_[instance].left = true;
    ++leaves_;
  });
}

void RoutedInstances::take_out(size_t instance, const std::function<void()>& record) {
  const std::vector<InstanceStats> stats = all_stats();
  std::vector<std::pair<InstanceClient*, RequestId>> withdrawn;  // old attempts elsewhere
  std::vector<Attempt> reruns;
  std::vector<InstanceEvent> ended;
  EventHandler handler;
  {
    std::lock_guard lock(mutex_);
    DUET_ASSERT(instance < instances_.size(), "instance {} of {}", instance, instances_.size());
    if (lost_[instance]) return;
    record();
    remove_instance(instance, withdrawn, reruns, ended, stats);
    handler = handler_;
  }
  for (const auto& [client, attempt] : withdrawn) client->cancel(attempt);
  submit_reruns(reruns, ended);
  if (handler && !ended.empty()) handler(ended);
}

bool RoutedInstances::lost(size_t instance) const {
  std::lock_guard lock(mutex_);
  return lost_[instance];
}

RoutedInstances::FailoverCounters RoutedInstances::failover_counters() const {
  std::lock_guard lock(mutex_);
  return failover_;
}

InstanceClient::Health RoutedInstances::health() const {
  std::lock_guard lock(mutex_);
  Health health;
  health.n_instances = static_cast<int>(instances_.size());
  bool target = false;  // an instance that can take a request (decode or colocated)
  for (size_t i = 0; i < instances_.size(); ++i) {
    const Membership& member = membership_[i];
    health.instances.push_back(
        {std::string(instance_role_name(instances_[i].role)), instances_[i].peer,
         lost_[i] && !member.left, lost_why_[i].first, lost_why_[i].second, member.joined,
         member.draining, member.left, member.host,
         switching_to_[i] ? std::string(instance_role_name(*switching_to_[i])) : std::string()});
    if (lost_[i]) {
      if (!member.left) ++health.n_lost;
      continue;
    }
    target = target || instances_[i].role != InstanceRole::kPrefill;
  }
  health.serving = target;
  health.reruns = failover_.reruns;
  health.failed_after_retries = failover_.failed_after_retries;
  health.joins = joins_;
  health.leaves = leaves_;
  health.role_changes = role_changes_;
  health.n_started = static_cast<int>(n_started_);
  health.n_live = 0;
  for (size_t i = 0; i < instances_.size(); ++i)
    health.n_live += !lost_[i] && !membership_[i].draining ? 1 : 0;
  return health;
}

std::string RoutedInstances::change_role(int64_t instance, InstanceRole role) {
  std::lock_guard lock(mutex_);
  const auto n = static_cast<int64_t>(instances_.size());
  auto refuse = [&](const std::string& why) -> std::string {
    throw Error(ErrorKind::kInvalidArgument, fmt::format("instance {} cannot become {}: {}",
                                                         instance, instance_role_name(role), why));
  };
  if (instance < 0 || instance >= n)
    return refuse(fmt::format("the cluster has instances 0 to {}", n - 1));
  const auto i = static_cast<size_t>(instance);
  if (membership_[i].left) return refuse("it has left");
  if (lost_[i]) return refuse("it was lost");
  if (membership_[i].draining) return refuse("it is leaving");
  const InstanceRole from = instances_[i].role;
  if (role != InstanceRole::kBoth && !instances_[i].kv_links) {
    return refuse(
        "it has no KV links to the other instances (a colocated cluster's, or one that joined), "
        "so it can only be colocated (both)");
  }
  // Some live instance must still take whole requests once every change in
  // progress is done.
  bool target = false;
  for (size_t k = 0; k < instances_.size(); ++k) {
    if (lost_[k] || membership_[k].draining) continue;
    const InstanceRole then = k == i ? role : switching_to_[k].value_or(instances_[k].role);
    target = target || then != InstanceRole::kPrefill;
  }
  if (!target) {
    return refuse(
        "no live instance would be left to decode; make another one decode or both first");
  }
  if (role == from) {
    if (!switching_to_[i])
      return fmt::format("instance {} is {} already", i, instance_role_name(role));
    spdlog::info("instance {}: stays {} (the change to {} is called off)", i,
                 instance_role_name(role), instance_role_name(*switching_to_[i]));
    switching_to_[i].reset();
    return fmt::format("instance {} stays {}", i, instance_role_name(role));
  }
  switching_to_[i] = role;
  finish_role_changes();
  if (!switching_to_[i]) {
    return fmt::format("instance {} is now {} (was {})", i, instance_role_name(role),
                       instance_role_name(from));
  }
  const int64_t running = sequences_[i];
  const int64_t queued = queued_prompt_[i];
  spdlog::info(
      "instance {}: {} -> {} once its {} request(s) and {} queued prompt token(s) are "
      "done",
      i, instance_role_name(from), instance_role_name(role), running, queued);
  return fmt::format(
      "instance {} becomes {} (from {}) once its {} request(s) and {} queued prompt token(s) "
      "are done; it takes no new work meanwhile",
      i, instance_role_name(role), instance_role_name(from), running, queued);
}

void RoutedInstances::finish_role_changes() {
  for (size_t i = 0; i < instances_.size(); ++i) {
    if (!switching_to_[i] || lost_[i]) continue;
    if (sequences_[i] != 0 || queued_prompt_[i] != 0 || pending_blocks_[i] != 0) continue;
    const InstanceRole from = instances_[i].role;
    instances_[i].role = *switching_to_[i];
    switching_to_[i].reset();
    // What it cached as a prefill instance before is only a guess now.
    prefixes_[i].forget_all();
    ++role_changes_;
    spdlog::info("instance {}: now {} (was {})", i, instance_role_name(instances_[i].role),
                 instance_role_name(from));
  }
}

std::vector<RoutedInstances::RoleView> RoutedInstances::role_views() const {
  std::lock_guard lock(mutex_);
  std::vector<RoleView> views;
  for (size_t i = 0; i < instances_.size(); ++i) {
    views.push_back({instances_[i].role, !lost_[i] && !membership_[i].draining && !switching_to_[i],
                     switching_to_[i].has_value(), instances_[i].kv_links, sequences_[i],
                     queued_prompt_[i]});
  }
  return views;
}

InstanceRole RoutedInstances::role(size_t instance) const {
  std::lock_guard lock(mutex_);
  DUET_ASSERT(instance < instances_.size(), "instance {} of {}", instance, instances_.size());
  return instances_[instance].role;
}

}  // namespace duet
