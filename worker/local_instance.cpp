#include "worker/local_instance.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/model/kv_layout.h"

namespace duet {

RequestOptions request_options(const InstanceRequest& request) {
  RequestOptions options;
  options.max_tokens = request.max_tokens;
  options.sampling = request.sampling;
  options.ignore_eos = request.ignore_eos;
  options.n_prompt = request.n_prompt;
  return options;
}

InstanceFinish instance_finish(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEndOfGeneration:
      return InstanceFinish::kEndOfGeneration;
    case FinishReason::kLength:
      return InstanceFinish::kLength;
    case FinishReason::kStopped:
      return InstanceFinish::kCancelled;
  }
  return InstanceFinish::kFailed;
}

LocalInstance::LocalInstance(const LlamaModel& model, const cpu::KernelTable& kernels,
                             cpu::ThreadPool& pool, EngineConfig config, std::string model_name,
                             PeerLinks peers, TpLeader* tp)
    : info_{std::move(model_name), model.config().n_ctx_train, model.config().n_vocab,
            config.n_kv_blocks * KvLayout::kDefaultBlockSize, config.end_of_generation},
      model_(model),
      tp_(tp),
      engine_(model, kernels, pool, std::move(config), tp != nullptr ? &tp->collective() : nullptr,
              tp != nullptr ? tp->device_collective() : nullptr),
      peers_(std::move(peers)) {
  publish_stats();
  if (tp_ != nullptr)
    engine_.set_before_forward([this](const ForwardBatch& batch) { mirror_step(batch); });
  if (peers_.transfer != nullptr) {
    KvTransfer::Handlers handlers;
    handlers.on_order = [this](int peer, PrefillOrder order) {
      post(Order{peer, std::move(order)});
    };
    handlers.on_cancel = [this](int, RequestId id) { post(Withdrawn{id}); };
    handlers.on_complete = [this](RequestId id, const KvHandoff& handoff) {
      post(Imported{id, handoff});
    };
    handlers.on_failed = [this](RequestId id, const ServeError& error) {
      post(ImportFailed{id, error});
    };
    handlers.on_released = [this](RequestId id) { post(Released{id}); };
    handlers.on_quarantined = [this](RequestId id) { post(Quarantined{id}); };
    peers_.transfer->set_handlers(std::move(handlers));
  }
  thread_ = std::thread([this] { run(); });
}

LocalInstance::~LocalInstance() {
  if (peers_.transfer != nullptr) peers_.transfer->set_handlers({});
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
  // Rows still on their way must not land in the engine's cache once it is gone.
  if (peers_.transfer != nullptr) peers_.transfer->forget_imports(engine_.cache());
}

void LocalInstance::set_event_handler(EventHandler handler) {
  std::lock_guard lock(callback_mutex_);
  handler_ = std::move(handler);
}

void LocalInstance::set_step_observer(StepObserver observer) {
  std::lock_guard lock(callback_mutex_);
  observer_ = std::move(observer);
}

void LocalInstance::post(Command command) {
  {
    std::lock_guard lock(mutex_);
    commands_.push_back(std::move(command));
  }
  wake_.notify_one();
}

void LocalInstance::submit(InstanceRequest request) { post(std::move(request)); }

void LocalInstance::cancel(RequestId id) { post(id); }

