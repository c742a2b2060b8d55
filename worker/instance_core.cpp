#include "worker/instance_core.h"

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
    case FinishReason::kCancelled:
      return InstanceFinish::kCancelled;
  }
  return InstanceFinish::kFailed;
}

InstanceCore::InstanceCore(std::unique_ptr<Engine> engine, InstanceCoreOptions options)
    : engine_(std::move(engine)), options_(std::move(options)) {
  DUET_REQUIRE(engine_ != nullptr, "an instance needs an engine");
  if (options_.tp != nullptr)
    engine_->set_before_forward([this](const ForwardBatch& batch) { mirror_step(batch); });
}

std::chrono::steady_clock::time_point InstanceCore::now() const {
  return options_.now ? options_.now() : std::chrono::steady_clock::time_point{};
}

std::vector<InstanceEvent> InstanceCore::take_events() {
  std::vector<InstanceEvent> events;
  events.swap(events_);
  return events;
}

void InstanceCore::apply(InstanceCommand& command) {
  std::visit(
      [this](auto& c) {
        using C = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<C, InstanceRequest>) {
          apply_submit(c);
        } else if constexpr (std::is_same_v<C, CancelRequest>) {
          apply_cancel(c.id);
        } else if constexpr (std::is_same_v<C, PeerOrder>) {
          apply_order(c);
        } else if constexpr (std::is_same_v<C, OrderWithdrawn>) {
          apply_withdrawn(c.id);
        } else if constexpr (std::is_same_v<C, ImportDone>) {
          apply_done(c);
        } else if constexpr (std::is_same_v<C, ImportFailed>) {
          apply_failed(c);
        } else if constexpr (std::is_same_v<C, ImportReleased>) {
          apply_released(c.id);
        } else {
          static_assert(std::is_same_v<C, ImportQuarantined>);
          apply_quarantined(c.id);
        }
      },
      command);
}

void InstanceCore::forget(RequestId id, SequenceId sequence) {
  requests_.erase(sequence);
  sequences_.erase(id);
}

void InstanceCore::fail(RequestId id, ServeError error) {
  events_.push_back(
      {.id = id, .finished = true, .finish = InstanceFinish::kFailed, .error = std::move(error)});
}

void InstanceCore::release_import(RequestId id, SequenceId sequence) {
  if (options_.tp != nullptr) options_.tp->release_import(id);
  engine_->release_import(sequence);
}

void InstanceCore::cancel_sequence(RequestId id, SequenceId sequence) {
  const bool in_flight = engine_->import_reserved(sequence);
  abort_released_ = false;
  engine_->cancel(sequence);  // its sink reports the finish; an import calls abort_import
  if (!in_flight) return;
  if (abort_released_) {
    release_import(id, sequence);
  } else {
    spdlog::info(
        "instance: request {} cancelled before its KV arrived; its blocks wait for "
        "the transfer",
        id.value);
    releasing_.emplace(id, sequence);
  }
}

void InstanceCore::apply_cancel(RequestId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  cancel_sequence(id, it->second);
}

void InstanceCore::apply_withdrawn(RequestId id) {
  auto it = exports_.find(id);
  if (it == exports_.end()) return;  // handed over already
  engine_->cancel(it->second.sequence);
  exports_.erase(it);
}

void InstanceCore::apply_failed(const ImportFailed& failed) {
  auto it = sequences_.find(failed.id);
  if (it == sequences_.end() || engine_->state(it->second) != SequenceState::kAwaitingKv) return;
  const SequenceId sequence = it->second;
  release_import(failed.id, sequence);
  forget(failed.id, sequence);
  fail(failed.id, failed.error);
}

void InstanceCore::apply_released(RequestId id) {
  auto it = releasing_.find(id);
  if (it == releasing_.end()) return;
  release_import(id, it->second);
  releasing_.erase(it);
}

void InstanceCore::apply_quarantined(RequestId id) {
  // Never released: the engine keeps the sequence, and its blocks, for good.
  SequenceId sequence;
  if (auto it = releasing_.find(id); it != releasing_.end()) {
    sequence = it->second;  // cancelled already: its finish was reported
    releasing_.erase(it);
  } else if (auto live = sequences_.find(id); live != sequences_.end()) {
    sequence = live->second;
    forget(id, sequence);
    fail(id,
         {ServeErrorKind::kUnavailable, "its prefill instance was lost while its KV was arriving"});
  } else {
    return;
  }
  ++n_quarantined_;
  quarantined_blocks_ += engine_->n_kv_blocks_of(sequence);
  spdlog::warn("instance: request {}: {} KV blocks quarantined (a lost rank may still write them)",
               id.value, engine_->n_kv_blocks_of(sequence));
}

