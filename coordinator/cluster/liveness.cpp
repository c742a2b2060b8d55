#include "coordinator/cluster/liveness.h"

#include <fmt/format.h>

#include <algorithm>

namespace duet {
namespace {

int64_t ms(Liveness::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

}  // namespace

Liveness::Liveness(const ClusterSpec& spec, std::chrono::milliseconds lease, Clock::time_point now)
    : lease_(lease) {
  for (const InstanceSpec& instance : spec.instances) {
    Watched watched;
    watched.instance_id = instance.id;
    watched.ranks = instance.ranks;
    watched.last_heard.assign(instance.ranks.size(), now);
    watched.step_moved_at = now;
    for (size_t i = 0; i < instance.ranks.size(); ++i)
      where_[instance.ranks[i]] = {instances_.size(), i};
    instances_.push_back(std::move(watched));
  }
}

Liveness::Watched* Liveness::find(Rank rank, size_t* position) {
  const auto it = where_.find(rank);
  if (it == where_.end()) return nullptr;
  *position = it->second.second;
  return &instances_[it->second.first];
}

void Liveness::heard_from(Rank rank, Clock::time_point now) {
  size_t position = 0;
  Watched* watched = find(rank, &position);
  if (watched == nullptr || watched->lost) return;
  watched->last_heard[position] = std::max(watched->last_heard[position], now);
}

void Liveness::on_heartbeat(const Heartbeat& beat, Clock::time_point now) {
  size_t position = 0;
  Watched* watched = find(beat.rank, &position);
  if (watched == nullptr || watched->lost) return;
  watched->last_heard[position] = std::max(watched->last_heard[position], now);
  if (position != 0) return;  // a follower's beat says only that it lives
  if (beat.step != watched->step || (beat.busy && !watched->busy)) watched->step_moved_at = now;
  watched->step = beat.step;
  watched->busy = beat.busy;
}

void Liveness::connection_lost(Rank rank, const std::string& why) {
  size_t position = 0;
  Watched* watched = find(rank, &position);
  if (watched == nullptr || watched->lost || !watched->connection_lost.empty()) return;
  watched->connection_lost =
      fmt::format("rank {}'s control connection ended ({})", rank.value, why);
}

std::vector<InstanceLoss> Liveness::check(Clock::time_point now) {
  std::vector<InstanceLoss> losses;
  for (Watched& watched : instances_) {
    if (watched.lost) continue;
    std::string reason = watched.connection_lost;
    for (size_t i = 0; i < watched.ranks.size() && reason.empty(); ++i) {
      const auto silent = now - watched.last_heard[i];
      if (silent > lease_) {
        reason = fmt::format("rank {} silent for {} ms (lease {} ms)", watched.ranks[i].value,
                             ms(silent), lease_.count());
      }
    }
    if (reason.empty() && watched.busy && now - watched.step_moved_at > lease_) {
      reason = fmt::format("stalled: no progress inside an engine step for {} ms (lease {} ms)",
                           ms(now - watched.step_moved_at), lease_.count());
    }
    if (reason.empty()) continue;
    watched.lost = true;
    watched.lost_epoch = ++epoch_;
    watched.reason = reason;
    losses.push_back({watched.instance_id, watched.ranks, watched.lost_epoch, reason});
  }
  return losses;
}

bool Liveness::lost(int32_t instance_id) const {
  for (const Watched& watched : instances_) {
    if (watched.instance_id == instance_id) return watched.lost;
  }
  return false;
}

bool Liveness::rank_lost(Rank rank) const {
  const auto it = where_.find(rank);
  return it != where_.end() && instances_[it->second.first].lost;
}

std::vector<Rank> Liveness::lost_ranks() const {
  std::vector<Rank> ranks;
  for (const Watched& watched : instances_) {
    if (watched.lost) ranks.insert(ranks.end(), watched.ranks.begin(), watched.ranks.end());
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

int Liveness::n_lost() const {
  return static_cast<int>(std::count_if(instances_.begin(), instances_.end(),
                                        [](const Watched& watched) { return watched.lost; }));
}

std::vector<Liveness::InstanceView> Liveness::view() const {
  std::vector<InstanceView> out;
  for (const Watched& watched : instances_) {
    out.push_back(
        {watched.instance_id, watched.lost, watched.lost_epoch, watched.step, watched.reason});
  }
  return out;
}

}  // namespace duet
