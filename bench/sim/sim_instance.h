// One instance of a simulated cluster: the real Engine, with a step-time
// model in place of a forward pass and no KV memory, behind the same
// InstanceClient interface the router drives, on the simulator's clock.
//
// It does what worker/local_instance.h does, with simulated time in place of
// a thread: commands (submit, cancel, and a transfer's orders and handoffs)
// wait while a step runs and apply between steps; events that a command
// produces (a refusal, an imported prompt's first token) leave at once; a
// step's events leave when the step ends, its cost model's seconds after it
// began; the router sees stats as of the last step. Disaggregated, a decode
// instance reserves an import's blocks, sends the prefill instance its order
// (after the link's latency), and completes the import when the handoff
// arrives; the prefill instance exports the prompt with the engine's own
// export path and hands the first token over when the rows have crossed the
// link.
//
// The KV transfer is modelled, not run: the rows of a prompt's earlier steps
// are taken to cross while later steps compute (the real transfer sends each
// layer as it is stored), and what the last step exported crosses after it,
// overlapped with that step except for its last layer:
//   tail = max(link(bytes / n_layers), link(bytes) - step seconds)
// where link(b) = latency + b / bandwidth. Transfers do not share the link's
// bandwidth with one another.
//
// Thread affinity: the simulator's one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <variant>
#include <vector>

#include "bench/sim/event_queue.h"
#include "bench/sim/profile.h"
#include "common/cluster/cluster_spec.h"
#include "common/serving.h"
#include "worker/engine.h"

namespace duet::sim {

// How KV moves between a prefill and a decode instance.
struct SimTransfer {
  LinkCost link;
  double kv_bytes_per_token = 0;  // all layers
  int64_t n_layers = 1;
};

// Instances that share one host's cores (a CPU cluster on one machine): a
// step that starts while more instance steps run than there are cores takes
// proportionally longer, and one that starts while any other runs takes
// `neighbour_slowdown` times longer on top (the memory and caches they share;
// the profile's HostSharing). Judged at each step's start: a step already
// running is not slowed by one that starts after it.
struct SharedCores {
  int cores = 0;  // 0: every instance has cores of its own
  double neighbour_slowdown = 1;
  int busy = 0;  // steps running now

  double begin_step() {
    ++busy;
    if (cores <= 0) return 1.0;
    return std::max(1.0, static_cast<double>(busy) / cores) * (busy > 1 ? neighbour_slowdown : 1.0);
  }
  void end_step() { --busy; }
};

class SimInstance final : public InstanceClient {
 public:
  // The prefill instance with transfer address `peer` (InstanceRequest::prefill_peer).
  using PeerLookup = std::function<SimInstance*(int32_t peer)>;

  // `clock`, `cores` and what `peers` returns outlive the instance. `tp`
  // divides the bytes each transfer moves (every rank ships its KV heads in
  // parallel).
  SimInstance(EventQueue& clock, InstanceRole role, int tp, const StepCost& cost,
              EngineConfig config, InstanceInfo info, const ModelShape& model, SimTransfer transfer,
              PeerLookup peers, SharedCores& cores);
  SimInstance(const SimInstance&) = delete;
  SimInstance& operator=(const SimInstance&) = delete;

  const InstanceInfo& info() const override { return info_; }
  void set_event_handler(EventHandler handler) override { handler_ = std::move(handler); }
  void submit(InstanceRequest request) override;
  void cancel(RequestId id) override;
  InstanceStats stats() const override { return stats_; }

  InstanceRole role() const { return role_; }
  int tp() const { return tp_; }
  // Simulated seconds spent in steps.
  double busy_seconds() const { return busy_seconds_; }
  int64_t steps() const { return engine_.stats().steps; }

 private:
  // From a decode instance: compute this prompt for it.
  struct Order {
    SimInstance* decode = nullptr;
    InstanceRequest request;
    int64_t send_from = 0;
  };
  // From a decode instance: the order's request was cancelled.
  struct Withdrawn {
    RequestId id;
  };
  // From a prefill instance: the rows are here.
  struct Imported {
    RequestId id;
    int32_t first_token = -1;
    int64_t cached_tokens = 0;
  };
  using Command = std::variant<InstanceRequest, RequestId, Order, Withdrawn, Imported>;

  // A prompt this (prefill) instance computes for a decode instance.
  struct Export {
    SequenceId sequence;
    SimInstance* decode = nullptr;
    int64_t rows_this_step = 0;  // positions exported by the running step
  };
  struct Handoff {
    SimInstance* decode = nullptr;
    Imported imported;
    int64_t rows = 0;  // exported by the last step
  };

  void post(Command command);
  // Applies the waiting commands, publishes their events, starts a step.
  void cycle();
  void step_done(double seconds);
  void apply(Command& command);
  void apply_submit(InstanceRequest& request);
  void apply_order(Order& order);
  void apply_imported(const Imported& imported);
  void fail(RequestId id, ServeError error);
  void publish();

  EventQueue& clock_;
  const InstanceRole role_;
  const int tp_;
  InstanceInfo info_;
  StepTimeForward* forward_ = nullptr;  // owned by engine_
  Engine engine_;
  const SimTransfer transfer_;
  const PeerLookup peers_;
  SharedCores& cores_;
  EventHandler handler_;

  std::deque<Command> commands_;
  bool busy_ = false;          // a step is running
  bool wake_pending_ = false;  // a cycle is scheduled
  double busy_seconds_ = 0;
  InstanceStats stats_;  // as of the last publish
  std::map<RequestId, SequenceId> sequences_;
  std::map<SequenceId, RequestId> requests_;
  std::map<RequestId, SimInstance*> prefill_of_;  // imports: where the prompt is computed
  std::map<RequestId, Export> exports_;
  std::vector<Handoff> handoffs_;      // exports the running step finished
  std::vector<InstanceEvent> events_;  // to publish
};

}  // namespace duet::sim