void InstanceCore::mirror_step(const ForwardBatch& batch) {
  tp_exports_.clear();
  for (const ForwardBatch::Export& rows : batch.exports) {
    for (const auto& [rid, exported] : exports_) {
      if (exported.sequence != rows.id) continue;
      tp_exports_.push_back({rid, rows.sequence, rows.pos0, rows.n, exported.decode_ranks});
      break;
    }
  }
  options_.tp->step(batch, tp_exports_);
}

void InstanceCore::apply_submit(InstanceRequest& request) {
  const RequestId rid = request.id;
  const RequestOptions options = request_options(request);
  auto on_token = [this, rid](const TokenEvent& e) {
    InstanceEvent event{.id = rid, .token = e.token, .finished = e.finished};
    if (e.finished) {
      event.finish = instance_finish(e.reason);
      forget(rid, e.id);
    }
    events_.push_back(std::move(event));
  };
  try {
    SequenceId sequence;
    if (request.prefill_peer >= 0) {
      InstancePeers* peers = options_.peers;
      DUET_REQUIRE(peers != nullptr,
                   "request {} names prefill instance {}, but this instance has no peers",
                   rid.value, request.prefill_peer);
      // The prefill instance's ranks: known since start-up, or consecutive
      // addresses (an instance that joined).
      std::vector<int32_t> sources;
      for (int32_t k = 0; k < std::max(request.prefill_tp, 1); ++k)
        sources.push_back(request.prefill_peer + k);
      if (auto it = options_.instance_ranks.find(request.prefill_peer);
          it != options_.instance_ranks.end())
        sources = it->second;
      ImportHooks hooks;
      hooks.reserved = [this, request, sources](SequenceId, int64_t cached,
                                                std::span<const int32_t> block_table) {
        PrefillOrder order{request, cached, options_.own_ranks};
        order.request.prefill_peer = -1;
        const TpImport import{request.id,
                              cached,
                              static_cast<int64_t>(request.prompt.size()),
                              {block_table.begin(), block_table.end()},
                              options_.transfer_timeout,
                              sources};
        // The followers know where their rows go before the order leaves.
        if (options_.tp != nullptr) options_.tp->expect_import(import);
        options_.peers->start_import(request.prefill_peer, order, import, engine_->cache());
      };
      hooks.abort = [this, rid, prefill = request.prefill_peer](SequenceId) {
        abort_released_ = options_.peers->abort_import(prefill, rid);
      };
      // Rows from GPUs with a device transfer land in the device pool directly.
      hooks.device_rows = std::all_of(sources.begin(), sources.end(), [peers](int32_t rank) {
        return peers->device_transfer(rank);
      });
      std::vector<int32_t> prompt = request.prompt;
      sequence = engine_->submit_import(std::move(prompt), options, on_token, std::move(hooks));
    } else {
      auto on_admitted = [this, rid](SequenceId, int64_t cached_tokens) {
        events_.push_back(
            {.id = rid, .admitted = true, .cached_tokens = cached_tokens, .admitted_at = now()});
      };
      sequence = engine_->submit(std::move(request.prompt), options, on_token, on_admitted);
    }
    sequences_.emplace(rid, sequence);
    requests_.emplace(sequence, rid);
  } catch (const Error& e) {
    fail(rid, ServeError{ServeErrorKind::kInvalidArgument, e.what()});
  } catch (const std::exception& e) {
    fail(rid, ServeError{ServeErrorKind::kInternal, e.what()});
  }
}

void InstanceCore::apply_done(const ImportDone& done) {
  auto it = sequences_.find(done.id);
  if (it == sequences_.end() || engine_->state(it->second) != SequenceState::kAwaitingKv)
    return;  // cancelled meanwhile
  const SequenceId sequence = it->second;
  if (options_.tp != nullptr && !options_.tp->confirm_import(done.id)) {
    release_import(done.id, sequence);
    forget(done.id, sequence);
    fail(done.id, ServeError{ServeErrorKind::kUnavailable,
                             "KV transfer: a follower rank of this instance did not receive "
                             "all of its KV heads' rows"});
    return;
  }
  // Queueing ended when the prefill side admitted the prompt: place that on
  // this host's clock as "prefill_ns before now".
  const KvHandoff& handoff = done.handoff;
  const auto admitted_at = options_.now ? now() - std::chrono::nanoseconds(handoff.prefill_ns)
                                        : std::chrono::steady_clock::time_point{};
  events_.push_back({.id = done.id,
                     .admitted = true,
                     .cached_tokens = handoff.cached_tokens,
                     .admitted_at = admitted_at});
  engine_->complete_import(sequence, handoff.first_token);
}

