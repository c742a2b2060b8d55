#include "worker/transfer/kv_transfer_adapter.h"

#include <utility>

namespace duet {

void KvTransferAdapter::start_import(int prefill_leader, const PrefillOrder& order,
                                     ImportPlan plan) {
  {
    std::lock_guard lock(commands_mutex_);
    starts_.push_back(Start{prefill_leader, order, std::move(plan)});
  }
  wake_thread();
}

void KvTransferAdapter::expect_import(ImportPlan plan) {
  {
    std::lock_guard lock(commands_mutex_);
    starts_.push_back(Start{-1, std::nullopt, std::move(plan)});
  }
  wake_thread();
}

void KvTransferAdapter::abort_import(RequestId id) {
  {
    std::lock_guard lock(commands_mutex_);
    aborts_.push_back(id);
  }
  wake_thread();
}

bool KvTransferAdapter::apply_commands(KvTransferProtocol& protocol, KvTransferActions& actions) {
  std::deque<Start> starts;
  std::deque<RequestId> aborts;
  {
    std::lock_guard lock(commands_mutex_);
    starts.swap(starts_);
    aborts.swap(aborts_);
  }
  for (Start& start : starts)
    protocol.start_import(start.leader, std::move(start.order), std::move(start.plan), actions);
  for (RequestId id : aborts) protocol.abort_import(id, KvTransfer::Clock::now(), actions);
  return !starts.empty() || !aborts.empty();
}

void KvTransferAdapter::drop_queued_starts(const KvCache& cache) {
  std::lock_guard lock(commands_mutex_);
  std::erase_if(starts_, [&](const Start& start) { return start.plan.cache == &cache; });
}

void KvTransferAdapter::set_handlers(Handlers handlers) {
  std::lock_guard lock(handlers_mutex_);
  handlers_ = std::move(handlers);
}

KvTransferAdapter::Counters KvTransferAdapter::counters() const {
  std::lock_guard lock(counters_mutex_);
  return counters_;
}

void KvTransferAdapter::count_sent(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  ++counters_.messages_sent;
  counters_.bytes_sent += bytes;
}

void KvTransferAdapter::count_received(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  ++counters_.messages_received;
  counters_.bytes_received += bytes;
}

void KvTransferAdapter::count_device_sent(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  counters_.device_bytes_sent += bytes;
}

void KvTransferAdapter::count_device_received(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  counters_.device_bytes_received += bytes;
}

void KvTransferAdapter::count_cma_sent(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  counters_.cma_bytes_sent += bytes;
}

void KvTransferAdapter::count_cma_received(int64_t bytes) {
  std::lock_guard lock(counters_mutex_);
  counters_.cma_bytes_received += bytes;
}

void KvTransferAdapter::set_rows_dropped(int64_t rows_dropped) {
  std::lock_guard lock(counters_mutex_);
  counters_.rows_dropped = rows_dropped;
}

void KvTransferAdapter::deliver(std::vector<KvTransferCall>& calls) {
  if (calls.empty()) return;
  {
    std::lock_guard lock(counters_mutex_);
    for (const KvTransferCall& call : calls) {
      if (call.kind == KvTransferCall::Kind::kComplete) ++counters_.imports_completed;
      if (call.kind == KvTransferCall::Kind::kFailed) ++counters_.imports_failed;
      if (call.kind == KvTransferCall::Kind::kQuarantined) ++counters_.imports_quarantined;
    }
  }
  std::lock_guard lock(handlers_mutex_);
  for (KvTransferCall& call : calls) {
    switch (call.kind) {
      case KvTransferCall::Kind::kOrder:
        if (handlers_.on_order) handlers_.on_order(call.peer, std::move(call.order));
        break;
      case KvTransferCall::Kind::kCancel:
        if (handlers_.on_cancel) handlers_.on_cancel(call.peer, call.id);
        break;
      case KvTransferCall::Kind::kComplete:
        if (handlers_.on_complete) handlers_.on_complete(call.id, call.handoff);
        break;
      case KvTransferCall::Kind::kFailed:
        if (handlers_.on_failed) handlers_.on_failed(call.id, call.error);
        break;
      case KvTransferCall::Kind::kReleased:
        if (handlers_.on_released) handlers_.on_released(call.id);
        break;
      case KvTransferCall::Kind::kQuarantined:
        if (handlers_.on_quarantined) handlers_.on_quarantined(call.id);
        break;
    }
  }
  calls.clear();
}

}  // namespace duet
