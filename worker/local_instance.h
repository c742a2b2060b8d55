// An instance in this process: an InstanceCore (worker/instance_core.h) on
// its own engine thread.
//
// The coordinator's fronts and the KV transfer's handlers reach it only
// through one command queue; the engine thread drains it between steps, runs
// a step, and hands the step's events to the event handler in one batch.
// Events the commands produce (a refusal, an imported prompt's first token)
// go out in a batch of their own before the step, so they do not wait for
// it. With nothing queued and nothing running, the thread sleeps.
//
// Thread affinity: submit, cancel, stats and info from any thread; the core
// belongs to the engine thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <variant>
#include <vector>

#include "common/serving.h"
#include "worker/instance_core.h"
#include "worker/tensor_parallel.h"
#include "worker/transfer/kv_transfer.h"

namespace duet {

// What a heartbeat says of an engine: its progress counter (steps, and
// layers of long steps: Engine::progress), and whether it is inside a step
// now (worker/rank_liveness.h).
struct EngineProgress {
  int64_t steps = 0;
  bool busy = false;
};

// How an instance takes part in disaggregated serving.
struct PeerLinks {
  KvTransfer* transfer = nullptr;  // outlives the instance; none: no peers
  // The longest a decode instance waits for a prompt's KV, from the moment
  // its blocks are reserved (the prefill side's queue included).
  std::chrono::milliseconds transfer_timeout{120'000};
  // This instance's ranks, leader first, and every instance's by its leader
  // (tensor parallelism: KV moves between the ranks that hold its heads).
  // Empty / absent: one rank each.
  std::vector<int32_t> own_ranks;
  std::map<int, std::vector<int32_t>> instance_ranks;
};

class LocalInstance final : public InstanceClient {
 public:
  // `model`, `kernels` and `pool` outlive the instance. The thread starts at
  // once; events go nowhere until set_event_handler. With a transfer in
  // `peers`, installs its handlers (removed by the destructor).
  // `tp`: this instance's followers when the model is a shard (outlives the instance).
  LocalInstance(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
                EngineConfig config, std::string model_name, PeerLinks peers = {},
                TpLeader* tp = nullptr);
  // Stops the engine thread; requests still running are dropped without events.
  ~LocalInstance() override;
  LocalInstance(const LocalInstance&) = delete;
  LocalInstance& operator=(const LocalInstance&) = delete;

  // Receives the stats right after every engine step (also a step that
  // produced no event), on the engine thread, before that step's events go
  // to the event handler: a remote coordinator that forwards both in this
  // order already has the new stats when a request's finish reaches a client.
  using StepObserver = std::function<void(const InstanceStats&)>;

  const InstanceInfo& info() const override { return info_; }
  void set_event_handler(EventHandler handler) override;
  // Set once, before the first submit, like the event handler.
  void set_step_observer(StepObserver observer);
  void submit(InstanceRequest request) override;
  void cancel(RequestId id) override;
  InstanceStats stats() const override;
  // Any thread.
  EngineProgress progress() const { return {core_.engine().progress(), in_step_.load()}; }

 private:
  // The core's peers through a KvTransfer.
  class TransferPeers;

  void post(InstanceCommand command);  // any thread
  void run();                          // the engine thread
  InstanceStats publish_stats();
  // Stats to the observer, then the pending events to the handler.
  void publish();

  InstanceInfo info_;
  KvTransfer* const transfer_;
  std::unique_ptr<TransferPeers> transfer_peers_;
  InstanceCore core_;  // engine thread only (after construction)

  mutable std::mutex mutex_;  // guards the members below
  std::condition_variable wake_;
  std::deque<InstanceCommand> commands_;
  bool stopping_ = false;
  InstanceStats stats_;
  std::atomic<bool> in_step_{false};  // written by the engine thread

  // Held by the engine thread while it calls the observer and the handler,
  // and by their setters: once a setter returns, the old callback is not
  // running and will not run again (its owner may be destroyed).
  std::mutex callback_mutex_;
  EventHandler handler_;   // guarded by callback_mutex_
  StepObserver observer_;  // guarded by callback_mutex_

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
