#include "bench/sim/sim_instance.h"

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "worker/local_instance.h"
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

SimInstance::SimInstance(EventQueue& clock, InstanceRole role, int tp, const StepCost& cost,
                         EngineConfig config, InstanceInfo info, const ModelShape& model,
                         SimTransfer transfer, PeerLookup peers, SharedCores& cores)
    : clock_(clock),
      role_(role),
      tp_(tp),
      info_(std::move(info)),
      engine_(cost_model_backend(cost, model, &forward_), std::move(config)),
      transfer_(transfer),
      peers_(std::move(peers)),
      cores_(cores) {
  DUET_REQUIRE(tp >= 1, "an instance needs at least one rank, got tp {}", tp);
  DUET_REQUIRE(transfer_.n_layers >= 1, "a transfer needs the model's layer count");
  publish();
}

void SimInstance::submit(InstanceRequest request) { post(std::move(request)); }

void SimInstance::cancel(RequestId id) { post(id); }

void SimInstance::post(Command command) {
  commands_.push_back(std::move(command));
  if (busy_ || wake_pending_) return;  // applied when the step ends, or by the coming cycle
  wake_pending_ = true;
  clock_.after(0.0, [this] {
    wake_pending_ = false;
    if (!busy_) cycle();
  });
}

void SimInstance::cycle() {
  std::deque<Command> commands;
  commands.swap(commands_);
  for (Command& command : commands) apply(command);
  // A refusal or an imported prompt's first token leaves now, not after the step.
  if (!events_.empty()) publish();
  const int64_t steps_before = forward_->steps();
  engine_.step();
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
  for (Handoff& handoff : handoffs_) {
    const double bytes = static_cast<double>(handoff.rows) * transfer_.kv_bytes_per_token / tp_;
    const double tail =
        std::max(transfer_.link.seconds(bytes / static_cast<double>(transfer_.n_layers)),
                 transfer_.link.seconds(bytes) - seconds);
    SimInstance* decode = handoff.decode;
    clock_.after(std::max(0.0, tail),
                 [decode, imported = handoff.imported] { decode->post(imported); });
  }
  handoffs_.clear();
  for (auto& [id, exported] : exports_) exported.rows_this_step = 0;
  if (!commands_.empty() || !engine_.idle()) cycle();
}

void SimInstance::apply(Command& command) {
  if (auto* request = std::get_if<InstanceRequest>(&command)) {
    apply_submit(*request);
  } else if (const auto* id = std::get_if<RequestId>(&command)) {
    auto it = sequences_.find(*id);
    if (it == sequences_.end()) return;
    const SequenceId sid = it->second;
    const bool in_transfer = engine_.import_reserved(sid);
    SimInstance* prefill = nullptr;
    if (auto p = prefill_of_.find(*id); p != prefill_of_.end()) {
      prefill = p->second;
      prefill_of_.erase(p);
    }
    engine_.cancel(sid);  // its sink reports the finish and forgets the ids
    if (prefill != nullptr) {
      // No rows are in flight in a model of the transfer: withdraw the order
      // and free the blocks at once.
      clock_.after(transfer_.link.latency_s,
                   [prefill, rid = *id] { prefill->post(Withdrawn{rid}); });
    }
    if (in_transfer) engine_.release_import(sid);
    requests_.erase(sid);
    sequences_.erase(*id);
  } else if (auto* order = std::get_if<Order>(&command)) {
    apply_order(*order);
  } else if (const auto* withdrawn = std::get_if<Withdrawn>(&command)) {
    auto it = exports_.find(withdrawn->id);
    if (it == exports_.end()) return;  // handed over already
    engine_.cancel(it->second.sequence);
    exports_.erase(it);
  } else if (const auto* imported = std::get_if<Imported>(&command)) {
    apply_imported(*imported);
  }
}

void SimInstance::fail(RequestId id, ServeError error) {
  events_.push_back(
      {.id = id, .finished = true, .finish = InstanceFinish::kFailed, .error = std::move(error)});
}