InstanceStats LocalInstance::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void LocalInstance::apply(Command& command) {
  if (auto* request = std::get_if<InstanceRequest>(&command)) {
    apply_submit(*request);
  } else if (const auto* id = std::get_if<RequestId>(&command)) {
    auto it = sequences_.find(*id);
    if (it == sequences_.end()) return;
    const SequenceId sid = it->second;
    // An import in transfer keeps its blocks until the transfer lets go.
    if (engine_.import_reserved(sid)) {
      spdlog::info(
          "instance: request {} cancelled before its KV arrived; its blocks wait for "
          "the transfer",
          id->value);
      releasing_.emplace(*id, sid);
    }
    engine_.cancel(sid);  // its sink reports the finish
  } else if (auto* order = std::get_if<Order>(&command)) {
    apply_order(*order);
  } else if (const auto* withdrawn = std::get_if<Withdrawn>(&command)) {
    auto it = exports_.find(withdrawn->id);
    if (it == exports_.end()) return;  // done already
    engine_.cancel(it->second.sequence);
    exports_.erase(it);
  } else if (const auto* imported = std::get_if<Imported>(&command)) {
    apply_imported(*imported);
  } else if (const auto* failed = std::get_if<ImportFailed>(&command)) {
    auto it = sequences_.find(failed->id);
    if (it == sequences_.end() || !engine_.importing(it->second)) return;  // cancelled
    release_import(failed->id, it->second);
    requests_.erase(it->second);
    sequences_.erase(it);
    fail(failed->id, failed->error);
  } else if (const auto* released = std::get_if<Released>(&command)) {
    auto it = releasing_.find(released->id);
    if (it == releasing_.end()) return;
    release_import(released->id, it->second);
    releasing_.erase(it);
  } else if (const auto* quarantined = std::get_if<Quarantined>(&command)) {
    // Never released: the engine keeps the sequence, and its blocks, for good.
    SequenceId sid;
    if (auto it = releasing_.find(quarantined->id); it != releasing_.end()) {
      sid = it->second;  // cancelled already: its finish was reported
      releasing_.erase(it);
    } else if (auto live = sequences_.find(quarantined->id); live != sequences_.end()) {
      sid = live->second;
      requests_.erase(sid);
      sequences_.erase(live);
      fail(quarantined->id, {ServeErrorKind::kUnavailable,
                             "its prefill instance was lost while its KV was arriving"});
    } else {
      return;
    }
    ++n_quarantined_;
    quarantined_blocks_ += engine_.n_kv_blocks_of(sid);
    spdlog::warn(
        "instance: request {}: {} KV blocks quarantined (a lost rank may still write them)",
        quarantined->id.value, engine_.n_kv_blocks_of(sid));
  }
}

void LocalInstance::release_import(RequestId id, SequenceId sequence) {
  if (tp_ != nullptr) tp_->release_import(id);
  engine_.release_import(sequence);
}

void LocalInstance::mirror_step(const ForwardBatch& batch) {
  tp_exports_.clear();
  for (const ForwardBatch::Export& rows : batch.exports) {
    for (const auto& [rid, exported] : exports_) {
      if (exported.sequence != rows.id) continue;
      tp_exports_.push_back({rid, rows.sequence, rows.pos0, rows.n, exported.decode_ranks});
      break;
    }
  }
  tp_->step(batch, tp_exports_);
}

void LocalInstance::fail(RequestId id, ServeError error) {
  events_.push_back(
      {.id = id, .finished = true, .finish = InstanceFinish::kFailed, .error = std::move(error)});
}

