#include "worker/rank_liveness.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/format.h"

namespace duet {

RankLiveness::RankLiveness(ControlChannel& channel, KvTransfer* transfer, MpiRuntime* mpi,
                           const InstanceSpec& instance, std::chrono::milliseconds interval,
                           LostHandler on_lost)
    : channel_(channel),
      transfer_(transfer),
      mpi_(mpi),
      instance_(instance),
      rank_(channel.rank()),
      interval_(interval),
      on_lost_(std::move(on_lost)) {
  channel_.set_intercept([this](const ReceivedMessage& message) { return apply(message); });
  channel_.set_link_lost_handler([this](Rank rank, const std::string& why) {
    if (rank == kCoordinatorRank) leave_unheard(why);
  });
  thread_ = std::thread([this] { beat_until_stopped(); });
}

RankLiveness::~RankLiveness() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  channel_.set_intercept({});
  channel_.set_link_lost_handler({});
}

void RankLiveness::watch(std::function<EngineProgress()> progress) {
  std::lock_guard lock(mutex_);
  progress_ = std::move(progress);
}

void RankLiveness::also_tell(PeersLost peers_lost) {
  std::lock_guard lock(mutex_);
  also_tell_ = std::move(peers_lost);
}

void RankLiveness::beat_until_stopped() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    Heartbeat beat{instance_.id, rank_, epoch_.load(), -1, false};
    if (progress_) {
      const EngineProgress progress = progress_();
      beat.step = progress.steps;
      beat.busy = progress.busy;
    }
    lock.unlock();
    try {
      channel_.send(kCoordinatorRank, beat);
    } catch (const Error&) {
      // The channel is closing: the cluster is ending, nobody counts beats.
      lock.lock();
      return;
    }
    lock.lock();
    wake_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

void RankLiveness::leave_unheard(const std::string& why) {
  // The coordinator closed this rank's connection (it counted this rank
  // lost, and its RanksLost did not get through) or is gone: nothing this
  // rank sends can be heard any more.
  if (mpi_ != nullptr) mpi_->leave_without_finalize();
  lost(format("its control connection to the coordinator ended ({})", why));
}

void RankLiveness::lost(const std::string& why) {
  if (lost_.exchange(true)) return;
  if (on_lost_) {
    spdlog::warn("instance {} (rank {}): {}", instance_.id, rank_.value, why);
    on_lost_(why);
    return;
  }
  spdlog::warn("instance {} (rank {}): {}; leaving", instance_.id, rank_.value, why);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  std::_Exit(0);
}

bool RankLiveness::apply(const ReceivedMessage& message) {
  const auto* lost = std::get_if<RanksLost>(&message.message);
  if (lost == nullptr || message.source != kCoordinatorRank) return false;
  // A rank of the MPI job lost: MPI_Finalize could wait on it forever. (A
  // joined member lost is none of MPI's business.)
  const bool world_rank_lost = std::any_of(lost->ranks.begin(), lost->ranks.end(),
                                           [&](Rank r) { return r.value < channel_.world_size(); });
  if (mpi_ != nullptr && world_rank_lost) mpi_->leave_without_finalize();
  const auto ours = std::find_if(lost->ranks.begin(), lost->ranks.end(), [&](Rank rank) {
    return std::find(instance_.ranks.begin(), instance_.ranks.end(), rank) != instance_.ranks.end();
  });
  if (ours != lost->ranks.end()) {
    // This instance is lost (this rank stalled, or another of its ranks is
    // gone): what it holds is the coordinator's to re-run elsewhere.
    this->lost(format("lost at epoch {} ({})", lost->epoch, lost->reason));
    return true;
  }
  std::string names;
  for (Rank rank : lost->ranks) names += (names.empty() ? "" : ", ") + std::to_string(rank.value);
  spdlog::warn("instance {} (rank {}): rank(s) {} lost at epoch {} ({}); no longer waiting on them",
               instance_.id, rank_.value, names, lost->epoch, lost->reason);
  channel_.forget(lost->ranks);
  {
    // Under the lock: once also_tell({}) returns, the hook is not running.
    std::lock_guard lock(mutex_);
    if (also_tell_) also_tell_(lost->ranks);
  }
  if (transfer_ != nullptr) transfer_->peers_lost(lost->ranks);
  epoch_ = std::max(epoch_.load(), lost->epoch);
  return true;
}

void LossLatch::lost(const std::string& why) {
  std::lock_guard lock(mutex_);
  lost_ = true;
  if (server_ != nullptr) server_->stop(format("lost: {}", why));
}

void LossLatch::serving(InstanceServer* server) {
  std::lock_guard lock(mutex_);
  server_ = server;
  if (server_ != nullptr && lost_) server_->stop("lost before it served");
}

bool LossLatch::is_lost() const {
  std::lock_guard lock(mutex_);
  return lost_;
}

}  // namespace duet