void SimInstance::apply_submit(InstanceRequest& request) {
  const RequestId rid = request.id;
  const RequestOptions options = request_options(request);
  auto on_token = [this, rid](const TokenEvent& e) {
    InstanceEvent event{.id = rid, .token = e.token, .finished = e.finished};
    if (e.finished) {
      event.finish = instance_finish(e.reason);
      requests_.erase(e.id);
      sequences_.erase(rid);
      prefill_of_.erase(rid);
    }
    events_.push_back(std::move(event));
  };
  try {
    SequenceId sid;
    if (request.prefill_peer >= 0) {
      SimInstance* prefill = peers_(request.prefill_peer);
      DUET_REQUIRE(prefill != nullptr, "request {} names prefill instance {}, which is not there",
                   rid.value, request.prefill_peer);
      ImportHooks hooks;
      hooks.reserved = [this, prefill, request](SequenceId, int64_t cached,
                                                std::span<const int32_t>) {
        Order order{this, request, cached};
        order.request.prefill_peer = -1;
        clock_.after(transfer_.link.latency_s,
                     [prefill, order = std::move(order)]() mutable { prefill->post(order); });
      };
      std::vector<int32_t> prompt = request.prompt;
      sid = engine_.submit_import(std::move(prompt), options, on_token, std::move(hooks));
      prefill_of_.emplace(rid, prefill);
    } else {
      auto on_admitted = [this, rid](SequenceId, int64_t cached_tokens) {
        events_.push_back({.id = rid, .admitted = true, .cached_tokens = cached_tokens});
      };
      sid = engine_.submit(std::move(request.prompt), options, on_token, on_admitted);
    }
    sequences_.emplace(rid, sid);
    requests_.emplace(sid, rid);
  } catch (const Error& e) {
    fail(rid, ServeError{ServeErrorKind::kInvalidArgument, e.what()});
  }
}

void SimInstance::apply_imported(const Imported& imported) {
  auto it = sequences_.find(imported.id);
  if (it == sequences_.end() || !engine_.importing(it->second)) return;  // cancelled meanwhile
  prefill_of_.erase(imported.id);
  if (imported.first_token < 0) {  // the prefill side refused the prompt
    engine_.release_import(it->second);
    requests_.erase(it->second);
    sequences_.erase(it);
    fail(imported.id, ServeError{ServeErrorKind::kInvalidArgument, "prefill refused the prompt"});
    return;
  }
  events_.push_back({.id = imported.id, .admitted = true, .cached_tokens = imported.cached_tokens});
  engine_.complete_import(it->second, imported.first_token);
}

void SimInstance::apply_order(Order& order) {
  const RequestId rid = order.request.id;
  SimInstance* decode = order.decode;
  RequestOptions options = request_options(order.request);
  options.max_tokens = 1;  // this side samples the first token only
  ExportSink sink;
  sink.layer = [this, rid](SequenceId, int64_t layer, int64_t, int64_t n, std::span<const int32_t>,
                           const KvCache&) {
    if (layer == 0) exports_.at(rid).rows_this_step += n;
  };
  sink.done = [this, rid](SequenceId, int32_t first_token, int64_t cached_tokens) {
    auto it = exports_.find(rid);
    handoffs_.push_back(
        {it->second.decode, Imported{rid, first_token, cached_tokens}, it->second.rows_this_step});
    exports_.erase(it);
  };
  try {
    const SequenceId sid =
        engine_.submit_export(std::move(order.request.prompt), options, order.send_from, sink);
    exports_.emplace(rid, Export{sid, decode, 0});
  } catch (const Error&) {
    clock_.after(transfer_.link.latency_s, [decode, rid] { decode->post(Imported{rid, -1, 0}); });
  }
}

void SimInstance::publish() {
  const EngineStats e = engine_.stats();
  stats_.running = engine_.n_running();
  stats_.waiting = engine_.n_waiting();
  stats_.kv_blocks_total = engine_.n_kv_blocks();
  stats_.kv_blocks_free = engine_.n_free_kv_blocks();
  stats_.kv_block_tokens = KvLayout::kDefaultBlockSize;
  stats_.steps = e.steps;
  stats_.prompt_tokens = e.prompt_tokens;
  stats_.prefix_hit_tokens = e.prefix_hit_tokens;
  stats_.generated_tokens = e.generated_tokens;
  stats_.preemptions = e.preemptions;
  if (!events_.empty() && handler_) {
    std::vector<InstanceEvent> events;
    events.swap(events_);
    handler_(events);
  }
}

}  // namespace duet::sim