void LocalInstance::apply_submit(InstanceRequest& request) {
  const RequestId rid = request.id;
  const RequestOptions options = request_options(request);
  auto on_token = [this, rid](const TokenEvent& e) {
    InstanceEvent event{.id = rid, .token = e.token, .finished = e.finished};
    if (e.finished) {
      event.finish = instance_finish(e.reason);
      requests_.erase(e.id);
      sequences_.erase(rid);
    }
    events_.push_back(std::move(event));
  };
  auto on_admitted = [this, rid](SequenceId, int64_t cached_tokens) {
    events_.push_back({.id = rid,
                       .admitted = true,
                       .cached_tokens = cached_tokens,
                       .admitted_at = std::chrono::steady_clock::now()});
  };
  try {
    SequenceId sid;
    if (request.prefill_peer >= 0) {
      DUET_REQUIRE(peers_.transfer != nullptr,
                   "request {} names prefill rank {}, but this instance has no KV transfer",
                   rid.value, request.prefill_peer);
      ImportHooks hooks;
      hooks.reserved = [this, request](SequenceId, int64_t cached,
                                       std::span<const int32_t> block_table) {
        PrefillOrder order{request, cached, peers_.own_ranks};
        order.request.prefill_peer = -1;
        TpImport import{request.id,
                        cached,
                        static_cast<int64_t>(request.prompt.size()),
                        {block_table.begin(), block_table.end()},
                        peers_.transfer_timeout,
                        {request.prefill_peer}};
        if (auto it = peers_.instance_ranks.find(request.prefill_peer);
            it != peers_.instance_ranks.end())
          import.prefill_ranks = it->second;
        // The followers know where their rows go before the order leaves.
        if (tp_ != nullptr) tp_->expect_import(import);
        peers_.transfer->start_import(request.prefill_peer, order,
                                      tp_import_plan(import, model_, engine_.cache()));
      };
      hooks.abort = [this, rid](SequenceId) { peers_.transfer->abort_import(rid); };
      // Rows from GPUs with a device transfer land in the device pool directly.
      std::vector<int32_t> sources = {request.prefill_peer};
      if (auto it = peers_.instance_ranks.find(request.prefill_peer);
          it != peers_.instance_ranks.end())
        sources = it->second;
      hooks.device_rows = std::all_of(sources.begin(), sources.end(), [this](int32_t rank) {
        return peers_.transfer->device_transfer(rank);
      });
      std::vector<int32_t> prompt = request.prompt;
      sid = engine_.submit_import(std::move(prompt), options, on_token, std::move(hooks));
    } else {
      sid = engine_.submit(std::move(request.prompt), options, on_token, on_admitted);
    }
    sequences_.emplace(rid, sid);
    requests_.emplace(sid, rid);
  } catch (const Error& e) {
    fail(rid, ServeError{ServeErrorKind::kInvalidArgument, e.what()});
  } catch (const std::exception& e) {
    fail(rid, ServeError{ServeErrorKind::kInternal, e.what()});
  }
}

void LocalInstance::apply_imported(const Imported& imported) {
  auto it = sequences_.find(imported.id);
  if (it == sequences_.end() || !engine_.importing(it->second)) return;  // cancelled meanwhile
  if (tp_ != nullptr && !tp_->confirm_import(imported.id)) {
    release_import(imported.id, it->second);
    requests_.erase(it->second);
    sequences_.erase(it);
    fail(imported.id, ServeError{ServeErrorKind::kUnavailable,
                                 "KV transfer: a follower rank of this instance did not receive "
                                 "all of its KV heads' rows"});
    return;
  }
  // Queueing ended when the prefill side admitted the prompt: place that on
  // this host's clock as "prefill_ns before now".
  const KvHandoff& handoff = imported.handoff;
  events_.push_back({.id = imported.id,
                     .admitted = true,
                     .cached_tokens = handoff.cached_tokens,
                     .admitted_at = std::chrono::steady_clock::now() -
                                    std::chrono::nanoseconds(handoff.prefill_ns)});
  engine_.complete_import(it->second, handoff.first_token);
}

void LocalInstance::apply_order(Order& order) {
  const RequestId rid = order.order.request.id;
  const int peer = order.peer;
  std::vector<int32_t> decode_ranks = order.order.decode_ranks;
  if (decode_ranks.empty()) decode_ranks = {peer};
  InstanceRequest& request = order.order.request;
  RequestOptions options = request_options(request);
  options.max_tokens = 1;  // this side samples the first token only
  ExportSink sink;
  sink.layer = [this, rid](SequenceId, int64_t layer, int64_t pos0, int64_t n,
                           std::span<const int32_t> block_table, const KvCache& cache) {
    Export& exported = exports_.at(rid);
    tp_send_rows(*peers_.transfer, model_, rid, layer, pos0, n, exported.decode_ranks, cache,
                 block_table);
    exported.rows_sent += n;
  };
  sink.done = [this, peer, rid](SequenceId, int32_t first_token, int64_t cached_tokens) {
    auto it = exports_.find(rid);
    const auto prefill = std::chrono::steady_clock::now() - it->second.admitted_at;
    peers_.transfer->send_handoff(
        peer, KvHandoff{rid, first_token, cached_tokens,
                        std::chrono::duration_cast<std::chrono::nanoseconds>(prefill).count(),
                        it->second.rows_sent, std::nullopt});
    exports_.erase(it);
  };
  // Rows for GPUs with a device transfer leave from the device pool directly.
  sink.device_rows = std::all_of(decode_ranks.begin(), decode_ranks.end(), [this](int32_t rank) {
    return peers_.transfer->device_transfer(rank);
  });
  auto on_admitted = [this, rid](SequenceId, int64_t) {
    exports_.at(rid).admitted_at = std::chrono::steady_clock::now();
  };
  try {
    const SequenceId sid = engine_.submit_export(std::move(request.prompt), options,
                                                 order.order.send_from, sink, on_admitted);
    exports_.emplace(
        rid, Export{sid, peer, std::move(decode_ranks), std::chrono::steady_clock::now(), 0});
  } catch (const std::exception& e) {
    peers_.transfer->send_handoff(
        peer, KvHandoff{rid, -1, 0, 0, 0,
                        ServeError{ServeErrorKind::kInvalidArgument,
                                   std::string("prefill refused the prompt: ") + e.what()}});
  }
}