void InstanceCore::apply_order(PeerOrder& order) {
  const RequestId rid = order.order.request.id;
  const int32_t peer = order.peer;
  std::vector<int32_t> decode_ranks = order.order.decode_ranks;
  if (decode_ranks.empty()) decode_ranks = {peer};
  InstanceRequest& request = order.order.request;
  RequestOptions options = request_options(request);
  options.max_tokens = 1;  // this side samples the first token only
  InstancePeers* peers = options_.peers;
  ExportSink sink;
  sink.layer = [this, rid](SequenceId, int64_t layer, int64_t pos0, int64_t n,
                           std::span<const int32_t> block_table, const KvCache& cache) {
    Export& exported = exports_.at(rid);
    options_.peers->send_rows(rid, layer, pos0, n, exported.decode_ranks, cache, block_table);
    exported.rows_sent += n;
  };
  sink.done = [this, peer, rid](SequenceId, int32_t first_token, int64_t cached_tokens) {
    auto it = exports_.find(rid);
    const auto prefill = now() - it->second.admitted_at;
    options_.peers->send_handoff(
        peer, KvHandoff{rid, first_token, cached_tokens,
                        std::chrono::duration_cast<std::chrono::nanoseconds>(prefill).count(),
                        it->second.rows_sent, std::nullopt});
    exports_.erase(it);
  };
  // Rows for GPUs with a device transfer leave from the device pool directly.
  sink.device_rows = std::all_of(decode_ranks.begin(), decode_ranks.end(),
                                 [peers](int32_t rank) { return peers->device_transfer(rank); });
  auto on_admitted = [this, rid](SequenceId, int64_t) { exports_.at(rid).admitted_at = now(); };
  try {
    const SequenceId sequence = engine_->submit_export(std::move(request.prompt), options,
                                                       order.order.send_from, sink, on_admitted);
    exports_.emplace(rid, Export{sequence, peer, std::move(decode_ranks), now(), 0});
  } catch (const std::exception& e) {
    peers->send_handoff(
        peer, KvHandoff{rid, -1, 0, 0, 0,
                        ServeError{ServeErrorKind::kInvalidArgument,
                                   std::string("prefill refused the prompt: ") + e.what()}});
  }
}

bool InstanceCore::step() {
  try {
    return engine_->step();
  } catch (const std::exception& e) {
    fail_everything(e.what());
    return true;
  }
}

void InstanceCore::fail_everything(const std::string& what) {
  // A broken invariant in the engine: fail every live request, keep going.
  for (const auto& [rid, sequence] : sequences_) {
    events_.push_back({.id = rid,
                       .finished = true,
                       .finish = InstanceFinish::kFailed,
                       .error = ServeError{ServeErrorKind::kInternal, what}});
  }
  std::vector<std::pair<RequestId, SequenceId>> live(sequences_.begin(), sequences_.end());
  std::vector<InstanceEvent> failed = std::move(events_);
  events_.clear();
  for (const auto& [rid, exported] : exports_) {
    options_.peers->send_handoff(
        exported.peer, KvHandoff{rid, -1, 0, 0, 0, ServeError{ServeErrorKind::kInternal, what}});
    live.emplace_back(RequestId{}, exported.sequence);
  }
  exports_.clear();
  for (const auto& [rid, sequence] : live) {
    try {
      if (requests_.contains(sequence)) {
        cancel_sequence(rid, sequence);  // frees the KV; its events are dropped
      } else {
        engine_->cancel(sequence);
      }
    } catch (const std::exception& cancel_error) {
      spdlog::error("instance: cancel after a failed step failed: {}", cancel_error.what());
    }
  }
  events_ = std::move(failed);
}

InstanceStats InstanceCore::stats() const {
  const EngineStats e = engine_->stats();
  InstanceStats s;
  s.running = engine_->n_running();
  s.waiting = engine_->n_waiting() - n_quarantined_;
  s.kv_blocks_quarantined = quarantined_blocks_;
  s.kv_blocks_total = engine_->n_kv_blocks();
  s.kv_blocks_free = engine_->n_free_kv_blocks();
  s.kv_block_tokens = KvLayout::kDefaultBlockSize;
  s.steps = e.steps;
  s.prompt_tokens = e.prompt_tokens;
  s.prefix_hit_tokens = e.prefix_hit_tokens;
  s.generated_tokens = e.generated_tokens;
  s.preemptions = e.preemptions;
  return s;
}

}  // namespace duet
