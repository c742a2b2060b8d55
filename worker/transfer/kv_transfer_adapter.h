// What every adapter of KvTransferProtocol shares (MpiKvTransfer over MPI,
// TcpKvTransfer over its own sockets): the instance's commands (imports to
// start, expect or abort), queued for the adapter's communication thread;
// the handlers and the handler calls the protocol's actions name, delivered
// outside the adapter's locks; the counters; and the coordinator's word that
// ranks are lost.
//
// Threads: the commands, set_handlers, counters and peers_lost from any
// thread; apply_commands and deliver from the adapter's communication
// thread, deliver with no lock of the adapter held.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "worker/transfer/kv_transfer.h"
#include "worker/transfer/kv_transfer_protocol.h"

namespace duet {

class KvTransferAdapter : public KvTransfer {
 public:
  // Queued, then the communication thread is woken (wake_thread).
  void start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) final;
  void expect_import(ImportPlan plan) final;
  void abort_import(RequestId id) final;
  void set_handlers(Handlers handlers) final;
  Counters counters() const final;

 protected:
  // Wakes the communication thread, which then calls apply_commands.
  virtual void wake_thread() = 0;
  // Feeds the queued commands to `protocol`, in order: starts, then aborts.
  // Whether there were any.
  bool apply_commands(KvTransferProtocol& protocol, KvTransferActions& actions);
  // Drops the queued starts of imports into `cache` (forget_imports).
  void drop_queued_starts(const KvCache& cache);

  void count_sent(int64_t bytes);
  void count_received(int64_t bytes);
  void count_device_sent(int64_t bytes);
  void count_device_received(int64_t bytes);
  void count_cma_sent(int64_t bytes);
  void count_cma_received(int64_t bytes);
  void set_rows_dropped(int64_t rows_dropped);
  // Counts the calls and runs their handlers, in order; clears `calls`.
  void deliver(std::vector<KvTransferCall>& calls);

 private:
  struct Start {
    int leader = -1;
    std::optional<PrefillOrder> order;  // a leader's import
    ImportPlan plan;
  };
  std::mutex commands_mutex_;
  std::deque<Start> starts_;      // guarded by commands_mutex_
  std::deque<RequestId> aborts_;  // guarded by commands_mutex_

  // Held while a handler runs and by set_handlers: once that returns, the old
  // handlers are not running and will not run again.
  std::mutex handlers_mutex_;
  Handlers handlers_;  // guarded by handlers_mutex_

  mutable std::mutex counters_mutex_;
  Counters counters_;  // guarded by counters_mutex_
};

}  // namespace duet
