#include "coordinator/cluster/liveness.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace duet {
std::chrono::milliseconds Liveness::grace_for(std::chrono::milliseconds lease) {
  return std::min(lease / 2, std::chrono::milliseconds(1000));
}

Liveness::Liveness(const ClusterSpec& spec, std::chrono::milliseconds lease, Clock::time_point now)
    : lease_(lease), grace_(grace_for(lease)) {
  for (const InstanceSpec& instance : spec.instances) add_instance(instance, now);
}

void Liveness::add_instance(const InstanceSpec& instance, Clock::time_point now) {
  Watched watched;
  watched.instance_id = instance.id;
  watched.ranks = instance.ranks;
  watched.last_heard.assign(instance.ranks.size(), now);
  watched.step_moved_at = now;
  for (size_t i = 0; i < instance.ranks.size(); ++i) {
    DUET_ASSERT(!where_.contains(instance.ranks[i]), "rank {} watched twice",
                instance.ranks[i].value);
    where_[instance.ranks[i]] = {instances_.size(), i};
  }
  instances_.push_back(std::move(watched));
}

void Liveness::retire(int32_t instance_id) {
  for (Watched& watched : instances_) {
    if (watched.instance_id == instance_id && !watched.lost) {
      watched.retired = true;
      watched.suspect = false;
    }
  }
}

Liveness::Watched* Liveness::find(Rank rank, size_t* position) {
  const auto it = where_.find(rank);
  if (it == where_.end()) return nullptr;
  *position = it->second.second;
  return &instances_[it->second.first];
}

void Liveness::heard_from(Rank rank, Clock::time_point arrived) {
  size_t position = 0;
  Watched* watched = find(rank, &position);
  if (watched == nullptr || watched->lost) return;
  watched->last_heard[position] = std::max(watched->last_heard[position], arrived);
}

void Liveness::on_heartbeat(const Heartbeat& beat, Clock::time_point arrived) {
  size_t position = 0;
  Watched* watched = find(beat.rank, &position);
  if (watched == nullptr || watched->lost) return;
  watched->last_heard[position] = std::max(watched->last_heard[position], arrived);
  if (position != 0) return;  // a follower's beat says only that it lives
  if (beat.step != watched->step || (beat.busy && !watched->busy)) {
    watched->step_moved_at = std::max(watched->step_moved_at, arrived);
  }
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

void Liveness::coordinator_paused(Clock::time_point from, Clock::time_point to) {
  if (to <= from) return;
  if (!pauses_.empty() && from < pauses_.back().to) from = pauses_.back().to;  // no overlaps
  if (to > from) pauses_.push_back({from, to});
}

std::chrono::milliseconds Liveness::silence(Clock::time_point since, Clock::time_point now) const {
  Clock::duration paused{};
  for (const Pause& pause : pauses_) {
    const auto from = std::max(pause.from, since);
    const auto to = std::min(pause.to, now);
    if (to > from) paused += to - from;
  }
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - since - paused);
}

std::pair<std::chrono::milliseconds, std::string> Liveness::worst_silence(
    const Watched& watched, Clock::time_point now) const {
  std::pair<std::chrono::milliseconds, std::string> worst{};
  for (size_t i = 0; i < watched.ranks.size(); ++i) {
    const auto silent = silence(watched.last_heard[i], now);
    if (silent > lease_ && silent > worst.first) {
      worst = {silent,
               fmt::format("rank {} silent for {} ms", watched.ranks[i].value, silent.count())};
    }
  }
  if (watched.busy) {
    const auto stalled = silence(watched.step_moved_at, now);
    if (stalled > lease_ && stalled > worst.first) {
      worst = {stalled, fmt::format("stalled: no progress inside an engine step for {} ms",
                                    stalled.count())};
    }
  }
  return worst;
}

std::vector<InstanceLoss> Liveness::check(Clock::time_point now) {
  std::vector<InstanceLoss> losses;
  for (Watched& watched : instances_) {
    if (watched.lost || watched.retired) continue;
    std::string reason = watched.connection_lost;
    if (reason.empty()) {
      const auto [silent, what] = worst_silence(watched, now);
      if (silent > lease_ + grace_) {
        reason =
            fmt::format("{} (lease {} ms + grace {} ms)", what, lease_.count(), grace_.count());
      } else if (!what.empty()) {
        if (!watched.suspect) {
          ++n_suspected_;
          notices_.push_back(fmt::format("instance {} is suspect: {} (lease {} ms)",
                                         watched.instance_id, what, lease_.count()));
        }
        watched.suspect = true;
        watched.suspicion = what;
        watched.worst = std::max(watched.worst, silent);
        continue;
      } else {
        if (watched.suspect) {
          ++n_cleared_;
          notices_.push_back(fmt::format(
              "instance {} is no longer suspect: heard again after up to {} ms (lease {} ms)",
              watched.instance_id, watched.worst.count(), lease_.count()));
        }
        watched.suspect = false;
        watched.suspicion.clear();
        watched.worst = {};
        continue;
      }
    }
    watched.lost = true;
    watched.suspect = false;
    watched.lost_epoch = ++epoch_;
    watched.reason = reason;
    losses.push_back({watched.instance_id, watched.ranks, watched.lost_epoch, reason});
  }
  // A pause older than any silence that can still count changes nothing.
  const auto horizon = now - 4 * (lease_ + grace_);
  while (!pauses_.empty() && pauses_.front().to < horizon) pauses_.pop_front();
  return losses;
}

std::vector<std::string> Liveness::take_notices() {
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
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
    out.push_back({watched.instance_id, watched.lost, watched.suspect, watched.lost_epoch,
                   watched.step, watched.lost ? watched.reason : watched.suspicion});
  }
  return out;
}

}  // namespace duet
