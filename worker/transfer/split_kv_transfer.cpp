#include "worker/transfer/split_kv_transfer.h"

#include <functional>
#include <utility>
#include <vector>

namespace duet {

SplitKvTransfer::SplitKvTransfer(std::unique_ptr<KvTransferAdapter> job,
                                 std::unique_ptr<TcpKvTransfer> members, int world_size)
    : job_(std::move(job)), members_(std::move(members)), world_size_(world_size) {}

KvTransfer& SplitKvTransfer::route(int peer) const {
  return peer < world_size_ ? static_cast<KvTransfer&>(*job_) : *members_;
}

void SplitKvTransfer::remember(RequestId id, KvTransfer& transfer, const KvCache* cache) {
  std::lock_guard lock(mutex_);
  imports_[id] = {&transfer, cache};
}

void SplitKvTransfer::forget(RequestId id) {
  std::lock_guard lock(mutex_);
  imports_.erase(id);
}

namespace {

// `handler`, calling `forget` first (the import's last call); empty stays empty.
template <typename... Args>
std::function<void(RequestId, Args...)> forgetting(
    const std::function<void(RequestId)>& forget, std::function<void(RequestId, Args...)> handler) {
  if (!handler) return handler;
  return [forget, handler = std::move(handler)](RequestId id, Args... args) {
    forget(id);
    handler(id, std::forward<Args>(args)...);
  };
}

}  // namespace

void SplitKvTransfer::set_handlers(Handlers handlers) {
  const std::function<void(RequestId)> forget = [this](RequestId id) { this->forget(id); };
  handlers.on_complete = forgetting(forget, std::move(handlers.on_complete));
  handlers.on_failed = forgetting(forget, std::move(handlers.on_failed));
  handlers.on_released = forgetting(forget, std::move(handlers.on_released));
  handlers.on_quarantined = forgetting(forget, std::move(handlers.on_quarantined));
  job_->set_handlers(handlers);
  members_->set_handlers(std::move(handlers));
}

void SplitKvTransfer::start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) {
  KvTransfer& transfer = route(prefill_leader);
  remember(order.request.id, transfer, plan.cache);
  transfer.start_import(prefill_leader, order, std::move(plan));
}

void SplitKvTransfer::expect_import(ImportPlan plan) {
  // Every source of one import is a rank of one prefill instance.
  KvTransfer& transfer = route(plan.sources.empty() ? 0 : plan.sources.front().rank);
  remember(plan.id, transfer, plan.cache);
  transfer.expect_import(std::move(plan));
}

void SplitKvTransfer::abort_import(RequestId id) {
  KvTransfer* transfer = job_.get();
  {
    std::lock_guard lock(mutex_);
    if (const auto it = imports_.find(id); it != imports_.end()) transfer = it->second.transfer;
  }
  // An import already over is unknown to both: either answers on_released.
  transfer->abort_import(id);
}

void SplitKvTransfer::forget_imports(const KvCache& cache) {
  job_->forget_imports(cache);
  members_->forget_imports(cache);
  std::lock_guard lock(mutex_);  // no handler of theirs runs any more
  std::erase_if(imports_, [&](const auto& entry) { return entry.second.cache == &cache; });
}

void SplitKvTransfer::send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0,
                                int64_t n, const KvCache& cache,
                                std::span<const int32_t> block_table, int64_t head_offset,
                                const KvSource& heads) {
  route(decode_rank)
      .send_rows(decode_rank, id, layer, pos0, n, cache, block_table, head_offset, heads);
}

void SplitKvTransfer::send_handoff(int decode_peer, const KvHandoff& handoff) {
  route(decode_peer).send_handoff(decode_peer, handoff);
}

bool SplitKvTransfer::device_transfer(int peer) const { return route(peer).device_transfer(peer); }

void SplitKvTransfer::peers_lost(std::span<const Rank> ranks) {
  std::vector<Rank> job, members;
  for (Rank rank : ranks) (rank.value < world_size_ ? job : members).push_back(rank);
  if (!job.empty()) job_->peers_lost(job);
  if (!members.empty()) members_->peers_lost(members);
}

KvTransfer::Counters SplitKvTransfer::counters() const {
  Counters counters = job_->counters();
  counters += members_->counters();
  return counters;
}

}  // namespace duet
