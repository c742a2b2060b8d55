// An instance in this process: the batching engine on its own thread.
//
// The coordinator's fronts reach the engine only through this class's one
// command queue (submit, cancel); the engine thread drains it between steps,
// runs a step, and hands the step's events to the event handler in one batch.
// Events that the commands themselves produce (a refusal, an imported
// prompt's first token) go out in a batch of their own before the step, so
// they do not wait for it. With nothing queued and nothing running, the thread sleeps on a
// condition variable (no CPU while idle).
//
// In a disaggregated cluster the instance also speaks to its peers through a
// KvTransfer (worker/transfer/kv_transfer.h). A decode instance imports the prompt
// of every request that names a prefill peer (it reserves the blocks, the
// transfer fetches the rows) and reports all of the request's events,
// admission included, so the coordinator follows one instance per request.
// A prefill instance takes PrefillOrders from its decode peers and exports
// the prompts' KV; it reports no events of its own. The transfer's handlers
// only queue commands: every engine call stays on the engine thread.
//
// With tensor parallelism this is the leader's side: a TpLeader mirrors
// every step and import on the followers (worker/tensor_parallel.h).
//
// Thread affinity: submit, cancel, stats and info from any thread; the engine,
// the id maps and the per-step event buffer belong to the engine thread.
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
#include "worker/engine.h"
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

// A request's engine options (its prompt aside), as every instance submits it.
RequestOptions request_options(const InstanceRequest& request);
// How an engine's finish reads to the coordinator.
InstanceFinish instance_finish(FinishReason reason);

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
  EngineProgress progress() const { return {engine_.progress(), in_step_.load()}; }

 private:
  // From the transfer (the peers' side of a transfer).
  struct Order {
    int peer = 0;
    PrefillOrder order;
  };
  struct Withdrawn {
    RequestId id;
  };
  struct Imported {
    RequestId id;
    KvHandoff handoff;
  };
  struct ImportFailed {
    RequestId id;
    ServeError error;
  };
  struct Released {
    RequestId id;
  };
  struct Quarantined {
    RequestId id;
  };
  // submit, cancel, then the transfer's.
  using Command = std::variant<InstanceRequest, RequestId, Order, Withdrawn, Imported, ImportFailed,
                               Released, Quarantined>;
  // A prompt this (prefill) instance computes for a decode peer.
  struct Export {
    SequenceId sequence;
    int peer = 0;
    std::vector<int32_t> decode_ranks;  // the decode instance's, leader (peer) first
    std::chrono::steady_clock::time_point admitted_at{};
    int64_t rows_sent = 0;
  };

  void post(Command command);  // any thread
  void run();                  // the engine thread
  void apply(Command& command);
  void apply_submit(InstanceRequest& request);
  void apply_order(Order& order);
  void apply_imported(const Imported& imported);
  void fail(RequestId id, ServeError error);  // a finished kFailed event
  // An import that ends without its KV (failed, or released after a cancel):
  // the followers let go of it too, then the engine frees its blocks.
  void release_import(RequestId id, SequenceId sequence);
  void mirror_step(const ForwardBatch& batch);  // tensor parallelism
  InstanceStats publish_stats();
  // Stats to the observer, then the pending events to the handler.
  void publish();

  InstanceInfo info_;
  const LlamaModel& model_;
  TpLeader* const tp_;
  Engine engine_;  // engine thread only (after construction)

  // Engine thread only.
  std::map<RequestId, SequenceId> sequences_;
  std::map<SequenceId, RequestId> requests_;
  std::map<RequestId, SequenceId> releasing_;  // cancelled imports waiting for on_released
  // Imports whose blocks a lost rank's rows may still land in: kept forever.
  int64_t n_quarantined_ = 0;
  int64_t quarantined_blocks_ = 0;
  std::map<RequestId, Export> exports_;
  std::vector<InstanceEvent> events_;  // of the current step
  std::vector<TpExport> tp_exports_;   // of the current step
  const PeerLinks peers_;

  mutable std::mutex mutex_;  // guards the members below
  std::condition_variable wake_;
  std::deque<Command> commands_;
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
