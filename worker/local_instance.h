// An instance in this process: the batching engine on its own thread.
//
// The coordinator's fronts reach the engine only through this class's one
// command queue (submit, cancel); the engine thread drains it between steps,
// runs a step, and hands the step's events to the event handler in one batch.
// With nothing queued and nothing running, the thread sleeps on a condition
// variable (no CPU while idle).
//
// Thread affinity: submit, cancel, stats and info from any thread; the engine,
// the id maps and the per-step event buffer belong to the engine thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <variant>
#include <vector>

#include "common/serving.h"
#include "worker/engine.h"

namespace duet {

class LocalInstance final : public InstanceClient {
 public:
  // `model`, `kernels` and `pool` outlive the instance. The thread starts at
  // once; events go nowhere until set_event_handler.
  LocalInstance(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
                EngineConfig config, std::string model_name);
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

 private:
  using Command = std::variant<InstanceRequest, RequestId>;  // submit or cancel

  void run();  // the engine thread
  void apply(Command& command);
  InstanceStats publish_stats();

  InstanceInfo info_;
  Engine engine_;  // engine thread only (after construction)

  // Engine thread only.
  std::map<RequestId, SequenceId> sequences_;
  std::map<SequenceId, RequestId> requests_;
  std::vector<InstanceEvent> events_;  // of the current step

  mutable std::mutex mutex_;  // guards the members below
  std::condition_variable wake_;
  std::deque<Command> commands_;
  bool stopping_ = false;
  InstanceStats stats_;

  // Held by the engine thread while it calls the observer and the handler,
  // and by their setters: once a setter returns, the old callback is not
  // running and will not run again (its owner may be destroyed).
  std::mutex callback_mutex_;
  EventHandler handler_;   // guarded by callback_mutex_
  StepObserver observer_;  // guarded by callback_mutex_

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
