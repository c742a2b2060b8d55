// One instance of a simulated cluster: the real Engine, with a step-time
// model in place of a forward pass and no KV memory, behind the same
// InstanceClient interface the router drives, on the simulator's clock.
//
// Like worker/local_instance.h, it is a shell around an InstanceCore
// (worker/instance_core.h), fed from simulated time in place of a thread:
// commands wait while a step runs and apply between steps; events that a
// command produces leave at once; a step's events leave when the step ends,
// its cost model's seconds after it began; the router sees stats as of the
// last step. Orders, withdrawals and handoffs cross a modelled link, and the
// KV transfer is modelled, not run (SimTransfer).
//
// Thread affinity: the simulator's one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/serving.h"
#include "sim/event_queue.h"
#include "sim/profile.h"
#include "worker/engine.h"
#include "worker/instance_core.h"

namespace duet::sim {

// How KV moves between a prefill and a decode instance: modelled, not run.
// The rows of a prompt's earlier steps are taken to cross while later steps
// compute (the real transfer sends each layer as it is stored), and what the
// last step exported crosses after it, overlapped with that step except for
// its last layer:
//   tail = max(link(bytes / n_layers), link(bytes) - step seconds)
// where link(b) = latency + b / bandwidth. Transfers do not share the link's
// bandwidth with one another.
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
  // The instance with transfer address `peer` (InstanceRequest::prefill_peer,
  // and a decode instance's address in its orders).
  using PeerLookup = std::function<SimInstance*(int32_t peer)>;

  // `clock`, `cores` and what `peers` returns outlive the instance. `tp`
  // divides the bytes each transfer moves (every rank ships its KV heads in
  // parallel). `address`: this instance's, as `peers` finds it.
  SimInstance(EventQueue& clock, int tp, const StepCost& cost, EngineConfig config,
              InstanceInfo info, const ModelShape& model, SimTransfer transfer, int32_t address,
              PeerLookup peers, SharedCores& cores);
  ~SimInstance() override;
  SimInstance(const SimInstance&) = delete;
  SimInstance& operator=(const SimInstance&) = delete;

  const InstanceInfo& info() const override { return info_; }
  void set_event_handler(EventHandler handler) override { handler_ = std::move(handler); }
  void submit(InstanceRequest request) override;
  void cancel(RequestId id) override;
  InstanceStats stats() const override { return stats_; }

  int tp() const { return tp_; }
  // Simulated seconds spent in steps.
  double busy_seconds() const { return busy_seconds_; }
  int64_t steps() const { return core_.engine().stats().steps; }

 private:
  // The core's peers across the modelled link.
  class LinkPeers;

  void post(InstanceCommand command);
  // Applies the waiting commands, publishes their events, starts a step.
  void cycle();
  void step_done(double seconds);
  void publish();

  EventQueue& clock_;
  const int tp_;
  InstanceInfo info_;
  StepTimeForward* forward_ = nullptr;  // owned by the core's engine
  std::unique_ptr<LinkPeers> link_peers_;
  InstanceCore core_;
  SharedCores& cores_;
  EventHandler handler_;

  std::deque<InstanceCommand> commands_;
  bool busy_ = false;          // a step is running
  bool wake_pending_ = false;  // a cycle is scheduled
  double busy_seconds_ = 0;
  InstanceStats stats_;  // as of the last publish
};

}  // namespace duet::sim
