#include "sim/sim_instance.h"

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "worker/model/step_time_forward.h"

namespace duet::sim {
namespace {

EngineBackend cost_model_backend(const StepCost& cost, const ModelShape& model,
                                 StepTimeForward** forward) {
  auto f = std::make_unique<StepTimeForward>([cost](const StepShape& shape) { return cost(shape); },
                                             model.n_vocab);
  f->set_layers(model.n_layers);
  *forward = f.get();
  KvLayout layout;
  layout.n_layers = model.n_layers;
  layout.n_kv_heads = model.n_kv_heads;
  layout.head_dim = model.head_dim;
  return {std::move(f), layout, KvMemory::kNone, model.n_vocab, model.n_ctx};
}

}  // namespace

// Orders and withdrawals cross the link after its latency. No row is in
// flight in this model: a cancelled import's blocks go at once, and a
// prompt's rows are counted, not sent; its handoff leaves when the step that
// finished it ends, after the tail the header describes.
class SimInstance::LinkPeers final : public InstancePeers {
 public:
  LinkPeers(EventQueue& clock, SimTransfer transfer, int tp, int32_t address, PeerLookup peers)
      : clock_(clock), transfer_(transfer), tp_(tp), address_(address), peers_(std::move(peers)) {
    DUET_REQUIRE(tp >= 1, "an instance needs at least one rank, got tp {}", tp);
    DUET_REQUIRE(transfer_.n_layers >= 1, "a transfer needs the model's layer count");
  }

  void start_import(int32_t prefill_peer, const PrefillOrder& order, const TpImport&,
                    KvCache&) override {
    SimInstance* prefill = find(prefill_peer);
    clock_.after(transfer_.link.latency_s,
                 [prefill, command = PeerOrder{address_, order}]() mutable {
                   prefill->post(std::move(command));
                 });
  }
  bool abort_import(int32_t prefill_peer, RequestId id) override {
    SimInstance* prefill = find(prefill_peer);
    clock_.after(transfer_.link.latency_s, [prefill, id] { prefill->post(OrderWithdrawn{id}); });
    return true;
  }
  void send_rows(RequestId id, int64_t layer, int64_t, int64_t n, std::span<const int32_t>,
                 const KvCache&, std::span<const int32_t>) override {
    if (layer == 0) rows_this_step_[id] += n;
  }
  void send_handoff(int32_t decode_peer, const KvHandoff& handoff) override {
    SimInstance* decode = find(decode_peer);
    if (handoff.error) {
      clock_.after(
          transfer_.link.latency_s,
          [decode, failed = ImportFailed{handoff.id, *handoff.error}] { decode->post(failed); });
      return;
    }
    handoffs_.push_back({decode, handoff, rows_this_step_[handoff.id]});
  }

  // The step that ran for `seconds` is over: its handoffs leave.
  void step_done(double seconds) {
    for (const Handoff& handoff : handoffs_) {
      const double bytes = static_cast<double>(handoff.rows) * transfer_.kv_bytes_per_token / tp_;
      const double tail =
          std::max(transfer_.link.seconds(bytes / static_cast<double>(transfer_.n_layers)),
                   transfer_.link.seconds(bytes) - seconds);
      clock_.after(std::max(0.0, tail), [decode = handoff.decode,
                                         done = ImportDone{handoff.handoff.id, handoff.handoff}] {
        decode->post(done);
      });
    }
    handoffs_.clear();
    rows_this_step_.clear();
  }

 private:
  struct Handoff {
    SimInstance* decode = nullptr;
    KvHandoff handoff;
    int64_t rows = 0;  // exported by the last step
  };

  SimInstance* find(int32_t peer) const {
    SimInstance* instance = peers_(peer);
    DUET_ASSERT(instance != nullptr, "the simulated cluster has no instance {}", peer);
    return instance;
  }

  EventQueue& clock_;
  const SimTransfer transfer_;
  const int tp_;
  const int32_t address_;
  const PeerLookup peers_;
  std::map<RequestId, int64_t> rows_this_step_;  // positions exported by the running step
  std::vector<Handoff> handoffs_;                // exports the running step finished
};

SimInstance::SimInstance(EventQueue& clock, int tp, const StepCost& cost, EngineConfig config,
                         InstanceInfo info, const ModelShape& model, SimTransfer transfer,
                         int32_t address, PeerLookup peers, SharedCores& cores)
    : clock_(clock),
      tp_(tp),
      info_(std::move(info)),
      link_peers_(std::make_unique<LinkPeers>(clock, transfer, tp, address, std::move(peers))),
      core_(std::make_unique<Engine>(cost_model_backend(cost, model, &forward_), std::move(config)),
            InstanceCoreOptions{.peers = link_peers_.get()}),
      cores_(cores) {
  publish();
}

SimInstance::~SimInstance() = default;

void SimInstance::submit(InstanceRequest request) { post(std::move(request)); }

void SimInstance::cancel(RequestId id) { post(CancelRequest{id}); }

void SimInstance::post(InstanceCommand command) {
  commands_.push_back(std::move(command));
  if (busy_ || wake_pending_) return;  // applied when the step ends, or by the coming cycle
  wake_pending_ = true;
  clock_.after(0.0, [this] {
    wake_pending_ = false;
    if (!busy_) cycle();
  });
}

void SimInstance::cycle() {
  std::deque<InstanceCommand> commands;
  commands.swap(commands_);
  for (InstanceCommand& command : commands) core_.apply(command);
  // A refusal or an imported prompt's first token leaves now, not after the step.
  if (core_.has_events()) publish();
  const int64_t steps_before = forward_->steps();
  core_.step();
  if (forward_->steps() == steps_before) {
    // Nothing to compute (imports wait for their rows): fresh stats, then
    // sleep until a command.
    publish();
    return;
  }
  const double seconds = forward_->last_step_seconds() * cores_.begin_step();
  busy_ = true;
  busy_seconds_ += seconds;
  clock_.after(seconds, [this, seconds] { step_done(seconds); });
}

void SimInstance::step_done(double seconds) {
  busy_ = false;
  cores_.end_step();
  publish();
  link_peers_->step_done(seconds);
  if (!commands_.empty() || !core_.idle()) cycle();
}

void SimInstance::publish() {
  stats_ = core_.stats();
  std::vector<InstanceEvent> events = core_.take_events();
  if (!events.empty() && handler_) handler_(events);
}

}  // namespace duet::sim