InstanceStats LocalInstance::publish_stats() {
  const EngineStats e = engine_.stats();
  InstanceStats s;
  s.running = engine_.n_running();
  s.waiting = engine_.n_waiting() - n_quarantined_;
  s.kv_blocks_quarantined = quarantined_blocks_;
  s.kv_blocks_total = engine_.n_kv_blocks();
  s.kv_blocks_free = engine_.n_free_kv_blocks();
  s.kv_block_tokens = KvLayout::kDefaultBlockSize;
  s.steps = e.steps;
  s.prompt_tokens = e.prompt_tokens;
  s.prefix_hit_tokens = e.prefix_hit_tokens;
  s.generated_tokens = e.generated_tokens;
  s.preemptions = e.preemptions;
  std::lock_guard lock(mutex_);
  stats_ = s;
  return s;
}

void LocalInstance::run() {
  std::deque<Command> commands;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !commands_.empty() || !engine_.idle(); });
      if (stopping_) return;
      commands.swap(commands_);
    }
    for (Command& command : commands) apply(command);
    commands.clear();
    // An imported prompt's first token (or a refusal) leaves now, not after
    // the next step: it is the request's time to first token.
    if (!events_.empty()) publish();
    in_step_ = true;
    try {
      engine_.step();
      in_step_ = false;
    } catch (const std::exception& e) {
      in_step_ = false;
      // A broken invariant in the engine: fail every live request, keep the thread.
      const std::string e_what = e.what();
      for (const auto& [rid, sid] : sequences_) {
        events_.push_back({.id = rid,
                           .finished = true,
                           .finish = InstanceFinish::kFailed,
                           .error = ServeError{ServeErrorKind::kInternal, e.what()}});
      }
      std::vector<SequenceId> live;
      for (const auto& [sid, rid] : requests_) live.push_back(sid);
      std::vector<InstanceEvent> failed = std::move(events_);
      events_.clear();
      for (const auto& [rid, exported] : exports_) {
        peers_.transfer->send_handoff(
            exported.peer,
            KvHandoff{rid, -1, 0, 0, 0, ServeError{ServeErrorKind::kInternal, e_what}});
        live.push_back(exported.sequence);
      }
      exports_.clear();
      for (SequenceId sid : live) {
        try {
          if (engine_.import_reserved(sid) && requests_.contains(sid))
            releasing_.emplace(requests_.at(sid), sid);
          engine_.cancel(sid);  // frees the KV; its events are dropped
        } catch (const std::exception& cancel_error) {
          spdlog::error("instance: cancel after a failed step failed: {}", cancel_error.what());
        }
      }
      events_ = std::move(failed);
    }
    publish();
  }
}

void LocalInstance::publish() {
  const InstanceStats stats = publish_stats();
  std::lock_guard callbacks(callback_mutex_);
  try {
    if (observer_) observer_(stats);
    if (!events_.empty() && handler_) handler_(events_);
  } catch (const std::exception& e) {
    // The consumer's fault; the engine and every other request go on.
    spdlog::error("instance: an event consumer failed: {}", e.what());
  }
  events_.clear();
}

}  // namespace duet
